"""Sharded runs of the tiny GPT on 2 CPU processes (gloo), for ``tests/test_sharded.py``.

    python tests/fsdp_script.py OUT_DIR SCENARIO [--accelerator A --devices N]

``SCENARIO``: ``ddp``, ``fsdp2``, ``encoder``, ``real-loss``, ``fsdp1``, ``lightning-fsdp1`` or ``compare``.

``ddp`` and ``fsdp2`` train a 2-layer GPT with SGD under Lightning, with a CSVLogger and a CurvatureMonitor
evaluating on steps 0, 2, 4, ...: ``ddp`` for 5 steps (``OUT_DIR/ddp``); ``fsdp2`` under
``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` with ``fully_shard`` on each layer and the
root in ``configure_model``, three fits in the same processes: 5 steps, then a checkpoint (a distributed checkpoint:
a folder, ``OUT_DIR/fsdp2.ckpt``) (``OUT_DIR/fsdp2``); resumed from it up to step 9 (``OUT_DIR/resumed``); 5 steps
from scratch with activation checkpointing (each layer in a non-reentrant checkpoint wrapper before sharding) and
the closed form of ``layer0/attn`` raising on rank 1 only, at its second evaluation (step 2) (``OUT_DIR/fail``).

``encoder`` trains a 2-layer ``nn.TransformerEncoderLayer`` LM (:func:`encoder_lm`) for 5 steps under DDP
(``OUT_DIR/encoder_ddp``), then under FSDP2 with ``fully_shard`` on each layer's attention and MLP Linears, the layer
and the root (``OUT_DIR/encoder_fsdp2``), in the same two processes.

``real-loss`` trains the 2-layer GPT with AdamW for 5 steps under DDP (``OUT_DIR/adamw_ddp``) and under FSDP2
(``OUT_DIR/adamw_fsdp2``), then under FSDP2 with SGD where rank 1's kept tokens carry no loss weight at step 0
(``OUT_DIR/unscored``), then AdamW under FSDP2 in a plain loop without Lightning, the real-loss keys sampled during
the backward (``OUT_DIR/plain_fsdp2``, :func:`plain_loop_fsdp2`), in the same two processes. Every Lightning run
has the real-loss keys on (``sharpness`` ``"auto"``: on under DDP and FSDP2, off under FSDP1).

``fsdp1`` runs FSDP1 outside Lightning (``torch.distributed.fsdp.FullyShardedDataParallel`` on CPU, which
Lightning's ``FSDPStrategy`` does not allow), comparing the monitor's numbers through
:func:`curvwatch.sharding.summoned_params` with those of an unsharded copy of the model on the same batch, under four
wrappings, with a block failing on rank 1 only (``OUT_DIR/fsdp1``).

``lightning-fsdp1`` trains under Lightning's ``FSDPStrategy`` (per-layer wrap policy), with and without
``use_orig_params`` (``OUT_DIR/fsdp1``, ``OUT_DIR/fsdp1_orig``; on CPU through :func:`cpu_fsdp_strategy`; on GPUs by
``benchmarks/gpu_fsdp_check.sh``); ``compare`` prints
how each run's step-0 numbers compare with the ``ddp`` run's. ``--accelerator`` and ``--devices`` (default ``cpu``,
``2``) set the Lightning runs' hardware.

Started as one process, a run starts the second rank itself; with ``LOCAL_RANK`` (and ``MASTER_ADDR``,
``MASTER_PORT``) set, the caller starts both ranks, as the tests do (both import at once: half the wall time).

Each rank writes ``rank{r}.json`` into each run's folder: the blocks whose weights it read, per evaluation and in
order (``reads``); the most bytes of read weights alive at once (``peak_bytes``) and those still alive after each
evaluation (``alive_after``); the bytes of each block's weights (``block_bytes``); the bytes of weight snapshots the
capture held (``snapshot_bytes``, per evaluation); the monitor's state on this rank at the start and the end of the
fit (``states``); the real-loss numbers this rank holds after the ranks agreed, per evaluation (``agreed``); on rank
zero the ``curv/`` numbers that reached the logger, by step (``logged``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import weakref

import torch

if __package__ in (None, ""):  # run as a script: make `curvwatch` and `tests` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import curvwatch.engine.core as engine_core
from curvwatch import (
    Evaluation,
    Warnings,
    sharding,  # noqa: E402
)
from curvwatch.engine import Engine  # noqa: E402
from curvwatch.ranks import Ranks  # noqa: E402

#: The first parts of the real-loss keys (``curv/layer0/attn/sharpness/QQ/h0``...): the sampled passes' numbers.
REAL_LOSS = ("sharpness", "sharpness_spread", "ggn", "precond_sharpness", "precond_ggn", "stability")


class Ledger:
    """What this rank read and held: the instrumented readers and engine write here."""

    def __init__(self) -> None:
        self.reads: list[list[str]] = []
        self.alive = 0
        self.peak = 0
        self.alive_after: list[int] = []
        self.block_bytes: dict[str, int] = {}
        self.snapshot_bytes: list[int] = []
        self.agreed: list[dict[str, float]] = []

    def reset(self) -> None:
        """Start the record of a new fit (read weights still alive stay counted)."""
        self.reads, self.peak, self.alive_after, self.block_bytes, self.snapshot_bytes = [], self.alive, [], {}, []
        self.agreed = []

    def _release(self, n: int) -> None:
        self.alive -= n

    def track(self, name: str, params: dict) -> dict:
        """Count the tensors of one block's read weights while they are alive."""
        total = 0
        for t in _tensors(params):
            n = t.numel() * t.element_size()
            total += n
            self.alive += n
            weakref.finalize(t, self._release, n)
        self.peak = max(self.peak, self.alive)
        self.block_bytes[name] = total
        self.reads[-1].append(name)
        return params

    def instrument(self) -> None:
        """Wrap the FSDP2 reader and the engine (module attributes, looked up at call time)."""
        full_params, evaluate = sharding.full_params, Engine.evaluate

        def reader(spec):
            return self.track(spec.name, full_params(spec))

        def instrumented(engine, captured, *args, **kwargs):
            self.reads.append([])
            self.snapshot_bytes.append(
                sum(t.numel() * t.element_size() for block in captured for t in _tensors(block.params))
            )
            try:
                return evaluate(engine, captured, *args, **kwargs)
            finally:
                self.alive_after.append(self.alive)

        def sync(ranks, flat, failed):
            out = sync_numbers(ranks, flat, failed)
            self.agreed.append({f"{b}/{k}": v for (b, k), v in out[0].items() if _real_loss(k)})
            return out

        sharding.full_params = reader
        Engine.evaluate = instrumented
        sync_numbers, Ranks.sync = Ranks.sync, sync

    def dump(self, path: str, **extra) -> None:
        with open(path, "w") as f:
            json.dump(
                {
                    "reads": self.reads,
                    "peak_bytes": self.peak,
                    "alive_after": self.alive_after,
                    "block_bytes": self.block_bytes,
                    "snapshot_bytes": self.snapshot_bytes,
                    "agreed": self.agreed,
                    **extra,
                },
                f,
            )


