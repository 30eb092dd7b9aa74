"""curvwatch.rules.RuleSet as a pure state machine: fires and stays silent on hand-made and recorded traces."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from curvwatch.alerts import Alert
from curvwatch.rules import RuleSet, block_quantities

DATA = Path(__file__).parent / "data" / "rules_traces.json"


def attn(block="layer0/attn", *, x_norm=1.0, wq=1.0, wk=1.0, vv=1.0, jac=(0.45, 0.5)):
    """The keys of one attention block that the rules read (two heads)."""
    m = {f"{block}/term/x_norm": x_norm}
    for h, j in enumerate(jac):
        m[f"{block}/term/wq_norm/h{h}"] = wq
        m[f"{block}/term/wk_norm/h{h}"] = wk
        m[f"{block}/outer/VV/h{h}"] = vv / (h + 1)
        m[f"{block}/term/softmax_jac_norm/h{h}"] = j
    return m


def feed(rules, rows, every=1):
    """rows: {step: metrics}; terms-only evaluations every `every` steps."""
    fired = []
    for step in sorted(rows):
        if step % every == 0:
            fired += rules.update(step, rows[step], full=False)
    return fired


def kinds(alerts):
    return [(a.kind, a.block) for a in alerts]


# -- validation --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"saturation_level": -1}, "saturation_level"),
        ({"saturation_level": 0.5}, "saturation_level"),
        ({"logit_growth": -0.1}, "logit_growth"),
        ({"outer_vv_growth": float("nan")}, "outer_vv_growth"),
        ({"w2w2_growth": "1"}, "w2w2_growth"),
        ({"window_steps": 0}, "window_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"smooth_steps": 1.5}, "smooth_steps"),
        ({"patience_steps": True}, "patience_steps"),
        ({"collapse_ratio": -5}, "collapse_ratio"),
        ({"collapse_patience": 0}, "collapse_patience"),
        ({"variance_drop_decades": -1}, "variance_drop_decades"),
        ({"variance_drop_ceiling": 0}, "variance_drop_ceiling"),
        ({"cooldown_steps": -1}, "cooldown_steps"),
        ({"max_history": -1}, "max_history"),
    ],
)
def test_invalid_thresholds_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=f"Invalid {name}="):
        RuleSet(**kwargs)


def test_zero_disables_every_rule():
    rules = RuleSet(
        saturation_level=0, logit_growth=0, outer_vv_growth=0, w2w2_growth=0, collapse_ratio=0, variance_drop_decades=0
    )
    rows = {s: {**attn(vv=10 ** (s / 10), jac=(0.0, 0.0)), "layer0/ln_1/ln/var_min_over_eps": 0.0} for s in range(300)}
    assert feed(rules, rows) == []


def test_step_must_be_an_int():
    with pytest.raises(ValueError, match="Invalid step="):
        RuleSet().update(1.5, {}, full=False)


def test_block_quantities_reads_the_logged_keys():
    m = {**attn(x_norm=2.0, wq=3.0, wk=0.5, vv=8.0, jac=(0.4, 1e-9)), "layer0/ffn/hessian/W2W2": 7.0}
    m["summary/ln/var_min_over_eps"] = 3.0  # a summary, not a block: ignored
    m["layer0/ln_1/ln/var_min_over_eps"] = 0.0  # a constant row: kept
    q = block_quantities(m)
    assert q == {
        ("layer0/attn", "logit"): 2.0**2 * 3.0 * 0.5,
        ("layer0/attn", "outer_VV"): 8.0,
        ("layer0/attn", "saturation"): 1e-9,
        ("layer0/ffn", "W2W2"): 7.0,
        ("layer0/ln_1", "ln_ratio"): 0.0,
    }


# -- specificity ---------------------------------------------------------------------------------------


def healthy_rows(steps=400, seed=0):
    """A healthy run: curvature grows slowly (1.5 decades over the run) with step-to-step noise, heads stay soft,
    and full evaluations every 10 steps bring per-head QQ/KK norms that swing 100x."""
    rng = random.Random(seed)
    rows = {}
    for s in range(steps):
        vv = 10 ** (1.5 * s / steps + rng.gauss(0, 0.15))
        m = attn(x_norm=3 + rng.random(), wq=1 + 0.001 * s, wk=1 + 0.001 * s, vv=vv,
                 jac=(rng.uniform(0.2, 0.5), rng.uniform(0.3, 0.5)))  # fmt: skip
        m["layer0/ln_1/ln/var_min_over_eps"] = 40 * 10 ** rng.gauss(0, 0.1)
        m["layer0/ffn/hessian/W2W2"] = 10 ** rng.gauss(2, 0.2)
        if s % 10 == 0:
            for h in range(2):
                m[f"layer0/attn/hessian/QQ/h{h}"] = 10 ** rng.uniform(0, 2)
                m[f"layer0/attn/hessian/KK/h{h}"] = 10 ** rng.uniform(0, 2)
        rows[s] = m
    return rows


@pytest.mark.parametrize("every", [1, 5, 10])
def test_silent_on_a_noisy_healthy_run(every):
    assert feed(RuleSet(), healthy_rows(), every) == []


def test_qq_kk_noise_alone_never_fires():
    rng = random.Random(1)
    rules = RuleSet()
    for s in range(500):
        m = {f"layer0/attn/hessian/{p}/h{h}": 10 ** rng.uniform(-1, 3) for p in ("QQ", "KK") for h in range(4)}
        m["layer0/attn/hessian/max"] = max(m.values())
        assert rules.update(s, m, full=True) == []


def test_a_single_spike_does_not_fire():
    rows = healthy_rows()
    for key in ("layer0/attn/outer/VV/h0", "layer0/attn/term/x_norm"):
        rows[250][key] *= 1e4
    rows[251]["layer0/attn/term/softmax_jac_norm/h0"] = 0.0
    rows[300]["layer0/ln_1/ln/var_min_over_eps"] = 0.1
    assert feed(RuleSet(), rows) == []


# -- early warnings --------------------------------------------------------------------------------------


def growing_rows(start, decades_per_step=0.05, steps=400):
    rows = healthy_rows(steps)
    for s in range(start, steps):
        rows[s]["layer0/attn/outer/VV/h0"] *= 10 ** (decades_per_step * (s - start))
    return rows


def test_growth_fires_soon_after_it_exceeds_the_threshold():
    fired = feed(RuleSet(), growing_rows(start=200))
    assert kinds(fired)[:1] == [("growth", "layer0/attn")]
    # the rise over 50 steps passes the 1.5-decade default 30 steps in; medians and patience add a few
    threshold = RuleSet().thresholds["outer_VV"]
    assert threshold == 1.5
    assert 200 + 30 <= fired[0].step <= 200 + 45, fired[0].step
    assert fired[0].threshold == pytest.approx(10**threshold)
    message = fired[0].message
    for needle in ("layer0/attn", "H_o(VV)", "since step", "Confidence", "learning rate"):
        assert needle in message


def test_growth_during_warmup_is_not_compared():
    rows = healthy_rows()
    for s in range(20, 90):  # early training: curvature rises 3.5 decades
        rows[s]["layer0/attn/outer/VV/h0"] *= 10 ** (0.05 * (s - 20))
    for s in range(90, 400):
        rows[s]["layer0/attn/outer/VV/h0"] *= 10**3.5
    assert feed(RuleSet(), rows) == []
    assert kinds(feed(RuleSet(warmup_steps=0), rows))[:1] == [("growth", "layer0/attn")]


@pytest.mark.parametrize("every", [5, 10])
def test_growth_fires_at_sparser_cadences(every):
    fired = feed(RuleSet(), growing_rows(start=200), every)
    assert fired and fired[0].kind == "growth" and fired[0].step <= 200 + 70


def test_logit_bound_growth():
    rows = healthy_rows()
    for s in range(200, 400):
        rows[s]["layer0/attn/term/x_norm"] *= 10 ** (0.02 * (s - 200))  # the bound grows like x_norm^2
    fired = feed(RuleSet(), rows)
    assert fired and fired[0].kind == "growth" and "attention-logit bound" in fired[0].message


def test_saturation_fires_and_names_the_head():
    rows = healthy_rows()
    for s in range(150, 400):
        rows[s]["layer0/attn/term/softmax_jac_norm/h1"] = 1e-8
        if s % 7 == 0:  # flicker back to soft now and then
            rows[s]["layer0/attn/term/softmax_jac_norm/h1"] = 0.4
    fired = feed(RuleSet(), rows)
    assert kinds(fired)[:1] == [("attn_saturation", "layer0/attn")]
    assert 150 + 2 <= fired[0].step <= 150 + 10
    assert "head h1" in fired[0].message and "QK-norm" in fired[0].message
    # the cooldown keeps it to one alert per 100 steps
    assert [a.step for a in fired if a.kind == "attn_saturation"][1] >= fired[0].step + 100


def test_collapse_is_announced_by_the_variance_drop():
    rows = healthy_rows()
    for s in range(100, 400):
        rows[s]["layer0/ln_1/ln/var_min_over_eps"] = 40 * 10 ** (-0.03 * (s - 100))
    fired = [a for a in feed(RuleSet(), rows) if a.block == "layer0/ln_1"]
    assert [a.kind for a in fired[:2]] == ["ln_variance_drop", "ln_collapse"]
    drop, collapse = fired[:2]
    crossing = 100 + math.log10(40 / 5) / 0.03  # var_min / eps = 5
    assert drop.step < crossing < collapse.step <= crossing + 4
    assert collapse.value < 5 and "eps" in collapse.message


def test_collapse_needs_patience():
    rows = healthy_rows()
    for s in (200, 201, 350, 351):
        rows[s]["layer0/ln_1/ln/var_min_over_eps"] = 1.0
    assert feed(RuleSet(collapse_patience=3), rows) == []
    assert kinds(feed(RuleSet(collapse_patience=2), rows)) == [("ln_collapse", "layer0/ln_1")] * 2


# -- state --------------------------------------------------------------------------------------------------


def test_state_dict_survives_a_checkpoint(tmp_path):
    rows = growing_rows(start=200)
    for s in range(150, 400):
        rows[s]["layer0/attn/term/softmax_jac_norm/h0"] = 0.0
    whole = RuleSet()
    expected = feed(whole, rows)
    first = RuleSet()
    got = feed(first, {s: m for s, m in rows.items() if s < 210})
    state = json.loads(json.dumps(first.state_dict()))  # plain numbers and strings
    torch.save(state, tmp_path / "rules.ckpt")
    resumed = RuleSet()
    resumed.load_state_dict(torch.load(tmp_path / "rules.ckpt", weights_only=True))
    got += feed(resumed, {s: m for s, m in rows.items() if s >= 210})
    assert got == expected and len(expected) >= 2
    assert resumed.fired == whole.fired and resumed.history == whole.history
    assert all(isinstance(a, Alert) for a in resumed.history)


def test_history_is_capped():
    rows = healthy_rows()
    for s in range(400):
        rows[s]["layer0/ln_1/ln/var_min_over_eps"] = 1.0
    rules = RuleSet(cooldown_steps=0, collapse_patience=1, max_history=5)
    assert len(feed(rules, rows)) == 400
    assert len(rules.history) == 5 and rules.fired == 400


# -- recorded traces (excerpts of the instability suite, tests/data/rules_traces.json) ------------------------


def recorded():
    return json.loads(DATA.read_text())["runs"]


@pytest.mark.parametrize("name", [r["name"] for r in json.loads(DATA.read_text())["runs"]])
def test_recorded_traces(name):
    run = next(r for r in recorded() if r["name"] == name)
    keys = run["keys"]
    rules = RuleSet()
    fired = []
    for step, values in zip(run["steps"], run["values"], strict=True):
        metrics = {k: v for k, v in zip(keys, values, strict=True) if v is not None}
        fired += rules.update(step, metrics, full=False)
    if run["expect"] is None:
        assert fired == [], [(a.step, a.kind, a.block) for a in fired]
    else:
        assert fired, name
        assert fired[0].kind == run["expect"], (fired[0].step, fired[0].kind)
        if run["onset"] is not None:
            assert run["onset"] - fired[0].step >= 30, (run["onset"], fired[0].step)
