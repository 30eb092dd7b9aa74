"""Tests of ``curvwatch.closed_form.jacobians`` against ``torch.func`` ground truths; benchmark smoke test."""

from __future__ import annotations

import json
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.func import jacfwd, jacrev

from curvwatch.closed_form.jacobians import (
    RowKronecker,
    block_output_jacobians,
    block_output_jacobians_structured,
    ffn_jacobian_W1,
    ffn_jacobian_W1_structured,
    ffn_jacobian_W2,
    ffn_jacobian_W2_structured,
    layernorm_jacobian_blocks,
    layernorm_jacobian_dense,
)
from tests.utils import TOL, assert_close_report

# float32 closed form vs the float64 torch.func reference on the same (cast) inputs. Tighter than
# TOL["float32"] on purpose: these are single products, not accumulated Hessian sums.
RTOL_F32 = 1e-5

# ----------------------------------------------------------------------------------------------------------
# cases: each dict becomes a seeded problem

LN_CASES = [
    dict(shape=(5, 4), eps=1e-5, weight=False, ref="jacrev"),
    dict(shape=(2, 3, 6), eps=0.0, weight=True, ref="jacfwd"),
    dict(shape=(7, 3), eps=0.0, weight=False, ref="jacrev"),  # n = 2 with eps = 0 is constant: J = 0
    dict(shape=(3, 9), eps=0.5, weight=True, ref="jacrev"),
    dict(shape=(8, 16), eps=1e-5, weight=False, ref="jacfwd"),  # the papers' LN size
]

FFN_CASES = [
    dict(
        batch=None,
        L=5,
        d=4,
        d_ff=7,
        d_out=4,
        act="relu",
        residual=True,
        bias=False,
        weight=False,
        eps=1e-5,
        ref="jacrev",
    ),
    dict(
        batch=2,
        L=3,
        d=6,
        d_ff=4,
        d_out=5,
        act="gelu",
        residual=False,
        bias=True,
        weight=True,
        eps=0.0,
        ref="jacfwd",
    ),
    dict(
        batch=None,
        L=8,
        d=16,
        d_ff=32,
        d_out=16,
        act="gelu",
        residual=True,
        bias=True,
        weight=True,
        eps=1e-5,
        ref="jacrev",
    ),  # the papers' size
    dict(
        batch=2,
        L=4,
        d=5,
        d_ff=3,
        d_out=5,
        act="relu",
        residual=False,
        bias=True,
        weight=False,
        eps=0.1,
        ref="jacfwd",
    ),
    dict(
        batch=None,
        L=6,
        d=3,
        d_ff=10,
        d_out=3,
        act="gelu",
        residual=True,
        bias=False,
        weight=False,
        eps=0.0,
        ref="jacrev",
    ),
]


def _case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items() if k != "ref")


def _seeded(case: dict) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(_case_id(case).encode()))


@pytest.fixture(params=LN_CASES, ids=_case_id)
def ln_problem(request):
    case = request.param
    gen = _seeded(case)
    X = torch.randn(*case["shape"], generator=gen, dtype=torch.float64) * 2.0 + 0.3
    n = case["shape"][-1]
    weight = torch.randn(n, generator=gen, dtype=torch.float64) if case["weight"] else None
    return case, X, weight


@pytest.fixture(params=FFN_CASES, ids=_case_id)
def ffn_problem(request):
    case = request.param
    gen = _seeded(case)
    shape = (case["L"], case["d"]) if case["batch"] is None else (case["batch"], case["L"], case["d"])
    kw = dict(generator=gen, dtype=torch.float64)
    p = dict(
        Y=torch.randn(*shape, **kw),
        W_1=torch.randn(case["d"], case["d_ff"], **kw) / math.sqrt(case["d"]),
        W_2=torch.randn(case["d_ff"], case["d_out"], **kw) / math.sqrt(case["d_ff"]),
        b_1=torch.randn(case["d_ff"], **kw) * 0.1 if case["bias"] else None,
        b_2=torch.randn(case["d_out"], **kw) * 0.1 if case["bias"] else None,
        weight=torch.randn(case["d_out"], **kw) if case["weight"] else None,
    )
    return case, p


