"""Closed-form FFN Hessian blocks against torch.func (curvwatch.reference)."""

from __future__ import annotations

import pytest
import torch

from curvwatch import reference
from curvwatch.closed_form import FFNWeights, OutputLoss, ffn
from curvwatch.closed_form.ffn import activation_derivatives
from curvwatch.closed_form.settings import EXACT
from tests.cases import DT, FFN_CASES, batch_shape, case_id, output_loss, rand
from tests.utils import TOL, assert_close_report


@pytest.mark.parametrize("case", FFN_CASES, ids=case_id)
def test_dense_blocks_and_norms_match_autograd(case):
    gen = torch.Generator().manual_seed(0)
    bs = batch_shape(case)
    Y = rand(gen, *bs, case["L"], case["d"])
    W_1, W_2, b_1 = rand(gen, case["d"], case["f"]), rand(gen, case["f"], case["d"]), rand(gen, case["f"])
    loss = output_loss(gen, case, tuple(Y.shape))
    weights, form = FFNWeights(W_1, W_2, b_1=b_1), dict(activation=case["activation"], residual=case["residual"])
    ref = reference.ffn_blocks(Y, weights, **form, loss=loss)
    out = ffn(Y, weights, **form, loss=loss, dense=True, lanczos=EXACT)
    norms = reference.dense_to_norms(ref)
    for key, mat in ref.items():
        if mat.ndim != 2:
            continue
        assert_close_report(out[f"dense/{key}"], mat, TOL["float64"], name=key, atol=1e-13)
        assert_close_report(out[key], norms[key], TOL["float64"], name=key, atol=1e-13)


def test_gelu_tanh_derivatives():
    z = torch.linspace(-4, 4, 101, dtype=DT)
    f = lambda t: torch.nn.functional.gelu(t, approximate="tanh")
    a, a1, a2 = activation_derivatives(z, "gelu_tanh")
    d1 = torch.func.vmap(torch.func.grad(f))(z)
    d2 = torch.func.vmap(torch.func.grad(torch.func.grad(f)))(z)
    assert_close_report(a, f(z), TOL["float64"])
    assert_close_report(a1, d1, TOL["float64"])
    assert_close_report(a2, d2, TOL["float64"])


def test_relu_dead_units_and_vanishing_w1w1_functional():
    gen = torch.Generator().manual_seed(2)
    Y = rand(gen, 8, 3)
    W_1 = rand(gen, 3, 6)
    W_1[:, 0] = -10 * Y.abs().sum(0).reciprocal() * 0  # column 0 zero: pre-activation 0, never positive
    b_1 = torch.zeros(6, dtype=DT)
    b_1[1] = -1e3  # unit 1 is dead
    out = ffn(Y, FFNWeights(W_1, rand(gen, 6, 3), b_1=b_1), loss=OutputLoss(grad_output=rand(gen, 8, 3)), lanczos=EXACT)
    assert float(out["dead_fraction"]) == pytest.approx(2 / 6)
    assert float(out["functional/W1W1"]) == 0.0  # ReLU: act'' = 0 a.e.
    assert float(out["functional/W1W2"]) > 0.0  # the cross term is where FFN curvature comes from


def test_float32_agrees_with_float64():
    gen = torch.Generator().manual_seed(3)
    Y, W_1, W_2, G = rand(gen, 2, 6, 5), rand(gen, 5, 9), rand(gen, 9, 5), rand(gen, 2, 6, 5)
    o64 = ffn(Y, FFNWeights(W_1, W_2), activation="gelu", loss=OutputLoss(grad_output=G), lanczos=EXACT)
    o32 = ffn(Y.float(), FFNWeights(W_1.float(), W_2.float()), activation="gelu",
              loss=OutputLoss(grad_output=G.float()), lanczos=EXACT)  # fmt: skip
    for k, v in o64.items():
        assert_close_report(o32[k], v, TOL["float32"], name=k, atol=1e-6)


def test_bad_input():
    Y = torch.randn(3, 4, dtype=DT)
    with pytest.raises(ValueError, match="activation"):
        ffn(Y, FFNWeights(torch.randn(4, 5, dtype=DT), torch.randn(5, 4, dtype=DT)), activation="swish",
            loss=OutputLoss(target=Y))  # fmt: skip
    with pytest.raises(ValueError, match="residual"):
        ffn(Y, FFNWeights(torch.randn(4, 5, dtype=DT), torch.randn(5, 3, dtype=DT)),
            loss=OutputLoss(target=torch.zeros(3, 3, dtype=DT)))  # fmt: skip


def test_gelu_tanh_blocks_match_torch_func():
    """GPT-2's tanh GELU (the reference module has exact GELU only): dense blocks vs torch.func directly."""
    gen = torch.Generator().manual_seed(4)
    Y, W_1, W_2, G = rand(gen, 2, 3, 3), rand(gen, 3, 4), rand(gen, 4, 3), rand(gen, 2, 3, 3)
    c = 0.37

    def S(w1, w2):
        return torch.nn.functional.gelu(Y @ w1, approximate="tanh") @ w2

    S0 = S(W_1, W_2).detach()

    def loss(w1, w2):
        return (G * S(w1, w2)).sum() + 0.5 * c * ((S(w1, w2) - S0) ** 2).sum()

    H = torch.func.hessian(loss, argnums=(0, 1))(W_1, W_2)
    out = ffn(Y, FFNWeights(W_1, W_2), activation="gelu_tanh", residual=False,
              loss=OutputLoss(grad_output=G, output_curvature=c), dense=True)  # fmt: skip
    for key, (i, j) in {"W1W1": (0, 0), "W2W2": (1, 1), "W1W2": (0, 1)}.items():
        expected = H[i][j].reshape(out[f"dense/hessian/{key}"].shape)
        assert_close_report(out[f"dense/hessian/{key}"], expected, TOL["float64"], name=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shared_operand_products_are_the_broadcasting_matmul_in_one_bmm(dtype):
    """``shared_times(S, T)`` / ``times_shared(T, S)`` (the FFN products' shared activations times tangent rows) are
    exactly ``S @ T`` / ``T @ S`` (the same ``bmm``: bitwise), transposed operands included, in at most three
    dispatched operators (a broadcasting matmul took seven or eight)."""
    from benchmarks.bench_dispatch import OpCounter
    from curvwatch.closed_form.solver.linalg import shared_times, times_shared

    g = torch.Generator().manual_seed(0)
    N, d, f, n = 12, 5, 7, 3
    Y, T, R = (torch.randn(*s, generator=g, dtype=dtype) for s in ((N, d), (n, d, f), (n, N, f)))
    cases = [(shared_times, Y, T), (shared_times, Y.mT, R), (shared_times, R[0], T.mT), (times_shared, R.mT, Y)]
    for ours, a, b in cases:
        counter = OpCounter()
        with counter:
            got = ours(a, b)
        assert torch.equal(got, a @ b), (ours.__name__, a.shape, b.shape)
        assert counter.total <= 3, (ours.__name__, dict(counter.ops))
