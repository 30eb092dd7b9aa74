"""Counting for the cost model (:mod:`benchmarks.cost_model`): what one warm training step with the monitor dispatches,
counted on the CPU, part by part.

:class:`PartCounter`, a ``TorchDispatchMode`` below autograd, counts every ATen operator (the views among them launch
no kernel), every host sync (``aten::_local_scalar_dense``; ``tolist``/``numpy`` reads through
:func:`benchmarks.bench_dispatch.count_host_reads`; not the reads of AdamW's step counters, which a GPU run keeps on
the host), the matmul FLOPs by dtype (``torch.utils.flop_counter``'s formulas, and the CPU's attention kernels),
the bytes the other kernels read and write, the stretches between syncs, and the bytes of tensors alive.

:func:`count_config` counts steps 1 and 2 (warm: every step evaluates) of a Lightning run of one tier, with the monitor
attached as a user would (``CurvatureMonitor`` defaults otherwise), split into parts by the public objects that run
them (:func:`attributed`, which wraps them for the run; the package itself is unchanged):

* ``sampling``: inside ``RealLoss.sample`` (the sampled backward passes of the real-loss keys,
  :func:`curvwatch.realloss.sampling.sample_outputs`);
* ``engine``: inside ``Engine.evaluate`` (the closed forms, their Lanczos solves, the sampled keys' solves);
* ``plugin``: inside ``RealLoss.preconditioners`` and ``RealLoss.finish`` (Adam preconditioners, stability ratios);
* ``step``: everything else: the training step itself, the capture's hooks, logging.

:func:`count_all` counts every tier of a model at 1 and 2 layers and batch 1 and 2 (:data:`GRID`), the terms-only tier
at the full depth and batch 1 and 2; at batch 2 without the engine (:func:`engine_skipped`), which evaluates the same
tokens whatever the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._pytree import tree_flatten

from benchmarks.common import PeakMemory

aten = torch.ops.aten

# Operators that launch no kernel on a GPU beyond what the host does (metadata, allocation); views are found by their
# schema (``OpOverload.is_view``).
_NO_KERNEL = {
    aten._unsafe_view.default,
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.lift_fresh.default,
    aten._local_scalar_dense.default,  # a sync, counted as such
}
_SYNC = aten._local_scalar_dense.default
# Dense eigen- and singular-value decompositions: on a GPU each reads its solver's error flag on the host inside the
# kernel (a sync the mode cannot see) and costs milliseconds whatever its size (``Constants.factorization_s``)
_FACTORIZATIONS = {aten._linalg_eigh.default, aten._linalg_svd.default, aten.linalg_eig.default}
# Reads the error flags of a batch of factorizations on the host (on a GPU, a sync)
_CHECKS = {aten._linalg_check_errors.default}
# In-place operators that write their first argument without reading it
_WRITE_ONLY = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
#: Operator names kept per part in the written counts (``names``, ``name_bytes``): the most dispatched and those that
#: moved the most bytes, for ``cost_model --top``; the totals count every operator.
TOP_NAMES = 24


def _sdpa_cpu_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
    """The CPU kernel of ``scaled_dot_product_attention`` (the GPU runs flash attention for it): torch's formula."""
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# matmul-like operators: torch.utils.flop_counter's formulas (dense; a causal mask is not discounted) and the CPU's
# attention kernels, which its table lacks
_FLOPS: dict[Any, Any] = dict(flop_counter.flop_registry)
_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_cpu_flop
_FLOPS[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _sdpa_cpu_backward_flop


@dataclasses.dataclass
class Tally:
    """One part's counts: operators (``views`` of them launch no kernel), host syncs, matmul FLOPs by dtype, bytes
    moved by the other kernels, and per sync-delimited segment the same (``segments``: segment index -> ``[ops,
    {dtype: flops}, bytes]``, for the overlap of host and device between syncs). Memory: ``entry_live``, the bytes of
    tensors alive when the part was first entered, and ``working``, the most bytes alive above that while it ran.
    ``factorizations``: the dense eigen- and singular-value decompositions among the operators (each a sync too), and
    by dtype and shape in ``factorization_shapes``; ``names``: the operators by name, ``name_bytes``: the bytes each
    name moved (:meth:`as_dict` keeps the :data:`TOP_NAMES` first of each)."""

    ops: int = 0
    views: int = 0
    syncs: int = 0
    factorizations: int = 0
    flops: Counter = dataclasses.field(default_factory=Counter)
    bytes: int = 0
    segments: dict[int, list] = dataclasses.field(default_factory=dict)
    entry_live: int | None = None
    working: int = 0
    names: Counter = dataclasses.field(default_factory=Counter)
    name_bytes: Counter = dataclasses.field(default_factory=Counter)
    factorization_shapes: Counter = dataclasses.field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ops": self.ops,
            "views": self.views,
            "syncs": self.syncs,
            "factorizations": self.factorizations,
            "flops": dict(self.flops),
            "bytes": self.bytes,
            "segments": [[ops, dict(fl), by] for _, (ops, fl, by) in sorted(self.segments.items())],
            "entry_live": self.entry_live,
            "working": self.working,
            "names": dict(self.names.most_common(TOP_NAMES)),
            "name_bytes": dict(self.name_bytes.most_common(TOP_NAMES)),
            "factorization_shapes": dict(self.factorization_shapes),
        }


