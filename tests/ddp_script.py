"""Tiny GPT LightningModule shared by the callback tests, and a DDP run of it as a script.

As a script: trains on 2 CPU processes (``strategy="ddp"``) with a CSVLogger and a CurvatureMonitor, then
rank zero writes ``{"steps": [...], "skipped": n}`` of what reached the logger to ``<out>/result.json``.

    python tests/ddp_script.py OUT_DIR [--fail-rank R]

``--fail-rank R`` makes the evaluation raise on rank R only (at every evaluation), to check that all ranks
skip together and nothing hangs.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: make `curvwatch` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import curvwatch.engine.core as engine_core
from curvwatch import Cadence, Evaluation, Warnings
from curvwatch.models.gpt import GPT, GPTConfig  # noqa: E402

VOCAB, SEQ = 11, 8


class TinyLM(L.LightningModule):
    """Next-token prediction with a 1- or 2-layer GPT of width 8 on random tokens."""

    def __init__(self, n_layer: int = 1, lr: float = 1e-2, ln_eps: float = 1e-5, d_model: int = 8) -> None:
        super().__init__()
        config = GPTConfig(
            vocab_size=VOCAB,
            block_size=SEQ,
            n_layer=n_layer,
            n_head=2,
            d_model=d_model,
            d_ff=16,
            ln_eps=ln_eps,
        )
        self.model = GPT(config)
        self.lr = lr

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self(idx[:, :-1])  # (B, L - 1, V)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(n: int = 32, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """``n`` random sequences of ``SEQ`` tokens."""
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, SEQ), generator=g)), batch_size=batch_size)


def main(out_dir: str, fail_rank: int | None, max_overhead: float | None = None) -> None:
    import json

    from lightning.pytorch.loggers import CSVLogger

    from curvwatch import CurvatureMonitor

    torch.set_num_threads(1)
    if fail_rank is not None:
        original = engine_core.evaluate_block

        def evaluate(self, **kwargs):
            if int(os.environ.get("LOCAL_RANK", "0")) == fail_rank:
                raise RuntimeError(f"induced failure on rank {fail_rank}")
            return original(self, **kwargs)

        engine_core.evaluate_block = evaluate
    L.seed_everything(0, verbose=False)
    monitor = CurvatureMonitor(
        every_n_train_steps=2,
        cadence=Cadence(max_overhead=max_overhead),
        evaluation=Evaluation(max_tokens=16),
        warning_rules=Warnings(warn=False),
    )
    logger = CSVLogger(out_dir, name="ddp", version=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=5,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[monitor],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(TinyLM(), loader(n=40))
    if trainer.is_global_zero:
        import csv

        with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
            rows = list(csv.DictReader(f))
        key = "curv/summary/max_hessian"
        steps = [int(r["step"]) for r in rows if r.get(key)]
        skipped = [
            float(r["curv/summary/skipped_evaluations"]) for r in rows if r.get("curv/summary/skipped_evaluations")
        ]
        values = [float(r[key]) for r in rows if r.get(key)]
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"steps": steps, "skipped": skipped, "values": values, "world_size": trainer.world_size}, f)


if __name__ == "__main__":
    args = sys.argv[1:]
    fail = None
    if "--fail-rank" in args:
        i = args.index("--fail-rank")
        fail = int(args[i + 1])
        del args[i : i + 2]
    budget = None
    if "--max-overhead" in args:
        i = args.index("--max-overhead")
        budget = float(args[i + 1])
        del args[i : i + 2]
    main(args[0], fail, budget)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # an orderly teardown: left to interpreter exit, gloo's threads can abort the process ("terminate called
        # without an active exception", exit code -6) after a successful run, seen once under load
        torch.distributed.destroy_process_group()