def _real_loss(key: str) -> bool:
    """Whether ``key`` is one of the real-loss keys (the sampled backward passes' numbers)."""
    return any(part in key.split("/") for part in REAL_LOSS)


def _tensors(params: dict):
    for v in params.values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            yield from _tensors(v)


def _fail(rank: int, block: str, at: int | None = None) -> None:
    """Make the closed form of ``block`` raise on ``rank`` only: at its ``at``-th evaluation (1-based), or at all."""

    original, calls = engine_core.evaluate_block, []

    def evaluate(self, **kwargs):
        if int(os.environ.get("LOCAL_RANK", "0")) == rank and self.spec.name == block:
            calls.append(None)
            if at is None or len(calls) == at:
                raise RuntimeError(f"induced failure of {block} on rank {rank}")
        return original(self, **kwargs)

    engine_core.evaluate_block = evaluate


def sharded_lm(activation_checkpointing: bool = False, adamw: bool = False, unscored: tuple[int, int] | None = None):
    """The 2-layer tiny GPT of ``tests/ddp_script.py``, sharded with FSDP2 per layer and at the root in
    ``configure_model`` when the strategy has a device mesh (imported here: the FSDP1 run needs no Lightning).

    ``adamw``: AdamW instead of SGD. ``unscored=(rank, step)``: on that rank at that step the first two sequences
    (the tokens the monitor keeps at ``max_tokens=16``) carry no loss weight (``ignore_index``)."""
    import torch.nn.functional as F

    from tests.ddp_script import VOCAB, TinyLM

    class ShardedLM(TinyLM):
        def __init__(self, activation_checkpointing: bool = False) -> None:
            super().__init__(n_layer=2)
            self.activation_checkpointing = activation_checkpointing

        def training_step(self, batch, batch_idx):
            if unscored != (self.global_rank, self.global_step):
                return super().training_step(batch, batch_idx)
            (idx,) = batch
            labels = idx[:, 1:].clone()
            labels[:2] = -100  # the kept sequences: no loss weight
            return F.cross_entropy(self(idx[:, :-1]).reshape(-1, VOCAB), labels.reshape(-1))

        def configure_optimizers(self):
            if adamw:
                return torch.optim.AdamW(self.parameters(), lr=self.lr)
            return super().configure_optimizers()

        def configure_model(self) -> None:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
            from torch.distributed.fsdp import fully_shard

            from curvwatch.models.gpt import Block

            if self.activation_checkpointing:
                apply_activation_checkpointing(self.model, check_fn=lambda m: isinstance(m, Block))
            if self.device_mesh is None:  # DDP
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.blocks:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return ShardedLM(activation_checkpointing)