def _bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches reading or writing ``t``: its elements, or its storage where that is smaller (a
    broadcast view reads its storage once). A kernel reads its tensor arguments (not an ``out=`` one, nor the first of
    :data:`_WRITE_ONLY`'s) and writes its outputs."""
    n = t.numel() * t.element_size()
    return min(n, t.untyped_storage().nbytes()) if t.layout == torch.strided else n


class PartCounter(PeakMemory):
    """A :class:`~benchmarks.common.PeakMemory` (the bytes of tensor storages alive: those an operator inside the mode
    made, for as long as any view of them lives, and those handed to :meth:`hold`; what a GPU's
    ``max_memory_allocated`` reads, without the allocator's rounding) that also counts every dispatched ATen operator,
    host sync, matmul FLOP (by dtype) and byte moved into the current part (:meth:`part`).
    ``host_reads`` is the current part's count of ``tolist``/``numpy`` reads, so
    :func:`benchmarks.bench_dispatch.count_host_reads` adds to it."""

    def __init__(self, part: str = "step") -> None:
        super().__init__()
        self.parts: dict[str, Tally] = {}
        self.current = part
        self.segment = 0  # index of the stretch between two syncs
        self._peaks: list[int] = []  # per part entered and not left: the most bytes alive since its entry
        self._host: set[int] = set()  # storages a GPU run keeps on the host (:meth:`on_host`)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Count what runs inside into part ``name`` (nested parts: the innermost one)."""
        previous, self.current = self.current, name
        tally = self.parts.setdefault(name, Tally())
        entry = self.live
        if tally.entry_live is None:
            tally.entry_live = entry
        self._peaks.append(entry)
        try:
            yield
        finally:
            self.current = previous
            tally.working = max(tally.working, self._peaks.pop() - entry)

    def hold(self, tensors) -> None:
        """Count the storages of ``tensors`` (made before the mode: parameters, optimizer state, gradients) as alive
        until they are freed."""
        for t in tensors:
            self._track(t)

    def on_host(self, tensors) -> None:
        """Tensors a GPU run keeps on the host (AdamW's step counters): reading one is no sync."""
        self._host.update(t.untyped_storage().data_ptr() for t in tensors)

    def _track(self, t: torch.Tensor) -> None:
        if self.track(t, t.untyped_storage()):  # alive while any view of its storage lives
            self._peaks[:] = [max(p, self.live) for p in self._peaks]

    def _tally(self) -> tuple[Tally, list]:
        tally = self.parts.setdefault(self.current, Tally())
        seg = tally.segments.setdefault(self.segment, [0, Counter(), 0])
        return tally, seg

    @property
    def host_reads(self) -> int:
        return self._tally()[0].syncs

    @host_reads.setter
    def host_reads(self, value: int) -> None:
        tally, seg = self._tally()
        tally.syncs = value
        self.segment += 1  # the host waits for the device here

    def read_host(self) -> None:
        """One host read without a dispatched operator (``tolist``, ``numpy``: :func:`count_host_reads`), a sync."""
        self.host_reads += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        tally, seg = self._tally()
        tally.ops += 1
        tally.names[str(func)] += 1
        seg[0] += 1
        if func in _FACTORIZATIONS:
            tally.factorizations += 1
            tally.factorization_shapes[f"{str(args[0].dtype).removeprefix('torch.')} {tuple(args[0].shape)}"] += 1
        if (
            (func == _SYNC and args[0].untyped_storage().data_ptr() not in self._host)
            or func in _FACTORIZATIONS
            or func in _CHECKS
        ):
            tally.syncs += 1
            self.segment += 1
        if func.is_view or func in _NO_KERNEL:
            tally.views += 1
            return out
        packet = func._overloadpacket
        if packet in _FLOPS:
            first = next(a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor))
            flops = _FLOPS[packet](*args, **kwargs, out_val=out)
            dtype = str(first.dtype).removeprefix("torch.")
            tally.flops[dtype] += flops
            seg[1][dtype] += flops
        else:
            read = (args[1:] if func in _WRITE_ONLY else args, {k: v for k, v in kwargs.items() if k != "out"})
            moved = sum(_bytes(t) for t in tree_flatten((read, out))[0] if isinstance(t, torch.Tensor))
            tally.bytes += moved
            tally.name_bytes[str(func)] += moved
            seg[2] += moved
        return out

    def as_dict(self) -> dict[str, Any]:
        parts = {name: tally.as_dict() for name, tally in sorted(self.parts.items())}
        return {"parts": parts, "peak_bytes": self.peak}


