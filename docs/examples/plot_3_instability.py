"""
An instability caught before the loss diverges
==============================================

A small GPT learns 3-digit addition for 100 steps; then its learning rate is re-warmed without gradient clipping,
from 5e-3 to 0.6 by step 400, as a continued-pretraining run that re-warms too hard would. The attention logits
grow, a head saturates, and some steps later the loss blows up. The monitor's default warning rules read the
terms-only evaluations (every 10 steps here) and warn first. This is ``make demo ARGS="--unstable"`` in a plain
PyTorch loop.
"""

# %%
# The run
# -------
# :class:`curvwatch.Monitor` drives the monitor from a plain loop: ``with monitor.step(step):`` around the forward and
# backward of each step. Full evaluations every 50 steps, terms-only ones (what the warning rules read) every 10,
# a fixed schedule (``max_overhead=None``); the real-loss keys are off to keep the example short.
import math
import warnings

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

from curvwatch import Cadence, CurvatureWarning, Monitor
from curvwatch.data import IGNORE_INDEX, VOCAB_SIZE, AdditionDataModule, sequence_length
from curvwatch.models import GPT, GPTConfig

torch.manual_seed(0)
torch.set_num_threads(1)
data = AdditionDataModule(n_digits=3, n_train=20_000, n_val=100, batch_size=64, seed=0)
data.setup("fit")
model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=sequence_length(3), n_layer=2, n_head=4, d_model=64))
decay = [p for p in model.parameters() if p.dim() >= 2]
rest = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=5e-4, betas=(0.9, 0.98))  # fmt: skip


def learning_rate(step: int) -> float:
    """Warm-up to 5e-3 by step 50, flat to step 100, then a re-warm to 0.6 by step 400."""
    knots = [(0, 5e-4), (50, 5e-3), (100, 5e-3), (400, 0.6)]
    for (s0, v0), (s1, v1) in zip(knots, knots[1:], strict=False):
        if step <= s1:
            return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return knots[-1][1]


logged: dict[str, list[tuple[int, float]]] = {}


def log(metrics: dict[str, float], step: int) -> None:
    for key, value in metrics.items():
        logged.setdefault(key, []).append((step, value))


monitor = Monitor(model, optimizer=optimizer, log=log, every_n_train_steps=50,
                  cadence=Cadence(terms_every_n_train_steps=10, max_overhead=None), sharpness=False)  # fmt: skip

losses = []
batches = iter(data.train_dataloader())
with warnings.catch_warnings():
    warnings.simplefilter("ignore", CurvatureWarning)  # printed below, from monitor.alerts
    for step in range(360):
        try:
            input_ids, targets = next(batches)
        except StopIteration:
            batches = iter(data.train_dataloader())
            input_ids, targets = next(batches)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        with monitor.step(step):
            logits = model(input_ids)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() if math.isfinite(loss.item()) else float("nan"))

# %%
# When did it warn, and when did the loss blow up?
# ------------------------------------------------
# The blow-up is the first step at which the 5-step mean of the loss stands 0.5 nats above its best so far for 3
# steps, the demo's definition. ``monitor.alerts`` holds each warning: its rule, block, step and message.
mean5 = [sum(losses[max(0, i - 4) : i + 1]) / len(losses[max(0, i - 4) : i + 1]) for i in range(len(losses))]
best, above, blowup = math.inf, 0, None
for step, value in enumerate(mean5):
    above = above + 1 if value > best + 0.5 or not math.isfinite(value) else 0
    best = min(best, value)
    if above == 3:
        blowup = step - 2
        break
first = {}
for alert in monitor.alerts:
    first.setdefault(alert.kind, alert)
for kind, alert in first.items():
    print(f"step {alert.step}: {kind} in {alert.block}")
print(f"loss blow-up at step {blowup}")
print()
print(min(monitor.alerts, key=lambda a: a.step).message)

# %%
# The picture
# -----------
# Top: the training loss, each warning (a vertical line) and the blow-up. Below: what the rules watch, model-wide:
# the attention-logit bound :math:`\|X\|^2 \max_h \|W_Q^h\| \|W_K^h\|` (the ``growth`` rule fires when it rises by
# more than 1.1 decades within 50 steps) and the smallest softmax-Jacobian norm of any head (``attn_saturation``
# fires when it stays below 0.01; a healthy head sits near 0.5).
fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
axes[0].plot(losses, color="k", lw=1)
axes[0].set(ylabel="training loss", yscale="log")
for name, ax in (("curv/summary/signals/logit_bound_max", axes[1]), ("curv/summary/signals/softmax_jac_min", axes[2])):
    steps, values = zip(*logged[name], strict=True)
    ax.plot(steps, values, marker=".", lw=1)
    ax.set(ylabel=name.rsplit("/", 1)[1], yscale="log")
axes[2].axhline(0.01, color="r", ls=":", lw=1)
axes[2].set_ylim(1e-6, 1)  # after the blow-up some heads read far below (exactly one-hot)
colors = {"growth": "tab:orange", "attn_saturation": "tab:red"}
for ax in axes:
    for kind, alert in first.items():
        ax.axvline(alert.step, color=colors.get(kind, "tab:purple"), ls="--", lw=1, label=f"{kind} (step {alert.step})")
    if blowup is not None:
        ax.axvline(blowup, color="k", ls="-", lw=2, alpha=0.4, label=f"loss blow-up (step {blowup})")
axes[0].legend(loc="upper left", fontsize=8)
axes[2].set_xlabel("optimizer step")
fig.tight_layout()
plt.show()