def encoder_lm():
    """A 2-layer LM of ``nn.TransformerEncoderLayer`` s (d 8, 2 heads) whose FSDP2 wrapping in ``configure_model``
    shards each layer's attention and MLP Linears, then the layer, then the root (per-sub-module sharding: FSDP2's
    pre-forward hook of the attention module hands it aliases of its query/key/value input, not the same object)."""
    import lightning as L
    import torch.nn.functional as F
    from torch import nn

    from tests.ddp_script import VOCAB

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 8)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True) for _ in range(2)
            )
            self.head = nn.Linear(8, VOCAB)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.emb(idx)  # (B, L, d)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    class EncoderLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Encoder()

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.model(idx)

        def training_step(self, batch, batch_idx):
            (idx,) = batch
            logits = self(idx[:, :-1])  # (B, L - 1, V)
            return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2)

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if self.device_mesh is None:  # DDP
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers:
                for sub in (layer.self_attn, layer.linear1, layer.linear2):
                    fully_shard(sub, mesh=mesh)
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return EncoderLM()


def cpu_fsdp_strategy() -> type:
    """Lightning's ``FSDPStrategy`` on CPU, for the tests: Lightning refuses the class itself off CUDA (an exact type
    check) and wraps with ``device_id=root_device.index`` (``None`` on CPU, which torch's FSDP1 refuses); torch FSDP1
    runs on CPU (gloo) with ``device_id=cpu``. This subclass changes that argument alone (no activation checkpointing,
    no torchmetrics: not used here)."""
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model):
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )

    return CPUFSDPStrategy


