"""The curvature in a low-rank adapter's parameters (:mod:`curvwatch.closed_form.adapted`) against ``torch.func``.

For an FFN (adapters on ``W_1`` and on some columns of ``W_2``) and a multi-head attention (a fused adapter over
``Q``, ``K``, ``V`` as peft's LoRA on GPT-2's ``c_attn``, plus a second adapter on ``V``), with a sampled output
curvature ``C = sum_b s_b s_b^T`` (one sample), the reference builds in float64 the block output ``F`` as a function of
the adapter parameters ``theta = [vec(A), vec(B)]`` (``W = W_0 + s A B`` in the columns each adapter writes), then

* the Gauss-Newton matrix ``sum_b (J_b^T s_b)(J_b^T s_b)^T`` from ``J = dF/dtheta`` (``torch.func.jacrev``),
* the functional part, the Hessian of ``<g, F(theta)>`` (``torch.func.hessian``),

and compares each adapter's diagonal block: dense, entry by entry (round-off), and the top eigenvalues of the GGN, of
GGN + functional (the ``sharpness``) and of both preconditioned by a random positive ``P`` (``P^-1/2 . P^-1/2``), which
:func:`~curvwatch.closed_form.adapted.adapter_norms` finds by Lanczos on the block's own operator (``TOL["lanczos"]``).

The kernels take adapters as a grouped input (``adapters=``, :class:`~curvwatch.closed_form.LowRankUpdate` by weight
argument): their ``ggn/lora/<name>``, ``sharpness/lora/<name>`` and ``precond_...`` keys are checked the same way for
the FFN, the gated FFN and a grouped-query attention with rotary embedding and a causal mask, the loss gradient ``G``
in the adapted weights then coming from the operator itself (``weight_gradient``).
"""

from __future__ import annotations

import pytest
import torch

from curvwatch.closed_form import (
    AttentionStructure,
    AttentionWeights,
    FFNWeights,
    GatedFFNWeights,
    LowRankUpdate,
    OutputLoss,
    ffn,
    gated_ffn,
    multi_head_attention,
)
from curvwatch.closed_form.adapted import AdaptedOperator, LowRankAdapter, LowRankTarget, adapter_norms
from curvwatch.closed_form.attention import AttentionOperator, HeadWeights
from curvwatch.closed_form.ffn import FFNOperator, activation_derivatives
from curvwatch.closed_form.settings import Lanczos
from curvwatch.closed_form.solver import SampledCurvature, dense_blocks, with_sampled
from curvwatch.reference.attention import attention_blocked, attention_forward
from curvwatch.reference.ffn import ffn_forward
from curvwatch.reference.gated_ffn import gated_ffn_forward
from tests.utils import TOL, assert_close_report

DT = torch.float64
B, L, r, s = 3, 4, 2, 1.5
TIGHT = Lanczos(tol=1e-12, max_iter=200, max_basis=None, warn=False)


def _factors(d_in: int, d_out: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(d_in, r, dtype=DT, generator=gen), torch.randn(r, d_out, dtype=DT, generator=gen)


def _theta(factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for A, Bf in factors.values() for t in (A, Bf)])


def _split(theta: torch.Tensor, factors) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out, i = {}, 0
    for name, (A, Bf) in factors.items():
        a = theta[i : i + A.numel()].reshape(A.shape)
        i += A.numel()
        b = theta[i : i + Bf.numel()].reshape(Bf.shape)
        i += Bf.numel()
        out[name] = (a, b)
    return out


def _updated(W0: torch.Tensor, writes, extra: dict, names) -> torch.Tensor:
    """``W0`` plus ``s A B`` (and ``extra[name]``, a free update of the same columns) in the columns of each
    ``(A, B, columns)`` of adapter ``name``."""
    W = W0.clone()
    for (A, Bf, columns), name in zip(writes, names, strict=True):
        W = W.index_add(1, columns, s * A @ Bf + extra.get(name, 0))
    return W


