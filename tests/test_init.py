"""The package's top level: every public name resolves lazily after a plain ``import curvwatch``, and the version
is the one pyproject.toml declares."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import curvwatch

ROOT = Path(__file__).parents[1]


def _fresh(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a new interpreter (no curvwatch submodule imported yet), from the repository root."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_hf_trainer_is_an_attribute_after_import_curvwatch():
    """The README's ``curvwatch.hf_trainer.CurvatureCallback()`` works after ``import curvwatch`` alone."""
    run = _fresh(
        "import curvwatch\n"
        "callback = curvwatch.hf_trainer.CurvatureCallback(sharpness=False)\n"
        "assert type(callback) is curvwatch.CurvatureCallback\n"
        "print('ok')"
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_every_public_name_resolves_in_a_fresh_interpreter():
    run = _fresh(
        "import curvwatch\n"
        "for name in curvwatch.__all__:\n"
        "    assert getattr(curvwatch, name) is not None and name in dir(curvwatch), name\n"
        "print(len(curvwatch.__all__))"
    )
    assert run.returncode == 0 and int(run.stdout) == len(curvwatch.__all__), run.stderr[-2000:]


def test_unknown_attribute_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'hf_trainers'"):
        curvwatch.hf_trainers  # noqa: B018


def test_version_is_pyproject_version():
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared is not None and curvwatch.__version__ == declared[1]
