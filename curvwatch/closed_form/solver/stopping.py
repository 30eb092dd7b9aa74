"""The Lanczos stopping test: when a member's largest Ritz value is its norm, from the projected matrix alone.

A Ritz value that passed the residual test sits on *an* eigenvalue, not necessarily the largest: :func:`verdict` also
waits until the Ritz values that decide stood still (:func:`drift`), asks the close neighbour of a crowded top to
converge too, and settles the other end of an indefinite spectrum. Host numpy only: the solver
(:mod:`~.lanczos`) reads each run's projected matrix once per round of tests and applies this to every member.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["CROWDED", "CROWDED_STEPS", "OVERTAKE_K", "STABLE", "STABLE_STEPS", "TIE", "Verdict", "drift", "verdict"]

#: The other end of an indefinite spectrum counts as settled once it could not overtake theta even at
#: ``OVERTAKE_K`` times its residual. With eigenvalues 1 and -0.95 above a cluster in [0, 0.9], K = 1 stops on -0.95
#: in about one random start of ten, K = 10 in none of 80; on attention and FFN Hessians K = 10 costs no extra products
#: at L = d = 512 and ~4% more on small blocks.
OVERTAKE_K = 10.0

#: A Ritz value that passed the residual test sits on *an* eigenvalue, not necessarily the largest: a direction the
#: start vector nearly missed has no Ritz value yet (an unlucky draw, a near-degenerate top, a warm start at last time's
#: top vector when another has overtaken it). Once the Krylov space holds the eigenvalues it found, each further step
#: amplifies such a direction by its gap to the rest of the spectrum, so a member also waits until the extreme Ritz
#: values that decide (theta's end, and the other end where both matter) moved by at most ``STABLE * tol * |theta|``
#: over its last ``STABLE_STEPS`` steps (:func:`drift`). ``benchmarks/bench_convergence.py`` counts the norms reported
#: converged that are more than 1% off a tight solve over recorded training states.
STABLE = 0.1
#: The window of :data:`STABLE`, in Lanczos steps: independent of how often the stopping test runs (the device's
#: ``check_every``, :mod:`~.choices`), so that the test's cadence changes only when a member that met the rule is seen
#: to.
STABLE_STEPS = 4
#: A crowded top: another Ritz value that could decide within this fraction of ``|theta|``. Theta's residual then does
#: not say which of the close eigenvalues it found, and a missed one just above grows slowly: the close Ritz value at
#: theta's end must meet the residual test too, and the window of :data:`STABLE` is :data:`CROWDED_STEPS`.
CROWDED = 0.05
CROWDED_STEPS = 8
#: Relative difference below which the two ends of a member's Ritz values count as tied (theta is then the top one).
TIE = 1e-9


class Verdict(NamedTuple):
    """The stopping test's outcome for every member of a run (:func:`verdict`), host arrays of ``batch_shape``."""

    #: theta: the largest-magnitude Ritz value (the largest one where algebraic), with its sign
    theta: np.ndarray
    #: its index among the ascending Ritz values (the first or the last)
    index: np.ndarray
    #: what the norm is known to, relative (reported as the relative residual): theta's residual / |theta| (with a
    #: crowded top the larger of theta's and its neighbour's), or the drift of the deciding Ritz values / STABLE where
    #: larger; at least ``eps``
    rel: np.ndarray
    #: whether the member passed the stopping test
    converged: np.ndarray
    #: whether its Krylov space is exhausted (the answer is exact up to round-off)
    exhausted: np.ndarray
    #: whether its top is crowded (:data:`CROWDED`)
    crowded: np.ndarray
    #: theta's gap to the nearest other Ritz value that could decide (its neighbour at theta's end; where both ends
    #: decide, the other end too), relative to ``|theta|``
    gap: np.ndarray


