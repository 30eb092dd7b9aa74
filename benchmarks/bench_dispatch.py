"""Benchmark: dispatched operators and host syncs of one monitor evaluation, per layer (and timings on a GPU).

On a GPU an evaluation of many small tensors is bound by what the host dispatches and by how often it waits for the
device, not by arithmetic. Both counts are the same on any device that takes the same solver choices, so they are
measured here on the CPU with the GPU's (:func:`gpu_choices`: the solver's and the sampling's; ``--choices device``:
the CPU's own, for its timings):

* **operators**: every ATen operator the dispatcher runs below autograd (a ``TorchDispatchMode`` counts them);
* **host syncs**: reads of a tensor's value by the host: ``aten::_local_scalar_dense`` (``.item()``, ``float(t)``,
  ``bool(t)``), ``Tensor.tolist()`` and ``Tensor.numpy()`` calls (the solver's one device-to-host copy per stopping
  test, :func:`~curvwatch.closed_form.solver.lanczos.to_host`, is one). On a CUDA device each one stops the host
  until the GPU is done.

A small Lightning run trains the same model three times (same seed and data): without the monitor, with a full
evaluation every step (``every_n_train_steps=1``, every default key, real-loss keys included) and with a terms-only
evaluation every step (the default ``terms_keys="warnings"``, full evaluations only at step 0). The counts of one warm
step (step 2) with the monitor, less those of the same step without it, divided by the number of layers, are the
monitor's per-layer cost. Defaults: a 2-layer GPT of GPT-2-small width (d 768, 12 heads, vocabulary 50304), B 2,
L 128, as the issue that set the ceilings measured it.

``--device cuda`` also times, side by side in one process, the plain step and the step with a full / terms-only
evaluation (median of ``--repeats`` steps after warm-up) and the peak memory of each (GPT-2-small shape by default on
CUDA: 12 layers, B 8, L 1024, bf16-mixed, AdamW), and prints the cost goals met or not (:func:`goals`; the third
from the monitor's own schedule on a clock of the measured costs).

Run ``python -m benchmarks.bench_dispatch [--n-layer 2] [--arch gpt|llama] [--device cpu|cuda] [--d-model 768]
[--engine-only] [--tiers full,terms] [--reads] [--time] [--out PATH]`` (``--time``: the timing path on CPU, a smoke
test of what ``--device cuda`` runs; ``--engine-only``: one warm ``Engine.evaluate`` of
captured blocks, no Trainer and no real-loss keys; ``--tiers``: the evaluations counted on CPU, e.g. ``--n-layer 12
--tiers terms``: the terms-only evaluation at GPT-2-small's depth, whose blocks meet in gathered calls; ``--reads``:
which Lanczos runs each stopping-test read of the full evaluation served, and each run's steps, :class:`ReadLabels`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from curvwatch import Cadence, CurvatureMonitor
from curvwatch.closed_form.solver.choices import GPU, forced
from curvwatch.schedule import simulate

NAME = "bench_dispatch"
_SYNC_OPS = ("aten._local_scalar_dense.default",)


class OpCounter(TorchDispatchMode):
    """Counts every dispatched ATen operator and every host read of a tensor's value inside the mode; while
    :attr:`part` names a part (:func:`count_sampling`), also that part's (:attr:`parts`: name -> ``[ops, syncs]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.host_reads = 0
        self.part: str | None = None
        self.parts: dict[str, list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.ops[name] += 1
        if self.part is not None:
            counts = self.parts.setdefault(self.part, [0, 0])
            counts[0] += 1
            counts[1] += name in _SYNC_OPS
        return func(*args, **(kwargs or {}))

    def read_host(self) -> None:
        """One host read without a dispatched operator (``tolist``, ``numpy``)."""
        self.host_reads += 1
        if self.part is not None:
            self.parts.setdefault(self.part, [0, 0])[1] += 1

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> int:
        return sum(self.ops[n] for n in _SYNC_OPS) + self.host_reads


@contextlib.contextmanager
def count_host_reads(counter: OpCounter):
    """Count ``tolist``/``numpy`` calls into ``counter.host_reads``: they read a tensor's memory without a dispatched
    operator (the solver's one host copy per stopping test, :func:`~curvwatch.closed_form.solver.lanczos.to_host`, is
    one ``numpy()`` call)."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrap(fn):
        def wrapped(*args, **kwargs):
            counter.read_host()
            return fn(*args, **kwargs)

        return wrapped

    try:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(fn))
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def count_sampling(counter: OpCounter):
    """Count the real-loss sampling (:meth:`~curvwatch.realloss.plugin.RealLoss.sample`: the loss weights, the draws
    and the sampled backward passes) as ``counter.parts["sampling"]`` too."""
    from curvwatch.realloss.plugin import RealLoss

    sample = RealLoss.sample

    def sample_(self, *args, **kwargs):
        counter.part = "sampling"
        try:
            return sample(self, *args, **kwargs)
        finally:
            counter.part = None

    RealLoss.sample = sample_
    try:
        yield counter
    finally:
        RealLoss.sample = sample


class ReadLabels:
    """Which Lanczos runs each stopping-test read served (``--reads``): while :attr:`active`, every
    :class:`~curvwatch.closed_form.solver.lanczos.LanczosRun` that steps is labelled at its first step (its product's
    function, batch shape and dimension; a run merged from several, ``merge_runs``, as ``merged[...]`` of theirs: those
    never step themselves), its steps counted, and every :func:`~curvwatch.closed_form.solver.lanczos.to_host` read
    records the labels of the runs whose stopping tests it fed. Reads in one row are one sync; runs that never share a
    row are solved one after the other (a chain of reads).

    Where the products go (:attr:`members`, per label): a run's product takes every member's row at every step, and a
    member that stopped has a zero row (a product leaves out a part none of whose members is live, and an attention
    product whose heads do not mix every member that is not: ``solver.operator.LIVE_MEMBERS``; the other stopped rows
    it computes). Per label, the member-steps (members times steps), those of live members, and those of second looks
    (``_second_look``) and of their live members: the rows a run holds, and how many of them still iterate."""

    def __init__(self) -> None:
        self.active = False
        self.reads: list[Counter[str]] = []  # per read: label -> runs tested
        self.runs: Counter[str] = Counter()  # label -> runs made
        self.steps: Counter[str] = Counter()  # label -> Lanczos steps
        # label -> {"member_steps", "live", "second", "second_live"}
        self.members: dict[str, Counter[str]] = {}

    @staticmethod
    def label(run) -> str:
        return f"{ReadLabels._product(run)} n={run.n}"

    @staticmethod
    def _product(run) -> str:
        """``"function (batch)"`` of a run's product; a merged run's as ``merged[...]`` of its runs'."""
        if run.merged:
            name = "merged[" + " + ".join(ReadLabels._product(part) for part, _, _ in run.merged) + "]"
        else:
            fn = run.matvec
            while hasattr(fn, "func"):  # functools.partial
                fn = fn.func
            name = getattr(fn, "__qualname__", type(fn).__name__).replace(".<locals>", "")
        return f"{name} {tuple(run.batch_shape)}"

    @contextlib.contextmanager
    def patched(self):
        from curvwatch.closed_form.solver import lanczos as _lanczos

        run_cls, to_host = _lanczos.LanczosRun, _lanczos.to_host
        step, check = run_cls.step, run_cls.check
        rec = self

        def step_(run):
            if rec.active:
                if getattr(run, "_bench_label", None) is None:  # its first step
                    run._bench_label = rec.label(run)
                    rec.runs[run._bench_label] += 1
                rec.steps[run._bench_label] += 1
                live = int(run.live.sum())
                m = rec.members.setdefault(run._bench_label, Counter())
                m["member_steps"] += run.b
                m["live"] += live
                if run.found is not None:  # (a second look: the first look's direction projected out)
                    m["second"] += run.b
                    m["second_live"] += live
            step(run)

        def to_host_(t):
            if rec.active:
                rec.reads.append(Counter())
            return to_host(t)

        def check_(run, ab):
            if rec.active and rec.reads and getattr(run, "_bench_label", None):
                rec.reads[-1][run._bench_label] += 1
            check(run, ab)

        run_cls.step, run_cls.check, _lanczos.to_host = step_, check_, to_host_
        try:
            yield self
        finally:
            run_cls.step, run_cls.check, _lanczos.to_host = step, check, to_host

    def summary(self) -> dict[str, Any]:
        return {
            "reads": len(self.reads),
            "runs": {k: {"made": self.runs[k], "steps": self.steps[k], **self.members.get(k, {})} for k in self.runs},
            "members": self.member_totals(),
            "per_read": [dict(c) for c in self.reads],
        }

    def member_totals(self) -> dict[str, float]:
        """The member-steps of every run labelled, live and in second looks, and their shares."""
        total = Counter(dict.fromkeys(("member_steps", "live", "second", "second_live"), 0))
        for m in self.members.values():
            total.update(m)
        steps = max(total["member_steps"], 1)
        return {**total, "live_share": total["live"] / steps, "second_share": total["second"] / steps}


def build_model(arch: str, n_layer: int, vocab: int, L_seq: int, d_model: int = 768) -> torch.nn.Module:
    """A model of GPT-2-small width (``d_model`` 768: 12 heads of 64) built from a config (no download): curvwatch's GPT
    or a HF LLaMA (12 query heads over 4 kv groups, feed-forward 2048; other widths: heads of 64 and a third as many kv
    groups, the feed-forward scaled alike)."""
    heads = max(1, d_model // 64)
    if arch == "gpt":
        from curvwatch.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=vocab, block_size=L_seq, n_layer=n_layer, n_head=heads, d_model=d_model))
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=d_model, intermediate_size=2048 * d_model // 768,
                         num_hidden_layers=n_layer, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
                         max_position_embeddings=L_seq, attn_implementation="sdpa")  # fmt: skip

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)

        def forward(self, idx):
            return self.model(input_ids=idx).logits

    return Wrapped()