# -- counting one configuration -----------------------------------------------------------------------------------


@contextlib.contextmanager
def attributed(counter: PartCounter) -> Iterator[PartCounter]:
    """Switch ``counter`` to the part of each public object that runs (see the module docstring), by wrapping
    ``RealLoss.sample``, ``RealLoss.preconditioners``, ``RealLoss.finish`` and ``Engine.evaluate`` on their classes
    for the duration; nothing in the package changes."""
    from curvwatch.engine import Engine
    from curvwatch.realloss import RealLoss

    wrapped = [
        (RealLoss, "sample", "sampling"),
        (RealLoss, "preconditioners", "plugin"),
        (RealLoss, "finish", "plugin"),
        (Engine, "evaluate", "engine"),
    ]
    originals = [(cls, name, getattr(cls, name)) for cls, name, _ in wrapped]

    def wrap(fn, part):
        def inside(*args, **kwargs):
            with counter.part(part):
                return fn(*args, **kwargs)

        return inside

    try:
        for (cls, name, part), (_, _, fn) in zip(wrapped, originals, strict=True):
            setattr(cls, name, wrap(fn, part))
        yield counter
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


#: What a count runs: the package and the benchmark code that drives and counts it (not the pricing).
COUNTED_PATHS = ("curvwatch", "benchmarks/cost_count.py", "benchmarks/bench_dispatch.py", "benchmarks/common.py")


