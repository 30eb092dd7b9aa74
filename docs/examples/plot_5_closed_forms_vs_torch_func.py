"""
The closed forms checked against torch.func
===========================================

Every number the monitor logs comes from a closed form: the Hessian blocks of an attention or FFN block are applied
to vectors through their formulas, never through autograd. :mod:`curvwatch.reference` writes the same blocks the
plain way and lets ``torch.func.hessian`` and ``torch.func.jacrev`` differentiate them. Here both run in float64 on
a small causal attention block and a GELU FFN, with the same grouped inputs
(:class:`~curvwatch.closed_form.AttentionWeights`, :class:`~curvwatch.closed_form.AttentionStructure`,
:class:`~curvwatch.closed_form.FFNWeights`, :class:`~curvwatch.closed_form.OutputLoss`), and every block, part and
head is compared: the dense matrices, and the spectral norms the monitor logs.
"""

# %%
# Two small blocks
# ----------------
# A causal attention block with two heads (``d = 8``, ``d_K = 4``) on a batch of two sequences of six tokens, under
# the papers' squared loss against a random target; and a GELU FFN (``d = 8``, ``d_ff = 16``) on the same token
# count, under the local quadratic model a block has inside a network (a back-propagated output gradient ``G`` and
# the output curvature ``c``). :data:`~curvwatch.closed_form.EXACT` runs each Lanczos norm to the block size, so the
# closed forms' norms are exact up to round-off.
import time

import matplotlib.pyplot as plt
import torch

from curvwatch import reference
from curvwatch.closed_form import (
    EXACT,
    AttentionStructure,
    AttentionWeights,
    FFNWeights,
    Lanczos,
    OutputLoss,
    ffn,
    multi_head_attention,
)

torch.manual_seed(0)
torch.set_num_threads(1)
dt = torch.float64
B, L, d, H, d_K, d_ff = 2, 6, 8, 2, 4, 16

X = torch.randn(B, L, d, dtype=dt)  # (B, L, d)
attention = AttentionWeights(
    W_Q=torch.randn(d, H * d_K, dtype=dt) / d**0.5,
    W_K=torch.randn(d, H * d_K, dtype=dt) / d**0.5,
    W_V=torch.randn(d, H * d_K, dtype=dt) / d**0.5,
    W_O=torch.randn(H * d_K, d, dtype=dt) / (H * d_K) ** 0.5,
    n_heads=H,
)
structure = AttentionStructure(causal=True)
attention_loss = OutputLoss(target=torch.randn(B, L, d, dtype=dt))

Y = torch.randn(B, L, d, dtype=dt)  # (B, L, d)
mlp = FFNWeights(W_1=torch.randn(d, d_ff, dtype=dt) / d**0.5, W_2=torch.randn(d_ff, d, dtype=dt) / d_ff**0.5)
mlp_loss = OutputLoss(grad_output=torch.randn(B, L, d, dtype=dt))

# %%
# Both routes
# -----------
# ``dense=True`` also returns each block as a matrix (``dense/hessian/QQ/h0``; small sizes only), built from the
# closed-form products.
seconds = {}
start = time.perf_counter()
closed = {
    "attention": multi_head_attention(X, attention, loss=attention_loss, structure=structure, lanczos=EXACT,
                                      dense=True),
    "ffn": ffn(Y, mlp, activation="gelu", loss=mlp_loss, lanczos=EXACT, dense=True),
}  # fmt: skip
seconds["closed forms"] = time.perf_counter() - start

start = time.perf_counter()
truth = {
    "attention": reference.multi_head_attention_blocks(X, attention, loss=attention_loss, structure=structure),
    "ffn": reference.ffn_blocks(Y, mlp, activation="gelu", loss=mlp_loss),
}
seconds["torch.func"] = time.perf_counter() - start
print(", ".join(f"{route}: {s:.2f} s" for route, s in seconds.items()))

