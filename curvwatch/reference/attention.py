"""The attention ground truths: the forward pass written the obvious way, and its dense blocks by ``torch.func``.

:func:`attention_forward` computes multi-head attention from an :class:`~curvwatch.closed_form.AttentionWeights`:
head by head as in the papers, or, with any modern option (grouped-query heads, a cross-attention memory, rotary
embeddings, a softmax scale, QK-norm, rows that see no key), with the heads batched the way real models compute them.
:func:`self_attention_blocks` and :func:`multi_head_attention_blocks` differentiate it; see the package docstring for
the losses and the layout of the blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from curvwatch.closed_form.inputs import AttentionStructure, AttentionWeights, OutputLoss
from curvwatch.reference.common import (
    PARTS,
    as_batched,
    batched_mask,
    check_loss,
    check_tensor,
    dense_blocks,
    describe,
    full_matrix,
    layer_norm,
    output_loss,
    pair_keys,
    with_columns,
)

__all__ = [
    "attention_blocked",
    "attention_forward",
    "blocked_logits",
    "multi_head_attention_blocks",
    "self_attention_blocks",
]

ATTENTION_PAIRS = (("V", "V"), ("Q", "Q"), ("K", "K"), ("V", "Q"), ("V", "K"), ("Q", "K"))


# ---- forward passes, all on batched tensors (B, L, .) ---------------------------------------------------------


def blocked_logits(B: int, L: int, causal: bool, key_padding_mask: Tensor | None, device: torch.device) -> Tensor:
    """Bool ``(B, L, L)``: True where query ``i`` may not attend to key ``j``.

    Future keys (``j > i``) are blocked when ``causal``; padded keys are blocked for every query. A row
    that would be blocked entirely (only a padded query can be, since query ``i`` always sees key ``i``)
    is left unblocked to avoid NaNs; such a row is dropped from the loss, so its content is irrelevant.
    """
    blocked = torch.zeros(B, L, L, dtype=torch.bool, device=device)
    if causal:
        blocked = blocked | torch.ones(L, L, dtype=torch.bool, device=device).triu(1)
    if key_padding_mask is not None:
        blocked = blocked | key_padding_mask[:, None, :]  # (B, 1, L): same keys for every query
    return blocked & ~blocked.all(dim=-1, keepdim=True)


def attention_blocked(
    B: int, L: int, L_kv: int, causal: bool, window: int | None, key_pad: Tensor | None, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(blocked (B, L, L_kv), dead (B, L))``: True where query ``i`` may not attend key ``j``; rows that see no key.

    Blocked: ``j > i`` when ``causal``; with a window ``w`` also ``j <= i - w`` (causal) or ``|i - j| >= w``; padded
    keys (``key_pad`` True) for every query. A row blocked entirely is unblocked (no NaN) and reported ``dead``: its
    attention is set to zero afterwards, so it outputs ``b_O`` and carries no curvature.
    """
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L_kv, device=device)[None, :]
    blocked = torch.zeros(B, L, L_kv, dtype=torch.bool, device=device)
    if causal:
        blocked = blocked | (j > i)
    if window is not None:
        blocked = blocked | ((j <= i - window) if causal else ((i - j).abs() >= window))
    if key_pad is not None:
        blocked = blocked | key_pad[:, None, :]  # (B, 1, L_kv): same keys for every query
    dead = blocked.all(dim=-1)
    return blocked & ~dead[..., None], dead


def attention_head(
    X: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor, blocked: Tensor, b_Q=None, b_K=None, b_V=None
) -> Tensor:
    """One head: ``softmax((X W_Q + b_Q)(X W_K + b_K)^T / sqrt(d_K)) (X W_V + b_V)``, ``(B, L, d_V)``."""
    Q = X @ W_Q + (0 if b_Q is None else b_Q)  # (B, L, d_K)
    K = X @ W_K + (0 if b_K is None else b_K)  # (B, L, d_K)
    V = X @ W_V + (0 if b_V is None else b_V)  # (B, L, d_V)
    T = Q @ K.transpose(-1, -2) / math.sqrt(W_Q.shape[-1])  # (B, L, L)
    A = torch.softmax(T.masked_fill(blocked, float("-inf")), dim=-1)  # rows sum to 1
    return A @ V


