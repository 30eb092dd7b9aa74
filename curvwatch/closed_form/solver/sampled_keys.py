"""The sampled keys' plan: Gram columns first, then the Lanczos runs of their members, then the debiased keys.

:func:`sampled_plan` turns the diagonal pairs of an operator with sampled output curvature
(:func:`~.sampled.with_sampled`) into a :class:`~.plan.Planned`: every pair's Gram columns and Gram eigenvalues are
made before it returns (the ``ggn`` keys where the Gram is small, :mod:`~.gram`), the members left (the ``sharpness``
keys, and the ``ggn`` ones where the Gram is large) are planned as Lanczos runs (:mod:`~.members`), and the plan's
``finish`` debiases and names the keys (:mod:`~.debiasing`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..settings import INPUTS_CHECKED, Lanczos
from . import debiasing
from .debiasing import debias, extrapolated_residual, has_shares
from .gram import gram_columns, gram_eigen, gram_matrices
from .members import member_shares, members_matvec
from .operator import BlockOperator, head_keys, pair_blocks, pair_matvec, stackable
from .plan import Planned, norm_results, norm_run, run_basis_bytes, solve_planned
from .sampled import Preconditioned, SampledCurvature, with_sampled

__all__ = ["GRAM_STEPS", "MEMBER_TOL", "SAMPLED_NAMES", "sampled_norms", "sampled_plan"]

#: The new keys per diagonal pair: ``{prefix}{name}/{XX}[/{head}]`` for prefix ``""`` and ``"precond_"``.
SAMPLED_NAMES = ("ggn", "sharpness")

#: The Gauss-Newton keys come from the samples' Gram matrix (:func:`~.gram.gram_eigen`: exact, one operator product per
#: column) instead of Lanczos members where its ``k B`` columns (samples times kept sequences) are at most this many
#: times the Lanczos members they replace (every member of a block whose own functional term is zero, else the GGN
#: ones), and at most ``max_basis`` times (memory: the columns ``A``, ``(k B, H, n)``, then take no more than the
#: replaced members' Lanczos bases, ``max_basis`` vectors each). A sampled run takes 8-28 products (it stops when its
#: slowest member has converged), and a Gram column costs one row of a product (its tangent is zero, the operator
#: still runs it); beyond about 12 columns per member the Gram takes more time on a CPU. Compare settings side by
#: side with ``python -m benchmarks.bench_sharpness --sampled GRAM_STEPS=4,12 --width W --batch B``.
GRAM_STEPS = 12

#: The Lanczos members of a debiased key are solved to this fraction of the key's ``tol``. The extrapolation
#: ``(1 + q) full - q mean(a, b)`` (``q = 1`` for equal halves) carries every member's error into the estimate,
#: weighted (:func:`~.debiasing.extrapolated_residual`: about 3 times a member's relative error where the bias is
#: small, more where the correction is a large part of ``full``): with members solved to ``tol`` itself a debiased
#: ``sharpness/W1W1`` can read tens of percent below a tight solve of the same samples while its members' residuals say
#: 1% (HF GPT-2 d 128 at its initial weights, 16 samples, tol 1e-2, where the correction is 13 times the estimate); at
#: 0.2 the same keys are within 0.1% of the tight solve. The ``residual/...`` keys stay the members' (their Lanczos
#: convergence); the bound of the members' error carried through the extrapolation is added to ``sharpness_spread``.
MEMBER_TOL = 0.2


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
    preconditioned ones those of :class:`~.sampled.Preconditioned` ``(op, {X: D})``. The sharpness keys run in one
    batched Lanczos for the largest *algebraic* eigenvalue (``lanczos_max_abs(algebraic=True)``), warm-started under
    the key ``("sharpness", XX, prefixes, estimates, "hessian")``. The GGN keys come from the samples' Gram matrix where
    it is small (:func:`~.gram.gram_eigen`: ``k B`` at most :data:`GRAM_STEPS` (and ``max_basis``) times the Lanczos
    members it replaces, no ``view`` or one whose ``gram_columns`` hold ``X``; exact eigenvalues, ``residual/...`` 0),
    and the sharpness members then start at their estimate's top Gauss-Newton direction (the samples are new at every
    evaluation, so the last evaluation's Ritz vector is of another matrix; no warm start is kept) and take their
    Gauss-Newton part from the Gram columns; else they join the same Lanczos run (two members per estimate, warm-start
    key ``("sharpness", XX, prefixes, estimates)``). The members of a debiased key are solved to :data:`MEMBER_TOL`
    times ``lanczos.tol``. For the pairs in ``linear`` (``F`` linear in ``X``: the block's own functional term is
    zero, e.g. ``VV``, ``W2W2``) the sharpness *is* the GGN: no Lanczos runs for them where the Gram is used. Every
    pair's Gram columns are made first, then the pairs' Lanczos runs are solved together (one host read per round of
    stopping tests for all of them; at most ``lanczos.solve_bytes`` of bases at once).

    With ``k >= 2`` samples the largest eigenvalue of the Monte-Carlo matrix is biased upward, by about ``c / k``
    (the few-sample Gram matrix's largest eigenvalue; ``c`` grows with the block). Each key is then debiased
    (:func:`~.debiasing.debias`): the same Lanczos also runs on the two independent halves of the samples (the Gram
    matrix's diagonal blocks), and the bias is extrapolated away from the full and the half-sample values
    (Richardson); ``sharpness_spread/XX[/h{i}]`` is the uncertainty of ``sharpness/XX``, relative.

    Args:
        op: the base operator with sampled curvature (:func:`~.sampled.with_sampled`).
        pairs: diagonal pair names such as ``"QQ"``, ``"W1W1"``.
        lanczos: the Lanczos settings.
        scale: ``block name -> D = P^{-1/2}`` in ``op``'s layout (see :class:`~.sampled.Preconditioned`).
        view: maps the (possibly preconditioned) base operator to the operator the blocks are read from (the
            grouped-query views); default the operator itself.
        linear: the pairs of ``pairs`` whose functional block is zero (the kernel knows them).
    """
    plan = sampled_plan(op, [(pairs, view, linear)], lanczos=lanczos, scale=scale)
    return solve_planned([plan], lanczos.solve_bytes)[0][0]


