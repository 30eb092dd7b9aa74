"""Monte-Carlo output curvature: sampled Gauss-Newton blocks, per-block sharpness and its preconditioned variant.

In ``grad_output`` mode the kernels model the loss around the block output ``F`` ``(B, L, m)`` by
``<G, F'> + (c/2) ||F' - F||^2`` with a stand-in curvature ``c`` per sequence. Given ``k`` sampled output gradients
``s_j`` ``(B, L, m)`` (e.g. back-propagated from labels drawn from the model's own predictive distribution, so that
``E[s s^T]`` is the loss's Gauss-Newton matrix in ``F``), this module replaces ``c`` by the Monte-Carlo curvature

    C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T        (block diagonal over the sequences b; dropped rows zeroed)

and reports, for a diagonal block ``XX`` with ``J_X = dF/dX`` and the functional part ``H_f,XX = sum g d^2F/dX^2``
(``g = grad_output``):

* ``ggn/XX``: ``lambda_max(J_X^T C J_X)`` (PSD, rank ``<= k B``);
* ``sharpness/XX``: the largest *algebraic* eigenvalue of ``J_X^T C J_X + H_f,XX``, the block of the loss Hessian
  up to the second-order part of the layers downstream of ``F`` (which ``C`` does not see);
* ``precond_ggn/XX``, ``precond_sharpness/XX``: the same of ``P^{-1/2} (.) P^{-1/2}`` for a positive diagonal
  preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``), the quantity an optimiser's stability threshold applies to
  (``2 / lr`` for gradient descent on the plain one).

Each operator applies its output curvature at one line (``FFNOperator.apply``, ``GatedFFNOperator.apply``,
``AttentionOperator._outer_cotangent``): the stand-in ``c`` unless its ``sampled`` attribute holds a
:class:`SampledCurvature`. The norms then run through the existing pair machinery on a copy of the operator
(:func:`with_sampled`), under the grouped-query views where needed, with :class:`Preconditioned` wrapping the base
operator.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ._common import _INPUTS_CHECKED
from ._operator import (
    BlockOperator,
    Planned,
    _Embedding,
    _norm_results,
    _norm_run,
    _pair_blocks,
    _rows,
    _skip_dead_kinds,
    apply_kinds,
    head_keys,
    pair_matvec,
    run_basis_bytes,
    solve_planned,
    stackable,
)
from .settings import Lanczos

#: Debias the sampled keys with ``k >= 2`` samples (:func:`debias`); ``False`` reports the plain Monte-Carlo values
#: (the benchmark's "before").
DEBIAS = True

#: The new keys per diagonal pair: ``{prefix}{name}/{XX}[/{head}]`` for prefix ``""`` and ``"precond_"``.
SAMPLED_NAMES = ("ggn", "sharpness")


class SampledCurvature:
    """The output curvature ``C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T`` applied in the space of an operator's
    output tangents.

    Args:
        sigma: ``(k, B, H, n)``: sample ``j`` as seen by unit ``h`` of sequence ``b``, flattened. For a block whose
            output is the tangent itself (FFN), ``H = 1`` and ``sigma = s``; for attention, whose tangents are the
            per-head outputs ``dF_h`` with ``F = sum_h F_h W_O^h``, ``sigma_{j,h} = s_j W_O^h^T``
            (see :meth:`of_tokens`, :meth:`of_heads`).
    """

    def __init__(self, sigma: torch.Tensor):
        # held as (B, H, k, n) in memory (a permuted view keeps the (k, B, H, n) indexing): each sequence and unit's
        # samples are then one matrix of the products' bmm, with no copy per product. Copied once when they are not
        # (a slice of k, as halves() takes, is already: no second copy)
        memory = sigma.permute(1, 2, 0, 3)
        try:
            memory.view(-1, *memory.shape[2:])  # (B H, k, n) as a view
        except RuntimeError:
            memory = memory.contiguous()
        self.sigma = memory.permute(2, 0, 1, 3)
        self.k = sigma.shape[0]
        # (n, k) weights of each tangent row's samples (:meth:`per_row`); None: 1/k for every row and sample
        self.row_weights: torch.Tensor | None = None

    @classmethod
    def of_tokens(cls, samples: torch.Tensor) -> SampledCurvature:
        """From samples ``(k, B, L, m)`` of a token-wise block whose tangents are ``(n, B L, m)``."""
        k, B = samples.shape[:2]
        return cls(samples.reshape(k, B, 1, -1))

    @classmethod
    def of_heads(cls, samples: torch.Tensor, W_O: torch.Tensor | None) -> SampledCurvature:
        """From samples ``(k, B, L, m)`` of attention with per-head output projection ``W_O`` ``(H, d_V, m)`` (None:
        one head, ``F = F_0``): ``sigma_{j,h} = s_j W_O^h^T`` ``(k, B, H, L d_V)``."""
        k, B = samples.shape[:2]
        sigma = samples.unsqueeze(2) if W_O is None else torch.einsum("kblm,hvm->kbhlv", samples, W_O)
        return cls(sigma.reshape(k, B, sigma.shape[2], -1))

    def per_row(self, weights: torch.Tensor) -> SampledCurvature:
        """The curvature with its own sample weights per tangent row: row ``r`` of a call applies
        ``sum_j weights[r, j] sigma_j sigma_j^T`` (``1/k`` on every sample is this curvature, ``1/k_a`` on the first
        half and 0 on the others is the first half's). Shares ``sigma``; a call must then have ``n`` =
        ``len(weights)`` rows (an operator's one-pass ``apply_masked``, which applies the curvature to every row).

        Args:
            weights: ``(n, k)``.
        """
        new = copy.copy(self)
        new.row_weights = weights
        return new

    def estimate_weights(self, E: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """``E`` tensors ``(k,)``: each estimate's sample weights, made on ``device`` (no host table to copy): ``1/k``
        on every sample (the full sample) and, with ``E = 3``, ``1/k_a`` on the first half's samples and ``1/k_b`` on
        the others' (:meth:`halves`), 0 elsewhere."""
        k, ka, kb = self.counts
        weights = [torch.full((k,), 1 / k, dtype=dtype, device=device)]
        if E == 3:
            first = (torch.arange(k, device=device) < ka).to(dtype)
            weights += [first / ka, (1 - first) / kb]
        return weights

    @property
    def counts(self) -> tuple[int, int, int]:
        """``(k, k_a, k_b)``: the samples, and those of the two halves (:meth:`halves`: the first ``k // 2``, the
        others), the split every debiased estimate uses (:func:`debias`, the stacked members, the Gram path)."""
        return self.k, self.k // 2, self.k - self.k // 2

    def halves(self) -> tuple[SampledCurvature, SampledCurvature]:
        """The curvatures of the first ``k_a`` samples and of the others (:attr:`counts`; independent estimates of
        ``C``)."""
        h = self.counts[1]
        return SampledCurvature(self.sigma[:h]), SampledCurvature(self.sigma[h:])

    def _samples(self) -> torch.Tensor:
        """``(B H, k, size)``: the samples per sequence and unit, a view (see ``__init__``)."""
        k, B, H, X = self.sigma.shape
        return self.sigma.permute(1, 2, 0, 3).reshape(B * H, k, X)

    def coefficients(self, dF: torch.Tensor, samples: torch.Tensor | None = None) -> torch.Tensor:
        """``(B H, n, k)``: ``<sigma_{j,b,h}, dF_{n,b,h}>`` of the tangents ``dF`` (as :meth:`__call__` takes them),
        by one ``bmm`` against :meth:`_samples` (``samples``, where the caller holds it already)."""
        _, B, H, X = self.sigma.shape
        s = self._samples() if samples is None else samples
        return torch.bmm(dF.reshape(dF.shape[0], B, H, X).permute(1, 2, 0, 3).reshape(B * H, dF.shape[0], X), s.mT)

    def __call__(self, dF: torch.Tensor, group: int = 1) -> torch.Tensor:
        """``u = C dF`` for tangents ``dF`` ``(n, B, H, ...)`` (or ``(n, B L, m)`` with ``H = 1``), same shape.

        Per sequence ``b`` and unit ``h``: ``u_h = (1/k) sum_j <sigma_{j,h}, dF_h>_b sigma_{j,h}``. With ``group > 1``
        the coefficient of ``h`` is summed over its group of ``group`` consecutive units (heads sharing a kv head,
        whose outputs a perturbation of the shared weights moves together), like the stand-in's ``mix``.
        """
        k, B, H, X = self.sigma.shape
        n = dF.shape[0]
        s = self._samples()
        a = self.coefficients(dF, s)  # (B H, n, k)
        if group > 1:
            a = a.view(B, H // group, group, n, k).sum(2, keepdim=True).expand(B, H // group, group, n, k)
            a = a.reshape(B * H, n, k)
        if self.row_weights is None:
            a = a / k
        elif self.row_weights.shape[0] != n:  # not reached: the stacked members call with every row
            raise RuntimeError(f"per-row sample weights for {self.row_weights.shape[0]} rows applied to {n}")
        else:
            a = a * self.row_weights  # (B H, n, k) * (n, k)
        u = torch.bmm(a, s)  # (B H, n, X)
        return u.view(B, H, n, X).permute(2, 0, 1, 3).reshape(dF.shape)


def with_sampled(op: BlockOperator, curvature: SampledCurvature) -> BlockOperator:
    """A shallow copy of ``op`` (sharing its tensors and cached factors) that applies ``curvature`` as its output
    curvature instead of the stand-in ``c``; ``op`` itself is unchanged."""
    new = copy.copy(op)
    new.sampled = curvature
    return new


class Preconditioned:
    """``D H D`` for a block operator ``H`` and positive diagonal scalings ``D`` (``P^{-1/2}``) of some of its blocks.

    Scales the tangent of each block in ``scale`` before :meth:`apply` and every part of the result after; blocks
    without a scaling pass unchanged. Every other attribute is the wrapped operator's, so the grouped-query views
    (:class:`~curvwatch.closed_form.attention._QueryView`, ``_GroupView``) can sit on top of it.

    Args:
        op: the operator (attention, FFN or gated FFN, possibly with sampled curvature).
        scale: ``name -> D`` in the operator's layout of that block without the leading tangent dimension
            (``(H, d, d_K)`` for attention's ``Q``, ``(d, f)`` for the FFN's ``W1``).
    """

    def __init__(self, op: BlockOperator, scale: Mapping[str, torch.Tensor]):
        self.op, self.scale = op, dict(scale)

    def __getattr__(self, name: str):
        if name in ("op", "scale") or name.startswith("__"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.op, name)

    def _scaled(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {nm: x * self.scale[nm] if nm in self.scale else x for nm, x in t.items()}

    def apply(self, tangent, *args, **kwargs):
        """The wrapped ``apply`` (any of its arguments) with ``D`` on the way in and on every part on the way out."""
        return tuple(self._scaled(part) for part in self.op.apply(self._scaled(tangent), *args, **kwargs))

    @property
    def apply_masked(self):
        """The wrapped ``apply_masked`` with ``D`` on the way in and out, or None where the operator has none (a
        property: ``__getattr__`` would hand out the wrapped method unscaled)."""
        inner = getattr(self.op, "apply_masked", None)
        if inner is None:
            return None
        return lambda tangent, *args, **kwargs: self._scaled(inner(self._scaled(tangent), *args, **kwargs))


def check_output_samples(
    samples: torch.Tensor | None,
    *,
    target: torch.Tensor | None,
    out_shape: tuple[int, int, int],
    batched: bool,
    row_keep: torch.Tensor,
    ref: torch.Tensor,
) -> torch.Tensor | None:
    """Validate ``output_samples`` against the block output ``(B, L, m)``; return them ``(k, B, L, m)`` in ``ref``'s
    dtype and device with the rows outside ``row_keep`` ``(B, L)`` zeroed (like ``g``), or None.

    Raises:
        ValueError: with ``target`` (grad_output mode only), on a non-tensor, or on a shape other than
            ``(k, B, L, m)`` (``(k, L, m)`` unbatched) with ``k >= 1``.
    """
    if samples is None:
        return None
    if target is not None:
        raise ValueError(
            "output_samples= applies to grad_output= mode only: the sampled curvature replaces the stand-in c of "
            "the local model around a block inside a network, while target= fixes the loss and its curvature. Pass "
            "grad_output= instead of target=, or drop output_samples (and precondition)."
        )
    B, L, m = out_shape
    expected = (B, L, m) if batched else (L, m)
    shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
    if not isinstance(samples, torch.Tensor) or samples.ndim != len(expected) + 1 or samples.shape[0] < 1:
        ok = False
    else:
        ok = tuple(samples.shape[1:]) == expected
    if not ok:
        names = "(k, B, L, m)" if batched else "(k, L, m)"
        raise ValueError(
            f"Invalid output_samples shape {shape}. Expected {names} = (k, {', '.join(map(str, expected))}) with "
            "k >= 1: k sampled gradients of the loss in the block output, each shaped like grad_output."
        )
    S = samples.to(dtype=ref.dtype, device=ref.device)
    if not batched:
        S = S.unsqueeze(1)
    return S * row_keep.to(S.dtype)[None, :, :, None]


def check_precondition(
    precondition: Mapping[str, torch.Tensor] | None,
    shapes: Mapping[str, tuple[int, ...]],
    ref: torch.Tensor,
    *,
    has_samples: bool,
) -> dict[str, torch.Tensor]:
    """Validate ``precondition`` (``weight argument name -> diagonal of P``); return ``name -> D = P^{-1/2}`` in
    ``ref``'s dtype and device, each shaped like its weight argument (``{}`` for None).

    Args:
        precondition: the kernel's argument, or None.
        shapes: the kernel's weight argument names and the shapes they were passed with, e.g.
            ``{"W_1": (d, f), "W_2": (f, m)}``.
        ref: a tensor of the working dtype and device.
        has_samples: whether ``output_samples`` was given (the preconditioned keys need it).

    Raises:
        ValueError: without ``output_samples``, on a non-mapping, an unknown name, a shape other than the weight's,
            or an entry that is not finite and positive everywhere.
    """
    if precondition is None:
        return {}
    if not has_samples:
        raise ValueError(
            "precondition= needs output_samples= (grad_output mode only): it preconditions the sampled-curvature keys "
            "(precond_sharpness/..., precond_ggn/...). Pass output_samples as well, or drop precondition."
        )
    if not isinstance(precondition, Mapping):
        raise ValueError(
            f"Invalid precondition={type(precondition).__name__}. Must be a mapping from weight names "
            f"{list(shapes)} to tensors of their shapes (the diagonal of P, e.g. Adam's sqrt(v_hat) + eps)."
        )
    unknown = sorted(set(precondition) - set(shapes))
    if unknown:
        raise ValueError(f"Invalid precondition names {unknown}. Allowed: {list(shapes)} (this kernel's weights).")
    out = {}
    for name, shape in shapes.items():
        if name not in precondition:
            continue
        p = precondition[name]
        got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != tuple(shape):
            raise ValueError(
                f"Invalid precondition[{name!r}] shape {got}. Must be {tuple(shape)}, the shape {name} was passed "
                "with (same layout: one entry of P per weight entry)."
            )
        out[name] = p.to(dtype=ref.dtype, device=ref.device)
    # every weight's entries finite and > 0, in one host read for all of them; none where the caller checked them
    # (the monitor's engine, in its one NaN/Inf read of all blocks: its P = sqrt(v_hat) + eps is positive if finite)
    valid = [True] * len(out)
    if out and not _INPUTS_CHECKED.get():
        valid = torch.stack([(torch.isfinite(p) & (p > 0)).all() for p in out.values()]).tolist()
    for (name, p), ok in zip(out.items(), valid, strict=True):
        if not ok:
            raise ValueError(
                f"Invalid precondition[{name!r}]: every entry must be finite and > 0 (the diagonal of a positive "
                f"preconditioner, e.g. Adam's sqrt(v_hat) + eps); smallest entry {float(p.min()):.3g}."
            )
    return {name: p.rsqrt() for name, p in out.items()}


#: The Gauss-Newton keys come from the samples' Gram matrix (:func:`_gram_eigen`: exact, one operator product per
#: column) instead of Lanczos members where its ``k B`` columns (samples times kept sequences) are at most this many
#: times the Lanczos members they replace (every member of a block whose own functional term is zero, else the GGN
#: ones), and at most ``max_basis`` times (memory: the columns ``A``, ``(k B, H, n)``, then take no more than the
#: replaced members' Lanczos bases, ``max_basis`` vectors each). The sampled runs take 8-28 products (session 15: a
#: run stops when its slowest member has converged; the factor was 4 when a member was thought to take about 6), and
#: a Gram column costs one row of a product (its tangent is zero, the operator still runs it). Side by side,
#: ``python -m benchmarks.bench_sharpness --sampled GRAM_STEPS=4,12 --width W --batch B`` (one full evaluation, CPU
#: time and operators): d 64, ``k B`` = 64: 2.77 s / 28,793 -> 2.93 s / 20,778; d 768, ``k B`` = 32: 66.6 s / 26,148
#: -> 46.8 s / 21,904; d 768, ``k B`` = 64: 166.8 s / 36,400 -> 102.1 s / 26,996. Beyond about 12 columns per
#: member the Gram took more time on the CPU (all pairs by the Gram at ``k B`` = 128, d 64, measured by a script
#: without the cap: 1.86 s against 1.44 s).
GRAM_STEPS = 12

#: Columns of the Gram matrix per operator product (as many as the Lanczos runs batch at once: its memory).
GRAM_CHUNK = 16

#: Where a pair's Gram columns are made (its GGN keys by the Gram path) and the block has its own functional term
#: (``QQ``, ``KK``, ``W1W1``), the sharpness members' products take their Gauss-Newton part from the columns held
#: (:func:`_members_matvec`'s ``columns``) and only the functional part from the operator. ``False``: the operator's
#: whole product with the sampled curvature (the benchmark's "before"). Memory: the columns (at most
#: ``min(GRAM_STEPS, max_basis)`` times the members they replaced, the GGN ones) are then held beside the sharpness
#: members' Lanczos bases, which is at most what those GGN members' bases took when they ran as Lanczos members
#: beside the sharpness ones (``GRAM_STEPS = 0``).
GRAM_SHARPNESS = True

#: Where a pair's Gram columns are made and its sharpness members run (a block with its own functional term), each
#: member starts at the top eigenvector of its estimate's sampled Gauss-Newton block (:func:`_gram_eigen`'s
#: ``vectors``: exact, from the Gram matrix) instead of the last evaluation's Ritz vector (plus, either way, the
#: solver's noise of the start's own norm, ``_lanczos.WARM_NOISE``). The samples are new at every evaluation, so the
#: last Ritz vector is of another matrix; the Gauss-Newton direction is of this one. Side by side, with 10 AdamW steps
#: between evaluations (``python -m benchmarks.bench_sharpness --sampled GRAM_START=0,1 --train 10 --repeats 4``; HF
#: GPT-2, 2 layers): d 128, one kept sequence of 512 tokens (16 columns): the FFN's ``W1W1`` members 8-16 -> 4 steps,
#: the attention's 12-20 -> 8-20, a full evaluation 18,526 -> 16,184 operators (7.24 -> 6.90 s); d 64, B 8, L 128
#: (64 columns): 22,605 -> 21,548 operators (2.30 -> 2.28 s). Tried and not kept (same runs): the sum of this direction
#: and the warm start (17,788 and 21,637 operators), and the sum with the engine's own functional Ritz vector of the
#: block, plain or weighted by the two parts' top eigenvalues (17,328 / 17,078 and 22,187 / 21,331): the attention's
#: members take 8-20 steps from any of these starts. ``False``: the warm start (the benchmark's "before").
GRAM_START = True


def sampled_norms(
    op: BlockOperator,
    pairs: Sequence[str],
    *,
    lanczos: Lanczos,
    scale: Mapping[str, torch.Tensor] | None = None,
    view: Callable[[BlockOperator], BlockOperator] | None = None,
    linear: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """``ggn/XX[/h{i}]``, ``sharpness/XX[/h{i}]`` and, where ``scale`` holds ``X``, ``precond_ggn/XX[/h{i}]``,
    ``precond_sharpness/XX[/h{i}]``, each with its ``residual/...`` key, for the diagonal ``pairs``.

    The GGN is the outer part and the sharpness the total of ``op`` (whose output curvature is sampled); the
    preconditioned ones those of :class:`Preconditioned` ``(op, {X: D})``. The sharpness keys run in one batched
    Lanczos for the largest *algebraic* eigenvalue (``lanczos_max_abs(algebraic=True)``), warm-started under the key
    ``("sharpness", XX, prefixes, estimates, "hessian")``. The GGN keys come from the samples' Gram matrix where it is
    small (:func:`_gram_eigen`: ``k B`` at most :data:`GRAM_STEPS` (and ``max_basis``) times the Lanczos members it
    replaces, no ``view`` or one whose ``gram_columns`` hold ``X``; exact eigenvalues, ``residual/...`` 0), and the
    sharpness members then start at their estimate's top Gauss-Newton direction instead (:data:`GRAM_START`; no warm
    start kept), else they join the same Lanczos run (two members per estimate, warm-start key ``("sharpness", XX,
    prefixes, estimates)``). The members of a debiased key are solved to :data:`MEMBER_TOL` times ``lanczos.tol``.
    For the pairs in ``linear`` (``F`` linear in ``X``: the block's own functional term is zero, e.g. ``VV``,
    ``W2W2``) the sharpness *is* the GGN: no Lanczos runs for them where the Gram is used. Every pair's Gram columns
    are made first, then the pairs' Lanczos runs are solved together (:data:`SOLVE_PAIRS`: one host read per round of
    stopping tests for all of them; at most ``lanczos.solve_bytes`` of bases at once).

    With ``k >= 2`` samples the largest eigenvalue of the Monte-Carlo matrix is biased upward, by about ``c / k``
    (the few-sample Gram matrix's largest eigenvalue; ``c`` grows with the block). Each key is then debiased
    (:func:`debias`): the same Lanczos also runs on the two independent halves of the samples (the Gram matrix's
    diagonal blocks), and the bias is extrapolated away from the full and the half-sample values (Richardson);
    ``sharpness_spread/XX[/h{i}]`` is the uncertainty of ``sharpness/XX``, relative.

    Args:
        op: the base operator with sampled curvature (:func:`with_sampled`).
        pairs: diagonal pair names such as ``"QQ"``, ``"W1W1"``.
        lanczos: the Lanczos settings.
        scale: ``block name -> D = P^{-1/2}`` in ``op``'s layout (see :class:`Preconditioned`).
        view: maps the (possibly preconditioned) base operator to the operator the blocks are read from (the
            grouped-query ``_QueryView`` / ``_GroupView``); default the operator itself.
        linear: the pairs of ``pairs`` whose functional block is zero (the kernel knows them).
    """
    plan = sampled_plan(op, [(pairs, view, linear)], lanczos=lanczos, scale=scale)
    return solve_planned([plan], lanczos.solve_bytes)[0][0]


@dataclass
class _PairJob:
    """One diagonal pair of :func:`sampled_plan`: its part (view) and block, its variants' prefixes, ``raw`` keys
    ``{name: ((P, E, H) values, relative residuals)}`` (the Gram's, then its run's) and their ``shares`` (with the
    debiasing: ``{name: (P, E, k, H)}``, :func:`debias`), the Gram ``columns`` and the
    sharpness members' ``tops`` until its run's product takes them, and, where it has a Lanczos run (``planned``),
    that run's keys ``names`` (``m`` kinds per member), warm-start ``key``, settings ``members``, whether it
    starts at vectors of its own (``own_start``: nothing kept for the next evaluation), and which of the plan's runs
    (``run``) and which of that run's rows (``rows``) are the pair's (pairs that stack share a run)."""

    part: int
    pair: str
    block: str
    prefixes: list[str]
    raw: dict[str, tuple[torch.Tensor, torch.Tensor]]
    columns: torch.Tensor | None
    tops: list[torch.Tensor] | None
    planned: bool = False
    names: list[str] = field(default_factory=list)
    m: int = 0
    key: tuple | None = None
    members: Lanczos | None = None
    own_start: bool = False
    run: int = -1
    rows: slice | None = None
    # name -> (P, E, k, H): each sample's part of each member's value at its top vector (debias's shares)
    shares: dict[str, torch.Tensor] = field(default_factory=dict)


def sampled_plan(
    op: BlockOperator,
    parts: Sequence[tuple[Sequence[str], Callable[[BlockOperator], BlockOperator] | None, Collection[str]]],
    *,
    lanczos: Lanczos,
    scale: Mapping[str, torch.Tensor] | None = None,
) -> Planned:
    """The Lanczos runs of :func:`sampled_norms` for several parts ``(pairs, view, linear)`` of one operator (the
    grouped-query kernel's ``QQ`` per query head and ``KK``, ``VV`` per kv group) as a :class:`~._operator.Planned`,
    every Gram column made (the ``ggn`` keys where the Gram is used) before it returns; its ``finish`` gives the dicts
    of keys, one per part.
    A kernel solves it with its own runs (:func:`~._operator.solve_planned`), so that their stopping tests share host
    reads; made before them, so that no Gram product's temporaries meet a Lanczos basis."""
    scale = {} if scale is None else scale
    curvature = getattr(op, "sampled", None)
    split = DEBIAS and curvature is not None and curvature.k >= 2
    # the debiased keys' noise from each sample's part of the members' values (debias's shares)
    shared = split and _has_shares(curvature.counts)
    if shared:  # (3, k): each estimate's sample weights
        weights = torch.stack(curvature.estimate_weights(3, op.dtype, op.device))
    # the estimates: the full sample, and with k >= 2 its two halves (independent, each unbiased)
    ops = [op, *(with_sampled(op, c) for c in curvature.halves())] if split else [op]
    counts = curvature.counts if split else None
    E = len(ops)
    columns = curvature.k * curvature.sigma.shape[1] if isinstance(curvature, SampledCurvature) else None
    gram_limit = GRAM_STEPS if lanczos.max_basis is None else min(GRAM_STEPS, lanczos.max_basis)

    def wrap(o: BlockOperator, prefix: str, X: str, view) -> BlockOperator:  # a variant's block X is read from it
        return view(Preconditioned(o, {X: scale[X]})) if prefix else view(o)

    # Every pair's Gram columns first (a pair without Lanczos members lets go of its columns at once), then every
    # pair's Lanczos run, then all the runs in one solve (SOLVE_PAIRS: their stopping tests share host reads). So no
    # Gram product's temporaries meet a Lanczos basis.
    jobs: list[_PairJob] = []
    # (job, Gram matrix, columns where its top eigenvectors are wanted, scale, their list) per pair and variant
    grams: list = []
    job_gram: dict[int, list[tuple]] = {}  # job -> its ((E, H) Gram eigenvalues, (E, k, H) shares) per variant
    linear_jobs: set[int] = set()  # the jobs of pairs in which F is linear (their sharpness is their GGN)
    gram_bytes = 0  # the largest pair's Gram columns: the Gram matrices decomposed at once stay within them

    def flush() -> None:  # the Gram matrices' eigenvalues (and the members' start vectors) of grams, in one batch
        if not grams:
            return
        for (j, _, _, _, tops), (values, top, shares) in zip(
            grams, _gram_eigen(grams, curvature, split, op.dtype), strict=True
        ):
            job_gram[j].append((values, shares))
            if top is not None:
                tops.append(top)
        grams.clear()

    makers: list = []  # (make a run, its basis's bytes), in the order of the jobs with a run
    views = []  # per part: (view, the viewed operator, whether its members stack)
    for part, (pairs, view, linear) in enumerate(parts):
        plain_view = view is None
        view = (lambda o: o) if view is None else view
        viewed = view(op)
        # the columns J_X^T sigma through the base operator or a view that keeps them for block X (``gram_columns``:
        # the grouped-query views)
        gram_ok = columns is not None and getattr(viewed, "head_diagonal", False)
        gram_blocks = None if plain_view else getattr(viewed, "gram_columns", frozenset())
        # the members (estimates x preconditionings) as rows of shared products: needs the one-pass apply_masked,
        # which applies the output curvature to every row (the per-row sample weights line up with the rows)
        one_pass = getattr(viewed, "head_diagonal", False) and getattr(viewed, "apply_masked", None) is not None
        stack_ok = STACK_MEMBERS and isinstance(curvature, SampledCurvature) and one_pass
        views.append((view, viewed, stack_ok))
        for pair_name in pairs:
            X, Y = _pair_blocks(pair_name, list(viewed.params))
            if X != Y:
                raise ValueError(f"Sampled sharpness is defined for diagonal pairs only; got {pair_name!r}.")
            prefixes = [""] + (["precond_"] if X in scale else [])
            # raw[name]: (P, E, H) values (variants: plain, preconditioned; estimates: full, halves) and relative
            # residuals
            raw: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            replaced = E * len(prefixes) * (2 if pair_name in linear else 1)  # the Lanczos members the Gram replaces
            gram = gram_ok and (gram_blocks is None or X in gram_blocks) and columns <= gram_limit * replaced
            A = tops = None
            if gram:
                job_gram[len(jobs)] = []
                A = _gram_columns(op, X, curvature, view)
                tops = [] if GRAM_START and pair_name not in linear else None  # the sharpness members' starts
                scales = [scale.get(X) if p else None for p in prefixes]
                gram_bytes = max(gram_bytes, A.numel() * A.element_size())
                for G, D in zip(_gram_matrices(A, curvature, scales), scales, strict=True):
                    if grams and sum(g.numel() for _, g, *_ in grams) * 8 + G.numel() * 8 > gram_bytes:
                        flush()  # (the matrices decomposed at once stay within the largest pair's columns)
                    grams.append((len(jobs), G, None if tops is None else A, D, tops))
                if pair_name in linear:  # F linear in X: the Hessian block is its outer part (no members)
                    A = None
                    linear_jobs.add(len(jobs))
            jobs.append(_PairJob(part, pair_name, X, prefixes, raw, A, tops))
    A = tops = None
    flush()  # the Gram matrices left
    for j, values in job_gram.items():
        ggn = torch.stack([v for v, _ in values])  # (P, E, H)
        jobs[j].raw["ggn"] = (ggn, torch.zeros_like(ggn))
        if shared:
            jobs[j].shares["ggn"] = torch.stack([sh for _, sh in values])  # (P, E, k, H)
        if j in linear_jobs:  # F linear in X: its sharpness is its GGN
            jobs[j].raw["sharpness"] = jobs[j].raw["ggn"]
            if shared:
                jobs[j].shares["sharpness"] = jobs[j].shares["ggn"]
    job_gram.clear()
    # the jobs with Lanczos members, in runs: consecutive pairs of one part whose blocks stack (STACK_PAIRS: the
    # attention's QQ and KK, one Lanczos step per step for both) share a run, the others have one each
    groups: list[list[_PairJob]] = []
    for job in jobs:
        job.names = [nm for nm in SAMPLED_NAMES if nm not in job.raw]
        if not job.names:
            job.columns = job.tops = None
            continue
        last = groups[-1][-1] if groups else None
        view, viewed, stack_ok = views[job.part]
        if (
            STACK_PAIRS
            and stack_ok
            and last is not None
            and last.part == job.part
            and last.names == job.names
            and last.prefixes == job.prefixes
            and (last.columns is None) == (job.columns is None)
            and bool(last.tops) == bool(job.tops)
            and stackable(viewed, [g.pair for g in groups[-1]] + [job.pair])
        ):
            groups[-1].append(job)
        else:
            groups.append([job])
    for group in groups:
        job = group[0]
        prefixes, names = job.prefixes, job.names
        view, viewed, stack_ok = views[job.part]
        kinds_one = tuple({"ggn": "outer", "sharpness": "hessian"}[nm] for nm in names)
        m = len(kinds_one)
        # run r = (g P + i) E + e (the group's pair g, variant i, estimate e) owns the rows m r ... m r + m - 1
        if stack_ok:  # the members as rows of few products (MEMBER_ROWS rows each)
            # with the Gram columns held, the Gauss-Newton part of each product is A W A^T (see _members_matvec)
            blocks = [
                (g.block, scale[g.block] if len(prefixes) > 1 else None, g.columns if GRAM_SHARPNESS else None)
                for g in group
            ]
            emb, mv = _members_matvec(op, blocks, curvature, E, kinds_one, view)
            del blocks
        else:
            X = job.block
            runs = [pair_matvec(wrap(o, prefix, X, view), (X, X), kinds_one) for prefix in prefixes for o in ops]
            emb = runs[0][0]

            def mv(u: torch.Tensor, live: torch.Tensor | None = None, runs=runs, m=m) -> torch.Tensor:
                pieces = []
                for i, (_, f) in enumerate(runs):  # the members of each run, each its own operator
                    rows = slice(m * i, m * i + m)
                    pieces.append(f(u[rows], None if live is None else live[rows]))
                return torch.cat(pieces)

        kinds = kinds_one * (len(prefixes) * E * len(group))
        pair = "+".join(g.pair for g in group)
        key = ("sharpness", pair, tuple(prefixes), E) + (() if m == 2 else kinds_one)
        # the members of a debiased key tighter than the key (see MEMBER_TOL); the warm starts are the same store
        members = lanczos.replace(tol=lanczos.tol * MEMBER_TOL) if split else lanczos
        # (P E, H, size) per pair: member i E + e (kinds_one is ("hessian",) where the Gram made the GGN keys) starts
        # at its estimate's top Gauss-Newton direction
        v0 = None if not job.tops or m != 1 else torch.cat([t for g in group for t in g.tops])
        # the run is made when its solve starts (its basis allocated at its first step): a lone solve keeps one basis at
        # a time
        make = functools.partial(_norm_run, viewed, emb, mv, kinds, key, True, members, algebraic=True, v0=v0)
        makers.append((make, run_basis_bytes(len(kinds), emb, members, viewed.dtype)))
        rows = m * len(prefixes) * E
        for g_index, g in enumerate(group):
            g.columns = g.tops = None  # (the run's product holds the columns from here on)
            g.planned, g.m, g.key, g.members = True, m, key, members
            g.own_start, g.run = v0 is not None, len(makers) - 1
            g.rows = None if len(group) == 1 else slice(g_index * rows, (g_index + 1) * rows)  # (None: every row)
        del mv, v0, make

    def finish(runs: list) -> list[dict[str, torch.Tensor]]:  # the keys, from the solved runs (in order)
        read: dict[int, tuple[torch.Tensor, ...]] = {}  # run -> (values, residuals, Ritz vectors), each read once
        outs: list[dict[str, torch.Tensor]] = [{} for _ in parts]
        for job in jobs:
            if not job.planned:
                continue
            if job.run not in read:
                run = runs[job.run]
                read[job.run] = (
                    (run.norm, run.rel_residual) if job.own_start else _norm_results(run, job.key, job.members)
                ) + (run.ritz,)
                run.matvec = None  # (its product's tensors, the Gram columns among them)
            vals, rel, ritz = read[job.run] if job.rows is None else (t[job.rows] for t in read[job.run])
            P, m = len(job.prefixes), job.m
            for j, name in enumerate(job.names):  # kind j of run i E + e is row m (i E + e) + j
                job.raw[name] = (vals[j::m].view(P, E, -1), rel[j::m].view(P, E, -1))
            if shared:  # each sample's part of each member's value at its Ritz vector: (P, E, m, k, H)
                D = scale[job.block] if len(job.prefixes) > 1 else None
                shares = _member_shares(op, job.block, curvature, ritz, views[job.part][0], D, weights, m)
                for j, name in enumerate(job.names):
                    job.shares[name] = shares[:, :, j]
        read.clear()
        if not jobs:
            return outs
        # every pair and variant of a name at once: (E, sum of P H) values, the plain variants (prefix "") first, the
        # keys in that order
        order = [(job, i) for i in range(2) for job in jobs if i < len(job.prefixes)]
        keys: list[tuple[int, str]] = []  # (part, key with {} for the name) of each column
        for job, i in order:
            prefix = job.prefixes[i]
            heads = head_keys(wrap(op, prefix, job.block, views[job.part][0]), f"{prefix}{{}}/{job.pair}", (job.block,))
            keys += [(job.part, k) for k in heads]
        n_plain = sum(job.raw["ggn"][0].shape[-1] for job in jobs)  # (the plain variants' columns)
        withheld: list[tuple[list[tuple[int, str]], torch.Tensor]] = []  # (keys, unresolved) of the debiased values
        spread_keys, spread = [(part, k.format("sharpness_spread")) for part, k in keys[:n_plain]], None
        for name in SAMPLED_NAMES:
            vals = torch.cat([job.raw[name][0][i] for job, i in order], 1)
            rel = torch.cat([job.raw[name][1][i] for job, i in order], 1)
            named = [(part, k.format(name)) for part, k in keys]
            value = vals[0]
            if split:
                shares = torch.cat([job.shares[name][i] for job, i in order], -1) if shared else None  # (E, k, .)
                value, width = debias(*vals.unbind(), counts, psd=name == "ggn", shares=shares)
                width = width + extrapolated_residual(vals, rel, counts, value)
                # unresolved: no value (NaN, "no data"); a spread of 0/0 (every estimate 0) is a resolved 0
                unresolved = width > SPREAD_LIMIT
                value = value.masked_fill(unresolved, torch.nan)
                withheld.append((named, unresolved))
                if name == "sharpness":  # the plain variants': 0/0 is "no data", no key (decided below)
                    width, plain = width[:n_plain], value[:n_plain]
                    spread = (width, torch.isfinite(width) & (plain != 0))
            for (part, k), v, r in zip(named, value.unbind(), rel.amax(0).unbind(), strict=True):
                outs[part][k] = v
                outs[part][f"residual/{k}"] = r
        if spread is not None and _INPUTS_CHECKED.get():
            # the monitor's engine: NaN marks "no data" and its logbook drops the key in its one read of every value
            # (the unresolved values are NaN already)
            for (part, k), v in zip(spread_keys, torch.where(spread[1], spread[0], torch.nan).unbind(), strict=True):
                outs[part][k] = v
        elif spread is not None:  # one host read: which spreads have data, which values are unresolved
            flags = iter(torch.cat([spread[1]] + [u for _, u in withheld]).tolist())
            for (part, k), v in zip(spread_keys, spread[0].unbind(), strict=True):
                if next(flags):
                    outs[part][k] = v
            for named, _ in withheld:
                for part, k in named:
                    if next(flags):
                        del outs[part][k]
        return outs

    return Planned(makers, finish, together=False, merge=SOLVE_PAIRS)


#: The sampled keys' Lanczos runs of all the pairs of a call (the attention's ``QQ`` and ``KK``) in one :func:`solve`,
#: and with the kernel's own runs where it solves them together (:func:`sampled_plan`): their stopping tests share
#: host reads (one sync per round of tests for all of them, instead of one per run one after the other). Their bases
#: are then held at once, at most ``lanczos.solve_bytes`` of them (the monitor's engine passes the block's
#: ``CapturedBlock.basis_bytes``, which counts three times the engine's own with output samples); their products still
#: run one at a time. ``False``: one solve per run (the benchmark's "before").
SOLVE_PAIRS = True


#: Run the sampled keys' Lanczos members of a pair as rows of one operator product (:func:`_members_matvec`) where
#: the operator allows it; ``False``: one product per member (the benchmark's "before").
STACK_MEMBERS = True


#: One Lanczos run for the sampled keys of the consecutive diagonal pairs of a part whose blocks stack
#: (:func:`~._operator.stackable`: the attention's ``QQ`` and ``KK``, one head-diagonal operator, blocks of one shape):
#: one Lanczos step per step for their members (:func:`_members_matvec`; the products stay one per block where its
#: rows fill one, :data:`MEMBER_ROWS`), where each pair's run took its own. ``False``: one run per pair (the
#: benchmark's "before").
STACK_PAIRS = True


#: At most this many rows per operator product of the stacked members (:func:`_members_matvec`): the rows of the
#: engine's own largest product (attention's ``QQ`` and ``KK``, three kinds each), so that a product's temporaries (the
#: attention's ``(B, H, L, L)`` tangents per row) stay within what the engine's evaluation of the block takes anyway.
#: (12, the attention's ``QQ`` and ``KK`` members in one product, cut 5% of one attention block's operators at the
#: issue's GPU shape and raised its peak memory by 32%: session 21.)
MEMBER_ROWS = 6


def _members_matvec(
    op: BlockOperator,
    blocks: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]],
    curvature: SampledCurvature,
    E: int,
    kinds_one: Sequence[str],
    view: Callable[[BlockOperator], BlockOperator] = lambda o: o,
):
    """``(emb, mv)`` for the Lanczos members of the sampled keys of the diagonal blocks ``XX`` of ``blocks``, in few
    operator products.

    ``blocks``: ``[(X, D, columns)]``, one or more blocks of one shape and headedness (:func:`~._operator.stackable`:
    the attention's ``Q`` and ``K``), each with ``D`` (``P^{-1/2}`` in the base operator's layout of ``X``, as
    :class:`Preconditioned` takes it; given for all of them or for none) and ``columns`` (below; for all or none).
    The members are ``(block b, variant i, estimate e)``: ``i = 0`` plain and, with ``D``, ``i = 1`` preconditioned;
    ``e = 0`` the full sample and, with ``E = 3``, ``e = 1, 2`` its halves (as :meth:`SampledCurvature.halves`).
    Member ``r = (b P + i) E + e`` (``P`` variants) owns the rows ``m r ... m r + m - 1`` (``m`` =
    ``len(kinds_one)``): the layout of one :func:`pair_matvec` per member, concatenated. The estimates differ only in
    their samples' weights (``1/k`` on all, or ``1/k_a`` on one half's), applied per row
    (:meth:`SampledCurvature.per_row`); the preconditioned rows are scaled by their block's ``D`` on the way in and
    out, and the rows of block ``b`` perturb ``X_b`` alone and read ``X_b`` (0/1 row masks, as
    :func:`~._operator.stacked_matvec`): so up to :data:`MEMBER_ROWS` rows of any members share **one** product, the
    same numbers as one product per member in the dispatched operators of one (only the arithmetic grows with the
    rows). ``view`` maps an operator to the one the blocks are read from (the grouped-query views); it must be
    head-diagonal and have ``apply_masked`` (one pass over every row: the curvature sees every row, in order).

    With ``columns``, the samples' Gram columns ``A`` ``(H, k B, size)`` of the block (:func:`_gram_columns`; only
    ``"hessian"`` kinds), a product is the operator's **functional** part plus the Gauss-Newton part from the columns:
    ``J_X^T C_e J_X v = sum_c w_{e,c} A_c <A_c, v>`` per head, ``w_{e,c}`` the member's weight of column ``c``'s sample
    (column ``j B + b`` is sample ``j``): the same numbers, without the operator's first-order pass and the sampled
    curvature (two ``(H, rows, k B)`` products against each block's ``A`` instead).
    """
    if len({D is None for _, D, _ in blocks}) > 1 or len({A is None for _, _, A in blocks}) > 1:
        raise ValueError("The stacked blocks take D and columns all or none.")
    k = curvature.k
    estimates = curvature.estimate_weights(E, op.dtype, op.device)  # (k,) sample weights of each estimate
    names = [X for X, _, _ in blocks]
    emb = _Embedding(view(op), names[:1])
    info = view(op).params[names[0]]
    layout = (emb.H, *info.shape) if info.headed else tuple(info.shape)  # a tangent row (head-diagonal operator)
    Ds = [None if D is None else D.reshape(layout) for _, D, _ in blocks]  # the view's layout (same entries, order)
    labels = [(b, i, e, kind) for b in range(len(blocks)) for i in range(1 if Ds[0] is None else 2) for e in range(E)
              for kind in kinds_one]  # fmt: skip
    gram = blocks[0][2] is not None
    if gram:
        if set(kinds_one) != {"hessian"}:
            raise ValueError(f"Gram columns serve the 'hessian' members only, not {kinds_one}.")
        B = blocks[0][2].shape[1] // k  # (the columns of sample j are j B ... j B + B - 1)
        column_weights = [w.repeat_interleave(B) for w in estimates]  # (k B,) per estimate

    def product(rows_of):  # one product for these rows
        n = len(rows_of)
        W = None
        if not gram:
            rows = _rows([kind for *_, kind in rows_of], 1, emb)
            weights = torch.stack([estimates[e] for _, _, e, _ in rows_of])  # (n, k)
            member_op = view(with_sampled(op, curvature.per_row(weights)))
        else:  # the operator's functional part; the Gauss-Newton part from the columns
            rows = _rows(["functional"] * n, 1, emb)
            member_op = view(op)
            W = torch.stack([column_weights[e] for _, _, e, _ in rows_of])  # (n, k B)
        present = list(dict.fromkeys(b for b, *_ in rows_of))
        # the preconditioned rows, as runs [start, stop) of consecutive rows of one block (the labels stay in order)
        scaled: list[tuple[int, int, int]] = []
        for r, (b, i, _, _) in enumerate(rows_of):
            if i == 0:
                continue
            if scaled and scaled[-1][0] == b and scaled[-1][2] == r:
                scaled[-1] = (b, scaled[-1][1], r + 1)
            else:
                scaled.append((b, r, r + 1))
        whole = scaled[0][0] if len(scaled) == 1 and scaled[0][1:] == (0, n) else None  # (no slices then)
        # (n, 1, ...) 0/1 masks of each block's rows where several blocks share the product, made once per row set
        masks = None
        if len(present) > 1:
            masks = {b: torch.tensor([float(rb == b) for rb, *_ in rows_of], dtype=op.dtype, device=op.device)
                     .reshape(n, *(1,) * len(layout)) for b in present}  # fmt: skip
        outputs = [names[b] for b in present]

        def mv(u: torch.Tensor) -> torch.Tensor:
            v = u.reshape(n, *layout)  # (the Lanczos vectors, its basis's: not changed)
            if whole is not None:  # every row preconditioned, by one block's D
                v = v * Ds[whole]
            elif scaled:
                v = v.clone()
                for b, start, stop in scaled:
                    v[start:stop].mul_(Ds[b])
            tangent = {names[b]: v if masks is None else v * masks[b] for b in present}
            out = apply_kinds(member_op, tangent, outputs, rows)
            total = None
            for b in present:
                o = out[names[b]]
                if W is not None:  # + sum_c w_c A_c <A_c, v> per head, through (H, n, k B) coefficients
                    A = blocks[b][2]
                    coeff = torch.bmm(tangent[names[b]].reshape(n, emb.H, emb.n).transpose(0, 1), A.mT).mul_(W)
                    o = o.contiguous()
                    o.view(n, emb.H, emb.n).add_(torch.bmm(coeff, A).transpose(0, 1))
                if masks is None:
                    total = o
                elif total is None:
                    total = o * masks[b]
                else:
                    total = total.addcmul_(o, masks[b])
            if scaled:
                total = total if total.is_contiguous() else total.contiguous()  # (an expanded result: not in place)
                if whole is not None:
                    total.mul_(Ds[whole])
                else:
                    for b, start, stop in scaled:
                        total[start:stop].mul_(Ds[b])
            return total.reshape(n, emb.H, emb.n)

        return mv

    def make(rows_of):
        # products of at most MEMBER_ROWS rows; a block's rows go to one product where they fit (a product of two
        # blocks' rows runs the operator's paths of both: it pays only where it saves a product)
        chunks: list[list] = []
        for b in dict.fromkeys(b for b, *_ in rows_of):
            mine = [row for row in rows_of if row[0] == b]
            if chunks and len(chunks[-1]) + len(mine) <= MEMBER_ROWS:
                chunks[-1] += mine
            else:
                chunks += [mine[i : i + MEMBER_ROWS] for i in range(0, len(mine), MEMBER_ROWS)]
        products = [product(c) for c in chunks]
        if len(products) == 1:
            return products[0]
        bounds = [0]
        for c in chunks:
            bounds.append(bounds[-1] + len(c))

        def mv(u: torch.Tensor) -> torch.Tensor:
            return torch.cat([f(u[a:z]) for f, a, z in zip(products, bounds[:-1], bounds[1:], strict=True)])

        return mv

    return emb, _skip_dead_kinds(labels, make)


class _Columns:
    """A stand-in output curvature that ignores the tangent: row ``r`` of a batch gets column ``start + r`` of the
    samples, ``r' = j B + b`` -> ``sigma_{j,b}`` on sequence ``b`` (zero on the others), so an operator's outer part
    returns ``J_X^T sigma_{j,b}``, the columns of ``A`` with ``J_X^T C J_X = A A^T / k`` (:func:`_gram_eigen`)."""

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


class _Recorder:
    """A stand-in output curvature that records the coefficients ``a_{n,j,b,h} = <sigma_{j,b,h}, dF_{n,b,h}>`` of
    the tangent rows ``n`` it is applied to (:meth:`SampledCurvature.coefficients`, summed over a kv group of
    ``group`` heads where the operator mixes them, as :class:`SampledCurvature` does), ``(n, k, B, H / group)`` in
    :attr:`coefficients`, and returns zero: an operator's outer part through it is ``J_X`` applied to the rows, read
    against the samples."""

    def __init__(self, curvature: SampledCurvature):
        self.curvature = curvature
        self.coefficients: list[torch.Tensor] = []

    def __call__(self, dF: torch.Tensor, group: int = 1) -> torch.Tensor:
        k, B, H, _ = self.curvature.sigma.shape
        a = self.curvature.coefficients(dF).view(B, H, -1, k).permute(2, 3, 0, 1)  # (n, k, B, H)
        if group > 1:
            a = a.reshape(*a.shape[:3], H // group, group).sum(-1)
        self.coefficients.append(a)
        return torch.zeros_like(dF)


def _member_shares(
    op: BlockOperator,
    X: str,
    curvature: SampledCurvature,
    ritz: torch.Tensor,
    view: Callable[[BlockOperator], BlockOperator],
    D: torch.Tensor | None,
    weights: torch.Tensor,
    m: int,
) -> torch.Tensor:
    """``(P, E, m, k, H)``: sample ``j``'s part ``w_{e,j} sum_b <sigma_{j,b}, J_X D_i v>^2`` of the Gauss-Newton
    quotient of each Lanczos member ``(variant i, estimate e, kind)`` at its unit Ritz vector ``v`` (:func:`debias`'s
    ``shares``; the block's own functional part is exact and has none), ``w_{e,j}`` = ``weights[e, j]`` the
    estimate's sample weight (``1/k`` on all, ``1/k_a`` on one half's: :meth:`SampledCurvature.counts`), ``D_0 = 1``
    and ``D_1 = D`` (``P = 2``; ``D`` None: ``P = 1``).

    ``ritz`` ``(P E m, H, size)``: the members' Ritz vectors in the rows' order of :func:`sampled_plan` (row ``m (i E
    + e) + kind``); ``view``: maps the operator to the one the block is read from; ``D``: the block's ``P^{-1/2}`` in
    the base operator's layout (the view's: same entries, order). Products of at most :data:`MEMBER_ROWS` rows (the
    members' own) through the operator's outer part (:class:`_Recorder`), the preconditioned rows scaled on the way
    in."""
    E, k = weights.shape
    v = ritz / ritz.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(ritz.dtype).tiny)  # (a zero vector: no share)
    if D is not None:
        v[E * m :] *= D.reshape(v.shape[1:])
    recorder = _Recorder(curvature)
    member_op = view(with_sampled(op, recorder))
    products = range(0, v.shape[0], MEMBER_ROWS)
    for start in products:
        rows = v[start : start + MEMBER_ROWS]
        pair_matvec(member_op, (X, X), ("outer",) * rows.shape[0])[1](rows)
    if len(recorder.coefficients) != len(products):  # (an operator applies its output curvature once per product)
        raise RuntimeError(f"{len(recorder.coefficients)} applications of the output curvature in {len(products)}")
    q = torch.cat(recorder.coefficients).square().sum(2)  # (P E m, k, H)
    return q.view(-1, E, m, k, q.shape[-1]) * weights.view(1, E, 1, k, 1)


def _gram_columns(
    op: BlockOperator,
    X: str,
    curvature: SampledCurvature,
    view: Callable[[BlockOperator], BlockOperator] = lambda o: o,
) -> torch.Tensor:
    """The columns ``A_{jb} = J_X^T sigma_{j,b}`` of the sampled Gauss-Newton block of ``op`` (``J_X^T C J_X = A
    A^T / k``, ``C`` block-diagonal over the sequences ``b``), ``(H, k B, size)``: column ``j B + b`` of head ``h``
    is ``A[h, j B + b]``. One operator product per column (in chunks of :data:`GRAM_CHUNK`: the outer part of a zero
    tangent with a stand-in curvature that returns the samples), written in place. ``view``: a grouped-query view whose
    ``gram_columns`` hold ``X`` (``_GroupView``: ``X`` per kv group; ``_QueryView``: ``Q`` per query head) or none.
    """
    k, B = curvature.sigma.shape[:2]
    n = k * B
    emb = _Embedding(view(op), [X])
    A = torch.empty((emb.H, n, emb.n), dtype=op.dtype, device=op.device)
    for start in range(0, n, GRAM_CHUNK):
        stop = min(n, start + GRAM_CHUNK)
        _, mv = pair_matvec(
            view(with_sampled(op, _Columns(curvature.sigma, start, stop))), (X, X), ("outer",) * (stop - start)
        )
        zero = torch.zeros((stop - start, emb.H, emb.n), dtype=op.dtype, device=op.device)
        A[:, start:stop] = mv(zero).transpose(0, 1)  # (H, chunk, size): J_X^T sigma_{j,b}
    return A


def _gram_matrices(
    A: torch.Tensor, curvature: SampledCurvature, scales: Sequence[torch.Tensor | None]
) -> list[torch.Tensor]:
    """The Gram matrices ``A^T D^2 A / k`` of the sampled Gauss-Newton block ``J_X^T C J_X = A A^T / k`` (and of its
    preconditioned ``D (.) D``), ``(H, k B, k B)`` float64 per entry of ``scales`` (``D`` in the layout of the block's
    tangent rows, None for 1): their nonzero eigenvalues are the block's (:func:`_gram_eigen`).

    ``A`` ``(H, k B, size)``: the columns of :func:`_gram_columns`. Built a chunk of rows at a time (no scaled copy of
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


def _gram_eigen(
    items: Sequence[tuple],
    curvature: SampledCurvature,
    split: bool,
    dtype: torch.dtype,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The largest eigenvalues of sampled Gauss-Newton blocks from their Gram matrices, all in one batch.

    ``items``: ``(label, G, A, D, ...)`` each (the label and what follows ``D`` are the caller's): ``G`` ``(H, k B, k
    B)`` of :func:`_gram_matrices` (all of one ``k B``), ``A`` its columns where the top eigenvectors are wanted (else
    None), ``D`` its scale (None: 1). Per item ``(values, tops)``: ``values`` ``(E, H)`` in ``dtype``: with ``split``
    the full sample and its two halves (``E = 3``, as :meth:`SampledCurvature.halves`), else the full sample only; a
    half's eigenvalues are those of its diagonal block of ``G`` (``j < k/2``, the first ``(k/2) B`` columns) times ``k
    / k_a``. ``tops`` ``(E, H, size)``: the top eigenvector of each estimate's Gauss-Newton block, unnormalised, in
    the layout of ``A``'s rows: ``D A_S u`` for the top eigenvector ``u`` of the estimate's Gram block (columns
    ``S``). With ``split`` and halves of at least 2 samples (:func:`_has_shares`), a third entry ``shares`` ``(E, k,
    H)``: sample ``j``'s part of each estimate's value at
    its top eigenvector (:func:`debias`'s ``shares``), ``lambda_e sum_b u_{j B + b}^2`` (the unit top eigenvector
    ``v`` of the estimate's block ``sum_c w_c (D A_c) (D A_c)^T`` has ``w_c <D A_c, v>^2 = lambda_e u_c^2``); else
    None.

    Exact eigenvalues (float64) instead of the Lanczos runs of every estimate and preconditioning. Every item's
    matrices go through one ``eigh`` (the halves, when of one size, through a second): on a GPU each call on small
    matrices costs milliseconds whatever the batch (issue 23: 791 calls took 2.8 s), and a kernel call has up to
    three pairs x two preconditionings x three estimates of them (:func:`sampled_plan` batches them while the
    matrices stay within the largest pair's Gram columns: all of them at realistic sizes).
    """
    k, B = curvature.sigma.shape[:2]
    _, ka, kb = curvature.counts
    n = items[0][1].shape[-1]
    half = ka * B  # sample j = r // B: the first half's columns come first
    G = items[0][1] if len(items) == 1 else torch.cat([item[1] for item in items])  # (S, k B, k B)
    S = G.shape[0]
    shared = split and _has_shares(curvature.counts)
    want = shared or any(item[2] is not None for item in items)  # (the shares need the eigenvectors too)

    def tops_of(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # (top eigenvalues, their vectors)
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
#: ``(1 + q) full - q mean(a, b)`` (``q = 1`` for equal halves) carries every member's error into the estimate,
#: weighted (:func:`extrapolated_residual`: about 3 times a member's relative error where the bias is small, more
#: where the correction is a large part of ``full``): with members solved to ``tol`` itself a debiased
#: ``sharpness/W1W1`` read 29% below a tight solve of the same samples while its members' residuals said 0.9%
#: (session 15: HF GPT-2 d 128 at its initial weights, warm starts, 16 samples, the monitor's tol 1e-2; the
#: correction there was 13 times the estimate); at 0.2 the same keys were within 0.1% of the tight solve. The
#: ``residual/...`` keys stay the members' (their Lanczos convergence); the bound of the members' error carried
#: through the extrapolation is added to ``sharpness_spread``.
MEMBER_TOL = 0.2


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
    q = _richardson_q(counts)
    err = residuals * values.abs()
    return ((1 + q) * err[0] + q / 2 * (err[1] + err[2])) / estimate.abs()


def _has_shares(counts: tuple[int, int, int]) -> bool:
    """Whether :func:`debias` reads its noise from ``shares`` for the sample counts ``(k, k_a, k_b)``: both halves of
    at least 2 samples (a half of one has no variance to read); else the halves' half-difference."""
    return min(counts[1:]) >= 2


def _richardson_q(counts: tuple[int, int, int]) -> float:
    """``q`` of the extrapolation ``estimate = (1 + q) full - q mean(a, b)`` from the sample counts ``(k, k_a, k_b)``:
    ``1 / (k h - 1)``, ``h`` the mean of ``1 / k_a`` and ``1 / k_b`` (``q = 1`` for equal halves)."""
    k, ka, kb = counts
    return 1 / (k * (1 / ka + 1 / kb) / 2 - 1)


#: How far beyond the extrapolation's own correction the reported uncertainty reaches (see :func:`debias`).
SPREAD_FACTOR = 0.5

#: The reported uncertainty's noise term is this many standard errors of the debiased estimate (:func:`debias`'s
#: ``shares``: the delta method over the samples, ``k - 2`` degrees of freedom, where the halves' difference, which
#: it replaced in session 25, had one). Measured (session 25, ``python -m benchmarks.bench_sharpness --bias --width
#: 32 64 128 --ks 16,64 --seeds 3``: held-out HF GPT-2, ``W2W2`` of both layers and ``VV/h0``: 54 estimates): the
#: spread with 2 standard errors covered the exact value in 54 of 54, with the halves' half-difference in 44 (it
#: missed 10 of the 18 ``VV/h0`` ones, whose debiased values read up to 26% off). Without the correction's part,
#: one standard error alone covered 42 (a ``/tmp`` script on the same samples' Gram columns).
NOISE_SE = 2.0

#: A debiased key is given a value only where its relative uncertainty (:func:`debias`'s spread plus the members' error,
#: ``sharpness_spread``) is at most this: beyond it the value is not known to within its own size (the extrapolation's
#: correction alone is then above twice the estimate, or two standard errors above it). Measured (session 25, the 54
#: estimates of :data:`NOISE_SE`): at ``k = 16`` every ``W2W2`` estimate (errors 11-89%) is above it and every ``VV/h0``
#: one (errors 0-26%, each within its spread) below; at ``k = 64``, 13 of the 18 ``W2W2`` estimates (errors 0-36%, each
#: within its spread) are below it, and every ``VV/h0`` one. (Until session 25: 0.5 on the halves' half-difference plus
#: the correction's part, which withheld 8 of those 18 at ``k = 64``.) With **one** kept sequence of 512 tokens (``k B``
#: = 16 columns, a long-context model's case; d 32 and d 64) the values read 2.7-4.1x the exact ones (the plain value
#: 16-38x). Such a key gets no value (NaN, "no data", in the engine; left out of a direct call's result), its
#: ``sharpness_spread`` is still logged, and the monitor names it once (:func:`curvwatch.sharpness.unresolved_keys`).
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
    q = _richardson_q(counts)
    correction = ((a + b) / 2 - full) * q  # c / k
    est = full - correction
    if psd:
        est = est.clamp_min(0)
    if shares is None or not _has_shares(counts):  # (a half of one sample has no variance to read)
        noise = (a - b).abs() / 2
    else:
        ka = counts[1]
        t = (1 + q) * shares[0] - (q / 2) * (shares[1] + shares[2])  # (k, H)
        noise = NOISE_SE * (t[:ka].var(0) * ka + t[ka:].var(0) * (counts[0] - ka)).sqrt()
    width = noise + SPREAD_FACTOR * correction.abs()
    return est, width / est.abs()  # inf or nan where the estimate is 0 (the caller logs none)
