"""How many keys reach the loggers at each ``log_level`` on a 12-layer, 12-head GPT (the dashboard's size).

    python -m benchmarks.key_count                      # the three levels at the monitor's defaults
    python -m benchmarks.key_count --level summary --list

Trains 3 steps of a GPT with ``n_layer=12``, ``n_head=12``, ``d_model=24`` (heads of width 2) on random tokens with
AdamW, a full evaluation at steps 0 and 2 and a terms-only one at step 1 (``max_overhead=None``), and counts the
distinct scalar keys that reached a logger. The images (``summary/heatmap``, ``summary/stability_heatmap``) and the
W&B table (``summary/layers``) come on top: 3 more keys with a ``WandbLogger`` (``tests/test_log_levels.py``).
About a minute per level on one CPU thread.
"""

from __future__ import annotations

import argparse
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F

from benchmarks.loggers import MemoryLogger
from curvwatch import Cadence, CurvatureMonitor, Evaluation
from curvwatch.models.gpt import GPT, GPTConfig

VOCAB, SEQ = 11, 8


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=12, n_head=12, d_model=24, d_ff=48))

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self.model(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def count(level: str, pairs: str = "diagonal") -> list[str]:
    """The sorted monitor keys one 3-step run logged at ``level``."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (32, SEQ)))
    logger = MemoryLogger()
    monitor = CurvatureMonitor(
        every_n_train_steps=2, cadence=Cadence(terms_every_n_train_steps=1, max_overhead=None),
        evaluation=Evaluation(pairs=pairs), log_heatmap=False, log_level=level,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(
            accelerator="cpu", max_steps=3, logger=logger, callbacks=[monitor], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False,
        ).fit(Model(), torch.utils.data.DataLoader(data, batch_size=4))  # fmt: skip
    return sorted(logger.keys("curv"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.key_count", description=__doc__.splitlines()[0])
    p.add_argument("--level", action="append", choices=["summary", "blocks", "all"], help="(repeatable) [all three]")
    p.add_argument("--pairs", default="diagonal", help="the monitor's pairs [diagonal]")
    p.add_argument("--list", action="store_true", help="print the keys")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| log_level | scalar keys | seconds |\n| --- | --- | --- |")
    for level in args.level or ["summary", "blocks", "all"]:
        start = time.perf_counter()
        keys = count(level, args.pairs)
        print(f"| {level} | {len(keys)} | {time.perf_counter() - start:.0f} |")
        if args.list:
            print("\n".join(keys))


if __name__ == "__main__":
    main()