@dataclass
class _PairJob:
    """One diagonal pair of :func:`sampled_plan`: its view's index ``part`` and its block, its variants' prefixes,
    ``raw`` keys ``{name: ((P, E, H) values, relative residuals)}`` (the Gram's, then its run's) and their ``shares``
    (with the debiasing: ``{name: (P, E, k, H)}``, :func:`~.debiasing.debias`), the Gram ``columns`` and the sharpness
    members' ``tops`` until its run's product takes them, and, where it has a Lanczos run (``planned``), that run's
    keys ``names`` (``m`` parts per member), warm-start ``key``, settings ``members``, whether it starts at vectors of
    its own (``own_start``: nothing kept for the next evaluation), and which of the plan's runs (``run``) and which of
    that run's rows (``rows``) are the pair's (pairs that stack share a run)."""

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


@dataclass
class _Estimates:
    """The estimates of one :func:`sampled_plan` call: the base operator ``op`` with its sampled ``curvature``, the
    preconditioners ``scale``; with ``split`` (``k >= 2``: debiased keys) the full sample and its two halves
    (``ops``, independent, each unbiased; their sample ``counts``), with ``shared`` the debiased keys' noise from each
    sample's part of the members' values (``weights``: each estimate's sample weights, ``(3, k)``)."""

    op: BlockOperator
    curvature: SampledCurvature | None
    scale: Mapping[str, torch.Tensor]
    split: bool
    shared: bool
    weights: torch.Tensor | None
    ops: list[BlockOperator]
    counts: tuple[int, int, int] | None

    @property
    def E(self) -> int:
        return len(self.ops)

    def wrap(self, o: BlockOperator, prefix: str, X: str, view) -> BlockOperator:
        """The operator a variant's block ``X`` is read from: ``o`` (preconditioned where ``prefix``) under ``view``."""
        return view(Preconditioned(o, {X: self.scale[X]})) if prefix else view(o)


