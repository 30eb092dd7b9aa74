"""Debiasing a few-sample largest eigenvalue: Richardson extrapolation over the halves of the samples, and its spread.

The largest eigenvalue of a Monte-Carlo matrix on ``k`` samples is biased upward, by about ``c / k``. The sampled
keys are therefore computed on the full sample and on its two halves (independent estimates), and :func:`debias`
extrapolates the bias away; ``sharpness_spread`` is the estimate's relative uncertainty, and a key whose spread is
above :data:`SPREAD_LIMIT` gets no value.
"""

from __future__ import annotations

import torch

__all__ = ["NOISE_SE", "SPREAD_FACTOR", "SPREAD_LIMIT", "debias", "extrapolated_residual", "has_shares", "richardson_q"]


def extrapolated_residual(
    values: torch.Tensor, residuals: torch.Tensor, counts: tuple[int, int, int], estimate: torch.Tensor
) -> torch.Tensor:
    """``(...)`` the relative error bound of a debiased estimate (:func:`debias`) from its Lanczos members: values
    and relative residuals ``(3, ...)`` (full sample, halves), each member's bound ``residual * |value|`` carried
    through the extrapolation ``estimate = (1 + q) full - q (a + b) / 2``, ``q = 1 / (k h - 1)``, over
    ``|estimate|`` (inf or nan where the estimate is 0, as :func:`debias`'s spread). 0 for exact members (the Gram
    path).

    Example:
        >>> vals = torch.tensor([[1.2], [1.4], [1.4]])  # full sample, halves: the estimate 2 * 1.2 - 1.4 = 1.0
        >>> res = torch.tensor([[1e-3], [1e-3], [1e-3]])
        >>> round(float(extrapolated_residual(vals, res, (16, 8, 8), torch.tensor([1.0]))[0]), 6)  # (2.4 + 1.4) 1e-3
        0.0038
    """
    q = richardson_q(counts)
    err = residuals * values.abs()
    return ((1 + q) * err[0] + q / 2 * (err[1] + err[2])) / estimate.abs()


def has_shares(counts: tuple[int, int, int]) -> bool:
    """Whether :func:`debias` reads its noise from ``shares`` for the sample counts ``(k, k_a, k_b)``: both halves of
    at least 2 samples (a half of one has no variance to read); else the halves' half-difference."""
    return min(counts[1:]) >= 2


def richardson_q(counts: tuple[int, int, int]) -> float:
    """``q`` of the extrapolation ``estimate = (1 + q) full - q mean(a, b)`` from the sample counts ``(k, k_a, k_b)``:
    ``1 / (k h - 1)``, ``h`` the mean of ``1 / k_a`` and ``1 / k_b`` (``q = 1`` for equal halves)."""
    k, ka, kb = counts
    return 1 / (k * (1 / ka + 1 / kb) / 2 - 1)


#: How far beyond the extrapolation's own correction the reported uncertainty reaches (see :func:`debias`).
SPREAD_FACTOR = 0.5

#: The reported uncertainty's noise term is this many standard errors of the debiased estimate (:func:`debias`'s
#: ``shares``: the delta method over the samples, ``k - 2`` degrees of freedom). On held-out HF GPT-2 blocks (``W2W2``
#: of both layers and ``VV/h0``, widths 32-128, 16 and 64 samples, 3 seeds: 54 estimates; ``python -m
#: benchmarks.bench_sharpness --bias --width 32 64 128 --ks 16,64 --seeds 3``) the spread with 2 standard errors covers
#: the exact value in all of them; one standard error alone, without the correction's part, in 42.
NOISE_SE = 2.0

