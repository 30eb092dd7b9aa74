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