def _reference(forward, factors, g, samples):
    """``{name: (GGN block, functional block)}`` of each adapter, from ``torch.func``."""
    theta0 = _theta(factors)
    J = torch.func.jacrev(forward)(theta0)  # (B, L, m, P)
    v = torch.einsum("blm,blmp->bp", samples[0], J)  # (B, P): J_b^T s_b
    ggn = v.T @ v
    func = torch.func.hessian(lambda t: (g * forward(t)).sum())(theta0)
    out, i = {}, 0
    for name, (A, Bf) in factors.items():
        j = i + A.numel() + Bf.numel()
        out[name] = (ggn[i:j, i:j], func[i:j, i:j])
        i = j
    return out


def _ffn_case(gen):
    d, f, m = 5, 7, 4
    Y = torch.randn(B, L, d, dtype=DT, generator=gen)
    W1, W2 = torch.randn(d, f, dtype=DT, generator=gen), torch.randn(f, m, dtype=DT, generator=gen) / 2
    b1 = torch.randn(f, dtype=DT, generator=gen)
    cols1, cols2 = torch.arange(f), torch.tensor([0, 2, 3])  # the W_2 adapter writes 3 of its 4 columns
    factors = {"W1": _factors(d, f, gen), "W2": _factors(f, 3, gen)}

    def weights(theta, extra):
        p = _split(theta, factors)
        return _updated(W1, [(*p["W1"], cols1)], extra, ["W1"]), _updated(W2, [(*p["W2"], cols2)], extra, ["W2"])

    def forward(theta, extra=None):
        W_1, W_2 = weights(theta, extra or {})
        return ffn_forward(Y, W_1, W_2, "gelu", residual=False, b_1=b1)

    W_1, W_2 = weights(_theta(factors), {})
    g = torch.randn(B, L, m, dtype=DT, generator=gen)
    Hid, a1, a2 = activation_derivatives(Y @ W_1 + b1, "gelu")
    keep = torch.ones(B, L, dtype=torch.bool)
    op = FFNOperator(Y, Hid, a1, a2, W_1, W_2, g, torch.ones(B, dtype=DT), keep)
    samples = torch.randn(1, B, L, m, dtype=DT, generator=gen)
    op = with_sampled(op, SampledCurvature.of_tokens(samples))
    targets = {
        "W1": (LowRankTarget.whole("W1", 0, f),),
        "W2": (LowRankTarget("W2", torch.arange(3), cols2),),  # B's 3 columns are W_2's columns 0, 2, 3
    }
    return op, factors, targets, forward, g, samples, {}


def _attention_case(gen):
    d, H, dK, m = 6, 2, 3, 5
    X = torch.randn(B, L, d, dtype=DT, generator=gen)
    W_Q, W_K, W_V = (torch.randn(d, H * dK, dtype=DT, generator=gen) / 2 for _ in range(3))
    W_O = torch.randn(H * dK, m, dtype=DT, generator=gen)
    n = H * dK
    fused = {"Q": torch.arange(n), "K": torch.arange(n, 2 * n), "V": torch.arange(2 * n, 3 * n)}
    factors = {"QKV": _factors(d, 3 * n, gen), "V": _factors(d, n, gen)}
    blocked = ~torch.ones(L, L, dtype=torch.bool).tril().expand(B, L, L)  # causal

    def weights(theta, extra):
        p = _split(theta, factors)
        W = torch.cat([W_Q, W_K, W_V], dim=1)
        W = _updated(W, [(*p["QKV"], torch.arange(3 * n)), (*p["V"], fused["V"])], extra, ["QKV", "V"])
        return W.split(n, dim=1)

    def forward(theta, extra=None):
        W_Q_, W_K_, W_V_ = weights(theta, extra or {})
        return attention_forward(X, AttentionWeights(W_Q_, W_K_, W_V_, W_O, n_heads=H), blocked)

    per_head = [W.reshape(d, H, dK).permute(1, 0, 2) for W in weights(_theta(factors), {})]  # (H, d, d_K)
    g = torch.randn(B, L, m, dtype=DT, generator=gen)
    W_Oh = W_O.reshape(H, dK, m)
    heads = HeadWeights(*per_head, W_Oh)
    op = AttentionOperator(X, heads, ~blocked, torch.ones(B, L, dtype=torch.bool), g, torch.ones(B, dtype=DT))
    samples = torch.randn(1, B, L, m, dtype=DT, generator=gen)
    op = with_sampled(op, SampledCurvature.of_heads(samples, W_Oh))
    targets = {
        "QKV": tuple(LowRankTarget.whole(X_, i * n, n, heads=H) for i, X_ in enumerate(("Q", "K", "V"))),
        "V": (LowRankTarget.whole("V", 0, n, heads=H),),
    }
    return op, factors, targets, forward, g, samples, {"mix": "all"}


