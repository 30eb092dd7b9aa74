"""Benchmark: are the norms the monitor reports as converged right? Recorded training states against a tight solve.

A Lanczos norm is reported converged (``residual/...`` at most ``tol``, not counted in ``summary/lanczos/unconverged``)
when its Ritz value passed the residual test. This benchmark counts how many such norms are more than 1% off the
block's true norm, over the states of real training runs:

* **record**: the demo's models (curvwatch's GPT, and the LLaMA-style litgpt model of ``examples/demo.py --arch
  llama``: rotary, grouped-query attention, RMSNorm, SwiGLU) at the demo's sizes and optimizer (AdamW, warmup, cosine,
  clipping), trained on 3-digit addition (learned to ~100% answer accuracy by step ~1,200), several seeds. Every
  ``--every`` steps the step's blocks are captured as the monitor captures them, and each norm is solved tightly
  (``tol=1e-7, max_iter=400``, no restarts, float32) from two independent cold starts: the reference is the larger
  (a Ritz value never exceeds the largest |eigenvalue|), their spread is reported. Saved under
  ``benchmarks/results/convergence/`` (tensors only: any commit's code can replay them).
* **replay**: the recorded states through the monitor's default engine (``Engine()``: ``Evaluation()``'s tol 1e-2,
  max_iter 60, max_basis 16, blocks in lockstep), in three set-ups:

  - ``run``: one engine over all states in order (each evaluation warm-started from the last one's Ritz vectors);
  - ``resumed``: the same with a fresh engine at ``--resume-at`` steps that loaded the last one's checkpoint, as the
    monitor's after a resume (it does not checkpoint its warm starts), warm again from there;
  - ``cold``: a fresh engine at every state that loaded the ``run`` engine's checkpoint: the first evaluation after a
    resume at that step (no warm starts).

Each norm reported converged is compared with the reference; the table counts the norms more than 1% off and the
worst error, and the CPU seconds the evaluations took. ``--baseline REV`` replays the same states with the code of
another commit (checked out in a temporary git worktree) in the same run, side by side.

Run ``python -m benchmarks.bench_convergence [--archs gpt llama] [--seeds 0 1 2] [--steps 1200] [--every 10]
[--baseline REV] [--quick] [--threads 1] [--out PATH]`` (recorded states are reused when present: ``--states-dir``,
``--record-only``, ``--rerecord``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from curvwatch.adapters.base import BlockSpec
from curvwatch.capture import CapturedBlock
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import Engine
from curvwatch.metrics import residuals

NAME = "bench_convergence"
ROOT = Path(__file__).resolve().parent.parent
STATES_DIR = ROOT / "benchmarks" / "results" / "convergence"
#: The reference solve: tight, no restarts (every vector kept), started cold from two independent starts.
TIGHT = Lanczos(tol=1e-7, max_iter=400, max_basis=None, warn=False)
#: A norm more than this far (relative) from the reference is wrong.
WRONG = 0.01
SETUPS = ("run", "resumed", "cold")


# -- recording -------------------------------------------------------------------------------------------------------


def _settings(arch: str) -> dict[str, Any]:
    from examples.demo import _DEFAULTS, _LLAMA_SHAPE

    s = dict(_DEFAULTS)
    if arch == "llama":
        s.update(_LLAMA_SHAPE)
    return s


def record(arch: str, seed: int, steps: int, every: int) -> dict[str, Any]:
    """Train ``arch`` (the demo's model and optimizer) on 3-digit addition for ``steps`` steps; every ``every`` steps
    capture the step's blocks as the monitor does and solve their norms tightly. Returns the recording: ``states``,
    a list of ``{"step", "loss", "accuracy", "blocks": [{name, layer, kind, inputs, params}], "reference": {block:
    {key: value}}, "spread": {block: {key: relative difference of the two tight solves}}}``."""
    from curvwatch.adapters import find_blocks
    from curvwatch.capture import Capture
    from curvwatch.data import IGNORE_INDEX, AdditionDataset, answer_accuracy
    from examples.demo import GPTLitModule, model_config

    s = _settings(arch)
    torch.manual_seed(seed)
    module = GPTLitModule(model_config(arch, s), lr=s["lr"], weight_decay=s["weight_decay"],
                          warmup_steps=s["warmup_steps"], max_steps=s["steps"], arch=arch)  # fmt: skip
    opt = module.configure_optimizers()
    optimizer, scheduler = opt["optimizer"], opt["lr_scheduler"]["scheduler"]
    data = AdditionDataset(s["n_digits"], s["n_train"], seed=seed)
    gen = torch.Generator().manual_seed(seed)
    specs = find_blocks(module)
    max_tokens = Engine().token_limit
    states = []
    for step in range(steps + 1):
        rows = torch.randint(0, len(data), (s["batch_size"],), generator=gen)
        x, y = data.input_ids[rows], data.targets[rows]
        due = step % every == 0
        with Capture(specs, max_tokens) if due else contextlib.nullcontext() as capture:
            logits = module(x)  # (B, L, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
            loss.backward()
        if due:
            blocks = [b for b in capture.blocks() if b.reason is None]
            reference, spread = tight_reference(blocks)
            states.append({
                "step": step, "loss": float(loss.detach()), "accuracy": float(answer_accuracy(logits.detach(), y)),
                "blocks": [{"name": b.spec.name, "layer": b.spec.layer, "kind": b.spec.kind, "inputs": b.inputs,
                            "params": b.params} for b in blocks],
                "reference": reference, "spread": spread,
            })  # fmt: skip
            print(f"  {arch} seed {seed} step {step}: loss {float(loss.detach()):.3f}", file=sys.stderr, flush=True)
        torch.nn.utils.clip_grad_norm_(module.parameters(), s["grad_clip"])
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {"arch": arch, "seed": seed, "steps": steps, "every": every, "states": states}


@contextlib.contextmanager
def _start_seed(offset: int) -> Iterator[None]:
    """Lanczos start vectors drawn with another seed (an independent cold start for the reference's second solve): the
    solver's ``start_vectors``, wherever a module of the package holds it, shifted by ``offset``."""
    from curvwatch.closed_form.solver import lanczos as solver

    draw = solver.start_vectors

    def shifted(batch_shape, n, dtype, device, v0=None, seed=0):
        return draw(batch_shape, n, dtype, device, v0, seed + offset)

    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("curvwatch.") and getattr(m, "start_vectors", None) is draw]  # fmt: skip
    for m in holders:
        m.start_vectors = shifted
    try:
        yield
    finally:
        for m in holders:
            m.start_vectors = draw


def tight_reference(blocks: Sequence[CapturedBlock]) -> tuple[dict, dict]:
    """``({block: {key: norm}}, {block: {key: spread}})``: each Lanczos norm of ``blocks`` solved tightly from two
    independent cold starts; the norm is the larger of the two, the spread their relative difference."""
    solves = []
    for offset in (0, 7919):
        with _start_seed(offset):
            solves.append(Engine(lanczos=TIGHT, lockstep=False).evaluate(blocks).results)
    reference: dict[str, dict[str, float]] = {}
    spread: dict[str, dict[str, float]] = {}
    for name, res in solves[0].items():
        reference[name], spread[name] = {}, {}
        for key in residuals(res):
            a, b = float(res[key]), float(solves[1][name][key])
            reference[name][key] = max(a, b, key=abs)
            spread[name][key] = abs(a - b) / max(abs(a), abs(b), 1e-30)
    return reference, spread


def states_path(folder: Path, arch: str, seed: int, steps: int, every: int) -> Path:
    return folder / f"{arch}_seed{seed}_steps{steps}_every{every}.pt"


# -- replaying -------------------------------------------------------------------------------------------------------


def _blocks(state: dict[str, Any]) -> list[CapturedBlock]:
    return [CapturedBlock(BlockSpec(b["name"], b["layer"], b["kind"], None, None), dict(b["inputs"]), dict(b["params"]))
            for b in state["blocks"]]  # fmt: skip


def _resumed(engine: Engine) -> Engine:
    """A fresh engine that loaded ``engine``'s checkpoint, as the monitor's does when a run resumes (no warm starts)."""
    fresh = Engine()
    fresh.load_state_dict(engine.state_dict())
    return fresh


def replay(recording: dict[str, Any], resume_at: Sequence[int]) -> dict[str, Any]:
    """The recorded states through the default engine in each set-up (:data:`SETUPS`): every norm reported converged
    with its error against the reference, every norm not reported converged counted, and the CPU seconds."""
    rows: dict[str, list] = {s: [] for s in SETUPS}
    unconverged = dict.fromkeys(SETUPS, 0)
    seconds = dict.fromkeys(SETUPS, 0.0)
    tol = Engine().lanczos.tol
    engines = {"run": Engine(), "resumed": Engine()}
    for state in recording["states"]:
        blocks = _blocks(state)
        if state["step"] in resume_at:
            engines["resumed"] = _resumed(engines["resumed"])
        for setup in SETUPS:
            engine = engines.get(setup) or _resumed(engines["run"])
            start = time.process_time()
            results = engine.evaluate(blocks).results
            seconds[setup] += time.process_time() - start
            for name, res in results.items():
                for key, rel in residuals(res).items():
                    if not rel <= tol:
                        unconverged[setup] += 1
                        continue
                    got, ref = float(res[key]), state["reference"][name][key]
                    err = (got - ref) / max(abs(ref), 1e-30)
                    rows[setup].append((state["step"], name, key, got, ref, err, rel, state["spread"][name][key]))
    return {"rows": rows, "unconverged": unconverged, "seconds": seconds}


def summarise(replays: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per set-up over all replays: norms reported converged, how many are more than 1% off, the worst error (and
    where), the norms not reported converged, the CPU seconds, the largest spread of the references."""
    out = {}
    for setup in SETUPS:
        rows = [(rp["label"], *r) for rp in replays for r in rp["rows"][setup]]
        wrong = [r for r in rows if abs(r[6]) > WRONG]
        worst = max(rows, key=lambda r: abs(r[6]), default=None)
        out[setup] = {
            "norms": len(rows),
            "wrong": len(wrong),
            "worst_error": None if worst is None else worst[6],
            "worst": None if worst is None else f"{worst[0]} step {worst[1]} {worst[2]}/{worst[3]}",
            "unconverged": sum(rp["unconverged"][setup] for rp in replays),
            "cpu_seconds": sum(rp["seconds"][setup] for rp in replays),
            "max_reference_spread": max((r[8] for r in rows), default=0.0),
            "wrong_norms": [
                {
                    "run": r[0],
                    "step": r[1],
                    "key": f"{r[2]}/{r[3]}",
                    "got": r[4],
                    "reference": r[5],
                    "error": r[6],
                    "rel_residual": r[7],
                }
                for r in wrong
            ],  # fmt: skip
        }
    return out


def table(summaries: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The markdown table: code x set-up x (norms, wrong, worst error, unconverged, CPU seconds)."""
    from benchmarks.common import markdown_table

    rows = []
    for code, summary in summaries.items():
        for setup, s in summary.items():
            worst = "-" if s["worst_error"] is None else f"{s['worst_error']:+.2%} ({s['worst']})"
            rows.append([code, setup, s["norms"], s["wrong"], worst, s["unconverged"], f"{s['cpu_seconds']:.1f}"])
    header = ["code", "set-up", "norms reported converged", f"> {WRONG:.0%} off", "worst error", "not converged",
              "CPU s"]  # fmt: skip
    return markdown_table(header, rows)


def cost_table(costs: dict[str, dict[str, Any]]) -> str:
    """The markdown table: code x evaluation x (operators per layer, host syncs per layer, CPU seconds)."""
    from benchmarks.common import markdown_table

    rows = [[code, tier, f"{c[tier]['ops_per_layer']:.1f}", f"{c[tier]['syncs_per_layer']:.1f}",
             f"{c[tier]['cpu_seconds']:.1f}"] for code, c in costs.items() for tier in ("cold", "warm")]  # fmt: skip
    return markdown_table(["code", "evaluation", "operators / layer", "host syncs / layer", "CPU s"], rows)


def replay_all(paths: Sequence[Path], resume_at: Sequence[int]) -> dict[str, Any]:
    """:func:`replay` of every recording in ``paths``, summarised."""
    replays = []
    for path in paths:
        recording = torch.load(path, weights_only=False)
        label = f"{recording['arch']}/seed{recording['seed']}"
        print(f"  replaying {label} ({len(recording['states'])} states)", file=sys.stderr, flush=True)
        replays.append({"label": label, **replay(recording, resume_at)})
    return summarise(replays)


def cost(d_model: int = 768, n_layer: int = 2, batch: int = 2, seq: int = 128, vocab: int = 50304) -> dict[str, Any]:
    """Operators, host syncs and CPU seconds of one cold and one warm :meth:`Engine.evaluate` (no real-loss keys) of
    ``bench_dispatch``'s GPT (default: 2 layers of GPT-2-small width, B 2, L 128), counted as ``bench_dispatch``
    counts them: the cold one is a run's first evaluation (or the first after a resume), the warm one the next."""
    from benchmarks.bench_dispatch import OpCounter, build_model, count_host_reads
    from curvwatch.adapters import find_blocks
    from curvwatch.capture import Capture

    torch.manual_seed(0)
    model = build_model("gpt", n_layer, vocab, seq, d_model)
    idx = torch.randint(0, vocab, (batch, seq + 1))
    engine, specs = Engine(), find_blocks(model)
    out: dict[str, Any] = {"shape": {"d_model": d_model, "n_layer": n_layer, "batch": batch, "seq": seq}}
    for tier in ("cold", "warm"):
        with Capture(specs, engine.token_limit) as capture:
            logits = model(idx[:, :-1])
            F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
        model.zero_grad()
        blocks = capture.blocks()
        counter = OpCounter()
        start = time.process_time()
        with counter, count_host_reads(counter):
            engine.evaluate(blocks)
        seconds = time.process_time() - start
        out[tier] = {"ops_per_layer": counter.total / n_layer, "syncs_per_layer": counter.syncs / n_layer,
                     "cpu_seconds": seconds}  # fmt: skip
        print(f"  cost {tier}: {out[tier]}", file=sys.stderr, flush=True)
    return out


def _baseline(rev: str, extra: Sequence[str]) -> dict[str, Any]:
    """This benchmark's results with the code of commit ``rev``: this file run (``--replay-only`` and ``extra``) in a
    subprocess whose ``curvwatch`` is a temporary git worktree of ``rev``."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)  # fmt: skip
        try:
            out = Path(tmp) / "baseline.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--replay-only", "--out", str(out), *extra]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            subprocess.run(cmd, check=True, cwd=tree, env=env)
            return json.loads(out.read_text())["codes"]["this tree"]
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", nargs="+", default=["gpt", "llama"], choices=("gpt", "llama"))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1200, help="training steps (the task is learned by ~1,200)")
    p.add_argument("--every", type=int, default=10, help="evaluate every this many steps")
    p.add_argument(
        "--resume-at",
        nargs="*",
        type=int,
        default=None,
        help="steps at which the 'resumed' set-up loads a checkpoint [a quarter, half, three quarters]",
    )
    p.add_argument("--baseline", default=None, help="also replay with this commit's code (a git worktree)")
    p.add_argument("--quick", action="store_true", help="one GPT seed, 60 steps (a smoke run)")
    p.add_argument("--record-only", action="store_true")
    p.add_argument("--rerecord", action="store_true", help="record again even where states are saved")
    p.add_argument("--replay-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--states", nargs="*", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cost", action="store_true",
                   help="also count the operators, host syncs and CPU seconds of a cold and a warm evaluation of "
                   "bench_dispatch's 2-layer GPT of GPT-2-small width")  # fmt: skip
    p.add_argument("--no-replay", action="store_true", help="skip the replay (with --cost: the cost alone)")
    p.add_argument("--states-dir", type=Path, default=STATES_DIR, help="where recordings are kept [%(default)s]")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.archs, args.seeds, args.steps = ["gpt"], [0], 60
    resume_at = args.resume_at
    if resume_at is None:
        q = args.steps // (4 * args.every) * args.every
        resume_at = [q, 2 * q, 3 * q] if q else []
    if args.replay_only:
        paths = args.states
    else:
        paths = []
        for arch in args.archs:
            for seed in args.seeds:
                path = states_path(args.states_dir, arch, seed, args.steps, args.every)
                if args.rerecord or not path.exists():
                    print(f"recording {arch} seed {seed}", file=sys.stderr, flush=True)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    torch.save(record(arch, seed, args.steps, args.every), path)
                paths.append(path)
    codes: dict[str, dict[str, Any]] = {}
    if not args.record_only:
        if args.baseline:
            extra = [*(["--threads", str(args.threads)] if args.threads else []), *(["--cost"] if args.cost else []),
                     *(["--no-replay"] if args.no_replay else []), "--resume-at", *map(str, resume_at),
                     "--states", *map(str, paths)]  # fmt: skip
            codes[f"baseline {args.baseline}"] = _baseline(args.baseline, extra)
        codes["this tree"] = {}
        if not args.no_replay:
            codes["this tree"]["summary"] = replay_all(paths, resume_at)
        if args.cost:
            codes["this tree"]["cost"] = cost()
        summaries = {code: c["summary"] for code, c in codes.items() if "summary" in c}
        if summaries:
            print(table(summaries))
        costs = {code: c["cost"] for code, c in codes.items() if "cost" in c}
        if costs:
            print(cost_table(costs))
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "resume_at": resume_at,
                              "states": [str(p) for p in paths], "codes": codes}  # fmt: skip
    if args.out or not args.replay_only:
        from benchmarks.common import write_json

        write_json(NAME, result, args.out)
    return result


if __name__ == "__main__":
    main()
