"""Closed-form whole-block Hessian (post- and pre-LN) against torch.func (curvwatch.reference)."""

from __future__ import annotations

import pytest
import torch

from curvwatch import reference
from curvwatch.closed_form import OutputLoss, transformer_block
from curvwatch.closed_form.settings import EXACT
from tests.cases import BLOCK_CASES, batch_shape, case_id, output_loss, rand
from tests.utils import TOL, assert_close_report


def _params(gen, case):
    d, H, d_K, f = case["d"], case["H"], case["d_K"], case["f"]
    d_V = d // H
    p = {
        "n_heads": H,
        "W_Q": rand(gen, d, H * d_K),
        "W_K": rand(gen, d, H * d_K),
        "W_V": rand(gen, d, H * d_V),
        "W_1": rand(gen, d, f),
        "W_2": rand(gen, f, d),
        "b_1": rand(gen, f),
        "ln1_weight": rand(gen, d),
        "ln2_bias": rand(gen, d),
    }
    if H > 1:
        p["W_O"] = rand(gen, H * d_V, d)
        p["b_Q"] = rand(gen, H * d_K)
    return p


@pytest.mark.parametrize("case", BLOCK_CASES, ids=case_id)
def test_all_block_pairs_match_autograd(case):
    gen = torch.Generator().manual_seed(0)
    X = rand(gen, *batch_shape(case), case["L"], case["d"])
    p = _params(gen, case)
    loss = output_loss(gen, case, tuple(X.shape))
    common = dict(norm=case["norm"], activation=case["activation"], eps=case["eps"], causal=case["causal"])
    ref = reference.transformer_block_blocks(X, p, **common, loss=loss)
    out = transformer_block(X, p, **common, dense=True, lanczos=EXACT, loss=loss)
    norms = reference.dense_to_norms(ref)
    checked = 0
    for key, mat in ref.items():
        if mat.ndim != 2:
            continue
        checked += 1
        assert_close_report(out[f"dense/{key}"], mat, TOL["float64"], name=key, atol=1e-12)
        assert_close_report(out[key], norms[key], TOL["float64"], name=key, atol=1e-12)
    assert checked >= 45  # 15 pairs x 3 kinds


def test_functional_vv_nonzero_in_full_block():
    """Sheet §6: inside the block, LN curvature makes H_f(VV) != 0 (it is 0 for attention alone)."""
    gen = torch.Generator().manual_seed(4)
    case = dict(d=4, H=1, d_K=2, f=6)
    X = rand(gen, 5, 4)
    out = transformer_block(X, _params(gen, case), loss=OutputLoss(target=rand(gen, 5, 4)), pairs=["VV"], lanczos=EXACT)
    assert float(out["functional/VV"]) > 1e-6


def test_bad_params():
    X = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="missing"):
        transformer_block(X, {"W_Q": torch.randn(4, 2, dtype=torch.float64)}, loss=OutputLoss(target=X))
    with pytest.raises(ValueError, match="norm"):
        transformer_block(X, {}, norm="sandwich", loss=OutputLoss(target=X))
