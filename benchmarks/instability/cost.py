"""What a terms-only evaluation costs on the suite's models, per ``terms_keys``, measured side by side.

``python -m benchmarks.instability.cost [--steps N] [--rounds R]`` trains every distinct model of the suite for
``N`` steps with one terms-only evaluation per step (and a full one at step 0 only), once with
``terms_keys="warnings"`` (the default: what the warning rules read) and once with ``"all"`` (every bound term and
bound, what the suite's traces record), alternating, ``R`` rounds. The cost of an evaluation in training steps is
its logged time over the step's own time (:func:`benchmarks.instability.evaluate.run_summary`), median over the
rounds. Writes ``benchmarks/results/instability/cost.json``; :func:`benchmarks.instability.evaluate.evaluate`
prices the default cadence (the ``auto`` row) with the ``"warnings"`` cost found there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment
from benchmarks.instability.cases import mechanisms
from benchmarks.instability.models import ModelSpec
from benchmarks.instability.train import RunConfig, run

COST_PATH = RESULTS_DIR / "instability" / "cost.json"
MODES = ("warnings", "all")


def model_key(model: ModelSpec | dict[str, Any]) -> str:
    """A model's key in ``cost.json``: its :class:`ModelSpec` fields as sorted JSON (a trace's ``config["model"]``
    may hold fields of older versions; those are left out)."""
    spec = asdict(model) if isinstance(model, ModelSpec) else dict(model)
    return json.dumps({f.name: spec.get(f.name, f.default) for f in fields(ModelSpec)}, sort_keys=True)


def suite_models(quick: bool = False) -> list[ModelSpec]:
    """The distinct models of the suite's runs, in first-seen order."""
    seen: dict[str, ModelSpec] = {}
    for mech in mechanisms(quick):
        for variant in mech.variants:
            seen.setdefault(model_key(variant.config.model), variant.config.model)
    return list(seen.values())


def measure(model: ModelSpec, steps: int, rounds: int, batch_size: int = 16) -> dict[str, Any]:
    """Cost of one terms-only evaluation of ``model`` per mode (interleaved runs; medians over ``rounds``)."""
    from benchmarks.instability.evaluate import run_summary

    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            cfg = RunConfig(model=model, steps=steps, batch_size=batch_size, lr=((0, 1e-3),), full_every=10**6,
                            terms_every=1, terms_keys=mode, stop_after=steps)  # fmt: skip
            trace = run(cfg)
            trace["label"] = {"mechanism": "cost", "variant": mode, "role": "control", "seed": 0, "split": "train"}
            per_mode[mode].append(run_summary(trace))
    out: dict[str, Any] = {"model": asdict(model)}
    for mode, summaries in per_mode.items():
        out[mode] = {
            "terms_cost_steps": statistics.median(s["terms_cost_steps"] for s in summaries),
            "terms_eval_s": statistics.median(s["terms_eval_s"] for s in summaries),
            "train_step_s": statistics.median(s["train_step_s"] for s in summaries),
            "rounds": [s["terms_cost_steps"] for s in summaries],
        }
    out["ratio_all_over_warnings"] = out["all"]["terms_cost_steps"] / out["warnings"]["terms_cost_steps"]
    return out


def load_costs(path: Path = COST_PATH) -> dict[str, float]:
    """``{model_key: cost of a "warnings" terms-only evaluation in training steps}`` (``{}`` without ``cost.json``)."""
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {model_key(m["model"]): m["warnings"]["terms_cost_steps"] for m in data["models"]}


def table(results: dict[str, Any]) -> str:
    """Markdown: model x (training step, terms-only cost in steps per mode, ratio)."""
    rows = ["| model | training step (ms) | `warnings` (steps) | `all` (steps) | all / warnings |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for m in results["models"]:
        spec = m["model"]
        name = f"{spec['arch']} {spec['norm']}-LN, {spec['n_layer']} layers, d {spec['d_model']}, L {spec['seq_len']}"
        rows.append(
            f"| {name} | {1e3 * m['warnings']['train_step_s']:.1f} | {m['warnings']['terms_cost_steps']:.2f} | "
            f"{m['all']['terms_cost_steps']:.2f} | {m['ratio_all_over_warnings']:.1f}x |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.instability.cost", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="steps per run (one terms-only evaluation each)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per mode")
    p.add_argument("--quick", action="store_true", help="the quick suite's models, 1 round of 6 steps (smoke test)")
    p.add_argument("--out", type=Path, default=COST_PATH)
    args = p.parse_args(argv)
    steps, rounds = (6, 1) if args.quick else (args.steps, args.rounds)
    models = [measure(m, steps, rounds) for m in suite_models(args.quick)]
    results = {
        "command": "python -m benchmarks.instability.cost " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": steps,
        "rounds": rounds,
        "models": models,
        "environment": environment(torch.device("cpu")),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return results


if __name__ == "__main__":
    main()