def _estimates(op: BlockOperator, scale: Mapping[str, torch.Tensor]) -> _Estimates:
    curvature = getattr(op, "sampled", None)
    split = curvature is not None and curvature.k >= 2
    shared = split and has_shares(curvature.counts)
    weights = torch.stack(curvature.estimate_weights(3, op.dtype, op.device)) if shared else None  # (3, k)
    ops = [op, *(with_sampled(op, c) for c in curvature.halves())] if split else [op]
    counts = curvature.counts if split else None
    return _Estimates(op, curvature, scale, split, shared, weights, ops, counts)


class _GramBatch:
    """The Gram matrices waiting for their eigenvalues, decomposed in batches (:func:`~.gram.gram_eigen`) that stay
    within the largest pair's Gram columns; ``values[job]`` collects each job's ``((E, H) eigenvalues, (E, k, H)
    shares)`` per variant and the members' start vectors go to the job's ``tops``."""

    def __init__(self, est: _Estimates):
        self.est = est
        self.grams: list = []  # (job, Gram matrix, columns where its top eigenvectors are wanted, scale, their list)
        self.values: dict[int, list[tuple]] = {}
        self.bytes = 0

    def add(self, job: int, A: torch.Tensor, tops: list | None, scales: list) -> None:
        """The Gram matrices of a pair's columns ``A``, one per variant's ``scales`` (``None``: 1)."""
        self.bytes = max(self.bytes, A.numel() * A.element_size())
        for G, D in zip(gram_matrices(A, self.est.curvature, scales), scales, strict=True):
            if self.grams and sum(g.numel() for _, g, *_ in self.grams) * 8 + G.numel() * 8 > self.bytes:
                self.flush()  # (the matrices decomposed at once stay within the largest pair's columns)
            self.grams.append((job, G, None if tops is None else A, D, tops))

    def flush(self) -> None:
        """The eigenvalues (and the members' start vectors) of the matrices waiting, in one batch."""
        if not self.grams:
            return
        est = self.est
        for (j, _, _, _, tops), (values, top, shares) in zip(
            self.grams, gram_eigen(self.grams, est.curvature, est.split, est.op.dtype), strict=True
        ):
            self.values[j].append((values, shares))
            if top is not None:
                tops.append(top)
        self.grams.clear()


def sampled_plan(
    op: BlockOperator,
    views: Sequence[tuple[Sequence[str], Callable[[BlockOperator], BlockOperator] | None, Collection[str]]],
    *,
    lanczos: Lanczos,
    scale: Mapping[str, torch.Tensor] | None = None,
) -> Planned:
    """The Lanczos runs of :func:`sampled_norms` for several views ``(pairs, view, linear)`` of one operator (the
    grouped-query kernel's ``QQ`` per query head and ``KK``, ``VV`` per kv group) as a :class:`~.plan.Planned`,
    every Gram column made (the ``ggn`` keys where the Gram is used) before it returns; its ``finish`` gives the dicts
    of keys, one per view.

    A kernel solves it with its own runs (:func:`~.plan.solve_planned`), so that their stopping tests share host
    reads; made before them, so that no Gram product's temporaries meet a Lanczos basis. Every pair's Gram columns
    first (a pair without Lanczos members lets go of its columns at once), then every pair's Lanczos run, then all
    the runs in one solve.
    """
    est = _estimates(op, {} if scale is None else scale)
    viewed = [_view(est, view) for _, view, _ in views]
    jobs = _gram_jobs(est, views, viewed, lanczos)
    makers: list = []  # (make a run, its basis's bytes), in the order of the jobs with a run
    for group in _run_groups(jobs, viewed):
        _plan_members(est, group, viewed[group[0].part], lanczos, makers)

    def finish(runs: list) -> list[dict[str, torch.Tensor]]:  # the keys, from the solved runs (in order)
        _read_runs(est, jobs, viewed, runs)
        return _sampled_keys(est, jobs, viewed, len(views))

    return Planned(makers, finish, together=False)


