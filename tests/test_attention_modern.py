"""Attention as modern models compute it: rotary, grouped-query heads, windows, scale, QK-norm, cross-attention.

Every closed form against the torch.func reference (curvwatch.reference) in float64, the reference's forward
against Hugging Face's and litgpt's own attention, the rotary tables against both libraries, the corrected bounds
on random and adversarial instances, and the default Lanczos at a realistic size.
"""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from curvwatch import reference
from curvwatch.closed_form import (
    AttentionStructure,
    AttentionWeights,
    Lanczos,
    OutputLoss,
    multi_head_attention,
    self_attention,
)
from curvwatch.closed_form import attention as attention_module
from curvwatch.closed_form.attention import GROUP_PAIRS, QUERY_PAIRS
from curvwatch.closed_form.attention import kernels as kernels_module
from curvwatch.closed_form.masks import attention_masks
from curvwatch.closed_form.rotary import apply_rotary, check_rotary
from curvwatch.closed_form.settings import EXACT
from curvwatch.closed_form.solver import plan
from curvwatch.reference.attention import attention_blocked, attention_forward
from tests.cases import DT, case_id, rand
from tests.utils import TOL, assert_close_report

# ---- cases ---------------------------------------------------------------------------------------------------

_BASE = dict(
    B=2, L=4, d=4, H=4, H_kv=2, d_K=2, d_V=2, m=4, causal=True, mode="grad", bias=False, pad=False, window=None,
    scale=None, rotary=None, r=None, rot_batched=False, qk_norm=None, memory=None, mem_pad=None,
)  # fmt: skip


def _case(**kw) -> dict:
    unknown = set(kw) - set(_BASE)
    assert not unknown, unknown
    return {**_BASE, **kw}


MODERN_CASES = [
    # grouped-query and multi-query attention
    _case(),
    _case(B=None, L=3, d=3, H=4, H_kv=1, d_V=3, m=5, causal=False, mode="target", bias=True),
    _case(B=None, L=1, d=3, H=2, H_kv=1, mode="target"),  # L = 1
    _case(H=3, H_kv=3, d_K=1, pad=True),  # H_kv = H through n_kv_heads
    # rotary: half-split and interleaved, full and partial, (L, r) and (B, L, r) tables
    _case(d_K=4, rotary="half", r=4, bias=True),
    _case(d_K=4, H=2, H_kv=1, rotary="half", r=2, rot_batched=True, mode="target", pad=True),
    _case(d_K=4, H=2, H_kv=2, rotary="interleaved", r=4, causal=False),
    _case(B=None, L=5, d_K=4, rotary="interleaved", r=2, rot_batched=True, H_kv=1),
    # masks and scale
    _case(window=2, pad=True, mode="target"),
    _case(B=None, L=5, window=2, causal=False, H=2, H_kv=2),
    _case(scale=1.0, window=1, H_kv=1),
    # QK-norm (RMSNorm, LayerNorm, Gemma's (1 + w) with its own scale)
    _case(d_K=4, qk_norm="rmsnorm", rotary="half", r=4),
    _case(d_K=3, H=2, H_kv=1, qk_norm="layernorm", mode="target", bias=True, pad=True),
    _case(d_K=4, qk_norm="gemma", scale=0.3, window=3, rotary="interleaved", r=2, causal=True),
    # cross-attention (L_kv != L, d_kv != d)
    _case(memory=(3, 5), causal=False, mem_pad="some"),
    _case(B=2, L=3, memory=(6, 3), H=2, H_kv=1, mode="target", pad=True, mem_pad="one_sequence_empty"),
    _case(B=None, L=4, memory=(2, 3), H=2, H_kv=2, causal=True, window=2, bias=True),
]


def _tables(gen, B: int, L: int, r: int, batched: bool, scaling: float = 1.0):
    """LLaMA-style ``(cos, sin)`` with the frequencies' halves duplicated; batched tables start at random offsets."""
    n = B if batched else 1
    pos = torch.arange(L, dtype=DT)[None] + torch.randint(0, 7, (n, 1), generator=gen).to(DT)  # (n, L)
    inv = 1.0 / (10.0 ** (torch.arange(0, r, 2, dtype=DT) / r))
    f = pos[..., None] * inv
    emb = torch.cat([f, f], dim=-1)  # (n, L, r)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return (cos, sin) if batched else (cos[0], sin[0])


def _qk_norm(gen, kind: str, d_K: int) -> dict:
    if kind == "rmsnorm":
        return dict(kind="rmsnorm", eps=1e-3, weight_q=rand(gen, d_K), weight_k=rand(gen, d_K))
    if kind == "gemma":
        return dict(
            kind="rmsnorm", eps=1e-6, weight_q=rand(gen, d_K), weight_k=rand(gen, d_K), weight_offset=1.0
        )  # fmt: skip
    return dict(
        kind="layernorm", eps=1e-2, weight_q=rand(gen, d_K), weight_k=rand(gen, d_K),
        bias_q=rand(gen, d_K), bias_k=rand(gen, d_K),
    )  # fmt: skip


