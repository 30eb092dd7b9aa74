"""The docs site's own pieces, without a Sphinx build: every public name has its API entry, every benchmark table a
result file with its provenance, and the gallery's examples import only the public API."""

from __future__ import annotations

import ast
import importlib
import itertools
import re
import sys
from pathlib import Path

import pytest

import curvwatch
import curvwatch.closed_form

DOCS = Path(__file__).parents[1] / "docs"
PUBLIC = {
    "curvwatch": curvwatch.__all__,
    "curvwatch.closed_form": curvwatch.closed_form.__all__,
    "curvwatch.closed_form.solver": curvwatch.closed_form.solver.__all__,
}


def _benchmark_tables():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import benchmark_tables
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return benchmark_tables


def test_every_public_name_has_an_api_entry():
    """docs/api.rst documents each public name with an autodoc directive (the build checks it too): its own, or an
    ``automodule`` with a bare ``:members:``, which documents the classes and functions of the module's ``__all__``
    (a constant, which carries no docstring of its own, needs its ``autodata``)."""
    lines = (DOCS / "api.rst").read_text().splitlines()
    current, documented = None, set()
    for i, line in enumerate(lines):
        if m := re.match(r"\.\. currentmodule:: (\S+)", line):
            current = m[1]
        elif m := re.match(r"\.\. automodule:: (\S+)", line):
            current = m[1]
            documented.add(current)
            options = [o.strip() for o in itertools.takewhile(lambda o: o.startswith("   :"), lines[i + 1 :])]
            if ":members:" in options:
                module = importlib.import_module(current)
                documented |= {f"{current}.{n}" for n in module.__all__ if callable(getattr(module, n))}
        elif m := re.match(r"\.\. auto(?:class|function|data):: (\S+)", line):
            name = m[1]
            documented.add(name if name.startswith("curvwatch") else f"{current}.{name}")
    missing = [f"{m}.{n}" for m, names in PUBLIC.items() for n in names if f"{m}.{n}" not in documented]
    assert not missing, f"not in docs/api.rst: {missing}"


def _benchmarks_on_pages() -> list[tuple[str, str]]:
    found = []
    for page in sorted(DOCS.glob("*.md")):
        found += [(page.name, name) for name in re.findall(r"^```\{benchmark\} (\S+)", page.read_text(), re.M)]
    return found


def test_the_pages_render_benchmark_tables():
    assert {name for _, name in _benchmarks_on_pages()} >= {"bench_jacobians", "bench_hvp", "bench_cadence"}


@pytest.mark.parametrize("page, name", _benchmarks_on_pages())
def test_every_benchmark_table_has_its_result_file_and_provenance(page, name):
    tables = _benchmark_tables()
    rendered = tables.render(name)
    assert rendered.tables and all(rows for _, rows in rendered.tables), (page, name)
    assert all(len(row) == len(header) for header, rows in rendered.tables for row in rows), (page, name)
    env = tables.load(name)["environment"]
    assert env["command"].startswith("python -m benchmarks.") and env["commit"], (page, name)
    assert f"`{env['command']}`" in rendered.provenance and env["timestamp_utc"][:10] in rendered.provenance


@pytest.mark.parametrize("example", sorted(p.name for p in (DOCS / "examples").glob("plot_*.py")))
def test_gallery_examples_use_only_the_public_api(example):
    tree = ast.parse((DOCS / "examples" / example).read_text())
    allowed_modules = {"curvwatch", "curvwatch.closed_form", "curvwatch.models", "curvwatch.data"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("curvwatch"):
            assert node.module in allowed_modules, f"{example} imports from {node.module}"
            if node.module in PUBLIC:
                assert all(a.name in PUBLIC[node.module] for a in node.names), (
                    f"{example}: {[a.name for a in node.names]}"
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert not alias.name.startswith("curvwatch.") or alias.name in allowed_modules, (example, alias.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "curvwatch":
            assert node.attr in curvwatch.__all__, f"{example} uses curvwatch.{node.attr}"