class LitLM(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        idx, y = batch
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self):
        # foreach: what torch picks on CUDA, so that a CPU count sees the GPU's optimizer operators
        return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)


class StepProbe(Callback):
    """Counts the operators and host syncs of step ``at`` (from its batch start to its end) and times every step."""

    def __init__(self, at: int, device: torch.device, labels: ReadLabels | None = None) -> None:
        self.at, self.device, self.labels = at, device, labels
        self.counter: OpCounter | None = None
        self._stack: contextlib.ExitStack | None = None
        self.times: list[float] = []
        self.peak: list[int] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if trainer.global_step == self.at and self.device.type == "cpu":
            self.counter = OpCounter()
            self._stack = contextlib.ExitStack()
            self._stack.enter_context(self.counter)
            self._stack.enter_context(count_host_reads(self.counter))
            self._stack.enter_context(count_sampling(self.counter))
            if self.labels is not None:
                self.labels.active = True
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak.append(torch.cuda.max_memory_allocated())
        self.times.append(time.perf_counter() - self._t0)
        if self._stack is not None:
            self._stack.close()
            self._stack = None
            if self.labels is not None:
                self.labels.active = False


def run(model_fn, monitor: CurvatureMonitor | None, steps: int, at: int, batch: int, L_seq: int, vocab: int,
        device: torch.device, precision: str, labels: ReadLabels | None = None,
        probe: Callback | None = None) -> Any:  # fmt: skip
    """Train ``steps`` steps with ``monitor`` (or none) and return the probe: a :class:`StepProbe` counting step ``at``,
    or ``probe``, any callback, put first among the callbacks."""
    torch.manual_seed(0)
    model = LitLM(model_fn())
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (batch * steps, L_seq + 1), generator=g)
    data = DataLoader(TensorDataset(idx[:, :-1], idx[:, 1:]), batch_size=batch)
    probe = StepProbe(at, device, labels) if probe is None else probe
    callbacks: list[Callback] = [probe] + ([monitor] if monitor is not None else [])
    trainer = L.Trainer(max_steps=steps, accelerator=device.type, devices=1, precision=precision, logger=False,
                        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, data)
    return probe


