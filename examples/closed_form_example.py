"""Print the closed-form curvature of one small Transformer block and its error against torch.func.

Run: python examples/closed_form_example.py
"""

from __future__ import annotations

import torch

from curvwatch import reference
from curvwatch.closed_form import (
    AttentionStructure,
    AttentionWeights,
    OutputLoss,
    layernorm,
    multi_head_attention,
    transformer_block,
)
from curvwatch.closed_form.settings import EXACT


def main() -> float:
    torch.manual_seed(0)
    dt = torch.float64
    L, d, H, d_K, f = 5, 4, 2, 2, 8
    X = torch.randn(L, d, dtype=dt)
    params = {
        "n_heads": H,
        "W_Q": torch.randn(d, H * d_K, dtype=dt) / d**0.5,
        "W_K": torch.randn(d, H * d_K, dtype=dt) / d**0.5,
        "W_V": torch.randn(d, d, dtype=dt) / d**0.5,
        "W_O": torch.randn(d, d, dtype=dt) / d**0.5,
        "W_1": torch.randn(d, f, dtype=dt) / d**0.5,
        "W_2": torch.randn(f, d, dtype=dt) / f**0.5,
    }
    target = torch.randn(L, d, dtype=dt)
    worst = 0.0

    print("== multi-head attention (target loss ||F - T||^2 / (L d)) ==")
    weights = AttentionWeights(params["W_Q"], params["W_K"], params["W_V"], params["W_O"], n_heads=H)
    loss, structure = OutputLoss(target=target), AttentionStructure(causal=True)
    att = multi_head_attention(X, weights, loss=loss, structure=structure, lanczos=EXACT, dense=True)
    ref = reference.multi_head_attention_blocks(X, weights, loss=loss, structure=structure)
    for key, mat in ref.items():
        err = float((att[f"dense/{key}"] - mat).norm() / mat.norm().clamp_min(1e-300))
        worst = max(worst, err)
    for key in sorted(k for k in att if not k.startswith("dense/") and k.endswith("/h0")):
        print(f"  {key:32s} {float(att[key]):.6g}")

    print("== LayerNorm of the block input ==")
    ln = layernorm(X, eps=1e-5, grad_output=torch.randn(L, d, dtype=dt), dense=True)
    ln_ref = reference.layernorm_dense(X, eps=1e-5)
    for key in ("jacobian", "hessian"):
        worst = max(worst, float((ln[f"dense/{key}"] - ln_ref[key]).norm() / ln_ref[key].norm()))
    for key in sorted(k for k in ln if not k.startswith("dense/")):
        print(f"  {key:32s} {float(ln[key]):.6g}")

    print("== whole pre-LN block (all 15 block pairs, per head) ==")
    blk = transformer_block(X, params, norm="pre", activation="gelu", causal=True, loss=loss, lanczos=EXACT, dense=True)
    blk_ref = reference.transformer_block_blocks(X, params, norm="pre", activation="gelu", causal=True, loss=loss)
    for key, mat in blk_ref.items():
        worst = max(worst, float((blk[f"dense/{key}"] - mat).norm() / mat.norm().clamp_min(1e-300)))
    for key in sorted(k for k in blk if k.startswith("hessian/") and not k.endswith("/h1")):
        print(f"  {key:32s} {float(blk[key]):.6g}")

    print(f"max relative error against curvwatch.reference (float64): {worst:.2e}")
    return worst


if __name__ == "__main__":
    main()
