"""Scores of the whole suite: onsets, every signal's generic detector, today's and the new rules, cadences, cost.

:func:`evaluate` turns the list of traces into ``results.json``:

* ``runs``: per run its label, onset, steps, wall time and measured cost of the monitor's evaluations;
* ``signals``: per signal and detector kind, the threshold fitted on the training seeds' controls, and per
  mechanism and seed the first alarm and the lead; false alarms per 1000 steps on the controls, training and
  held-out seeds apart;
* ``rules``: the same for ``suite`` (:class:`curvwatch.rules.RuleSet` at its defaults), with the kind of the first
  alarm;
* ``cadence``: the new rules replayed with terms-only evaluations every 1, 5, 10, 25 steps (and no full ones),
  with the cost of that cadence, and at the default (``"auto"``: every 10 steps within 4% of training, the
  cadence each run's own terms-only cost allows).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.common import markdown_table
from benchmarks.instability.analysis import (
    SIGNALS,
    detector_alarms,
    excursions,
    fit_theta,
    median_or_none,
    onset_step,
    replay_ruleset,
    score,
    thinned,
)
from curvwatch.schedule import DEFAULT_TERMS_EVERY, DEFAULT_TERMS_OVERHEAD

DETECTORS = ("level", "trend")
CADENCES = (1, 5, 10, 25)


def _key(trace: Mapping[str, Any]) -> str:
    lab = trace["label"]
    return f"{lab['mechanism']}/{lab['variant']}/s{lab['seed']}"


def run_summary(trace: Mapping[str, Any]) -> dict[str, Any]:
    """Label, onset and measured cost of one run.

    The cost of an evaluation is its logged time (``summary/eval_time_s``, ``summary/terms_eval_time_s``); the
    training step's own time is the step's wall time minus the evaluation on it (median over steps).
    """
    lab = trace["label"]
    onset = onset_step(trace["series"]["loss"])
    evals = {row["step"]: row for row in trace["monitor"]}
    train, terms, full = [], [], []
    for step, total in zip(trace["steps"], trace["series"]["step_time_s"], strict=True):
        row = evals.get(step)
        if total is None or step == 0:
            continue
        spent = 0.0
        if row is not None:
            m = row["metrics"]
            spent = (m.get("summary/eval_time_s") if row["full"] else m.get("summary/terms_eval_time_s")) or 0.0
            (full if row["full"] else terms).append(spent)
        train.append(total - spent)
    step_s = statistics.median(train) if train else None
    terms_s = statistics.median(terms) if terms else None
    full_s = statistics.median(full) if full else None
    return {
        **lab,
        "onset": onset,
        "steps": len(trace["steps"]),
        "wall_s": trace.get("wall_s"),
        "diverged": onset is not None,
        "train_step_s": step_s,
        "terms_eval_s": terms_s,
        "full_eval_s": full_s,
        "terms_cost_steps": None if not (step_s and terms_s) else terms_s / step_s,
        "full_cost_steps": None if not (step_s and full_s) else full_s / step_s,
    }


def _is_control(summary: Mapping[str, Any]) -> bool:
    """Runs that count for false alarms: stable runs (designed controls or extras that did not diverge)."""
    return summary["role"] != "unstable" and not summary["diverged"]


def _per_run_scores(alarms: Mapping[str, list[int]], runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """First alarm, lead and rate of every run, plus false-alarm rates over the controls, per split."""
    per_run = {k: score(alarms[k], runs[k]["onset"], runs[k]["steps"]) for k in alarms}
    fa: dict[str, dict[str, float]] = {}
    for split in ("train", "held_out"):
        ctrl = [k for k in per_run if _is_control(runs[k]) and runs[k]["split"] == split]
        n_alarms = sum(per_run[k]["alarms"] for k in ctrl)
        n_steps = sum(runs[k]["steps"] for k in ctrl)
        fa[split] = {"alarms": n_alarms, "steps": n_steps, "per_1000": 1000.0 * n_alarms / max(n_steps, 1)}
    return {"per_run": per_run, "false_alarms": fa}


def evaluate(traces: Sequence[Mapping[str, Any]], quick: bool = False) -> dict[str, Any]:
    """Score every signal and rule on the suite's traces (see the module docstring)."""
    runs = {_key(t): run_summary(t) for t in traces}
    by_key = {_key(t): t for t in traces}
    train_controls = [k for k, r in runs.items() if _is_control(r) and r["split"] == "train"]

    signals: dict[str, Any] = {}
    for name, sig in SIGNALS.items():
        values = {k: sig.read(t) for k, t in by_key.items()}
        for kind in DETECTORS:
            exc = {k: excursions(v, sig.direction, kind) for k, v in values.items()}
            theta = fit_theta(exc[k] for k in train_controls)
            alarms = {k: detector_alarms(e, theta) for k, e in exc.items()}
            signals[f"{name}/{kind}"] = {
                "signal": name,
                "detector": kind,
                "tier": sig.tier,
                "direction": sig.direction,
                "description": sig.description,
                "theta_decades": theta,
                **_per_run_scores(alarms, runs),
            }

    rules: dict[str, Any] = {}
    alarms, kinds = {}, {}
    for k, t in by_key.items():
        fired = _replay(t, t["monitor"])
        alarms[k] = [s for s, _, _ in fired]
        kinds[k] = sorted({(s, kind, block) for s, kind, block in fired})[:1]
    rules["suite"] = {**_per_run_scores(alarms, runs), "first": {k: v[0] if v else None for k, v in kinds.items()}}

    cadence: dict[str, Any] = {}
    for every in CADENCES:
        alarms = {k: [s for s, _, _ in _replay(t, thinned(t, every, full_every=10**9))] for k, t in by_key.items()}
        cost = [r["terms_cost_steps"] for r in runs.values() if r["terms_cost_steps"] is not None]
        cadence[str(every)] = {
            **_per_run_scores(alarms, runs),
            "overhead": (statistics.median(cost) / every) if cost else None,
        }
    # the default: every 10 steps within 4% of training, i.e. the multiple of 10 each run's terms cost allows. The
    # traces record terms_keys="all"; the default computes only what the rules read ("warnings"), priced by
    # benchmarks.instability.cost where it was measured for the run's model, else by the trace's own cost.
    from benchmarks.instability.cost import load_costs, model_key

    costs = load_costs()
    cost_of = {k: costs.get(model_key(t["config"]["model"]), runs[k]["terms_cost_steps"]) for k, t in by_key.items()}
    every_of = {k: default_terms_every(cost_of[k]) for k in by_key}
    alarms = {k: [s for s, _, _ in _replay(t, thinned(t, every_of[k], full_every=10**9))] for k, t in by_key.items()}
    fractions = [cost_of[k] / every_of[k] for k in by_key if cost_of[k] is not None]
    cadence["auto"] = {
        **_per_run_scores(alarms, runs),
        "overhead": statistics.median(fractions) if fractions else None,
        "every": statistics.median(every_of.values()) if every_of else None,
        "every_range": [min(every_of.values()), max(every_of.values())] if every_of else None,
        "priced_by": "warnings" if costs and all(model_key(t["config"]["model"]) in costs for t in traces) else "all",
    }
    from benchmarks.instability.calibrate import calibrate
    from benchmarks.instability.cases import HELD_OUT_SEEDS, QUICK_SEEDS, TRAIN_SEEDS

    calibration = {
        "train": calibrate(traces, (1, 10), QUICK_SEEDS if quick else TRAIN_SEEDS),
        "held_out": calibrate(traces, (1, 10), () if quick else HELD_OUT_SEEDS),
    }
    return {
        "quick": quick,
        "calibration": calibration,
        "runs": runs,
        "signals": signals,
        "rules": rules,
        "cadence": cadence,
        "onset_definition": {"window": 10, "margin_nats": 0.5, "patience": 20},
    }