def _inputs(case: dict, seed: int = 0):
    """``(X, weights, kwargs)`` for :func:`multi_head_attention` and the reference (``loss``, ``structure``)."""
    gen = torch.Generator().manual_seed(seed)
    B, L, d, H, H_kv = case["B"], case["L"], case["d"], case["H"], case["H_kv"]
    d_K, d_V, m = case["d_K"], case["d_V"], case["m"]
    bs = (B,) if B else ()
    Bn = B or 1
    X = rand(gen, *bs, L, d)
    kw: dict = dict(n_heads=H, n_kv_heads=H_kv, causal=case["causal"])  # the fields of every group, grouped below
    d_kv = d
    if case["memory"] is not None:
        L_kv, d_kv = case["memory"]
        kw["memory"] = rand(gen, *bs, L_kv, d_kv)
        if case["mem_pad"] is not None:
            mpm = torch.zeros(Bn, L_kv, dtype=torch.bool)
            mpm[0, -1] = True
            if case["mem_pad"] == "one_sequence_empty":
                mpm[-1] = True  # every key of the last sequence is padded: its queries see nothing
            kw["memory_padding_mask"] = mpm if B else mpm[0]
    W = dict(
        W_Q=rand(gen, d, H * d_K), W_K=rand(gen, d_kv, H_kv * d_K), W_V=rand(gen, d_kv, H_kv * d_V),
        W_O=rand(gen, H * d_V, m),
    )  # fmt: skip
    if case["bias"]:
        W.update(b_Q=rand(gen, H * d_K), b_K=rand(gen, H_kv * d_K), b_V=rand(gen, H_kv * d_V), b_O=rand(gen, m))
    if case["mode"] == "target":
        kw["target"] = rand(gen, *bs, L, m)
    else:
        kw.update(grad_output=rand(gen, *bs, L, m), output_curvature=0.37)
    if case["pad"]:
        kpm = torch.zeros(Bn, L, dtype=torch.bool)
        kpm[0, -1] = True
        kw["key_padding_mask"] = kpm if B else kpm[0]
    if case["window"] is not None:
        kw["window"] = case["window"]
    if case["scale"] is not None:
        kw["scale"] = case["scale"]
    if case["rotary"] is not None:
        kw["rotary"] = _tables(gen, Bn, L, case["r"], case["rot_batched"])
        kw["rotary_interleaved"] = case["rotary"] == "interleaved"
    if case["qk_norm"] is not None:
        kw["qk_norm"] = _qk_norm(gen, case["qk_norm"], d_K)
    return _with(X, AttentionWeights(**W, n_heads=H), dict(loss=OutputLoss(), structure=AttentionStructure()), **kw)


def _with(X, weights: AttentionWeights, kw: dict, **fields):
    """``(X, weights, kw)`` with ``fields`` (of any of the groups) replaced in the group that holds them: the weights,
    or ``kw``'s ``loss`` and ``structure``."""
    groups = {"weights": weights, **kw}
    for name, group in groups.items():
        own = {f.name for f in dataclasses.fields(group)}
        groups[name] = dataclasses.replace(group, **{k: v for k, v in fields.items() if k in own})
    unknown = set(fields) - {f.name for group in groups.values() for f in dataclasses.fields(group)}
    assert not unknown, unknown
    weights = groups.pop("weights")
    return X, weights, groups


# ---- closed forms against torch.func ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", MODERN_CASES, ids=case_id)
def test_modern_attention_matches_autograd(case):
    """Every dense block (``dense=True``) to 1e-10 and every spectral norm (``EXACT``) against the reference."""
    X, W, kw = _inputs(case)
    ref = reference.multi_head_attention_blocks(X, W, **kw)
    out = multi_head_attention(X, W, **kw, dense=True, lanczos=EXACT)
    ref_norms = reference.dense_to_norms(ref)
    for key, mat in ref.items():
        assert_close_report(out[f"dense/{key}"], mat, TOL["float64"], name=f"dense/{key}", atol=1e-13)
        assert_close_report(out[key], ref_norms[key], TOL["float64"], name=key, atol=1e-13)
    G = case["H"] // case["H_kv"]
    unit = "h" if G == 1 else "g"
    expected = {f"{p}/h{i}" for p in QUERY_PAIRS for i in range(case["H"])}
    expected |= {f"{p}/{unit}{j}" for p in (*GROUP_PAIRS, "QKV") for j in range(case["H_kv"])}
    if case["qk_norm"] is not None:  # the norm's own parameters (tests/test_qk_norm_blocks.py)
        expected |= {"N1N1", "N2N2", "N1N2"}
    assert {k.split("/", 1)[1] for k in ref if k.startswith("hessian/")} == expected
    assert {k.split("/", 1)[1] for k in out if k.startswith("hessian/")} == expected


SINGLE_HEAD_CASES = [
    _case(H=1, H_kv=1, d_K=4, m=2, rotary="half", r=4),
    _case(B=None, L=1, H=1, H_kv=1, m=2, mode="target"),  # L = 1
    _case(H=1, H_kv=1, m=2, window=2, pad=True, mode="target", scale=0.7),
    _case(H=1, H_kv=1, d_K=4, m=2, qk_norm="rmsnorm", rotary="interleaved", r=2, rot_batched=True),
    _case(H=1, H_kv=1, d_K=3, m=2, qk_norm="layernorm", causal=False, pad=True),
]


@pytest.mark.parametrize("case", SINGLE_HEAD_CASES, ids=case_id)
def test_single_head_self_attention_takes_the_modern_options(case):
    """``self_attention`` (one head, no ``W_O``) with rotary, window, scale and QK-norm: every dense block and norm
    against the torch.func reference of that head with ``W_O = I`` (the same function), to 1e-10."""
    X, W, kw = _inputs(case)
    one = AttentionWeights(W.W_Q, W.W_K, W.W_V, qk_norm=W.qk_norm)
    eye = torch.eye(case["d_V"], dtype=DT)
    ref = reference.multi_head_attention_blocks(X, dataclasses.replace(one, W_O=eye), **kw)
    out = self_attention(X, one, **kw, dense=True, lanczos=EXACT)
    ref_norms = reference.dense_to_norms(ref)
    for key, mat in ref.items():
        mine = key.removesuffix("/h0")  # one head: no head suffix
        assert_close_report(out[f"dense/{mine}"], mat, TOL["float64"], name=f"dense/{mine}", atol=1e-13)
        assert_close_report(out[mine], ref_norms[key], TOL["float64"], name=mine, atol=1e-13)
    assert {k.removesuffix("/h0") for k in ref} == {k.removeprefix("dense/") for k in out if k.startswith("dense/")}


