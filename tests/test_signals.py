"""The cheap terms-only tier (``terms_keys="warnings"``): each kernel computes only what the warning rules read, and
those numbers are the very numbers of the full terms tier (float64, relative tolerance 1e-12: equal up to the last bits;
the attention's signals come from a forward without the values, whose matmul may round differently)."""

from __future__ import annotations

import pytest
import torch

from curvwatch import rules as rules_module
from curvwatch.closed_form import layernorm, multi_head_attention, rmsnorm
from curvwatch.engine import Engine
from curvwatch.kinds import KINDS
from curvwatch.rules import RuleSet, block_quantities
from tests.cases import case_id
from tests.test_attention_modern import MODERN_CASES, _inputs
from tests.test_engine import _captured
from tests.utils import assert_close_report

SIGNAL_TERMS = ("term/x_norm", "term/x_norm6", "term/softmax_jac_norm", "term/wq_norm", "term/wk_norm")


@pytest.mark.parametrize("case", MODERN_CASES, ids=case_id)
def test_attention_signals_are_the_full_tiers_numbers(case):
    """GQA/MQA, rotary, windows, scale, QK-norm, padding, cross-attention, both loss modes."""
    X, W, kw = _inputs(case)
    everything = multi_head_attention(X, W, pairs=("VV",), **kw)
    signals = multi_head_attention(X, W, pairs=("VV",), terms="signals", **kw)
    assert set(signals) <= set(everything)
    for key, value in signals.items():
        assert_close_report(value, everything[key], rtol=1e-12, name=key)
    terms = {k for k in signals if k.startswith("term/")}
    assert terms == {k for k in everything if k.startswith(SIGNAL_TERMS)}  # all of them, nothing else
    assert not any(k.startswith("bound/") for k in signals)
    # what the rules read is complete: every quantity of the full tier's keys comes out of the signals alone
    q_all = block_quantities({f"b/{k}": float(v) for k, v in everything.items()})
    q_sig = block_quantities({f"b/{k}": float(v) for k, v in signals.items()})
    assert q_sig == pytest.approx(q_all, rel=1e-12)


def test_attention_signals_without_the_value_pair_and_bad_terms():
    X, W, kw = _inputs(MODERN_CASES[0])
    out = multi_head_attention(X, W, pairs=(), terms="signals", **kw)
    assert {k.split("/")[0] for k in out} == {"term"}
    with pytest.raises(ValueError, match="Invalid terms='bounds'. Must be True, False or 'signals'"):
        multi_head_attention(X, W, pairs=("VV",), terms="bounds", **kw)


@pytest.mark.parametrize("kernel", [layernorm, rmsnorm], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_norm_stats_only_are_the_full_kernels_statistics(kernel, eps):
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    X[1, 2] = 0.0  # a zero row: infinite inverse statistics at eps = 0
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    kw = dict(eps=eps, weight=torch.randn(6, generator=gen, dtype=torch.float64), row_mask=mask,
              grad_output=torch.randn(3, 5, 6, generator=gen, dtype=torch.float64))  # fmt: skip
    everything, stats = kernel(X, **kw), kernel(X, **kw, stats_only=True)
    assert set(stats) < set(everything) and not any("norm" in k for k in stats)
    for key, value in stats.items():
        assert torch.equal(value, everything[key]), key
    ratio = "var_min_over_eps" if kernel is layernorm else "ms_min_over_eps"
    assert ratio in stats and "collapsed_fraction" in stats


def test_engine_signals_evaluation_leaves_out_what_no_rule_reads():
    blocks = _captured(n_layer=2)
    engine = Engine(dtype="float64")
    everything = engine.evaluate(blocks, terms_only=True).results
    signals = engine.evaluate(blocks, terms_only=True, signal_pairs=RuleSet().exact_pairs).results
    assert sorted(signals) == sorted(n for n in everything if not n.endswith("/ffn"))
    for name, keys in signals.items():
        for key, value in keys.items():
            assert_close_report(value, everything[name][key], rtol=1e-12, name=f"{name} {key}")
    # a rule on the FFN's exact W2W2 brings the FFN blocks back, with that pair
    only_w2 = RuleSet(outer_vv_growth=0, w2w2_growth=1.0).exact_pairs
    w2 = engine.evaluate(blocks, terms_only=True, signal_pairs=only_w2).results
    assert "hessian/W2W2" in w2["layer0/ffn"] and "outer/VV/h0" not in w2["layer0/attn"]
    assert w2["layer0/ffn"]["hessian/W2W2"] == everything["layer0/ffn"]["hessian/W2W2"]
    # signal pairs without terms_only change nothing: a full evaluation computes everything
    full = engine.evaluate(blocks, signal_pairs=("VV",)).results
    assert "hessian/QQ/h0" in full["layer0/attn"] and "layer0/ffn" in full


def test_only_blocks_with_nothing_to_compute_is_an_empty_evaluation():
    ffn_only = [b for b in _captured() if b.spec.kind == "ffn"]
    out = Engine().evaluate(ffn_only, terms_only=True, signal_pairs=())
    assert out.results == {} and not out.failed


def test_rule_set_exact_pairs_follow_the_enabled_rules():
    assert RuleSet().exact_pairs == ("VV",)
    assert RuleSet(outer_vv_growth=0).exact_pairs == ()
    assert RuleSet(w2w2_growth=0.5).exact_pairs == ("VV", "W2W2")
    # every quantity the rules read is in a kind's signal keys or one of these pairs
    assert set(rules_module._GROWTH) == {"logit", "outer_VV", "W2W2"}
    assert {k for k, kind in KINDS.items() if kind.signal_kwargs is None} == {"ffn", "gated_ffn"}


def test_rules_split_keys_at_their_first_category():
    """``.../bound/outer/VV`` and ``.../residual/outer/VV`` are not the ``outer/VV`` of a block ``.../bound``."""
    from curvwatch import keys

    firsts = {spec.pattern.split("/")[0] for kind in KINDS.values() for spec in kind.keys}
    firsts |= {spec.pattern.split("/")[0] for name in dir(keys) if isinstance(getattr(keys, name), (list, tuple))
               for spec in getattr(keys, name) if hasattr(spec, "pattern")}  # fmt: skip
    assert firsts - {"summary", "ffn"} <= set(rules_module.CATEGORIES)
    q = block_quantities({"layer0/attn/bound/outer/VV/h0": 9e9, "layer0/attn/residual/outer/VV/h0": 1e-3,
                          "layer0/attn/outer/VV/h0": 2.0, "layer0/attn/ratio/outer/VV": 5.0,
                          "layer0/ffn/hessian/W2W2": 3.0, "layer0/ffn/ffn/dead_fraction": 0.5,
                          "layer0/ffn/bound/hessian/W2W2": 8.0})  # fmt: skip
    assert q == {("layer0/attn", "outer_VV"): 2.0, ("layer0/ffn", "W2W2"): 3.0}
