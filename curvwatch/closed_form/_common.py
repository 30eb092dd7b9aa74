"""Input checks and loss conventions shared by the closed-form kernels."""

from __future__ import annotations

import torch

from .settings import INPUTS_CHECKED
from .solver.lockstep import gathered


def as_batched(X: torch.Tensor, name: str = "X") -> tuple[torch.Tensor, bool]:
    """Return ``(X3, was_batched)`` with ``X3`` of shape ``(B, L, d)``.

    Raises:
        ValueError: if ``X`` is not 2-D or 3-D, not floating point, or has an empty dimension.
    """
    if not isinstance(X, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(X).__name__}.")
    if X.ndim not in (2, 3):
        raise ValueError(f"{name} must have shape (L, d) or (B, L, d); got shape {tuple(X.shape)}.")
    if not X.is_floating_point():
        raise ValueError(f"{name} must be floating point (float32 or float64); got dtype {X.dtype}. Cast it first.")
    if X.numel() == 0:
        raise ValueError(f"{name} has an empty dimension: shape {tuple(X.shape)}.")
    # amax propagates NaN; 4x cheaper than isfinite(X).all()
    if not INPUTS_CHECKED.get() and not bool(torch.isfinite(X.abs().amax())):
        raise ValueError(
            f"{name} holds NaN or Inf values: the curvature of a diverged forward pass is undefined. "
            "Check the loss for NaN (lower the learning rate, clip gradients) or skip this batch."
        )
    return (X.unsqueeze(0), False) if X.ndim == 2 else (X, True)


def check_like(t: torch.Tensor | None, shape: tuple[int, ...], name: str, ref: torch.Tensor) -> torch.Tensor | None:
    """Check an optional tensor's shape and move it to ``ref``'s dtype/device."""
    if t is None:
        return None
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}; got {tuple(t.shape)}.")
    return t.to(dtype=ref.dtype, device=ref.device)


def check_row_mask(
    row_mask: torch.Tensor | None, B: int, L: int, ref: torch.Tensor, nonempty: bool = False
) -> torch.Tensor | None:
    """The optional ``row_mask`` as ``(B, L)`` bool on ``ref``'s device (True = token in the loss), or ``None``.

    Accepts ``(B, L)``, and ``(L,)`` when ``B == 1`` (an unbatched input).

    Raises:
        ValueError: If it is not a tensor of those shapes, or (``nonempty``) if it keeps no token.

    Example:
        >>> check_row_mask(torch.tensor([True, False]), 1, 2, torch.zeros(1)).shape
        torch.Size([1, 2])
    """
    if row_mask is None:
        return None
    allowed = [(B, L)] + ([(L,)] if B == 1 else [])
    if not isinstance(row_mask, torch.Tensor) or tuple(row_mask.shape) not in allowed:
        got = tuple(row_mask.shape) if isinstance(row_mask, torch.Tensor) else type(row_mask).__name__
        raise ValueError(
            f"Invalid row_mask shape {got}. row_mask must have shape (B, L) = {(B, L)}"
            f"{' or (L,)' if B == 1 else ''}: one bool per token, True = token in the loss."
        )
    keep = row_mask.to(device=ref.device, dtype=torch.bool).reshape(B, L)
    if nonempty and not bool(keep.any()):
        raise ValueError("row_mask excludes every row; nothing to measure. Keep at least one row (True = keep).")
    return keep


def check_weight(W: torch.Tensor, rows: int, name: str, ref: torch.Tensor) -> torch.Tensor:
    """Check a weight in math convention (``X @ W``): 2-D with ``rows`` rows."""
    if not isinstance(W, torch.Tensor) or W.ndim != 2:
        raise ValueError(f"{name} must be a 2-D tensor (d_in, d_out) used as X @ {name}; got {getattr(W, 'shape', W)}.")
    if W.shape[0] != rows:
        raise ValueError(
            f"{name} has shape {tuple(W.shape)} but the input width is {rows}: weights follow the math "
            f"convention X @ W (pass nn.Linear.weight.T)."
        )
    return W.to(dtype=ref.dtype, device=ref.device)


