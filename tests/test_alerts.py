"""Tests of curvwatch.alerts: the LayerNorm-collapse and spike state machine."""

from __future__ import annotations

import pytest

from curvwatch.alerts import AlertMonitor, CurvatureWarning


def feed(monitor, norms, start=0, block="layer0/attn"):
    out = []
    for i, n in enumerate(norms):
        out.append(monitor.update(start + i, norms={block: n}))
    return out


def test_warning_category():
    assert issubclass(CurvatureWarning, UserWarning)


def test_spike_fires_after_warmup_only():
    monitor = AlertMonitor(spike_factor=10.0, spike_warmup=3, cooldown=0)
    # a 100x jump during warmup is absorbed into the baseline, never reported
    assert not any(feed(monitor, [1.0, 100.0, 1.0]))
    monitor = AlertMonitor(spike_factor=10.0, spike_warmup=3, cooldown=0)
    fired = feed(monitor, [1.0, 1.2, 0.8, 1.0, 2.0, 50.0])
    assert [len(f) for f in fired] == [0, 0, 0, 0, 0, 1]
    alert = fired[-1][0]
    assert (alert.kind, alert.block, alert.step, alert.value) == ("spike", "layer0/attn", 5, 50.0)
    assert alert.threshold == pytest.approx(20.0)  # 10 x the last normal value 2 (above the baseline ~1.1)
    # the message names the block, the value, the threshold and what to do
    for text in ("layer0/attn", "50", "spike_factor=10", "learning rate", "gradient_clip_val"):
        assert text in alert.message


def test_steady_early_growth_is_not_a_spike():
    """Curvature rising a few-fold per evaluation early in training (seen in the demo) is not a jump."""
    monitor = AlertMonitor(spike_factor=10.0, spike_warmup=3, cooldown=0)
    demo_series = [0.217, 0.397, 1.47, 5.66, 21.6, 50.6, 52.6, 49.6, 76.0, 90.5, 133.0]
    assert not any(feed(monitor, demo_series))
    # ... while a jump of more than spike_factor above the last normal value fires
    assert feed(monitor, [2000.0])[0][0].kind == "spike"


def test_persistent_spike_with_patience():
    monitor = AlertMonitor(spike_factor=10.0, spike_warmup=2, patience=2, cooldown=0)
    counts = [len(f) for f in feed(monitor, [1.0, 1.0, 1.0, 100.0, 100.0])]
    assert counts == [0, 0, 0, 0, 1]


def test_spike_baseline_absorbs_level_shift():
    monitor = AlertMonitor(spike_factor=10.0, spike_warmup=1, cooldown=0, spike_decay=0.5)
    fired = feed(monitor, [1.0, 1.0] + [1000.0] * 12)
    counts = [len(f) for f in fired]
    assert counts[2] == 1  # the jump is reported
    assert counts[-1] == 0  # a lasting new level stops being a spike


def test_patience_and_cooldown():
    monitor = AlertMonitor(collapse_ratio=5.0, patience=2, cooldown=2)
    bad = {"layer0/ln_1": {"var_min_over_eps": 1.0, "eps": 1e-5}}
    good = {"layer0/ln_1": {"var_min_over_eps": 100.0, "eps": 1e-5}}
    seq = [bad, good, bad, bad, bad, bad, bad, bad]
    fired = [len(monitor.update(i, layernorms=s)) for i, s in enumerate(seq)]
    # streak broken at 1; fires at the 2nd consecutive bad (step 3), silent for 2 evaluations, fires again
    assert fired == [0, 0, 0, 1, 0, 0, 1, 0]
    assert monitor.fired == 2 and [a.step for a in monitor.history] == [3, 6]


def test_collapse_message_and_inv_var_threshold():
    monitor = AlertMonitor(collapse_ratio=5.0)
    (alert,) = monitor.update(7, layernorms={"layer1/ln_2": {"var_min": 2e-6, "eps": 1e-5}})
    assert alert.kind == "ln_collapse" and alert.value == pytest.approx(0.2)
    for text in ("layer1/ln_2", "step 7", "0.2", "collapse_ratio=5", "eps", "learning rate", "pre-LN"):
        assert text in alert.message
    healthy = {"layer1/ln_2": {"var_min_over_eps": 50.0, "inv_var_max": 2e3}}
    assert AlertMonitor().update(0, layernorms=healthy) == []
    (alert,) = AlertMonitor(inv_var_threshold=1e3).update(0, layernorms=healthy)
    assert "inv_var_threshold=1000" in alert.message
    assert AlertMonitor(collapse_ratio=0).update(0, layernorms={"b": {"var_min_over_eps": 0.1}}) == []


def test_state_dict_round_trip_gives_same_decisions():
    a = AlertMonitor(spike_factor=3.0, spike_warmup=2, patience=2, cooldown=1)
    feed(a, [1.0, 2.0, 1.5, 10.0])
    b = AlertMonitor(spike_factor=3.0, spike_warmup=2, patience=2, cooldown=1)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert b.baseline("layer0/attn") == a.baseline("layer0/attn")
    tail = [10.0, 10.0, 1.0, 30.0, 30.0]
    assert [len(x) for x in feed(a, tail, start=4)] == [len(x) for x in feed(b, tail, start=4)]
    assert a.state_dict() == b.state_dict() and a.fired >= 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"collapse_ratio": -1}, "Invalid collapse_ratio=-1. Must be a number >= 0"),
        ({"spike_factor": 1.0}, "Invalid spike_factor=1.0. Must be > 1"),
        ({"spike_warmup": 0}, "Invalid spike_warmup=0. Must be an int >= 1"),
        ({"spike_decay": 1.0}, "Invalid spike_decay=1.0. Must be in [0, 1)"),
        ({"patience": 0}, "Invalid patience=0. Must be an int >= 1"),
        ({"cooldown": -1}, "Invalid cooldown=-1. Must be an int >= 0"),
        ({"inv_var_threshold": 0}, "Invalid inv_var_threshold=0. Must be a number > 0"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        AlertMonitor(**kwargs)