def lightning_run(
    out_dir: str,
    ledger: Ledger,
    strategy: str,
    max_steps: int = 5,
    activation_checkpointing: bool = False,
    save: str | None = None,
    resume: str | None = None,
    accelerator: str = "cpu",
    devices: int = 2,
    lm=None,
    **model_options,
) -> None:
    """One fit under ``strategy`` (``"ddp"``, ``"fsdp2"``, ``"fsdp1"`` or ``"fsdp1_orig"``: FSDP1 with
    ``use_orig_params``), recorded into ``out_dir/rank{r}.json``; ``model_options`` go to :func:`sharded_lm`."""
    import csv

    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from curvwatch import CurvatureMonitor
    from curvwatch.models.gpt import Block
    from tests.ddp_script import loader

    os.makedirs(out_dir, exist_ok=True)
    ledger.reset()
    L.seed_everything(0, verbose=False)
    # real-loss keys (sharpness="auto"): on under DDP and FSDP2, off under FSDP1 (the set-up line says why)
    monitor = CurvatureMonitor(
        every_n_train_steps=2,
        log_heatmap=False,
        log_level="all",
        evaluation=Evaluation(max_tokens=16),
        warning_rules=Warnings(warn=False),
    )
    states = {}

    class Record(Callback):  # the monitor's state on this rank once restored
        def on_train_start(self, trainer, pl_module):
            states["start"] = {k: monitor.state_dict()[k] for k in ("evaluations", "skipped", "last_step")}

    fsdp = FSDPStrategy if accelerator != "cpu" else cpu_fsdp_strategy()
    logger = CSVLogger(out_dir, name="logs", version=0)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy={
            "ddp": lambda: "ddp",
            "fsdp2": lambda: ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1),
            "fsdp1": lambda: fsdp(auto_wrap_policy={Block}, use_orig_params=False),
            "fsdp1_orig": lambda: fsdp(auto_wrap_policy={Block}, use_orig_params=True),
        }[strategy](),
        max_steps=max_steps,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[monitor, Record()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    torch.manual_seed(0)  # the initial weights: the same in every run (the plain loop's too)
    model = sharded_lm(activation_checkpointing, **model_options) if lm is None else lm()
    trainer.fit(model, loader(n=40), ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    states["end"] = {k: monitor.state_dict()[k] for k in ("evaluations", "skipped", "last_step")}
    logged: dict[int, dict[str, float]] = {}
    if trainer.is_global_zero:
        with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
            for row in csv.DictReader(f):
                values = {k: float(v) for k, v in row.items() if k.startswith("curv/") and v}
                if values:
                    logged.setdefault(int(row["step"]), {}).update(values)
    ledger.dump(
        os.path.join(out_dir, f"rank{trainer.global_rank}.json"),
        world_size=trainer.world_size,
        states=states,
        logged=logged,
        param_types=sorted({type(p).__name__ for p in model.parameters()}),
    )


def plain_loop_fsdp2(out_dir: str, steps: int = 5) -> None:
    """The ``real-loss`` scenario's AdamW run without Lightning: :class:`curvwatch.Monitor` in a plain loop over the
    batches each rank gets under Lightning (its ``DistributedSampler``: shuffled, seed 0), the model sharded with
    FSDP2 as in :func:`sharded_lm`, the real-loss keys sampled from the logits' gradient during the backward (the loop
    does not hand the loss over); rank zero writes what it logged (``OUT_DIR/plain_fsdp2``). Needs the process group
    of an earlier Lightning run."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DistributedSampler

    from curvwatch.adapters import find_blocks
    from curvwatch.monitor import Monitor
    from tests.ddp_script import VOCAB, loader

    os.makedirs(out_dir, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = sharded_lm().model  # the same initial weights as the Lightning runs'
    specs = find_blocks(model)  # before sharding, as the callback's setup
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.blocks:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logged: dict[str, dict[str, float]] = {}
    monitor = Monitor(
        optimizer=optimizer,
        log=lambda metrics, step: logged.setdefault(str(step), {}).update(metrics),
        every_n_train_steps=2,
        log_heatmap=False,
        log_level="all",
        evaluation=Evaluation(max_tokens=16),
        warning_rules=Warnings(warn=False),
    )
    monitor.attach(model, specs=specs, read_params=sharding.full_params)
    dataset = loader(n=40).dataset
    order = list(DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0))  # Lightning's
    for step in range(steps):
        (idx,) = dataset[order[4 * step : 4 * step + 4]]
        with monitor.step(step):
            logits = model(idx[:, :-1])
            F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        with open(os.path.join(out_dir, "rank0.json"), "w") as f:
            json.dump({"logged": logged, "param_types": sorted({type(p).__name__ for p in model.parameters()})}, f)


def fsdp1_worker(rank: int, out_dir: str) -> None:
    """FSDP1 on CPU (gloo): the monitor's numbers through summon_full_params vs an unsharded copy of the model, under
    four wrappings (per layer with and without ``use_orig_params``, layers and their Linears, the root alone), and
    a block failing on rank 1 only, which must not hang the other rank."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from curvwatch.adapters import find_blocks
    from curvwatch.capture import Capture
    from curvwatch.models.gpt import GPT, Block, GPTConfig

    os.makedirs(out_dir, exist_ok=True)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", rank=rank, world_size=2)  # MASTER_ADDR, MASTER_PORT from the environment
    ledger = Ledger()
    _fail(1, "layer1/ffn")  # rank 1 only: the block is left out there, every block's weights are still read

    def evaluate(model, specs, reader, idx):
        with Capture(specs, max_tokens=16, read_params=reader) as capture:
            model(idx).square().mean().backward()
        return Engine().evaluate(capture.blocks())

    wrappings = {
        "layers": (False, {Block}),
        "layers, use_orig_params": (True, {Block}),
        "layers and linears": (False, {Block, torch.nn.Linear}),
        "root only": (False, None),
    }
    out = {}
    for name, (use_orig_params, wrap) in wrappings.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, d_ff=16))
        reference = copy.deepcopy(model)
        specs = find_blocks(model)  # found before wrapping, as the monitor's setup does under Lightning
        wrapped = FSDP(
            model,
            auto_wrap_policy=None if wrap is None else ModuleWrapPolicy(wrap),
            device_id=torch.device("cpu"),
            use_orig_params=use_orig_params,
        )
        summoned = sharding.summoned_params(lambda wrapped=wrapped: wrapped)
        reader = lambda spec, summoned=summoned: ledger.track(spec.name, summoned(spec))  # noqa: E731
        idx = torch.randint(0, 11, (4, 8), generator=torch.Generator().manual_seed(rank))  # this rank's batch
        ledger.reads.append([])
        sharded = evaluate(wrapped, specs, reader, idx)
        ledger.alive_after.append(ledger.alive)
        plain = evaluate(reference, find_blocks(reference), None, idx)
        out[name] = {
            "sharded": {b: {k: float(v) for k, v in r.items()} for b, r in sharded.results.items()},
            "plain": {b: {k: float(v) for k, v in r.items()} for b, r in plain.results.items()},
            "failed": sorted(sharded.failed),
            "units": sum(isinstance(m, FSDP) for m in wrapped.modules()),
            "unchanged": _same_weights(wrapped, model, reference),
        }
    dist.destroy_process_group()
    ledger.dump(os.path.join(out_dir, f"rank{rank}.json"), fsdp1=out)