def source_commit() -> str:
    """The last commit that changed :data:`COUNTED_PATHS`, ``-dirty`` when they hold changes: the code a count
    counted (the same for any later commit that leaves them alone)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", *COUNTED_PATHS)
    return git("log", "-1", "--format=%h", "--", *COUNTED_PATHS) + ("-dirty" if dirty else "")


@contextlib.contextmanager
def engine_skipped() -> Iterator[None]:
    """``Engine.evaluate`` returns an empty evaluation for the duration: for the runs that count only what depends on
    the batch (the engine evaluates the first sequence's first ``max_tokens`` positions whatever the batch)."""
    from curvwatch.engine import Engine, Evaluation

    evaluate = Engine.evaluate
    Engine.evaluate = lambda self, *args, **kwargs: Evaluation()
    try:
        yield
    finally:
        Engine.evaluate = evaluate


#: The shape the cost model estimates, ``(n_layer, batch)``: the sampled passes are counted batched as they would be
#: there (:func:`passes_as_at`).
TARGET = (12, 8)


@contextlib.contextmanager
def passes_as_at(n_layer: int, batch: int, target: tuple[int, int], chosen: list[int]) -> Iterator[None]:
    """The real-loss sampled passes batched for the duration as at the ``target`` shape ``(n_layer, batch)``, not as at
    the counted one: :func:`~curvwatch.realloss.sampling.passes_at_once` fits a batch of passes into its memory budget
    by one sample's bytes (:func:`~curvwatch.realloss.sampling.pass_bytes`: its cotangent and gradients at every block
    output, which grow with the layers and the batch), so a small counted shape would batch passes that the target runs
    one at a time. Each number of passes at once is appended to ``chosen``."""
    from curvwatch.realloss import sampling

    own = sampling.passes_at_once

    def at_target(live, start, samples, **kwargs) -> int:
        counted = own(live, start, samples, **kwargs)
        if counted > 1:  # batched at the counted shape: scale one sample's bytes to the target's
            # every term of pass_bytes grows with the batch; the gradients at the block outputs also with the layers
            outputs = sum(item.output.numel() * item.output.element_size() for item in live)
            per_sample = target[1] / batch * (sampling.pass_bytes(live, start) + outputs * (target[0] / n_layer - 1))
            memory_mb = kwargs.get("memory_mb")
            budget = (sampling.BATCH_MEMORY_MB if memory_mb is None else memory_mb) * 2**20
            counted = int(max(1, min(counted, budget // per_sample)))
        chosen.append(counted)
        return counted

    sampling.passes_at_once = at_target
    try:
        yield
    finally:
        sampling.passes_at_once = own


def _variants() -> dict[str, Any]:
    """The tiers counted: the plain step, a full evaluation every step (defaults: real-loss keys on), the same without
    the real-loss keys, a terms-only evaluation every step. In the last the schedule's step-0 full evaluation is made a
    terms-only one too (the steady state: terms-only evaluations follow terms-only ones between full ones), so that
    counting at the full depth does not wait for a 12-layer full evaluation on the CPU."""
    from curvwatch import Cadence, CurvatureMonitor

    every = {"every_n_train_steps": 1, "cadence": Cadence(max_overhead=None, terms_every_n_train_steps=None)}

    def terms() -> CurvatureMonitor:
        monitor = CurvatureMonitor(
            every_n_train_steps=10**9, cadence=Cadence(max_overhead=None, terms_every_n_train_steps=1)
        )
        schedule = monitor.monitor.schedule
        decide = schedule.decide
        schedule.decide = lambda step, agree=None: None if decide(step, agree) is None else "terms"
        return monitor

    return {
        "off": lambda: None,
        "full": lambda: CurvatureMonitor(**every),
        "full_nrl": lambda: CurvatureMonitor(**every, sharpness=False),
        "terms": terms,
    }


def count_config(
    arch: str,
    tier: str,
    n_layer: int,
    batch: int,
    seq: int,
    precision: str = "bf16-mixed",
    d_model: int = 768,
    vocab: int = 50304,
    steps: tuple[int, ...] = (1, 2),
    engine: bool = True,
    target: tuple[int, int] = TARGET,
) -> list[dict[str, Any]]:
    """The parts' counts of each of ``steps`` (warm: step 0 evaluates too) of one Lightning run of ``tier`` on the CPU.

    Args:
        arch: ``"gpt"`` (curvwatch's GPT) or ``"llama"`` (HF ``LlamaForCausalLM``, vocabulary 32000), as
            :func:`benchmarks.bench_dispatch.build_model` builds them.
        tier: A key of :func:`_variants`.
        n_layer, batch, seq, d_model, vocab: The shape.
        precision: Lightning's precision (``"bf16-mixed"``: autocast to bfloat16 on the CPU as on a GPU).
        steps: The steps counted, one :meth:`PartCounter.as_dict` each (a warm evaluation's Lanczos steps vary from
            one training step to the next).
        engine: ``False``: the engine evaluates nothing (:func:`engine_skipped`); its part is then empty.
        target: The estimate's ``(n_layer, batch)``: the sampled passes are batched as there (:func:`passes_as_at`);
            each step's count records it (``passes_at_once``).

    The GPU's choices are made (:func:`benchmarks.bench_dispatch.gpu_choices`).
    """
    from lightning.pytorch.callbacks import Callback

    from benchmarks import bench_dispatch

    class Probe(Callback):
        def __init__(self) -> None:
            self.counts: list[dict[str, Any]] = []
            self.counter: PartCounter | None = None
            self.stack: contextlib.ExitStack | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step in steps:
                self.counter = PartCounter()
                state = [t for s in trainer.optimizers[0].state.values() for t in s.values()]
                params = list(pl_module.parameters())
                self.counter.hold(
                    [t for t in [*params, *(p.grad for p in params), *state] if isinstance(t, torch.Tensor)]
                )
                self.counter.on_host([s["step"] for s in trainer.optimizers[0].state.values() if "step" in s])
                self.stack = contextlib.ExitStack()
                self.stack.enter_context(self.counter)
                self.stack.enter_context(bench_dispatch.count_host_reads(self.counter))
                self.stack.enter_context(attributed(self.counter))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.stack is not None:
                self.stack.close()
                self.stack = None
                self.counts.append({**self.counter.as_dict(), "passes_at_once": chosen[-1] if chosen else None})

    vocab = 32000 if arch == "llama" else vocab
    model_fn = lambda: bench_dispatch.build_model(arch, n_layer, vocab, seq, d_model)  # noqa: E731
    probe = Probe()
    device = torch.device("cpu")
    chosen: list[int] = []
    with (
        bench_dispatch.gpu_choices(),
        passes_as_at(n_layer, batch, target, chosen),
        contextlib.nullcontext() if engine else engine_skipped(),
    ):
        monitor = _variants()[tier]()
        bench_dispatch.run(model_fn, monitor, max(steps) + 1, -1, batch, seq, vocab, device, precision, probe=probe)
    return probe.counts


#: The configurations counted per model: ``(n_layer, batch)``; the terms-only tier at the full depth and batch 1 and 2.
#: At batch 2 the engine is skipped (its part is counted at batch 1: it evaluates the first sequence's first
#: ``max_tokens`` positions whatever the batch).
GRID = ((1, 1), (2, 1), (1, 2), (2, 2))
TIERS = ("off", "full", "full_nrl", "terms")


def count_all(
    archs,
    seq: int = 1024,
    depth: int = TARGET[0],
    grid=GRID,
    tiers=TIERS,
    d_model: int = 768,
    vocab: int = 50304,
    precision: str = "bf16-mixed",
    steps=(1, 2),
    path=None,
    counts: dict | None = None,
    batch: int = TARGET[1],
) -> dict[str, Any]:
    """Count every tier of every model of ``archs`` on the ``grid`` (the terms-only tier at ``depth`` layers, batch 1
    and 2; the sampled passes batched as at ``depth`` layers and batch ``batch``, :func:`passes_as_at`), written to
    ``path`` after each configuration (an existing entry of ``counts`` is kept: a run that stopped goes on where it
    stopped). Each configuration records the commit it counted (:func:`source_commit`) and its seconds; an entry
    counted at another commit is counted again."""
    import json
    import sys
    import time

    counts = counts if counts is not None else {}
    commit = source_commit()
    for arch in archs:
        for tier in tiers:
            configs = [(depth, 1), (depth, 2)] if tier == "terms" else list(grid)
            for n, b in configs:
                key = f"n{n}_b{b}"
                done = counts.setdefault(arch, {}).setdefault(tier, {})
                if done.get(key, {}).get("commit") == commit:
                    continue
                start = time.perf_counter()
                engine = b == 1 or tier == "off"
                counted = count_config(arch, tier, n, b, seq, precision, d_model, vocab, steps=steps, engine=engine,
                                       target=(depth, batch))  # fmt: skip
                seconds = round(time.perf_counter() - start, 1)
                done[key] = {"steps": counted, "engine": engine, "cpu_seconds": seconds, "commit": commit}
                print(f"counted {arch} {tier} {key} in {done[key]['cpu_seconds']} s", file=sys.stderr)
                if path is not None:
                    with open(path, "w") as f:
                        json.dump(counts, f)
    return counts


#: Configurations outside the grid, counted to check the extrapolation: ``(arch, tier, n_layer, batch, engine)``
CHECKS = (("gpt", "off", 3, 3, True), ("gpt", "full", 3, 3, False), ("gpt", "full_nrl", 3, 1, True))


def count_checks(path=None, checks: dict | None = None, seq: int = 1024, configs=CHECKS) -> dict[str, Any]:
    """Count the :data:`CHECKS` configurations (``{arch: {tier: {key: cell}}}``), written to ``path`` after each (an
    existing entry of ``checks`` counted at the same commit is kept)."""
    import json

    checks = checks if checks is not None else {}
    commit = source_commit()
    for arch, tier, n, b, engine in configs:
        done = checks.setdefault(arch, {}).setdefault(tier, {})
        if done.get(f"n{n}_b{b}", {}).get("commit") != commit:
            counted = count_config(arch, tier, n, b, seq, engine=engine)
            done[f"n{n}_b{b}"] = {"steps": counted, "engine": engine, "commit": commit}
            if path is not None:
                with open(path, "w") as f:
                    json.dump(checks, f)
    return checks
