"""
Reading a run: the heatmap, the stability trace, the warnings
=============================================================

The three pictures of a monitored run, drawn from what the monitor logs at its default ``log_level="summary"``:
the block-norm heatmap (layers by sub-blocks, the image ``curv/summary/heatmap`` on W&B and TensorBoard), each
layer's edge-of-stability ratio over training (``curv_stability/layer{i}``), and the signals the warning rules
watch, against their thresholds. The run is healthy: a 4-layer GPT on 3-digit addition, trained in a plain loop.
"""

# %%
# A monitored run
# ---------------
# ``log=`` takes a callable ``fn(metrics, step)``: here it keeps every logged number in a dict of series.
import math
from collections import defaultdict

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from curvwatch import Cadence, Monitor
from curvwatch.data import IGNORE_INDEX, VOCAB_SIZE, AdditionDataModule, sequence_length
from curvwatch.models import GPT, GPTConfig

torch.manual_seed(0)
torch.set_num_threads(1)
N_LAYER, STEPS = 4, 300
data = AdditionDataModule(n_digits=3, n_train=20_000, n_val=100, batch_size=64, seed=0)
data.setup("fit")
model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=sequence_length(3), n_layer=N_LAYER, n_head=4, d_model=48))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * (1 - 0.9 * s / STEPS))

logged = defaultdict(list)
monitor = Monitor(model, optimizer=optimizer, log=lambda metrics, step: [logged[k].append((step, v)) for k, v in
                  metrics.items()], every_n_train_steps=50,
                  cadence=Cadence(terms_every_n_train_steps=10, max_overhead=None))  # fmt: skip

batches = iter(data.train_dataloader())
for step in range(STEPS):
    input_ids, targets = next(batches)
    with monitor.step(step):
        loss = F.cross_entropy(model(input_ids).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
print(f"final loss {loss.item():.3f}; {monitor.book.evaluations} full evaluations; {len(monitor.alerts)} warnings")


def series(key):
    return np.array([s for s, _ in logged[key]]), np.array([v for _, v in logged[key]])


# %%
# The heatmap
# -----------
# ``curv_hessian/layer{i}/{part}`` is the largest Hessian norm of sub-block ``part`` of layer ``i`` (over its weight
# pairs and heads). Left: at the last full evaluation, as the logged image shows it; right: the same for every full
# evaluation, one column per step. The scale is that of a local model of the loss (see :doc:`/dashboard`): read
# the pattern and its trend, not the number.
parts = ["attn", "ffn"]
steps = series("curv_hessian/layer0/attn")[0]
grid = np.array([[series(f"curv_hessian/layer{i}/{p}")[1] for p in parts] for i in range(N_LAYER)])  # (layer, part, t)
fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2), gridspec_kw={"width_ratios": [1, 3]})
im = left.imshow(np.log10(grid[:, :, -1]), cmap="viridis", aspect="auto")
left.set(xticks=range(len(parts)), xticklabels=parts, yticks=range(N_LAYER), ylabel="layer",
         title=f"step {steps[-1]}")  # fmt: skip
fig.colorbar(im, ax=left, label="log10 ||H||")
over_time = np.log10(grid.reshape(N_LAYER * len(parts), -1))
im = right.imshow(over_time, cmap="viridis", aspect="auto", extent=(steps[0], steps[-1], len(over_time) - 0.5, -0.5))
right.set(yticks=range(len(over_time)), yticklabels=[f"{i} {p}" for i in range(N_LAYER) for p in parts],
          xlabel="optimizer step", title="every full evaluation")  # fmt: skip
fig.colorbar(im, ax=right, label="log10 ||H||")
fig.tight_layout()
plt.show()

# %%
# The stability trace
# -------------------
# ``curv_stability/layer{i}`` is the largest edge-of-stability ratio in layer ``i``: a block's real-loss sharpness
# over the threshold of the optimizer updating it (for AdamW, the preconditioned sharpness over ``38 / lr``).
# At or above 1 a block is at the edge of stability for its learning rate. There is no ratio at step 0 under AdamW:
# the optimizer has no second moments before its first step.
fig, ax = plt.subplots(figsize=(7, 3))
for i in range(N_LAYER):
    ax.plot(*series(f"curv_stability/layer{i}"), marker=".", label=f"layer {i}")
ax.axhline(1.0, color="r", ls=":", label="edge of stability")
ax.set(yscale="log", xlabel="optimizer step", ylabel="stability ratio")
ax.legend(fontsize=8, ncol=3)
fig.tight_layout()
plt.show()

# %%
# The warnings timeline
# ---------------------
# Each default warning rule watches one number; the monitor logs its model-wide worst value at every evaluation,
# terms-only ones included. The dotted lines are where a rule starts to look (``attn_saturation`` below 0.01,
# ``ln_collapse`` below 5); the growth rules fire on a rise, not a level (more than 1.1 decades of the logit bound,
# 1.5 of ``outer_vv``, within 50 steps). A warning would be a vertical line; this run has none.
signals = [
    ("curv/summary/signals/softmax_jac_min", 0.01, "attn_saturation: smallest softmax-Jacobian norm"),
    ("curv/summary/signals/logit_bound_max", None, "growth: attention-logit bound"),
    ("curv/summary/signals/outer_vv_max", None, "growth: exact value curvature outer/VV"),
    ("curv/summary/ln/var_min_over_eps", 5.0, "ln_collapse: smallest LayerNorm variance / eps"),
]
fig, axes = plt.subplots(len(signals), 1, figsize=(7, 7), sharex=True)
for ax, (key, level, title) in zip(axes, signals, strict=True):
    ax.plot(*series(key), marker=".", lw=1, ms=3)
    if level is not None:
        ax.axhline(level, color="r", ls=":")
    for alert in monitor.alerts:
        ax.axvline(alert.step, color="tab:red", ls="--")
    ax.set(yscale="log", title=title)
    ax.title.set_fontsize(9)
axes[-1].set_xlabel("optimizer step")
fig.tight_layout()
plt.show()
print("warnings:", [(a.step, a.kind, a.block) for a in monitor.alerts] or "none")
print("softmax-Jacobian norm, smallest:", f"{min(series(signals[0][0])[1]):.3f}", "(healthy heads: near 0.5)")
print("LayerNorm var_min/eps, smallest:", f"{min(series(signals[3][0])[1]):.3g}", "(collapse: below 5)")
assert math.isfinite(loss.item())
