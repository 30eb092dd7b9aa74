"""Sphinx extension of the curvwatch docs: the API reference covers the public names, references into private modules
render as code, and the ``benchmark`` directive renders ``benchmarks/results/*.json`` as tables.

* **Public names.** Every name in ``curvwatch.__all__`` and ``curvwatch.closed_form.__all__`` must be documented
  (``api.rst``); a name missing there is a build warning, so ``-W`` fails the build.
* **References.** Docstrings name objects by the module that defines them (``curvwatch.monitor.Monitor``); the API
  reference documents them under their public name (``curvwatch.Monitor``). A reference to the defining path resolves
  to the public entry of the same object. A reference to an object of a private module (``curvwatch.logbook.Logbook``)
  that exists renders as code without a link; one to an object that does not exist stays a warning.
* **Constants.** A constant exported by a public module (``curvwatch.closed_form.PARTS``) is documented with the
  ``#:`` comment of its defining module, not the docstring of its type.
* **Benchmarks.** ``.. benchmark:: bench_overhead`` (``:table: NAME`` picks a view) renders a result file: the
  numbers, then the machine, the command, the commit and the date they were measured with (:mod:`benchmark_tables`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

import benchmark_tables
from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

PUBLIC_MODULES = ("curvwatch", "curvwatch.closed_form", "curvwatch.closed_form.solver")


def _public_names() -> list[str]:
    names = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names += [f"{module_name}.{name}" for name in module.__all__]
    return names


def _lookup(path: str) -> tuple[bool, Any]:
    """``(found, object)`` for a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False, None
        return True, obj
    return False, None


def _documented(env: Any) -> dict[str, Any]:
    return env.get_domain("py").objects


def _public_of(env: Any) -> dict[int, str]:
    """id(object) -> the documented public name of it."""
    table = {}
    for name in _documented(env):
        if not name.startswith("curvwatch."):
            continue
        found, obj = _lookup(name)
        if found and (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)):
            table.setdefault(id(obj), name)
    return table


def _candidates(node: Any) -> list[str]:
    """The dotted paths a reference may mean: as written, then inside the module and class it was written in."""
    target = node["reftarget"].lstrip("~.")
    paths = [target]
    module, cls = node.get("py:module"), node.get("py:class")
    if module:
        found, obj = _lookup(module if not cls else f"{module}.{cls}")
        # the defining module of the documented object, where its docstring's short names live
        real = getattr(obj, "__module__", None) if found and not inspect.ismodule(obj) else module
        for base in {module, real}:
            if base:
                paths.append(f"{base}.{target}")
                if cls:
                    paths.append(f"{base}.{cls}.{target}")
    return paths


def missing_reference(app: Sphinx, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    public = _public_of(env)
    target = node["reftarget"].lstrip("~.")
    # a short name in a docstring lives in the module that defines the object documented; the directive knows only
    # the public module, so the package's own modules are searched last (the object must exist in one of them)
    fallback = [f"{m}.{target}" for m in sorted(sys.modules) if m.startswith("curvwatch")]
    for path in [*_candidates(node), *fallback]:
        if not path.startswith("curvwatch"):
            continue
        found, obj = _lookup(path)
        if not found:
            continue
        name = public.get(id(obj))
        if name is not None and name != node["reftarget"]:
            domain = env.get_domain("py")
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], name, node, contnode)
        if name is None:
            return contnode  # an object of a private module: code, no link
    return None


def data_comment(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """The ``#:`` comment of a re-exported constant, from the module under its public one that assigns it."""
    if what != "data" or not name.startswith("curvwatch."):
        return
    public, attr = name.rsplit(".", 1)
    for module_name in sorted(m for m in sys.modules if m == public or m.startswith(f"{public}.")):
        if getattr(sys.modules[module_name], attr, None) is not obj:
            continue
        try:
            comment = ModuleAnalyzer.for_module(module_name).find_attr_docs().get(("", attr))
        except Exception:  # a module without source (the analyzer raises PycodeError and others)
            continue
        if comment:
            lines[:] = list(comment)
            return


def check_public_names(app: Sphinx, env: Any) -> None:
    documented = _documented(env)
    for name in _public_names():
        if name not in documented:
            logger.warning(f"public name {name} is not in the API reference (docs/api.rst)", type="curvwatch")


class BenchmarkDirective(SphinxDirective):
    """``.. benchmark:: NAME`` renders ``benchmarks/results/NAME.json`` (``:table:`` picks the view)."""

    required_arguments = 1
    option_spec = {"table": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        view = self.options.get("table", "default")
        path = benchmark_tables.RESULTS / f"{name}.json"
        self.env.note_dependency(str(path))
        try:
            rendered = benchmark_tables.render(name, view)
        except (OSError, KeyError, ValueError) as err:
            logger.warning(f"benchmark {name} ({view}): {err}", location=self.get_location(), type="curvwatch")
            return []
        out: list[nodes.Node] = []
        for header, rows in rendered.tables:
            out.append(_table(header, rows))
        out.append(nodes.paragraph("", "", nodes.emphasis("", rendered.provenance)))
        return out


def _cell(text: str) -> nodes.entry:
    entry = nodes.entry()
    paragraph = nodes.paragraph()
    for i, piece in enumerate(str(text).split("`")):  # `code` spans
        if piece:
            paragraph += nodes.literal(piece, piece) if i % 2 else nodes.Text(piece)
    entry += paragraph
    return entry


def _table(header: list[str], rows: list[list[str]]) -> nodes.table:
    table = nodes.table(classes=["benchmark"])
    group = nodes.tgroup(cols=len(header))
    table += group
    group.extend(nodes.colspec(colwidth=1) for _ in header)
    head = nodes.thead()
    head += nodes.row("", *(_cell(h) for h in header))
    body = nodes.tbody()
    body.extend(nodes.row("", *(_cell(c) for c in row)) for row in rows)
    group += head
    group += body
    return table


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", missing_reference)
    app.connect("autodoc-process-docstring", data_comment)
    app.connect("env-check-consistency", check_public_names)
    app.add_directive("benchmark", BenchmarkDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
