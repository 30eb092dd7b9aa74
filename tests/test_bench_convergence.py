"""``bench_convergence --quick``: a short recorded training run (the demo's GPT on 3-digit addition, 7 evaluations)
replayed through the monitor's default engine, warm, resumed and cold, each norm reported converged against a tight
solve of the same captured blocks.

The replays here draw every evaluation's start vectors with one seed, so that the starts are those on which the
residual test alone stops low (a norm 33% low at step 40, ``layer1/attn/functional/KK/h0``, and one 4.7% low after a
resume, ``layer0/attn/outer/QQ/h3``, step 20, with the GPU's solver choices: attention's ``QQ`` and ``KK`` rows of
one run, whose start vectors are rows of one draw); the default stopping test reports none of them converged and off,
with the GPU's choices and with the CPU's."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench_convergence
from curvwatch.closed_form.solver import choices, lanczos, stopping
from curvwatch.engine import Engine


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    folder = tmp_path_factory.mktemp("convergence")
    out = folder / "record.json"
    result = bench_convergence.main(["--quick", "--record-only", "--states-dir", str(folder), "--out", str(out)])
    assert json.loads(out.read_text())["states"] == result["states"] and len(result["states"]) == 1
    return result


def _replay(recording, monkeypatch, residual_alone: bool, chosen: choices.SolverChoices = choices.GPU) -> dict:
    evaluate = Engine.evaluate

    def one_seed(self, *args, **kwargs):
        self.draws = 0
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "evaluate", one_seed)
    if residual_alone:
        monkeypatch.setattr(stopping, "STABLE", math.inf)
        monkeypatch.setattr(stopping, "CROWDED", 0.0)
        monkeypatch.setattr(lanczos, "RELOOK", -math.inf)
    with choices.forced(chosen):
        return bench_convergence.replay_all(recording["states"], recording["resume_at"])


def test_the_residual_test_alone_reports_norms_converged_and_off_on_the_recorded_run(recording, monkeypatch):
    summary = _replay(recording, monkeypatch, residual_alone=True)
    assert summary["resumed"]["wrong"] >= 1 and summary["cold"]["wrong"] >= 1, summary
    assert summary["cold"]["worst_error"] < -0.3  # layer1/attn/functional/KK/h0 at step 40


@pytest.mark.parametrize("chosen", [choices.GPU, choices.CPU], ids=["gpu", "cpu"])
def test_no_norm_of_the_recorded_run_is_reported_converged_and_more_than_1_percent_off(recording, monkeypatch, chosen):
    summary = _replay(recording, monkeypatch, residual_alone=False, chosen=chosen)
    assert set(summary) == {"run", "resumed", "cold"}
    for setup, s in summary.items():
        assert s["norms"] >= 300, (setup, s["norms"])  # 7 evaluations x 54 Lanczos norms
        assert s["max_reference_spread"] < 1e-3, setup  # the two tight solves agree: the reference is sound
        assert s["wrong"] == 0, (setup, s["wrong_norms"])
