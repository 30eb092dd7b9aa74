"""The QK-norm's own parameters as Hessian blocks (``N1`` = query norm, ``N2`` = key norm; closed_form/_qk_norm_blocks).

Every dense block (``dense=True``) and every spectral norm (``EXACT`` Lanczos) against the torch.func reference
(``reference.multi_head_attention_blocks``, which differentiates the attention in the norm's parameters) in float64:
dense blocks to ``TOL["float64"]`` (1e-10) relative, norms to the same (EXACT runs Lanczos to the block size). The
sampled keys against dense ``J^T C J + H_f`` built here; the optimizer-state map of the Qwen3 adapters; the documented
default Lanczos at a realistic size.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from torch.func import jacrev

from curvwatch import find_blocks, reference
from curvwatch.closed_form import (
    AttentionStructure,
    AttentionWeights,
    Lanczos,
    OutputLoss,
    multi_head_attention,
)
from curvwatch.closed_form.attention import ATTENTION_PAIRS, NORM_PAIRS
from curvwatch.closed_form.settings import EXACT
from curvwatch.realloss import RealLoss, sample_outputs
from curvwatch.realloss.stability import param_index_map
from curvwatch.reference.attention import attention_blocked, attention_forward
from tests import zoo
from tests.cases import DT, case_id, rand
from tests.test_attention_modern import _with
from tests.utils import TOL, assert_close_report

_BASE = dict(
    B=2, L=4, d=4, H=4, H_kv=2, d_K=3, d_V=2, m=4, causal=True, mode="grad", pad=False, rotary=None, norm="rmsnorm",
    sides="qk", window=None, scale=None, memory=None,
)  # fmt: skip


def _case(**kw) -> dict:
    unknown = set(kw) - set(_BASE)
    assert not unknown, unknown
    return {**_BASE, **kw}


CASES = [
    _case(),  # GQA, causal, RMSNorm
    _case(B=None, L=1, H=2, H_kv=1, mode="target"),  # L = 1, MQA
    _case(H=4, H_kv=1, pad=True, norm="layernorm", mode="target"),  # MQA, padding, LayerNorm with bias
    _case(H=2, H_kv=2, d_K=4, rotary="half", norm="layernorm_no_bias", causal=False),  # plain MHA, rotary
    _case(B=3, d_K=4, rotary="interleaved", norm="gemma", scale=0.3, window=2, pad=True),  # Gemma's (1 + w)
    _case(B=None, L=5, d_K=4, rotary="half", H_kv=4, mode="target"),  # unbatched, rotary, no grouping
    _case(sides="q", pad=True),  # only the query norm has a weight: N1N1 alone
    _case(sides="k", norm="layernorm", H_kv=1),  # only the key norm has parameters: N2N2 alone
    _case(memory=(3, 5), causal=False, norm="layernorm"),  # cross-attention: keys from the memory
]


def _tables(L: int, r: int):
    pos = torch.arange(L, dtype=DT)[:, None] + 2.0
    f = pos / (10.0 ** (torch.arange(0, r, 2, dtype=DT) / r))
    emb = torch.cat([f, f], dim=-1)  # (L, r), the frequencies' halves duplicated
    return emb.cos(), emb.sin()


def _qk_norm(gen, case) -> dict:
    d_K, norm, sides = case["d_K"], case["norm"], case["sides"]
    kind = "rmsnorm" if norm in ("rmsnorm", "gemma") else "layernorm"
    out = dict(kind=kind, eps=1e-2 if kind == "layernorm" else 1e-3)
    for s in "qk":
        if s in sides:
            out[f"weight_{s}"] = rand(gen, d_K)
            if norm == "layernorm":
                out[f"bias_{s}"] = rand(gen, d_K)
    if norm == "gemma":
        out["weight_offset"] = 1.0
    return out


def _inputs(case: dict, seed: int = 0):
    """``(X, weights, kwargs)`` for :func:`multi_head_attention` and the reference."""
    gen = torch.Generator().manual_seed(seed)
    B, L, d, H, H_kv, d_K, d_V, m = (case[k] for k in ("B", "L", "d", "H", "H_kv", "d_K", "d_V", "m"))
    bs = (B,) if B else ()
    X = rand(gen, *bs, L, d)
    kw: dict = dict(n_heads=H, n_kv_heads=H_kv, causal=case["causal"], qk_norm=_qk_norm(gen, case))
    d_kv = d
    if case["memory"] is not None:
        L_kv, d_kv = case["memory"]
        kw["memory"] = rand(gen, *bs, L_kv, d_kv)
    W = dict(
        W_Q=rand(gen, d, H * d_K), W_K=rand(gen, d_kv, H_kv * d_K), W_V=rand(gen, d_kv, H_kv * d_V),
        W_O=rand(gen, H * d_V, m),
    )  # fmt: skip
    if case["mode"] == "target":
        kw["target"] = rand(gen, *bs, L, m)
    else:
        kw.update(grad_output=rand(gen, *bs, L, m), output_curvature=0.37)
    if case["pad"]:
        kpm = torch.zeros(B or 1, L, dtype=torch.bool)
        kpm[0, -1] = True
        kw["key_padding_mask"] = kpm if B else kpm[0]
    if case["rotary"] is not None:
        kw.update(rotary=_tables(L, d_K), rotary_interleaved=case["rotary"] == "interleaved")
    for name in ("window", "scale"):
        if case[name] is not None:
            kw[name] = case[name]
    return _with(X, AttentionWeights(**W), dict(loss=OutputLoss(), structure=AttentionStructure()), **kw)


def _expected_pairs(case) -> set[str]:
    have = {block for block, side in (("N1", "q"), ("N2", "k")) if side in case["sides"]}
    return {p for p in NORM_PAIRS if {p[:2], p[2:]} <= have}


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_norm_parameter_blocks_match_autograd(case):
    """Dense ``N1N1``, ``N2N2``, ``N1N2`` (outer, functional, hessian) and their EXACT norms against torch.func."""
    X, W, kw = _inputs(case)
    ref = {k: v for k, v in reference.multi_head_attention_blocks(X, W, **kw).items() if "/N" in k}
    out = multi_head_attention(X, W, **kw, dense=True, lanczos=EXACT)
    ref_norms = reference.dense_to_norms(ref)
    assert {k.split("/", 1)[1] for k in ref if k.startswith("hessian/")} == _expected_pairs(case)
    assert {k.split("/", 1)[1] for k in out if k.startswith("hessian/N")} == _expected_pairs(case)
    for key, mat in ref.items():
        assert_close_report(out[f"dense/{key}"], mat, TOL["float64"], name=f"dense/{key}", atol=1e-13)
        assert_close_report(out[key], ref_norms[key], TOL["float64"], name=key, atol=1e-13)
    for pair in _expected_pairs(case) & {"N1N1", "N2N2"}:  # the Gauss-Newton part is PSD
        assert torch.linalg.eigvalsh(out[f"dense/outer/{pair}"]).min() >= -1e-12 * out[f"outer/{pair}"]


def test_the_gauss_newton_part_has_cross_head_terms():
    """``H_o(N1N1)`` is not the sum of the single heads' Gauss-Newton blocks: every head's output moves with ``gamma_q``
    (the cotangents mix all heads through ``W_O``), while ``H_f`` is (each head's second derivative is its own)."""
    case = _case(H=2, H_kv=2)
    X, W, kw = _inputs(case, seed=4)
    cheap = dict(dense=True, lanczos=EXACT, terms=False, pairs=["N1N1"])
    both = multi_head_attention(X, W, **kw, **cheap)
    single = []
    for h in range(2):  # the same model with the other head's output projection zeroed: head h alone
        W_O = W.W_O.clone()
        W_O[(1 - h) * case["d_V"] : (2 - h) * case["d_V"]] = 0
        single.append(multi_head_attention(X, dataclasses.replace(W, W_O=W_O), **kw, **cheap))
    f_sum = single[0]["dense/functional/N1N1"] + single[1]["dense/functional/N1N1"]
    assert_close_report(both["dense/functional/N1N1"], f_sum, TOL["float64"], name="functional", atol=1e-13)
    o_sum = single[0]["dense/outer/N1N1"] + single[1]["dense/outer/N1N1"]
    assert (both["dense/outer/N1N1"] - o_sum).norm() > 1e-3 * o_sum.norm()


@pytest.mark.parametrize(
    "qk_norm",
    [
        None,
        dict(kind="rmsnorm", eps=1e-6),  # Qwen3-style norm with elementwise_affine=False
        dict(kind="layernorm", eps=1e-5),
    ],
    ids=["no-qk-norm", "rmsnorm-no-weight", "layernorm-no-affine"],
)
def test_a_norm_without_parameters_has_no_blocks(qk_norm):
    """No ``N1``/``N2`` key (not even when asked for: the monitor asks every attention block for every pair), and the
    other keys are those of a call that never heard of them, bit for bit."""
    X, W, kw = _inputs(_case())
    W = dataclasses.replace(W, qk_norm=qk_norm)
    out = multi_head_attention(X, W, **kw, dense=True, lanczos=EXACT)
    asked = multi_head_attention(X, W, **kw, dense=True, lanczos=EXACT, pairs=[*ATTENTION_PAIRS, "QKV", *NORM_PAIRS])
    assert not [k for k in out if "/N" in k] and not [k for k in asked if "/N" in k]
    assert set(out) == set(asked) and all(torch.equal(out[k], asked[k]) for k in out)


def test_other_keys_are_bitwise_unchanged_and_pairs_select_the_norm_blocks():
    X, W, kw = _inputs(_case(rotary="half", d_K=4, pad=True))
    short = Lanczos(max_iter=8, warn=False)
    with_norm = multi_head_attention(X, W, **kw, lanczos=short)
    without = multi_head_attention(X, W, **kw, lanczos=short, pairs=[*ATTENTION_PAIRS, "QKV"])
    new = {f"{r}{k}/{p}" for r in ("", "residual/") for k in ("outer", "functional", "hessian") for p in NORM_PAIRS}
    assert set(with_norm) - set(without) == new
    assert all(torch.equal(with_norm[k], without[k]) for k in without)
    only = multi_head_attention(X, W, **kw, lanczos=short, pairs=["N2N2"], parts="outer", terms=False)
    assert sorted(only) == ["outer/N2N2", "residual/outer/N2N2"]
    assert torch.equal(only["outer/N2N2"], with_norm["outer/N2N2"])  # same Lanczos run, same number
    with pytest.raises(ValueError, match="Unknown attention pair 'N3N3'"):
        multi_head_attention(X, W, **kw, pairs=["N3N3"])


# ---- sampled (real-loss) keys ------------------------------------------------------------------------------------

SAMPLED_CASES = [
    _case(pad=True),  # GQA
    _case(H=2, H_kv=2, norm="layernorm", rotary="half", d_K=4),  # LayerNorm: N = [gamma; beta]
    _case(B=None, L=3, H=2, H_kv=1, norm="gemma"),
]


def _sampled_reference(X, W, kw, case, S, P):
    """Dense ``ggn``, ``sharpness`` (and their preconditioned twins) of ``N1N1`` and ``N2N2``, by torch.func."""
    B, L = (case["B"] or 1), case["L"]
    Xb = X.reshape(B, L, -1)
    qk, structure = W.qk_norm, kw["structure"]
    kpm = structure.key_padding_mask
    padded = None if kpm is None else kpm.reshape(B, L)
    blocked, dead = attention_blocked(B, L, L, structure.causal, None, padded, X.device)
    G = kw["loss"].grad_output.reshape(B, L, -1)
    Sb = S.reshape(S.shape[0], B, L, -1)
    keep = torch.ones(B, L, dtype=torch.bool) if padded is None else ~padded
    G, Sb = G * keep[..., None], Sb * keep[..., None]
    out = {}
    for block, side in (("N1", "q"), ("N2", "k")):
        entries = [e for e in ("weight", "bias") if qk.get(f"{e}_{side}") is not None]
        theta0 = torch.stack([qk[f"{e}_{side}"] for e in entries]).reshape(-1)

        def f(theta, entries=entries, side=side):
            norm = {**qk, **{f"{e}_{side}": t for e, t in zip(entries, theta.reshape(len(entries), -1), strict=True)}}
            return attention_forward(Xb, dataclasses.replace(W, qk_norm=norm), blocked, rotary=structure.rotary,
                                     rotary_interleaved=structure.rotary_interleaved, dead=dead)  # fmt: skip

        J = jacrev(f)(theta0)  # (B, L, m, n)
        a = torch.einsum("kblm,blmn->kbn", Sb, J)  # J_b^T s_jb
        ggn = torch.einsum("kbn,kbp->np", a, a) / S.shape[0]
        H_f = torch.func.hessian(lambda t: (G * f(t)).sum())(theta0)
        D = torch.stack([P[f"qk_norm.{e}_{side}"] for e in entries]).reshape(-1).rsqrt()
        for prefix, M in (("", ggn), ("precond_", D[:, None] * ggn * D)):
            out[f"{prefix}ggn/{block}{block}"] = torch.linalg.eigvalsh(M)[-1]
        for prefix, M in (("", ggn + H_f), ("precond_", D[:, None] * (ggn + H_f) * D)):
            out[f"{prefix}sharpness/{block}{block}"] = torch.linalg.eigvalsh((M + M.T) / 2)[-1]
    return out


@pytest.mark.parametrize("case", SAMPLED_CASES, ids=case_id)
def test_sampled_keys_of_the_norm_blocks_match_dense_reference(case):
    """``ggn/N1N1``, ``sharpness/N1N1``, ``precond_...`` (and for N2N2) to 1e-8 relative (EXACT Lanczos against
    eigvalsh), with a preconditioner given by the names the optimizer-state map uses (``"qk_norm.weight_q"``). One
    sample: the keys are the plain Monte-Carlo values (a debiased key needs two halves), so the reference is that
    sample's Gauss-Newton block."""
    X, W, kw = _inputs(case, seed=7)
    gen = torch.Generator().manual_seed(11)
    S = rand(gen, 1, *kw["loss"].grad_output.shape)
    P = {f"qk_norm.{nm}": 0.05 + torch.rand(case["d_K"], generator=gen, dtype=DT) for nm in W.qk_norm
         if nm in ("weight_q", "weight_k", "bias_q", "bias_k")}  # fmt: skip
    _, W, kw = _with(X, W, kw, output_samples=S)
    out = multi_head_attention(X, W, **kw, lanczos=EXACT, terms=False, precondition=P, pairs=["N1N1", "N2N2"])
    expected = _sampled_reference(X, W, kw, case, S, P)
    assert {k for k in out if not k.startswith("residual/")} >= set(expected)
    for key, value in expected.items():
        assert_close_report(out[key], value, 1e-8, name=key, atol=1e-12)


def test_a_partial_preconditioner_leaves_the_block_unpreconditioned():
    """A LayerNorm block is ``[gamma; beta]``: with ``P`` for its weight only there is no ``precond_`` key for it."""
    case = _case(norm="layernorm")
    X, W, kw = _inputs(case)
    S = rand(torch.Generator().manual_seed(1), 2, *kw["loss"].grad_output.shape)
    P = {"qk_norm.weight_q": torch.ones(case["d_K"], dtype=DT), "qk_norm.weight_k": torch.ones(case["d_K"], dtype=DT),
         "qk_norm.bias_k": torch.ones(case["d_K"], dtype=DT)}  # fmt: skip
    _, W, kw = _with(X, W, kw, output_samples=S)
    out = multi_head_attention(X, W, **kw, terms=False, precondition=P, pairs=["N1N1", "N2N2"])
    assert "sharpness/N1N1" in out and "precond_sharpness/N1N1" not in out
    assert torch.allclose(out["precond_sharpness/N2N2"], out["sharpness/N2N2"], rtol=1e-3)  # P = 1
    with pytest.raises(ValueError, match=r"Invalid precondition names \['qk_norm.bias_q'\]"):
        multi_head_attention(X, dataclasses.replace(W, qk_norm={**W.qk_norm, "bias_q": None}), **kw, terms=False,
                             precondition={**P, "qk_norm.bias_q": P["qk_norm.weight_q"]})  # fmt: skip


# ---- adapters: the optimizer-state map -------------------------------------------------------------------------


@pytest.mark.parametrize("build", [lambda: zoo.hf_decoder("qwen3"), lambda: zoo.litgpt_gpt("qwen3")],
                         ids=["hf-qwen3", "litgpt-qwen3"])  # fmt: skip
def test_optimizer_state_map_reads_the_qk_norm_weights(build):
    """``param_index_map`` maps ``qk_norm.weight_q`` / ``weight_k`` onto the norm modules' own weights, element by
    element, next to ``W_Q``... (Adam's ``exp_avg_sq`` then preconditions the ``N1``, ``N2`` blocks)."""
    tiny = build()
    spec = next(s for s in find_blocks(tiny.model) if s.kind == "attention")
    found = param_index_map(spec)
    attn = spec.module
    norms = {"qk_norm.weight_q": getattr(attn, "q_norm", None) or attn.norm_q,
             "qk_norm.weight_k": getattr(attn, "k_norm", None) or attn.norm_k}  # fmt: skip
    assert {"W_Q", "W_K", "W_V", *norms} <= set(found)
    for name, module in norms.items():
        params, index = found[name]
        assert len(params) == 1 and params[0] is module.weight
        assert torch.equal(index, torch.arange(module.weight.numel()))


def test_real_loss_sharpness_and_adam_stability_of_the_norm_blocks_on_qwen3():
    """The whole path on Hugging Face's Qwen3: after one AdamW step, the monitor's engine (1024 sampled output
    gradients) gives ``sharpness/N1N1`` within 15% of ``lambda_max(GGN + own)`` of ``q_norm.weight`` in the real loss
    (torch.func, :func:`~curvwatch.reference.real_loss.real_loss_blocks`), and the optimizer-state map gives
    ``precond_sharpness/N1N1``, ``N2N2`` and their ``stability/...`` ratios."""
    from curvwatch.capture import Capture
    from curvwatch.engine import Engine
    from curvwatch.realloss.logits import find_logits_module
    from curvwatch.realloss.stability import stability_rule
    from curvwatch.reference.real_loss import real_loss_blocks

    tiny = zoo.hf_decoder("qwen3", impl="eager")
    tf = pytest.importorskip("transformers")
    model = tf.Qwen3ForCausalLM(tiny.model.config).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:  # the norm weights off their ones
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    idx = torch.randint(1, zoo.VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))

    def loss_fn(m):
        z = m(input_ids=idx).logits
        return torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), idx.reshape(-1)), z

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn(model)[0].backward()
    opt.step()
    opt.zero_grad()
    specs = find_blocks(model)
    attn = next(s for s in specs if s.kind == "attention")
    rule, why = stability_rule(opt, param_index_map(attn))
    assert why is None and {"qk_norm.weight_q", "qk_norm.weight_k"} <= set(rule.precondition)
    with Capture(specs, max_tokens=100, logits_module=find_logits_module(model)[1]) as cap:
        loss, _ = loss_fn(model)
        sample_outputs(cap, loss, 1024, generator=torch.Generator().manual_seed(0))
        loss.backward()
    engine = Engine(lanczos=Lanczos(tol=1e-8, max_iter=100), dtype="float64", pairs=["N1N1", "N2N2"])
    real_loss = RealLoss()
    evaluation = engine.evaluate(cap.blocks(), precondition=real_loss.preconditioners(opt, cap.blocks()))
    real_loss.finish(evaluation)  # the stability ratios of the optimizer's rule
    result = evaluation.results[attn.name]
    for pair in ("N1N1", "N2N2"):
        for key in (f"sharpness/{pair}", f"precond_sharpness/{pair}", f"stability/{pair}"):
            assert key in result, (key, sorted(result))
        ratio = float(result[f"precond_sharpness/{pair}"]) / rule.threshold
        assert float(result[f"stability/{pair}"]) == pytest.approx(ratio, rel=1e-12)
    r = real_loss_blocks(model, loss_fn, attn, "qk_norm.weight_q")
    target = float(torch.linalg.eigvalsh(r["ggn"] + r["own"])[-1])
    print(f"sharpness/N1N1 {float(result['sharpness/N1N1']):.4g}, torch.func lambda_max(GGN + own) {target:.4g}")
    assert abs(float(result["sharpness/N1N1"]) - target) <= 0.15 * abs(target)


