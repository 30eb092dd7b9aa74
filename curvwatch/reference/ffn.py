"""The feed-forward ground truth: ``act(Y W_1 + b_1) W_2 + b_2 (+ Y)`` and its dense blocks by ``torch.func``."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from curvwatch.closed_form.inputs import FFNWeights, OutputLoss
from curvwatch.reference.common import (
    as_batched,
    batched_mask,
    check_choice,
    check_loss,
    check_tensor,
    dense_blocks,
    describe,
    output_loss,
    pair_keys,
)

__all__ = ["ACTIVATIONS", "activation_of", "ffn_blocks", "ffn_forward", "gelu"]

ACTIVATIONS = ("relu", "gelu")


def gelu(x: Tensor) -> Tensor:
    """Exact GELU, ``x * Phi(x)`` with the normal CDF written through ``erf``."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def activation_of(name: str) -> Callable[[Tensor], Tensor]:
    """ReLU, or the exact GELU."""
    return torch.relu if name == "relu" else gelu


def ffn_forward(Y: Tensor, W_1: Tensor, W_2: Tensor, activation: str, residual: bool, b_1=None, b_2=None) -> Tensor:
    """``act(Y W_1 + b_1) W_2 + b_2 (+ Y)``, ``(B, L, d)``."""
    act = activation_of(activation)
    S = act(Y @ W_1 + (0 if b_1 is None else b_1)) @ W_2 + (0 if b_2 is None else b_2)
    return S + Y if residual else S


def ffn_blocks(
    Y: Tensor,
    weights: FFNWeights,
    *,
    activation: str = "relu",
    residual: bool = True,
    loss: OutputLoss,
    row_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Dense Hessian blocks of a feed-forward layer, by ``torch.func``.

    :math:`S = \\sigma(Y W_1 + b_1) W_2 + b_2\\ (+\\,Y \\text{ if residual})` with ``relu`` or the exact
    (erf) ``gelu``. Losses as in the package docstring with output width ``m = d``.

    Args:
        Y: input, ``(L, d)`` or ``(B, L, d)``.
        weights: ``W_1`` ``(d, d_ff)``, ``W_2`` ``(d_ff, d)``, optional ``b_1`` ``(d_ff,)``, ``b_2`` ``(d,)``.
        activation: ``"relu"`` or ``"gelu"``.
        residual: add ``Y`` to the output.
        loss: ``target`` (same shape as ``Y``; squared-error loss, mean over the batch) or ``grad_output`` (same
            shape; surrogate loss, summed over the batch) with ``output_curvature`` (default ``2 / (L d)``).
        row_mask: ``(B, L)`` bool (``(L,)`` for an unbatched ``Y``), True = keep; dropped rows contribute
            nothing and shrink the target-mode normaliser to ``L_b d``.

    Returns:
        ``{part}/{XY}`` for part in ``outer, functional, hessian`` and XY in ``W1W1, W2W2, W1W2``.

    Raises:
        ValueError: on inconsistent shapes, dtypes, masks or ``activation``, or unless exactly one of
            ``target`` and ``grad_output`` is given.

    Example:
        >>> Y = torch.randn(3, 2, dtype=torch.float64)
        >>> W_1, W_2 = torch.randn(2, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> out = ffn_blocks(Y, FFNWeights(W_1, W_2), activation="gelu", loss=OutputLoss(target=torch.zeros_like(Y)))
        >>> out["hessian/W1W2"].shape
        torch.Size([8, 8])
    """
    check_choice("activation", activation, ACTIVATIONS)
    loss = check_loss(loss)
    W_1, W_2, b_1, b_2 = weights.W_1, weights.W_2, weights.b_1, weights.b_2
    Yb, batched = as_batched("Y", Y)
    B, L, d = Yb.shape
    if not isinstance(W_1, Tensor) or W_1.ndim != 2:
        raise ValueError(f"Invalid W_1: expected a (d, d_ff) = ({d}, d_ff) tensor, got {describe(W_1)}.")
    d_ff = W_1.shape[1]
    check_tensor("W_1", W_1, (d, d_ff), Yb)
    check_tensor("W_2", W_2, (d_ff, d), Yb)
    check_tensor("b_1", b_1, (d_ff,), Yb)
    check_tensor("b_2", b_2, (d,), Yb)
    keep = batched_mask("row_mask", row_mask, B, L, batched)

    def forward(W1: Tensor, W2: Tensor) -> Tensor:
        return ffn_forward(Yb, W1, W2, activation, residual, b_1, b_2)

    mats = dense_blocks(forward, {"W1": W_1, "W2": W_2}, lambda F0: output_loss(F0, keep, loss, batched))
    return pair_keys(mats, (("W1", "W1"), ("W2", "W2"), ("W1", "W2")))