# ----------------------------------------------------------------------------------------------------------
# torch.func ground truths (the obvious forward, differentiated)


def _jac(case: dict):
    return jacrev if case["ref"] == "jacrev" else jacfwd


def _act(Z: torch.Tensor, act: str) -> torch.Tensor:
    return torch.relu(Z) if act == "relu" else F.gelu(Z)


def _ffn_forward(Y, W_1, W_2, b_1, b_2, act, residual):
    S = _act(Y @ W_1 + (0 if b_1 is None else b_1), act) @ W_2 + (0 if b_2 is None else b_2)
    return S + Y if residual else S


def _ref_ffn(case, p, wrt: str) -> torch.Tensor:
    args = dict(p)

    def f(W):
        args[wrt] = W
        return _ffn_forward(
            args["Y"], args["W_1"], args["W_2"], args["b_1"], args["b_2"], case["act"], case["residual"]
        ).reshape(-1)

    return _jac(case)(f)(p[wrt]).reshape(-1, p[wrt].numel())


def _ref_block(case, p, wrt: str) -> torch.Tensor:
    args = dict(p)

    def f(W):
        args[wrt] = W
        S = _ffn_forward(args["Y"], args["W_1"], args["W_2"], args["b_1"], args["b_2"], case["act"], case["residual"])
        return F.layer_norm(S, (S.shape[-1],), weight=args["weight"], eps=case["eps"]).reshape(-1)

    return _jac(case)(f)(p[wrt]).reshape(-1, p[wrt].numel())


def _ref_ln(case, X, weight) -> torch.Tensor:
    n = X.shape[-1]
    J = _jac(case)(lambda x: F.layer_norm(x, (n,), weight=weight, eps=case["eps"]).reshape(-1))(X)
    return J.reshape(X.numel(), X.numel())


def _f32(p: dict) -> dict:
    return {k: None if v is None else v.float() for k, v in p.items()}


# ----------------------------------------------------------------------------------------------------------
# LayerNorm


def test_layernorm_dense_matches_autograd(ln_problem):
    case, X, weight = ln_problem
    expected = _ref_ln(case, X, weight)
    assert_close_report(layernorm_jacobian_dense(X, case["eps"], weight), expected, TOL["float64"], "LN dense f64")
    X32, w32 = X.float(), None if weight is None else weight.float()
    expected32 = _ref_ln(case, X32.double(), None if weight is None else w32.double())
    actual32 = layernorm_jacobian_dense(X32, case["eps"], w32)
    assert actual32.dtype == torch.float32
    assert_close_report(actual32, expected32, RTOL_F32, "LN dense f32")


def test_layernorm_blocks_are_the_diagonal_blocks(ln_problem):
    case, X, weight = ln_problem
    n = X.shape[-1]
    N = X.numel() // n
    dense = _ref_ln(case, X, weight).reshape(N, n, N, n)
    expected = torch.stack([dense[i, :, i, :] for i in range(N)])  # (N, n, n)
    blocks = layernorm_jacobian_blocks(X, case["eps"], weight)
    assert blocks.shape == (N, n, n)
    assert_close_report(blocks, expected, TOL["float64"], "LN blocks")
    # off-diagonal blocks of the autograd Jacobian are exactly zero, so the blocks are the whole object
    off = dense.clone()
    off[torch.arange(N), :, torch.arange(N), :] = 0
    assert off.abs().max().item() == 0.0


# ----------------------------------------------------------------------------------------------------------
# FFN


