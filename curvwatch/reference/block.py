"""The whole-block ground truth: a post-LN or pre-LN Transformer block and its dense blocks by ``torch.func``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import torch  # noqa: F401  (the doctests use it)
from torch import Tensor

from curvwatch.closed_form.inputs import AttentionWeights, OutputLoss
from curvwatch.reference.attention import ATTENTION_PAIRS, attention_forward, blocked_logits, check_heads
from curvwatch.reference.common import (
    PARTS,
    as_batched,
    check_choice,
    check_loss,
    check_tensor,
    dense_blocks,
    describe,
    layer_norm,
    output_loss,
    pair_keys,
    with_columns,
)
from curvwatch.reference.ffn import ACTIVATIONS, ffn_forward

__all__ = ["BLOCK_PAIRS", "transformer_block_blocks", "transformer_block_forward"]

BLOCK_ORDER = ("V", "Q", "K", "W1", "W2")
BLOCK_PAIRS = tuple(itertools.combinations_with_replacement(BLOCK_ORDER, 2))
NORMS = ("post", "pre")
ATTENTION_ORDER = {X for pair in ATTENTION_PAIRS for X in pair}

# Optional params of transformer_block_blocks: held fixed, not differentiated.
BLOCK_BIASES = ("b_Q", "b_K", "b_V", "b_O", "b_1", "b_2")
BLOCK_LN_AFFINE = ("ln1_weight", "ln1_bias", "ln2_weight", "ln2_bias")
BLOCK_FIXED = ("W_O", *BLOCK_BIASES, *BLOCK_LN_AFFINE)
BLOCK_KEYS = {"W_Q", "W_K", "W_V", "W_1", "W_2", "n_heads", *BLOCK_FIXED}


def transformer_block_forward(
    X: Tensor,
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    W_1: Tensor,
    W_2: Tensor,
    fixed: Mapping[str, Tensor | None],
    n_heads: int,
    norm: str,
    activation: str,
    eps: float,
    blocked: Tensor,
) -> Tensor:
    """Post-LN or pre-LN block output ``Z``, ``(B, L, d)``, for ``X`` ``(B, L, d)``; ``fixed`` holds ``W_O``, the
    biases and the LayerNorm affine parameters (each None for none), ``blocked`` ``(B, L, L)`` the attention mask."""
    weights = AttentionWeights(W_Q, W_K, W_V, fixed["W_O"], n_heads, b_Q=fixed["b_Q"], b_K=fixed["b_K"],
                               b_V=fixed["b_V"], b_O=fixed["b_O"])  # fmt: skip

    def ln1(inp: Tensor) -> Tensor:
        return layer_norm(inp, eps, fixed["ln1_weight"], fixed["ln1_bias"])

    def ln2(inp: Tensor) -> Tensor:
        return layer_norm(inp, eps, fixed["ln2_weight"], fixed["ln2_bias"])

    if norm == "post":
        U = X + attention_forward(X, weights, blocked)
        Y = ln1(U)
        S = ffn_forward(Y, W_1, W_2, activation, True, fixed["b_1"], fixed["b_2"])  # includes + Y
        return ln2(S)
    Y = ln1(X)
    U = X + attention_forward(Y, weights, blocked)
    V = ln2(U)
    return U + ffn_forward(V, W_1, W_2, activation, False, fixed["b_1"], fixed["b_2"])


def transformer_block_blocks(
    X: Tensor,
    params: Mapping[str, Tensor | int],
    *,
    norm: str = "post",
    activation: str = "relu",
    eps: float = 1e-5,
    causal: bool = False,
    loss: OutputLoss,
) -> dict[str, Tensor]:
    """Dense Hessian blocks of a full post-LN or pre-LN Transformer block, by ``torch.func``.

    * post (the block of Ormaniec et al. 2024): :math:`U = X + \\mathrm{MHA}(X)`, :math:`Y = \\mathrm{LN}_1(U)`,
      :math:`S = \\sigma(Y W_1 + b_1) W_2 + b_2 + Y`, :math:`Z = \\mathrm{LN}_2(S)`.
    * pre: :math:`Y = \\mathrm{LN}_1(X)`, :math:`U = X + \\mathrm{MHA}(Y)`, :math:`V = \\mathrm{LN}_2(U)`,
      :math:`Z = U + \\sigma(V W_1 + b_1) W_2 + b_2`.

    MHA is that of :func:`~curvwatch.reference.multi_head_attention_blocks`; the loss acts on ``Z`` (width
    ``m = d``).

    Args:
        X: input, ``(L, d)`` or ``(B, L, d)``.
        params: ``W_Q, W_K`` ``(d, H d_K)``, ``W_V`` ``(d, H d_V)``, ``W_1`` ``(d, d_ff)``,
            ``W_2`` ``(d_ff, d)``; optional ``n_heads`` (int, default 1), ``W_O`` ``(H d_V, d)`` (default
            the identity, which needs ``H d_V = d``), biases ``b_Q, b_K`` ``(H d_K,)``, ``b_V`` ``(H d_V,)``,
            ``b_O, b_2`` ``(d,)``, ``b_1`` ``(d_ff,)``, LayerNorm affine ``ln1_weight, ln1_bias,
            ln2_weight, ln2_bias`` ``(d,)`` (default identity / zero).
        norm: ``"post"`` or ``"pre"``.
        activation: ``"relu"`` or ``"gelu"`` (exact).
        eps: LayerNorm variance floor, ``>= 0``.
        causal: block attention to future positions.
        loss: ``target`` (same shape as ``X``; squared-error loss, mean over the batch) or ``grad_output`` (same
            shape; surrogate loss, summed over the batch) with ``output_curvature`` (default ``2 / (L d)``).

    Returns:
        ``{part}/{XY}`` for part in ``outer, functional, hessian`` and the 15 pairs XY of the block
        order ``V, Q, K, W1, W2`` with X not after Y (``VV, VQ, ..., W1W2, W2W2``). With ``n_heads > 1``
        every pair involving an attention block is per head with suffix ``/h{i}`` (pairs between
        different heads are not computed); ``W1W1, W1W2, W2W2`` have no suffix.

    Raises:
        ValueError: on unknown or missing ``params`` keys, inconsistent shapes or dtypes, a bad
            ``norm``/``activation``/``eps``, or unless exactly one of ``target`` and ``grad_output`` is given.

    Example:
        >>> X = torch.randn(3, 4, dtype=torch.float64)
        >>> p = {k: torch.randn(4, 4, dtype=torch.float64) for k in ("W_Q", "W_K", "W_V", "W_1", "W_2")}
        >>> out = transformer_block_blocks(X, p, norm="pre", loss=OutputLoss(grad_output=torch.ones_like(X)))
        >>> out["hessian/QW1"].shape
        torch.Size([16, 16])
    """
    check_choice("norm", norm, NORMS)
    check_choice("activation", activation, ACTIVATIONS)
    loss = check_loss(loss)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"Invalid eps={eps!r}. Must be a finite number >= 0.")
    Xb, batched = as_batched("X", X)
    B, L, d = Xb.shape
    fixed, (d_K, d_V) = _checked_params(params, Xb)
    n_heads = params.get("n_heads", 1)
    W_Q, W_K, W_V, W_1, W_2 = (params[k] for k in ("W_Q", "W_K", "W_V", "W_1", "W_2"))
    blocked = blocked_logits(B, L, causal, None, Xb.device)

    out: dict[str, Tensor] = {}
    for h in range(n_heads):

        def forward(V: Tensor, Q: Tensor, K: Tensor, W1: Tensor, W2: Tensor, h: int = h) -> Tensor:
            return transformer_block_forward(
                Xb,
                with_columns(W_Q, Q, h * d_K),
                with_columns(W_K, K, h * d_K),
                with_columns(W_V, V, h * d_V),
                W1, W2, fixed, n_heads, norm, activation, eps, blocked,
            )  # fmt: skip

        blocks = {
            "V": W_V[:, h * d_V : (h + 1) * d_V],
            "Q": W_Q[:, h * d_K : (h + 1) * d_K],
            "K": W_K[:, h * d_K : (h + 1) * d_K],
            "W1": W_1,
            "W2": W_2,
        }
        mats = dense_blocks(forward, blocks, lambda F0: output_loss(F0, None, loss, batched))
        attention_pairs = [p for p in BLOCK_PAIRS if p[0] in ATTENTION_ORDER]
        out.update(pair_keys(mats, attention_pairs, f"/h{h}" if n_heads > 1 else ""))
        if h == 0:
            out.update(pair_keys(mats, [p for p in BLOCK_PAIRS if p[0] not in ATTENTION_ORDER]))
    return {k: out[k] for k in sorted(out, key=_canonical_position)}


def _checked_params(params, Xb: Tensor) -> tuple[dict[str, Tensor | None], tuple[int, int]]:
    """``(fixed params, (d_K, d_V))`` of :func:`transformer_block_blocks`'s ``params``, every key and shape checked."""
    if not isinstance(params, Mapping):
        raise ValueError(f"Invalid params: expected a dict of tensors, got {type(params).__name__}.")
    unknown = sorted(set(params) - BLOCK_KEYS)
    if unknown:
        raise ValueError(f"Invalid params keys {unknown}. Allowed keys: {sorted(BLOCK_KEYS)}.")
    missing = [k for k in ("W_Q", "W_K", "W_V", "W_1", "W_2") if k not in params]
    if missing:
        raise ValueError(f"Missing params {missing}; W_Q, W_K, W_V, W_1 and W_2 are required.")
    d = Xb.shape[-1]
    n_heads = params.get("n_heads", 1)
    W_Q, W_K, W_V, W_1, W_2 = (params[k] for k in ("W_Q", "W_K", "W_V", "W_1", "W_2"))
    d_K, d_V = check_heads(d, W_Q, W_K, W_V, n_heads, Xb)
    if not isinstance(W_1, Tensor) or W_1.ndim != 2:
        raise ValueError(f"Invalid W_1: expected a (d, d_ff) = ({d}, d_ff) tensor, got {describe(W_1)}.")
    d_ff = W_1.shape[1]
    check_tensor("W_1", W_1, (d, d_ff), Xb)
    check_tensor("W_2", W_2, (d_ff, d), Xb)
    fixed = {k: params.get(k) for k in BLOCK_FIXED}
    if fixed["W_O"] is None and n_heads * d_V != d:
        raise ValueError(
            f"Invalid params: W_O omitted (identity) needs n_heads * d_V == d, got {n_heads} * {d_V} != {d}. "
            f"Pass W_O of shape ({n_heads * d_V}, {d})."
        )
    expected = {
        "W_O": (n_heads * d_V, d), "b_Q": (n_heads * d_K,), "b_K": (n_heads * d_K,),
        "b_V": (n_heads * d_V,), "b_O": (d,), "b_1": (d_ff,), "b_2": (d,),
        "ln1_weight": (d,), "ln1_bias": (d,), "ln2_weight": (d,), "ln2_bias": (d,),
    }  # fmt: skip
    for k, shape in expected.items():
        check_tensor(k, fixed[k], shape, Xb)
    return fixed, (d_K, d_V)


def _canonical_position(key: str) -> tuple[int, int, str]:
    """Sort keys by part, then by the canonical pair order, then by head suffix."""
    part, pair, *head = key.split("/")
    pair_names = ["".join(p) for p in BLOCK_PAIRS]
    return PARTS.index(part), pair_names.index(pair), "/".join(head)