# ---- realistic size --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_norm_blocks_with_the_defaults_at_B4_L128_d256():
    """Default Lanczos (tol 1e-3, at most 100 steps, 16 vectors), 4 heads of 64, Qwen3-style RMSNorm QK-norm: the
    norm blocks converge in a few seconds; their Lanczos vectors are ``d_K = 64`` long (memory: that of a product)."""
    gen = torch.Generator().manual_seed(1)
    X, G = torch.randn(4, 128, 256, generator=gen), torch.randn(4, 128, 256, generator=gen)
    W = [torch.randn(256, 256, generator=gen) / 16 for _ in range(4)]
    qk = dict(kind="rmsnorm", eps=1e-6, weight_q=1 + 0.1 * torch.randn(64, generator=gen),
              weight_k=1 + 0.1 * torch.randn(64, generator=gen))  # fmt: skip
    start = time.perf_counter()
    out = multi_head_attention(
        X,
        AttentionWeights(*W, n_heads=4, qk_norm=qk),
        loss=OutputLoss(grad_output=G),
        structure=AttentionStructure(causal=True),
        pairs=list(NORM_PAIRS),
        terms=False,
    )
    elapsed = time.perf_counter() - start
    residuals = {k: float(v) for k, v in out.items() if k.startswith("residual/")}
    assert len(residuals) == 9 and all(r <= Lanczos().tol for r in residuals.values()), residuals
    assert all(torch.isfinite(v) for v in out.values())
    print(f"N1N1, N2N2, N1N2 (3 kinds each) at B=4, L=128, d=256, H=4: {elapsed:.1f} s")
    assert elapsed < 60
