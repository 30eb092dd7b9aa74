"""Smoke test of the instability suite: its ``--quick`` run trains, writes JSON, and separates unstable from stable.

The quick run is two mechanisms on d = 32 models, one seed (a divergence and a LayerNorm collapse), about 20 s
on one CPU thread.
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.instability import suite
from benchmarks.instability.analysis import SIGNALS, onset_step


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("instability")
    results = suite.main(["--quick", "--out", str(out)])
    return out, results


def test_writes_results_and_traces(quick):
    out, results = quick
    stored = json.loads((out / "results.json").read_text())
    assert set(stored["runs"]) == set(results["runs"])
    traces = sorted((out / "runs").glob("*.json"))
    assert len(traces) == len(results["runs"]) == 4
    trace = json.loads(traces[0].read_text())
    assert {"config", "corpus", "steps", "series", "monitor", "label", "live_alerts"} <= set(trace)
    assert trace["corpus"]["files"] > 0 and len(trace["corpus"]["sha256"]) == 64
    # every step has the baselines and a terms-only (or full) evaluation of the monitor
    assert len(trace["series"]["loss"]) == len(trace["steps"]) == len(trace["monitor"])
    assert {"loss", "grad_norm", "max_attn_logit", "lse", "step_time_s"} <= set(trace["series"])
    assert any(row["full"] for row in trace["monitor"]) and any(not row["full"] for row in trace["monitor"])
    assert set(stored["signals"]) == {f"{s}/{k}" for s in SIGNALS for k in ("level", "trend")}


def test_onsets_on_unstable_runs_only(quick):
    _, results = quick
    runs = results["runs"]
    diverging = runs["attn_logit/unstable/s0"]
    assert diverging["onset"] is not None and 20 < diverging["onset"] < diverging["steps"]
    for key, run in runs.items():
        if run["role"] == "control" or run["mechanism"] == "ln_collapse":
            assert run["onset"] is None, key


def test_collapse_warning_fires_on_the_collapse_only(quick):
    _, results = quick
    first = results["rules"]["suite"]["first"]
    kinds = {k: (f[1] if f else None) for k, f in first.items()}
    assert kinds["ln_collapse/unstable/s0"] in ("ln_collapse", "ln_variance_drop"), kinds
    assert results["rules"]["suite"]["per_run"]["ln_collapse/control/s0"]["alarms"] == 0


def test_the_rules_are_silent_on_controls_and_early_on_the_divergence(quick):
    _, results = quick
    rules = results["rules"]["suite"]
    assert rules["false_alarms"]["train"]["alarms"] == 0
    lead = rules["per_run"]["attn_logit/unstable/s0"]["lead"]
    assert lead is not None and lead > 0


def test_replay_of_the_rules_matches_the_live_monitor(quick):
    """The offline replay of the rules reproduces what the callback's own rules fired."""
    out, _ = quick
    from benchmarks.instability.analysis import replay_ruleset

    for path in sorted((out / "runs").glob("*.json")):
        trace = json.loads(path.read_text())
        replayed = [(s, k, b) for s, k, b in replay_ruleset(trace["monitor"])]
        live = [(a["step"], a["kind"], a["block"]) for a in trace["live_alerts"]]
        assert len(live) < 100, path.name  # the live history keeps the last 100
        assert replayed == live, path.name


def test_onset_definition():
    assert onset_step([3.0] * 30) is None
    assert onset_step([5.0, 4.0, 3.0] + [2.0] * 30 + [2.6] * 40) == 41  # mean > 2.5 from step 41
    assert onset_step([2.0] * 15 + [float("nan")]) == 15
    assert onset_step([2.0] * 15 + [None]) == 15


def test_llama_architecture_scores_are_litgpts():
    """The suite's LLaMA-style model: the attention-logit probe's scores are the ones litgpt's SDPA call gets."""
    pytest.importorskip("litgpt")
    import math

    import torch.nn.functional as F

    from benchmarks.instability.models import ARCHITECTURES, ModelSpec, build_model

    model = build_model(ModelSpec(arch="llama", d_model=32, seq_len=16, n_head=4))
    (attn, scores), *_ = ARCHITECTURES["llama"].attention_scores(model)
    seen: dict = {}
    attn.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]) if "x" not in seen else None)
    original = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        if "s" not in seen:  # the first call: layer 0
            k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
            seen["s"] = q @ k.transpose(-2, -1) * kwargs.get("scale", 1 / math.sqrt(q.shape[-1]))
        return original(q, k, v, *args, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            model(torch.randint(0, 256, (2, 16)))
    finally:
        F.scaled_dot_product_attention = original
    with torch.no_grad():
        got = scores(attn, seen["x"])
    torch.testing.assert_close(got, seen["s"], rtol=1e-5, atol=1e-6)
    assert model.config.n_query_groups == 2 and model.config.norm_class_name == "RMSNorm"


def test_cost_of_a_terms_only_evaluation_per_terms_keys(tmp_path):
    """``python -m benchmarks.instability.cost --quick``: both settings measured per model; the default is cheaper."""
    from benchmarks.instability import cost

    out = tmp_path / "cost.json"
    result = cost.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text())["models"] == result["models"]
    assert [m["model"] for m in result["models"]] == [vars(m) for m in cost.suite_models(quick=True)]
    for m in result["models"]:
        assert 0 < m["warnings"]["terms_cost_steps"] < m["all"]["terms_cost_steps"]
    assert set(cost.load_costs(out)) == {cost.model_key(m) for m in cost.suite_models(quick=True)}
    assert cost.load_costs(tmp_path / "absent.json") == {}
    assert "| model |" in cost.table(result)
