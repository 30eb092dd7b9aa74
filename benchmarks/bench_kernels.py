"""Benchmark: the closed-form kernels called directly on CPU, this tree side by side with another commit's.

Times the same calls in the current tree and, with ``--old PATH`` (a git worktree of another commit, e.g. ``git
worktree add --detach ../old 2a724ff``), in that tree, interleaved (every repeat runs each call in each tree in turn),
best of ``--repeats``, and checks each tree's values against a tight solve of the same call in float64
(:data:`TIGHT`, this tree): equal speed means little at unequal accuracy.

Each tree runs in a worker subprocess of its own (``PYTHONPATH`` set to the tree, so that it imports that tree's
``curvwatch``), kept alive for the whole run and driven over its stdin; the worker code below uses only what every
tree has and finds each tree's call by the signature of ``multi_head_attention`` (positional weights and
``kinds=`` in older trees, :class:`~curvwatch.closed_form.AttentionWeights` and ``parts=`` in newer ones).

Calls (``multi_head_attention``, per-head ``hessian`` ``QQ``, ``KK``, ``VV``, ``terms=False``, ``Lanczos(tol=1e-3)``,
cold starts, float32, causal, ``grad_output`` loss):

* ``head512``: one head, L = d = 512, d_K 64;
* ``layer256``: 8 heads, L 256, d 512;
* ``tiny``: 2 heads, L = d = 16, d_K 8 (the smoke test's);
* ``engine``: one warm full :meth:`Engine.evaluate` of a 2-layer GPT (d 128, 4 heads, L 128, B 2; the engine's
  default settings; trees with the engine API of this one only).

Run ``nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.bench_kernels [--old PATH] [--cases head512,layer256]
[--repeats 3] [--out PATH]``; prints a markdown table (call | old ms | this tree ms | ratio, the same in process CPU
time (steadier on a shared machine) | max rel diff to the tight solve, each tree) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
NAME = "bench_kernels"
CASES = ("head512", "layer256", "engine", "tiny")
#: The reference solve's settings (in float64).
TIGHT = {"tol": 1e-8, "max_iter": 600, "max_basis": 64}

# -- the worker: runs in a subprocess on one tree's curvwatch; standard library and torch only --------------------


def _inputs(case: str, dtype):
    """``(X, W_Q, W_K, W_V, W_O, H, G)`` of a kernel case, seeded (the same tensors in every tree), in ``dtype``."""
    import torch

    L, d, H, d_K = {"head512": (512, 512, 1, 64), "layer256": (256, 512, 8, 64), "tiny": (16, 16, 2, 8)}[case]
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    X = r(L, d)
    W_Q, W_K, W_V = (r(d, H * d_K, scale=d**-0.5) for _ in range(3))
    W_O = r(H * d_K, d, scale=(H * d_K) ** -0.5)
    G = r(L, d, scale=1e-2)
    X, W_Q, W_K, W_V, W_O, G = (t.to(dtype) for t in (X, W_Q, W_K, W_V, W_O, G))
    return X, W_Q, W_K, W_V, W_O, H, G


def _kernel_call(case: str, tight: bool):
    """A no-argument function making the case's ``multi_head_attention`` call in the imported tree (``tight``: the
    reference solve, float64 and :data:`TIGHT`; else float32 and ``tol=1e-3``)."""
    import inspect

    import torch

    from curvwatch import closed_form as cf

    X, W_Q, W_K, W_V, W_O, H, G = _inputs(case, torch.float64 if tight else torch.float32)
    lanczos_kwargs = TIGHT if tight else {"tol": 1e-3}
    params = inspect.signature(cf.multi_head_attention).parameters
    common = {"pairs": ("QQ", "KK", "VV"), "terms": False}
    if "W_K" in params:  # positional weights, kinds=

        def call():
            return cf.multi_head_attention(X, W_Q, W_K, W_V, W_O, H, grad_output=G, causal=True, kinds=("hessian",),
                                           lanczos=cf.Lanczos(**lanczos_kwargs), **common)  # fmt: skip
    else:  # AttentionWeights, OutputLoss, AttentionStructure, parts=
        weights = cf.AttentionWeights(W_Q, W_K, W_V, W_O, n_heads=H)
        loss, structure = cf.OutputLoss(grad_output=G), cf.AttentionStructure(causal=True)

        def call():
            return cf.multi_head_attention(X, weights, loss=loss, structure=structure, parts=("hessian",),
                                           lanczos=cf.Lanczos(**lanczos_kwargs), **common)  # fmt: skip

    return call


def _engine_call(tight: bool):
    """A no-argument function: one warm full evaluation of a small GPT's captured blocks (warm starts in place)."""
    import torch

    from curvwatch.adapters import find_blocks
    from curvwatch.capture import Capture
    from curvwatch.closed_form import Lanczos
    from curvwatch.engine import Engine
    from curvwatch.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=128, n_layer=2, n_head=4, d_model=128))
    idx = torch.randint(0, 64, (2, 129))
    engine = Engine(lanczos=Lanczos(**TIGHT), dtype="float64") if tight else Engine()
    specs = find_blocks(model)
    with torch.enable_grad(), Capture(specs, engine.token_limit) as capture:
        logits = model(idx[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1)).backward()
    blocks = capture.blocks()
    engine.evaluate(blocks)  # warm starts, as at every evaluation after the first

    def call():
        return engine.evaluate(blocks).results

    return call


