"""Batched Lanczos iteration for the largest-magnitude eigenvalue of symmetric matrix-free operators."""

from __future__ import annotations

from collections.abc import Callable

import torch

# The other end of an indefinite spectrum counts as settled once it could not overtake theta even at
# OVERTAKE_K times its residual. Of 80 random trials with eigenvalues 1 and -0.95 above a cluster in [0, 0.9],
# 7 of the first 60 stopped on -0.95 with K = 1, 1 of 80 with K = 3, none with K = 10; on the attention and
# FFN Hessians tried, K = 10 cost no extra products at L = d = 512 and ~4% more on small blocks.
OVERTAKE_K = 10.0

# Re-orthogonalise a second time when the first Gram-Schmidt pass left less than this fraction of w: Kahan and
# Parlett's 1/sqrt(2) ("twice is enough", Giraud et al. 2005). After one pass w is orthogonal to the basis only up
# to ~eps ||w_before|| / ||w_after||, and that error compounds from step to step. The earlier threshold 0.1 let it
# compound: a 60 x 60 operator with eigenvalues in [0.1, 3] run past convergence (tol=0, 200 steps) returned 21.7 to
# 25.7 instead of 3, and 46 to 90 with max_basis=16, tol=1e-12 (3 seeds); with 1/sqrt(2) all six give 3.0. At the
# monitor's tolerances (1e-3, 1e-2) the runs stop before it shows; the second pass costs one more (k, n) matmul.
REORTH_KAPPA = 0.7071

# Norm of the noise mixed into a warm start, relative to the start vector's norm.
WARM_NOISE = 1e-3

# Off the CPU, the stopping test (a host-device sync) runs every this many Lanczos steps. Not tuned: no GPU
# has been available to measure the sync's cost against the products that a member iterating past its
# convergence spends (on average (CHECK_EVERY_OFF_CPU - 1) / 2 per run).
CHECK_EVERY_OFF_CPU = 2