def test_grouped_query_blocks_collect_every_query_head_of_the_group():
    """The functional ``KK/g0``, ``VK/g0`` are the sums of the group's two query heads' terms (each computed by a model
    in which that head alone reads the group), and the per-head ``QK/h1`` is head 1's own."""
    X, W, kw = _inputs(_case(H=4, H_kv=2, mode="grad"), seed=3)
    cheap = dict(dense=True, lanczos=EXACT, terms=False, pairs=["KK"], parts="functional")  # the dense blocks matter
    out = multi_head_attention(X, W, **kw, **cheap)
    alone = []
    for heads in ([0, 2], [1, 3]):  # one query head per group, the same kv heads
        cols = [c for h in heads for c in (2 * h, 2 * h + 1)]  # d_K = d_V = 2
        W1 = dataclasses.replace(W, W_Q=W.W_Q[:, cols], W_O=W.W_O[cols], n_heads=2, n_kv_heads=2)
        alone.append(multi_head_attention(X, W1, **kw, **cheap))
    for pair in ("KK", "VK"):
        total = alone[0][f"dense/functional/{pair}/h0"] + alone[1][f"dense/functional/{pair}/h0"]
        assert_close_report(out[f"dense/functional/{pair}/g0"], total, TOL["float64"], name=pair, atol=1e-13)
        assert (out[f"dense/functional/{pair}/g0"] - alone[0][f"dense/functional/{pair}/h0"]).norm() > 1e-3
    own = alone[1]["dense/functional/QK/h0"]
    assert_close_report(out["dense/functional/QK/h1"], own, TOL["float64"], name="QK/h1", atol=1e-13)


def test_grouped_query_views_runs_are_solved_together_with_the_values_of_one_run_at_a_time(monkeypatch):
    """With ``G > 1`` the Lanczos runs of the query view (``QQ``, ``VQ``, ``QK`` per query head) and of the group view
    (``KK``, ``VK`` per kv group) go to one ``solve`` (their stopping tests share host reads), where the runs of one
    vector size are one run (``plan._made``: the views' head counts differ, so a flat run of their members): the same
    keys as one solve per run (float64, tight Lanczos; the stopping tests fall on the same steps)."""
    X, W, kw = _inputs(_case(H=4, H_kv=2, mode="grad", rotary="half", r=2), seed=3)
    solves = []
    inner = plan.solve
    monkeypatch.setattr(plan, "solve", lambda runs: solves.append(len(runs)) or inner(runs))
    tight = dict(lanczos=Lanczos(tol=1e-10, max_iter=400), terms=False, parts=("outer", "functional", "hessian"))
    pairs = ["QQ", "KK", "VQ", "VK", "QK"]
    together = multi_head_attention(X, W, **kw, **tight, pairs=pairs)
    assert len(solves) == 1, solves  # one solve: both views' runs

    inner_plan = plan.spectral_plan

    def one_run_at_a_time(*args, **kwargs):
        return dataclasses.replace(inner_plan(*args, **kwargs), together=False, merge=False)

    monkeypatch.setattr(kernels_module, "spectral_plan", one_run_at_a_time)
    solves.clear()
    apart = multi_head_attention(X, W, **kw, **tight, pairs=pairs)
    assert solves == [1] * len(solves) and len(solves) >= 4, solves
    assert set(together) == set(apart) and any(k.endswith("/g1") for k in apart)
    for key, value in apart.items():
        if not key.startswith("residual/"):
            assert_close_report(together[key], value, 1e-8, name=key)


@pytest.mark.parametrize("H_kv", [4, 2], ids=["G1", "GQA"])
def test_the_vv_run_joins_the_kernels_solve_with_the_values_of_a_solve_of_its_own(H_kv, monkeypatch):
    """The ``VV`` norm's Lanczos run (``G = 1``: the ``d x d`` Gram's ``lambda_max``, by Lanczos for ``d > 256``, forced
    here; ``G > 1``: the grouped outer part) joins the kernel's one ``solve`` with its other runs (their stopping tests
    share host reads; a solve of its own before them costs the LLaMA-style 2-layer benchmark 6 reads per layer in a
    chain with the others' 7; grouped-query, it is merged into their run); with ``solve_bytes=0`` it is solved alone,
    with the same keys (float64, tight Lanczos)."""
    monkeypatch.setattr(attention_module.AttentionOperator, "vv_exact", staticmethod(lambda d, max_iter: False))
    X, W, kw = _inputs(_case(H=4, H_kv=H_kv, mode="grad", rotary="half", r=2), seed=3)
    solves = []
    inner = plan.solve
    monkeypatch.setattr(plan, "solve", lambda runs: solves.append(len(runs)) or inner(runs))
    pairs = ["VV", "QQ", "KK"]

    def keys(solve_bytes):
        solves.clear()
        lanczos = Lanczos(tol=1e-10, max_iter=400, solve_bytes=solve_bytes)
        return multi_head_attention(X, W, **kw, lanczos=lanczos, terms=False, pairs=pairs)

    together = keys(None)
    # the VV run with the others in one solve: G = 1 its Gram run (vectors of d numbers) beside theirs; grouped-query
    # its vectors have the QQ and KK runs' size and it is one run with them (plan._made)
    assert len(solves) == 1 and solves[0] >= 2 if H_kv == 4 else solves == [1], solves
    apart = keys(0)
    assert len(solves) >= 2 and solves[0] == 1, solves  # the VV run first, alone
    assert set(together) == set(apart) and any("VV" in k for k in apart)
    for key, value in apart.items():
        if not key.startswith("residual/"):
            assert_close_report(together[key], value, 1e-8, name=key)