def variants() -> dict[str, Any]:
    """The monitors compared: none, a full evaluation every step (with and without the real-loss keys), a terms-only
    evaluation every step."""
    return {
        "off": lambda: None,
        "full": lambda: CurvatureMonitor(
            every_n_train_steps=1, cadence=Cadence(max_overhead=None, terms_every_n_train_steps=None)
        ),
        "full_nrl": lambda: CurvatureMonitor(
            every_n_train_steps=1, cadence=Cadence(max_overhead=None, terms_every_n_train_steps=None), sharpness=False
        ),
        "terms": lambda: CurvatureMonitor(
            every_n_train_steps=10**9, cadence=Cadence(max_overhead=None, terms_every_n_train_steps=1)
        ),
    }


@contextlib.contextmanager
def gpu_choices() -> Iterator[None]:
    """The GPU's choices, made on the CPU for the duration, so that a count is what a GPU dispatches: the solver's
    (:func:`~curvwatch.closed_form.solver.choices.forced` with ``GPU``: the stopping-test cadence, a growing basis,
    stacked diagonal pairs, lockstep threads) and the real-loss sampling's (its sampled backward passes batched,
    :data:`~curvwatch.realloss.sampling.BATCH_ON_CPU`). A per-device choice added to the package is wired here too
    (the count would otherwise be the CPU's)."""
    from curvwatch.realloss import sampling

    batch_on_cpu = sampling.BATCH_ON_CPU
    sampling.BATCH_ON_CPU = True
    try:
        with forced(GPU):
            yield
    finally:
        sampling.BATCH_ON_CPU = batch_on_cpu