def attention_forward(
    X: Tensor,
    weights: AttentionWeights,
    blocked: Tensor,
    *,
    memory: Tensor | None = None,
    rotary: tuple[Tensor, Tensor] | None = None,
    rotary_interleaved: bool = False,
    scale: float | None = None,
    dead: Tensor | None = None,
) -> Tensor:
    """The attention output ``concat_h(head_h) W_O + b_O``, ``(B, L, d_out)`` (``W_O`` None: the identity).

    Args:
        X: ``(B, L, d)`` queries (and keys and values without ``memory``).
        weights: packed weights, ``n_heads``, ``n_kv_heads``, biases and ``qk_norm`` as the kernels take them.
        blocked: ``(B, L, L_kv)`` bool, True where query ``i`` may not attend key ``j``.
        memory: ``(B, L_kv, d_kv)`` cross-attention source of the keys and values, or None.
        rotary: ``(cos, sin)``, each ``(L, r)`` or ``(B or 1, L, r)``; rotary_interleaved: the GPT-J layout.
        scale: softmax scale (default ``1/sqrt(d_K)``).
        dead: ``(B, L)`` bool, query rows that see no key (zero attention), or None.

    Without ``n_kv_heads``, QK-norm and the options above the heads are computed one by one as in the papers;
    otherwise as modern models do: QK-norm then rotary on the queries and keys, kv heads repeated for grouped-query
    attention (``repeat_interleave``), keys and values from ``memory``.
    """
    modern = (weights.n_kv_heads, memory, rotary, scale, weights.qk_norm, dead)
    if rotary_interleaved or any(v is not None for v in modern):
        return _modern_attention(X, weights, blocked, memory, rotary, rotary_interleaved, scale, dead)
    W_Q, W_K, W_V, n_heads = weights.W_Q, weights.W_K, weights.W_V, weights.n_heads
    b_Q, b_K, b_V = weights.b_Q, weights.b_K, weights.b_V
    d_K = W_Q.shape[1] // n_heads
    d_V = W_V.shape[1] // n_heads
    heads = []
    for h in range(n_heads):
        qk, v = slice(h * d_K, (h + 1) * d_K), slice(h * d_V, (h + 1) * d_V)
        heads.append(
            attention_head(
                X,
                W_Q[:, qk],
                W_K[:, qk],
                W_V[:, v],
                blocked,
                None if b_Q is None else b_Q[qk],
                None if b_K is None else b_K[qk],
                None if b_V is None else b_V[v],
            )
        )
    out = torch.cat(heads, dim=-1)  # (B, L, H * d_V)
    if weights.W_O is not None:
        out = out @ weights.W_O
    return out + (0 if weights.b_O is None else weights.b_O)


