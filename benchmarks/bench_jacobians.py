"""Benchmark 1: closed-form vs autograd Jacobians of the post-LN FFN block (∂Z/∂W_1, ∂Z/∂W_2) and LayerNorm.

Run ``python -m benchmarks.bench_jacobians [--quick] [--device cpu|cuda] [--out PATH]``; see
``benchmarks/README.md`` for what each number means.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import jacrev, vmap

from benchmarks.common import (
    environment,
    markdown_table,
    peak_memory_bytes,
    rel_err,
    select_device,
    tensor_bytes,
    time_interleaved,
    write_json,
)
from curvwatch.closed_form.jacobians import (
    RowKronecker,
    block_output_jacobians,
    block_output_jacobians_structured,
    layernorm_jacobian_blocks,
    layernorm_jacobian_dense,
)

NAME = "bench_jacobians"

# P1 thesis slides (2026), CUDA, mean ± sd; baseline not named (sheet §8).
PUBLISHED = {
    "dZ/dW_2": {"autograd_ms": 57.81, "closed_form_ms": 0.13, "ratio": 444.0},
    "dZ/dW_1": {"autograd_ms": 55.85, "closed_form_ms": 0.45, "ratio": 124.0},
    "LN Jacobian": {"autograd_ms": 55.96, "closed_form_ms": 0.80, "ratio": 70.0},
}
QUANTITIES = ("dZ/dW_2", "dZ/dW_1", "LN Jacobian")
DENSE_BASELINES = {
    "loop": "per-row loop: autograd.functional.jacobian(vectorize=False)",
    "vectorize": "autograd.functional.jacobian(vectorize=True)",
    "jacrev": "torch.func.jacrev",
}
ROWWISE = "jacrev_rowwise"
ROWWISE_LABEL = "structure-aware autograd: vmap over tokens of torch.func.jacrev of one token"


@dataclass(frozen=True)
class Size:
    name: str
    L: int
    d: int
    d_ff: int
    repeats: int
    budget_s: float  # per method
    min_time_s: float = 0.02  # shortest timed repeat
    max_dense_mib: float | None = None  # overrides --max-dense-mib for this size
    max_subset_rows: int | None = None  # a row subset has at most this many output rows (per-row loop cost)


PAPERS = Size("papers", L=8, d=16, d_ff=32, repeats=15, budget_s=3.0)
REALISTIC = Size("realistic", L=128, d=256, d_ff=1024, repeats=5, budget_s=2.0, max_subset_rows=2048)
# --quick: the papers' size, and a small stand-in for the realistic size whose dense-memory budget is tiny,
# so that the row-subset and extrapolation path runs too.
QUICK = (
    Size("papers", L=8, d=16, d_ff=32, repeats=3, budget_s=0.05, min_time_s=0.002),
    Size(
        "realistic (quick stand-in)",
        L=8,
        d=16,
        d_ff=64,
        repeats=3,
        budget_s=0.05,
        min_time_s=0.002,
        max_dense_mib=0.1,
    ),
)


def _act(Z: torch.Tensor, activation: str) -> torch.Tensor:
    return torch.relu(Z) if activation == "relu" else F.gelu(Z)


def _dense_bytes(quantity: str, tokens: int, s: Size, itemsize: int) -> int:
    rows = tokens * s.d
    cols = rows if quantity == "LN Jacobian" else s.d * s.d_ff
    return rows * cols * itemsize


def _subset_tokens(quantity: str, s: Size, itemsize: int, max_dense_bytes: int) -> int:
    """``L`` if the dense Jacobian fits in ``max_dense_bytes``; else the most tokens that fit (at least 1)
    with at most ``s.max_subset_rows`` output rows."""
    if _dense_bytes(quantity, s.L, s, itemsize) <= max_dense_bytes:
        return s.L
    t = s.L if s.max_subset_rows is None else max(1, min(s.L, s.max_subset_rows // s.d))
    while t > 1 and _dense_bytes(quantity, t, s, itemsize) > max_dense_bytes:
        t -= 1
    return t


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _block_diag(blocks: torch.Tensor) -> torch.Tensor:
    return torch.block_diag(*blocks.unbind(0))


class _Problem:
    """Inputs of one size and the closures that compute each quantity."""

    def __init__(self, s: Size, activation: str, eps: float, device: torch.device, seed: int):
        gen = torch.Generator().manual_seed(seed)
        kw = dict(generator=gen, dtype=torch.float32)
        self.s, self.activation, self.eps = s, activation, eps
        self.Y = torch.randn(s.L, s.d, **kw).to(device)
        self.W_1 = (torch.randn(s.d, s.d_ff, **kw) / math.sqrt(s.d)).to(device)
        self.W_2 = (torch.randn(s.d_ff, s.d, **kw) / math.sqrt(s.d_ff)).to(device)
        self.X = (torch.randn(s.L, s.d, **kw) * 1.5 + 0.2).to(device)  # LN input

    # -- the block's forward, written the obvious way (what autograd differentiates) --
    def _Z(self, Y: torch.Tensor, W_1: torch.Tensor, W_2: torch.Tensor) -> torch.Tensor:
        S = _act(Y @ W_1, self.activation) @ W_2 + Y
        return F.layer_norm(S, (S.shape[-1],), eps=self.eps)

    def _ln(self, X: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(X, (X.shape[-1],), eps=self.eps)

    def closed_dense(self, q: str, t: int) -> Callable[[], torch.Tensor]:
        if q == "LN Jacobian":
            X = self.X[:t]
            return lambda: layernorm_jacobian_dense(X, self.eps)
        Y, wrt = self.Y[:t], q[-3:]
        return lambda: block_output_jacobians(Y, self.W_1, self.W_2, self.eps, self.activation, wrt=(wrt,))[wrt]

    def closed_structured(self, q: str) -> Callable[[], Any]:
        if q == "LN Jacobian":
            return lambda: layernorm_jacobian_blocks(self.X, self.eps)
        wrt = q[-3:]
        return lambda: block_output_jacobians_structured(
            self.Y, self.W_1, self.W_2, self.eps, self.activation, wrt=(wrt,)
        )[wrt]

    def autograd_dense(self, q: str, t: int, kind: str) -> Callable[[], torch.Tensor]:
        if q == "LN Jacobian":
            arg = self.X[:t].clone()
            f = lambda X: self._ln(X).reshape(-1)
        else:
            Y = self.Y[:t]
            if q == "dZ/dW_1":
                arg = self.W_1.clone()
                f = lambda W_1: self._Z(Y, W_1, self.W_2).reshape(-1)
            else:
                arg = self.W_2.clone()
                f = lambda W_2: self._Z(Y, self.W_1, W_2).reshape(-1)
        n_out = (self.X[:t] if q == "LN Jacobian" else self.Y[:t]).numel()
        shape = (n_out, arg.numel())
        if kind == "jacrev":
            jf = jacrev(f)
            return lambda: jf(arg).reshape(shape)
        vectorize = kind == "vectorize"
        return lambda: torch.autograd.functional.jacobian(f, arg, vectorize=vectorize).reshape(shape)

    def autograd_rowwise(self, q: str) -> Callable[[], Any]:
        """The structured objects, by autograd that knows rows are independent (vmap over tokens)."""
        if q == "LN Jacobian":
            jf = vmap(jacrev(self._ln))
            return lambda: jf(self.X)
        if q == "dZ/dW_2":
            jf = vmap(jacrev(self._ln))

            def w2() -> RowKronecker:
                H = _act(self.Y @ self.W_1, self.activation)
                return RowKronecker(H, jf(H @ self.W_2 + self.Y))

            return w2

        def z_of_pre(z_pre: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self._ln(_act(z_pre, self.activation) @ self.W_2 + y)

        jf1 = vmap(jacrev(z_of_pre))
        return lambda: RowKronecker(self.Y, jf1(self.Y @ self.W_1, self.Y))


def _structured_to_dense(q: str, obj: Any, t: int) -> torch.Tensor:
    """Dense Jacobian of the first ``t`` tokens of a structured result."""
    if q == "LN Jacobian":
        return _block_diag(obj[:t])
    return RowKronecker(obj.left[:t], obj.right[:t]).to_dense()


def _structured_probe(q: str, obj: Any, V: torch.Tensor) -> torch.Tensor:
    """A product that pins the structured object down on all tokens: the LN blocks, or ``J vec_r(V)``.

    (A RowKronecker may split a per-row scalar between left and right freely, so factors are not compared.)
    """
    return obj if q == "LN Jacobian" else obj.mv(V)


def _bench_quantity(p: _Problem, q: str, device: torch.device, max_dense_bytes: int) -> list[dict[str, Any]]:
    s = p.s
    itemsize = p.Y.element_size()
    t = _subset_tokens(q, s, itemsize, max_dense_bytes)
    subset = t < s.L
    fns: dict[str, Callable[[], Any]] = {
        "closed_dense": p.closed_dense(q, t),
        "closed_structured": p.closed_structured(q),
        **{k: p.autograd_dense(q, t, k) for k in DENSE_BASELINES},
        ROWWISE: p.autograd_rowwise(q),
    }

    # check every result against the baselines before timing (also the first warm-up call)
    errs: dict[str, float] = {}
    dense = fns["closed_dense"]()
    structured = fns["closed_structured"]()
    out_bytes = {"closed_dense": tensor_bytes(dense), "closed_structured": tensor_bytes(structured)}
    structured_dense = _structured_to_dense(q, structured, t)
    for k in DENSE_BASELINES:
        ref = fns[k]()
        out_bytes[k] = tensor_bytes(ref)
        errs[k] = max(rel_err(dense, ref), rel_err(structured_dense, ref))
        del ref
    del dense, structured_dense
    rowwise = fns[ROWWISE]()
    out_bytes[ROWWISE] = tensor_bytes(rowwise)
    gen = torch.Generator().manual_seed(1)
    V = torch.randn(p.W_1.shape if q == "dZ/dW_1" else p.W_2.shape, generator=gen, dtype=p.Y.dtype).to(device)
    errs[ROWWISE] = rel_err(_structured_probe(q, structured, V), _structured_probe(q, rowwise, V))
    del structured, rowwise

    timing = time_interleaved(
        fns, device, repeats=s.repeats, min_repeats=3, budget_s=s.budget_s, min_time_s=s.min_time_s
    )
    peaks = {k: peak_memory_bytes(fn, device) for k, fn in fns.items()}

    def method(k: str) -> dict[str, Any]:
        return {
            "median_s": timing[k]["median_s"],
            "min_s": timing[k]["min_s"],
            "iqr_rel": timing[k]["iqr_rel"],
            "times_s": timing[k]["times_s"],
            "number": timing[k]["number"],
            "output_bytes": out_bytes[k],
            "peak_bytes": peaks[k],
        }

    full_bytes = _dense_bytes(q, s.L, s, itemsize)
    common = {
        "size": s.name,
        "L": s.L,
        "d": s.d,
        "d_ff": s.d_ff,
        "quantity": q,
        "status": "measured",
        "full_dense_shape": [s.L * s.d, s.L * s.d if q == "LN Jacobian" else s.d * s.d_ff],
        "full_dense_bytes": full_bytes,
    }
    rows = []

    # dense closed form vs the three dense baselines, on the same tokens
    dense_row = {
        **common,
        "form": "dense",
        "tokens": t,
        "subset": subset,
        "closed_form_s": timing["closed_dense"]["median_s"],
        "closed_form": method("closed_dense"),
        "baselines": {},
        "max_rel_err": max(errs[k] for k in DENSE_BASELINES),
    }
    if subset:
        dense_row["note"] = (
            f"full dense Jacobian {common['full_dense_shape']} needs {_fmt_bytes(full_bytes)} "
            f"(> --max-dense-mib); measured on the first {t} of {s.L} tokens, i.e. the same problem with "
            f"L={t} "
            "(rows are independent, so these are exactly rows of the full Jacobian"
            + (")" if q != "LN Jacobian" else "; for LN, its leading diagonal block)")
        )
    for k, label in DENSE_BASELINES.items():
        dense_row["baselines"][k] = {
            "status": "measured",
            "label": label,
            "extrapolated": False,
            "tokens": t,
            "rel_err": errs[k],
            "ratio": timing[k]["median_s"] / timing["closed_dense"]["median_s"],
            **method(k),
        }
    rows.append(dense_row)

    # structured closed form (all L tokens) vs the dense baselines (extrapolated when measured on a subset)
    # and vs structure-aware autograd (all L tokens)
    t_struct = timing["closed_structured"]["median_s"]
    struct_row = {
        **common,
        "form": "structured",
        "tokens": s.L,
        "subset": False,
        "closed_form_s": t_struct,
        "closed_form": method("closed_structured"),
        "baselines": {},
        "max_rel_err": max(errs.values()),
        "structure": "(L, n, n) per-row blocks" if q == "LN Jacobian" else "RowKronecker(left, right)",
    }
    for k, label in DENSE_BASELINES.items():
        if subset:
            b = {
                "label": label,
                "status": "extrapolated",
                "extrapolated": True,
                "median_s": timing[k]["median_s"] * s.L / t,
                "tokens": s.L,
                "basis": f"EXTRAPOLATED: median time on {t} token(s) x {s.L}/{t}, linear in output rows; "
                "a lower bound (each row of the full problem is at least as costly) and hypothetical: "
                f"the full dense output would need {_fmt_bytes(full_bytes)}",
                "measured": {"tokens": t, **method(k)},
                "rel_err": errs[k],
            }
        else:
            b = {"label": label, "status": "measured", "extrapolated": False, "tokens": t, "rel_err": errs[k]}
            b.update(method(k))
        b["ratio"] = b["median_s"] / t_struct
        struct_row["baselines"][k] = b
    struct_row["baselines"][ROWWISE] = {
        "status": "measured",
        "label": ROWWISE_LABEL,
        "extrapolated": False,
        "tokens": s.L,
        "rel_err": errs[ROWWISE],
        "ratio": timing[ROWWISE]["median_s"] / t_struct,
        **method(ROWWISE),
    }
    rows.append(struct_row)
    return rows


def _fmt_ratio(b: dict[str, Any] | None) -> str:
    if b is None or b.get("status") == "skipped":
        return "—"
    r = b["ratio"]
    txt = f"{r:.0f}×" if r >= 10 else f"{r:.2g}×" if r >= 1 else f"{r:.2f}×"
    return f"~{txt} (extrap.)" if b.get("extrapolated") else txt


def ratio_table(rows: Sequence[dict[str, Any]]) -> str:
    header = [
        "size",
        "quantity",
        "closed form",
        "tokens",
        "closed form (ms)",
        "per-row loop",
        "vectorize=True",
        "jacrev",
        "jacrev per token (vmap)",
        "max rel err",
    ]
    body = []
    for r in rows:
        if r["status"] != "measured":
            body.append([r["size"], r["quantity"], r["form"], "—", "skipped: " + r["reason"], *["—"] * 5])
            continue
        b = r["baselines"]
        body.append(
            [
                f"{r['size']} (L={r['L']}, d={r['d']}, d_ff={r['d_ff']})",
                r["quantity"],
                r["form"],
                f"{r['tokens']}/{r['L']}",
                f"{r['closed_form_s'] * 1e3:.3g}",
                _fmt_ratio(b.get("loop")),
                _fmt_ratio(b.get("vectorize")),
                _fmt_ratio(b.get("jacrev")),
                _fmt_ratio(b.get(ROWWISE)),
                f"{r['max_rel_err']:.1e}",
            ]
        )
    return markdown_table(header, body)


def published_table(rows: Sequence[dict[str, Any]]) -> str:
    header = [
        "quantity",
        "published (CUDA, slides)",
        "ours dense: per-row loop",
        "vectorize=True",
        "jacrev",
        "ours structured: per-row loop",
    ]
    body = []
    for q in QUANTITIES:
        found = {r["form"]: r for r in rows if r["size"] == "papers" and r["quantity"] == q}
        if "dense" not in found:
            continue
        d, st = found["dense"]["baselines"], found["structured"]["baselines"]
        body.append(
            [
                q,
                f"{PUBLISHED[q]['ratio']:.0f}×",
                _fmt_ratio(d["loop"]),
                _fmt_ratio(d["vectorize"]),
                _fmt_ratio(d["jacrev"]),
                _fmt_ratio(st["loop"]),
            ]
        )
    return markdown_table(header, body)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_jacobians", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few repeats, papers' size and a shrunk 'realistic' size")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{NAME}.json)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--activation", choices=("relu", "gelu"), default="relu")
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument(
        "--max-dense-mib",
        type=float,
        default=256.0,
        help="largest dense Jacobian to materialise per method, in MiB (default 256)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"Invalid --threads={args.threads}. Must be >= 1.")
    if args.max_dense_mib <= 0:
        ap.error(f"Invalid --max-dense-mib={args.max_dense_mib}. Must be > 0.")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write the JSON, print the ratio tables; returns the JSON data."""
    args = parse_args(argv)
    device = select_device(args.device)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        sizes = QUICK if args.quick else (PAPERS, REALISTIC)
        max_dense_bytes = int(args.max_dense_mib * 2**20)
        t0 = time.perf_counter()
        rows: list[dict[str, Any]] = []
        for s in sizes:
            p = _Problem(s, args.activation, args.eps, device, args.seed)
            budget = max_dense_bytes if s.max_dense_mib is None else int(s.max_dense_mib * 2**20)
            for q in QUANTITIES:
                rows += _bench_quantity(p, q, device, budget)
                print(f"[{time.perf_counter() - t0:6.1f} s] {s.name}: {q}", file=sys.stderr, flush=True)
        data = {
            "name": NAME,
            "config": {
                "quick": args.quick,
                "device": str(device),
                "threads": args.threads,
                "dtype": "float32",
                "activation": args.activation,
                "eps": args.eps,
                "max_dense_mib": args.max_dense_mib,
                "seed": args.seed,
                "sizes": [s.__dict__ for s in sizes],
                "wall_s": time.perf_counter() - t0,
                "timing": "warm-up, round-robin repeats (rotating order), median per-call time",
                "ratio": "baseline median time / closed-form median time (> 1: closed form faster)",
            },
            "environment": environment(device),
            "published": {
                "source": "P1 thesis slides (2026), CUDA, autograd baseline not named",
                **PUBLISHED,
            },
            "baselines": {**DENSE_BASELINES, ROWWISE: ROWWISE_LABEL},
            "results": rows,
        }
        path = write_json(NAME, data, args.out)
        print(f"## Closed form vs autograd, {device}, float32, {args.threads} threads ({path})\n")
        print(ratio_table(rows))
        print("\n## Papers' size against the published ratios\n")
        print(published_table(rows))
        return data
    finally:
        torch.set_num_threads(threads_before)


if __name__ == "__main__":
    main(sys.argv[1:])