def default_terms_every(cost_steps: float | None) -> int:
    """The terms-only cadence the default budget allows where one evaluation costs ``cost_steps`` training steps.

    ``terms_every_n_train_steps="auto"`` evaluates on multiples of 10 while the terms-only seconds stay within 4% of
    training: in the long run one evaluation per ``10 * ceil(cost / (0.04 * 10))`` steps.

    Example:
        >>> default_terms_every(0.3), default_terms_every(1.23), default_terms_every(None)
        (10, 40, 10)
    """
    every = DEFAULT_TERMS_EVERY
    if cost_steps is None:
        return every
    return every * max(1, math.ceil(cost_steps / (DEFAULT_TERMS_OVERHEAD * every) - 1e-9))


def _replay(trace: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[tuple[int, str, str]]:
    return replay_ruleset(rows)


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def mechanism_rows(results: Mapping[str, Any]) -> dict[str, dict[str, list[str]]]:
    """``{mechanism: {variant: run keys}}`` in suite order."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for key, r in results["runs"].items():
        out[r["mechanism"]][r["variant"]].append(key)
    return out


def lead_cell(
    per_run: Mapping[str, Mapping[str, Any]], runs: Mapping[str, Mapping[str, Any]], keys: Sequence[str]
) -> str:
    """``lead@seed`` for every run (``miss`` without an alarm, ``-`` without onset)."""
    cells = []
    for k in keys:
        r, s = runs[k], per_run[k]
        if r["onset"] is None:
            cells.append(f"{'alarm ' + str(s['first_alarm']) if s['first_alarm'] is not None else 'silent'}")
        elif s["first_alarm"] is None:
            cells.append("miss")
        else:
            cells.append(f"{s['lead']:+d}")
    return " / ".join(cells)


def rules_table(results: Mapping[str, Any], label: str) -> str:
    """Mechanism x (onsets, leads of the first alarm per seed, false alarms/1000 steps on its control)."""
    runs, rule = results["runs"], results["rules"][label]
    header = ["mechanism", "onset (seeds)", "first alarm: lead (steps) per seed", "control: alarms / 1000 steps"]
    rows = []
    for mech, variants in mechanism_rows(results).items():
        unstable = variants.get("unstable", [])
        ctrl = [k for v, ks in variants.items() if v != "unstable" for k in ks]
        onsets = " / ".join(_fmt(runs[k]["onset"]) for k in unstable)
        fa = [rule["per_run"][k]["per_1000"] for k in ctrl if _is_control(runs[k])]
        rows.append([mech, onsets, lead_cell(rule["per_run"], runs, unstable), _fmt(max(fa) if fa else None)])
    return markdown_table(header, rows)


def signals_table(results: Mapping[str, Any]) -> str:
    """Per signal and detector: threshold, median lead per mechanism, false alarms on held-out controls."""
    runs = results["runs"]
    mechs = [
        m for m in mechanism_rows(results) if any(runs[k]["diverged"] for k in mechanism_rows(results)[m]["unstable"])
    ]
    header = ["signal", "tier", "theta (decades)", *mechs, "FA/1000 train", "FA/1000 held-out"]
    rows = []
    for key, s in results["signals"].items():
        cells = []
        for m in mechs:
            keys = mechanism_rows(results)[m]["unstable"]
            leads = [s["per_run"][k]["lead"] for k in keys if runs[k]["onset"] is not None]
            cells.append(_fmt(median_or_none(leads)))
        rows.append([
            key, s["tier"], f"{s['theta_decades']:.2f}", *cells,
            _fmt(s["false_alarms"]["train"]["per_1000"]), _fmt(s["false_alarms"]["held_out"]["per_1000"]),
        ])  # fmt: skip
    return markdown_table(header, rows)


def print_tables(results: Mapping[str, Any]) -> None:
    """The suite's tables, markdown, on stdout."""
    print("\n## Runs\n")
    header = ["run", "split", "onset", "steps", "wall s", "terms eval / step", "full eval / step"]
    rows = [
        [k, r["split"], _fmt(r["onset"]), r["steps"], _fmt(r["wall_s"]), _fmt(r["terms_cost_steps"]),
         _fmt(r["full_cost_steps"])]
        for k, r in results["runs"].items()
    ]  # fmt: skip
    print(markdown_table(header, rows))
    print("\n## Rules\n")
    print(rules_table(results, "suite"))
    print("\n## Signals (median lead over seeds; generic detector, threshold fitted on training controls)\n")
    print(signals_table(results))
    print("\n## Cadence of the new rules (terms-only every N steps, no full evaluations)\n")
    header = ["every", "overhead", "FA/1000 train", "FA/1000 held-out", "leads"]
    rows = []
    for every, c in results["cadence"].items():
        leads = [v["lead"] for k, v in c["per_run"].items() if results["runs"][k]["onset"] is not None]
        rows.append([every, _fmt(c["overhead"]), _fmt(c["false_alarms"]["train"]["per_1000"]),
                     _fmt(c["false_alarms"]["held_out"]["per_1000"]), " ".join(_fmt(x) for x in leads)])  # fmt: skip
    print(markdown_table(header, rows))
