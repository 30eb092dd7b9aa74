"""Small dense linear algebra of the kernels: products with a shared factor and exact spectral norms."""

from __future__ import annotations

import torch

from .choices import for_device

__all__ = [
    "SQUARINGS",
    "SQUARING_TOL",
    "gram_lambda_max",
    "shared_times",
    "spectral_norm_2d",
    "times_shared",
    "top_by_squaring",
    "top_pair_by_squaring",
]


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

    That is ``||M||_2^2`` (before the ``clamp_min(0)`` that round-off may need). The Gram matrices of all batches
    that have the same size go through one call: on the host one ``eigvalsh`` (exact to round-off; its fixed cost per
    call is comparable to the work of a small matrix, and the bound terms need many small norms), on a GPU
    :func:`top_by_squaring` (matmuls only: a dense eigen-decomposition there costs milliseconds whatever its size and
    reads its error flag on the host), as :class:`~.choices.SolverChoices`'s ``top_by_squaring`` says.

    Returns:
        One ``(...)`` tensor per argument, in order.
    """
    grams = []
    for M in Ms:
        p, q = M.shape[-2:]
        G = M.mT @ M if q <= p else M @ M.mT  # (..., k, k), k = min(p, q)
        grams.append(G.reshape(-1, *G.shape[-2:]))  # (n_i, k, k)
    squaring = bool(Ms) and for_device(Ms[0].device).top_by_squaring
    lam: list[torch.Tensor] = [None] * len(Ms)  # type: ignore[list-item]
    for k in dict.fromkeys(G.shape[-1] for G in grams):  # one call per Gram size, in first-seen order
        idx = [i for i, G in enumerate(grams) if G.shape[-1] == k]
        G = grams[idx[0]] if len(idx) == 1 else torch.cat([grams[i] for i in idx])  # (sum n_i, k, k)
        # G is symmetric: G^T is a view already in the column-major layout LAPACK works in (no transposing copy)
        top = top_by_squaring(G) if squaring else torch.linalg.eigvalsh(G.mT)[:, -1]  # (sum n_i,)
        for i, t in zip(idx, top.split([grams[i].shape[0] for i in idx]), strict=True):
            lam[i] = t.reshape(Ms[i].shape[:-2])
    return lam


#: Squarings of :func:`top_by_squaring`: ``G^(2^14)``'s column is within ``SQUARING_TOL`` of the top eigenvector's
#: eigenvalue for Grams of up to 8,000 rows, whatever their spectrum.
SQUARINGS = 14
#: The most :func:`top_by_squaring` may fall short of ``lambda_max``, relative, in exact arithmetic (with
#: :data:`SQUARINGS`; the tests measure round-off-level errors on random and clustered spectra).
SQUARING_TOL = 1e-3


def top_by_squaring(G: torch.Tensor, squarings: int = SQUARINGS) -> torch.Tensor:
    """``lambda_max`` of each symmetric positive semi-definite ``G`` ``(n, k, k)`` from matmuls alone: ``(n,)``.

    ``M = G^p`` with ``p = 2^squarings`` by repeated squaring (rescaled to unit trace every third squaring: the top
    eigenvalue of a unit-trace matrix is at least ``1/k``, so three squarings leave it above ``k^-8``, ``6e-32`` for
    ``k = 8000`` where float32's smallest normal number is ``1.2e-38``; no entry exceeds 1), then the Rayleigh
    quotient ``x^T G x / x^T x`` of ``x`` = the column ``j`` of ``M`` with the largest diagonal entry. A Rayleigh
    quotient never exceeds ``lambda_max``. It falls short by at most :data:`SQUARING_TOL` relative (in exact
    arithmetic, for ``k <= 8000``): with ``lambda_max = 1``, ``M_jj >= tr(M) / k >= 1/k``, of which the eigenvectors
    more than ``delta`` below the top hold at most ``(1 - delta)^p``; so they carry at most a ``(k (1 - delta)^p)^2``
    share of ``|x|^2``, ``4e-7`` at ``delta = 1e-3``, ``p = 2^14``, ``k = 8000``, and the quotient is at least ``1 -
    delta`` less that share. In float32 the squarings act as a perturbed power iteration (the quotient is taken with
    ``G`` itself): the tests measure errors of round-off size, below float32 ``eigvalsh``'s, but where two top
    eigenvalues are closer than :data:`SQUARING_TOL` (the quotient lies between them). No host sync, about 45
    dispatched operators per call and ``2 squarings k^3`` FLOPs per matrix.

    Example:
        >>> G = torch.diag(torch.tensor([3.0, 1.0, 2.0]))[None]
        >>> top_by_squaring(G)
        tensor([3.])
    """
    return top_pair_by_squaring(G, squarings)[0]


def top_pair_by_squaring(G: torch.Tensor, squarings: int = SQUARINGS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`top_by_squaring` and its vector: ``(lambda (n,), u (n, k))``, ``u`` of unit norm, in the span of the
    eigenvectors within :data:`SQUARING_TOL` of the top but for a ``1e-6`` share (the column of ``G^p``), where an
    eigen-decomposition's top eigenvector is wanted (its sign is arbitrary, as there).

    Example:
        >>> lam, u = top_pair_by_squaring(torch.tensor([[[2.0, 1.0], [1.0, 2.0]]]))
        >>> lam.round(decimals=4), u.abs()
        (tensor([3.]), tensor([[0.7071, 0.7071]]))
    """
    tiny = torch.finfo(G.dtype).tiny

    def unit_trace(M: torch.Tensor) -> torch.Tensor:
        return M / M.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True).clamp_min_(tiny).unsqueeze(-1)

    M = unit_trace(G)
    for s in range(squarings):
        M = torch.bmm(M, M)
        if s % 3 == 2:
            M = unit_trace(M)
    j = M.diagonal(dim1=-2, dim2=-1).argmax(-1)  # (n,)
    x = torch.take_along_dim(M, j[:, None, None], -1)  # (n, k, 1), a column (M is symmetric)
    x = x / torch.linalg.vector_norm(x, dim=-2, keepdim=True).clamp_min_(tiny)  # its norm is at least 1/k
    return torch.linalg.vecdot(x, torch.bmm(G, x), dim=-2).squeeze(-1), x.squeeze(-1)
