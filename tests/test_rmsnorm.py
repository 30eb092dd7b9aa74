"""Closed-form RMSNorm Jacobian/Hessian, statistics and RMSNormRows products against torch.func."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import grad, jvp, vjp

from curvwatch import reference
from curvwatch.closed_form.rmsnorm import RMSNormRows, rmsnorm
from curvwatch.reference.rmsnorm import rmsnorm_contracted_hessian, rmsnorm_dense
from tests.cases import DT, case_id, rand
from tests.utils import TOL, assert_close_report

# weight: "none" (no affine), "random" (LLaMA-style w), "gemma" ((1 + w), weight_offset = 1.0);
# mask: drop a seeded random subset of rows (never all); scale: multiplies X (small scale + large eps: delta -> 1)
RMS_CASES = [
    dict(B=None, L=1, n=8, eps=1e-6, weight="none", mask=False, scale=1.0),  # L = 1
    dict(B=None, L=3, n=4, eps=0.0, weight="none", mask=False, scale=1.0),
    dict(B=2, L=3, n=3, eps=1e-5, weight="random", mask=True, scale=1.0),
    dict(B=None, L=3, n=2, eps=0.3, weight="none", mask=False, scale=1.0),
    dict(B=None, L=4, n=2, eps=2.0, weight="random", mask=False, scale=0.5),  # n = 2 with delta > 1/3
    dict(B=None, L=3, n=1, eps=0.1, weight="random", mask=False, scale=1.0),
    dict(B=None, L=2, n=1, eps=0.0, weight="none", mask=False, scale=1.0),  # sign(x): J = H = 0
    dict(B=2, L=2, n=8, eps=0.0, weight="gemma", mask=True, scale=1.0),
    dict(B=None, L=3, n=3, eps=1.0, weight="gemma", mask=False, scale=0.3),
    dict(B=2, L=1, n=8, eps=1e-6, weight="gemma", mask=False, scale=1.0),  # batched L = 1
]


def _row_mask(gen: torch.Generator, B: int | None, L: int) -> torch.Tensor:
    mask = torch.rand(B or 1, L, generator=gen) < 0.6
    mask[0, 0] = True  # never empty
    return mask if B else mask[0]


def _weight(gen: torch.Generator, kind: str, n: int) -> tuple[torch.Tensor | None, float]:
    if kind == "none":
        return None, 0.0
    w = rand(gen, n)
    return (w, 0.0) if kind == "random" else (0.3 * w, 1.0)


def _problem(case: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    shape = ((case["B"],) if case["B"] else ()) + (case["L"], case["n"])
    w, c = _weight(gen, case["weight"], case["n"])
    return dict(
        X=rand(gen, *shape, scale=case["scale"]),
        G=rand(gen, *shape),
        eps=case["eps"],
        weight=w,
        weight_offset=c,
        row_mask=_row_mask(gen, case["B"], case["L"]) if case["mask"] else None,
    )


def _adversarial(name: str) -> dict:
    """Hand-built rows where cancellation, huge ranges or degenerate directions could break the closed forms."""
    gen = torch.Generator().manual_seed(7)
    X, G, eps = rand(gen, 3, 5), rand(gen, 3, 5), 1e-6
    if name == "near_zero_row":  # one row far below sqrt(eps): delta ~ 1, rho ~ 0
        X[1] *= 1e-8
    elif name == "zero_row":  # exactly zero with eps > 0: J = I/sqrt(eps), H = 0
        X[2] = 0.0
        eps = 1e-5
    elif name == "huge_entry":  # one entry dominates every row: y ~ sqrt(n) e_0
        X[:, 0] = 1e6
    elif name == "constant_rows":  # eps = 0, rows c * 1
        X = torch.tensor([[2.0] * 5, [-0.5] * 5, [1e-3] * 5], dtype=DT)
        eps = 0.0
    elif name == "tiny_rows_eps0":  # scale invariance under eps = 0: curvature ~ 1/r^2 = 1e16
        X *= 1e-8
        eps = 0.0
    elif name == "g_parallel_y":  # b = 0: the 2x2 block is diagonal
        G = 3.0 * X
    elif name == "g_perp_y":  # t = 0
        G = G - (G * X).sum(-1, keepdim=True) / (X * X).sum(-1, keepdim=True) * X
    elif name == "delta_one_third":  # 1 - 3 delta = 0: the hypot's first term vanishes
        X = X / (X * X).mean(-1, keepdim=True).sqrt()  # m = 1, so delta = eps / (1 + eps)
        eps = 0.5
    return dict(X=X, G=G, eps=eps, weight=None, weight_offset=0.0, row_mask=None)


ADVERSARIAL = [
    "near_zero_row",
    "zero_row",
    "huge_entry",
    "constant_rows",
    "tiny_rows_eps0",
    "g_parallel_y",
    "g_perp_y",
    "delta_one_third",
]


@pytest.fixture(params=RMS_CASES, ids=case_id)
def problem(request):
    return _problem(request.param, seed=RMS_CASES.index(request.param))


@pytest.fixture(params=ADVERSARIAL)
def adversarial(request):
    return _adversarial(request.param)


def _kept(p: dict, t: torch.Tensor) -> torch.Tensor:
    """The kept rows of an ``X``-shaped tensor, ``(N, n)``."""
    n = t.shape[-1]
    if p["row_mask"] is None:
        return t.reshape(-1, n)
    return t.reshape(-1, n)[p["row_mask"].reshape(-1)]


def _scales(p: dict) -> tuple[float, float]:
    """``max|c + w|`` and ``1/min r^2`` over the kept rows: the natural magnitudes behind the ``atol`` floors."""
    rows = _kept(p, p["X"])
    inv_r2 = 1.0 / float(((rows * rows).mean(-1) + p["eps"]).min())
    w = p["weight"]
    return (1.0 if w is None else float((p["weight_offset"] + w).abs().max())), inv_r2


def _check_against_reference(p: dict) -> None:
    kw = dict(eps=p["eps"], weight=p["weight"], weight_offset=p["weight_offset"])
    out = rmsnorm(p["X"], grad_output=p["G"], row_mask=p["row_mask"], dense=True, **kw)
    smax, inv_r2 = _scales(p)
    floor = 1e-3 * TOL["float64"]  # absolute floor, relative to the natural scale: exact zeros vs round-off
    j_unit, h_unit = floor * math.sqrt(inv_r2), floor * inv_r2  # ||J|| ~ 1/r, ||H|| ~ 1/r^2
    j_atol, h_atol = smax * j_unit, smax * h_unit
    ref = rmsnorm_dense(p["X"], row_mask=p["row_mask"], **kw)
    assert_close_report(out["dense/jacobian"], ref["jacobian"], TOL["float64"], name="jacobian", atol=j_atol)
    assert_close_report(out["dense/hessian"], ref["hessian"], TOL["float64"], name="hessian", atol=h_atol)
    # exact norms of the normalisation (no affine)
    unit = reference.dense_to_norms(rmsnorm_dense(p["X"], eps=p["eps"], row_mask=p["row_mask"]))
    assert_close_report(out["jacobian_norm"], unit["jacobian"], TOL["float64"], name="jacobian_norm", atol=j_unit)
    assert_close_report(out["hessian_norm"], unit["hessian"], TOL["float64"], name="hessian_norm", atol=h_unit)
    # affine bounds
    affine = reference.dense_to_norms(ref)
    assert affine["jacobian"] <= out["jacobian_norm_affine_bound"] * (1 + 1e-12) + j_atol
    assert affine["hessian"] <= out["hessian_norm_affine_bound"] * (1 + 1e-12) + h_atol
    # contracted Hessian of the affine RMSNorm, on the kept rows
    Xk, Gk = _kept(p, p["X"]), _kept(p, p["G"])
    Hc = rmsnorm_contracted_hessian(Xk, Gk, **kw)
    c_atol = h_atol * float(Gk.abs().max())
    exact = reference.spectral_norm(Hc)
    assert_close_report(out["contracted_hessian_norm"], exact, TOL["float64"], name="contracted", atol=c_atol)
    assert out["contracted_hessian_norm"] <= out["contracted_hessian_bound"] * (1 + 1e-12)
    assert exact <= out["contracted_hessian_bound"] * (1 + 1e-12) + c_atol


def test_closed_forms_match_torch_func(problem):
    _check_against_reference(problem)


def test_adversarial_rows_match_torch_func(adversarial):
    _check_against_reference(adversarial)


def test_statistics_match_definitions(problem):
    p = problem
    out = rmsnorm(p["X"], eps=p["eps"], weight=p["weight"], weight_offset=p["weight_offset"], row_mask=p["row_mask"])
    rows = _kept(p, p["X"])
    ms = (rows * rows).mean(-1)
    eps = p["eps"]
    expected = {
        "ms_min": ms.min(),
        "ms_mean": ms.mean(),
        "inv_rms_max": 1 / (ms + eps).sqrt().min(),
        "inv_ms_max": 1 / (ms + eps).min(),
        "ms_min_over_eps": ms.min() / eps if eps > 0 else torch.tensor(math.inf, dtype=DT),
        "collapsed_fraction": ((ms <= 10 * eps) if eps > 0 else (ms == 0)).to(DT).mean(),
    }
    for key, value in expected.items():
        if torch.isinf(value):
            assert torch.isinf(out[key]), key
        else:
            assert_close_report(out[key], value, TOL["float64"], name=key)
    for key, value in out.items():
        assert value.ndim == 0 and value.dtype == DT and not value.requires_grad, key


def test_collapse_and_eps_zero_report_inf_never_nan():
    X = torch.tensor([[1.0, -1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=DT)
    out = rmsnorm(X, eps=1e-5)
    assert float(out["ms_min"]) == 0.0 and float(out["ms_mean"]) == 0.75
    assert torch.isclose(out["inv_ms_max"], torch.tensor(1e5, dtype=DT))
    assert torch.isclose(out["inv_rms_max"], torch.tensor(1e5**0.5, dtype=DT))
    assert float(out["collapsed_fraction"]) == 0.5 and float(out["ms_min_over_eps"]) == 0.0
    G = torch.ones_like(X)
    out0 = rmsnorm(X, eps=0.0, grad_output=G)
    assert all(not torch.isnan(v).any() for v in out0.values())
    for key in ("inv_ms_max", "inv_rms_max", "jacobian_norm", "hessian_norm", "contracted_hessian_norm"):
        assert torch.isinf(out0[key]), key
    assert float(out0["collapsed_fraction"]) == 0.5 and torch.isinf(out0["ms_min_over_eps"])
    G[1] = 0.0  # nothing contracted on the dead row: finite, and equal to the live row's value
    out1 = rmsnorm(X, eps=0.0, grad_output=G)
    live = rmsnorm(X[:1], eps=0.0, grad_output=G[:1])
    assert torch.equal(out1["contracted_hessian_norm"], live["contracted_hessian_norm"])
    assert torch.isfinite(out1["contracted_hessian_bound"])
    with pytest.raises(ValueError, match="Pass eps > 0 or mask the row out"):
        rmsnorm(X, eps=0.0, dense=True)
    # the collapse threshold is inclusive: m = 10 eps exactly counts
    edge = rmsnorm(torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]], dtype=DT), eps=0.1)
    assert float(edge["collapsed_fraction"]) == 0.5


def test_contracted_bound_is_nearly_attained():
    """Rows with m << eps and g' parallel to y: ||S|| = 3 delta |t| / (n r^2) against 4 |t| / (n r^2): ratio -> 3/4."""
    gen = torch.Generator().manual_seed(9)
    X = rand(gen, 3, 6, scale=1e-4)
    out = rmsnorm(X, eps=1.0, grad_output=X)
    ratio = float(out["contracted_hessian_norm"] / out["contracted_hessian_bound"])
    assert 0.75 - 1e-6 < ratio <= 0.75


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_eps_zero_constants_are_scale_invariant(n):
    """eps = 0: ||J|| r_min = 1 (n >= 2), ||H|| r_min^2 = sqrt((n-1)/n) (n >= 3), 1 (n = 2); n = 1: both 0."""
    gen = torch.Generator().manual_seed(n)
    X = rand(gen, 4, n)
    j_const = 0.0 if n == 1 else 1.0
    h_const = {1: 0.0, 2: 1.0}.get(n, ((n - 1) / n) ** 0.5)
    for c in (1.0, 1e-3, 1e4):
        out = rmsnorm(c * X, eps=0.0)
        r_min = out["ms_min"].sqrt()
        assert abs(float(out["jacobian_norm"] * r_min) - j_const) < 1e-12
        assert abs(float(out["hessian_norm"] * r_min**2) - h_const) < 1e-12