def count(args) -> dict[str, Any]:
    """Operators and host syncs of step 2 per variant, and the monitor's share per layer."""
    device = torch.device("cpu")
    model_fn = lambda: build_model(args.arch, args.n_layer, args.vocab, args.seq, args.d_model)
    out: dict[str, Any] = {}
    for name, make in variants().items():
        if name != "off" and name not in args.tiers.split(","):
            continue
        labels = ReadLabels() if getattr(args, "reads", False) and name == "full" else None
        with labels.patched() if labels is not None else contextlib.nullcontext():
            probe = run(model_fn, make(), 3, 2, args.batch, args.seq, args.vocab, device, "32-true", labels)
        out[name] = {"ops": probe.counter.total, "syncs": probe.counter.syncs,
                     "top": probe.counter.ops.most_common(12)}  # fmt: skip
        print(f"{name}: {out[name]['ops']} operators, {out[name]['syncs']} host syncs", file=sys.stderr)
        if "sampling" in probe.counter.parts:
            ops, syncs = probe.counter.parts["sampling"]
            out[f"{name}_sampling_per_layer"] = {"ops": ops / args.n_layer, "syncs": syncs / args.n_layer}
            print(f"{name}, of which the real-loss sampling: {ops} operators, {syncs} host syncs", file=sys.stderr)
        if labels is not None:
            out["full_reads"] = labels.summary()
            print(f"full: {len(labels.reads)} stopping-test reads; the runs each served:", file=sys.stderr)
            for i, served in enumerate(labels.reads, 1):
                print(f"  {i:4d} " + "; ".join(f"{k} x{v}" for k, v in served.items()), file=sys.stderr)
            t = labels.member_totals()
            print(f"full: {t['member_steps']} member-steps in the products, {t['live_share']:.0%} of them live; "
                  f"{t['second_share']:.0%} in second looks ({t['second_live']} live)", file=sys.stderr)  # fmt: skip
    for name in [n for n in ("full", "full_nrl", "terms") if n in out]:
        out[f"{name}_per_layer"] = {
            "ops": (out[name]["ops"] - out["off"]["ops"]) / args.n_layer,
            "syncs": (out[name]["syncs"] - out["off"]["syncs"]) / args.n_layer,
        }
    return out


def engine_only(args) -> dict[str, Any]:
    """Operators and host syncs of one warm :meth:`Engine.evaluate` (no Trainer, no real-loss sampling) per layer:
    a full evaluation and a signals (terms-only) one, each after one warm-up evaluation of the same kind."""
    from curvwatch.adapters import find_blocks
    from curvwatch.capture import Capture
    from curvwatch.engine import Engine
    from curvwatch.rules import RuleSet

    torch.manual_seed(0)
    model = build_model(args.arch, args.n_layer, args.vocab, args.seq, args.d_model)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    engine, specs = Engine(), find_blocks(model)

    def captured():
        with Capture(specs, engine.token_limit) as capture:
            logits = model(idx[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)).backward()
        model.zero_grad()
        return capture.blocks()

    out: dict[str, Any] = {}
    tiers = {"full": {}, "terms": {"terms_only": True, "signal_pairs": RuleSet().exact_pairs}}
    for tier, kwargs in tiers.items():
        if tier not in args.tiers.split(","):
            continue
        engine.evaluate(captured(), **kwargs)  # warm starts in place, as at every evaluation after the first
        blocks = captured()
        counter = OpCounter()
        start = time.perf_counter()
        with counter, count_host_reads(counter):
            engine.evaluate(blocks, **kwargs)
        out[tier] = {"ops": counter.total, "syncs": counter.syncs, "seconds": time.perf_counter() - start,
                     "top": counter.ops.most_common(12)}  # fmt: skip
        out[f"{tier}_per_layer"] = {"ops": counter.total / args.n_layer, "syncs": counter.syncs / args.n_layer}
        print(f"engine {tier}: {out[f'{tier}_per_layer']} per layer", file=sys.stderr)
    return out


