"""The architecture contracts hold: import-linter's contracts (pyproject.toml) are kept, and its list of the closed
forms' private modules is complete."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _contracts() -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def test_every_private_closed_form_module_is_protected():
    private = {f"curvwatch.closed_form.{p.stem}" for p in (ROOT / "curvwatch" / "closed_form").glob("_*.py")}
    private.discard("curvwatch.closed_form.__init__")
    assert private and set(_contracts()["closed-form-private"]["protected_modules"]) == private


def test_no_private_closed_form_import_outside_the_closed_forms():
    """The same rule as the contract, read from the source of every Python file outside ``closed_form/`` (function-
    level imports and string module names of ``importlib`` calls included)."""
    found = []
    for path in ROOT.glob("**/*.py"):
        rel = path.relative_to(ROOT)
        skip = rel.parts[0] in (".venv", "build") or rel.parts[:2] == ("curvwatch", "closed_form")
        if skip or path == Path(__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            found += [f"{rel}:{node.lineno}" for n in names if n.startswith("curvwatch.closed_form._")]
    assert not found, found


def test_the_import_contracts_are_kept():
    assert {"pipeline-layers", "engine-without-realloss", "no-cycles", "closed-form-private"} <= set(_contracts())
    command = Path(sys.executable).parent / "lint-imports"
    if not command.exists():
        pytest.skip("import-linter is not installed (the dev extra installs it)")
    run = subprocess.run([str(command), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "4 kept, 0 broken" in run.stdout