#: A debiased key is given a value only where its relative uncertainty (:func:`debias`'s spread plus the members' error,
#: ``sharpness_spread``) is at most this: beyond it the value is not known to within its own size (the extrapolation's
#: correction alone is then above twice the estimate, or two standard errors above it). On the 54 estimates of
#: :data:`NOISE_SE`: at ``k = 16`` every ``W2W2`` estimate (errors 11-89%) is above it and every ``VV/h0`` one (errors
#: 0-26%, each within its spread) below; at ``k = 64``, 13 of the 18 ``W2W2`` estimates (errors 0-36%, each within its
#: spread) are below it, and every ``VV/h0`` one. With **one** kept sequence of 512 tokens (``k B`` = 16 columns, a
#: long-context model's case; d 32 and d 64) the values read 2.7-4.1x the exact ones (the plain value 16-38x). Such a
#: key gets no value (NaN, "no data", in the engine; left out of a direct call's result), its ``sharpness_spread`` is
#: still logged, and the monitor names it once (:func:`curvwatch.realloss.plugin.unresolved_keys`).
SPREAD_LIMIT = 1.0


def debias(
    full: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    counts: tuple[int, int, int],
    psd: bool = False,
    shares: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(estimate, relative uncertainty)`` of a largest eigenvalue from its Monte-Carlo values on ``k`` samples
    (``full``) and on the two halves (``a``, ``b``), with their sample counts ``counts = (k, k_a, k_b)``.

    The largest eigenvalue of a ``k``-sample estimate of a matrix is biased upward, for a well-separated top
    eigenvalue by ``c / k + O(k^-2)``. Richardson extrapolation removes the ``c / k`` term: with ``h`` the mean of
    ``1/k_a`` and ``1/k_b``, ``c = (mean(a, b) - full) / (h - 1/k)`` and the estimate is ``full - c / k``
    (``2 full - mean(a, b)`` for equal halves). The uncertainty is its noise plus ``SPREAD_FACTOR`` times the
    correction ``c / k`` (the bias left when it is not exactly ``c / k``), relative to ``|estimate|``. The noise:
    with ``shares``, ``NOISE_SE`` standard errors by the delta method over the samples (below); without, the
    half-difference of the halves (one degree of freedom).

    The delta method: each estimate's value is, to first order in its samples, its quotient at its top vector
    ``v_e``, ``sum_j s_{e,j}`` plus the block's exact own part, with ``s_{e,j} = w_{e,j} sum_b <J^T sigma_{j,b},
    v_e>^2`` (``shares``; 0 outside a half's samples). So the estimate is ``sum_j t_j`` plus a constant, ``t_j = (1 +
    q) s_{full,j} - (q / 2) (s_{a,j} + s_{b,j})``, independent over ``j`` and alike within a half: its variance is
    ``sum over the halves of n_h var_h(t)``.

    Args:
        full, a, b: ``(H,)`` the values per head.
        counts: ``(k, k_a, k_b)``.
        psd: The matrix is positive semi-definite (the Gauss-Newton block): the estimate is at least 0.
        shares: ``(3, k, H)`` the samples' parts ``s_{e,j}`` of the full sample's and the halves' values, or None
            (or a half of one sample: the halves' half-difference then).

    Example:
        >>> lam, c = 2.0, 8.0  # truth and bias constant: value(k) = lam + c / k
        >>> full, half = torch.tensor([lam + c / 16]), torch.tensor([lam + c / 8])
        >>> est, spread = debias(full, half, half, (16, 8, 8))
        >>> round(float(est), 6), round(float(spread), 3)
        (2.0, 0.125)
    """
    q = richardson_q(counts)
    correction = ((a + b) / 2 - full) * q  # c / k
    est = full - correction
    if psd:
        est = est.clamp_min(0)
    if shares is None or not has_shares(counts):  # (a half of one sample has no variance to read)
        noise = (a - b).abs() / 2
    else:
        ka = counts[1]
        t = (1 + q) * shares[0] - (q / 2) * (shares[1] + shares[2])  # (k, H)
        noise = NOISE_SE * (t[:ka].var(0) * ka + t[ka:].var(0) * (counts[0] - ka)).sqrt()
    width = noise + SPREAD_FACTOR * correction.abs()
    return est, width / est.abs()  # inf or nan where the estimate is 0 (the caller logs none)
