"""Benchmark: what the default schedule delivers on a run, from what its evaluations cost.

The monitor's own :class:`~curvwatch.schedule.Schedule` decides every step of a ``--steps``-step run on a clock of
the given costs (:func:`~curvwatch.schedule.simulate`: the decisions and charges of a monitored run, nothing
trained), with its floor (a full evaluation at least every 500 steps within 5% of the training time in all) and
without it (the 1% budget alone). Costs are in plain training steps: ``FULL/TERMS``
pairs, a full and a terms-only evaluation (step 0's full evaluation priced as a warm one unless ``--first`` says
otherwise). Deterministic: no timing, no randomness; the costs to feed it come from ``bench_dispatch --device cuda``
(which prints the cadence goal from its own measured costs) or ``bench_overhead``.

Run ``python -m benchmarks.bench_cadence [--steps 2000] [--costs 10/0.25 550/17 ...] [--first F] [--out PATH]``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.common import environment, write_json
from curvwatch.schedule import Schedule, simulate

NAME = "bench_cadence"
#: (label, full, terms-only) in training steps: costs either side of the 1% budget's reach, a terms-only evaluation at
#: its 4% budget's edge (0.4 steps at every 10 steps), a small model on a CPU (a full evaluation of ~90 training
#: steps, a terms-only one of ~1.3) and a GPU-sized evaluation of 600 / 18
DEFAULT_COSTS = (
    ("a full evaluation of 2 steps", 2.0, 0.25),
    ("of 5 steps", 5.0, 0.125),
    ("of 10 steps", 10.0, 0.25),
    ("of 20 steps", 20.0, 0.25),
    ("terms-only at 0.4 steps (its budget's edge)", 10.0, 0.4),
    ("a small model on a CPU", 90.0, 1.3),
    ("600 / 18", 600.0, 18.0),
)


def table(steps: int, costs, first: float | None) -> list[dict[str, Any]]:
    rows = []
    for label, full, terms in costs:
        no_floor = Schedule()
        no_floor.max_gap = None
        for floor, schedule in (("floor", Schedule()), ("1% only", no_floor)):
            r = simulate(steps, 1.0, full, terms, first_seconds=first, schedule=schedule)
            rows.append({"costs": label, "full_cost": full, "terms_cost": terms, "schedule": floor,
                         "full_steps": r["full"], "terms_steps": r["terms"], "max_full_gap": r["max_full_gap"],
                         "max_gap": r["max_gap"], "overhead": r["overhead"]})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--costs", nargs="*", default=None, help="FULL/TERMS pairs in training steps")
    p.add_argument("--first", type=float, default=None, help="step 0's full evaluation, training steps")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    costs = DEFAULT_COSTS
    if args.costs:
        costs = [(c, *map(float, c.split("/"))) for c in args.costs]
    rows = table(args.steps, costs, args.first)
    print(f"| costs (full / terms-only, training steps) | schedule | full evaluations on {args.steps} steps | longest "
          "gap without a full one | longest without any | terms-only | overhead |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        fulls = ", ".join(map(str, r["full_steps"][:6])) + (" ..." if len(r["full_steps"]) > 6 else "")
        print(
            f"| {r['costs']} ({r['full_cost']:g} / {r['terms_cost']:g}) | {r['schedule']} | {fulls} | "
            f"{r['max_full_gap']} | {r['max_gap']} | {len(r['terms_steps'])} | {100 * r['overhead']:.2f}% |"
        )
    config = {"steps": args.steps, "first": args.first, "costs": [list(c) for c in costs]}
    path = write_json(NAME, {"name": NAME, "config": config, "environment": environment(torch.device("cpu")),
                             "rows": rows}, args.out)  # fmt: skip
    print(f"[bench_cadence] wrote {path}")
    return rows


if __name__ == "__main__":
    main()
