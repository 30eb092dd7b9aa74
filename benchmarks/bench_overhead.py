"""Benchmark 3: wall-time overhead of :class:`~curvwatch.CurvatureMonitor` in a real Lightning training run.

Two models are trained with and without the monitor, same seed, data order and settings:

* ``demo``: :mod:`examples.demo`'s default run (GPT, 2 layers, d_model 64, 4 heads, 3-digit addition, batch 64,
  AdamW with the demo's schedule and gradient clipping);
* ``mid``: a mid-size GPT (6 layers, d_model 384, 6 heads, L = 256, vocabulary 65 as nanoGPT's
  shakespeare-char) on random tokens (no download), small batch (``--mid-batch``, default 8).

A timing callback records ``time.perf_counter()`` in ``on_train_batch_start`` and ``on_train_batch_end``. The
time of step ``i`` is start(i) -> start(i + 1): the whole loop iteration (forward, backward, the monitor's
capture, evaluation and logging, optimizer step, Lightning's logging, next batch). The first ``warmup`` steps
(including the monitor's first evaluation at step 0) are excluded; both variants are compared on the same
step indices. Runs are interleaved (off, every 1, every 10, ... then the next round in rotated order) and the
median over rounds is reported.

* **overhead** ``= sum(step times with) / sum(step times without) - 1`` over the same window, per round;
* **cost per evaluation** ``= (mean step time on due steps - mean on the other steps) / mean step time
  without monitor``, in units of one training step (for ``every_n_train_steps=1`` every step is due, so it
  is ``mean with / mean without - 1``); the **same-run** variant divides the same difference by the mean of
  the monitored run's own steps without evaluation, immune to the machine's load changing between runs;
* **derived** cells (mid-size model at cadences 50 and 200, whose windows would need hundreds of slow steps)
  are ``cost_per_eval / N`` from the cadence-10 cost, not measured;
* **terms only, every step**: ``CurvatureMonitor(cadence=Cadence(terms_every_n_train_steps=1),
  evaluation=Evaluation(terms_keys="all"))`` (every bound term) with full evaluations out of the window
  (``every_n_train_steps`` beyond the run: only step 0, in the warm-up), measured like cadence 1 on the cadence-1
  window, in the same rounds; **warnings only, every step** the same with ``terms_keys="warnings"`` (the default:
  what the warning rules read).

Run ``python -m benchmarks.bench_overhead [--quick] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, TensorDataset

from benchmarks.common import environment, markdown_table, select_device, synchronize, time_interleaved, write_json
from curvwatch import Cadence, CurvatureMonitor, Evaluation, find_blocks
from curvwatch.capture import Capture
from curvwatch.closed_form.settings import Lanczos
from curvwatch.data import IGNORE_INDEX, VOCAB_SIZE, AdditionDataset, sequence_length
from curvwatch.engine import evaluate_block
from curvwatch.models.gpt import GPTConfig
from examples.demo import GPTLitModule, build_parser, resolve_settings

NAME = "bench_overhead"
CPU = torch.device("cpu")
CADENCES = (1, 10, 50, 200)
DERIVE_FROM = 10  # the cadence whose measured cost per evaluation gives the derived cells
GOAL_OVERHEAD, GOAL_COST = 0.01, 1.0  # at the monitor's defaults; per evaluation at every step
DEMO = resolve_settings(build_parser().parse_args([]))  # examples.demo's default run
# The monitor's settings in the fixed-cadence runs (its defaults, but a fixed schedule: no overhead budget), put in
# their groups (Evaluation, Cadence) by run_training; the JSON records them flat.
MONITOR_KWARGS: dict[str, Any] = {
    "max_tokens": 512,
    "tol": 1e-2,
    "max_iter": 40,
    "pairs": "diagonal",
    "max_overhead": None,
}


@dataclass(frozen=True)
class Model:
    """One benchmarked training setup.

    ``windows`` maps a cadence to the number of measured steps (after ``warmup``); cadences not in it are
    derived. The run without monitor trains ``warmup + max(windows) + 1`` steps and each comparison uses its
    first ``warmup + windows[N]`` steps.
    """

    name: str
    config: GPTConfig
    batch_size: int
    data: str  # "addition" or "random"
    n_digits: int
    warmup: int
    windows: dict[int, int]
    rounds: int
    lr: float = DEMO["lr"]
    warmup_steps: int = DEMO["warmup_steps"]
    grad_clip: float = DEMO["grad_clip"]
    notes: str = ""
    max_tokens: int = MONITOR_KWARGS["max_tokens"]
    default_steps: int | None = None  # length of the runs with CurvatureMonitor() at its defaults (None: skip)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_steps(self) -> int:
        return self.warmup + max(self.windows.values()) + 1


def demo_model(rounds: int) -> Model:
    n = DEMO["n_digits"]
    cfg = GPTConfig(
        vocab_size=VOCAB_SIZE,
        block_size=sequence_length(n),
        n_layer=DEMO["n_layer"],
        n_head=DEMO["n_head"],
        d_model=DEMO["d_model"],
        norm=DEMO["norm"],
    )
    return Model(
        "demo", cfg, DEMO["batch_size"], "addition", n, warmup=10,
        windows={1: 30, 10: 200, 50: 400, 200: 400}, rounds=rounds, default_steps=DEMO["steps"],
        notes="examples.demo defaults: 3-digit addition, batch 64, L = 11",
    )  # fmt: skip


def mid_model(rounds: int, batch: int) -> Model:
    cfg = GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, d_model=384)
    # One evaluation costs tens of training steps here, so the windows are short: cadence 10 sees one
    # evaluation (step 10), cadence 1 two steps; 50 and 200 are derived.
    return Model(
        "mid", cfg, batch, "random", 0, warmup=1, windows={1: 2, 10: 11}, rounds=rounds,
        notes=f"random tokens, vocab 65, L = 256, batch {batch}",
    )  # fmt: skip


def quick_models() -> list[Model]:
    tiny = GPTConfig(vocab_size=VOCAB_SIZE, block_size=sequence_length(2), n_layer=1, n_head=2, d_model=16)
    small = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, d_model=32)
    return [
        Model("demo", tiny, 16, "addition", 2, warmup=3, windows={1: 6, 10: 12}, rounds=2, max_tokens=64,
              default_steps=30, notes="quick: 2-digit addition, 1 layer, d_model 16"),
        Model("mid", small, 4, "random", 0, warmup=3, windows={1: 6, 10: 12}, rounds=2, max_tokens=64,
              notes="quick: random tokens, 2 layers, d_model 32, L = 32"),
    ]  # fmt: skip


class StepTimer(Callback):
    """Records ``time.perf_counter()`` at the start and end of every training batch.

    On CUDA it synchronises first, so that a reading covers the kernels queued before it (one sync per hook,
    the same in the runs with and without the monitor).
    """

    def __init__(self, device: torch.device = CPU) -> None:
        self.device = device
        self.starts: list[float] = []
        self.ends: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        synchronize(self.device)
        self.starts.append(time.perf_counter())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        synchronize(self.device)
        self.ends.append(time.perf_counter())


def make_dataset(m: Model, seed: int) -> Dataset:
    n = m.batch_size * (m.max_steps + 1)  # one epoch covers the run: no epoch boundary inside a window
    if m.data == "addition":
        return AdditionDataset(m.n_digits, n, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, m.config.vocab_size, (n, m.config.block_size + 1), generator=gen)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def train_once(
    m: Model, dataset: Dataset, cadence: int | str | None, steps: int, seed: int, device: torch.device = CPU
) -> dict[str, Any]:
    """Train ``steps`` steps (with a monitor every ``cadence`` steps, ``"default"``: ``CurvatureMonitor()`` with
    its defaults, ``"terms"`` / ``"warnings"``: terms-only evaluations every step with ``terms_keys="all"`` /
    ``"warnings"``, or none); per-step wall times."""
    L.seed_everything(seed, verbose=False)
    # the learning-rate schedule of the longest run, so that every variant takes the same steps
    module = GPTLitModule(m.config, lr=m.lr, warmup_steps=m.warmup_steps, max_steps=m.max_steps)
    loader = DataLoader(
        dataset, batch_size=m.batch_size, shuffle=True, drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    timer = StepTimer(device)
    callbacks: list[Callback] = [timer]
    monitor = None
    k = MONITOR_KWARGS
    evaluation = Evaluation(max_tokens=m.max_tokens, tol=k["tol"], max_iter=k["max_iter"], pairs=k["pairs"])
    if cadence == "default":  # every 200 steps, max_overhead=0.01
        monitor = CurvatureMonitor(evaluation=Evaluation(max_tokens=m.max_tokens))
    elif cadence in ("terms", "warnings"):  # full evaluation at step 0 only (in the warm-up), terms only later
        evaluation = dataclasses.replace(evaluation, terms_keys="all" if cadence == "terms" else cadence)
        monitor = CurvatureMonitor(
            every_n_train_steps=steps + 1,
            cadence=Cadence(terms_every_n_train_steps=1, max_overhead=k["max_overhead"]),
            evaluation=evaluation,
        )
    elif cadence is not None:
        monitor = CurvatureMonitor(
            every_n_train_steps=cadence, cadence=Cadence(max_overhead=k["max_overhead"]), evaluation=evaluation
        )
    if monitor is not None:
        callbacks.append(monitor)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        # CurvatureWarnings (spikes) and Lightning's data-loader hints are not what is measured here
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            max_steps=steps, accelerator=device.type, devices=1, logger=CSVLogger(tmp, name="csv"),
            callbacks=callbacks, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=10,
            gradient_clip_val=m.grad_clip or None, enable_checkpointing=False, enable_model_summary=False,
            enable_progress_bar=False, default_root_dir=tmp,
        )  # fmt: skip
        t0 = time.perf_counter()
        trainer.fit(module, train_dataloaders=loader)
        wall = time.perf_counter() - t0
    starts, ends = timer.starts, timer.ends
    return {
        "cadence": cadence,
        "steps": len(starts),
        "wall_s": wall,
        "step_s": [b - a for a, b in zip(starts, starts[1:], strict=False)],  # start(i) -> start(i + 1)
        "hook_s": [b - a for a, b in zip(starts, ends, strict=False)],  # start(i) -> end(i)
        "evaluations": None if monitor is None else monitor.book.evaluations,
        "terms_evaluations": None if monitor is None else monitor.book.terms_evaluations,
        # the monitor's own account at the end of the run: its seconds (evaluations and logging) over the
        # training seconds (wall time minus its own), what max_overhead budgets; immune to drift between runs
        "monitor_overhead_fraction": None
        if monitor is None
        else monitor.schedule.eval_seconds / max(monitor.schedule.train_seconds, 1e-9),
        "monitor_terms_fraction": None  # the terms-only tier's part of it
        if monitor is None
        else monitor.schedule.terms_seconds / max(monitor.schedule.train_seconds, 1e-9),
    }


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def compare(off: dict[str, Any], on: dict[str, Any], cadence: int, warmup: int, window: int) -> dict[str, Any]:
    """Overhead and cost per evaluation of one monitored run against the run without monitor."""
    idx = range(warmup, warmup + window)
    base = [off["step_s"][i] for i in idx]
    with_ = [on["step_s"][i] for i in idx]
    due = [on["step_s"][i] for i in idx if i % cadence == 0]
    other = [on["step_s"][i] for i in idx if i % cadence != 0]
    mean_base = statistics.fmean(base)
    same_run = None
    if cadence == 1:
        cost = statistics.fmean(with_) / mean_base - 1
    elif due and other:
        cost = (statistics.fmean(due) - statistics.fmean(other)) / mean_base
        # the same difference in units of the run's own steps without evaluation: immune to a change of the
        # machine's load between the two runs (the other steps carry no hooks, so they are plain steps)
        same_run = (statistics.fmean(due) - statistics.fmean(other)) / statistics.fmean(other)
    else:
        cost = None
    return {
        "overhead": sum(with_) / sum(base) - 1,
        "cost_per_eval_steps": cost,
        "cost_per_eval_steps_same_run": same_run,
        "cost_per_eval_s": None if cost is None else cost * mean_base,
        "step_s_without": mean_base,
        "evaluations_in_window": len(due),
    }


def bench_model(m: Model, seed: int, device: torch.device = CPU) -> dict[str, Any]:
    dataset = make_dataset(m, seed)
    variants: list[int | str | None] = [None, *sorted(m.windows), "terms", "warnings"]
    runs: dict[str, list[dict[str, Any]]] = {str(v): [] for v in variants}
    per_round: dict[int, list[dict[str, Any]]] = {c: [] for c in m.windows}
    terms_rounds: list[dict[str, Any]] = []
    warnings_rounds: list[dict[str, Any]] = []
    for r in range(m.rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        done: dict[int | None, dict[str, Any]] = {}
        for v in order:
            steps = m.max_steps if v is None else m.warmup + m.windows[1 if v in ("terms", "warnings") else v] + 1
            done[v] = train_once(m, dataset, v, steps, seed, device)
            print(
                f"[{NAME}] {m.name} round {r + 1}/{m.rounds} every_n={v}: {done[v]['steps']} steps in "
                f"{done[v]['wall_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        for v, run in done.items():
            runs[str(v)].append(run)
        for c in m.windows:
            per_round[c].append(compare(done[None], done[c], c, m.warmup, m.windows[c]))
        terms_rounds.append(compare(done[None], done["terms"], 1, m.warmup, m.windows[1]))
        warnings_rounds.append(compare(done[None], done["warnings"], 1, m.warmup, m.windows[1]))
    cadences: dict[str, dict[str, Any]] = {}
    for c in m.windows:
        rs = per_round[c]
        costs = [x["cost_per_eval_steps"] for x in rs if x["cost_per_eval_steps"] is not None]
        same = [x["cost_per_eval_steps_same_run"] for x in rs if x["cost_per_eval_steps_same_run"] is not None]
        overheads = [x["overhead"] for x in rs]
        cadences[str(c)] = {
            "status": "measured",
            "window_steps": m.windows[c],
            "overhead": _median(overheads),
            "overhead_rounds": overheads,
            "cost_per_eval_steps": _median(costs),
            "cost_per_eval_rounds": costs,
            "cost_per_eval_steps_same_run": _median(same),
            "cost_per_eval_same_run_rounds": same,
            "cost_per_eval_s": _median([x["cost_per_eval_s"] for x in rs if x["cost_per_eval_s"] is not None]),
            "step_s_without": _median([x["step_s_without"] for x in rs]),
            "evaluations_in_window": rs[0]["evaluations_in_window"],
        }
    basis = cadences.get(str(DERIVE_FROM), {}).get("cost_per_eval_steps")
    basis_same = cadences.get(str(DERIVE_FROM), {}).get("cost_per_eval_steps_same_run")
    for c in CADENCES:
        if str(c) in cadences:
            cadences[str(c)]["derived_overhead"] = None if basis is None else basis / c
            cadences[str(c)]["derived_overhead_same_run"] = None if basis_same is None else basis_same / c
        else:
            cadences[str(c)] = {
                "status": "derived",
                "overhead": None if basis is None else basis / c,
                "overhead_same_run": None if basis_same is None else basis_same / c,
                "cost_per_eval_steps": basis,
                "cost_per_eval_steps_same_run": basis_same,
                "basis": f"cost_per_eval_steps measured at every_n_train_steps={DERIVE_FROM}, divided by N",
            }
    cfg = asdict(m.config)
    return {
        "model": m.name,
        "notes": m.notes,
        "config": cfg,
        "batch_size": m.batch_size,
        "parameters": sum(p.numel() for p in GPTLitModule(m.config).parameters()),
        "warmup_steps_excluded": m.warmup,
        "windows": {str(k): v for k, v in m.windows.items()},
        "rounds": m.rounds,
        "max_tokens": m.max_tokens,
        "cadences": {str(c): cadences[str(c)] for c in CADENCES},
        **{
            key: {
                "terms_keys": keys,
                "window_steps": m.windows[1],
                "overhead": _median([x["overhead"] for x in rs]),
                "overhead_rounds": [x["overhead"] for x in rs],
                "cost_per_eval_steps": _median([x["cost_per_eval_steps"] for x in rs]),
                "cost_per_eval_rounds": [x["cost_per_eval_steps"] for x in rs],
                "cost_per_eval_s": _median([x["cost_per_eval_s"] for x in rs]),
            }
            for key, keys, rs in (("terms_only_every_step", "all", terms_rounds),
                                  ("warnings_only_every_step", "warnings", warnings_rounds))
        },  # fmt: skip
        "runs": runs,
    }


def bench_default(m: Model, seed: int, device: torch.device = CPU) -> dict[str, Any] | None:
    """Whole runs of ``m.default_steps`` steps with ``CurvatureMonitor()`` at its defaults vs without, interleaved.

    Every step counts, step 0's evaluation included: with the overhead budget the run's total is the number
    that matters. Median over ``m.rounds`` rounds.
    """
    if m.default_steps is None:
        return None
    dataset = make_dataset(m, seed)
    rounds = []
    for r in range(m.rounds):
        order = [None, "default"] if r % 2 == 0 else ["default", None]
        done = {v: train_once(m, dataset, v, m.default_steps, seed, device) for v in order}
        off, on = done[None], done["default"]
        n = min(len(off["step_s"]), len(on["step_s"]))
        rounds.append({
            "overhead": sum(on["step_s"][:n]) / sum(off["step_s"][:n]) - 1,
            "evaluations": on["evaluations"],
            "terms_evaluations": on["terms_evaluations"],
            "monitor_overhead_fraction": on["monitor_overhead_fraction"],
            "monitor_terms_fraction": on["monitor_terms_fraction"],
            "wall_s": {"without": off["wall_s"], "with": on["wall_s"]},
        })  # fmt: skip
        print(f"[{NAME}] {m.name} defaults round {r + 1}/{m.rounds}: {rounds[-1]}", file=sys.stderr, flush=True)
    return {
        "steps": m.default_steps,
        "monitor": "CurvatureMonitor(max_tokens=...) defaults: every_n_train_steps=200, max_overhead=0.01, "
        "terms_every_n_train_steps='auto' (every 10 steps within 4%)",
        "overhead": _median([x["overhead"] for x in rounds]),
        "monitor_overhead_fraction": _median([x["monitor_overhead_fraction"] for x in rounds]),
        "monitor_terms_fraction": _median([x["monitor_terms_fraction"] for x in rounds]),
        "evaluations": [x["evaluations"] for x in rounds],
        "terms_evaluations": [x["terms_evaluations"] for x in rounds],
        "rounds": rounds,
    }


def breakdown(m: Model, seed: int, repeats: int, layers: int, device: torch.device = CPU) -> dict[str, Any]:
    """Time of one ``evaluate_block`` per sub-block of the first ``layers`` layers, vs a training step.

    Uses the monitor's kwargs on one captured step of a fresh model; interleaved repeats, median.
    """
    torch.manual_seed(seed)
    module = GPTLitModule(m.config).to(device)
    dataset = make_dataset(m, seed)
    x, y = (t.to(device) for t in next(iter(DataLoader(dataset, batch_size=m.batch_size))))
    specs = [s for s in find_blocks(module, "auto") if s.layer < layers]
    opt = torch.optim.AdamW(module.parameters())

    def loss_fn() -> torch.Tensor:
        logits = module(x)  # (B, L, vocab)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)

    def step() -> None:
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()

    with Capture(specs, max_tokens=m.max_tokens) as capture:
        loss_fn().backward()
    blocks = [b for b in capture.blocks() if b.reason is None]
    pairs = ("VV", "QQ", "KK", "W1W1", "W2W2")  # what pairs="diagonal" asks the kernels for
    lanczos = Lanczos(tol=MONITOR_KWARGS["tol"], max_iter=MONITOR_KWARGS["max_iter"], max_basis=None, warn=False)
    kw = {"lanczos": lanczos, "pairs": pairs}
    fns = {"train_step": step}
    fns.update({b.spec.name: (lambda b=b: evaluate_block(b, dtype=torch.float32, **kw)) for b in blocks})

    def hessian_only() -> None:  # the hessian part only: one Lanczos vector per product
        for b in blocks:
            evaluate_block(b, dtype=torch.float32, parts=("hessian",), **kw)

    fns["all_blocks_hessian_kind_only"] = hessian_only

    def terms_only() -> None:  # CurvatureMonitor(terms_every_n_train_steps=...): the exact pairs, no Lanczos
        for b in blocks:
            evaluate_block(b, dtype=torch.float32, pairs=("VV", "W2W2"))

    fns["all_blocks_terms_only"] = terms_only
    t = time_interleaved(fns, device, repeats=repeats, min_repeats=1, warmup=0, min_time_s=0.0)
    step_s = t["train_step"]["median_s"]
    per_block = {
        b.spec.name: {"kind": b.spec.kind, "median_s": t[b.spec.name]["median_s"],
                      "steps": t[b.spec.name]["median_s"] / step_s}
        for b in blocks
    }  # fmt: skip
    kinds: dict[str, float] = {}
    for v in per_block.values():
        kinds[v["kind"]] = kinds.get(v["kind"], 0.0) + v["median_s"]
    total = sum(kinds.values())
    return {
        "layers": layers,
        "repeats": repeats,
        "train_step_s": step_s,
        "blocks": per_block,
        "by_kind_s": kinds,
        "by_kind_share": {k: v / total for k, v in kinds.items()},
        "evaluate_total_s": total,
        "evaluate_total_steps": total / step_s,
        "evaluate_total_s_hessian_kind_only": t["all_blocks_hessian_kind_only"]["median_s"],
        "evaluate_total_s_terms_only": t["all_blocks_terms_only"]["median_s"],
        "evaluate_total_steps_terms_only": t["all_blocks_terms_only"]["median_s"] / step_s,
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _steps(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def overhead_table(results: Sequence[dict[str, Any]]) -> str:
    header = ["every N steps", *(f"{r['model']}: overhead / cost per eval in steps [same-run]" for r in results)]
    rows = []
    for c in CADENCES:
        cells = [str(c)]
        for r in results:
            d = r["cadences"][str(c)]
            if d["status"] == "derived":
                cells.append(f"≈ {_pct(d['overhead'])} [{_pct(d['overhead_same_run'])}] (derived) / –")
            else:
                same = d["cost_per_eval_steps_same_run"]
                extra = "" if same is None else f" [{_steps(same)}]"
                cells.append(f"{_pct(d['overhead'])} / {_steps(d['cost_per_eval_steps'])}{extra}")
        rows.append(cells)
    for key, label in (("terms_only_every_step", "1, terms only (`terms_keys=\"all\"`)"),
                       ("warnings_only_every_step", "1, terms only (`terms_keys=\"warnings\"`, default)")):  # fmt: skip
        if all(key in r for r in results):
            cells = [label]
            for r in results:
                d = r[key]
                cells.append(f"{_pct(d['overhead'])} / {_steps(d['cost_per_eval_steps'])}")
            rows.append(cells)
    return markdown_table(header, rows)


def goals(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        default = (r.get("defaults") or {}).get("overhead")
        cost = r["cadences"]["1"]["cost_per_eval_steps"]
        terms = r.get("terms_only_every_step", {}).get("cost_per_eval_steps")
        warn = r.get("warnings_only_every_step", {}).get("cost_per_eval_steps")
        out.append({
            "model": r["model"],
            "overhead_at_defaults": default,
            "overhead_at_defaults_ok": None if default is None else default <= GOAL_OVERHEAD,
            "cost_per_eval_steps_every_step": cost,
            "cost_per_eval_ok": None if cost is None else cost < GOAL_COST,
            "terms_only_cost_per_eval_steps": terms,
            "terms_only_cost_per_eval_ok": None if terms is None else terms < GOAL_COST,
            "warnings_only_cost_per_eval_steps": warn,
            "warnings_only_cost_per_eval_ok": None if warn is None else warn < GOAL_COST,
        })  # fmt: skip
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, short windows (< 60 s)")
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{NAME}.json)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every run (default 1)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the models train (default cpu)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds, demo model (default 3)")
    ap.add_argument("--mid-rounds", type=int, default=1, help="interleaved rounds, mid-size model (default 1)")
    ap.add_argument("--mid-batch", type=int, default=8, help="batch size of the mid-size model (default 8)")
    ap.add_argument("--models", default="demo,mid", help="comma-separated subset of demo,mid")
    ap.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip per-block timing")
    ap.add_argument("--breakdown-only", action="store_true", help="only the per-block timing (no training runs)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"Invalid --threads={args.threads}. Must be >= 1.")
    for name in ("rounds", "mid_rounds", "mid_batch"):
        if getattr(args, name) < 1:
            ap.error(f"Invalid --{name.replace('_', '-')}={getattr(args, name)}. Must be >= 1.")
    args.models = parse_models(ap, args.models)
    return args


def parse_models(ap: argparse.ArgumentParser, value: str) -> list[str]:
    """``--models`` as a list: a non-empty comma-separated subset of ``demo,mid`` (else a usage error)."""
    wanted = [s for s in value.split(",") if s]
    if not wanted or any(s not in ("demo", "mid") for s in wanted):
        ap.error(f"Invalid --models={value!r}. Must be a comma-separated subset of demo,mid.")
    return wanted


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write the JSON, print the table; returns the JSON data."""
    args = parse_args(argv)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    pl_log = logging.getLogger("lightning.pytorch")
    level_before = pl_log.level
    pl_log.setLevel(logging.WARNING)  # no "GPU available" banners between the progress lines
    try:
        device = select_device(args.device)
        models = quick_models() if args.quick else [demo_model(args.rounds), mid_model(args.mid_rounds, args.mid_batch)]
        models = [m for m in models if m.name in args.models]
        t0 = time.perf_counter()
        if args.breakdown_only:
            results = [{"model": m.name, "cadences": {}, "breakdown_only": True} for m in models]
        else:
            results = [bench_model(m, args.seed, device) for m in models]
            for m, r in zip(models, results, strict=True):
                r["defaults"] = bench_default(m, args.seed, device)
        if args.breakdown:
            for m, r in zip(models, results, strict=True):
                quick_or_demo = args.quick or m.name == "demo"
                r["breakdown"] = breakdown(
                    m, args.seed, repeats=3 if quick_or_demo else 1, layers=m.config.n_layer if quick_or_demo else 1,
                    device=device,
                )
        data = {
            "name": NAME,
            "config": {
                "quick": args.quick,
                "threads": args.threads,
                "device": args.device,
                "seed": args.seed,
                "cadences": CADENCES,
                "monitor_kwargs": {
                    **MONITOR_KWARGS,
                    "dtype": "float32",
                    "max_tokens_per_model": {m.name: m.max_tokens for m in models},
                },
                "trainer": "CPU, CSVLogger (temp dir), log_every_n_steps=10, no validation, no checkpointing, "
                "no progress bar, no model summary, gradient_clip_val as the demo, deterministic=False",
                "step_time": "perf_counter at on_train_batch_start(i) -> on_train_batch_start(i + 1)",
                "overhead": "sum of step times with / without monitor - 1, same step window; median over rounds",
                "cost_per_eval": "(mean step time on due steps - mean on other steps) / mean step time without "
                "monitor; every_n=1: mean with / mean without - 1; median over rounds",
                "cost_per_eval_same_run": "(mean step time on due steps - mean on other steps) / mean on other "
                "steps, all from the monitored run (insensitive to load changes between runs)",
                "derived": f"overhead(N) = cost_per_eval measured at N={DERIVE_FROM} / N (not measured)",
                "wall_s": time.perf_counter() - t0,
            },
            "environment": environment(torch.device("cpu")),
            "results": results,
            "goals": [] if args.breakdown_only else goals(results),
        }
        path = write_json(NAME, data, args.out)
        print(f"## Overhead of CurvatureMonitor in training, {args.device}, {args.threads} thread(s) ({path})\n")
        if not args.breakdown_only:
            print(overhead_table(results))
        for r in results:
            d = r.get("defaults")
            if d:
                print(
                    f"\n{r['model']}: {d['steps']} steps with CurvatureMonitor() at its defaults: overhead "
                    f"{_pct(d['overhead'])} (median of {len(d['rounds'])} rounds), evaluations {d['evaluations']}; "
                    f"the monitor's own seconds / training seconds: {_pct(d['monitor_overhead_fraction'])}"
                )
        for r in results:
            b = r.get("breakdown")
            if b:
                share = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(b["by_kind_share"].items()))
                print(
                    f"\n{r['model']}: one evaluation of {b['layers']} layer(s) = {b['evaluate_total_s']:.3g} s "
                    f"= {b['evaluate_total_steps']:.3g} training steps ({share}); with parts=('hessian',): "
                    f"{b['evaluate_total_s_hessian_kind_only']:.3g} s; terms only: "
                    f"{b['evaluate_total_s_terms_only']:.3g} s = {b['evaluate_total_steps_terms_only']:.3g} steps"
                )
        return data
    finally:
        torch.set_num_threads(threads_before)
        pl_log.setLevel(level_before)


if __name__ == "__main__":
    main(sys.argv[1:])