def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of ``x`` ``(B, heads, L, d_K)`` written out; tables ``(B or 1, L, r)``, halves duplicated.

    Half-split: ``x * cos + rotate_half(x) * sin`` on the first ``r`` dims. Interleaved (GPT-J): the frequencies
    repeated in pairs and ``rotate_every_two(x) = [-x_1, x_0, -x_3, x_2, ...]``. Dims ``r:`` pass unchanged.
    """
    r = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # (B or 1, 1, L, r)
    x_rot, x_pass = x[..., :r], x[..., r:]
    if interleaved:
        c = cos[..., : r // 2].repeat_interleave(2, dim=-1)
        s = sin[..., : r // 2].repeat_interleave(2, dim=-1)
        rotated = torch.stack([-x_rot[..., 1::2], x_rot[..., 0::2]], dim=-1).flatten(-2)
        y = x_rot * c + rotated * s
    else:
        half = r // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        y = x_rot * cos + rotated * sin
    return torch.cat([y, x_pass], dim=-1)


def qk_norm(x: Tensor, norm: Mapping, side: str) -> Tensor:
    """Per-head RMSNorm ``x / sqrt(mean(x^2) + eps) * (offset + w)`` or LayerNorm over ``d_K`` of ``x``."""
    w = norm.get(f"weight_{side}")
    w = None if w is None else w + norm.get("weight_offset", 0.0)
    if norm["kind"] == "rmsnorm":
        y = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + norm["eps"])
        return y if w is None else y * w
    return layer_norm(x, norm["eps"], w, norm.get(f"bias_{side}"))


def _modern_attention(X, weights: AttentionWeights, blocked, memory, rotary, rotary_interleaved, scale, dead):
    """:func:`attention_forward` with the heads batched, as modern models compute it, ``(B, L, d_out)``."""
    B, L, _ = X.shape
    n_heads = weights.n_heads
    X_kv = X if memory is None else memory
    L_kv = X_kv.shape[1]
    H_kv = n_heads if weights.n_kv_heads is None else weights.n_kv_heads
    W_Q, W_K, W_V, b_Q, b_K, b_V = weights.W_Q, weights.W_K, weights.W_V, weights.b_Q, weights.b_K, weights.b_V
    d_K, d_V = W_Q.shape[1] // n_heads, W_V.shape[1] // H_kv
    q = (X @ W_Q + (0 if b_Q is None else b_Q)).reshape(B, L, n_heads, d_K).transpose(1, 2)  # (B, H, L, d_K)
    k = (X_kv @ W_K + (0 if b_K is None else b_K)).reshape(B, L_kv, H_kv, d_K).transpose(1, 2)  # (B, H_kv, L_kv, d_K)
    v = (X_kv @ W_V + (0 if b_V is None else b_V)).reshape(B, L_kv, H_kv, d_V).transpose(1, 2)  # (B, H_kv, L_kv, d_V)
    if weights.qk_norm is not None:
        q, k = qk_norm(q, weights.qk_norm, "q"), qk_norm(k, weights.qk_norm, "k")
    if rotary is not None:
        cos, sin = (t if t.ndim == 3 else t[None] for t in rotary)
        q, k = rope(q, cos, sin, rotary_interleaved), rope(k, cos, sin, rotary_interleaved)
    k = k.repeat_interleave(n_heads // H_kv, dim=1)  # (B, H, L_kv, d_K): query head h reads kv head h // G
    v = v.repeat_interleave(n_heads // H_kv, dim=1)
    s = 1.0 / math.sqrt(d_K) if scale is None else scale
    T = q @ k.transpose(-1, -2) * s  # (B, H, L, L_kv)
    A = torch.softmax(T.masked_fill(blocked[:, None], float("-inf")), dim=-1)
    if dead is not None:
        A = A.masked_fill(dead[:, None, :, None], 0.0)
    out = (A @ v).transpose(1, 2).reshape(B, L, n_heads * d_V)
    if weights.W_O is not None:
        out = out @ weights.W_O
    return out + (0 if weights.b_O is None else weights.b_O)


# ---- dense blocks -----------------------------------------------------------------------------------------------


def self_attention_blocks(
    X: Tensor, weights: AttentionWeights, *, loss: OutputLoss, structure: AttentionStructure | None = None
) -> dict[str, Tensor]:
    """Dense Hessian blocks of a single-head self-attention layer, by ``torch.func``.

    The layer is :math:`F = \\mathrm{softmax}_{\\text{row}}(X W_Q W_K^\\top X^\\top / \\sqrt{d_K}) X W_V`,
    with future keys set to :math:`-\\infty` when ``causal`` and padded keys when ``key_padding_mask``
    says so. Losses as in the package docstring.

    Args:
        X: input, ``(L, d)`` or ``(B, L, d)``.
        weights: ``W_Q`` ``(d, d_K)``, ``W_K`` ``(d, d_K)``, ``W_V`` ``(d, d_V)``; one head, nothing else.
        loss: ``target`` (``(L, d_V)`` or ``(B, L, d_V)``; squared-error loss, mean over the batch) or
            ``grad_output`` (same shape; surrogate loss, summed over the batch) with ``output_curvature``
            (default ``2 / (L d_V)``).
        structure: ``causal`` and ``key_padding_mask`` ``(B, L)`` bool (``(L,)`` for an unbatched ``X``), True =
            padded: padded keys are never attended to and padded query rows are dropped from the loss; nothing
            else. ``None``: neither.

    Returns:
        ``{part}/{XY}`` for part in ``outer, functional, hessian`` and XY in ``VV, QQ, KK, VQ, VK, QK``,
        each ``(n_X, n_Y)`` with ``n_V = d d_V``, ``n_Q = n_K = d d_K``; plus ``{part}/QKV``, the full
        ``(2 d d_K + d d_V)``-square matrix in block order Q, K, V.

    Raises:
        ValueError: on inconsistent shapes, dtypes or masks, options beyond one plain head, or unless exactly one
            of ``target`` and ``grad_output`` is given.

    Example:
        >>> X = torch.randn(3, 4, dtype=torch.float64)
        >>> W_Q, W_K, W_V = (torch.randn(4, 2, dtype=torch.float64) for _ in range(3))
        >>> out = self_attention_blocks(X, AttentionWeights(W_Q, W_K, W_V),
        ...                             loss=OutputLoss(target=torch.zeros(3, 2, dtype=torch.float64)))
        >>> out["hessian/VQ"].shape, out["outer/QKV"].shape
        (torch.Size([8, 8]), torch.Size([24, 24]))
    """
    loss = check_loss(loss)
    structure = AttentionStructure() if structure is None else structure
    plain = AttentionStructure(causal=structure.causal, key_padding_mask=structure.key_padding_mask)
    extra = [f.name for f in dataclasses.fields(weights) if f.name not in ("W_Q", "W_K", "W_V", "n_heads")
             and getattr(weights, f.name) is not None]  # fmt: skip
    extra += [f.name for f in dataclasses.fields(plain) if getattr(structure, f.name) is not getattr(plain, f.name)]
    if extra or weights.n_heads != 1:
        raise ValueError(
            f"Invalid self_attention_blocks options {extra} (n_heads={weights.n_heads}): it takes one plain head; "
            "use multi_head_attention_blocks."
        )
    W_Q, W_K, W_V = weights.W_Q, weights.W_K, weights.W_V
    Xb, batched = as_batched("X", X)
    B, L, d = Xb.shape
    if not isinstance(W_Q, Tensor) or W_Q.ndim != 2:
        raise ValueError(f"Invalid W_Q: expected a (d, d_K) = ({d}, d_K) tensor, got {describe(W_Q)}.")
    if not isinstance(W_V, Tensor) or W_V.ndim != 2:
        raise ValueError(f"Invalid W_V: expected a (d, d_V) = ({d}, d_V) tensor, got {describe(W_V)}.")
    check_tensor("W_Q", W_Q, (d, W_Q.shape[1]), Xb)
    check_tensor("W_K", W_K, tuple(W_Q.shape), Xb)
    check_tensor("W_V", W_V, (d, W_V.shape[1]), Xb)
    padded = batched_mask("key_padding_mask", structure.key_padding_mask, B, L, batched)
    blocked = blocked_logits(B, L, structure.causal, padded, Xb.device)
    keep = None if padded is None else ~padded

    def forward(V: Tensor, Q: Tensor, K: Tensor) -> Tensor:
        return attention_head(Xb, Q, K, V, blocked)

    mats = dense_blocks(forward, {"V": W_V, "Q": W_Q, "K": W_K}, lambda F0: output_loss(F0, keep, loss, batched))
    return {**pair_keys(mats, ATTENTION_PAIRS), **full_matrix(mats, ("Q", "K", "V"))}


def multi_head_attention_blocks(
    X: Tensor, weights: AttentionWeights, *, loss: OutputLoss, structure: AttentionStructure | None = None
) -> dict[str, Tensor]:
    """Per-head dense Hessian blocks of multi-head attention, by ``torch.func``.

    :math:`F = \\mathrm{concat}_h(A_h (X W_V^h + b_V^h)) W_O + b_O` with
    :math:`A_h = \\mathrm{softmax}((X W_Q^h + b_Q^h)(X W_K^h + b_K^h)^\\top / \\sqrt{d_K})`. For each head
    ``h`` the blocks are those of that head's own slices ``W_V^h, W_Q^h, W_K^h`` (the diagonal head
    blocks of the full Hessian); pairs between different heads are not computed. Losses as in the
    package docstring with output width ``m = d_out``.

    Args:
        X: input, ``(L, d)`` or ``(B, L, d)``.
        weights: ``W_Q`` ``(d, H d_K)`` (head ``h`` owns columns ``h d_K:(h+1) d_K``), ``W_K`` ``(d_kv, H_kv d_K)``,
            ``W_V`` ``(d_kv, H_kv d_V)``, ``W_O`` ``(H d_V, d_out)`` (head ``h`` owns rows ``h d_V:(h+1) d_V``),
            ``n_heads`` ``H``, ``n_kv_heads`` ``H_kv`` (grouped-query attention: query head ``h`` reads kv head
            ``h // (H / H_kv)``; ``None``: ``H``), optional biases ``b_Q`` ``(H d_K,)``, ``b_K`` ``(H_kv d_K,)``,
            ``b_V`` ``(H_kv d_V,)``, ``b_O`` ``(d_out,)`` and ``qk_norm`` (applied per head to the queries and keys
            before the rotary embedding), as the kernels take them.
        loss: ``target`` (``(L, d_out)`` or ``(B, L, d_out)``) or ``grad_output`` with ``output_curvature``
            (default ``2 / (L d_out)``).
        structure: ``causal``; ``key_padding_mask`` ``(B, L)`` bool, True = padded (with ``memory`` it only drops
            query rows from the loss); ``window`` ``w`` (key ``j`` visible to query ``i`` iff ``i - w < j <= i``
            causal, ``|i - j| < w`` otherwise); ``scale`` (default ``1/sqrt(d_K)``); ``rotary`` ``(cos, sin)``, each
            ``(L, r)`` or ``(B or 1, L, r)``, and ``rotary_interleaved``; ``memory`` ``(B, L_kv, d_kv)`` and
            ``memory_padding_mask`` ``(B, L_kv)``. A query row that sees no key has zero attention.

    Returns:
        ``{part}/{XY}/h{i}`` for part in ``outer, functional, hessian``, XY in ``VV, QQ, KK, VQ, VK, QK`` and every
        head ``i``; plus ``{part}/QKV/h{i}`` (block order Q, K, V). With a ``qk_norm`` that has parameters,
        ``{part}/N1N1``, ``{part}/N2N2``, ``{part}/N1N2`` (no head suffix): the blocks of the query norm's parameters
        ``N1 = [weight_q; bias_q]`` (those it has, ``(p, d_K)`` in vec_r order) and the key norm's ``N2``, each
        shared by every head. With ``H_kv < H`` the blocks with a query weight stay per query head (``QQ/h{i}``;
        ``VQ/h{i}`` and ``QK/h{i}`` pair head ``i``'s ``W_Q`` with its group's ``W_V``, ``W_K``), those of ``W_K``,
        ``W_V`` alone are per kv group (``KK/g{j}``, ``VV/g{j}``, ``VK/g{j}``), and ``QKV/g{j}`` is group ``j``'s
        whole Hessian in block order ``Q`` (its query heads in order), ``K``, ``V``.

    Raises:
        ValueError: on inconsistent shapes, dtypes, masks or ``n_heads``, or unless exactly one of
            ``target`` and ``grad_output`` is given.

    Example:
        >>> X = torch.randn(3, 4, dtype=torch.float64)
        >>> W_Q, W_K, W_V = (torch.randn(4, 4, dtype=torch.float64) for _ in range(3))
        >>> weights = AttentionWeights(W_Q, W_K, W_V, torch.eye(4, dtype=torch.float64), n_heads=2)
        >>> out = multi_head_attention_blocks(X, weights, loss=OutputLoss(grad_output=torch.ones(3, 4).double()))
        >>> out["outer/QQ/h1"].shape
        torch.Size([8, 8])
    """
    loss = check_loss(loss)
    structure = AttentionStructure() if structure is None else structure
    Xb, batched = as_batched("X", X)
    plain = AttentionStructure(causal=structure.causal, key_padding_mask=structure.key_padding_mask)
    modern = (
        weights.n_kv_heads is not None
        or weights.qk_norm is not None
        or any(getattr(structure, f.name) is not getattr(plain, f.name) for f in dataclasses.fields(plain))
    )
    if modern:
        return _modern_attention_blocks(Xb, batched, weights, loss, structure)
    return _head_blocks(Xb, batched, weights, loss, structure)


def _head_blocks(Xb: Tensor, batched: bool, weights: AttentionWeights, loss: OutputLoss, structure) -> dict:
    """:func:`multi_head_attention_blocks` of plain multi-head attention: one dense Hessian per head."""
    B, L, d = Xb.shape
    W_Q, W_K, W_V, W_O, n_heads = weights.W_Q, weights.W_K, weights.W_V, weights.W_O, weights.n_heads
    d_K, d_V = check_heads(d, W_Q, W_K, W_V, n_heads, Xb)
    if not isinstance(W_O, Tensor) or W_O.ndim != 2:
        raise ValueError(f"Invalid W_O: expected a (H d_V, d_out) tensor, got {describe(W_O)}.")
    check_tensor("W_O", W_O, (n_heads * d_V, W_O.shape[1]), Xb)
    check_tensor("b_Q", weights.b_Q, (n_heads * d_K,), Xb)
    check_tensor("b_K", weights.b_K, (n_heads * d_K,), Xb)
    check_tensor("b_V", weights.b_V, (n_heads * d_V,), Xb)
    check_tensor("b_O", weights.b_O, (W_O.shape[1],), Xb)
    padded = batched_mask("key_padding_mask", structure.key_padding_mask, B, L, batched)
    blocked = blocked_logits(B, L, structure.causal, padded, Xb.device)
    keep = None if padded is None else ~padded

    out: dict[str, Tensor] = {}
    for h in range(n_heads):

        def forward(V: Tensor, Q: Tensor, K: Tensor, h: int = h) -> Tensor:
            head = dataclasses.replace(weights, W_Q=with_columns(W_Q, Q, h * d_K), W_K=with_columns(W_K, K, h * d_K),
                                       W_V=with_columns(W_V, V, h * d_V))  # fmt: skip
            return attention_forward(Xb, head, blocked)

        head_blocks = {
            "V": W_V[:, h * d_V : (h + 1) * d_V],
            "Q": W_Q[:, h * d_K : (h + 1) * d_K],
            "K": W_K[:, h * d_K : (h + 1) * d_K],
        }
        mats = dense_blocks(forward, head_blocks, lambda F0: output_loss(F0, keep, loss, batched))
        out.update(pair_keys(mats, ATTENTION_PAIRS, f"/h{h}"))
        out.update(full_matrix(mats, ("Q", "K", "V"), f"/h{h}"))
    return out


def _modern_attention_blocks(
    Xb: Tensor, batched: bool, weights: AttentionWeights, loss: OutputLoss, structure: AttentionStructure
) -> dict[str, Tensor]:
    """:func:`multi_head_attention_blocks` with the modern options: one dense Hessian per kv group."""
    B, L, d = Xb.shape
    mem, weights = _checked_modern(Xb, batched, weights, structure)
    H, H_kv = weights.n_heads, weights.n_kv_heads
    G = H // H_kv
    L_kv = L if mem is None else mem.shape[1]
    padded = batched_mask("key_padding_mask", structure.key_padding_mask, B, L, batched)
    mem_padded = None
    if mem is not None:
        mem_padded = batched_mask("memory_padding_mask", structure.memory_padding_mask, B, L_kv, batched)
    key_pad = padded if mem is None else mem_padded
    blocked, dead = attention_blocked(B, L, L_kv, structure.causal, structure.window, key_pad, Xb.device)
    keep = None if padded is None else ~padded
    opts = dict(memory=mem, rotary=structure.rotary, rotary_interleaved=structure.rotary_interleaved,
                scale=structure.scale, dead=dead)  # fmt: skip

    def make_loss(F0: Tensor):
        return output_loss(F0, keep, loss, batched)

    out: dict[str, Tensor] = {}
    for j in range(H_kv):
        out.update(_group_blocks(Xb, weights, j, G, blocked, opts, make_loss))
    if weights.qk_norm is not None:

        def with_norm(norm: Mapping) -> Tensor:
            return attention_forward(Xb, dataclasses.replace(weights, qk_norm=norm), blocked, **opts)

        out.update(qk_norm_parameter_blocks(weights.qk_norm, with_norm, make_loss))
    return out


def _checked_modern(Xb: Tensor, batched: bool, weights: AttentionWeights, structure: AttentionStructure):
    """``(memory (B, L_kv, d_kv) or None, weights with n_kv_heads set)``, every shape checked."""
    B, L, d = Xb.shape
    n_heads, n_kv_heads = weights.n_heads, weights.n_kv_heads
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"Invalid n_heads={n_heads!r}. Must be an int >= 1.")
    H_kv = n_heads if n_kv_heads is None else n_kv_heads
    if isinstance(H_kv, bool) or not isinstance(H_kv, int) or H_kv < 1 or n_heads % H_kv:
        raise ValueError(f"Invalid n_kv_heads={n_kv_heads!r}. Must be an int >= 1 dividing n_heads={n_heads}.")
    mem = None
    if structure.memory is not None:
        mem, mem_batched = as_batched("memory", structure.memory)
        if mem_batched != batched or mem.shape[0] != B:
            raise ValueError(
                f"Invalid memory shape {tuple(structure.memory.shape)}. It must be batched like X ({B} sequences)."
            )
        check_tensor("memory", mem, tuple(mem.shape), Xb)
    d_kv = d if mem is None else mem.shape[2]
    W_Q, W_K, W_V, W_O = weights.W_Q, weights.W_K, weights.W_V, weights.W_O
    for name, W, rows in (("W_Q", W_Q, d), ("W_K", W_K, d_kv), ("W_V", W_V, d_kv), ("W_O", W_O, None)):
        if not isinstance(W, Tensor) or W.ndim != 2 or (rows is not None and W.shape[0] != rows):
            raise ValueError(f"Invalid {name}: expected a ({rows}, heads * width) tensor, got {describe(W)}.")
        check_tensor(name, W, tuple(W.shape), Xb)
    if W_Q.shape[1] % n_heads or W_K.shape[1] % H_kv or W_V.shape[1] % H_kv:
        raise ValueError("Invalid widths: W_Q must split into n_heads heads, W_K and W_V into n_kv_heads heads.")
    d_K, d_V = W_Q.shape[1] // n_heads, W_V.shape[1] // H_kv
    if W_K.shape[1] != H_kv * d_K or W_O.shape[0] != n_heads * d_V:
        raise ValueError(
            f"Invalid W_K {tuple(W_K.shape)} or W_O {tuple(W_O.shape)}: expected ({d_kv}, {H_kv * d_K}) and "
            f"({n_heads * d_V}, d_out)."
        )
    for name, b, n in (("b_Q", weights.b_Q, n_heads * d_K), ("b_K", weights.b_K, H_kv * d_K),
                       ("b_V", weights.b_V, H_kv * d_V), ("b_O", weights.b_O, W_O.shape[1])):  # fmt: skip
        check_tensor(name, b, (n,), Xb)
    rotary = structure.rotary
    if rotary is not None:
        if mem is not None:
            raise ValueError("rotary applies to self-attention only.")
        if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2):
            raise ValueError("Invalid rotary: expected a (cos, sin) pair of tensors.")
        for t in rotary:
            if t.ndim not in (2, 3) or t.shape[-2] != L or t.shape[-1] % 2 or t.shape[-1] > d_K:
                raise ValueError(f"Invalid rotary table shape {tuple(t.shape)}. Expected (L, r) or (B, L, r).")
    return mem, dataclasses.replace(weights, n_kv_heads=H_kv)


def _group_blocks(Xb, weights: AttentionWeights, j: int, G: int, blocked, opts: dict, make_loss) -> dict:
    """The blocks of kv group ``j``'s weights (its ``G`` query heads, its ``W_K``, ``W_V`` slices): per query head
    ``QQ``, ``VQ``, ``QK`` (``/h{i}``), per group ``VV``, ``KK``, ``VK`` and ``QKV`` (``/g{j}``; ``/h{j}`` with
    ``G = 1``)."""
    H, H_kv = weights.n_heads, weights.n_kv_heads
    W_Q, W_K, W_V = weights.W_Q, weights.W_K, weights.W_V
    d_K, d_V = W_Q.shape[1] // H, W_V.shape[1] // H_kv
    q_names = ["Q"] if G == 1 else [f"Q{s}" for s in range(G)]

    def forward(V: Tensor, *rest: Tensor) -> Tensor:
        *Qs, K = rest
        Wq = W_Q
        for s, Q in enumerate(Qs):
            Wq = with_columns(Wq, Q, (j * G + s) * d_K)
        group = dataclasses.replace(weights, W_Q=Wq, W_K=with_columns(W_K, K, j * d_K),
                                    W_V=with_columns(W_V, V, j * d_V))  # fmt: skip
        return attention_forward(Xb, group, blocked, **opts)

    group_blocks = {"V": W_V[:, j * d_V : (j + 1) * d_V]}
    group_blocks.update((nm, W_Q[:, (j * G + s) * d_K : (j * G + s + 1) * d_K]) for s, nm in enumerate(q_names))
    group_blocks["K"] = W_K[:, j * d_K : (j + 1) * d_K]
    mats = dense_blocks(forward, group_blocks, make_loss)
    g_suffix = f"/h{j}" if G == 1 else f"/g{j}"
    out: dict[str, Tensor] = {}
    for part in PARTS:
        for X_, Y_ in (("V", "V"), ("K", "K"), ("V", "K")):
            out[f"{part}/{X_}{Y_}{g_suffix}"] = mats[part][X_, Y_]
        for s, nm in enumerate(q_names):
            h = j * G + s
            for pair, (X_, Y_) in (("QQ", (nm, nm)), ("VQ", ("V", nm)), ("QK", (nm, "K"))):
                out[f"{part}/{pair}/h{h}"] = mats[part][X_, Y_]
        order = [*q_names, "K", "V"]
        out[f"{part}/QKV{g_suffix}"] = torch.cat(
            [torch.cat([mats[part][X_, Y_] for Y_ in order], dim=1) for X_ in order], dim=0
        )
    return out


def qk_norm_parameter_blocks(
    norm: Mapping,
    forward: Callable[[Mapping], Tensor],
    make_loss: Callable[[Tensor], tuple[Callable[[Tensor], Tensor], Tensor]],
) -> dict[str, Tensor]:
    """``{part}/N1N1``, ``{part}/N2N2``, ``{part}/N1N2``: the blocks of the QK-norm's own parameters.

    ``N1`` is the query norm's ``[weight_q; bias_q]`` (the entries ``norm`` has, stacked as rows, vec_r order),
    ``N2`` the key norm's; ``forward`` maps a ``qk_norm`` dict to the attention output. A norm with neither weight
    nor bias has no block.
    """
    entries = {s: [e for e in ("weight", "bias") if norm.get(f"{e}_{s}") is not None] for s in ("q", "k")}
    sides = {name: side for name, side in (("N1", "q"), ("N2", "k")) if entries[side]}
    blocks = {name: torch.stack([norm[f"{e}_{side}"] for e in entries[side]]) for name, side in sides.items()}
    if not blocks:
        return {}

    def of_parameters(*params: Tensor) -> Tensor:
        new = dict(norm)
        for name, p in zip(blocks, params, strict=True):
            new.update({f"{e}_{sides[name]}": p[i] for i, e in enumerate(entries[sides[name]])})
        return forward(new)

    mats = dense_blocks(of_parameters, blocks, make_loss)
    pairs = [(X_, Y_) for X_, Y_ in (("N1", "N1"), ("N2", "N2"), ("N1", "N2")) if X_ in blocks and Y_ in blocks]
    return pair_keys(mats, pairs)


def check_heads(d: int, W_Q, W_K, W_V, n_heads: int, like: Tensor) -> tuple[int, int]:
    """Validate packed attention weights and ``n_heads``; return per-head ``(d_K, d_V)``."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"Invalid n_heads={n_heads!r}. Must be an int >= 1.")
    for name, W in (("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
        if not isinstance(W, Tensor) or W.ndim != 2:
            raise ValueError(f"Invalid {name}: expected a ({d}, H * width) tensor, got {describe(W)}.")
    check_tensor("W_Q", W_Q, (d, W_Q.shape[1]), like)
    check_tensor("W_K", W_K, tuple(W_Q.shape), like)
    check_tensor("W_V", W_V, (d, W_V.shape[1]), like)
    for name, W in (("W_Q", W_Q), ("W_V", W_V)):
        if W.shape[1] % n_heads != 0 or W.shape[1] == 0:
            raise ValueError(
                f"Invalid {name} width {W.shape[1]} for n_heads={n_heads}. The width must be a positive "
                f"multiple of n_heads (head h owns columns h*width:(h+1)*width)."
            )
    return W_Q.shape[1] // n_heads, W_V.shape[1] // n_heads