def test_row_mask_excludes_padding():
    gen = torch.Generator().manual_seed(5)
    X, G = rand(gen, 2, 3, 5), rand(gen, 2, 3, 5)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    ref = rmsnorm(X, grad_output=G, row_mask=mask)
    X2, G2 = X.clone(), G.clone()
    X2[0, 2] = 0.0  # a collapsed padding row must not count
    X2[1, 1] = 1e6
    G2[0, 2] = 1e9
    out = rmsnorm(X2, grad_output=G2, row_mask=mask)
    for k in ref:
        assert torch.equal(ref[k], out[k]), k
    unbatched = rmsnorm(X[1], grad_output=G[1], row_mask=mask[1])  # (L,) mask for an (L, n) input
    assert torch.equal(unbatched["ms_min"], rmsnorm(X[1][mask[1]])["ms_min"])


# ----------------------------------------------------------------------------------------------------
# Bounds on random and adversarial instances (hypothesis)
# ----------------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    N=st.integers(1, 3),
    n=st.integers(1, 8),
    log_scale=st.floats(-8, 6),
    eps=st.sampled_from([0.0, 1e-6, 1e-2, 1.0]),
    weight=st.sampled_from(["none", "random", "gemma"]),
    g_kind=st.sampled_from(["random", "parallel", "perp", "nearly_parallel"]),
    seed=st.integers(0, 10_000),
)
def test_bounds_hold_and_norms_exact_on_random_instances(N, n, log_scale, eps, weight, g_kind, seed):
    gen = torch.Generator().manual_seed(seed)
    X = rand(gen, N, n, scale=10.0**log_scale)
    w, c = _weight(gen, weight, n)
    G = rand(gen, N, n)
    gam = torch.ones(n, dtype=DT) if w is None else c + w
    Gp = G * gam  # g' = (c + w) g
    if g_kind == "parallel":
        Gp = 2.0 * X / X.norm(dim=-1, keepdim=True)
    elif g_kind == "perp":
        Gp = Gp - (Gp * X).sum(-1, keepdim=True) / (X * X).sum(-1, keepdim=True) * X
    elif g_kind == "nearly_parallel":
        Gp = X / X.norm(dim=-1, keepdim=True) + 1e-7 * Gp
    G = Gp / torch.where(gam.abs() > 1e-12, gam, torch.ones_like(gam))
    p = dict(X=X, G=G, eps=eps, weight=w, weight_offset=c, row_mask=None)
    _check_against_reference(p)