CASES = {"ffn": _ffn_case, "attention": _attention_case}


def _gradients(forward, factors, g) -> dict[str, torch.Tensor]:
    """``G = dL/dW`` ``(d_in, d_out)`` in the columns each adapter writes, ``L = <g, F>``: the gradient in a free
    update of those columns, at zero."""
    theta0 = _theta(factors)
    out = {}
    for name, (A, Bf) in factors.items():
        zero = torch.zeros(A.shape[0], Bf.shape[1], dtype=DT)
        out[name] = torch.func.grad(lambda E, name=name: (g * forward(theta0, {name: E})).sum())(zero)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_curvature_matches_torch_func(case):
    gen = torch.Generator().manual_seed(7)
    op, factors, targets, forward, g, samples, kwargs = CASES[case](gen)
    grads = _gradients(forward, factors, g)
    adapters = {name: LowRankAdapter(A, Bf, s, targets[name], grad=grads[name]) for name, (A, Bf) in factors.items()}
    ref = _reference(forward, factors, g, samples)
    adapted = AdaptedOperator(op, adapters, kwargs)
    dense = dense_blocks(adapted, [name + name for name in adapters])
    P = {name: torch.rand(a.size, dtype=DT, generator=gen) + 0.5 for name, a in adapters.items()}
    keys = adapter_norms(op, adapters, lanczos=TIGHT, precondition=P, apply_kwargs=kwargs)
    for name, (ggn, func) in ref.items():
        XX = name + name
        assert_close_report(dense[f"dense/outer/{XX}"], ggn, TOL["float64"], f"{case} GGN {XX}")
        assert_close_report(dense[f"dense/functional/{XX}"], func, TOL["float64"], f"{case} functional {XX}")
        D = P[name].rsqrt()
        for prefix, scale in (("", None), ("precond_", D)):
            for key, M in (("ggn", ggn), ("sharpness", ggn + func)):
                M = M if scale is None else scale[:, None] * M * scale[None, :]
                expected = torch.linalg.eigvalsh(M)[-1]
                assert_close_report(keys[f"{prefix}{key}/{XX}"], expected, TOL["lanczos"], f"{case} {prefix}{key}/{XX}")


def test_adapter_norms_debiased_with_several_samples():
    """With ``k >= 2`` samples every key is debiased (the halves' estimates, the spread): the members run through the
    chain rule too (a smoke test of the sampled machinery's paths on the adapted operator)."""
    gen = torch.Generator().manual_seed(3)
    op, factors, targets, forward, g, _, kwargs = _ffn_case(gen)
    samples = torch.randn(4, B, L, op.g.shape[-1], dtype=DT, generator=gen)
    op = with_sampled(op, SampledCurvature.of_tokens(samples))
    grads = _gradients(forward, factors, g)
    adapters = {name: LowRankAdapter(A, Bf, s, targets[name], grad=grads[name]) for name, (A, Bf) in factors.items()}
    P = {"W1": torch.rand(adapters["W1"].size, dtype=DT, generator=gen) + 0.5}
    keys = adapter_norms(op, adapters, lanczos=TIGHT, precondition=P)
    expected = {f"{p}{k}/{X}{X}" for X in ("W1", "W2") for p in ("", "precond_") for k in ("ggn", "sharpness")}
    expected -= {"precond_ggn/W2W2", "precond_sharpness/W2W2"}
    assert expected <= set(keys) and all(torch.isfinite(keys[k]) for k in expected)
    assert {"sharpness_spread/W1W1", "sharpness_spread/W2W2"} <= set(keys)