def test_ffn_jacobian_W2_matches_autograd(ffn_problem):
    case, p = ffn_problem
    expected = _ref_ffn(case, p, "W_2")
    actual = ffn_jacobian_W2(p["Y"], p["W_1"], p["b_1"], case["act"], d_out=case["d_out"])
    assert_close_report(actual, expected, TOL["float64"], "dS/dW_2 f64")
    q = _f32(p)
    actual32 = ffn_jacobian_W2(q["Y"], q["W_1"], q["b_1"], case["act"], d_out=case["d_out"])
    expected32 = _ref_ffn(case, {k: None if v is None else v.double() for k, v in q.items()}, "W_2")
    assert_close_report(actual32, expected32, RTOL_F32, "dS/dW_2 f32")


def test_ffn_jacobian_W1_matches_autograd(ffn_problem):
    case, p = ffn_problem
    expected = _ref_ffn(case, p, "W_1")
    actual = ffn_jacobian_W1(p["Y"], p["W_1"], p["W_2"], p["b_1"], case["act"])
    assert_close_report(actual, expected, TOL["float64"], "dS/dW_1 f64")
    q = _f32(p)
    actual32 = ffn_jacobian_W1(q["Y"], q["W_1"], q["W_2"], q["b_1"], case["act"])
    expected32 = _ref_ffn(case, {k: None if v is None else v.double() for k, v in q.items()}, "W_1")
    assert_close_report(actual32, expected32, RTOL_F32, "dS/dW_1 f32")


def test_ffn_structured_factors(ffn_problem):
    case, p = ffn_problem
    N = p["Y"].numel() // case["d"]
    K2 = ffn_jacobian_W2_structured(p["Y"], p["W_1"], p["b_1"], case["act"], d_out=case["d_out"])
    K1 = ffn_jacobian_W1_structured(p["Y"], p["W_1"], p["W_2"], p["b_1"], case["act"])
    assert K2.left.shape == (N, case["d_ff"]) and K2.right.shape == (N, case["d_out"], case["d_out"])
    assert K1.left.shape == (N, case["d"]) and K1.right.shape == (N, case["d_out"], case["d_ff"])
    # the W_2 factor is σ(Y W_1 + b_1) itself
    Z_pre = p["Y"].reshape(N, -1) @ p["W_1"] + (0 if p["b_1"] is None else p["b_1"])
    assert_close_report(K2.left, _act(Z_pre, case["act"]), TOL["float64"], "σ(YW_1)")


# ----------------------------------------------------------------------------------------------------------
# post-LN block output


@pytest.mark.parametrize("wrt", ["W_1", "W_2"])
def test_block_output_jacobians_match_autograd(ffn_problem, wrt):
    case, p = ffn_problem
    kw = dict(b_1=p["b_1"], b_2=p["b_2"], residual=case["residual"], weight=p["weight"])
    expected = _ref_block(case, p, wrt)
    actual = block_output_jacobians(p["Y"], p["W_1"], p["W_2"], case["eps"], case["act"], **kw)[wrt]
    assert_close_report(actual, expected, TOL["float64"], f"dZ/d{wrt} f64")
    q = _f32(p)
    kw32 = dict(b_1=q["b_1"], b_2=q["b_2"], residual=case["residual"], weight=q["weight"])
    actual32 = block_output_jacobians(q["Y"], q["W_1"], q["W_2"], case["eps"], case["act"], **kw32)[wrt]
    assert actual32.dtype == torch.float32
    expected32 = _ref_block(case, {k: None if v is None else v.double() for k, v in q.items()}, wrt)
    assert_close_report(actual32, expected32, RTOL_F32, f"dZ/d{wrt} f32")