# ----------------------------------------------------------------------------------------------------
# RMSNormRows: forward against torch.nn.RMSNorm, products against torch.func
# ----------------------------------------------------------------------------------------------------


ROWS_CASES = [
    dict(shape=(5,), eps=1e-6, weight="none"),
    dict(shape=(3, 5), eps=0.0, weight="random"),
    dict(shape=(2, 3, 4), eps=0.1, weight="gemma"),
    dict(shape=(2, 2, 3, 1), eps=0.5, weight="random"),
]


@pytest.fixture(params=ROWS_CASES, ids=case_id)
def rows_problem(request):
    case = request.param
    gen = torch.Generator().manual_seed(ROWS_CASES.index(case) + 100)
    shape = case["shape"]
    w, c = _weight(gen, case["weight"], shape[-1])
    tensors = {k: rand(gen, *shape) for k in ("X", "dx", "gy")}
    return dict(eps=case["eps"], weight=w, weight_offset=c, **tensors)


def _forward(p: dict):
    def f(x: torch.Tensor) -> torch.Tensor:
        return RMSNormRows(x, p["eps"], p["weight"], p["weight_offset"]).forward()

    return f


def test_forward_matches_torch_nn_rmsnorm(rows_problem):
    p = rows_problem
    n = p["X"].shape[-1]
    affine = p["weight"] is not None
    module = torch.nn.RMSNorm(n, eps=p["eps"], elementwise_affine=affine, dtype=DT)
    if affine:
        with torch.no_grad():
            module.weight.copy_(p["weight_offset"] + p["weight"])  # Gemma's (1 + w) folded into the weight
    with torch.no_grad():
        expected = module(p["X"])
    assert_close_report(_forward(p)(p["X"]), expected, TOL["float64"], name="forward")


