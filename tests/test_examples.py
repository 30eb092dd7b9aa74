"""The example scripts run and stay correct (examples cannot rot)."""

import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_closed_form_example_matches_reference(capsys):
    worst = runpy.run_path(str(EXAMPLES / "closed_form_example.py"))["main"]()
    assert worst < 1e-10
    assert "max relative error" in capsys.readouterr().out