def timings(args) -> dict[str, Any]:
    """Median step times (and peak memory) side by side on CUDA: plain and the ``--tiers`` evaluations (on CPU,
    ``--time``: a smoke test of this path, no peak memory). ``peak_gib``: the run's peak (a terms-only run's step 0 is a
    full evaluation); ``warm_peak_gib``: that of the timed steps."""
    device = torch.device(args.device)
    model_fn = lambda: build_model(args.arch, args.n_layer, args.vocab, args.seq, args.d_model)
    res: dict[str, Any] = {}
    for round_ in range(args.rounds):
        for name, make in variants().items():
            if name != "off" and name not in args.tiers.split(","):
                continue
            # a full evaluation every step costs many steps: fewer of them (step 0 cold, step 1 warms up)
            steps = (args.full_repeats if name.startswith("full") else args.repeats) + 2
            probe = run(model_fn, make(), steps, -1, args.batch, args.seq, args.vocab, device, args.precision)
            t = probe.times[2:]  # step 0 (a full evaluation in every monitored variant) and one warm-up step out
            res.setdefault(name, {"times": [], "peak": [], "warm_peak": [], "first": []})
            res[name]["times"] += t
            res[name]["first"].append(probe.times[0])
            res[name]["peak"].append(max(probe.peak, default=0))  # (none on CPU)
            res[name]["warm_peak"].append(max(probe.peak[2:], default=0))
            print(f"round {round_} {name}: median {statistics.median(t) * 1e3:.1f} ms", file=sys.stderr)
    plain = statistics.median(res["off"]["times"])
    for name in [n for n in res if n != "off"]:
        med = statistics.median(res[name]["times"])
        res[name]["steps"] = (med - plain) / plain  # the evaluation's cost in plain training steps
    # step 0's cold full evaluation (every monitored variant's step 0), less the plain run's step 0
    res["full"]["first_steps"] = statistics.median(
        (f - o) / plain for f, o in zip(res["full"]["first"], res["off"]["first"], strict=True)
    )
    res["plain_ms"] = plain * 1e3
    for name in res:
        if isinstance(res[name], dict):
            res[name]["median_ms"] = statistics.median(res[name]["times"]) * 1e3
            res[name]["peak_gib"] = max(res[name]["peak"]) / 2**30
            res[name]["warm_peak_gib"] = max(res[name]["warm_peak"]) / 2**30
            del res[name]["times"], res[name]["first"], res[name]["warm_peak"]
    plain_peak = res["off"]["peak_gib"] or math.nan  # (not measured on CPU)
    res["extra_peak_fraction"] = {n: res[n]["peak_gib"] / plain_peak - 1 for n in ("full", "terms")}
    res["goals"] = goals(res)
    for line in res["goals"]["lines"]:
        print(line, file=sys.stderr)
    return res


