"""Head splitting and the attention masks of the attention closed forms (causal, sliding window, padding)."""

from __future__ import annotations

import torch

__all__ = ["attention_masks", "keep_masks", "padding_mask", "split_heads"]


def split_heads(W: torch.Tensor, n_heads: int, name: str, per_head_cols: bool = True) -> torch.Tensor:
    """(d, H*k) -> (H, d, k) for column-packed heads; (H*k, m) -> (H, k, m) for row-packed W_O."""
    if per_head_cols:
        d, hk = W.shape
        if hk % n_heads:
            raise ValueError(f"{name} has {hk} columns, not divisible by n_heads={n_heads}.")
        return W.reshape(d, n_heads, hk // n_heads).permute(1, 0, 2)
    hk, m = W.shape
    if hk % n_heads:
        raise ValueError(f"{name} has {hk} rows, not divisible by n_heads={n_heads}.")
    return W.reshape(n_heads, hk // n_heads, m)


def padding_mask(mask, B: int, L: int, name: str, device) -> torch.Tensor | None:
    """A ``(B, L)`` (or ``(L,)``) padding mask as bool ``(B, L)``, True = padded."""
    if mask is None:
        return None
    m = mask.to(device=device, dtype=torch.bool)
    if m.ndim == 1:
        m = m.unsqueeze(0)
    if tuple(m.shape) != (B, L):
        raise ValueError(f"{name} must have shape (B, L) = {(B, L)}; got {tuple(mask.shape)}.")
    return m


def attention_masks(
    B: int,
    L: int,
    L_kv: int,
    causal: bool,
    window: int | None,
    key_padding_mask,
    memory_padding_mask,
    cross: bool,
    device,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(keep (B, L, L_kv) or None, row_keep (B, L), kv_keep (B, L_kv))`` of one attention call.

    ``keep[b, i, j]``: query ``i`` sees key ``j``. Causal: ``j <= i``; a window ``w`` adds ``j > i - w`` (causal) or
    ``|i - j| < w`` (not causal); padded keys are never seen: ``key_padding_mask`` in self-attention,
    ``memory_padding_mask`` in cross-attention. ``row_keep``: query rows that belong to the loss (not padded);
    ``kv_keep``: key positions that are not padded.
    """
    kpm = padding_mask(key_padding_mask, B, L, "key_padding_mask", device)
    row_keep = torch.ones(B, L, dtype=torch.bool, device=device) if kpm is None else ~kpm
    keep = None
    if causal or window is not None:
        m = torch.ones(L, L_kv, dtype=torch.bool, device=device)
        m = m.tril() if causal else m
        if window is not None:
            i, j = torch.arange(L, device=device)[:, None], torch.arange(L_kv, device=device)[None]
            m = m & ((j > i - window) if causal else ((i - j).abs() < window))
        keep = m.expand(B, L, L_kv)
    kv_pad = padding_mask(memory_padding_mask, B, L_kv, "memory_padding_mask", device) if cross else kpm
    kv_keep = row_keep if not cross else torch.ones(B, L_kv, dtype=torch.bool, device=device)
    if kv_pad is not None:
        kv_keep = ~kv_pad
        kk = kv_keep.unsqueeze(1).expand(B, L, L_kv)
        keep = kk if keep is None else keep & kk
    return keep, row_keep, kv_keep


def keep_masks(B: int, L: int, causal: bool, key_padding_mask, device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(keep (B, L, L) or None, row_keep (B, L))`` from the causal flag and a padding mask (True = padded)."""
    keep, row_keep, _ = attention_masks(B, L, L, causal, None, key_padding_mask, None, False, device)
    return keep, row_keep
