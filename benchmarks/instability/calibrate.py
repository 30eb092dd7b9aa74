"""How the defaults of :class:`curvwatch.rules.RuleSet` were chosen: the worst excursion on the training controls.

``python -m benchmarks.instability.calibrate [--out DIR] [--cadence N ...]`` replays the rules' own statistics
(:meth:`RuleSet._change` for the growth rules, the saturation level, the variance drop) on every stable run of
the training seeds and prints, per quantity and cadence, the largest value a control reached and where; a
default must sit above it with a margin. The same numbers for the unstable training runs show how much room
is left below. Held-out seeds are not read.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import markdown_table
from benchmarks.instability.analysis import onset_step, thinned
from benchmarks.instability.cases import TRAIN_SEEDS


def excursions(trace: Mapping[str, Any], cadence: int) -> dict[str, float]:
    """Per quantity, the largest statistic the rules compute on this run before its onset (decades; for the
    saturation, ``-log10`` of its geometric-mean level; for LayerNorms, the fall of ``var_min / eps`` while
    below the drop ceiling)."""
    from curvwatch.rules import RuleSet, block_quantities

    probe = RuleSet()
    onset = onset_step(trace["series"]["loss"])
    worst: dict[str, float] = defaultdict(lambda: -math.inf)
    for row in thinned(trace, cadence, full_every=10**9):
        step = row["step"]
        if onset is not None and step >= onset:
            break
        metrics = {k: v for k, v in row["metrics"].items() if v is not None}
        for (block, quantity), value in block_quantities(metrics).items():
            points = probe._add(f"{block}|{quantity}", step, math.log10(max(value, 1e-300)))
            if quantity == "saturation":
                n = max(probe._n_smooth(points), round(probe.saturation_steps / probe._cadence(points)))
                if len(points) >= n:
                    level = sum(max(p[1], -6.0) for p in points[-n:]) / n
                    worst[quantity] = max(worst[quantity], -level)
            elif quantity == "ln_ratio":
                change = probe._change(points, step)
                if change is not None and value < probe.variance_drop_ceiling:
                    worst["ln_drop"] = max(worst["ln_drop"], -change[0])
                worst["ln_ratio_min"] = max(worst["ln_ratio_min"], -math.log10(max(value, 1e-30)))
            else:
                change = probe._change(points, step, since=probe.warmup_steps)
                if change is not None:
                    worst[quantity] = max(worst[quantity], change[0])
    return dict(worst)


def calibrate(
    traces: Sequence[Mapping[str, Any]], cadences: Sequence[int], seeds: Sequence[int] = TRAIN_SEEDS
) -> dict[str, Any]:
    """``{cadence: {"controls": {quantity: (worst, run)}, "unstable": {quantity: [(value, run), ...] sorted}}}``
    over the runs of ``seeds``."""
    out: dict[str, Any] = {}
    for cadence in cadences:
        controls: dict[str, tuple[float, str]] = {}
        unstable: dict[str, tuple[float, str]] = {}
        for trace in traces:
            lab = trace["label"]
            if lab["seed"] not in seeds:
                continue
            name = f"{lab['mechanism']}/{lab['variant']}/s{lab['seed']}"
            stable = onset_step(trace["series"]["loss"]) is None and lab["role"] != "unstable"
            for quantity, value in excursions(trace, cadence).items():
                if stable and value > controls.get(quantity, (-math.inf, ""))[0]:
                    controls[quantity] = (value, name)
                if lab["role"] == "unstable" and lab["diverges"]:
                    unstable.setdefault(quantity, []).append((value, name))  # type: ignore[arg-type]
        out[str(cadence)] = {"controls": controls, "unstable": {q: sorted(v) for q, v in unstable.items()}}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.instability.suite import DEFAULT_OUT

    p = argparse.ArgumentParser(prog="python -m benchmarks.instability.calibrate", description=__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder of the suite")
    p.add_argument("--cadence", type=int, nargs="+", default=[1, 5, 10])
    args = p.parse_args(argv)
    traces = [json.loads(f.read_text()) for f in sorted((args.out / "runs").glob("*.json"))]
    result = calibrate(traces, args.cadence)
    for cadence, r in result.items():
        print(f"\n## terms-only every {cadence} steps (training seeds {TRAIN_SEEDS})\n")
        rows = []
        for q in sorted(set(r["controls"]) | set(r["unstable"])):
            worst, where = r["controls"].get(q, (None, "-"))
            unstable = " ".join(f"{v:.2f}" for v, _ in r["unstable"].get(q, []))
            rows.append([q, "-" if worst is None else f"{worst:.2f}", where, unstable])
        print(markdown_table(["quantity", "worst on controls", "run", "unstable runs (sorted)"], rows))
    return result


if __name__ == "__main__":
    main()
