"""Tests of curvwatch.metrics: the pure aggregation of per-block results."""

from __future__ import annotations

import math

import pytest
import torch

from curvwatch import metrics as M

ATTN = {
    "hessian/QQ/h0": torch.tensor(1e-4),
    "hessian/QQ/h1": torch.tensor(2e-4),
    "hessian/VV/h0": torch.tensor(1e-1),
    "hessian/VV/h1": torch.tensor(4e-2),
    "hessian/VQ/h0": torch.tensor(5.0),  # off-diagonal, dropped by "diagonal"
    "outer/QQ/h0": 1e-4,
    "outer/VV/h0": 1e-1,
    "functional/QQ/h0": 5e-5,
    "functional/VV/h0": 0.0,
    "bound/outer/QQ/h0": 1.0,
    "term/x_norm": 3.0,
}
FFN = {"hessian/W1W1": 1e-2, "hessian/W2W2": 1e-3, "outer/W1W1": 1e-2, "functional/W1W1": 2e-2}
LN = {"ln/var_min": 1e-3, "ln/inv_var_max": 900.0, "ln/var_min_over_eps": 100.0}


def test_pair_parsing():
    assert M.pair_of("bound/outer/QQ/h3") == "QQ"
    assert M.pair_of("hessian/QKV/h0") == "QKV"
    assert M.pair_of("term/inv_L3") is None
    assert M.pair_of("ln/var_min") is None
    assert [M.is_diagonal_pair(p) for p in ("VV", "W2W2", "W1W2", "QK", "QKV")] == [
        True,
        True,
        False,
        False,
        False,
    ]


def test_select_pairs_keeps_pairless_keys():
    diag = M.select_pairs(ATTN, "diagonal")
    assert "hessian/VQ/h0" not in diag and "hessian/QQ/h0" in diag and "term/x_norm" in diag
    assert set(M.select_pairs(ATTN, "all")) == set(ATTN)
    only_vv = M.select_pairs(ATTN, ["VV"])
    assert (
        "hessian/VV/h0" in only_vv and "hessian/QQ/h0" not in only_vv and "bound/outer/QQ/h0" not in only_vv
    )


def test_block_norm_is_largest_hessian_pair_norm():
    assert M.block_norm(M.select_pairs(ATTN, "diagonal")) == pytest.approx(0.1)
    assert M.block_norm(ATTN) == pytest.approx(5.0)  # VQ included when not filtered; bounds never count
    assert M.block_norm(LN) is None
    assert M.block_norms({"a": FFN, "b": LN}) == {"a": pytest.approx(1e-2)}


def test_log10_spread():
    assert M.log10_spread([1.0, 10.0, 1000.0]) == pytest.approx(3.0)
    assert M.log10_spread([2.0]) == 0.0
    assert M.log10_spread([0.0, math.nan, 5.0, 50.0]) == pytest.approx(1.0)  # non-positive and nan ignored
    assert math.isnan(M.log10_spread([]))


def test_ratios():
    ratios = M.vv_qq_ratios(ATTN)
    assert ratios == {"ratio/VV_QQ/h0": pytest.approx(1000.0), "ratio/VV_QQ/h1": pytest.approx(200.0)}
    assert M.vv_qq_ratios({"hessian/VV": 1.0, "hessian/QQ": 0.0}) == {"ratio/VV_QQ": math.inf}
    assert M.functional_outer_ratio(FFN) == pytest.approx(2.0)
    assert M.functional_outer_ratio(LN) is None
    derived = M.block_derived(FFN)
    assert derived == {"hessian/max": pytest.approx(1e-2), "ratio/functional_outer": pytest.approx(2.0)}


def test_summarize_model_and_layers():
    results = {
        "layer0/attn": M.select_pairs(ATTN, "diagonal"),
        "layer0/ln_1": LN,
        "layer0/ffn": FFN,
        "layer1/attn": {"hessian/QQ/h0": 10.0, "hessian/VV/h0": 1.0},
        "layer1/ln_1": {"ln/var_min": 1e-6, "ln/inv_var_max": 1e5, "ln/var_min_over_eps": 0.1},
    }
    s = M.summarize(results)
    assert s["summary/max_hessian"] == pytest.approx(10.0)
    assert s["summary/max_hessian_layer"] == 1.0
    assert s["summary/max_hessian_block"] == 3.0  # position in `results`
    assert s["summary/heterogeneity/model"] == pytest.approx(3.0)  # 10 / 1e-2
    assert s["summary/heterogeneity/layer0"] == pytest.approx(1.0)  # 0.1 / 1e-2; LayerNorms carry no norm
    assert s["summary/heterogeneity/layer1"] == 0.0
    assert s["summary/vv_qq_ratio/median"] == pytest.approx(200.0)  # median of 1000, 200, 0.1
    assert s["summary/functional_outer/max"] == pytest.approx(2.0)
    assert s["summary/ln/inv_var_max"] == pytest.approx(1e5)
    assert s["summary/ln/var_min"] == pytest.approx(1e-6)
    assert all(isinstance(v, float) for v in s.values())
    # explicit layers override the names
    assert M.summarize({"a": FFN}, layers={"a": 7})["summary/max_hessian_layer"] == 7.0
    assert M.summarize({}) == {}
