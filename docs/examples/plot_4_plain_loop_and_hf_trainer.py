"""
A plain PyTorch loop and the Hugging Face Trainer
=================================================

The monitor without Lightning. :class:`curvwatch.Monitor` gains a plain loop two lines; the Hugging Face
``transformers.Trainer`` takes :class:`curvwatch.CurvatureCallback` (also reachable as
``curvwatch.hf_trainer.CurvatureCallback``). Both train the same LLaMA-style model here, a
``transformers.LlamaForCausalLM`` built from a config (rotary positions, grouped-query attention, RMSNorm, a SwiGLU
MLP; nothing downloaded), on 2-digit addition, from the same initial weights.
"""

# %%
# The model and the data
# ----------------------
# Each addition is one sequence ``a+b=s`` (the sum reversed, :mod:`curvwatch.data`); the labels score the answer
# tokens only (``-100`` elsewhere). The model shifts the labels itself, as Hugging Face causal LMs do.
import tempfile
from collections import defaultdict

import matplotlib.pyplot as plt
import torch
import transformers

from curvwatch import Cadence, CurvatureCallback, Monitor
from curvwatch.data import IGNORE_INDEX, VOCAB_SIZE, AdditionDataModule, sequence_length

torch.set_num_threads(1)
transformers.logging.set_verbosity_error()
N_DIGITS, STEPS, EVERY = 2, 120, 20
data = AdditionDataModule(n_digits=N_DIGITS, n_train=4096, n_val=64, batch_size=32, seed=0)
data.setup("fit")


def example(item):
    input_ids, targets = item  # (L,), (L,): targets are the next tokens, IGNORE_INDEX outside the answer
    return {
        "input_ids": torch.cat([input_ids, targets[-1:]]),  # the whole sample
        "labels": torch.cat([torch.tensor([IGNORE_INDEX]), targets]),  # the model shifts them by one
    }


dataset = [example(item) for item in data.train_set]
config = transformers.LlamaConfig(
    vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=sequence_length(N_DIGITS) + 1, use_cache=False,
)  # fmt: skip
torch.manual_seed(0)
initial = transformers.LlamaForCausalLM(config).state_dict()

# %%
# A plain loop
# ------------
# ``with monitor.step(step):`` around the forward and backward: on a due step the hooks capture each block's input
# and output gradient, and the monitor evaluates and logs when the block exits, before ``optimizer.step()``.
# ``log`` takes a W&B run, a Lightning or Fabric logger, or a callable ``fn(metrics, step)``. Full evaluations
# every 20 steps and no overhead budget (``max_overhead=None``): a dense picture of a short run.
model = transformers.LlamaForCausalLM(config)
model.load_state_dict(initial)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
plain = defaultdict(dict)
monitor = Monitor(model, optimizer=optimizer, log=lambda metrics, step: plain[step].update(metrics),
                  every_n_train_steps=EVERY, cadence=Cadence(max_overhead=None))  # fmt: skip
loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
step = 0
while step < STEPS:
    for batch in loader:
        with monitor.step(step):
            loss = model(**batch).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == STEPS:
            break
print(f"plain loop: loss {loss.item():.3f} after {STEPS} steps, {monitor.book.evaluations} full evaluations")
print(monitor.summary_text(top=3))

# %%
# The Hugging Face Trainer
# ------------------------
# The callback goes in ``callbacks=``; it logs to the W&B run when ``report_to="wandb"``, or to ``log=``.
# Gradient accumulation, the fp16 loss scale and checkpoints are handled (:doc:`/training_loops`).
model = transformers.LlamaForCausalLM(config)
model.load_state_dict(initial)
hf = defaultdict(dict)
callback = CurvatureCallback(log=lambda metrics, step: hf[step].update(metrics), every_n_train_steps=EVERY,
                             cadence=Cadence(max_overhead=None))  # fmt: skip
args = transformers.TrainingArguments(
    output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=32, learning_rate=3e-3,
    lr_scheduler_type="constant", weight_decay=0.0, optim="adamw_torch", use_cpu=True, report_to=[],
    save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0,
)  # fmt: skip
transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback]).train()
print(f"Trainer: {callback.monitor.book.evaluations} full evaluations")
print(callback.monitor.summary_text(top=3))

# %%
# The curvature in both runs
# --------------------------
# The block norms of each layer's attention and MLP over training, and the edge-of-stability ratio. The two loops
# see different batch orders, so their curves differ in detail, not in kind.
fig, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharey=True)
for ax, (title, rows) in zip(axes, (("plain loop", plain), ("transformers.Trainer", hf)), strict=True):
    steps = sorted(s for s in rows if "curv_hessian/layer0/attn" in rows[s])
    for layer in range(config.num_hidden_layers):
        for part, style in (("attn", "-"), ("ffn", "--")):
            key = f"curv_hessian/layer{layer}/{part}"
            ax.plot(steps, [rows[s][key] for s in steps], style, marker=".", label=f"layer {layer} {part}")
    ax.set(title=title, xlabel="optimizer step", yscale="log")
axes[0].set_ylabel("block norm ||H||")
axes[1].legend(fontsize=8)
fig.tight_layout()
plt.show()
