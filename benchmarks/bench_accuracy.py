"""Lanczos accuracy vs cost: what ``tol``, ``max_iter`` and ``max_basis`` buy on the overhead benchmark's models.

Run ``python -m benchmarks.bench_accuracy [--quick] [--out PATH]``; see ``benchmarks/README.md``.

For each model (the demo's, and the first layer of the mid-size GPT), one training batch is captured with
the monitor's capture, and every attention and FFN block is evaluated as the callback does (float32, diagonal
pairs, all three kinds, cold start) for several ``(tol, max_iter, max_basis)`` settings, interleaved. Each
Lanczos norm is compared with a reference run to ``tol = 1e-9`` in float64. Reported per setting: median seconds
per evaluation, how many norms stopped at ``max_iter`` above ``tol`` (what ``summary/lanczos/unconverged``
counts), the worst relative residual, the worst and median *true* relative error against the reference, and the
largest peak of allocated tensor memory of one block's evaluation (a separate, untimed pass under
:class:`benchmarks.common.PeakMemory`: what a GPU would hold).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from benchmarks.bench_overhead import Model, demo_model, make_dataset, mid_model, parse_models, quick_models
from benchmarks.common import PeakMemory, environment, markdown_table, write_json
from curvwatch import find_blocks
from curvwatch.capture import Capture
from curvwatch.closed_form.settings import Lanczos
from curvwatch.data import IGNORE_INDEX
from curvwatch.engine import evaluate_block
from examples.demo import GPTLitModule

NAME = "bench_accuracy"
# (tol, max_iter, max_basis); (1e-2, 40, 16) is the monitor's default, None holds every vector (no restarts)
SETTINGS = (
    (1e-3, 20, None), (1e-2, 20, None), (1e-2, 40, None), (1e-3, 40, None),
    (1e-2, 40, 16), (1e-2, 40, 8), (1e-2, 40, 4),
)  # fmt: skip
REFERENCE = {"tol": 1e-9, "max_iter": 150}  # float64, no restarts
PAIRS = {"attention": ("VV", "QQ", "KK"), "ffn": ("W1W1", "W2W2")}  # pairs="diagonal"


def captured_blocks(m: Model, seed: int, layers: int) -> list:
    """The attention and FFN blocks of the first ``layers`` layers, captured on one batch of a fresh model."""
    torch.manual_seed(seed)
    module = GPTLitModule(m.config)
    x, y = next(iter(DataLoader(make_dataset(m, seed), batch_size=m.batch_size)))
    specs = [s for s in find_blocks(module, "auto") if s.layer < layers and s.kind in PAIRS]
    with Capture(specs, max_tokens=m.max_tokens) as capture:
        logits = module(x)  # (B, L, vocab)
        F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).backward()
    return [b for b in capture.blocks() if b.reason is None]


def evaluate(blocks: list, **kw: Any) -> dict[tuple[str, str], tuple[float, float | None]]:
    """``{(block, norm key): (norm, relative residual or None)}`` over the blocks' Lanczos and exact norms."""
    out = {}
    for b in blocks:
        r = evaluate_block(b, pairs=PAIRS[b.spec.kind], **kw)
        for key, value in r.items():
            if key.split("/")[0] in ("outer", "functional", "hessian"):
                res = r.get(f"residual/{key}")
                out[(b.spec.name, key)] = (float(value), None if res is None else float(res))
    return out


def peak_bytes(blocks: list, **kw: Any) -> int:
    """Largest peak of allocated tensor memory over the blocks' evaluations (one block at a time, as the callback)."""
    peak = 0
    for b in blocks:
        with PeakMemory() as mem:
            evaluate_block(b, pairs=PAIRS[b.spec.kind], **kw)
        peak = max(peak, mem.peak)
    return peak