def test_rows_jvp_vjp_hvp_match_torch_func(rows_problem):
    p = rows_problem
    f = _forward(p)
    rows = RMSNormRows(p["X"], p["eps"], p["weight"], p["weight_offset"])
    _, jvp_ref = jvp(f, (p["X"],), (p["dx"],))
    assert_close_report(rows.jvp(p["dx"]), jvp_ref, TOL["float64"], name="jvp")
    _, pullback = vjp(f, p["X"])
    assert_close_report(rows.vjp(p["gy"]), pullback(p["gy"])[0], TOL["float64"], name="vjp")
    contracted_grad = grad(lambda x: (p["gy"] * f(x)).sum())
    _, hvp_ref = jvp(contracted_grad, (p["X"],), (p["dx"],))
    assert_close_report(rows.hvp(p["gy"], p["dx"]), hvp_ref, TOL["float64"], name="hvp")
    # a leading batch of tangents broadcasts against the row statistics
    dxs = torch.stack([p["dx"], 2 * p["dx"] - 1])  # (2, ..., n)
    assert_close_report(rows.jvp(dxs)[1], 2 * jvp_ref - rows.jvp(torch.ones_like(p["dx"])), TOL["float64"], "batch")


def test_rmsnorm_rows_matches_reference_forward():
    gen = torch.Generator().manual_seed(11)
    X, w = rand(gen, 2, 3, 6), rand(gen, 6)
    rows = RMSNormRows(X, 1e-6, w, 1.0)
    expected = X * torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w)  # Gemma, as written there
    assert_close_report(rows.forward(), expected, TOL["float64"], name="gemma forward")