def _view(est: _Estimates, view) -> tuple:
    """``(view, the viewed operator, whether its members stack, the blocks its Gram columns may be read for)``.

    The members (estimates x preconditionings) go as rows of shared products where the viewed operator has the
    one-pass ``apply_masked``, which applies the output curvature to every row (the per-row sample weights line up
    with the rows). The Gram columns ``J_X^T sigma`` go through the base operator or a view that keeps them for block
    ``X`` (``gram_columns``: the grouped-query views); ``None``: every block."""
    plain_view = view is None
    view = (lambda o: o) if view is None else view
    viewed = view(est.op)
    one_pass = getattr(viewed, "head_diagonal", False) and getattr(viewed, "apply_masked", None) is not None
    stack_ok = isinstance(est.curvature, SampledCurvature) and one_pass
    gram_blocks = None if plain_view else getattr(viewed, "gram_columns", frozenset())
    return view, viewed, stack_ok, gram_blocks


def _gram_jobs(est: _Estimates, views, viewed, lanczos: Lanczos) -> list[_PairJob]:
    """One job per pair, its Gram columns made and its ``ggn`` keys (and, where ``F`` is linear in its block, its
    ``sharpness`` keys) read from the Gram matrices where the Gram path is taken."""
    curvature, E = est.curvature, est.E
    columns = curvature.k * curvature.sigma.shape[1] if isinstance(curvature, SampledCurvature) else None
    gram_limit = GRAM_STEPS if lanczos.max_basis is None else min(GRAM_STEPS, lanczos.max_basis)
    jobs: list[_PairJob] = []
    batch = _GramBatch(est)
    linear_jobs: set[int] = set()  # the jobs of pairs in which F is linear (their sharpness is their GGN)
    for part, ((pairs, _, linear), (view, op_view, _, gram_blocks)) in enumerate(zip(views, viewed, strict=True)):
        gram_ok = columns is not None and getattr(op_view, "head_diagonal", False)
        for pair_name in pairs:
            X, Y = pair_blocks(pair_name, list(op_view.params))
            if X != Y:
                raise ValueError(f"Sampled sharpness is defined for diagonal pairs only; got {pair_name!r}.")
            prefixes = [""] + (["precond_"] if X in est.scale else [])
            replaced = E * len(prefixes) * (2 if pair_name in linear else 1)  # the Lanczos members the Gram replaces
            gram = gram_ok and (gram_blocks is None or X in gram_blocks) and columns <= gram_limit * replaced
            A = tops = None
            if gram:
                batch.values[len(jobs)] = []
                A = gram_columns(est.op, X, curvature, view)
                tops = None if pair_name in linear else []  # the sharpness members' starts
                batch.add(len(jobs), A, tops, [est.scale.get(X) if p else None for p in prefixes])
                if pair_name in linear:  # F linear in X: the Hessian block is its outer part (no members)
                    A = None
                    linear_jobs.add(len(jobs))
            # raw[name]: (P, E, H) values (variants: plain, preconditioned; estimates: full, halves) and residuals
            jobs.append(_PairJob(part, pair_name, X, prefixes, {}, A, tops))
    batch.flush()  # the Gram matrices left
    for j, values in batch.values.items():
        job = jobs[j]
        ggn = torch.stack([v for v, _ in values])  # (P, E, H)
        job.raw["ggn"] = (ggn, torch.zeros_like(ggn))
        if est.shared:
            job.shares["ggn"] = torch.stack([sh for _, sh in values])  # (P, E, k, H)
        if j in linear_jobs:  # F linear in X: its sharpness is its GGN
            job.raw["sharpness"] = job.raw["ggn"]
            if est.shared:
                job.shares["sharpness"] = job.shares["ggn"]
    return jobs


def _run_groups(jobs: list[_PairJob], viewed) -> list[list[_PairJob]]:
    """The jobs with Lanczos members, in runs: consecutive pairs of one view whose blocks stack (the attention's
    ``QQ`` and ``KK``, one Lanczos step per step for both) share a run, the others have one each."""
    groups: list[list[_PairJob]] = []
    for job in jobs:
        job.names = [nm for nm in SAMPLED_NAMES if nm not in job.raw]
        if not job.names:
            job.columns = job.tops = None
            continue
        last = groups[-1][-1] if groups else None
        _, op_view, stack_ok, _ = viewed[job.part]
        if (
            stack_ok
            and last is not None
            and last.part == job.part
            and last.names == job.names
            and last.prefixes == job.prefixes
            and (last.columns is None) == (job.columns is None)
            and bool(last.tops) == bool(job.tops)
            and stackable(op_view, [g.pair for g in groups[-1]] + [job.pair])
        ):
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups


