"""The sampled Gauss-Newton block through the samples' Gram matrix: its columns, Gram matrices and top eigenpairs.

With the sampled output curvature ``C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T`` the Gauss-Newton block of a weight
``X`` is ``J_X^T C J_X = A A^T / k`` with the columns ``A_{jb} = J_X^T sigma_{j,b}``: its nonzero eigenvalues are
those of the ``k B x k B`` Gram matrix ``A^T A / k``. Where ``k B`` is small this gives the ``ggn/...`` keys exactly,
one operator product per column, instead of Lanczos runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .choices import for_device
from .debiasing import has_shares
from .linalg import top_pair_by_squaring
from .operator import BlockOperator, Embedding, pair_matvec
from .sampled import SampledCurvature, with_sampled

__all__ = ["GRAM_CHUNK", "Columns", "gram_columns", "gram_eigen", "gram_matrices"]

#: Columns of the Gram matrix per operator product (as many as the Lanczos runs batch at once: its memory).
GRAM_CHUNK = 16


class Columns:
    """A stand-in output curvature that ignores the tangent: row ``r`` of a batch gets column ``start + r`` of the
    samples, ``r' = j B + b`` -> ``sigma_{j,b}`` on sequence ``b`` (zero on the others), so an operator's outer part
    returns ``J_X^T sigma_{j,b}``, the columns of ``A`` with ``J_X^T C J_X = A A^T / k`` (:func:`gram_eigen`)."""

    def __init__(self, sigma: torch.Tensor, start: int, stop: int):
        self.sigma, self.start, self.stop = sigma, start, stop

    def __call__(self, dF: torch.Tensor, group: int = 1) -> torch.Tensor:
        # whatever ``group``: a kv group's mixing sums the coefficients <sigma, dF> over its heads, and the columns
        # have none (the operator's pull then sums J^T sigma over the heads sharing the weights: the group's column)
        k, B, H, X = self.sigma.shape
        rows = torch.arange(self.start, self.stop, device=self.sigma.device)
        j, b = rows // B, rows % B
        u = torch.zeros((len(rows), B, H, X), dtype=dF.dtype, device=dF.device)
        u[torch.arange(len(rows), device=u.device), b] = self.sigma[j, b].to(dF.dtype)
        return u.reshape(dF.shape)


def gram_columns(
    op: BlockOperator,
    X: str,
    curvature: SampledCurvature,
    view: Callable[[BlockOperator], BlockOperator] = lambda o: o,
) -> torch.Tensor:
    """The columns ``A_{jb} = J_X^T sigma_{j,b}`` of the sampled Gauss-Newton block of ``op`` (``J_X^T C J_X = A
    A^T / k``, ``C`` block-diagonal over the sequences ``b``), ``(H, k B, size)``: column ``j B + b`` of head ``h``
    is ``A[h, j B + b]``. One operator product per column (in chunks of :data:`GRAM_CHUNK`: the outer part of a zero
    tangent with a stand-in curvature that returns the samples), written in place. ``view``: a grouped-query view whose
    ``gram_columns`` hold ``X`` (the grouped-query attention's group view: ``X`` per kv group; its query view: ``Q``
    per query head) or none.
    """
    k, B = curvature.sigma.shape[:2]
    n = k * B
    emb = Embedding(view(op), [X])
    A = torch.empty((emb.H, n, emb.n), dtype=op.dtype, device=op.device)
    for start in range(0, n, GRAM_CHUNK):
        stop = min(n, start + GRAM_CHUNK)
        _, mv = pair_matvec(
            view(with_sampled(op, Columns(curvature.sigma, start, stop))), (X, X), ("outer",) * (stop - start)
        )
        zero = torch.zeros((stop - start, emb.H, emb.n), dtype=op.dtype, device=op.device)
        A[:, start:stop] = mv(zero).transpose(0, 1)  # (H, chunk, size): J_X^T sigma_{j,b}
    return A


def gram_matrices(
    A: torch.Tensor, curvature: SampledCurvature, scales: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """The Gram matrices ``A^T D^2 A / k`` of the sampled Gauss-Newton block ``J_X^T C J_X = A A^T / k`` (and of its
    preconditioned ``D (.) D``), ``(H, k B, k B)`` float64 per entry of ``scales`` (``D`` in the layout of the block's
    tangent rows, None for 1): their nonzero eigenvalues are the block's (:func:`gram_eigen`).

    ``A`` ``(H, k B, size)``: the columns of :func:`gram_columns`. Built a chunk of rows at a time (no scaled copy of
    ``A``)."""
    k = curvature.sigma.shape[0]
    H, n, size = A.shape
    out = []
    for D in scales:
        D2 = None if D is None else D.reshape(-1, 1, size).square()  # (H or 1, 1, size)
        G = torch.empty((H, n, n), dtype=torch.float64, device=A.device)  # (H, k B, k B)
        for start in range(0, n, GRAM_CHUNK):
            stop = min(n, start + GRAM_CHUNK)
            rows = A[:, start:stop] if D2 is None else A[:, start:stop] * D2
            G[:, start:stop] = torch.bmm(rows, A.mT).double() / k
        out.append(G)
    return out


def gram_eigen(
    items: Sequence[tuple],
    curvature: SampledCurvature,
    split: bool,
    dtype: torch.dtype,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The largest eigenvalues of sampled Gauss-Newton blocks from their Gram matrices, all in one batch.

    ``items``: ``(label, G, A, D, ...)`` each (the label and what follows ``D`` are the caller's): ``G`` ``(H, k B, k
    B)`` of :func:`gram_matrices` (all of one ``k B``), ``A`` its columns where the top eigenvectors are wanted (else
    None), ``D`` its scale (None: 1). Per item ``(values, tops)``: ``values`` ``(E, H)`` in ``dtype``: with ``split``
    the full sample and its two halves (``E = 3``, as :meth:`SampledCurvature.halves`), else the full sample only; a
    half's eigenvalues are those of its diagonal block of ``G`` (``j < k/2``, the first ``(k/2) B`` columns) times ``k
    / k_a``. ``tops`` ``(E, H, size)``: the top eigenvector of each estimate's Gauss-Newton block, unnormalised, in
    the layout of ``A``'s rows: ``D A_S u`` for the top eigenvector ``u`` of the estimate's Gram block (columns
    ``S``). With ``split`` and halves of at least 2 samples (:func:`~.debiasing.has_shares`), a third entry ``shares``
    ``(E, k, H)``: sample ``j``'s part of each estimate's value at its top eigenvector
    (:func:`~.debiasing.debias`'s ``shares``), ``lambda_e sum_b u_{j B + b}^2`` (the unit top eigenvector ``v`` of the
    estimate's block ``sum_c w_c (D A_c) (D A_c)^T`` has ``w_c <D A_c, v>^2 = lambda_e u_c^2``); else None.

    Eigenvalues of the Gram matrices (float64) instead of the Lanczos runs of every estimate and preconditioning.
    Every item's matrices go through one call (the halves, when of one size, through a second): ``eigh`` on the host
    (exact), :func:`~.linalg.top_pair_by_squaring` where :class:`~.choices.SolverChoices`'s ``top_by_squaring``
    says (on a GPU, where an ``eigh`` of small matrices costs milliseconds whatever the batch and syncs; at most
    ``SQUARING_TOL`` low). A kernel call has up to three pairs x two preconditionings x three estimates of them
    (:func:`~.sampled_keys.sampled_plan` batches them while the matrices stay within the largest pair's Gram columns:
    all of them at realistic sizes).
    """
    k, B = curvature.sigma.shape[:2]
    _, ka, kb = curvature.counts
    n = items[0][1].shape[-1]
    half = ka * B  # sample j = r // B: the first half's columns come first
    G = items[0][1] if len(items) == 1 else torch.cat([item[1] for item in items])  # (S, k B, k B)
    S = G.shape[0]
    shared = split and has_shares(curvature.counts)
    want = shared or any(item[2] is not None for item in items)  # (the shares need the eigenvectors too)

    squaring = for_device(G.device).top_by_squaring

    def tops_of(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # (top eigenvalues, their vectors)
        if squaring:  # matmuls, no eigh (a GPU's choice: linalg.top_pair_by_squaring)
            lam, u = top_pair_by_squaring(M)
            return lam, u if want else None
        if not want:
            return torch.linalg.eigvalsh(M)[:, -1], None
        lam, U = torch.linalg.eigh(M)
        return lam[:, -1], U[..., -1]

    lam, U = tops_of(G)
    values = [lam]
    vecs = None
    if want:  # every estimate's top eigenvector in the k B columns (zero outside its half): (E, S, k B)
        vecs = torch.zeros((3 if split else 1, S, n), dtype=G.dtype, device=G.device)
        vecs[0] = U
    if split:
        first, second = G[:, :half, :half], G[:, half:, half:]
        if half * 2 == n:  # halves of one size: one call for both
            lam_h, U_h = tops_of(torch.cat([first, second]))
            values += [lam_h[:S] * (k / ka), lam_h[S:] * (k / kb)]
            U_a, U_b = (None, None) if U_h is None else (U_h[:S], U_h[S:])
        else:
            (lam_a, U_a), (lam_b, U_b) = tops_of(first), tops_of(second)
            values += [lam_a * (k / ka), lam_b * (k / kb)]
        if vecs is not None:
            vecs[1, :, :half] = U_a
            vecs[2, :, half:] = U_b
    values = torch.stack(values)  # (E, S) float64
    shares = None
    if shared:  # (E, k, S): lambda_e sum_b u_{j B + b}^2 (zero outside a half's own samples)
        shares = vecs.square().view(3, S, k, B).sum(-1).transpose(1, 2).mul_(values[:, None]).to(dtype)
    values = values.to(dtype)
    out = []
    start = 0
    for _, g, A, D, *_ in items:
        H = g.shape[0]
        top = None
        if A is not None:  # (H, E, k B) @ (H, k B, size): A_S u per estimate
            top = torch.bmm(vecs[:, start : start + H].transpose(0, 1).to(A.dtype), A).transpose(0, 1)
            top = top if D is None else top * D.reshape(-1, A.shape[-1])
        out.append((values[:, start : start + H], top, None if shares is None else shares[..., start : start + H]))
        start += H
    return out


#: The Lanczos members of a debiased key are solved to this fraction of the key's ``tol``. The extrapolation
