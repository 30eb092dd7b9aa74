"""Generated documentation cannot drift from the code: docs/design.md's signatures and kinds table."""

from __future__ import annotations

from pathlib import Path

from curvwatch._docgen import render_design

DESIGN = Path(__file__).parents[1] / "docs" / "design.md"


def test_design_doc_is_generated_from_the_code():
    text = DESIGN.read_text()
    assert render_design(text) == text, "docs/design.md drifted from the code: run python -m curvwatch._docgen"
