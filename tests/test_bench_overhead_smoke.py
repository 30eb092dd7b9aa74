"""Smoke test of the training-overhead benchmark: its ``--quick`` main runs, writes JSON, and is consistent."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from benchmarks import bench_overhead


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "overhead.json"
    result = bench_overhead.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    return result


def test_json_fields(data):
    assert data["name"] == "bench_overhead"
    assert {"config", "environment", "results", "goals"} <= set(data)
    kwargs = data["config"]["monitor_kwargs"]
    assert {"max_tokens", "tol", "max_iter", "pairs"} <= set(kwargs)
    assert data["config"]["threads"] == data["environment"]["torch_threads"] == 1
    assert [r["model"] for r in data["results"]] == ["demo", "mid"]


def test_runs_time_the_same_steps(data):
    for r in data["results"]:
        base = r["runs"]["None"]
        assert len(base) == r["rounds"]
        for c, window in r["windows"].items():
            for run in r["runs"][c]:
                # warm-up + window measured steps, plus one final step that only closes the last interval
                assert run["steps"] == r["warmup_steps_excluded"] + window + 1
                assert len(run["step_s"]) == run["steps"] - 1
                assert all(t > 0 for t in run["step_s"])
            assert all(len(run["step_s"]) >= r["warmup_steps_excluded"] + window for run in base)


def test_cadences_measured_or_derived(data):
    for r in data["results"]:
        cells = r["cadences"]
        assert set(cells) == {str(c) for c in bench_overhead.CADENCES}
        basis = cells[str(bench_overhead.DERIVE_FROM)]
        assert basis["status"] == "measured" and basis["evaluations_in_window"] >= 1
        assert math.isfinite(basis["cost_per_eval_steps_same_run"])
        assert cells["1"]["cost_per_eval_steps_same_run"] is None  # every step is due: no steps to compare
        for c, cell in cells.items():
            assert math.isfinite(cell["overhead"]), (r["model"], c)
            if cell["status"] == "measured":
                assert len(cell["overhead_rounds"]) == r["rounds"]
                assert cell["overhead"] == pytest.approx(statistics.median(cell["overhead_rounds"]))
            else:
                assert cell["status"] == "derived"
                assert cell["overhead"] == pytest.approx(basis["cost_per_eval_steps"] / int(c))
                assert cell["overhead_same_run"] == pytest.approx(basis["cost_per_eval_steps_same_run"] / int(c))
        # an evaluation of real closed forms is never free: every step monitored costs more than none
        assert cells["1"]["overhead"] > 0


def test_breakdown(data):
    for r in data["results"]:
        b = r["breakdown"]
        assert {v["kind"] for v in b["blocks"].values()} == {"attention", "layernorm", "ffn"}
        assert sum(b["by_kind_share"].values()) == pytest.approx(1.0)
        assert b["evaluate_total_s"] > 0 and b["train_step_s"] > 0
        # terms only runs no Lanczos: cheaper than the full evaluation of the same blocks
        assert 0 < b["evaluate_total_s_terms_only"] < b["evaluate_total_s"]


@pytest.mark.parametrize("key,variant", [("terms_only_every_step", "terms"), ("warnings_only_every_step", "warnings")])
def test_terms_only_every_step(data, key, variant):
    for r in data["results"]:
        cell = r[key]
        assert len(cell["overhead_rounds"]) == r["rounds"] and math.isfinite(cell["cost_per_eval_steps"])
        for run in r["runs"][variant]:
            assert run["steps"] == r["warmup_steps_excluded"] + r["windows"]["1"] + 1
            assert run["evaluations"] == 1 and run["terms_evaluations"] == run["steps"] - 1  # step 0 is full
    prefix = key.split("_every")[0]
    for goal in data["goals"]:
        assert goal[f"{prefix}_cost_per_eval_ok"] == (goal[f"{prefix}_cost_per_eval_steps"] < 1.0)


def test_table_lists_every_cadence(data):
    table = bench_overhead.overhead_table(data["results"])
    lines = table.splitlines()
    assert len(lines) == 2 + len(bench_overhead.CADENCES) + 2  # + terms only every step, both terms_keys
    assert lines[-2].startswith("| 1, terms only (`terms_keys=\"all\"`)")
    assert lines[-1].startswith("| 1, terms only (`terms_keys=\"warnings\"`, default)")
    assert "derived" in table
