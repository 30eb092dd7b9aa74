"""The RMSNorm ground truths (dense Jacobian/Hessian, contracted Hessian) by ``torch.func``; see the package doc."""

from __future__ import annotations

import math

from torch import Tensor
from torch.func import hessian, jacrev

from curvwatch.reference.common import as_batched, batched_mask, check_tensor

__all__ = ["rmsnorm_dense", "rmsnorm_contracted_hessian"]


def _rms_norm(X: Tensor, eps: float, weight: Tensor | None = None, weight_offset: float = 0.0) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * (weight_offset + weight)`` over the last dim."""
    Y = X / (X.pow(2).mean(dim=-1, keepdim=True) + eps).sqrt()
    if weight is not None:
        Y = Y * (weight_offset + weight)
    return Y


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_rmsnorm(X: Tensor, eps: float, weight: Tensor | None, weight_offset: float) -> tuple[Tensor, bool]:
    """Validate RMSNorm inputs; return ``X`` as ``(B, L, n)`` and whether it was batched."""
    X3, batched = as_batched("X", X)
    if not _is_real(eps) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"Invalid eps={eps!r}. Must be a finite number >= 0.")
    if not _is_real(weight_offset) or not math.isfinite(weight_offset):
        raise ValueError(f"Invalid weight_offset={weight_offset!r}. Must be a finite number (Gemma: 1.0).")
    if weight is None and weight_offset != 0.0:
        raise ValueError(f"Invalid weight_offset={weight_offset} without a weight. Pass weight= or drop the offset.")
    check_tensor("weight", weight, (X3.shape[-1],), X3)
    return X3, batched


def rmsnorm_dense(
    X: Tensor,
    eps: float = 1e-6,
    weight: Tensor | None = None,
    weight_offset: float = 0.0,
    row_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Dense Jacobian and Hessian of RMSNorm over the last dim, by ``torch.func``.

    :math:`y_i = x_i / \\sqrt{\\|x_i\\|^2 / n + \\epsilon} \\odot (\\text{weight\\_offset} + \\text{weight})` for
    every row ``x_i``, seen as a map of :math:`x = \\mathrm{vec}_r` of the ``N`` kept rows.

    Args:
        X: ``(L, n)`` or ``(B, L, n)``.
        eps: the mean-square floor, ``>= 0``.
        weight: optional ``(n,)`` affine scale. weight_offset: added to it (Gemma: 1.0).
        row_mask: optional bool ``(B, L)`` (``(L,)`` unbatched), True = row kept; None keeps all rows.

    Returns:
        ``jacobian``: ``(N n, N n)``, ``[k, a] = dy_k/dx_a``;
        ``hessian``: ``(N n, N n, N n)``, ``[k, a, b] = d^2 y_k / dx_a dx_b``.
        Both are block-diagonal over rows.

    Raises:
        ValueError: on a bad shape, dtype, ``eps``, ``weight_offset`` or mask, or a mask that keeps no row.

    Example:
        >>> import torch
        >>> out = rmsnorm_dense(torch.randn(2, 3, dtype=torch.float64), eps=1e-6)
        >>> out["jacobian"].shape, out["hessian"].shape
        (torch.Size([6, 6]), torch.Size([6, 6, 6]))
    """
    X3, batched = _check_rmsnorm(X, eps, weight, weight_offset)
    B, L, n = X3.shape
    mask = batched_mask("row_mask", row_mask, B, L, batched)
    rows = X3.reshape(-1, n) if mask is None else X3[mask]  # (N, n)
    if rows.shape[0] == 0:
        raise ValueError("Invalid row_mask: it keeps no row. Keep at least one (True = keep).")

    def rms_flat(x: Tensor) -> Tensor:
        return _rms_norm(x.reshape(rows.shape), eps, weight, weight_offset).reshape(-1)

    x = rows.reshape(-1)
    return {"jacobian": jacrev(rms_flat)(x), "hessian": hessian(rms_flat)(x)}


def rmsnorm_contracted_hessian(
    X: Tensor, grad_output: Tensor, eps: float = 1e-6, weight: Tensor | None = None, weight_offset: float = 0.0
) -> Tensor:
    """:math:`\\sum_k g_k \\nabla^2 y_k` for RMSNorm, by ``torch.func``.

    The Hessian of :math:`x \\mapsto \\langle g, \\mathrm{RMSNorm}(x)\\rangle` with
    :math:`g = \\mathrm{vec}_r(\\text{grad\\_output})` held fixed.

    Args:
        X: ``(L, n)`` or ``(B, L, n)``.
        grad_output: same shape as ``X``.
        eps: the mean-square floor, ``>= 0``.
        weight: optional ``(n,)`` affine scale. weight_offset: added to it (Gemma: 1.0).

    Returns:
        ``(N n, N n)``, block-diagonal over the ``N`` rows.

    Raises:
        ValueError: on a bad shape, dtype, ``eps`` or ``weight_offset``.

    Example:
        >>> import torch
        >>> X = torch.randn(2, 3, dtype=torch.float64)
        >>> rmsnorm_contracted_hessian(X, torch.ones_like(X)).shape
        torch.Size([6, 6])
    """
    X3, _ = _check_rmsnorm(X, eps, weight, weight_offset)
    check_tensor("grad_output", grad_output, tuple(X.shape), X)
    rows = X3.reshape(-1, X3.shape[-1])
    g = grad_output.reshape(-1).detach()

    def contracted(x: Tensor) -> Tensor:
        return (g * _rms_norm(x.reshape(rows.shape), eps, weight, weight_offset).reshape(-1)).sum()

    return hessian(contracted)(rows.reshape(-1))