def output_cotangent(
    F: torch.Tensor,
    row_keep: torch.Tensor,
    *,
    target: torch.Tensor | None,
    grad_output: torch.Tensor | None,
    output_curvature: float | None,
    batched: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve the loss convention into the cotangent ``g = dl/dF`` and the output curvature per sequence.

    * ``target``: ``l = mean_b ||F_b - T_b||^2 / (L_b m)``, so ``c_b = 2 / (L_b m B)`` and ``g = c_b (F - T)``
      (``L_b``: kept rows of sequence ``b``).
    * ``grad_output``: ``l = sum_b <G_b, F_b'> + (c/2) ||F_b' - F_b||^2``; ``g = G``, ``c_b = c``
      (default ``2 / (L m)``).

    Args:
        F: block output ``(B, L, m)``.
        row_keep: ``(B, L)`` bool, rows that belong to the loss.
        target, grad_output: exactly one, shaped like the unbatched/batched output.
        output_curvature: ``c`` of the grad_output mode.
        batched: whether the user passed batched tensors.

    Returns:
        ``(g, c, residual)`` with ``g`` ``(B, L, m)`` (zero on dropped rows), ``c`` ``(B,)`` and the
        residual ``F - T`` (target mode) or ``g`` itself (grad_output mode).
    """
    B, L, m = F.shape
    if (target is None) == (grad_output is None):
        raise ValueError(
            "Pass exactly one of target= (the papers' loss ||F - target||^2/(L m)) or grad_output= "
            "(the back-propagated dl/dF, for a block inside a network)."
        )
    keep = row_keep.to(F.dtype).unsqueeze(-1)
    other = target if target is not None else grad_output
    name = "target" if target is not None else "grad_output"
    expected = (B, L, m) if batched else (L, m)
    if tuple(other.shape) != expected:
        raise ValueError(f"{name} must have the output's shape {expected}; got {tuple(other.shape)}.")
    other = other.to(dtype=F.dtype, device=F.device)
    if not batched:
        other = other.unsqueeze(0)
    if target is not None:
        if output_curvature is not None:
            raise ValueError("output_curvature only applies with grad_output=; target mode fixes c = 2/(L m).")
        L_b = row_keep.sum(-1).clamp_min(1).to(F.dtype)  # (B,)
        c = 2.0 / (L_b * m * B)
        R = (F - other) * keep
        return c.unsqueeze(-1).unsqueeze(-1) * R, c, R
    c_val = 2.0 / (L * m) if output_curvature is None else float(output_curvature)
    if not c_val >= 0.0:
        raise ValueError(
            f"output_curvature must be >= 0 (a curvature of the loss in the output); got {output_curvature}."
        )
    g = other * keep
    return g, torch.full((B,), c_val, dtype=F.dtype, device=F.device), g


def row_statistics(X: torch.Tensor, keep: torch.Tensor | None = None, *, eps: float, centered: bool) -> torch.Tensor:
    """The row statistics of a LayerNorm (``centered``) or RMSNorm input, what the collapse warnings read:
    ``(..., 6)`` for ``X`` ``(..., B, L, n)``.

    With ``v`` the row variance (biased; ``centered``) or mean square: ``v_min``, ``v_mean`` over the kept rows,
    ``1/sqrt(v_min + eps)`` (``= 1/min sqrt(v + eps)``: the square root is monotone), ``1/(v_min + eps)``,
    ``v_min / eps`` (``inf`` when ``eps = 0``) and the fraction of collapsed rows (``v <= 10 eps``; with ``eps = 0``,
    ``v = 0``): the LayerNorm's ``var_min`` ... ``collapsed_fraction``, the RMSNorm's ``ms_min`` ....

    Args:
        X: ``(..., B, L, n)``; any leading dimensions (the blocks of a gathered call, see
            :func:`~curvwatch.closed_form.solver.lockstep.gathered`).
        keep: ``(..., B, L)`` bool, the rows counted (at least one), or ``None``: all.
        eps: the norm's epsilon.
        centered: LayerNorm (the variance) or RMSNorm (the mean square).
    """
    Xc = X - X.mean(-1, keepdim=True) if centered else X
    var = (Xc * Xc).mean(-1).flatten(-2)  # (..., B L)
    collapsed = var <= 10 * eps if eps > 0 else var == 0
    if keep is None:
        var_min, var_mean, frac = var.amin(-1), var.mean(-1), collapsed.to(X.dtype).mean(-1)
    else:
        k = keep.flatten(-2)
        count = k.sum(-1).to(X.dtype)
        var_min = var.masked_fill(~k, torch.inf).amin(-1)
        var_mean, frac = (var * k).sum(-1) / count, (collapsed & k).sum(-1).to(X.dtype) / count
    low = var_min + eps
    over_eps = var_min / eps if eps > 0 else torch.full_like(var_min, torch.inf)
    return torch.stack([var_min, var_mean, low.sqrt().reciprocal(), low.reciprocal(), over_eps, frac], -1)


def norm_statistics(
    X: torch.Tensor, keep: torch.Tensor | None, eps: float, names: tuple[str, ...], centered: bool
) -> dict:
    """``{name: 0-d tensor}`` of :func:`row_statistics` for a LayerNorm (``centered``) or an RMSNorm input ``X``
    ``(B, L, n)``, one gathered call for the norms of a Lockstep that meet here (every norm
    block's, in a terms-only evaluation; :func:`~curvwatch.closed_form.solver.lockstep.gathered`)."""
    with torch.no_grad():
        inputs = (X,) if keep is None else (X, keep)
        stats = gathered(row_statistics, *inputs, eps=eps, centered=centered)
        return dict(zip(names, stats.unbind(-1), strict=True))