# --------------------------------------------------------------------------------------------------
# The kernels' adapters= (grouped input, keys ggn/lora/<name>, ...)
# --------------------------------------------------------------------------------------------------


def _kernel_case(base: dict[str, torch.Tensor], writes: dict[str, dict[str, torch.Tensor]], gen):
    """Factors of adapters ``name -> {weight: columns}`` (``B``'s columns laid out over the weights in order), and
    ``weights(theta)``: every weight ``base[w]`` plus each adapter's ``s A B`` in its columns."""
    factors = {}
    for name, cols in writes.items():
        d_in = {base[w].shape[0] for w in cols}.pop()
        factors[name] = _factors(d_in, sum(c.numel() for c in cols.values()), gen)

    def weights(theta):
        p = _split(theta, factors)
        out = dict(base)
        for name, cols in writes.items():
            A, Bf = p[name]
            start = 0
            for w, c in cols.items():
                out[w] = out[w].index_add(1, c, s * A @ Bf[:, start : start + c.numel()])
                start += c.numel()
        return out

    updates = {}
    for name, cols in writes.items():
        A, Bf = factors[name]
        starts = torch.tensor([0, *[c.numel() for c in cols.values()]]).cumsum(0)
        on = {w: (torch.arange(int(starts[i]), int(starts[i + 1])), c) for i, (w, c) in enumerate(cols.items())}
        updates[name] = LowRankUpdate(A, Bf, s, on)
    return factors, weights, updates


def _ffn_kernel(gen):
    d, f = 5, 7
    Y = torch.randn(B, L, d, dtype=DT, generator=gen)
    base = {"W_1": torch.randn(d, f, dtype=DT, generator=gen), "W_2": torch.randn(f, d, dtype=DT, generator=gen) / 2}
    writes = {"fc_1": {"W_1": torch.arange(f)}, "fc_2": {"W_2": torch.tensor([4, 0, 2])}}
    factors, weights, updates = _kernel_case(base, writes, gen)

    def forward(theta):
        w = weights(theta)
        return ffn_forward(Y, w["W_1"], w["W_2"], "gelu", residual=False)

    def call(**kw):
        w = weights(_theta(factors))
        return ffn(Y, FFNWeights(w["W_1"], w["W_2"]), activation="gelu", residual=False, **kw)

    return factors, updates, forward, call, d


def _gated_kernel(gen):
    d, f = 4, 6
    Y = torch.randn(B, L, d, dtype=DT, generator=gen)
    base = {
        "W_gate": torch.randn(d, f, dtype=DT, generator=gen),
        "W_up": torch.randn(d, f, dtype=DT, generator=gen),
        "W_down": torch.randn(f, d, dtype=DT, generator=gen) / 2,
    }
    writes = {"gate_proj": {"W_gate": torch.arange(f)}, "down_proj": {"W_down": torch.arange(d)}}
    factors, weights, updates = _kernel_case(base, writes, gen)

    def forward(theta):
        return gated_ffn_forward(Y, GatedFFNWeights(**weights(theta)), "silu")

    def call(**kw):
        return gated_ffn(Y, GatedFFNWeights(**weights(_theta(factors))), activation="silu", **kw)

    return factors, updates, forward, call, d