def test_products_over_the_live_members_give_the_norms_of_the_full_products(monkeypatch):
    """A Lanczos product computes only its live members (the heads with one, or the live members packed into the heads
    of one row: ``AttentionOperator.apply_masked``, forced here on a model below the size where it pays): the norms
    of every pair and part as with the full products (float64, tight Lanczos; the products differ in their rounding
    only, so the runs agree to their tolerance)."""
    from curvwatch.closed_form.attention import operator as attention_operator

    X, W, kw = _inputs(_case(L=6, d=6, d_K=3, d_V=3, H=4, H_kv=4, rotary="half", r=2), seed=3)
    tight = dict(lanczos=Lanczos(tol=1e-10, max_iter=400), terms=False, parts=("outer", "functional", "hessian"))
    pairs = ["QQ", "KK", "VV", "VQ", "VK", "QK"]
    monkeypatch.setattr(attention_operator, "HEADS_VIEW_MIN", math.inf)
    full = multi_head_attention(X, W, **kw, **tight, pairs=pairs)
    packed = []
    inner = attention_operator.AttentionOperator._apply_packed
    monkeypatch.setattr(attention_operator.AttentionOperator, "_apply_packed",
                        lambda self, t, *a: packed.append((len(a[-1]), next(iter(t.values())).shape[:2].numel()))
                        or inner(self, t, *a))  # fmt: skip
    monkeypatch.setattr(attention_operator, "HEADS_VIEW_MIN", 0)
    live = multi_head_attention(X, W, **kw, **tight, pairs=pairs)
    assert packed and all(slots < members for slots, members in packed), packed  # the live members alone
    assert set(live) == set(full)
    for key, value in full.items():
        if not key.startswith("residual/"):
            assert_close_report(live[key], value, 1e-8, name=key)


def _modern_kwargs() -> tuple:
    X, W, kw = _inputs(_case(d_K=4, rotary="half", r=4, window=3, pad=True, H=4, H_kv=4), seed=5)
    return X, W, kw


def test_n_kv_heads_equal_to_n_heads_is_bit_identical():
    X, W, kw = _modern_kwargs()
    a = multi_head_attention(X, W, **kw, dense=True, lanczos=EXACT)
    W = dataclasses.replace(W, n_kv_heads=None)
    b = multi_head_attention(X, W, **kw, dense=True, lanczos=EXACT)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    c = multi_head_attention(X, W, **kw)  # the default Lanczos too
    e = multi_head_attention(X, dataclasses.replace(W, n_kv_heads=W.n_heads), **kw)
    assert set(c) == set(e) and all(torch.equal(c[k], e[k]) for k in c)


def test_identity_rotary_and_full_window_are_bit_identical_to_none():
    """``cos = 1, sin = 0`` is the identity exactly, and a window as long as the sequence masks nothing more."""
    X, W, kw = _inputs(_case(d_K=4, H=2, H_kv=1, pad=True, mode="target"), seed=6)
    short = Lanczos(max_iter=6, warn=False)  # bit-identity holds for any (deterministic) settings
    base = multi_head_attention(X, W, **kw, dense=True, lanczos=short)
    L = X.shape[-2]
    for extra in (
        dict(rotary=(torch.ones(L, 4, dtype=DT), torch.zeros(L, 4, dtype=DT))),
        dict(rotary=(torch.ones(L, 2, dtype=DT), torch.zeros(L, 2, dtype=DT)), rotary_interleaved=True),
        dict(window=L),
    ):
        _, We, kwe = _with(X, W, kw, **extra)
        out = multi_head_attention(X, We, **kwe, dense=True, lanczos=short)
        assert set(out) == set(base)
        bad = [k for k in base if not torch.equal(out[k], base[k])]
        assert not bad, (extra.keys(), bad[:5])


def test_cross_attention_on_its_own_input_is_self_attention():
    X, W, kw = _inputs(_case(B=2, L=4, H=2, H_kv=1, mode="target"), seed=7)
    self_out = multi_head_attention(X, W, **kw, dense=True, lanczos=EXACT)
    _, Wc, kwc = _with(X, W, kw, memory=X)
    cross = multi_head_attention(X, Wc, **kwc, dense=True, lanczos=EXACT)
    assert "term/memory_norm" in cross and "term/memory_norm" not in self_out
    assert_close_report(cross["term/memory_norm"], cross["term/x_norm"], 1e-14, name="memory_norm")
    for key, v in self_out.items():
        assert_close_report(cross[key], v, TOL["float64"], name=key, atol=1e-13)


def test_query_that_sees_no_key_has_zero_attention_and_no_curvature():
    """Cross-attention whose memory is all padded for one sequence: those queries add nothing (and no NaN)."""
    case = _case(B=2, L=3, memory=(4, 3), H=2, H_kv=1, mode="grad", mem_pad="one_sequence_empty")
    X, W, kw = _inputs(case, seed=8)
    out = multi_head_attention(X, W, **kw, dense=True, lanczos=EXACT)
    structure, loss = kw["structure"], kw["loss"]
    first = dict(memory=structure.memory[:1], memory_padding_mask=structure.memory_padding_mask[:1],
                 grad_output=loss.grad_output[:1])  # fmt: skip
    _, W1, kw1 = _with(X[:1], W, kw, **first)
    one = multi_head_attention(X[:1], W1, **kw1, dense=True, lanczos=EXACT)
    for key in ("dense/hessian/QKV/g0", "dense/outer/VQ/h1", "dense/functional/QK/h0"):
        assert torch.isfinite(out[key]).all()
        assert_close_report(out[key], one[key], TOL["float64"], name=key, atol=1e-13)