# ----------------------------------------------------------------------------------------------------
# float32, and input validation
# ----------------------------------------------------------------------------------------------------


def test_float32_agrees_with_float64():
    gen = torch.Generator().manual_seed(4)
    X, G, w = rand(gen, 2, 4, 16), rand(gen, 2, 4, 16), 0.3 * rand(gen, 16)
    kw = dict(eps=1e-6, weight_offset=1.0)
    o64 = rmsnorm(X, weight=w, grad_output=G, **kw)
    o32 = rmsnorm(X.float(), weight=w.float(), grad_output=G.float(), **kw)
    assert set(o32) == set(o64)
    for k, v in o64.items():
        assert o32[k].dtype == torch.float32, k
        assert_close_report(o32[k], v, TOL["float32"], name=k)


def test_bad_inputs_raise_clear_errors():
    X = torch.randn(2, 3, 4, dtype=DT)
    with pytest.raises(ValueError, match=r"Invalid weight shape \(3,\)\. Expected \(4,\).*pass the RMSNorm"):
        rmsnorm(X, weight=torch.ones(3, dtype=DT))
    with pytest.raises(ValueError, match=r"Invalid weight shape \(4, 1\)"):
        RMSNormRows(X, 1e-6, torch.ones(4, 1, dtype=DT))
    with pytest.raises(ValueError, match=r"Invalid eps=-1e-06\. Must be a finite number >= 0"):
        rmsnorm(X, eps=-1e-6)
    with pytest.raises(ValueError, match="Invalid eps=nan"):
        RMSNormRows(X, float("nan"))
    with pytest.raises(ValueError, match="needs a weight.*drop weight_offset"):
        rmsnorm(X, weight_offset=1.0)
    with pytest.raises(ValueError, match="Invalid weight_offset=True"):
        rmsnorm(X, weight=torch.ones(4, dtype=DT), weight_offset=True)
    with pytest.raises(ValueError, match="excludes every row.*Keep at least one row"):
        rmsnorm(X, row_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"row_mask must have shape \(B, L\) = \(2, 3\)"):
        rmsnorm(X, row_mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"grad_output must have X's shape \(2, 3, 4\)"):
        rmsnorm(X, grad_output=torch.ones(3, 4, dtype=DT))
    with pytest.raises(ValueError, match="holds NaN or Inf"):
        rmsnorm(torch.full((2, 4), math.nan, dtype=DT))
    # the references validate as well
    with pytest.raises(ValueError, match="keeps no row"):
        rmsnorm_dense(X, row_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"Invalid weight shape \(3,\)\. Expected \(4,\)"):
        rmsnorm_dense(X, weight=torch.ones(3, dtype=DT))
    with pytest.raises(ValueError, match="Invalid eps"):
        rmsnorm_contracted_hessian(X, X, eps=-1.0)