def verdict(T: np.ndarray, evals: np.ndarray, evecs: np.ndarray, beta: np.ndarray, *, tol: float | np.ndarray,
            algebraic: np.ndarray, both: np.ndarray, kept: int = 0, breakdown: float = 0.0,
            eps: float = 0.0, spans: bool = False) -> Verdict:  # fmt: skip
    """The stopping test of a batch of Lanczos members from their projected matrices (host numpy only).

    A member passes when theta's residual ``|beta s_theta| <= tol |theta|`` (for a symmetric operator an eigenvalue
    lies within that residual); where ``both`` ends decide, the Ritz value at the other end has too or cannot overtake
    theta (``|theta_o| + OVERTAKE_K r_o <= |theta|``; with eigenvalues 1 and -0.95 the isolated smaller end converges
    first, and stopping on it returns 0.95 in about a third of random starts), and the member holds two Ritz values at
    least; and the deciding extreme Ritz values moved by at most ``STABLE tol |theta|`` over the last
    :data:`STABLE_STEPS` steps (:func:`drift`). With a crowded top (another deciding Ritz value within :data:`CROWDED`
    of theta) theta's close neighbour must pass the residual test too and the window is :data:`CROWDED_STEPS`. Theta
    is the top one where the two ends tie to round-off (:data:`TIE`: the ``+-sigma`` of an off-diagonal pair's
    symmetric embedding), so that which end decides does not hang on the rounding of the products.

    Args:
        T: ``(*batch_shape, size, size)`` projected matrices.
        evals: ``(*batch_shape, size)`` their eigenvalues, ascending; ``evecs`` ``(*batch_shape, size, size)`` their
            eigenvectors.
        beta: ``(*batch_shape,)`` the current beta (the norm of the residual direction).
        tol: relative tolerance, one or ``(*batch_shape,)``.
        algebraic: ``(*batch_shape,)`` bool: the largest eigenvalue (else the largest magnitude).
        both: ``(*batch_shape,)`` bool: both ends of the spectrum decide.
        kept: Ritz vectors kept by the last thick restart (0: none).
        breakdown: beta at most this times the largest ``|alpha|``: the Krylov space is exhausted.
        eps: the least relative residual reported (the working precision).
        spans: the basis spans the whole space (as many vectors as its dimension, no restart): every member's Ritz
            values are its eigenvalues, so its Krylov space is exhausted whatever beta's round-off.

    Example:
        >>> T = np.diag([1.0, 3.0]); ev, V = np.linalg.eigh(T)
        >>> v = verdict(T, ev, V, np.array(0.0), tol=1e-2, algebraic=np.array(False), both=np.array(False))
        >>> float(v.theta), bool(v.exhausted)
        (3.0, True)
    """
    size = T.shape[-1]
    upper = algebraic | (np.abs(evals[..., -1]) >= (1 - TIE) * np.abs(evals[..., 0]))
    idx = np.where(upper, size - 1, 0)
    top = upper
    theta = np.take_along_axis(evals, idx[..., None], -1)[..., 0]
    resid = np.abs(beta[..., None] * evecs[..., -1, :])  # residual of every Ritz pair
    opp = np.where(top, 0, size - 1)[..., None]  # the other end: the lowest Ritz value when theta is the highest
    scale = np.maximum(np.abs(np.diagonal(T, axis1=-2, axis2=-1)).max(-1), np.finfo(np.float64).tiny)
    exhausted = (beta <= breakdown * scale) | spans
    a_theta, t_opp = np.abs(theta), np.abs(np.take_along_axis(evals, opp, -1)[..., 0])
    near = np.clip(np.where(top, size - 2, 1), 0, size - 1)[..., None]  # theta's neighbour at its end
    gap = np.abs(theta - np.take_along_axis(evals, near, -1)[..., 0])
    with np.errstate(divide="ignore", invalid="ignore"):
        gap = np.where(size > 1, gap / a_theta, np.inf)
        gap = np.minimum(gap, np.where(both & (size > 1), 1 - t_opp / a_theta, np.inf))
    close = (np.abs(theta - np.take_along_axis(evals, near, -1)[..., 0]) <= CROWDED * a_theta) & (size > 1)
    crowded = close | (both & (t_opp >= (1 - CROWDED) * a_theta))
    r_theta = np.take_along_axis(resid, idx[..., None], -1)[..., 0]
    r_theta = np.where(close, np.maximum(r_theta, np.take_along_axis(resid, near, -1)[..., 0]), r_theta)
    with np.errstate(divide="ignore", invalid="ignore"):  # r / |theta|: inf for a zero Ritz value (unresolved)
        rel = np.where(r_theta > 0, r_theta / a_theta, 0.0)
    moved = drift(T, evals, top, both, np.where(crowded, CROWDED_STEPS, STABLE_STEPS), kept)
    moving = ~exhausted & (moved > STABLE * tol)
    with np.errstate(invalid="ignore"):  # (inf / inf where STABLE is inf: not read, moving is False there)
        # a member still moving reports at least its drift (at most 1: a run cut short before a whole window, by
        # max_iter, knows no more than that its norm is unresolved)
        rel = np.where(moving, np.maximum(rel, np.minimum(moved / STABLE, 1.0)), rel)
    converged = (rel <= tol) & ~moving
    r_opp = np.take_along_axis(resid, opp, -1)[..., 0]
    settled = (r_opp <= tol * a_theta) | (t_opp + OVERTAKE_K * r_opp <= a_theta)
    converged = converged & (~both | (settled & (size > 1)))
    return Verdict(theta, idx, np.maximum(rel, eps), converged, exhausted, crowded, gap)


