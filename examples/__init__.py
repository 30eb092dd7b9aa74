"""Examples that use curvwatch; not part of the installed package.

Run them from the repository root: ``python -m examples.demo`` (what ``make demo`` runs) and
``python examples/closed_form_example.py``.
"""