def _plan_members(est: _Estimates, group: list[_PairJob], viewed, lanczos: Lanczos, makers: list) -> None:
    """The Lanczos run of a group of jobs' members, planned: its maker appended to ``makers``, the jobs told their
    run and rows."""
    job = group[0]
    prefixes, names = job.prefixes, job.names
    view, op_view, stack_ok, _ = viewed
    parts_one = tuple({"ggn": "outer", "sharpness": "hessian"}[nm] for nm in names)
    m, E = len(parts_one), est.E
    # run r = (g P + i) E + e (the group's pair g, variant i, estimate e) owns the rows m r ... m r + m - 1
    if stack_ok:  # the members as rows of few products; with the Gram columns held, the Gauss-Newton part is A W A^T
        blocks = [(g.block, est.scale[g.block] if len(prefixes) > 1 else None, g.columns) for g in group]
        emb, mv = members_matvec(est.op, blocks, est.curvature, E, parts_one, view)
        del blocks
    else:
        emb, mv = _member_runs(est, job.block, prefixes, parts_one, view)
    parts = parts_one * (len(prefixes) * E * len(group))
    pair = "+".join(g.pair for g in group)
    key = ("sharpness", pair, tuple(prefixes), E) + (() if m == 2 else parts_one)
    # the members of a debiased key tighter than the key (see MEMBER_TOL); the warm starts are the same store
    # (no second look: a sampled estimate's own uncertainty, sharpness_spread, exceeds what it would find)
    members = lanczos.replace(tol=lanczos.tol * MEMBER_TOL if est.split else lanczos.tol, second_look=False)
    # (P E, H, size) per pair: member i E + e (parts_one is ("hessian",) where the Gram made the GGN keys) starts at its
    # estimate's top Gauss-Newton direction
    v0 = None if not job.tops or m != 1 else torch.cat([t for g in group for t in g.tops])
    # the run is made when its solve starts (its basis allocated at its first step): a lone solve keeps one basis at a
    # time
    make = functools.partial(norm_run, op_view, emb, mv, parts, key, True, members, algebraic=True, v0=v0)
    makers.append((make, run_basis_bytes(len(parts), emb, members, op_view.dtype)))
    rows = m * len(prefixes) * E
    for g_index, g in enumerate(group):
        g.columns = g.tops = None  # (the run's product holds the columns from here on)
        g.planned, g.m, g.key, g.members = True, m, key, members
        g.own_start, g.run = v0 is not None, len(makers) - 1
        g.rows = None if len(group) == 1 else slice(g_index * rows, (g_index + 1) * rows)  # (None: every row)


