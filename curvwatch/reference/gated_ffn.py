"""The gated-MLP (SwiGLU, GeGLU) ground truth: dense Hessian blocks by ``torch.func``; see the package docstring."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.nn.functional as nnF
from torch import Tensor

from curvwatch.closed_form.inputs import GatedFFNWeights, OutputLoss
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

__all__ = ["gated_ffn_blocks", "gated_ffn_forward"]

_GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
# LLaMA's names: w1 = gate, w3 = up, w2 = down (pair names must read as two "[A-Z][0-9]*" units)
_GATED_PAIRS = (("W1", "W1"), ("W3", "W3"), ("W2", "W2"), ("W1", "W3"), ("W1", "W2"), ("W3", "W2"))


def _gate_activation(name: str) -> Callable[[Tensor], Tensor]:
    """torch's own activations: SiLU (SwiGLU), exact erf GELU and tanh GELU (GeGLU)."""
    if name == "silu":
        return nnF.silu
    if name == "gelu":
        return nnF.gelu
    return lambda x: nnF.gelu(x, approximate="tanh")


def gated_ffn_forward(Y: Tensor, weights: GatedFFNWeights, activation: str) -> Tensor:
    """``(act(Y W_gate + b_gate) * (Y W_up + b_up)) W_down + b_down``, ``(B, L, m)``, for ``Y`` ``(B, L, d)``."""
    W_gate, W_up, W_down = weights.W_gate, weights.W_up, weights.W_down
    b_gate, b_up, b_down = weights.b_gate, weights.b_up, weights.b_down
    act = _gate_activation(activation)
    gate = act(Y @ W_gate + (0 if b_gate is None else b_gate))  # (B, L, f)
    up = Y @ W_up + (0 if b_up is None else b_up)  # (B, L, f)
    return (gate * up) @ W_down + (0 if b_down is None else b_down)  # (B, L, m)


def gated_ffn_blocks(
    Y: Tensor,
    weights: GatedFFNWeights,
    *,
    activation: str = "silu",
    loss: OutputLoss,
    row_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Dense Hessian blocks of a gated MLP (SwiGLU / GeGLU), by ``torch.func``.

    :math:`F = (\\mathrm{act}(Y W_{gate} + b_{gate}) \\odot (Y W_{up} + b_{up})) W_{down} + b_{down}` (no
    residual) with ``act`` torch's ``silu``, exact ``gelu`` or tanh ``gelu``. Losses as in the package
    docstring with output width ``m``. The blocks are named as in LLaMA: ``W1`` = ``W_gate``, ``W3`` =
    ``W_up``, ``W2`` = ``W_down``.

    Args:
        Y: input, ``(L, d)`` or ``(B, L, d)``.
        weights: ``W_gate`` ``(d, f)``, ``W_up`` ``(d, f)``, ``W_down`` ``(f, m)``; optional ``b_gate``, ``b_up``
            ``(f,)``, ``b_down`` ``(m,)``, held fixed.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` or ``"gelu_tanh"`` (GeGLU).
        loss: ``target`` (shaped like the output ``(L, m)`` / ``(B, L, m)``; squared-error loss, mean over the
            batch) or ``grad_output`` (surrogate loss, summed over the batch) with ``output_curvature`` (default
            ``2 / (L m)``).
        row_mask: ``(B, L)`` bool (``(L,)`` for an unbatched ``Y``), True = keep.

    Returns:
        ``{part}/{XY}`` for part in ``outer, functional, hessian`` and XY in
        ``W1W1, W3W3, W2W2, W1W3, W1W2, W3W2``, each ``(n_X, n_Y)`` in ``vec_r`` order.

    Raises:
        ValueError: on inconsistent shapes, dtypes, masks or ``activation``, or unless exactly one of
            ``target`` and ``grad_output`` is given.

    Example:
        >>> import torch
        >>> Y = torch.randn(3, 2, dtype=torch.float64)
        >>> W_g, W_u = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
        >>> W_d, G = torch.randn(4, 5, dtype=torch.float64), torch.ones(3, 5, dtype=torch.float64)
        >>> out = gated_ffn_blocks(Y, GatedFFNWeights(W_g, W_u, W_d), loss=OutputLoss(grad_output=G))
        >>> out["hessian/W1W2"].shape, float(out["functional/W3W3"].abs().max())
        (torch.Size([8, 20]), 0.0)
    """
    check_choice("activation", activation, _GATED_ACTIVATIONS)
    loss = check_loss(loss)
    W_gate, W_up, W_down = weights.W_gate, weights.W_up, weights.W_down
    Yb, batched = as_batched("Y", Y)
    B, L, d = Yb.shape
    if not isinstance(W_gate, Tensor) or W_gate.ndim != 2:
        raise ValueError(f"Invalid W_gate: expected a (d, f) = ({d}, f) tensor, got {describe(W_gate)}.")
    f = W_gate.shape[1]
    check_tensor("W_gate", W_gate, (d, f), Yb)
    check_tensor("W_up", W_up, (d, f), Yb)
    if not isinstance(W_down, Tensor) or W_down.ndim != 2:
        raise ValueError(f"Invalid W_down: expected a (f, m) = ({f}, m) tensor, got {describe(W_down)}.")
    m = W_down.shape[1]
    check_tensor("W_down", W_down, (f, m), Yb)
    check_tensor("b_gate", weights.b_gate, (f,), Yb)
    check_tensor("b_up", weights.b_up, (f,), Yb)
    check_tensor("b_down", weights.b_down, (m,), Yb)
    keep = batched_mask("row_mask", row_mask, B, L, batched)

    def forward(W1: Tensor, W3: Tensor, W2: Tensor) -> Tensor:
        return gated_ffn_forward(Yb, dataclasses.replace(weights, W_gate=W1, W_up=W3, W_down=W2), activation)

    blocks = {"W1": W_gate, "W3": W_up, "W2": W_down}
    mats = dense_blocks(forward, blocks, lambda F0: output_loss(F0, keep, loss, batched))
    return pair_keys(mats, _GATED_PAIRS)