# ---- masks --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_window_mask_is_the_documented_one(causal):
    L, w = 7, 3
    keep, _, _ = attention_masks(1, L, L, causal, w, None, None, False, "cpu")
    expected = torch.tensor(
        [[(i - w < j <= i) if causal else abs(i - j) < w for j in range(L)] for i in range(L)], dtype=torch.bool
    )
    assert torch.equal(keep[0], expected)
    blocked, dead = attention_blocked(1, L, L, causal, w, None, "cpu")
    assert torch.equal(~blocked[0], expected) and not dead.any()


# ---- rotary against Hugging Face and litgpt ------------------------------------------------------------------


def test_rotary_matches_hugging_face_llama_neox_and_gptj():
    from transformers import LlamaConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
    from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(10)
    B, H, L, d_K = 2, 3, 6, 8
    q, k = rand(gen, B, H, L, d_K), rand(gen, B, H, L, d_K)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    config = LlamaConfig(hidden_size=H * d_K, num_attention_heads=H, head_dim=d_K, max_position_embeddings=32)
    cos, sin = LlamaRotaryEmbedding(config).to(DT)(q, position_ids)  # (B, L, d_K), the halves duplicated
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    rot = check_rotary((cos, sin), False, B, L, d_K, q)  # the tables as the kernel takes them
    assert_close_report(rot(q), q_hf, 1e-15, name="llama q")
    assert_close_report(apply_rotary(k, cos[:, None], sin[:, None]), k_hf, 1e-15, name="llama k")
    # partial rotary (NeoX / pythia): tables of r = 4 < d_K columns rotate the first 4 dims only
    small = LlamaConfig(hidden_size=H * 4, num_attention_heads=H, head_dim=4, max_position_embeddings=32)
    cos4, sin4 = LlamaRotaryEmbedding(small).to(DT)(q, position_ids)
    q_neox, _ = neox_rope(q, k, cos4, sin4)
    partial = check_rotary((cos4, sin4), False, B, L, d_K, q)
    assert_close_report(partial(q), q_neox, 1e-15, name="neox")
    # interleaved (GPT-J): its sin/cos tables hold one column per frequency, repeated in pairs inside
    sincos = create_sinusoidal_positions(16, 4).to(DT)[position_ids]  # (B, L, 4) = [sin | cos], r = 4
    s_half, c_half = sincos.chunk(2, dim=-1)
    q_gptj = gptj_rope(q[..., :4].transpose(1, 2), s_half, c_half).transpose(1, 2)  # GPT-J is (B, L, H, r)
    c4, s4 = torch.cat([c_half, c_half], -1), torch.cat([s_half, s_half], -1)
    mine = check_rotary((c4, s4), True, B, L, d_K, q)(q)
    assert_close_report(mine[..., :4], q_gptj, 1e-15, name="gptj")
    assert torch.equal(mine[..., 4:], q[..., 4:])


def test_rotary_matches_litgpt_apply_rope_and_its_interleaved_layout():
    from litgpt.model import apply_rope, apply_rope_interleave, build_rope_cache

    gen = torch.Generator().manual_seed(11)
    B, H, L, d_K, r = 2, 2, 5, 6, 4
    q, k = rand(gen, B, H, L, d_K), rand(gen, B, H, L, d_K)
    cos, sin = (t.to(DT) for t in build_rope_cache(L, r))  # (L, r), the halves duplicated
    half = check_rotary((cos, sin), False, B, L, d_K, q)
    lit = torch.cat([apply_rope(q[..., :r], cos[None], sin[None]), q[..., r:]], dim=-1)
    assert_close_report(half(q), lit, 1e-15, name="litgpt apply_rope")
    # litgpt's interleaved variant returns the rotated pairs regrouped [even | odd]: the same logits q_rot k_rot^T
    inter = check_rotary((cos, sin), True, B, L, d_K, q)
    lq, lk = (apply_rope_interleave(t[..., :r], cos[None], sin[None]) for t in (q, k))
    mq, mk = inter(q)[..., :r], inter(k)[..., :r]
    assert_close_report(torch.cat([mq[..., 0::2], mq[..., 1::2]], -1), lq, 1e-15, name="litgpt interleave")
    assert_close_report(mq @ mk.mT, lq @ lk.mT, 1e-14, name="litgpt logits")


def test_rotary_transpose_is_the_adjoint():
    gen = torch.Generator().manual_seed(12)
    x, y = rand(gen, 2, 3, 5, 6), rand(gen, 2, 3, 5, 6)
    cos, sin = _tables(gen, 2, 5, 4, batched=True, scaling=1.3)  # not a rotation: YaRN-like scaling
    cos, sin = cos[:, None], sin[:, None]
    for interleaved in (False, True):
        lhs = (apply_rotary(x, cos, sin, interleaved) * y).sum()
        rhs = (x * apply_rotary(y, cos, sin, interleaved, transpose=True)).sum()
        assert_close_report(lhs, rhs, 1e-14, name=f"adjoint interleaved={interleaved}")