def test_block_output_structured_products(ffn_problem):
    """mv / rmv of the structured Jacobians equal products with the dense autograd Jacobian."""
    case, p = ffn_problem
    gen = torch.Generator().manual_seed(1)
    jac = block_output_jacobians_structured(
        p["Y"],
        p["W_1"],
        p["W_2"],
        case["eps"],
        case["act"],
        b_1=p["b_1"],
        b_2=p["b_2"],
        residual=case["residual"],
        weight=p["weight"],
    )
    N = p["Y"].numel() // case["d"]
    for wrt in ("W_1", "W_2"):
        dense = _ref_block(case, p, wrt)
        assert jac[wrt].shape == tuple(dense.shape)
        V = torch.randn(p[wrt].shape, generator=gen, dtype=torch.float64)
        U = torch.randn(N, case["d_out"], generator=gen, dtype=torch.float64)
        assert_close_report(jac[wrt].mv(V).reshape(-1), dense @ V.reshape(-1), TOL["float64"], f"J v {wrt}")
        assert_close_report(jac[wrt].rmv(U).reshape(-1), dense.T @ U.reshape(-1), TOL["float64"], f"Jᵀu {wrt}")


def test_block_output_wrt_subset():
    Y, W_1, W_2 = torch.randn(4, 3), torch.randn(3, 5), torch.randn(5, 3)
    assert list(block_output_jacobians(Y, W_1, W_2, wrt=["W_2"])) == ["W_2"]


def test_block_output_wrt_order_and_repeats():
    """Keys come in the order of ``wrt``, once each, and each Jacobian does not depend on what else is asked."""
    gen = torch.Generator().manual_seed(3)
    Y, W_1, W_2 = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 4, 3), (3, 5), (5, 3)))
    full = block_output_jacobians(Y, W_1, W_2, activation="gelu")
    for wrt in (["W_2", "W_1"], ("W_1",), ("W_2", "W_2"), ("W_1", "W_2", "W_1")):
        out = block_output_jacobians(Y, W_1, W_2, activation="gelu", wrt=wrt)
        assert list(out) == list(dict.fromkeys(wrt))
        for k, v in out.items():
            assert torch.equal(v, full[k]), (wrt, k)


def test_row_kronecker_internal_constructor_matches_the_validated_one():
    """The closed forms build RowKronecker without re-checking shapes; the objects are the validated ones."""
    left, right = torch.randn(4, 3), torch.randn(4, 2, 5)
    fast, checked = RowKronecker._unchecked(left, right), RowKronecker(left, right)
    assert type(fast) is RowKronecker
    assert fast.left is left and fast.right is right
    assert fast == checked and repr(fast) == repr(checked) and fast.shape == checked.shape == (8, 15)
    assert torch.equal(fast.to_dense(), checked.to_dense())
    with pytest.raises(AttributeError):  # still frozen
        fast.left = right
    # every factor pair the closed forms return passes the public check
    Y, W_1, W_2 = torch.randn(2, 4, 3), torch.randn(3, 5), torch.randn(5, 3)
    made = [
        *block_output_jacobians_structured(Y, W_1, W_2).values(),
        ffn_jacobian_W1_structured(Y, W_1, W_2),
        ffn_jacobian_W2_structured(Y, W_1, d_out=2),
    ]
    for K in made:
        assert RowKronecker(K.left, K.right) == K


@pytest.mark.parametrize("shape", [(6, 3), (2, 3, 3), (1, 3)])
def test_layernorm_dense_is_exactly_the_block_diagonal(shape):
    X = torch.randn(*shape, dtype=torch.float64)
    blocks = layernorm_jacobian_blocks(X, 1e-5)
    dense = layernorm_jacobian_dense(X, 1e-5)
    assert dense.is_contiguous()
    assert torch.equal(dense, torch.block_diag(*blocks.unbind(0)))