def drift(T: np.ndarray, evals: np.ndarray, top: np.ndarray, both: np.ndarray, window: np.ndarray | int,
          kept: int = 0) -> np.ndarray:  # fmt: skip
    """How far the extreme Ritz values that decide a member's norm moved over its last ``window`` steps, relative to
    the norm: ``(*batch_shape,)``, ``inf`` where the member has not taken more steps than that yet.

    The Ritz values of the space of the first ``m`` basis vectors are those of ``T[:m, :m]`` (Rayleigh-Ritz on a nested
    space), and by interlacing the extremes of ``T`` lie outside theirs: the drift is how far the end of theta
    (``top``: its highest Ritz value, else its lowest) moved outward since the space was ``window`` vectors smaller;
    with ``both`` also the other end's, where at that pace it could overtake theta within :data:`OVERTAKE_K` more such
    windows. After a thick restart the space compared keeps at least the ``kept`` Ritz vectors (the first rows of
    ``T``): never less than what the restart kept. Host numpy only.

    Args:
        T: ``(*batch_shape, size, size)`` projected matrices.
        evals: ``(*batch_shape, size)`` their eigenvalues, ascending.
        top: ``(*batch_shape,)`` bool: whether theta is the highest Ritz value (else the lowest).
        both: ``(*batch_shape,)`` bool: whether both ends of the spectrum decide.
        window: Steps looked back, one for all members or ``(*batch_shape,)``.
        kept: Ritz vectors kept by the last thick restart (0: none).

    Example:
        >>> T = np.diag([3.0, 1.0, 2.0, 0.5, 4.0, 0.2])  # the top Ritz value grew from 3 to 4 in the last 4 steps
        >>> drift(T, np.sort(np.diag(T)), np.array(True), np.array(False), 4)
        array(0.25)
    """
    size = T.shape[-1]
    theta = np.abs(np.where(top, evals[..., -1], evals[..., 0]))  # |theta|: the largest |Ritz value|, or largest one
    other = np.abs(np.where(top, evals[..., 0], evals[..., -1]))
    window = np.broadcast_to(window, theta.shape)
    out = np.full(theta.shape, np.inf)
    for w in np.unique(window):
        m = max(size - int(w), kept)
        if m < 1 or m >= size:
            continue
        before = np.linalg.eigvalsh(T[..., :m, :m])  # ascending
        up = evals[..., -1] - before[..., -1]  # (>= 0 up to round-off: interlacing)
        down = before[..., 0] - evals[..., 0]
        mine, theirs = np.where(top, up, down), np.where(top, down, up)
        theirs = np.where(both & (other + OVERTAKE_K * theirs > theta), theirs, 0.0)
        moved = np.maximum(np.maximum(mine, theirs), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            moved = np.where(theta != 0, moved / theta, np.where(moved > 0, np.inf, 0.0))
        out = np.where(window == w, moved, out)
    return out