def test_the_rotary_maps_call_is_apply_rotary():
    """:class:`~curvwatch.closed_form.rotary.Rotary` applies ``R`` (and ``R^T``) from its per-feature tables, a
    partner permutation and a signed sine, as :func:`apply_rotary` does: both layouts, full and partial rotary,
    per-sequence tables, scaled (non-rotation) tables."""
    gen = torch.Generator().manual_seed(13)
    B, H, L = 2, 3, 5
    for d_K, r in ((6, 6), (8, 4), (6, 2)):
        for batched in (False, True):
            cos, sin = _tables(gen, B, L, r, batched=batched, scaling=1.3)
            for interleaved in (False, True):
                rot = check_rotary((cos, sin), interleaved, B, L, d_K, rand(gen, B, L, 4))
                x = rand(gen, B, H, L, d_K)
                for transpose in (False, True):
                    assert_close_report(rot(x, transpose), apply_rotary(x, rot.cos, rot.sin, interleaved, transpose),
                                        1e-15, name=f"{d_K} {r} {batched} {interleaved} {transpose}")  # fmt: skip


# ---- the reference against the libraries' own attention --------------------------------------------------------


def test_reference_forward_matches_hugging_face_qwen3_attention():
    """GQA + per-head RMSNorm QK-norm before rotary + causal mask: the reference reads Qwen3 as Hugging Face runs it.

    Hugging Face computes the norm and the rotary tables in float32, hence the 1e-5 tolerance; getting the order
    (norm, then rotary), the kv-head sharing or the scale wrong moves the output by O(1).
    """
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    torch.manual_seed(13)
    H, H_kv, d_K, B, L = 4, 2, 4, 2, 5
    cfg = Qwen3Config(hidden_size=8, num_attention_heads=H, num_key_value_heads=H_kv, head_dim=d_K, rms_norm_eps=1e-3)
    cfg._attn_implementation = "eager"
    att = Qwen3Attention(cfg, layer_idx=0).to(DT)
    with torch.no_grad():
        for p in att.parameters():
            p.normal_()
    x = torch.randn(B, L, 8, dtype=DT)
    cos, sin = Qwen3RotaryEmbedding(cfg).to(DT)(x, torch.arange(L)[None].expand(B, L))
    mask = torch.full((L, L), float("-inf"), dtype=DT).triu(1).expand(B, 1, L, L)
    with torch.no_grad():
        expected, _ = att(x, (cos, sin), mask)
    blocked, dead = attention_blocked(B, L, L, True, None, None, x.device)
    qk = dict(kind="rmsnorm", eps=1e-3, weight_q=att.q_norm.weight.detach(), weight_k=att.k_norm.weight.detach())
    Ws = [lin.weight.detach().T for lin in (att.q_proj, att.k_proj, att.v_proj, att.o_proj)]
    weights = AttentionWeights(*Ws, n_heads=H, n_kv_heads=H_kv, qk_norm=qk)
    got = attention_forward(x, weights, blocked, rotary=(cos, sin), dead=dead)
    assert_close_report(got, expected, 1e-5, name="qwen3")
    no_norm = dataclasses.replace(weights, qk_norm=None)
    wrong = attention_forward(x, no_norm, blocked, rotary=(cos, sin), dead=dead)
    assert (wrong - expected).norm() > 1e-2 * expected.norm()


def test_reference_forward_matches_litgpt_attention():
    """litgpt's CausalSelfAttention with query groups, QK-norm, partial rotary, a sliding window and its own scale."""
    from litgpt.config import Config
    from litgpt.model import CausalSelfAttention, build_rope_cache

    torch.manual_seed(14)
    H, H_kv, d_K, B, L, w = 4, 2, 4, 2, 6, 3
    cfg = Config(
        n_embd=8, n_head=H, n_query_groups=H_kv, head_size=d_K, rotary_percentage=0.5, norm_qk=True, bias=False,
        block_size=16, norm_class_name="RMSNorm", norm_eps=1e-3, n_layer=1, sliding_window_size=w,
        sliding_window_indices=[1], attention_scores_scalar=2,
    )  # fmt: skip
    att = CausalSelfAttention(cfg, block_idx=0).to(DT)
    with torch.no_grad():
        for p in att.parameters():
            p.normal_()
    x = torch.randn(B, L, 8, dtype=DT)
    cos, sin = (t.to(DT) for t in build_rope_cache(L, cfg.rope_n_elem))  # (L, 2): partial rotary
    with torch.no_grad():
        expected = att(x, cos[None], sin[None])
    Wq, Wk, Wv = att.qkv.weight.detach().T.split([H * d_K, H_kv * d_K, H_kv * d_K], dim=1)
    blocked, dead = attention_blocked(B, L, L, True, w, None, x.device)
    qk = dict(kind="rmsnorm", eps=1e-3, weight_q=att.norm_q.weight.detach(), weight_k=att.norm_k.weight.detach())
    weights = AttentionWeights(Wq, Wk, Wv, att.proj.weight.detach().T, n_heads=H, n_kv_heads=H_kv, qk_norm=qk)
    got = attention_forward(x, weights, blocked, rotary=(cos, sin), scale=1 / math.sqrt(2), dead=dead)
    assert_close_report(got, expected, 1e-5, name="litgpt")


# ---- bounds ---------------------------------------------------------------------------------------------------


def _n_bounds(H: int, H_kv: int) -> int:
    """``bound/...`` keys: 19 per head, or 9 per query head (QQ, VQ, QK) and 10 per group (VV, KK, VK, QKV)."""
    return 19 * H if H == H_kv else 9 * H + 10 * H_kv


