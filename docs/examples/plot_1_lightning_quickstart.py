"""
Quick start: Lightning
======================

Add :class:`curvwatch.CurvatureMonitor` to a Lightning ``Trainer`` and read the curvature of every Transformer block
over training. The model is curvwatch's small GPT (:mod:`curvwatch.models`), the task 3-digit addition
(:mod:`curvwatch.data`), generated on the fly; the numbers go to a ``CSVLogger`` here, and to W&B or TensorBoard
in the same way.
"""

# %%
# A LightningModule
# -----------------
# Any LightningModule whose model contains Transformer layers curvwatch knows (its own GPT, PyTorch's, litgpt's,
# Hugging Face's, nanoGPT-style ones) works as it is. This one trains the GPT with AdamW, warm-up and cosine decay.
import csv
import math
import tempfile
from pathlib import Path

import lightning as L
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from curvwatch import Cadence, CurvatureMonitor
from curvwatch.data import IGNORE_INDEX, VOCAB_SIZE, AdditionDataModule, sequence_length
from curvwatch.models import GPT, GPTConfig

STEPS = 400


class AdditionGPT(L.LightningModule):
    def __init__(self, lr: float = 5e-3, warmup: int = 60):
        super().__init__()
        config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=sequence_length(3), n_layer=2, n_head=4, d_model=64)
        self.model, self.lr, self.warmup = GPT(config), lr, warmup

    def training_step(self, batch, batch_idx):
        input_ids, targets = batch
        logits = self.model(input_ids)  # (B, L, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.98), weight_decay=0.1)

        def factor(step):
            if step < self.warmup:
                return (step + 1) / self.warmup
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - self.warmup) / (STEPS - self.warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# %%
# Attach the monitor
# ------------------
# ``CurvatureMonitor()`` at its defaults keeps to about 1% of the training time for full evaluations (plus 4% for
# the terms-only ones that feed the warnings). For a dense picture of a short run this example asks for a full
# evaluation every 50 steps instead, and no budget.
torch.manual_seed(0)
torch.set_num_threads(1)
out = Path(tempfile.mkdtemp())
monitor = CurvatureMonitor(every_n_train_steps=50, cadence=Cadence(max_overhead=None))
trainer = L.Trainer(
    max_steps=STEPS,
    callbacks=[monitor],
    logger=CSVLogger(out, name="run"),
    log_every_n_steps=10,
    gradient_clip_val=1.0,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
)
data = AdditionDataModule(n_digits=3, n_train=20_000, n_val=200, batch_size=64)
trainer.fit(AdditionGPT(), datamodule=data)

# %%
# At the end, :meth:`~curvwatch.CurvatureMonitor.summary_text` says what the monitor saw.
print(monitor.summary_text())

# %%
# The curvature over training
# ---------------------------
# The CSV has one column per logged key (``log_level="summary"``: the headline keys and, per layer, each sub-block's
# block norm ``curv_hessian/layer{i}/{part}`` and edge-of-stability ratio ``curv_stability/layer{i}``).
with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as f:
    rows = list(csv.DictReader(f))


def series(key):
    points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
    return [s for s, _ in points], [v for _, v in points]


fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
top.plot(*series("train/loss"), color="k", lw=1)
top.set(ylabel="training loss", yscale="log")
for layer in range(2):
    for part, style in (("attn", "-"), ("ffn", "--")):
        middle.plot(*series(f"curv_hessian/layer{layer}/{part}"), style, marker=".", label=f"layer {layer} {part}")
middle.set(ylabel="block norm ||H||", yscale="log")
middle.legend(fontsize=8, ncol=2)
for layer in range(2):
    bottom.plot(*series(f"curv_stability/layer{layer}"), marker=".", label=f"layer {layer}")
bottom.axhline(1.0, color="r", ls=":", lw=1, label="edge of stability")
bottom.set(ylabel="stability ratio", yscale="log", xlabel="optimizer step")
bottom.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %%
# Early training grows every block's curvature by decades; the attention and FFN blocks then settle. The stability
# ratio (the block's real-loss sharpness over the optimizer's threshold) would read 1 or more where a block is past
# the edge of stability for its learning rate: :doc:`/dashboard` says how to read each key.
