"""Small dense linear algebra of the kernels: products with a shared factor and exact spectral norms."""

from __future__ import annotations

import torch

__all__ = ["gram_lambda_max", "shared_times", "spectral_norm_2d", "times_shared"]


def shared_times(S: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """``S @ T_i`` for every row ``i``: a shared ``S`` ``(p, q)`` (any strides) and rows ``T`` ``(n, q, r)`` ->
    ``(n, p, r)``, as one ``bmm`` on ``S`` expanded over the rows (no copy): two dispatched operators where ``S @ T``
    (a broadcasting matmul) dispatches seven or eight, the same numbers (the same ``bmm``)."""
    return torch.bmm(S.expand(T.shape[0], *S.shape), T)


def times_shared(T: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``T_i @ S`` for rows ``T`` ``(n, p, q)`` and a shared ``S`` ``(q, r)``, as :func:`shared_times`."""
    return torch.bmm(T, S.expand(T.shape[0], *S.shape))


def spectral_norm_2d(M: torch.Tensor) -> torch.Tensor:
    """Largest singular value of each matrix in a batch ``(..., p, q)`` (exact, via the smaller Gram)."""
    return gram_lambda_max(M)[0].clamp_min(0).sqrt()


def gram_lambda_max(*Ms: torch.Tensor) -> list[torch.Tensor]:
    """``lambda_max`` of the smaller Gram matrix of each matrix in the batches ``Ms[i]`` ``(..., p_i, q_i)``.

    That is ``||M||_2^2`` (exact, before the ``clamp_min(0)`` that round-off may need). The Gram matrices
    of all batches that have the same size go through one ``eigvalsh`` call: on CPU its fixed cost per call
    is comparable to the work of a small matrix, and the bound terms need many small norms.

    Returns:
        One ``(...)`` tensor per argument, in order.
    """
    grams = []
    for M in Ms:
        p, q = M.shape[-2:]
        G = M.mT @ M if q <= p else M @ M.mT  # (..., k, k), k = min(p, q)
        grams.append(G.reshape(-1, *G.shape[-2:]))  # (n_i, k, k)
    lam: list[torch.Tensor] = [None] * len(Ms)  # type: ignore[list-item]
    for k in dict.fromkeys(G.shape[-1] for G in grams):  # one eigvalsh per Gram size, in first-seen order
        idx = [i for i, G in enumerate(grams) if G.shape[-1] == k]
        G = grams[idx[0]] if len(idx) == 1 else torch.cat([grams[i] for i in idx])  # (sum n_i, k, k)
        # G is symmetric: G^T is a view already in the column-major layout LAPACK works in (no transposing copy)
        top = torch.linalg.eigvalsh(G.mT)[:, -1]  # (sum n_i,)
        for i, t in zip(idx, top.split([grams[i].shape[0] for i in idx]), strict=True):
            lam[i] = t.reshape(Ms[i].shape[:-2])
    return lam