def _same_weights(wrapped, model, reference) -> bool:
    """Whether the FSDP1 model's full weights still equal the unsharded copy's (``writeback=False`` kept them)."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(wrapped, writeback=False):
        return all(
            torch.equal(functools.reduce(getattr, name.split("."), model), p)
            for name, p in reference.named_parameters()
        )


def compare(out_dir: str) -> int:
    """Print, for each run under ``out_dir`` (GPU check), how its step-0 numbers compare with the ``ddp`` run's and
    what it read; 1 if any run is missing, logs other keys or steps, or numbers beyond float32 round-off."""
    from tests.utils import TOL

    def load(run: str) -> dict | None:
        path = os.path.join(out_dir, run, "rank0.json")
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    ddp, status = load("ddp"), 0
    if ddp is None:
        print(f"no ddp run under {out_dir}")
        return 1
    for run in ("ddp", "fsdp2", "fsdp1", "fsdp1_orig"):
        result = load(run)
        if result is None:
            print(f"{run:11s} missing")
            status = 1
            continue
        # FSDP1 has no real-loss keys (sharding.real_loss_support); the Lanczos diagnostics count the sampled keys'
        fsdp1 = run.startswith("fsdp1")
        expected = {k for k in ddp["logged"]["0"] if not (fsdp1 and _real_loss(k))}
        base = {  # clock readings aside
            k: v
            for k, v in ddp["logged"]["0"].items()
            if k in expected and not any(c in k for c in ("time", "overhead")) and not (fsdp1 and "/lanczos/" in k)
        }
        steps, numbers = sorted(result["logged"], key=int), result["logged"].get("0", {})
        same = steps == sorted(ddp["logged"], key=int) and sorted(numbers) == sorted(expected)
        diffs = {k: abs(numbers[k] - v) for k, v in base.items() if k in numbers}
        # sharpness_spread/...: a fraction of the sharpness, its round-off absolute (tests/test_sharded.py)
        bad = [k for k, d in diffs.items() if d > TOL["float32"] * (1 if "/sharpness_spread/" in k else abs(base[k]))
               + 1e-7]  # fmt: skip
        relative = {k: d / (1 if "/sharpness_spread/" in k else max(abs(base[k]), 1e-30)) for k, d in diffs.items()}
        worst = max(relative, key=relative.get, default=None)
        ok = same and bool(diffs) and not bad
        status |= not ok
        rel = relative[worst] if worst else float("nan")
        blocks = sum(result["block_bytes"].values())
        real = sum(_real_loss(k) for k in numbers)
        print(
            f"{run:11s} {'ok ' if ok else 'BAD'} steps {steps}, keys {len(numbers)}/{len(expected)} "
            f"({real} real-loss), "
            f"{len(bad)} numbers off; worst relative difference at step 0 {rel:.2e} ({worst}); most read weights "
            f"alive {result['peak_bytes']} B of {blocks} B in all blocks; snapshots {result['snapshot_bytes']} B"
        )
    pairs = (("ddp", "fsdp2"), ("adamw_ddp", "adamw_fsdp2"), ("adamw_ddp", "plain_fsdp2"))
    for reference, run in pairs:  # the real-loss keys at every step
        a, b = load(reference), load(run)
        for step in sorted(a["logged"], key=int) if a and b else ():
            x, y = a["logged"][step], b["logged"].get(step, {})
            keys = [k for k in x if _real_loss(k)]
            # relative differences; sharpness_spread/... (a fraction of the sharpness) absolute
            diffs = {k: abs(x[k] - y[k]) / (1 if "/sharpness_spread/" in k else max(abs(x[k]), 1e-30))
                     for k in keys if k in y}  # fmt: skip
            worst = max(diffs, key=diffs.get, default=None)
            print(
                f"{run} vs {reference}, step {step}: {len(diffs)} of {len(keys)} real-loss keys, "
                f"{sum(_real_loss(k) for k in y)} in {run}; worst difference {diffs.get(worst, math.nan):.1e} ({worst})"
            )
    return status


def main(out_dir: str, scenario: str, *options: str) -> None:
    """Run ``scenario``; ``options``: ``--accelerator A --devices N`` for the Lightning runs (default cpu, 2)."""
    torch.set_num_threads(1)
    opts = dict(zip(options[::2], options[1::2], strict=True))
    hardware = dict(accelerator=opts.get("--accelerator", "cpu"), devices=int(opts.get("--devices", "2")))
    if scenario == "compare":
        raise SystemExit(compare(out_dir))
    if scenario == "fsdp1":
        if "LOCAL_RANK" in os.environ:  # both ranks started by the caller (tests/test_sharded.py)
            fsdp1_worker(int(os.environ["LOCAL_RANK"]), os.path.join(out_dir, "fsdp1"))
        else:
            import torch.multiprocessing as mp

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            mp.spawn(fsdp1_worker, args=(os.path.join(out_dir, "fsdp1"),), nprocs=2)
        return
    ledger = Ledger()
    ledger.instrument()
    if scenario == "ddp":
        lightning_run(os.path.join(out_dir, "ddp"), ledger, "ddp", **hardware)
    elif scenario == "fsdp2":
        ckpt = os.path.join(out_dir, "fsdp2.ckpt")
        lightning_run(os.path.join(out_dir, "fsdp2"), ledger, "fsdp2", save=ckpt, **hardware)
        if hardware["accelerator"] == "cpu":  # the GPU check compares the numbers only
            lightning_run(os.path.join(out_dir, "resumed"), ledger, "fsdp2", resume=ckpt, max_steps=9, **hardware)
            _fail(1, "layer0/attn", at=2)
            lightning_run(os.path.join(out_dir, "fail"), ledger, "fsdp2", activation_checkpointing=True, **hardware)
    elif scenario == "encoder":  # nn.TransformerEncoderLayer blocks: DDP, then FSDP2 on each sub-module
        for strategy in ("ddp", "fsdp2"):
            lightning_run(os.path.join(out_dir, f"encoder_{strategy}"), ledger, strategy, lm=encoder_lm, **hardware)
    elif scenario == "real-loss":  # AdamW under DDP and FSDP2; FSDP2 with rank 1's kept tokens unscored at step 0
        for strategy in ("ddp", "fsdp2"):
            lightning_run(os.path.join(out_dir, f"adamw_{strategy}"), ledger, strategy, adamw=True, **hardware)
        lightning_run(os.path.join(out_dir, "unscored"), ledger, "fsdp2", unscored=(1, 0), **hardware)
        if hardware["accelerator"] == "cpu":
            plain_loop_fsdp2(os.path.join(out_dir, "plain_fsdp2"))
    elif scenario == "lightning-fsdp1":  # FSDPStrategy (on CPU: cpu_fsdp_strategy)
        for strategy in ("fsdp1", "fsdp1_orig"):
            lightning_run(os.path.join(out_dir, strategy), ledger, strategy, **hardware)
    else:
        raise SystemExit(
            f"Invalid scenario {scenario!r}. Must be ddp, fsdp2, encoder, real-loss, fsdp1, lightning-fsdp1 or compare."
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
