"""Batched Lanczos iteration for the largest-magnitude eigenvalue of symmetric matrix-free operators."""

from __future__ import annotations

from collections.abc import Callable

import torch


def lanczos_max_abs(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    batch_shape: tuple[int, ...],
    n: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tol: float = 1e-6,
    max_iter: int | None = None,
    v0: torch.Tensor | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest |eigenvalue| of a batch of symmetric operators, matrix-free.

    Runs Lanczos with full re-orthogonalisation on every operator of the batch at once. A batch member
    stops contributing once its extreme Ritz pair has residual ``|beta_j * s_j| <= tol * |theta|``
    (for a symmetric operator the eigenvalue error is at most that residual), or when its Krylov space is
    exhausted (then the answer is exact up to round-off).

    Args:
        matvec: maps ``(*batch_shape, n)`` to ``(*batch_shape, n)``; member ``b`` applies operator ``b``.
        batch_shape: shape of the batch of independent operators.
        n: dimension of each operator.
        dtype: working dtype.
        device: working device.
        tol: relative residual tolerance on the extreme Ritz value. ``0`` runs to ``max_iter``.
        max_iter: most Lanczos steps (default and upper limit: ``n``).
        v0: optional start vectors ``(*batch_shape, n)`` (warm start), else seeded Gaussian.
        seed: seed of the Gaussian start.

    Returns:
        ``(norm, vec)``: ``norm`` of shape ``batch_shape`` is the largest |eigenvalue| found; ``vec`` of
        shape ``(*batch_shape, n)`` is its Ritz vector (a good warm start for the next call).

    Example:
        >>> M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=torch.float64))
        >>> val, _ = lanczos_max_abs(lambda v: v @ M, (), 3, dtype=torch.float64, device=torch.device("cpu"))
        >>> round(float(val), 6)
        5.0
    """
    if n <= 0:
        return torch.zeros(batch_shape, dtype=dtype, device=device), torch.zeros(
            (*batch_shape, max(n, 0)), dtype=dtype, device=device
        )
    k_max = n if max_iter is None else max(1, min(int(max_iter), n))
    if v0 is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        v = torch.randn((*batch_shape, n), generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    else:
        v = v0.to(dtype=dtype, device=device).clone()
        # a zero warm start (e.g. an exactly-zero block last time) would stall: mix in noise
        gen = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.randn((*batch_shape, n), generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
        v = v + 1e-3 * noise * v.norm(dim=-1, keepdim=True).clamp_min(1.0)
    v = v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)

    # The basis grows one vector per step (no up-front (k_max, ..., n) allocation): (*batch, j, n).
    basis = v.unsqueeze(-2)
    alphas: list[torch.Tensor] = []
    betas: list[torch.Tensor] = []
    active = torch.ones(batch_shape, dtype=torch.bool, device=device)
    eps = torch.finfo(dtype).eps
    theta = torch.zeros(batch_shape, dtype=dtype, device=device)
    ritz = v.clone()
    for j in range(k_max):
        w = matvec(v)
        alpha = (w * v).sum(-1)
        alphas.append(alpha)
        # full re-orthogonalisation against the whole basis (classical Gram-Schmidt, repeated once when
        # it removed a large part of w: "twice is enough")
        norm_before = w.norm(dim=-1)
        coeff = (basis @ w.unsqueeze(-1)).squeeze(-1)  # (*b, j+1)
        w = w - (coeff.unsqueeze(-2) @ basis).squeeze(-2)
        beta = w.norm(dim=-1)
        if bool((beta < 0.5 * norm_before).any()):
            coeff = (basis @ w.unsqueeze(-1)).squeeze(-1)
            w = w - (coeff.unsqueeze(-2) @ basis).squeeze(-2)
            beta = w.norm(dim=-1)
        # eigen-decomposition of the (j+1)x(j+1) tridiagonal matrix of every batch member
        a = torch.stack(alphas, -1)
        T = torch.diag_embed(a)
        if j > 0:
            off = torch.stack(betas, -1)
            T = T + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)
        evals, evecs = torch.linalg.eigh(T)
        idx = evals.abs().argmax(-1, keepdim=True)
        theta = evals.gather(-1, idx).squeeze(-1)
        s_last = evecs[..., -1, :].gather(-1, idx).squeeze(-1)
        scale = a.abs().amax(-1).clamp_min(torch.finfo(dtype).tiny)
        exhausted = beta <= 10 * eps * scale
        converged = (beta * s_last).abs() <= tol * theta.abs()
        active = active & ~(exhausted | converged)
        if not bool(active.any()) or j + 1 == k_max:
            y = evecs.gather(-1, idx.unsqueeze(-2).expand(*evecs.shape[:-1], 1)).squeeze(-1)  # (*b, j+1)
            ritz = (y.unsqueeze(-2) @ basis).squeeze(-2)
            break
        betas.append(torch.where(active, beta, torch.zeros_like(beta)))
        v = torch.where(active.unsqueeze(-1), w / beta.clamp_min(torch.finfo(dtype).tiny).unsqueeze(-1), 0.0)
        basis = torch.cat([basis, v.unsqueeze(-2)], dim=-2)
    return theta.abs(), ritz