# %%
# The agreement
# -------------
# For every block ``part/pair[/head]`` of the ground truth: the relative error of the dense matrix (Frobenius) and
# of its spectral norm, the number the monitor logs. The functional parts of ``VV`` and ``W2W2`` are zero (the
# block output is linear in ``W_V``, in ``W_2``): there the error is the absolute one.


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.norm())
    return float((a - b).norm()) / (scale if scale > 0 else 1.0)


rows = []  # (block, key, norm by the closed form, norm by torch.func, dense error, norm error)
for block, blocks in truth.items():
    norms = reference.dense_to_norms(blocks)
    for key, matrix in blocks.items():
        dense_err = relative(closed[block][f"dense/{key}"], matrix)
        norm_err = relative(closed[block][key], norms[key])
        rows.append((block, key, float(closed[block][key]), float(norms[key]), dense_err, norm_err))

print(f"{'block':10s} {'key':20s} {'closed form':>12s} {'torch.func':>12s} {'dense err':>10s} {'norm err':>10s}")
for block, key, mine, true, dense_err, norm_err in rows:
    if key.endswith("/h1"):
        continue  # head 1 agrees as head 0 does; the figure shows both
    print(f"{block:10s} {key:20s} {mine:12.6g} {true:12.6g} {dense_err:10.1e} {norm_err:10.1e}")
worst = max(max(r[4], r[5]) for r in rows)
print(f"{len(rows)} blocks; largest relative error {worst:.1e}")
assert worst < 1e-9

# %%
# The monitor's own tolerance
# ---------------------------
# The monitor stops each Lanczos norm at a relative residual of ``1e-2`` (:class:`curvwatch.Evaluation`'s ``tol``,
# at most ``max_iter = 60`` steps and 16 vectors held) instead of running it to the block size: some eigenvalue then
# lies within 1% of the reported norm. Against the ground truth, the attention norms at that setting:
monitor = multi_head_attention(X, attention, loss=attention_loss, structure=structure,
                               lanczos=Lanczos(tol=1e-2, max_iter=60, max_basis=16))  # fmt: skip
norms = reference.dense_to_norms(truth["attention"])
at_tol = {key: relative(monitor[key], norms[key]) for key in norms}
print(f"tol=1e-2: largest relative error {max(at_tol.values()):.1e} over {len(at_tol)} attention norms")

# %%
# The figure: each nonzero norm by both routes (left: on the diagonal when they agree), and the relative errors
# (right: float64 round-off for the exact runs, within the tolerance at the monitor's setting; an exact match is
# drawn at 1e-17).
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
colors = {"outer": "tab:blue", "functional": "tab:orange", "hessian": "tab:green"}
markers = {"attention": "o", "ffn": "s"}
floor = 1e-17  # an exact match, on the log axis of the errors
nonzero = [r for r in rows if r[3] > 0]
for block, key, mine, true, _, _ in nonzero:
    left.loglog(true, mine, markers[block], color=colors[key.split("/")[0]], mfc="none")
lo, hi = min(r[3] for r in nonzero), max(r[3] for r in nonzero)
left.loglog([lo, hi], [lo, hi], color="gray", lw=0.8)
left.set_xlabel("spectral norm, torch.func (dense)")
left.set_ylabel("spectral norm, closed form")
left.set_title("every block, part and head (nonzero norms)", fontsize=9)
for part, color in colors.items():
    left.plot([], [], "o", color=color, mfc="none", label=part)
for block, marker in markers.items():
    left.plot([], [], marker, color="gray", mfc="none", label=block)
left.legend(fontsize=7)

exact = sorted(max(r[5], floor) for r in rows)
at_tol_sorted = sorted(max(e, floor) for e in at_tol.values())
right.semilogy(exact, ".", label="closed forms, Lanczos to the block size")
right.semilogy(at_tol_sorted, ".", label="attention, Lanczos at tol=1e-2 (the monitor's)")
right.axhline(1e-2, color="gray", lw=0.8, ls="--", label="tol=1e-2")
right.set_xlabel("norms, sorted by error")
right.set_ylabel("relative error against torch.func")
right.set_title("how far apart", fontsize=9)
right.legend(fontsize=7)
fig.tight_layout()
plt.show()
