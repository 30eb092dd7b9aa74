"""The key table (curvwatch.keys): every key a real evaluation produces has a row, the reductions are those the
monitor used before the table existed, and docs/metrics.md and the callback's docstring cannot drift from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from curvwatch import keys
from curvwatch.adapters import find_blocks
from curvwatch.callback import CurvatureMonitor
from curvwatch.capture import Capture
from curvwatch.engine import Engine
from curvwatch.kinds import KINDS
from curvwatch.models.gpt import GPT, GPTConfig

DOCS = Path(__file__).parents[1] / "docs" / "metrics.md"


def _spelling_rule(key: str) -> str:
    """The cross-rank reduction as the monitor guessed it from a key's spelling before the key table."""
    pieces = key.split("/")
    if pieces[0] == "residual":
        return "max"
    last = pieces[-2] if len(pieces) > 1 and re.match(r"^h\d+$", pieces[-1]) else pieces[-1]
    tokens = last.split("_")
    return "max" if "max" in tokens else "min" if "min" in tokens else "mean"


def _evaluated_keys() -> set[str]:
    """Every relative key one evaluation of a 2-layer GPT produces with pairs='all' (the richest key set)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8, d_ff=16))
    with Capture(find_blocks(model), max_tokens=12) as capture:
        model(torch.randint(0, 11, (2, 6))).square().mean().backward()
    evaluation = Engine(pairs="all", dtype="float64").evaluate(capture.blocks())
    return {k for result in evaluation.results.values() for k in result}


@pytest.mark.parametrize(
    "key, op",
    [
        ("hessian/QQ/h0", "mean"),
        ("term/x_norm6", "mean"),
        ("ln/inv_var_max", "max"),
        ("ln/var_min", "min"),
        ("ln/var_min_over_eps", "min"),
        ("term/attn_entropy/h1", "mean"),
        ("ffn/dead_fraction", "mean"),
        ("residual/functional/W1W2", "max"),
        ("hessian/KK/g1", "mean"),
    ],
)
def test_reduce_op(key, op):
    assert keys.reduce_op(key) == op


def test_every_evaluated_key_has_a_row_with_the_reduction_it_always_had():
    produced = _evaluated_keys()
    assert len(produced) > 60
    for key in sorted(produced):
        spec = keys.spec_of(key)
        assert spec is not None, f"{key} has no row in the key table"
        assert keys.reduce_op(key) == _spelling_rule(key), key


def test_unknown_and_derived_keys_are_refused_by_name():
    with pytest.raises(ValueError, match="'term/made_up' has no row in the key table"):
        keys.reduce_op("term/made_up")
    with pytest.raises(ValueError, match="derived after the reduction"):
        keys.reduce_op("hessian/max")


def test_docs_tables_are_the_generated_ones():
    text = DOCS.read_text()
    assert keys.render_docs(text) == text, "docs/metrics.md drifted from the key table: run python -m curvwatch.keys"


def test_every_table_section_has_a_marker_and_markers_name_sections():
    with pytest.raises(ValueError, match="no marker for the key table sections"):
        keys.render_docs("")
    with pytest.raises(ValueError, match="names no key table section"):
        keys.render_docs("<!-- keys:nope -->\n<!-- /keys -->")


def test_callback_docstring_lists_every_summary_key():
    doc = CurvatureMonitor.__doc__
    summary = [r.pattern for r in keys.key_table() if r.pattern.startswith("summary/")]
    missing = [p for p in summary if f"{{p}}{p}" not in doc and p != "summary/heatmap"]
    assert not missing, f"the 'Logged metrics' section of CurvatureMonitor misses {missing}"
    assert "{p}summary/heatmap" in doc


def test_each_kind_declares_its_keys_and_pairs():
    for kind in KINDS.values():
        assert kind.keys, kind.name
        assert set(kind.exact_pairs) <= set(kind.pairs)
        assert all(s.reduce in ("max", "min") for s in kind.summaries)
