"""Benchmark 4: how curvwatch's evaluation time scales with L, d, heads and layers, against one forward pass.

For each sweep point we time, side by side (interleaved), curvwatch's closed-form evaluation of a block and
one forward pass of the same block (the floor any method pays), and report both times and their ratio:

* attention: :func:`curvwatch.closed_form.multi_head_attention` (default pairs, ``tol``, ``max_iter``) vs
  ``concat_h(softmax(P_h K_h^T / sqrt(d_K)) V_h) W_O``;
* layernorm: :func:`curvwatch.closed_form.layernorm` (with ``grad_output``) vs ``F.layer_norm``;
* ffn: :func:`curvwatch.closed_form.ffn` (default pairs, ReLU, ``d_ff = 4 d``) vs ``relu(Y W_1) W_2 + Y``;
* layers: all three blocks of ``n`` layers in turn vs the ``n`` forwards (expected linear).

Log-log exponents are fitted with ``numpy.polyfit``. A sweep stops growing a block once one evaluation took
longer than ``--point-budget-s``, and the run stops adding points after ``--total-budget-s`` (the skipped
points are listed, with the reason, in the JSON and the table).

Run ``python -m benchmarks.bench_scaling [--quick] [--device cpu|cuda] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.common import (
    cpu_peak_rss,
    environment,
    markdown_table,
    peak_memory_bytes,
    run_memory_child,
    select_device,
    synchronize,
    time_interleaved,
    write_json,
)
from curvwatch.closed_form import AttentionWeights, FFNWeights, OutputLoss, ffn, layernorm, multi_head_attention
from curvwatch.closed_form.settings import Lanczos

NAME = "bench_scaling"
KINDS = ("attention", "layernorm", "ffn")


@dataclass(frozen=True)
class Point:
    L: int
    d: int
    H: int
    d_K: int
    layers: int = 1

    @property
    def d_ff(self) -> int:
        return 4 * self.d


@dataclass(frozen=True)
class Sweep:
    name: str  # the varied factor: "L", "d", "H" or "layers"
    base: Point
    values: tuple[int, ...]
    kinds: tuple[str, ...]

    def points(self) -> list[Point]:
        return [replace(self.base, **{self.name: v}) for v in self.values]


FULL = (  # cheap sweeps first, so the total budget cannot starve them
    Sweep("H", Point(L=128, d=64, H=1, d_K=32), (1, 2, 4, 8), ("attention",)),
    Sweep("layers", Point(L=64, d=64, H=2, d_K=32), (1, 2, 4), ("layers",)),
    Sweep("L", Point(L=64, d=64, H=1, d_K=32), (64, 128, 256, 512, 1024, 2048), KINDS),
    Sweep("d", Point(L=64, d=64, H=1, d_K=32), (64, 128, 256, 512, 1024), KINDS),
)
QUICK = (  # the same order: on a loaded machine the 40 s budget used to skip the layers sweep (last) entirely
    Sweep("H", Point(L=8, d=8, H=1, d_K=4), (1, 2), ("attention",)),
    Sweep("layers", Point(L=8, d=8, H=1, d_K=4), (1, 2), ("layers",)),
    Sweep("L", Point(L=8, d=8, H=1, d_K=4), (8, 16, 32), KINDS),
    Sweep("d", Point(L=8, d=8, H=1, d_K=4), (8, 16), KINDS),
)


class Layer:
    """Random weights of one post-LN Transformer layer and closures for curvwatch and the forward floor."""

    def __init__(
        self, p: Point, device: torch.device, gen: torch.Generator, tol: float, max_iter: int, max_basis: int | None
    ):
        def W(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(device)

        self.p, self.tol, self.max_iter, self.max_basis = p, tol, max_iter, max_basis
        self.X = torch.randn(p.L, p.d, generator=gen).to(device)  # (L, d)
        self.T = torch.randn(p.L, p.d, generator=gen).to(device)  # target / grad_output, (L, d)
        self.W_Q, self.W_K, self.W_V = W(p.d, p.H * p.d_K), W(p.d, p.H * p.d_K), W(p.d, p.H * p.d_K)
        self.W_O = W(p.H * p.d_K, p.d)
        self.W_1, self.W_2 = W(p.d, p.d_ff), W(p.d_ff, p.d)

    # -- curvwatch --
    def eval_attention(self) -> dict[str, torch.Tensor]:
        return multi_head_attention(
            self.X,
            AttentionWeights(self.W_Q, self.W_K, self.W_V, self.W_O, n_heads=self.p.H),
            loss=OutputLoss(target=self.T),
            lanczos=Lanczos(tol=self.tol, max_iter=self.max_iter, max_basis=self.max_basis, warn=False),
        )

    def eval_layernorm(self) -> dict[str, torch.Tensor]:
        return layernorm(self.X, grad_output=self.T)

    def eval_ffn(self) -> dict[str, torch.Tensor]:
        return ffn(
            self.X,
            FFNWeights(self.W_1, self.W_2),
            loss=OutputLoss(target=self.T),
            lanczos=Lanczos(tol=self.tol, max_iter=self.max_iter, max_basis=self.max_basis, warn=False),
        )

    # -- the floor: one forward pass of the same block --
    @torch.no_grad()
    def fwd_attention(self) -> torch.Tensor:
        p = self.p
        P = (self.X @ self.W_Q).reshape(p.L, p.H, p.d_K).transpose(0, 1)  # (H, L, d_K)
        K = (self.X @ self.W_K).reshape(p.L, p.H, p.d_K).transpose(0, 1)
        V = (self.X @ self.W_V).reshape(p.L, p.H, p.d_K).transpose(0, 1)
        Fh = torch.softmax(P @ K.mT / math.sqrt(p.d_K), dim=-1) @ V  # (H, L, d_V)
        return Fh.transpose(0, 1).reshape(p.L, -1) @ self.W_O

    @torch.no_grad()
    def fwd_layernorm(self) -> torch.Tensor:
        return F.layer_norm(self.X, (self.p.d,))

    @torch.no_grad()
    def fwd_ffn(self) -> torch.Tensor:
        return torch.relu(self.X @ self.W_1) @ self.W_2 + self.X


def _closures(kind: str, p: Point, device: torch.device, args: argparse.Namespace) -> tuple[Callable, Callable]:
    gen = torch.Generator().manual_seed(args.seed)
    n = p.layers if kind == "layers" else 1
    layers = [Layer(p, device, gen, args.tol, args.max_iter, args.max_basis) for _ in range(n)]
    if kind != "layers":
        return getattr(layers[0], f"eval_{kind}"), getattr(layers[0], f"fwd_{kind}")

    def ev() -> None:
        for lay in layers:
            for k in KINDS:
                getattr(lay, f"eval_{k}")()

    def fw() -> None:
        for lay in layers:
            for k in KINDS:
                getattr(lay, f"fwd_{k}")()

    return ev, fw


def _fit(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 2:
        return None
    return float(np.polyfit(np.log(np.asarray(xs, dtype=float)), np.log(np.asarray(ys, dtype=float)), 1)[0])


def run_sweep(sw: Sweep, device: torch.device, args: argparse.Namespace, t_start: float) -> list[dict[str, Any]]:
    rows = []
    for kind in sw.kinds:
        stop_reason = None
        for p in sw.points():
            row: dict[str, Any] = {
                "sweep": sw.name,
                "kind": kind,
                "x": getattr(p, sw.name),
                **asdict(p),
                "d_ff": p.d_ff,
            }
            if stop_reason is None and time.perf_counter() - t_start > args.total_budget_s:
                stop_reason = f"total budget {args.total_budget_s:.0f} s spent"
            if stop_reason is not None:
                rows.append({**row, "status": "skipped", "reason": stop_reason})
                continue
            ev, fw = _closures(kind, p, device, args)
            synchronize(device)
            t0 = time.perf_counter()
            ev()  # warm-up, and the probe of the point budget
            synchronize(device)
            probe = time.perf_counter() - t0
            fw()
            if probe > args.point_budget_s:
                # too slow to repeat: the probe is the (single, cold) sample; the forward is still timed
                timing = time_interleaved({"forward": fw}, device, repeats=args.repeats, min_repeats=1, warmup=0)
                timing["eval"] = {"median_s": probe, "times_s": [probe]}
                budget = args.point_budget_s
                stop_reason = f"previous point's evaluation took {probe:.3g} s > --point-budget-s={budget:g}"
            else:
                timing = time_interleaved(
                    {"eval": ev, "forward": fw},
                    device,
                    repeats=args.repeats,
                    min_repeats=1,
                    warmup=0,
                    budget_s=args.point_budget_s,
                )
            e, f = timing["eval"]["median_s"], timing["forward"]["median_s"]
            rows.append(
                {
                    **row,
                    "status": "measured",
                    "single_cold_call": probe > args.point_budget_s,
                    "eval_s": e,
                    "forward_s": f,
                    "ratio": e / f,
                    "eval_times_s": timing["eval"]["times_s"],
                    "forward_times_s": timing["forward"]["times_s"],
                    "memory": _memory(kind, p, ev, fw, device, args) if probe <= args.point_budget_s else None,
                }
            )
    return rows


def _memory(kind: str, p: Point, ev: Callable, fw: Callable, device: torch.device, args) -> dict[str, Any] | None:
    """Peak extra memory of one evaluation and of one forward pass (CUDA: allocator; CPU: RSS, fresh process)."""
    if not args.memory:
        return None
    if device.type == "cuda":
        return {"status": "measured", "eval": peak_memory_bytes(ev, device), "forward": peak_memory_bytes(fw, device)}
    child = ["--_memory-child", kind, "--_point", json.dumps(asdict(p)), "--tol", str(args.tol)]
    child += ["--max-iter", str(args.max_iter), "--seed", str(args.seed)]
    if args.max_basis is not None:
        child += ["--max-basis", str(args.max_basis)]
    return run_memory_child("benchmarks.bench_scaling", child)


def _memory_child(kind: str, p: Point, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    ev, fw = _closures(kind, p, torch.device("cpu"), args)
    ev(), fw()  # warm at the full size
    out = {"eval": cpu_peak_rss(ev)["bytes"], "forward": cpu_peak_rss(fw)["bytes"]}
    print(json.dumps(out))


def fits(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    keys = sorted(
        {(r["sweep"], r["kind"]) for r in rows},
        key=lambda k: (k[0], KINDS.index(k[1]) if k[1] in KINDS else 9),
    )
    for sweep, kind in keys:
        pts = [r for r in rows if r["sweep"] == sweep and r["kind"] == kind and r["status"] == "measured"]
        xs = [r["x"] for r in pts]
        out.append(
            {
                "sweep": sweep,
                "kind": kind,
                "range": [min(xs), max(xs)] if xs else None,
                "points": len(pts),
                "eval_exponent": _fit(xs, [r["eval_s"] for r in pts]),
                "forward_exponent": _fit(xs, [r["forward_s"] for r in pts]),
                "ratio_exponent": _fit(xs, [r["ratio"] for r in pts]),
                "memory_exponent": _fit(*_mem_points(pts, "eval")),
                "forward_memory_exponent": _fit(*_mem_points(pts, "forward")),
            }
        )
    return out


def _mem_points(pts: Sequence[dict[str, Any]], which: str) -> tuple[list[float], list[float]]:
    """``(x, bytes)`` of the points whose memory was measured and positive (log-log fit)."""
    ok = [r for r in pts if (r.get("memory") or {}).get("status") == "measured" and r["memory"][which] > 0]
    return [r["x"] for r in ok], [float(r["memory"][which]) for r in ok]


def _mib(r: dict[str, Any]) -> str:
    m = r.get("memory") or {}
    if m.get("status") != "measured":
        return "—"
    return f"{m['eval'] / 2**20:.3g} / {m['forward'] / 2**20:.3g}"


def _f(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def points_table(rows: Sequence[dict[str, Any]]) -> str:
    header = [
        "sweep",
        "block",
        "L",
        "d",
        "H",
        "d_K",
        "layers",
        "curvwatch (ms)",
        "forward (ms)",
        "eval / forward",
        "peak extra MiB: eval / forward",
    ]
    body = []
    for r in rows:
        head = [r["sweep"], r["kind"], r["L"], r["d"], r["H"], r["d_K"], r["layers"]]
        if r["status"] != "measured":
            body.append([*head, "skipped: " + r["reason"], "—", "—", "—"])
        else:
            star = " (1 cold call)" if r.get("single_cold_call") else ""
            body.append(
                [*head, f"{r['eval_s'] * 1e3:.3g}{star}", f"{r['forward_s'] * 1e3:.3g}", f"{r['ratio']:.3g}×", _mib(r)]
            )
    return markdown_table(header, body)


def fits_table(fs: Sequence[dict[str, Any]]) -> str:
    header = [
        "sweep",
        "block",
        "range",
        "points",
        "exponent: curvwatch",
        "exponent: forward",
        "exponent: ratio",
        "memory exponent: eval / forward",
    ]
    body = [
        [
            f["sweep"],
            f["kind"],
            "—" if f["range"] is None else f"{f['range'][0]}..{f['range'][1]}",
            f["points"],
            _f(f["eval_exponent"]),
            _f(f["forward_exponent"]),
            _f(f["ratio_exponent"]),
            f"{_f(f['memory_exponent'])} / {_f(f['forward_memory_exponent'])}",
        ]
        for f in fs
    ]
    return markdown_table(header, body)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (< 60 s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{NAME}.json)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1, see bench_hvp)")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--max-iter", type=int, default=100, help="most Lanczos steps per norm (default 100)")
    ap.add_argument("--max-basis", type=int, default=None, help="most Lanczos vectors held per norm (default: all)")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per point (default 3; 1 with --quick)")
    ap.add_argument("--point-budget-s", type=float, default=None, help="default 20 (2 with --quick)")
    ap.add_argument("--total-budget-s", type=float, default=None, help="default 360 (40 with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the peak-memory children")
    ap.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_point", dest="point", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"Invalid --threads={args.threads}. Must be >= 1.")
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.point_budget_s = args.point_budget_s or (2.0 if args.quick else 20.0)
    args.total_budget_s = args.total_budget_s or (40.0 if args.quick else 360.0)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the sweeps, write the JSON, print the tables; returns the JSON data."""
    args = parse_args(argv)
    if args.memory_child:  # hidden mode: one point's peak memory, in a fresh process (see _memory)
        _memory_child(args.memory_child, Point(**json.loads(args.point)), args)
        return {}
    device = select_device(args.device)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        sweeps = QUICK if args.quick else FULL
        t0 = time.perf_counter()
        rows = [r for sw in sweeps for r in run_sweep(sw, device, args, t0)]
        fs = fits(rows)
        data = {
            "name": NAME,
            "config": {
                "quick": args.quick,
                "device": str(device),
                "threads": args.threads,
                "dtype": "float32",
                "tol": args.tol,
                "max_iter": args.max_iter,
                "max_basis": args.max_basis,
                "repeats": args.repeats,
                "point_budget_s": args.point_budget_s,
                "total_budget_s": args.total_budget_s,
                "seed": args.seed,
                "sweeps": [
                    {"name": s.name, "base": asdict(s.base), "values": s.values, "kinds": s.kinds} for s in sweeps
                ],
                "wall_s": time.perf_counter() - t0,
                "timing": "one warm-up call, then interleaved repeats of eval and forward, median per call",
                "ratio": "curvwatch evaluation time / one forward pass of the same block (floor: 1)",
                "memory": "CUDA: max_memory_allocated above the start; CPU: peak RSS of one call above the RSS "
                "before it, in a fresh process per point after a warm-up call of the same size (VmHWM after "
                "/proc/self/clear_refs); points evaluated once (over the point budget) are not measured",
            },
            "environment": environment(device),
            "results": rows,
            "fits": fs,
        }
        path = write_json(NAME, data, args.out)
        print(f"## Scaling of curvwatch's evaluation, {device}, float32, {args.threads} thread(s) ({path})\n")
        print(fits_table(fs))
        print()
        print(points_table(rows))
        return data
    finally:
        torch.set_num_threads(threads_before)


if __name__ == "__main__":
    main(sys.argv[1:])
