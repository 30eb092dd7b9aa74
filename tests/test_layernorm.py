"""Closed-form LayerNorm Jacobian/Hessian and statistics against torch.func (curvwatch.reference)."""

from __future__ import annotations

import pytest
import torch

from curvwatch import reference
from curvwatch.closed_form import layernorm
from tests.cases import DT, LN_CASES, batch_shape, case_id, rand
from tests.utils import TOL, assert_close_report


def _inputs(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    X = rand(gen, *batch_shape(case), case["L"], case["n"])
    w = rand(gen, case["n"]) if case["affine"] else None
    b = rand(gen, case["n"]) if case["affine"] else None
    G = rand(gen, *X.shape)
    return X, w, b, G


@pytest.mark.parametrize("case", LN_CASES, ids=case_id)
def test_dense_jacobian_and_hessian_match_autograd(case):
    X, w, b, G = _inputs(case)
    ref = reference.layernorm_dense(X, eps=case["eps"], weight=w, bias=b)
    out = layernorm(X, eps=case["eps"], weight=w, bias=b, grad_output=G, dense=True)
    assert_close_report(out["dense/jacobian"], ref["jacobian"], TOL["float64"], name="jacobian")
    assert_close_report(out["dense/hessian"], ref["hessian"], TOL["float64"], name="hessian")


@pytest.mark.parametrize("case", LN_CASES, ids=case_id)
def test_exact_norms_match_dense(case):
    X, w, b, G = _inputs(case, seed=1)
    out = layernorm(X, eps=case["eps"], weight=w, grad_output=G)
    unit = reference.dense_to_norms(reference.layernorm_dense(X, eps=case["eps"]))
    assert_close_report(out["jacobian_norm"], unit["jacobian"], TOL["float64"], name="jacobian_norm")
    assert_close_report(out["hessian_norm"], unit["hessian"], TOL["float64"], name="hessian_norm")
    Hc = reference.layernorm_contracted_hessian(X, G, eps=case["eps"], weight=w)
    assert_close_report(
        out["contracted_hessian_norm"], reference.spectral_norm(Hc), TOL["float64"], name="contracted"
    )
    assert out["contracted_hessian_norm"] <= out["contracted_hessian_bound"]
    affine = reference.dense_to_norms(reference.layernorm_dense(X, eps=case["eps"], weight=w))
    assert affine["jacobian"] <= out["jacobian_norm_affine_bound"] * (1 + 1e-12)
    assert affine["hessian"] <= out["hessian_norm_affine_bound"] * (1 + 1e-12)


def test_sheet_constants_with_eps_zero():
    """||J|| s_min = 1 and ||H|| s_min^2 = sqrt((n-2)/n) (n >= 4), sqrt(2/3) (n = 3), at every scale."""
    gen = torch.Generator().manual_seed(3)
    for n, const in ((8, (6 / 8) ** 0.5), (3, (2 / 3) ** 0.5)):
        X = rand(gen, 4, n)
        for c in (1.0, 1e-2, 1e-3):
            out = layernorm(c * X, eps=0.0)
            s_min = out["var_min"].sqrt()
            assert abs(float(out["jacobian_norm"] * s_min) - 1.0) < 1e-12
            assert abs(float(out["hessian_norm"] * s_min**2) - const) < 1e-12


def test_variance_statistics_and_collapse():
    X = torch.tensor([[1.0, -1.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0]], dtype=DT)
    out = layernorm(X, eps=1e-5)
    assert float(out["var_min"]) == 0.0
    assert torch.isclose(out["inv_var_max"], torch.tensor(1e5, dtype=DT))
    assert torch.isclose(out["inv_std_max"], torch.tensor(1e5**0.5, dtype=DT))
    assert float(out["collapsed_fraction"]) == 0.5
    # eps = 0 and a constant row: infinite curvature reported, never NaN
    out0 = layernorm(X, eps=0.0, grad_output=torch.ones_like(X))
    assert all(not torch.isnan(v).any() for v in out0.values())
    assert torch.isinf(out0["inv_var_max"]) and torch.isinf(out0["hessian_norm"])


def test_row_mask_excludes_padding():
    X = torch.randn(2, 3, 5, dtype=DT)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    ref = layernorm(X, row_mask=mask)
    X2 = X.clone()
    X2[0, 2] = 1e-6 * X2[0, 2]  # a collapsed padding row must not count
    out = layernorm(X2, row_mask=mask)
    for k in ref:
        assert torch.equal(ref[k], out[k]), k
    with pytest.raises(ValueError, match="row_mask"):
        layernorm(X, row_mask=torch.ones(3, 3, dtype=torch.bool))


def test_float32_agrees_with_float64():
    X, w, b, G = _inputs(dict(B=2, L=4, n=16, affine=True), seed=4)
    o64 = layernorm(X, weight=w, grad_output=G)
    o32 = layernorm(X.float(), weight=w.float(), grad_output=G.float())
    for k, v in o64.items():
        assert_close_report(o32[k], v, TOL["float32"], name=k)