def goals(res: dict[str, Any]) -> dict[str, Any]:
    """The cost goals from measured costs (``res``: :func:`timings`' numbers, costs in plain training steps):
    1. a full evaluation <= 10 steps, a terms-only one <= 0.25; 2. extra peak memory <= 15% of the plain run's;
    3. the defaults on a 2,000-step run (the monitor's own :class:`~curvwatch.schedule.Schedule`, on a clock of these
    costs: :func:`~curvwatch.schedule.simulate`): a terms-only evaluation every 10 steps, a full one at least every
    500, within 5% of the training time."""
    full, terms, first = res["full"]["steps"], res["terms"]["steps"], res["full"]["first_steps"]
    peak = max(res["extra_peak_fraction"].values())
    # (a cost measured below zero, timing noise of a cheap evaluation, priced as free)
    run = simulate(2000, 1.0, max(full, 0.0), max(terms, 0.0), first_seconds=max(first, full, 0.0))
    met = {
        "1_full": full <= 10,
        "1_terms": terms <= 0.25,
        "2_memory": peak <= 0.15,  # (NaN, not measured: not met)
        "3_cadence": run["max_gap"] <= 10 and run["max_full_gap"] <= 500 and run["overhead"] <= 0.05,
    }
    word = {True: "met", False: "NOT met"}
    fulls = f"{run['full'][:8]}{' ...' if len(run['full']) > 8 else ''}"
    lines = [
        f"goal 1: full evaluation {full:.2f} training steps (<= 10: {word[met['1_full']]}), terms-only {terms:.3f} "
        f"(<= 0.25: {word[met['1_terms']]}); step 0's cold one {first:.2f}",
        f"goal 2: extra peak memory {100 * peak:.1f}% of the plain run's (<= 15%: {word[met['2_memory']]})",
        f"goal 3: the defaults on 2,000 steps: full evaluations at {fulls}"
        f" (longest gap {run['max_full_gap']}, <= 500), {len(run['terms'])} terms-only (longest gap without any "
        f"evaluation {run['max_gap']}, <= 10), overhead {100 * run['overhead']:.2f}% (<= 5%): {word[met['3_cadence']]}",
    ]
    return {"met": met, "cadence_2000": run, "lines": lines}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--n-layer", type=int, default=None, help="default: 2 on CPU, 12 on CUDA")
    p.add_argument("--batch", type=int, default=None, help="default: 2 on CPU, 8 on CUDA")
    p.add_argument("--seq", type=int, default=None, help="default: 128 on CPU, 1024 on CUDA")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--d-model", type=int, default=768, help="width (heads of 64); 768 is GPT-2-small's, the issue's")
    p.add_argument("--precision", default="bf16-mixed", help="CUDA only")
    p.add_argument("--repeats", type=int, default=8, help="CUDA: timed steps per run")
    p.add_argument("--full-repeats", type=int, default=3, help="CUDA: timed steps of the full-evaluation run")
    p.add_argument("--rounds", type=int, default=1, help="CUDA: rounds (each runs the three variants in turn)")
    p.add_argument(
        "--engine-only",
        action="store_true",
        help="count one warm Engine.evaluate of captured blocks "
        "(no Trainer, no real-loss keys) instead of the whole monitor in a Lightning run",
    )
    p.add_argument(
        "--tiers",
        default="full,terms",
        help="CPU counts: the evaluations counted or timed (full, full_nrl: without the real-loss keys, terms); a full "
        "evaluation's real-loss sampling (the loss weights, draws and sampled backward passes) is also counted on its "
        "own (full_sampling_per_layer)",
    )
    p.add_argument(
        "--reads",
        action="store_true",
        help="CPU, whole monitor: label which Lanczos runs each stopping-test read of the full evaluation served "
        "(and each run's steps)",
    )
    p.add_argument(
        "--time",
        action="store_true",
        help="time the steps side by side and print the goals (the default on CUDA; on CPU a smoke test of that path)",
    )
    p.add_argument(
        "--choices",
        choices=("gpu", "device"),
        default="gpu",
        help="the solver's per-device choices (curvwatch.closed_form.solver.choices): 'gpu' (default) the GPU's on "
        "any device, so the counts are what a GPU dispatches and reads; 'device' each device its own",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    args.n_layer = args.n_layer or (12 if cuda else 2)
    args.batch = args.batch or (8 if cuda else 2)
    args.seq = args.seq or (1024 if cuda else 128)
    if args.arch == "llama":  # the LLaMA-style model's own vocabulary (build_model), whatever --vocab says
        args.vocab = 32000
    measure = timings if cuda or args.time else engine_only if args.engine_only else count
    with gpu_choices() if args.choices == "gpu" else contextlib.nullcontext():
        result = {"args": vars(args), **measure(args)}
    result["device_name"] = torch.cuda.get_device_name() if cuda else "cpu"
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
