"""Documentation cannot drift from the code: docs/design.md's signatures and kinds table, what docs/metrics.md states
about keys, log levels, W&B sections and strategies, the warning rules of docs/warnings.md, and the keys the user
pages name."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from curvwatch._docgen import render_design
from curvwatch.names import KeySpec

DESIGN = Path(__file__).parents[1] / "docs" / "design.md"


def test_design_doc_is_generated_from_the_code():
    text = DESIGN.read_text()
    assert render_design(text) == text, "docs/design.md drifted from the code: run python -m curvwatch._docgen"


# --------------------------------------------------------------------------------------------------
# docs/metrics.md: the statements a test can keep true
# --------------------------------------------------------------------------------------------------

METRICS = Path(__file__).parents[1] / "docs" / "metrics.md"
WARNINGS = Path(__file__).parents[1] / "docs" / "warnings.md"
#: the pages that name keys: every key they name must exist
KEY_PAGES = [METRICS, WARNINGS, *(Path(__file__).parents[1] / "docs" / f for f in ("dashboard.md", "cadence.md"))]
_NAMED_KEY = re.compile(r"`((?:curv/|curv_hessian/|curv_stability/|summary/)[^`\s]*)`")


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : None if end < 0 else end]


def _known(key: str) -> bool:
    """Whether a key named in the docs exists: a row of the key table or of the per-layer keys (patterns allowed)."""
    from curvwatch import keys

    key = key.rstrip(".,;:").replace(".*", "layer0")  # a regex the docs suggest for a panel
    if key.endswith("/"):  # a prefix such as `curv/layer3/attn/`
        return True
    table = [r.pattern for r in keys.key_table()]
    if key.startswith(("curv_hessian/", "curv_stability/")):
        relative = key[len("curv_") :]
        return any(
            KeySpec(p, "").regex.match(relative.replace("{i}", "0").replace("{part}", "attn"))
            for p in (r.pattern for r in keys.LAYER_KEYS)
        )
    relative = key[len("curv/") :] if key.startswith("curv/") else key
    if relative.startswith("summary/"):
        return relative in table or keys.spec_of(relative) is not None or relative.endswith("...")
    block_key = re.sub(r"^layer(\{i\}|\d+)/[\w{}]+/", "", relative)  # curv/layer3/attn/hessian/max -> hessian/max
    if "*" in block_key or block_key.endswith("..."):
        return True
    return block_key in table or keys.spec_of(block_key) is not None


def test_docs_metrics_key_tables_have_four_cells_per_row():
    """A ``|`` in a key's meaning splits its Markdown table row, even inside a code span."""
    from curvwatch import keys

    for name, table in keys.doc_sections().items():
        split = [row for row in table.splitlines() if row.count("|") != 5]
        assert not split, f"keys:{name}: rows that do not have 4 cells: {split}"


def test_every_key_docs_metrics_names_exists():
    text = METRICS.read_text()
    named = sorted(set(_NAMED_KEY.findall(text)))
    assert len(named) > 40
    unknown = [k for k in named if not _known(k)]
    assert not unknown, f"docs/metrics.md names keys that do not exist: {unknown}"


def test_every_key_the_user_pages_name_exists():
    for page in KEY_PAGES:
        named = sorted(set(_NAMED_KEY.findall(page.read_text())))
        assert named, page
        unknown = [k for k in named if not _known(k)]
        assert not unknown, f"{page.name} names keys that do not exist: {unknown}"


def test_docs_metrics_log_levels_match_the_code():
    from curvwatch import CurvatureMonitor, keys

    text = METRICS.read_text()
    levels = _section(text, "Log levels")
    assert '`"summary"` (default)' in levels
    assert inspect.signature(CurvatureMonitor).parameters["log_level"].default == "summary"
    # every summary key marked "summary" in the generated table is in SUMMARY_LEVEL and the other way round
    marked = set(re.findall(r"^\| `(summary/[^`]+)` \|.*\| summary \|$", text, re.M))
    declared = {k for k in keys.SUMMARY_LEVEL if any(r.pattern == k for r in keys.key_table())}
    assert marked == declared
    # the W&B sections are the prefixes before the first "/" of the names the code gives
    wandb = _section(text, "W&B workspace")
    assert "before the **first** `/`" in wandb
    for section in re.findall(r"^\| `(curv\w*)` \|", wandb, re.M):
        assert section in ("curv", *{keys.layer_key("curv/", r.pattern).split("/")[0] for r in keys.LAYER_KEYS})


def test_docs_metrics_warning_defaults_are_the_code_defaults():
    from curvwatch import CurvatureMonitor
    from curvwatch.rules import RuleSet

    warnings_section = _section(WARNINGS.read_text(), "Warnings (`CurvatureWarning`)")
    assert '`Warnings(rules="suite")`' in warnings_section and '`"suite"` (the default)' in WARNINGS.read_text()
    assert inspect.signature(CurvatureMonitor).parameters["warning_rules"].default == "suite"
    defaults = {n: p.default for n, p in inspect.signature(RuleSet).parameters.items()}
    quoted = re.findall(r"`(\w+)=([\d.e-]+)`", warnings_section)
    assert len(quoted) >= 10
    for name, value in quoted:
        assert name in defaults, f"docs/warnings.md quotes {name}, which RuleSet does not take"
        assert float(defaults[name]) == float(value), f"{name}: docs {value}, RuleSet {defaults[name]}"
    rules = {m for m in re.findall(r"^\| `(\w+)`", warnings_section, re.M)}
    fired = {"attn_saturation", "growth", "ln_collapse", "ln_variance_drop"}
    assert rules == fired
    source = inspect.getsource(RuleSet)
    assert all(f'Alert("{kind}"' in source for kind in rules), "a rule the docs list is not an alert RuleSet raises"


def test_docs_metrics_names_the_strategies_as_they_are():
    text = METRICS.read_text()
    ddp = _section(text, "Distributed data parallel")
    assert "ModelParallelStrategy(tensor_parallel_size=1)" in ddp and "`FSDPStrategy`" in ddp
    assert "FSDP, DeepSpeed and model-parallel strategies are refused" not in text
    from curvwatch import sharding

    assert "ModelParallelStrategy" in inspect.getsource(sharding)
