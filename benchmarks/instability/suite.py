"""Command line of the instability suite: run every mechanism, score every signal and rule, write JSON.

``python -m benchmarks.instability [--quick] [--out DIR] [--only NAME ...] [--reuse] [--report]``

Writes (``DIR`` defaults to ``benchmarks/results/instability``, with ``--quick`` ``.../instability_quick``)
``DIR/runs/<mechanism>__<variant>__s<seed>.json`` (one trace per run, see
:func:`benchmarks.instability.train.run`) and ``DIR/results.json`` (:func:`benchmarks.instability.evaluate.evaluate`),
and prints the tables. ``--report`` also writes ``docs/instability.md`` and its plots
(:mod:`benchmarks.instability.report`). Runs are trained one after the other, each on one thread.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, environment
from benchmarks.instability.cases import HELD_OUT_SEEDS, QUICK_SEEDS, TRAIN_SEEDS, mechanisms
from benchmarks.instability.train import run

DEFAULT_OUT = RESULTS_DIR / "instability"
DEFAULT_OUT_QUICK = RESULTS_DIR / "instability_quick"  # so a smoke run never overwrites the suite's runs


def _round(obj: Any, digits: int = 6) -> Any:
    """Floats to ``digits`` significant digits (the traces are large; the seventh digit is noise)."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _round(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round(v, digits) for v in obj]
    return obj


def run_path(out: Path, mechanism: str, variant: str, seed: int) -> Path:
    """Where the trace of one run is stored."""
    return out / "runs" / f"{mechanism}__{variant}__s{seed}.json"


def collect(
    out: Path, quick: bool = False, only: Sequence[str] | None = None, reuse: bool = False, verbose: bool = True
) -> list[dict[str, Any]]:
    """Train (or, with ``reuse``, load) every run of the suite; returns the traces with their labels."""
    seeds = QUICK_SEEDS if quick else TRAIN_SEEDS + HELD_OUT_SEEDS
    traces = []
    for mech in mechanisms(quick):
        if only and mech.name not in only:
            continue
        for variant in mech.variants:
            for seed in seeds:
                path = run_path(out, mech.name, variant.name, seed)
                if reuse and path.exists():
                    trace = json.loads(path.read_text())
                else:
                    start = time.perf_counter()
                    trace = _round(run(replace(variant.config, seed=seed)))
                    trace["label"] = {
                        "mechanism": mech.name,
                        "variant": variant.name,
                        "role": variant.role,
                        "seed": seed,
                        "split": "train" if seed in TRAIN_SEEDS or quick else "held_out",
                        "diverges": mech.diverges,
                    }
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False))
                    if verbose:
                        print(
                            f"[instability] {mech.name}/{variant.name} seed {seed}: {len(trace['steps'])} steps in "
                            f"{time.perf_counter() - start:.1f} s",
                            flush=True,
                        )
                traces.append(trace)
    return traces


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.instability",
        description="Reproducible training instabilities of small byte-level LMs on the Python standard library's "
        "sources; lead times and false alarms of every monitor signal and warning rule.",
    )
    p.add_argument("--quick", action="store_true", help="two small mechanisms, one seed: the CI smoke run (seconds)")
    p.add_argument(
        "--out", type=Path, default=None, help=f"results folder [{DEFAULT_OUT}; with --quick {DEFAULT_OUT_QUICK}]"
    )
    p.add_argument("--only", nargs="+", default=None, help="mechanism names to run")
    p.add_argument("--reuse", action="store_true", help="load runs already in --out instead of training them")
    p.add_argument("--report", action="store_true", help="also write docs/instability.md and docs/instability/*.png")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the suite; returns what ``results.json`` holds."""
    from benchmarks.instability.evaluate import evaluate, print_tables

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick and args.report:
        parser.error("--report writes docs/instability.md from the full suite; run it without --quick.")
    out = args.out if args.out is not None else DEFAULT_OUT_QUICK if args.quick else DEFAULT_OUT
    start = time.perf_counter()
    traces = collect(out, quick=args.quick, only=args.only, reuse=args.reuse)
    results = evaluate(traces, quick=args.quick)
    results["environment"] = environment(torch.device("cpu"))
    results["wall_s"] = time.perf_counter() - start
    results["train_wall_s"] = sum(t.get("wall_s") or 0.0 for t in traces)
    results["command"] = "python -m benchmarks.instability " + " ".join(argv if argv is not None else sys.argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_round(results), indent=1, allow_nan=False) + "\n")
    print_tables(results)
    if args.report:
        from benchmarks.instability.report import write_report

        write_report(results, traces)
    return results
