"""Tensor layouts of the attention's products: per-head matmuls over tangent rows in one ``bmm`` and few views.

The Lanczos products of :class:`~.operator.AttentionOperator` move tangent rows ``(n, B, H, ...)`` through matmuls
with per-sequence, per-head factors ``(B, H, p, q)``. Each function here does one such product in one ``bmm`` (or
``mm``) with the rows folded beside a matrix dimension, and returns a strided view of the result instead of a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["as_view", "lmul", "per_head", "permuted_copy", "rmul", "unflat", "xtm", "xw"]


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def as_view(t: torch.Tensor, perm: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """``t.permute(perm).reshape(shape)`` in **one** dispatched operator where that is a view (an ``as_strided`` view:
    each dimension of ``shape`` merges consecutive dimensions of the permuted tensor whose strides nest), else a copy in
    two (``permute_copy``, a view), where ``permute`` then ``reshape`` take three.

    The products move tangent rows between the layouts ``(n, B, H, ...)`` and ``(B H, ...)``; each
    permute-then-reshape dispatches two or three operators, and on a GPU a Lanczos product of the attention is bound
    by what the host dispatches. Reading sizes and strides dispatches nothing.
    """
    dims = [(t.shape[i], t.stride(i)) for i in perm if t.shape[i] != 1]  # size-1 dimensions have any stride
    strides = []
    for size in reversed(shape):  # each target dimension takes the innermost permuted dimensions left
        group, inner, nested = 1, 1, None  # sizes taken, the innermost's stride, the stride the next one must have
        while group < size:
            if not dims:
                return permuted_copy(t, perm, shape)
            n, stride = dims.pop()
            if nested is None:
                inner = stride
            elif stride != nested:
                return permuted_copy(t, perm, shape)
            nested, group = stride * n, group * n
        if group != size:
            return permuted_copy(t, perm, shape)
        strides.append(inner)
    if dims:
        return permuted_copy(t, perm, shape)
    return t.as_strided(shape, tuple(reversed(strides)), t.storage_offset())


def permuted_copy(t: torch.Tensor, perm: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """``t.permute(perm).reshape(shape)`` as a contiguous copy: two dispatched operators."""
    return torch.permute_copy(t, perm).view(shape)


def unflat(t: torch.Tensor, memory: Sequence[int], perm: Sequence[int]) -> torch.Tensor:
    """``t.view(memory).permute(perm)`` for a contiguous ``t`` (a matmul's result) in one dispatched operator."""
    strides = _strides(memory)
    return t.as_strided([memory[i] for i in perm], [strides[i] for i in perm], t.storage_offset())


def lmul(S: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """``S @ T`` for a shared ``S`` ``(B, H, p, q)`` and tangent rows ``T`` ``(n, B, H, q, r)`` -> ``(n, B, H, p, r)``.

    One ``bmm`` over ``B H`` with the rows beside ``r`` (``(B H, q, n r)``: a copy of ``T`` at most, never of ``S``):
    a matmul broadcasting ``S`` over ``n`` dispatches ~8 operators and copies ``S`` ``n`` times. The result is a
    permuted view whose memory is ``(B, H, p, n, r)``.
    """
    n, B, H, q, r = T.shape
    p = S.shape[-2]
    S3 = S if S.dim() == 3 else as_view(S, (0, 1, 2, 3), (B * H, p, q))  # (as AttentionOperator._bh)
    out = torch.bmm(S3, as_view(T, (1, 2, 3, 0, 4), (B * H, q, n * r)))
    return unflat(out, (B, H, p, n, r), (3, 0, 1, 2, 4))


def rmul(T: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``T @ S`` for tangent rows ``T`` ``(n, B, H, p, q)`` and a shared ``S`` ``(B, H, q, r)`` -> ``(n, B, H, p, r)``.

    One ``bmm`` over ``B H`` with the rows stacked (``(B H, n p, q)``; no copy when ``T``'s memory is already
    ``(B, H, n, p, q)``, as :func:`rmul`'s results are). The result is a permuted view of ``(B, H, n, p, r)``.
    """
    n, B, H, p, q = T.shape
    r = S.shape[-1]
    S3 = S if S.dim() == 3 else as_view(S, (0, 1, 2, 3), (B * H, q, r))  # (as AttentionOperator._bh)
    out = torch.bmm(as_view(T, (1, 2, 0, 3, 4), (B * H, n * p, q)), S3)
    return unflat(out, (B, H, n, p, r), (2, 0, 1, 3, 4))


def per_head(T: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``T @ M_h`` for tangent rows ``T`` ``(n, B, H, p, q)``, per-head ``M`` ``(H, q, r)`` -> ``(n, B, H, p, r)``."""
    n, B, H, p, q = T.shape
    r = M.shape[-1]
    out = torch.bmm(as_view(T, (2, 0, 1, 3, 4), (H, n * B * p, q)), M)
    return unflat(out, (H, n, B, p, r), (1, 2, 0, 3, 4))


def xw(X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``X W`` for a batch of per-head weights: X ``(B, L, d)``, W ``(n, H, d, k)`` -> ``(n, B, H, L, k)``.

    One ``(B L, d) @ (d, n H k)`` matmul for every tangent and head (a permuted view is returned): no copy of ``X``.
    """
    n, H, d, k = W.shape
    B, L, _ = X.shape
    Y = torch.mm(as_view(X, (0, 1, 2), (B * L, d)), as_view(W, (2, 0, 1, 3), (d, n * H * k)))  # (B L, n H k)
    return unflat(Y, (B, L, n, H, k), (2, 0, 3, 1, 4))


def xtm(X: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``sum_b X_b^T M_b``: X ``(B, L, d)``, M ``(n, B, H, L, k)`` -> ``(n, H, d, k)`` in one matmul over B*L."""
    n, B, H, L, k = M.shape
    d = X.shape[-1]
    out = torch.mm(as_view(X, (2, 0, 1), (d, B * L)), as_view(M, (1, 3, 0, 2, 4), (B * L, n * H * k)))
    return unflat(out, (d, n, H, k), (1, 2, 0, 3))
