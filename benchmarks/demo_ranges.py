"""What healthy values look like: the demo's run, and the range of its headline keys after warm-up.

Runs ``examples.demo`` at its defaults (2000 steps of a 2-layer GPT on 3-digit addition, a full evaluation every 50
steps, a terms-only one every 10; CSV logger only) and writes, for the keys the docs' dashboard page names first,
their range over the evaluations from ``--after`` on, the value at step 0, the final accuracy and the warnings, to
``benchmarks/results/demo_ranges.json`` (rendered by ``docs/dashboard.md``).

Run ``python -m benchmarks.demo_ranges [--after 200] [--steps 2000] [--out PATH]`` (about 4 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch

from benchmarks.common import environment, write_json
from examples import demo

NAME = "demo_ranges"
KEYS = (
    "curv/summary/warnings",
    "curv/summary/stability/max",
    "curv/summary/signals/softmax_jac_min",
    "curv/summary/ln/var_min_over_eps",
    "curv/summary/max_hessian",
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after", type=int, default=200, help="ranges over the evaluations from this step on")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out_dir = tempfile.mkdtemp(prefix="demo_ranges_")
    result = demo.run(["--wandb", "disabled", "--steps", args.steps, "--out-dir", out_dir])
    series = demo.read_metrics(result.metrics_csv)
    keys: dict[str, Any] = {}
    for key in KEYS:
        steps, values = series.get(key, ([], []))
        later = [v for s, v in zip(steps, values, strict=True) if s >= args.after]
        keys[key] = {
            "at_step_0": values[0] if steps and steps[0] == 0 else None,
            "min": min(later) if later else None,
            "max": max(later) if later else None,
            "evaluations": len(later),
            "at_or_above_1": sum(v >= 1 for v in later) if key.endswith("stability/max") else None,
            "last": values[-1] if values else None,
        }
    data = {
        "name": NAME,
        "config": {"after": args.after, "steps": args.steps, "demo": "python -m examples.demo --wandb disabled"},
        "environment": environment(torch.device("cpu")),
        "run": {
            "steps": result.steps,
            "final_val_acc": result.final_val_acc,
            "final_val_loss": result.final_val_loss,
            "warnings": result.warnings,
            "train_seconds": result.train_seconds,
            "evaluations": list(result.evaluations),
        },
        "keys": keys,
    }
    path = write_json(NAME, data, args.out)
    print(f"[demo_ranges] wrote {path}")
    return data


if __name__ == "__main__":
    main()