def _values(out: dict) -> dict[str, float]:
    """The norms of a kernel's (or an engine evaluation's) result: every ``hessian/``/``outer/``/``functional/`` key."""
    flat: dict[str, float] = {}

    def add(prefix: str, d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                add(f"{prefix}{k}:", v)
            elif k.split("/")[0] in ("hessian", "outer", "functional"):
                flat[prefix + k] = float(v)

    add("", out)
    return flat


def worker() -> None:
    """Serve ``{"case", "tight"}`` requests on stdin: one JSON line back per request, ``{"ms", "cpu_ms", "values"}``
    (wall-clock and process CPU time of one call; or ``{"error"}``); the first request of a case builds and warms it
    up."""
    import time

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    calls: dict[tuple[str, bool], Any] = {}
    for line in sys.stdin:
        req = json.loads(line)
        key = (req["case"], req["tight"])
        try:
            with torch.no_grad():
                if key not in calls:
                    if req["case"] == "engine":
                        calls[key] = _engine_call(req["tight"])
                    else:
                        calls[key] = _kernel_call(req["case"], req["tight"])
                    calls[key]()  # warm-up
                start, cpu = time.perf_counter(), time.process_time()
                out = calls[key]()
                ms, cpu_ms = (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3
            reply = {"ms": ms, "cpu_ms": cpu_ms, "values": _values(out)}
        except Exception as err:  # a tree without this call's API: reported, not fatal
            reply = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(reply), flush=True)


# -- the driver ------------------------------------------------------------------------------------------------


class Tree:
    """A worker subprocess on the ``curvwatch`` of the tree at ``path``."""

    def __init__(self, name: str, path: Path) -> None:
        self.name, self.path = name, path
        env = {**os.environ, "PYTHONPATH": str(path)}
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(path))  # fmt: skip

    def ask(self, case: str, tight: bool = False) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"case": case, "tight": tight}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.proc.stdout.close()


def _commit(path: Path) -> str | None:
    """The commit checked out at ``path`` (``+`` when its tracked files differ from it), or None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(path), "diff", "--quiet", "HEAD"]).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty else "")


def max_rel_diff(values: dict[str, float], ref: dict[str, float]) -> float:
    """Largest ``|v - ref| / |ref|`` over the keys of ``ref`` (``|v|`` where ``ref`` is 0, ``inf`` where a key is
    missing)."""
    return max((abs(values[k] - r) / (abs(r) or 1.0) if k in values else float("inf")) for k, r in ref.items())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", type=Path, default=None, help="a worktree of the commit to compare with")
    p.add_argument("--cases", default="head512,layer256")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"Invalid --cases {unknown}. Must be among {CASES}.")
    trees = ([Tree("old", args.old.resolve())] if args.old is not None else []) + [Tree("this", ROOT)]
    try:
        ref = {c: trees[-1].ask(c, tight=True) for c in cases}  # the tight solve, this tree
        for c, r in ref.items():
            if "error" in r:
                raise SystemExit(f"tight solve of {c} failed: {r['error']}")
        runs: dict[str, dict[str, list]] = {t.name: {c: [] for c in cases} for t in trees}
        for rep in range(args.repeats):  # interleaved: each repeat runs every call in every tree in turn
            for c in cases:
                for t in trees if rep % 2 == 0 else trees[::-1]:
                    runs[t.name][c].append(t.ask(c))
    finally:
        for t in trees:
            t.close()
    res: dict[str, Any] = {
        "repeats": args.repeats,
        "old": None if args.old is None else str(args.old),
        "old_commit": None if args.old is None else _commit(args.old),
        "this_commit": _commit(ROOT),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        },
        "cases": {},
    }
    for c in cases:
        row = {}
        for t in trees:
            got = runs[t.name][c]
            errors = [g["error"] for g in got if "error" in g]
            if errors:
                row[t.name] = {"error": errors[0]}
                continue
            row[t.name] = {
                "best_ms": min(g["ms"] for g in got),
                "best_cpu_ms": min(g["cpu_ms"] for g in got),
                "ms": [g["ms"] for g in got],
                "cpu_ms": [g["cpu_ms"] for g in got],
                "max_rel_diff": max(max_rel_diff(g["values"], ref[c]["values"]) for g in got),
            }
        res["cases"][c] = row
    print("| call | old ms | this tree ms | ratio | old CPU ms | this CPU ms | CPU ratio | max rel diff to tight solve "
          "(old / this) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")

    def ok(r) -> bool:
        return r is not None and "error" not in r

    for c, row in res["cases"].items():
        new, old = row["this"], row.get("old")
        cells = [c]
        for field in ("best_ms", "best_cpu_ms"):
            cells += [f"{r[field]:.1f}" if ok(r) else "n/a" for r in (old, new)]
            cells.append(f"{new[field] / old[field]:.2f}" if ok(old) and ok(new) else "n/a")
        cells.append(" / ".join(f"{r['max_rel_diff']:.1e}" if ok(r) else "n/a" for r in (old, new)))
        print("| " + " | ".join(cells) + " |")
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    if "--worker" in sys.argv:
        worker()
    else:
        main()