def test_relu_pieces_are_the_mask_and_the_clamp():
    """ReLU's σ' is exactly (Z > 0) in Z's dtype, specials included, and σ is torch.relu; with inputs that require
    grad the closed forms still build a graph that backpropagates (the mask is not differentiated)."""
    from curvwatch.closed_form.ffn import activation_derivatives, activation_value

    for dtype in (torch.float32, torch.float64):
        Z = torch.tensor([-2.0, -0.0, 0.0, 3.0, math.nan, math.inf, -math.inf, 1e-30, -1e-30], dtype=dtype)
        Z = torch.cat([Z, torch.randn(50, dtype=dtype)])
        H, d1, d2 = activation_derivatives(Z, "relu")
        assert d1.dtype == dtype and torch.equal(d1, (Z > 0).to(dtype))
        assert not d1.signbit().any()  # +0, never -0, where Z <= 0 or NaN
        torch.testing.assert_close(H, torch.relu(Z), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(activation_value(Z, "relu"), H, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(d2, torch.zeros_like(Z))
    Y = torch.randn(4, 3, dtype=torch.float64)
    W_1 = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    W_2 = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    jac = block_output_jacobians_structured(Y, W_1, W_2)
    sum(K.left.sum() + K.right.sum() for K in jac.values()).backward()
    assert W_1.grad is not None and W_2.grad is not None
    ffn_jacobian_W1_structured(Y, W_1, W_2).right.sum().backward()


# ----------------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: layernorm_jacobian_blocks(torch.randn(4, 3).half()), "dtype"),
        (lambda: layernorm_jacobian_blocks(torch.randn(3)), r"\(L, n\) or \(B, L, n\)"),
        (lambda: layernorm_jacobian_blocks(torch.randn(4, 3), eps=-1.0), "eps"),
        (lambda: layernorm_jacobian_blocks(torch.ones(4, 3), eps=0.0), "eps > 0"),
        (lambda: layernorm_jacobian_blocks(torch.randn(4, 3), weight=torch.ones(4)), "weight.shape"),
        (
            lambda: layernorm_jacobian_dense(torch.randn(4, 3), weight=torch.ones(3, dtype=torch.float64)),
            "weight.to",
        ),
        (lambda: ffn_jacobian_W2(torch.randn(4, 3), torch.randn(5, 3)), "nn.Linear.weight.T"),
        (lambda: ffn_jacobian_W2(torch.randn(4, 3), torch.randn(3, 5), activation="tanh"), "'relu', 'gelu'"),
        (lambda: ffn_jacobian_W2(torch.randn(4, 3), torch.randn(3, 5), d_out=0), "d_out"),
        (lambda: ffn_jacobian_W1(torch.randn(4, 3), torch.randn(3, 5), torch.randn(3, 5)), "W_2.shape"),
        (
            lambda: ffn_jacobian_W1(torch.randn(4, 3), torch.randn(3, 5), torch.randn(5, 3), b_1=torch.ones(3)),
            "b_1.shape",
        ),
        (
            lambda: block_output_jacobians(torch.randn(4, 3), torch.randn(3, 5), torch.randn(5, 2)),
            "residual=False",
        ),
        (
            lambda: block_output_jacobians(torch.randn(4, 3), torch.randn(3, 5), torch.randn(5, 3), wrt=["W_Q"]),
            "wrt",
        ),
        (lambda: RowKronecker(torch.ones(2, 3), torch.ones(3, 4, 4)), "same N"),
    ],
)
def test_invalid_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _y_w1_w2(**change):
    """Valid (Y, W_1, W_2) of the block, float32 on the CPU, with some of them replaced."""
    args = dict(Y=torch.randn(2, 4, 3), W_1=torch.randn(3, 5), W_2=torch.randn(5, 3))
    args.update(change)
    return args["Y"], args["W_1"], args["W_2"]