def _member_runs(est: _Estimates, X: str, prefixes: list[str], parts_one: tuple[str, ...], view):
    """``(emb, mv)`` of a pair's members where they cannot share products: one :func:`~.operator.pair_matvec` per
    member, each its own operator (variant, estimate)."""
    m = len(parts_one)
    runs = [pair_matvec(est.wrap(o, prefix, X, view), (X, X), parts_one) for prefix in prefixes for o in est.ops]

    def mv(u: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        pieces = []
        for i, (_, f) in enumerate(runs):  # the members of each run, each its own operator
            rows = slice(m * i, m * i + m)
            pieces.append(f(u[rows], None if live is None else live[rows]))
        return torch.cat(pieces)

    return runs[0][0], mv


def _read_runs(est: _Estimates, jobs: list[_PairJob], viewed, runs: list) -> None:
    """Each planned job's ``raw`` values and residuals (and, debiased with shares, its members' ``shares``) from the
    solved runs; each run read once."""
    read: dict[int, tuple[torch.Tensor, ...]] = {}  # run -> (values, residuals, Ritz vectors)
    E = est.E
    for job in jobs:
        if not job.planned:
            continue
        if job.run not in read:
            run = runs[job.run]
            read[job.run] = (
                (run.norm, run.rel_residual) if job.own_start else norm_results(run, job.key, job.members)
            ) + (run.ritz,)
            run.matvec = None  # (its product's tensors, the Gram columns among them)
        vals, rel, ritz = read[job.run] if job.rows is None else (t[job.rows] for t in read[job.run])
        P, m = len(job.prefixes), job.m
        for j, name in enumerate(job.names):  # part j of run i E + e is row m (i E + e) + j
            job.raw[name] = (vals[j::m].view(P, E, -1), rel[j::m].view(P, E, -1))
        if est.shared:  # each sample's part of each member's value at its Ritz vector: (P, E, m, k, H)
            D = est.scale[job.block] if len(job.prefixes) > 1 else None
            view = viewed[job.part][0]
            shares = member_shares(est.op, job.block, est.curvature, ritz, view, D, est.weights, m)
            for j, name in enumerate(job.names):
                job.shares[name] = shares[:, :, j]


def _sampled_keys(est: _Estimates, jobs: list[_PairJob], viewed, n_views: int) -> list[dict[str, torch.Tensor]]:
    """The keys of every view from the jobs' ``raw`` values: every pair and variant of a name at once, ``(E, sum of
    P H)`` values, the plain variants (prefix ``""``) first; debiased where ``split``, a value withheld where its
    spread is above :data:`~.debiasing.SPREAD_LIMIT`."""
    outs: list[dict[str, torch.Tensor]] = [{} for _ in range(n_views)]
    if not jobs:
        return outs
    order = [(job, i) for i in range(2) for job in jobs if i < len(job.prefixes)]
    keys: list[tuple[int, str]] = []  # (view, key with {} for the name) of each column
    for job, i in order:
        prefix = job.prefixes[i]
        op_view = est.wrap(est.op, prefix, job.block, viewed[job.part][0])
        keys += [(job.part, k) for k in head_keys(op_view, f"{prefix}{{}}/{job.pair}", (job.block,))]
    n_plain = sum(job.raw["ggn"][0].shape[-1] for job in jobs)  # (the plain variants' columns)
    withheld: list[tuple[list[tuple[int, str]], torch.Tensor]] = []  # (keys, unresolved) of the debiased values
    spread_keys, spread = [(part, k.format("sharpness_spread")) for part, k in keys[:n_plain]], None
    for name in SAMPLED_NAMES:
        vals = torch.cat([job.raw[name][0][i] for job, i in order], 1)
        rel = torch.cat([job.raw[name][1][i] for job, i in order], 1)
        named = [(part, k.format(name)) for part, k in keys]
        value = vals[0]
        if est.split:
            shares = torch.cat([job.shares[name][i] for job, i in order], -1) if est.shared else None  # (E, k, .)
            value, width = debias(*vals.unbind(), est.counts, psd=name == "ggn", shares=shares)
            width = width + extrapolated_residual(vals, rel, est.counts, value)
            # unresolved: no value (NaN, "no data"); a spread of 0/0 (every estimate 0) is a resolved 0
            unresolved = width > debiasing.SPREAD_LIMIT
            value = value.masked_fill(unresolved, torch.nan)
            withheld.append((named, unresolved))
            if name == "sharpness":  # the plain variants': 0/0 is "no data", no key (decided below)
                width, plain = width[:n_plain], value[:n_plain]
                spread = (width, torch.isfinite(width) & (plain != 0))
        for (part, k), v, r in zip(named, value.unbind(), rel.amax(0).unbind(), strict=True):
            outs[part][k] = v
            outs[part][f"residual/{k}"] = r
    if spread is not None:
        _spread_keys(outs, spread_keys, spread, withheld)
    return outs


def _spread_keys(outs: list[dict], spread_keys: list, spread: tuple, withheld: list) -> None:
    """The ``sharpness_spread`` keys that have data, and the unresolved values left out."""
    if INPUTS_CHECKED.get():
        # the monitor's engine: NaN marks "no data" and its logbook drops the key in its one read of every value
        # (the unresolved values are NaN already)
        for (part, k), v in zip(spread_keys, torch.where(spread[1], spread[0], torch.nan).unbind(), strict=True):
            outs[part][k] = v
        return
    # one host read: which spreads have data, which values are unresolved
    flags = iter(torch.cat([spread[1]] + [u for _, u in withheld]).tolist())
    for (part, k), v in zip(spread_keys, spread[0].unbind(), strict=True):
        if next(flags):
            outs[part][k] = v
    for named, _ in withheld:
        for part, k in named:
            if next(flags):
                del outs[part][k]