def bench_model(m: Model, seed: int, repeats: int, layers: int) -> dict[str, Any]:
    blocks = captured_blocks(m, seed, layers)
    ref = evaluate(blocks, lanczos=Lanczos(**REFERENCE, max_basis=None, warn=False), dtype=torch.float64)
    times: dict[tuple, list[float]] = {s: [] for s in SETTINGS}
    last: dict[tuple, dict] = {}
    for rep in range(repeats):  # interleaved, order reversed every other round
        for setting in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
            tol, max_iter, max_basis = setting
            t0 = time.perf_counter()
            last[setting] = evaluate(
                blocks,
                lanczos=Lanczos(tol=tol, max_iter=max_iter, max_basis=max_basis, warn=False),
                dtype=torch.float32,
            )
            times[setting].append(time.perf_counter() - t0)
    rows = []
    for setting in SETTINGS:
        tol, max_iter, max_basis = setting
        got = last[setting]
        lanczos = {k: v for k, v in got.items() if v[1] is not None}
        errors = {k: abs(v[0] - ref[k][0]) / max(abs(ref[k][0]), 1e-30) for k, v in lanczos.items()}
        worst = max(errors, key=errors.__getitem__)
        rows.append(
            {
                "tol": tol,
                "max_iter": max_iter,
                "max_basis": max_basis,
                "median_s": statistics.median(times[setting]),
                "times_s": times[setting],
                "lanczos_norms": len(lanczos),
                "unconverged": sum(not v[1] <= tol for v in lanczos.values()),
                "rel_residual_max": max(v[1] for v in lanczos.values()),
                "true_rel_error_max": errors[worst],
                "true_rel_error_max_at": "/".join(worst),
                "true_rel_error_median": statistics.median(errors.values()),
                "reads_high": sum(v[0] > ref[k][0] * (1 + 1e-5) for k, v in lanczos.items()),
                "peak_allocated_bytes": peak_bytes(
                    blocks,
                    lanczos=Lanczos(tol=tol, max_iter=max_iter, max_basis=max_basis, warn=False),
                    dtype=torch.float32,
                ),
            }
        )
    return {"model": m.name, "notes": m.notes, "layers": layers, "blocks": [b.spec.name for b in blocks],
            "repeats": repeats, "settings": rows}  # fmt: skip


def table(results: Sequence[dict[str, Any]]) -> str:
    header = ["model", "tol", "max_iter", "max_basis", "s / evaluation", "unconverged", "max rel. residual",
              "max true error", "median true error", "peak allocated MiB (one block)"]  # fmt: skip
    rows = [
        [r["model"], f"{s['tol']:g}", str(s["max_iter"]), str(s["max_basis"] or "-"), f"{s['median_s']:.3g}",
         f"{s['unconverged']} / {s['lanczos_norms']}", f"{s['rel_residual_max']:.1e}",
         f"{s['true_rel_error_max']:.1e} ({s['true_rel_error_max_at']})", f"{s['true_rel_error_median']:.1e}",
         f"{s['peak_allocated_bytes'] / 2**20:.3g}"]
        for r in results
        for s in r["settings"]
    ]  # fmt: skip
    return markdown_table(header, rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny models (< 30 s)")
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{NAME}.json)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds on the demo model (default 5)")
    ap.add_argument("--models", default="demo,mid", help="comma-separated subset of demo,mid")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        ap.error("--threads and --repeats must be >= 1.")
    args.models = parse_models(ap, args.models)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write the JSON, print the table; returns the JSON data."""
    args = parse_args(argv)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        models = quick_models() if args.quick else [demo_model(1), mid_model(1, 8)]
        t0 = time.perf_counter()
        results = [
            # the mid-size model: its first layer (one cold evaluation costs seconds), 2 rounds
            bench_model(m, args.seed, args.repeats if m.name == "demo" or args.quick else 2,
                        m.config.n_layer if m.name == "demo" or args.quick else 1)
            for m in models
            if m.name in args.models
        ]  # fmt: skip
        data = {
            "name": NAME,
            "config": {"quick": args.quick, "threads": args.threads, "seed": args.seed, "settings": SETTINGS,
                       "reference": {**REFERENCE, "max_basis": None, "dtype": "float64"}, "dtype": "float32",
                       "pairs": PAIRS,
                       "kinds": "outer, functional, hessian", "start": "cold (no warm start)",
                       "wall_s": time.perf_counter() - t0},
            "environment": environment(torch.device("cpu")),
            "results": results,
        }  # fmt: skip
        path = write_json(NAME, data, args.out)
        print(f"## Lanczos accuracy vs cost, cpu, {args.threads} thread(s) ({path})\n")
        print(table(results))
        return data
    finally:
        torch.set_num_threads(threads_before)


if __name__ == "__main__":
    main(sys.argv[1:])