# each only breaks one rule, with Y, W_1 and W_2 given and no b_1: the inputs that _check_ffn's fast accept sees
FAST_PATH_INVALID = [
    (dict(Y=torch.randn(4, 3).half(), W_1=torch.randn(3, 5).half(), W_2=torch.randn(5, 3).half()), "Y.dtype"),
    (dict(Y=torch.randn(4, 3).int()), "Y.dtype"),
    (dict(Y=torch.randn(3)), r"Y.shape=\(3,\)"),
    (dict(Y=torch.randn(2, 2, 4, 3)), r"\(L, n\) or \(B, L, n\)"),
    (dict(Y=[[1.0, 2.0, 3.0]]), "Y: expected a torch.Tensor"),
    (dict(W_1=torch.randn(4, 5)), "W_1.shape"),
    (dict(W_1=torch.randn(1, 3, 5)), "W_1.shape"),
    (dict(W_1=torch.randn(3, 5, dtype=torch.float64)), r"W_1.to\(input\)"),
    (dict(W_1=torch.randn(3, 5, device="meta")), r"W_1.to\(input\)"),
    (dict(W_1=torch.randn(3, 5).numpy()), "W_1: expected a torch.Tensor"),
    (dict(W_2=torch.randn(4, 3)), "W_2.shape"),
    (dict(W_2=torch.randn(5)), "W_2.shape"),
    (dict(W_2=torch.randn(5, 3, dtype=torch.float64)), r"W_2.to\(input\)"),
    (dict(W_2=torch.randn(5, 3, device="meta")), r"W_2.to\(input\)"),
    (dict(W_2=torch.randn(5, 3).half()), "W_2.dtype"),
    (dict(W_2=torch.randn(5, 3).tolist()), "W_2: expected a torch.Tensor"),
    (dict(W_2=None), "W_2: expected a torch.Tensor"),  # was an AttributeError from W_2.shape
]


@pytest.mark.parametrize("change, match", FAST_PATH_INVALID)
def test_invalid_ffn_inputs_raise_through_the_fast_check(change, match):
    Y, W_1, W_2 = _y_w1_w2(**change)
    with pytest.raises(ValueError, match=match):
        block_output_jacobians_structured(Y, W_1, W_2)
    with pytest.raises(ValueError, match=match):
        ffn_jacobian_W1_structured(Y, W_1, W_2)


@pytest.mark.parametrize("shape", [(4, 3), (2, 4, 3)])
def test_fast_and_step_by_step_checks_return_the_same_rows(shape):
    """_check_ffn accepts the usual call in one test (no b_1) and otherwise checks step by step; same rows."""
    from curvwatch.closed_form.jacobians import _check_ffn

    Y, W_1, W_2 = _y_w1_w2(Y=torch.randn(*shape))
    fast = _check_ffn(Y, W_1, W_2, None)
    slow = _check_ffn(Y, W_1, W_2, torch.zeros(5))  # a b_1 skips the fast accept
    assert fast.shape == slow.shape == (Y.numel() // 3, 3) and fast.stride() == slow.stride()
    assert torch.equal(fast, slow) and fast.data_ptr() == Y.data_ptr()


# ----------------------------------------------------------------------------------------------------------
# benchmark smoke test


def test_benchmark_quick_smoke(tmp_path):
    from benchmarks import bench_jacobians

    out = tmp_path / "bench.json"
    result = bench_jacobians.main(["--quick", "--threads", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result))
    for key in ("name", "config", "environment", "published", "results"):
        assert key in data, key
    assert data["config"]["quick"] is True
    rows = data["results"]
    quantities = {r["quantity"] for r in rows}
    assert {"dZ/dW_2", "dZ/dW_1", "LN Jacobian"} <= quantities
    n_ratios = 0
    for r in rows:
        for key in ("size", "quantity", "form", "status", "closed_form_s", "baselines", "max_rel_err"):
            assert key in r, (key, r)
        if r["status"] != "measured":
            assert r.get("reason"), r
            continue
        assert math.isfinite(r["closed_form_s"]) and r["closed_form_s"] > 0
        assert r["max_rel_err"] < 1e-4, r
        for name, b in r["baselines"].items():
            assert b["status"] in ("measured", "extrapolated", "skipped"), (name, b)
            if b["status"] == "skipped":
                assert b.get("reason"), (name, b)
                continue
            assert b["extrapolated"] == (b["status"] == "extrapolated"), (name, b)
            assert math.isfinite(b["ratio"]) and b["ratio"] > 0, (name, b)
            n_ratios += 1
    assert n_ratios >= 9
    # the shrunk "realistic" size in quick mode exercises the row-subset / extrapolation path
    assert any(b.get("extrapolated") for r in rows for b in r["baselines"].values())