def _gqa_kernel(gen):
    d, H, H_kv, dK, m = 6, 4, 2, 2, 5
    X = torch.randn(B, L, d, dtype=DT, generator=gen)
    base = {
        "W_Q": torch.randn(d, H * dK, dtype=DT, generator=gen) / 2,
        "W_K": torch.randn(d, H_kv * dK, dtype=DT, generator=gen) / 2,
        "W_V": torch.randn(d, H_kv * dK, dtype=DT, generator=gen) / 2,
    }
    W_O = torch.randn(H * dK, m, dtype=DT, generator=gen)
    # one adapter over the fused [W_Q | W_K | W_V] (GPT-2's c_attn), one on some columns of W_V across its kv heads
    writes = {
        "c_attn": {"W_Q": torch.arange(H * dK), "W_K": torch.arange(H_kv * dK), "W_V": torch.arange(H_kv * dK)},
        "v_proj": {"W_V": torch.tensor([3, 0, 1])},
    }
    factors, weights, updates = _kernel_case(base, writes, gen)
    angles = torch.rand(L, 1, dtype=DT, generator=gen) * torch.arange(1, L + 1, dtype=DT)[:, None]
    rotary = (angles.cos().repeat(1, dK), angles.sin().repeat(1, dK))  # (L, d_K): halves duplicated
    blocked, dead = attention_blocked(B, L, L, True, None, None, X.device)

    def packed(theta):
        w = weights(theta)
        return AttentionWeights(w["W_Q"], w["W_K"], w["W_V"], W_O, n_heads=H, n_kv_heads=H_kv)

    def forward(theta):
        return attention_forward(X, packed(theta), blocked, rotary=rotary, dead=dead)

    def call(**kw):
        structure = AttentionStructure(causal=True, rotary=rotary)
        return multi_head_attention(X, packed(_theta(factors)), structure=structure, **kw)

    return factors, updates, forward, call, m


KERNELS = {"ffn": _ffn_kernel, "gated_ffn": _gated_kernel, "gqa_attention": _gqa_kernel}


@pytest.mark.parametrize("case", list(KERNELS))
def test_kernel_adapter_keys_match_torch_func(case):
    gen = torch.Generator().manual_seed(11)
    factors, updates, forward, call, m = KERNELS[case](gen)
    g = torch.randn(B, L, m, dtype=DT, generator=gen)
    samples = torch.randn(1, B, L, m, dtype=DT, generator=gen)
    ref = _reference(forward, factors, g, samples)
    P = {f"lora/{name}": torch.rand(u.A.numel() + u.B.numel(), dtype=DT, generator=gen) + 0.5
         for name, u in updates.items()}  # fmt: skip
    keys = call(loss=OutputLoss(grad_output=g, output_samples=samples), lanczos=TIGHT, adapters=updates, precondition=P)
    for name, (ggn, func) in ref.items():
        D = P[f"lora/{name}"].rsqrt()
        for prefix, scale in (("", None), ("precond_", D)):
            for key, M in (("ggn", ggn), ("sharpness", ggn + func)):
                M = M if scale is None else scale[:, None] * M * scale[None, :]
                expected = torch.linalg.eigvalsh(M)[-1]
                got = keys[f"{prefix}{key}/lora/{name}"]
                assert_close_report(got, expected, TOL["lanczos"], f"{case} {prefix}{key}/lora/{name}")


def test_kernel_adapters_are_checked():
    gen = torch.Generator().manual_seed(0)
    factors, updates, _, call, m = _ffn_kernel(gen)
    g = torch.randn(B, L, m, dtype=DT, generator=gen)
    samples = OutputLoss(grad_output=g, output_samples=torch.randn(2, B, L, m, dtype=DT, generator=gen))
    with pytest.raises(ValueError, match="adapters= needs output_samples="):
        call(loss=OutputLoss(grad_output=g), adapters=updates)
    u = updates["fc_1"]
    with pytest.raises(ValueError, match="writes 'W_O', which has no block"):
        call(loss=samples, adapters={"o": LowRankUpdate(u.A, u.B, s, {"W_O": u.writes["W_1"]})})
    with pytest.raises(ValueError, match="must be columns of B"):
        call(loss=samples, adapters={"x": LowRankUpdate(u.A, u.B, s, {"W_1": (torch.arange(1, 8), torch.arange(7))})})
    with pytest.raises(ValueError, match="a word"):
        call(loss=samples, adapters={"a.b": u})
    with pytest.raises(ValueError, match="Invalid precondition names"):
        call(loss=samples, adapters=updates, precondition={"lora/nope": torch.ones(3, dtype=DT)})
