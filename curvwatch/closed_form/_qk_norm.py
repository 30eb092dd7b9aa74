"""The per-head QK-norm of the attention closed forms: its settings (``qk_norm=`` dict) and its row products.

Its parameters as blocks of their own (``N1``, ``N2``) are in :mod:`curvwatch.closed_form._qk_norm_blocks`.
"""

from __future__ import annotations

import math

import torch

from ._common import check_like
from ._qk_norm_blocks import norm_affine
from .layernorm import LayerNormRows
from .rmsnorm import RMSNormRows

__all__ = ["QK_NORM_KINDS", "QKNorm", "check_qk_norm"]

QK_NORM_KINDS = ("rmsnorm", "layernorm")
_QK_NORM_KEYS = ("kind", "eps", "weight_q", "weight_k", "bias_q", "bias_k", "weight_offset")


class QKNorm:
    """Per-head QK-norm settings: builds the row products of ``N_q``, ``N_k`` at the pre-norm queries and keys."""

    def __init__(self, kind: str, eps: float, weights: dict, offset: float):
        self.kind, self.eps, self.weights, self.offset = kind, eps, weights, offset

    def rows(self, Y0: torch.Tensor, side: str):
        """``(rows, N(Y0))``: the row object (``jvp``, ``vjp``, ``hvp``) and the normalised ``Y0`` ``(..., d_K)``."""
        w, b = self.weights[f"weight_{side}"], self.weights.get(f"bias_{side}")
        if self.kind == "rmsnorm":
            rows = RMSNormRows(Y0, self.eps, w, self.offset)
            return rows, rows.forward()
        rows = LayerNormRows(Y0, self.eps, None if w is None else w + self.offset)
        return rows, rows.forward(b)

    def affine(self, rows, side: str):
        """The norm's parameters of ``side`` as a block (:class:`~._qk_norm_blocks.NormAffine`), or None."""
        return norm_affine(self, rows, side)


def check_qk_norm(qk_norm, d_K: int, ref: torch.Tensor) -> QKNorm | None:
    """Validate the ``qk_norm`` dict of :func:`multi_head_attention`."""
    if qk_norm is None:
        return None
    if not isinstance(qk_norm, dict):
        raise ValueError(f"Invalid qk_norm={type(qk_norm).__name__}. Must be None or a dict with keys {_QK_NORM_KEYS}.")
    unknown = sorted(set(qk_norm) - set(_QK_NORM_KEYS))
    if unknown:
        raise ValueError(f"Invalid qk_norm keys {unknown}. Allowed: {list(_QK_NORM_KEYS)}.")
    kind = qk_norm.get("kind")
    if kind not in QK_NORM_KINDS:
        raise ValueError(f"Invalid qk_norm kind={kind!r}. Must be one of {list(QK_NORM_KINDS)}.")
    eps = qk_norm.get("eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"Invalid qk_norm eps={eps!r}. Must be a finite number >= 0 (the norm module's eps).")
    offset = qk_norm.get("weight_offset", 0.0)
    if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
        raise ValueError(f"Invalid qk_norm weight_offset={offset!r}. Must be 0.0, or 1.0 for Gemma's (1 + weight).")
    names = ("weight_q", "weight_k") + (("bias_q", "bias_k") if kind == "layernorm" else ())
    if kind == "rmsnorm" and any(qk_norm.get(b) is not None for b in ("bias_q", "bias_k")):
        raise ValueError("qk_norm bias_q / bias_k apply to kind='layernorm' only; RMSNorm has no bias.")
    weights = {}
    for name in names:
        weights[name] = check_like(qk_norm.get(name), (d_K,), f"qk_norm {name}", ref)
    if offset != 0.0 and (weights["weight_q"] is None or weights["weight_k"] is None):
        raise ValueError(f"qk_norm weight_offset={offset} needs weight_q and weight_k: the offset is added to them.")
    return QKNorm(kind, float(eps), weights, float(offset))