def _assert_bounds_hold(out: dict, rtol: float, expected: int) -> None:
    """Every ``bound/...`` key is >= its measured norm (outer, functional or total); ``expected`` keys."""
    n = 0
    for key, bound in out.items():
        if not key.startswith("bound/"):
            continue
        name = key[len("bound/") :]
        value = out[name] if name.startswith(("outer/", "functional/")) else out[f"hessian/{name}"]
        assert value <= bound * (1 + rtol), (key, float(value), float(bound))
        n += 1
    assert n == expected, n


BOUND_CASES = [
    _case(H=4, H_kv=2),
    _case(H=4, H_kv=1, mode="target", pad=True, bias=True),
    _case(d_K=4, rotary="half", r=4, H_kv=2, window=2),
    _case(d_K=4, rotary="interleaved", r=2, rot_batched=True, H=2, H_kv=2, causal=False),
    _case(scale=3.0, H_kv=2, mode="target"),
    _case(scale=0.05, H=3, H_kv=1),
    _case(memory=(5, 3), causal=False, mem_pad="some", H_kv=2),
    _case(memory=(3, 6), causal=True, H=2, H_kv=2, mode="target", pad=True),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", BOUND_CASES, ids=case_id)
def test_corrected_bounds_hold_in_the_modern_settings(case, seed):
    X, W, kw = _inputs(case, seed=200 + seed)
    X = X * [0.3, 1.0, 3.0][seed]  # small, moderate and saturated softmax
    if kw["structure"].memory is not None:
        _, W, kw = _with(X, W, kw, memory=kw["structure"].memory * [3.0, 0.3, 1.0][seed])
    out = multi_head_attention(X, W, **kw, lanczos=EXACT)
    _assert_bounds_hold(out, rtol=1e-10, expected=_n_bounds(case["H"], case["H_kv"]))


def test_bounds_hold_with_non_orthogonal_rotary_tables():
    """YaRN-style tables scaled by 1.6: ``R`` stretches ``P`` and ``K``, the bounds follow through ``max ||R_i||``."""
    X, W, kw = _inputs(_case(d_K=4, rotary="half", r=4, H_kv=2), seed=15)
    gen = torch.Generator().manual_seed(15)
    _, W, kw = _with(X, W, kw, rotary=_tables(gen, 2, 4, 4, batched=False, scaling=1.6))
    _assert_bounds_hold(multi_head_attention(X, W, **kw, lanczos=EXACT), rtol=1e-10, expected=_n_bounds(4, 2))


@pytest.mark.parametrize("L", [4, 8, 16])
def test_bounds_hold_on_split_attention_shared_by_a_group(L):
    """Formula sheet §3b's split-attention instance, with two query heads reading one key/value head."""
    big = 40.0
    X = torch.zeros(L, 2, dtype=DT)
    X[0, 0], X[1, 0] = 1.0, -1.0
    X[2:, 1] = 1.0
    W_Q1 = torch.tensor([[0.0, 0.0], [0.0, -big]], dtype=DT)
    W_Q = torch.cat([W_Q1, 0.5 * W_Q1], dim=1)  # two query heads, both splitting 1/2-1/2
    W_K, W_V, W_O = torch.eye(2, dtype=DT), torch.eye(2, dtype=DT), torch.eye(4, 2, dtype=DT) + 0.1
    out = multi_head_attention(
        X,
        AttentionWeights(W_Q, W_K, W_V, W_O, n_heads=2, n_kv_heads=1),
        loss=OutputLoss(target=torch.zeros(L, 2, dtype=DT)),
        lanczos=EXACT,
    )  # fmt: skip
    _assert_bounds_hold(out, rtol=1e-12, expected=_n_bounds(2, 1))
    assert out["term/softmax_jac_norm/h0"] > 1.0 / L


def test_bounds_follow_the_function_preserving_rescaling_with_grouped_heads():
    X, W, kw = _inputs(_case(H=4, H_kv=2, mode="target"), seed=16)
    for s in (1.0, 30.0, 300.0):
        Ws = dataclasses.replace(W, W_Q=s * W.W_Q, W_K=W.W_K / s)
        _assert_bounds_hold(multi_head_attention(X, Ws, **kw, lanczos=EXACT), rtol=1e-10, expected=_n_bounds(4, 2))


def test_qk_norm_emits_no_bounds_but_keeps_the_terms():
    X, W, kw = _inputs(_case(d_K=4, qk_norm="rmsnorm", H_kv=2), seed=17)
    out = multi_head_attention(X, W, **kw, lanczos=EXACT)
    assert not any(k.startswith("bound/") for k in out)
    keys = {k for k in out if k.startswith("term/")}
    assert {"term/wk_norm/g0", "term/wv_norm/g1", "term/wq_norm/h3", "term/softmax_jac_norm/h3"} <= keys
    assert "term/wk_norm/h0" not in keys


# ---- dtypes, defaults and errors -------------------------------------------------------------------------------


def test_float32_agrees_with_float64():
    X, W, kw = _inputs(_case(d_K=4, rotary="half", r=2, window=3, H_kv=1, qk_norm="rmsnorm"), seed=18)
    out64 = multi_head_attention(X, W, **kw, lanczos=EXACT)

    def f32(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.float()
        if isinstance(v, tuple):
            return tuple(f32(t) for t in v)
        if isinstance(v, dict):
            return {k: f32(t) for k, t in v.items()}
        if dataclasses.is_dataclass(v):
            return dataclasses.replace(v, **{f.name: f32(getattr(v, f.name)) for f in dataclasses.fields(v)})
        return v

    out32 = multi_head_attention(f32(X), f32(W), **f32(kw), lanczos=EXACT)
    for key, v in out64.items():
        assert out32[key].dtype == torch.float32
        assert_close_report(out32[key], v, TOL["float32"], name=key, atol=1e-6)


def test_bad_modern_options_say_how_to_fix():
    X, W, kw = _inputs(_case(B=None, L=4, d_K=4, H=2, H_kv=1, mode="grad"), seed=19)
    L = X.shape[0]
    c, s = _tables(torch.Generator().manual_seed(0), 1, L, 4, batched=False)

    def call(**extra):
        _, We, kwe = _with(X, W, kw, **extra)
        return multi_head_attention(X, We, **kwe)

    with pytest.raises(ValueError, match="n_kv_heads"):
        call(n_kv_heads=3)
    with pytest.raises(ValueError, match="pass n_kv_heads"):
        call(n_kv_heads=None)  # W_K packs one kv head, read as two of half the width
    with pytest.raises(ValueError, match="window"):
        call(window=0)
    with pytest.raises(ValueError, match="scale"):
        call(scale=-1.0)
    with pytest.raises(ValueError, match="repeat its frequencies"):
        call(rotary=(torch.randn(L, 4, dtype=DT), torch.randn(L, 4, dtype=DT)))
    with pytest.raises(ValueError, match="sin must repeat its frequencies"):
        call(rotary=(c, torch.randn(L, 4, dtype=DT)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        call(rotary=(c, s.clone().fill_(float("nan"))))
    with pytest.raises(ValueError, match="even"):
        call(rotary=(c[:, :3], s[:, :3]))
    with pytest.raises(ValueError, match="d_K = 4"):
        call(rotary=(torch.cat([c, c], -1), torch.cat([s, s], -1)))  # r = 8 > d_K = 4
    with pytest.raises(ValueError, match=r"cos\[:L\]"):
        call(rotary=(torch.cat([c, c]), torch.cat([s, s])))  # 2 L positions
    with pytest.raises(ValueError, match="rotary_interleaved"):
        call(rotary=(c, s), rotary_interleaved="gptj")
    with pytest.raises(ValueError, match="kind"):
        call(qk_norm=dict(kind="batchnorm", eps=1e-6))
    with pytest.raises(ValueError, match="eps"):
        call(qk_norm=dict(kind="rmsnorm"))
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        call(qk_norm=dict(kind="rmsnorm", eps=1e-6, bias_q=torch.zeros(4, dtype=DT)))
    with pytest.raises(ValueError, match="shape"):
        call(qk_norm=dict(kind="layernorm", eps=1e-6, weight_q=torch.ones(3, dtype=DT)))
    with pytest.raises(ValueError, match="qk_norm keys"):
        call(qk_norm=dict(kind="rmsnorm", eps=1e-6, weight=torch.ones(4, dtype=DT)))
    with pytest.raises(ValueError, match="self-attention only"):
        call(rotary=(c, s), memory=torch.randn(3, 4, dtype=DT))
    with pytest.raises(ValueError, match="memory_padding_mask needs memory"):
        call(memory_padding_mask=torch.zeros(L, dtype=torch.bool))
    with pytest.raises(ValueError, match="batched like X"):
        call(memory=torch.randn(1, 3, 4, dtype=DT))
    with pytest.raises(ValueError, match="input width"):
        call(memory=torch.randn(3, 5, dtype=DT))  # W_K reads d_kv = 4 features


# ---- a realistic size -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_lanczos_at_a_realistic_grouped_rotary_size(monkeypatch):
    """B = 2, L = 128, d = 256, H = 8, H_kv = 2, LLaMA rotary, causal: every norm converges within the default
    budget (an unconverged one would raise its LanczosWarning) and the products stay bounded by ``max_iter``."""
    gen = torch.Generator().manual_seed(20)
    B, L, d, H, H_kv, d_K = 2, 128, 256, 8, 2, 32

    def w(*shape):
        return torch.randn(*shape, generator=gen) / shape[0] ** 0.5

    X, G = torch.randn(B, L, d, generator=gen), 1e-2 * torch.randn(B, L, d, generator=gen)
    pos = torch.arange(L, dtype=torch.float32)[:, None] / (10000.0 ** (torch.arange(0, d_K, 2) / d_K))
    emb = torch.cat([pos, pos], dim=-1)
    products = []
    apply = attention_module.AttentionOperator.apply

    def counted(self, tangent, *args, **kwargs):
        products.append(next(iter(tangent.values())).shape[0])
        return apply(self, tangent, *args, **kwargs)

    monkeypatch.setattr(attention_module.AttentionOperator, "apply", counted)
    t0 = time.perf_counter()
    out = multi_head_attention(
        X,
        AttentionWeights(w(d, H * d_K), w(d, H_kv * d_K), w(d, H_kv * d_K), w(H * d_K, d), n_heads=H, n_kv_heads=H_kv),
        loss=OutputLoss(grad_output=G), structure=AttentionStructure(causal=True, rotary=(emb.cos(), emb.sin())),
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    residuals = {k: float(v) for k, v in out.items() if k.startswith("residual/")}
    assert len(residuals) == 3 * (3 * H + 2 * H_kv + H_kv) + 2 * H_kv  # QQ VQ QK, KK VK, QKV; VV (outer) as 2 keys
    assert all(r <= Lanczos().tol for r in residuals.values()), residuals
    assert all(torch.isfinite(v).all() for v in out.values())
    n_norms = 7  # Lanczos runs: QQ, VQ, QK, KK, VK, VV (outer), QKV
    assert len(products) <= n_norms * Lanczos().max_iter
    print(f"realistic grouped rotary attention: {elapsed:.1f} s, {len(products)} products, {sum(products)} rows")