def lanczos_max_abs(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    batch_shape: tuple[int, ...],
    n: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tol: float = 1e-6,
    max_iter: int | None = None,
    max_basis: int | None = None,
    v0: torch.Tensor | None = None,
    seed: int = 0,
    both_ends: torch.Tensor | bool = True,
    pass_live: bool = False,
    info: dict | None = None,
    algebraic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest |eigenvalue| (``algebraic``: largest eigenvalue) of a batch of symmetric operators, matrix-free.

    Runs Lanczos with full re-orthogonalisation on every operator of the batch at once. A batch member
    stops contributing once its largest-magnitude Ritz value ``theta`` has residual ``|beta_j s_j| <= tol |theta|``
    (for a symmetric operator an eigenvalue lies within that residual) and, where ``both_ends``, the Ritz
    value ``theta_o`` at the other end of the spectrum has too or cannot overtake it
    (``|theta_o| + 10 r_o <= |theta|``), so an indefinite operator does not stop on the wrong end; or when its
    Krylov space is exhausted (then the answer is exact up to round-off). Like every Lanczos stopping rule
    (ARPACK's included) this cannot see an eigenvalue the Krylov space has not reached yet.

    Args:
        matvec: maps ``(*batch_shape, n)`` to ``(*batch_shape, n)``; member ``b`` applies operator ``b``.
        batch_shape: shape of the batch of independent operators.
        n: dimension of each operator.
        dtype: working dtype.
        device: working device.
        tol: relative residual tolerance on the extreme Ritz value. ``0`` runs to ``max_iter``.
        max_iter: most Lanczos steps, i.e. products (default and upper limit: ``n``).
        max_basis: most basis vectors held per member (``>= 4``; default ``max_iter``: none is ever dropped).
            Memory is then ``~1.5 max_basis`` vectors whatever ``max_iter``: when the basis is full the run
            restarts thickly (Wu & Simon 2000), keeping the Ritz vectors of the ``max_basis // 4`` lowest and
            highest Ritz values and the residual direction, and goes on until it converges or ``max_iter``
            products were spent.
        v0: optional start vectors ``(*batch_shape, n)`` (warm start), else seeded Gaussian.
        seed: seed of the Gaussian start.
        both_ends: bool or ``batch_shape`` bool tensor; False where the spectrum is known to be one-sided
            (a Gauss-Newton block, PSD) or symmetric about zero (the ``[[0, B], [B^T, 0]]`` embedding of an
            off-diagonal block), where the largest-magnitude end alone decides.
        pass_live: call ``matvec(v, live)`` instead, ``live`` a CPU bool tensor of shape ``batch_shape``: the
            members still iterating. The others have zero vectors and their output rows must be zero (exactly
            what a linear ``matvec`` returns), so ``matvec`` may skip computing them. Reading ``live`` costs no
            extra host-device sync: the stopping test reads it anyway.
        info: optional dict; receives ``"rel_residual"`` (shape ``batch_shape``): ``|beta_j s_j| / |theta|`` of
            the returned Ritz value when its member stopped. Some eigenvalue lies within that fraction of the
            norm; it is ``<= tol`` where the member converged and larger where ``max_iter`` cut it short (the
            norm may then read low: Ritz values never exceed the largest |eigenvalue|).
        algebraic: follow the largest Ritz value ``theta`` (not the largest in magnitude) and return it with
            its sign: the largest algebraic eigenvalue, e.g. of an indefinite Hessian whose most negative
            eigenvalue is the largest in magnitude. The same stopping test on ``theta`` alone (``both_ends`` is
            ignored: the other end cannot overtake the top one; Ritz values never exceed it); every step
            re-orthogonalises twice.

    Returns:
        ``(norm, vec)``: ``norm`` of shape ``batch_shape`` is the largest |eigenvalue| found (the largest
        eigenvalue with ``algebraic``); ``vec`` of shape ``(*batch_shape, n)`` is its Ritz vector (a good warm
        start for the next call).

    Example:
        >>> M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=torch.float64))
        >>> val, _ = lanczos_max_abs(lambda v: v @ M, (), 3, dtype=torch.float64, device=torch.device("cpu"))
        >>> round(float(val), 6)
        5.0
    """
    if n <= 0:
        if info is not None:
            info["rel_residual"] = torch.zeros(batch_shape, dtype=dtype, device=device)
        return torch.zeros(batch_shape, dtype=dtype, device=device), torch.zeros(
            (*batch_shape, max(n, 0)), dtype=dtype, device=device
        )
    # products at most; without restarts the basis spans the whole space after n of them (then it stops)
    k_max = n if max_iter is None else max(1, int(max_iter))
    cap = min(k_max, n) if max_basis is None else min(k_max, n, int(max_basis))  # basis vectors at most
    if cap >= min(k_max, n):  # room for every vector the run can make: no restarts
        k_max = min(k_max, n)
    elif cap < 4:
        raise ValueError(
            f"Invalid max_basis={max_basis!r}. Must be >= 4 (a restart keeps two Ritz vectors and needs room for "
            "more), or None for no limit."
        )
    if v0 is None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        v = torch.randn((*batch_shape, n), generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    else:
        v = v0.to(dtype=dtype, device=device).clone()
        # a zero warm start (e.g. an exactly-zero block last time) would stall: mix in noise of norm
        # WARM_NOISE * ||v0|| (1 for a zero v0). Per entry it was that size, i.e. sqrt(n) times more: 16% of a
        # unit start vector at n = 24576, which made every other warm start of the same operator as slow as a
        # cold one (the same seeded noise, only half removed by a short run, came back doubled).
        gen = torch.Generator(device="cpu").manual_seed(seed)
        noise = torch.randn((*batch_shape, n), generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
        noise = noise / noise.norm(dim=-1, keepdim=True)
        v = v + WARM_NOISE * noise * v.norm(dim=-1, keepdim=True).clamp_min(1.0)
    v = v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    both = torch.as_tensor(False if algebraic else both_ends, dtype=torch.bool, device=device).expand(batch_shape)

    # The basis grows one vector per step into a buffer: basis = buf[..., :size, :]. On CPU the buffer has
    # room for all its vectors from the start: torch.empty does not touch its pages, so only the vectors
    # written cost memory, and no growth copies the basis (doubling cost 125 ms per run of 20 steps at
    # n = 590k, batch 3). On other devices an allocation is memory at once, so the capacity doubles instead.
    cpu = _on_cpu(device)
    buf = torch.empty((*batch_shape, cap if cpu else min(cap, 8), n), dtype=dtype, device=device)
    buf[..., 0, :] = v
    basis = buf[..., :1, :]
    # The stopping test (eigen-decomposition of the small projected matrix T of every member) runs on the
    # host. On CPU that is where everything is, and it runs every step. Elsewhere reading alpha, beta is a
    # host-device sync, and torch.linalg.eigh on a CUDA tensor syncs too (and pays a solver launch for a tiny
    # matrix), so the test runs every CHECK_EVERY_OFF_CPU steps on a float64 host copy of T, and members that
    # converged in between keep iterating until then (more steps only sharpen their Ritz values).
    check_every = 1 if cpu else CHECK_EVERY_OFF_CPU
    host = torch.device("cpu")
    # T = tridiag(alphas, betas), plus after a thick restart the couplings ``arrow`` (*b, k) of the k kept Ritz
    # vectors with the first new vector (T is then an arrowhead followed by a tridiagonal tail)
    alphas: list[torch.Tensor] = []
    betas: list[torch.Tensor] = []
    arrow: torch.Tensor | None = None
    restarted = False
    active = torch.ones(batch_shape, dtype=torch.bool, device=device)
    live = torch.ones(batch_shape, dtype=torch.bool)  # host copy of ``active``, for ``pass_live``
    both_h = both if cpu else both.cpu()
    eps = torch.finfo(dtype).eps
    theta = torch.zeros(batch_shape, dtype=dtype, device=host)
    rel_residual = torch.zeros(batch_shape, dtype=dtype, device=host)
    ritz = v.clone()
    for j in range(k_max):
        size = basis.shape[-2]  # vectors in the basis, the current one (v) last
        w = matvec(v, live) if pass_live else matvec(v)
        alpha = (w * v).sum(-1)
        alphas.append(alpha)
        # full re-orthogonalisation against the whole basis by classical Gram-Schmidt. A second pass is
        # needed only when the first cancelled most of w (then its rounding errors, ~eps ||w_before||, are
        # large next to what is left): it runs when ||w_after|| < REORTH_KAPPA ||w_before|| for some member.
        # Reading that is a host-device sync, free on CPU; elsewhere both passes always run (no extra sync).
        # With ``algebraic`` both passes always run too: the top of an indefinite spectrum can need many steps,
        # and over them the conditional pass let the basis lose orthogonality geometrically until a ghost Ritz
        # value above the spectrum passed the stopping test (49 for a spectrum in [-5, -0.3], n = 60,
        # max_basis = 8, tol = 1e-10; 80 run to the end with tol = 0: tests/test_lanczos.py).
        w_norm = w.norm(dim=-1) if cpu else None
        w = _project_out(w, basis)
        beta = w.norm(dim=-1)
        if not cpu or algebraic or bool((beta < REORTH_KAPPA * w_norm).any()):
            w = _project_out(w, basis)
            beta = w.norm(dim=-1)
        last = j + 1 == k_max
        full = size == cap and not last  # no room for the next vector: restart (after the test)
        if cpu or last or full or (j + 1) % check_every == 0:
            # eigen-decomposition of the (size x size) projected matrix of every member, on the host
            if cpu:
                a, off, beta_h = torch.stack(alphas, -1), (torch.stack(betas, -1) if size > 1 else None), beta
                arr = arrow
            else:  # one transfer for all of alpha, the betas kept so far, the current beta (and the arrow)
                parts = [*alphas, *betas, beta] if arrow is None else [*alphas, *betas, beta, *arrow.unbind(-1)]
                ab = torch.stack(parts, -1).to(device=host, dtype=torch.float64)
                a, beta_h = ab[..., :size], ab[..., 2 * size - 1]
                off = ab[..., size : 2 * size - 1] if size > 1 else None
                arr = None if arrow is None else ab[..., 2 * size :]
            T = torch.diag_embed(a)
            if off is not None:
                T = T + torch.diag_embed(off, offset=1) + torch.diag_embed(off, offset=-1)
            if arr is not None:  # the kept Ritz vectors 0..k-1 couple to vector k only
                k = arr.shape[-1]
                T[..., :k, k] = arr
                T[..., k, :k] = arr
            evals, evecs = torch.linalg.eigh(T)  # ascending
            idx = (evals if algebraic else evals.abs()).argmax(-1, keepdim=True)
            theta_now = evals.gather(-1, idx).squeeze(-1)
            resid = (beta_h.unsqueeze(-1) * evecs[..., -1, :]).abs()  # residual of every Ritz pair
            # the opposite extreme: the lowest Ritz value when theta is the highest, and vice versa
            opp = torch.where(
                idx == evals.shape[-1] - 1, torch.zeros_like(idx), torch.full_like(idx, evals.shape[-1] - 1)
            )
            scale = a.abs().amax(-1).clamp_min(torch.finfo(dtype).tiny)
            exhausted = beta_h <= 10 * eps * scale
            # converged: theta is accurate to tol and, where both ends matter, the Ritz value at the other end
            # is either accurate too or cannot overtake theta (with an indefinite operator, e.g. eigenvalues 1
            # and -0.95, the isolated smaller end converges first; stopping on it alone returned 0.95 in 15 of
            # 40 trials)
            r_theta = resid.gather(-1, idx).squeeze(-1)
            converged = r_theta <= tol * theta_now.abs()
            # relative residual of the members iterating in this step (a stopped member keeps its last one);
            # r / 0 = inf: a zero Ritz value, unresolved
            rel_now = torch.where(r_theta > 0, r_theta / theta_now.abs(), 0.0).to(dtype)
            rel_residual = torch.where(live, rel_now, rel_residual)
            theta = torch.where(live, theta_now.to(dtype), theta)
            r_opp, t_opp = resid.gather(-1, opp).squeeze(-1), evals.gather(-1, opp).squeeze(-1).abs()
            settled = (r_opp <= tol * theta_now.abs()) | (t_opp + OVERTAKE_K * r_opp <= theta_now.abs())
            # with one Ritz value there is no other end yet: a warm start at an eigenvector of the smaller end
            # (last evaluation's top vector, when the weights have moved) would otherwise stop on it after one step
            converged = converged & (~both_h | (settled & (j > 0)))
            was_live = live
            live = live & ~(exhausted | converged)  # the host mask; on CPU also the device one
            done = not bool(live.any()) or last
            # algebraic: a member takes its Ritz vector when it stops. Its later steps are zero (alpha = beta = 0),
            # and with a negative theta those zero Ritz values would outrank it at the end.
            take = (was_live if done else was_live & ~live) if algebraic else None
            if done or (take is not None and bool(take.any())):
                # the Ritz vector of theta, (*b, 1, size) @ (*b, size, n)
                y = evecs.gather(-1, idx.unsqueeze(-2).expand(*evecs.shape[:-1], 1)).squeeze(-1)  # (*b, size)
                y = y.to(device=device, dtype=dtype)
                new = (y.unsqueeze(-2) @ basis).squeeze(-2)
                ritz = new if take is None else torch.where(take.to(device).unsqueeze(-1), new, ritz)
                if done:
                    break
            active = live if cpu else live.to(device)
            if full:
                # thick restart: keep the Ritz vectors of the lowest and highest Ritz values (both ends of the
                # spectrum, the members' theta among them) and continue from the residual direction. With
                # H V = V T + w e^T, H y_i = theta_i y_i + (beta s_i) w / beta: the kept vectors couple to the
                # next one only, through arrow_i = beta s_i (s_i the last entry of eigenvector i).
                k_lo = max(1, cap // 4)
                keep = torch.cat([torch.arange(k_lo), torch.arange(size - k_lo, size)]).to(evecs.device)
                Y = evecs.index_select(-1, keep)  # (*b, size, 2 k_lo)
                kept = Y.to(device=device, dtype=dtype).mT @ basis  # (*b, 2 k_lo, n), a temporary
                k = kept.shape[-2]
                buf[..., :k, :] = kept
                del kept
                basis = buf[..., :k, :]
                arrow = (beta_h.unsqueeze(-1) * Y[..., -1, :]).to(device=device, dtype=dtype)  # (*b, k)
                arrow = torch.where(active.unsqueeze(-1), arrow, torch.zeros_like(arrow))
                alphas = list(evals.index_select(-1, keep).to(device=device, dtype=dtype).unbind(-1))
                # zero couplings between the kept vectors, and between the last of them and the next vector
                # (that one, like all of the kept vectors' couplings to it, is in arrow)
                betas = [torch.zeros_like(beta) for _ in range(k)]
                restarted = True
        if restarted:
            restarted = False
        else:
            betas.append(torch.where(active, beta, torch.zeros_like(beta)))
        size = basis.shape[-2]
        if size + 1 > buf.shape[-2]:
            grown = torch.empty((*batch_shape, min(cap, 2 * buf.shape[-2]), n), dtype=dtype, device=device)
            grown[..., :size, :] = basis
            buf = grown
        # the next vector, written straight into its basis slot; members that stopped get a zero vector
        # (in place: torch.where with a broadcast condition and a scalar was 10x slower on CPU at n = 590k)
        v = buf[..., size, :]
        torch.div(w, beta.clamp_min(torch.finfo(dtype).tiny).unsqueeze(-1), out=v)
        if not bool(live.all()):
            v.masked_fill_(~active.unsqueeze(-1), 0.0)
        basis = buf[..., : size + 1, :]
    theta, rel_residual = theta.to(device), rel_residual.to(device)
    if info is not None:
        info["rel_residual"] = rel_residual
    return (theta if algebraic else theta.abs()), ritz


def _project_out(w: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """One classical Gram-Schmidt pass: ``w - (w B^T) B`` for ``w`` ``(*b, n)`` and a basis ``B`` ``(*b, j, n)``."""
    # w^T B^T, not B w: as a row-vector product this is 7-10x faster on CPU (measured, batched n=32768)
    coeff = w.unsqueeze(-2) @ basis.mT  # (*b, 1, j)
    return w - (coeff @ basis).squeeze(-2)


def _on_cpu(device: torch.device | str) -> bool:
    """Whether ``device`` is the host: allocations are lazy and reading a tensor's value costs no sync there.

    (A function so that the tests can run the other devices' code path on CPU.)
    """
    return torch.device(device).type == "cpu"
