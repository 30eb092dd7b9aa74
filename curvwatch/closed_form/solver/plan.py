"""Lanczos runs planned, made and solved: the spectral norms of a :class:`~.operator.BlockOperator`'s blocks.

A kernel plans the runs of its norms (:func:`spectral_plan`: one run per block pair, or one for diagonal pairs that
stack), and :func:`solve_planned` makes and solves the runs of several plans together: their stopping tests share
host reads (one sync per round of tests for all of them), within a budget of bytes of Lanczos bases held at once, and
the runs whose vectors have one size become one :class:`~.lanczos.LanczosRun` (:func:`~.lanczos.merge_runs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..settings import PARTS, Lanczos
from .choices import for_device
from .lanczos import LanczosRun, merge_runs, mergeable, solve, split_results, start_vectors
from .operator import (
    BlockOperator,
    Embedding,
    apply_parts,
    head_keys,
    pair_blocks,
    pair_matvec,
    part_rows,
    skip_dead_parts,
    stackable,
    stacked_matvec,
)

__all__ = [
    "SOLVE_BYTES",
    "Planned",
    "full_norms",
    "norm_results",
    "norm_run",
    "norms_with_a_linear_pair",
    "put_heads",
    "run_basis_bytes",
    "solve_planned",
    "spectral_norms",
    "spectral_plan",
]


def spectral_norms(
    op: BlockOperator,
    pairs: Sequence[str],
    *,
    parts: Sequence[str] = PARTS,
    lanczos: Lanczos,
    skip: Sequence[tuple[str, str]] = (),
) -> dict[str, torch.Tensor]:
    """Spectral norms ``{part}/{pair}[/h{i}]`` of the requested block pairs, by batched Lanczos.

    Args:
        op: the block operator.
        pairs: pair names such as ``"QQ"``, ``"VK"``, ``"W1W2"``.
        parts: subset of ``("outer", "functional", "hessian")``.
        lanczos: the Lanczos settings (tolerance, steps, basis, warm start); the Ritz vectors of each norm
            are stored in its ``warm_start`` and used as start vectors next time.
        skip: ``(part, pair)`` combinations computed elsewhere (exactly) and not needed here.

    Returns:
        Flat dict of 0-d tensors: the norms ``{part}/{pair}[/h{i}]`` and, for each, ``residual/{part}/{pair}[/h{i}]``,
        the relative Lanczos residual of that norm (see :func:`lanczos_max_abs`'s ``info``; ``<= tol`` once
        converged, larger when ``max_iter`` stopped it).
    """
    plan = spectral_plan([(op, pairs)], parts=parts, lanczos=lanczos, skip=skip)
    return solve_planned([plan], lanczos.solve_bytes)[0][0]


@dataclass
class Planned:
    """Lanczos runs planned but not made yet (:func:`solve_planned` makes and solves them).

    Attributes:
        makers: ``[(make, bytes)]``: ``make()`` makes one run (its basis is allocated at its first step), ``bytes``
            its basis at most (:func:`run_basis_bytes`).
        finish: ``finish(runs)``: the plan's results from its runs, solved, in the order of ``makers``.
        together: Its runs always in one solve, whatever their bytes (the engine's own keys);
            otherwise each run may be solved apart from the others once the solve's budget (:func:`solve_planned`)
            is reached.
        merge: Whether its runs may share a solve with other runs at all (``False``: one solve per run).
    """

    makers: list[tuple[Callable[[], LanczosRun], int]]
    finish: Callable[[list[LanczosRun]], Any]
    together: bool = True
    merge: bool = True


#: Runs that could go to one :func:`solve` (:func:`solve_planned`) share it while their Lanczos bases together stay
#: within this many bytes (a plan whose runs always go together, or one run, may hold more alone), unless the kernel's
#: ``lanczos.solve_bytes`` says otherwise: the monitor's engine passes each block's own estimate of its bases
#: (``engine.memory.basis_bytes``), at least this. At GPT-2-small width (d 768, 12 heads, 16 vectors) the attention's
#: engine run and its two sampled runs hold 3 x 216 MiB, the FFN's engine run 432 MiB and its sampled run 864 MiB
#: (within the FFN's estimate, 2,592 MiB of bases: one solve); called directly, at d 4096 one sampled run alone holds
#: 6 GiB, and there the sampled runs go one at a time.
SOLVE_BYTES = 2**30


def run_basis_bytes(rows: int, emb: Embedding, lanczos: Lanczos, dtype: torch.dtype) -> int:
    """The Lanczos basis of a run of ``rows`` members of ``emb``'s operator at most, in bytes (``max_basis``, else
    ``max_iter``, vectors of ``H n`` numbers per member)."""
    vectors = emb.n if lanczos.max_iter is None else min(lanczos.max_iter, emb.n)
    vectors = vectors if lanczos.max_basis is None else min(vectors, lanczos.max_basis)
    return rows * emb.H * emb.n * vectors * dtype.itemsize


def solve_planned(plans: Sequence[Planned], budget: int | None = None) -> list[Any]:
    """Make and solve the runs of ``plans`` in order; each plan's ``finish`` of its runs, in order.

    The runs share solves (one host read per round of stopping tests for all of a solve's runs) while their bases
    together stay within ``budget`` bytes (``None``: :data:`SOLVE_BYTES`; a kernel passes its ``lanczos.solve_bytes``);
    a ``together`` plan's runs are never split, a plan without ``merge`` solves each run alone. A run is made when its
    solve starts, so runs solved one after the other hold one basis at a time. The plans' makers are consumed.
    """
    budget = SOLVE_BYTES if budget is None else budget
    units: list[tuple[list[tuple[int, Callable[[], LanczosRun]]], int, bool]] = []  # ([(plan, make)], bytes, merge)
    for i, plan in enumerate(plans):
        if plan.together and plan.merge:
            if plan.makers:
                units.append(([(i, make) for make, _ in plan.makers], sum(b for _, b in plan.makers), True))
        else:
            units += [([(i, make)], size, plan.merge) for make, size in plan.makers]
    for plan in plans:  # consumed: a maker holds its run's product (and what that holds) until the run is made
        plan.makers = []
    runs: list[list[LanczosRun]] = [[] for _ in plans]
    while units:
        (group, total, merge), units = units[0], units[1:]
        group = list(group)
        while merge and units and units[0][2] and total + units[0][1] <= budget:
            (more, size, _), units = units[0], units[1:]
            group += more
            total += size
        made, solved = _made(group)
        solve(solved)
        for run in solved:
            if run.merged:
                split_results(run)  # (and releases the merged product: the plans' finish reads results only)
        for i, run in made:
            runs[i].append(run)
    return [plan.finish(r) for plan, r in zip(plans, runs, strict=True)]


def _made(group: Sequence[tuple[int, Callable[[], LanczosRun]]]):
    """The runs of one solve, made: ``([(plan, run)], the runs to solve)``.

    The :func:`~.lanczos.mergeable` runs whose vectors have one size, dtype and device and whose ``max_iter`` and
    ``max_basis`` agree are solved as one (:func:`~.lanczos.merge_runs`; :func:`solve_planned` hands each its results):
    one Lanczos step (two Gram-Schmidt passes, the norm, the next vector: ~17 dispatched operators) per step for all of
    their members instead of one per run, and their stopping tests in one host copy (the attention's own ``QQ``+``KK``
    run and its sampled members' run; the FFN's and its sampled run; the grouped-query attention's query-view runs,
    its group-view runs and its grouped ``VV`` run). Each member keeps its own start, tolerance and end of the
    spectrum, and every member of a Lanczos run is its own recurrence: the keys and warm starts are those of one run
    each, to the bit on CPU. A run that several evaluations hold (a ``made_together`` run) is never merged; the others
    are solved as they are."""
    made = [(i, make()) for i, make in group]
    clusters: dict[tuple, list[LanczosRun]] = {}
    for _, run in made:
        if mergeable(run):
            clusters.setdefault((run.n, run.dtype, run.device, run.k_max, run.cap), []).append(run)
    solved = [merge_runs(runs) for runs in clusters.values() if len(runs) > 1]
    merged = {id(r) for run in solved for r, _, _ in run.merged}
    return made, solved + [run for _, run in made if id(run) not in merged]


def norms_with_a_linear_pair(
    op: BlockOperator,
    pairs: Sequence[str],
    linear: str | None,
    *,
    parts: Sequence[str],
    lanczos: Lanczos,
    extra: Sequence[Planned] = (),
) -> dict[str, torch.Tensor]:
    """:func:`spectral_norms` of ``pairs`` where the functional block of the diagonal pair ``linear`` is exactly zero
    (the FFN's ``W1W1`` under ReLU, the gated FFN's ``W3W3``: ``F`` linear in that weight): one outer-only run for it,
    its ``hessian`` keys the outer part and its ``functional`` key 0. The runs and those of the plans ``extra`` (the
    sampled keys' :func:`~.sampled_keys.sampled_plan`, the adapters') in one :func:`solve_planned` (their stopping
    tests share host reads, within ``lanczos.solve_bytes`` of bases); ``extra``'s keys come last, in order."""
    iterative = [p for p in pairs if p != linear]
    zero = linear is not None and linear in pairs
    outer = zero and ("outer" in parts or "hessian" in parts)
    plans = [spectral_plan([(op, [linear])], parts=["outer"], lanczos=lanczos)] if outer else []
    if iterative:
        plans.append(spectral_plan([(op, iterative)], parts=parts, lanczos=lanczos))
    solved = iter(solve_planned(plans + list(extra), lanczos.solve_bytes))
    out: dict[str, torch.Tensor] = {}
    if outer:
        o = next(solved)[0]
        for k in parts:
            if k != "functional":
                out[f"{k}/{linear}"] = o[f"outer/{linear}"]
                out[f"residual/{k}/{linear}"] = o[f"residual/outer/{linear}"]
    if zero and "functional" in parts:
        out[f"functional/{linear}"] = torch.zeros((), dtype=op.dtype, device=op.device)
    if iterative:
        out.update(next(solved)[0])
    for _ in extra:
        out.update(next(solved)[0])
    return out


def spectral_plan(
    views: Sequence[tuple[BlockOperator, Sequence[str]]],
    *,
    parts: Sequence[str] = PARTS,
    lanczos: Lanczos,
    skip: Sequence[tuple[str, str]] = (),
) -> Planned:
    """The Lanczos runs of :func:`spectral_norms` for several ``(operator, pairs)`` views (the grouped-query
    kernel's query and group views of one attention) as a :class:`Planned`, all in one solve (their stopping tests
    share host reads; their bases are held at once, their products made one at a time); its ``finish`` gives the
    dicts of keys, one per view."""
    jobs = []  # (view, pair names, parts, warm-start key): one run per pair, or one for diagonal pairs sharing
    makers: list[tuple[Callable[[], LanczosRun], int]] = []
    for view, (op, pairs) in enumerate(views):
        names = list(op.params)
        todo: dict[tuple[str, ...], list[str]] = {}  # the parts to compute -> the pairs that need them
        for pair_name in pairs:
            ks = tuple(k for k in parts if (k, pair_name) not in skip)
            if ks:
                todo.setdefault(ks, []).append(pair_name)
        for ks, group in todo.items():
            diag = [p for p in group if len(set(pair_blocks(p, names))) == 1]
            # one product for the diagonal pairs of one shape where the device's choice is fewer dispatches
            stack = diag if for_device(op.device).stack_pairs and stackable(op, diag) else []
            if stack:
                emb, mv = stacked_matvec(op, [pair_blocks(p, names)[0] for p in stack], ks)
                key = (tuple(stack), ks)
                rows = list(ks) * len(stack)
                jobs.append((view, stack, ks, key))
                make = functools.partial(norm_run, op, emb, mv, rows, key, True, lanczos)
                makers.append((make, run_basis_bytes(len(rows), emb, lanczos, op.dtype)))
            for pair_name in group:
                if pair_name in stack:
                    continue
                pair = pair_blocks(pair_name, names)
                emb, mv = pair_matvec(op, pair, ks)
                key = (pair_name, ks)
                jobs.append((view, [pair_name], ks, key))
                make = functools.partial(norm_run, op, emb, mv, ks, key, pair[0] == pair[1], lanczos)
                makers.append((make, run_basis_bytes(len(ks), emb, lanczos, op.dtype)))

    def finish(runs: list[LanczosRun]) -> list[dict[str, torch.Tensor]]:
        outs: list[dict[str, torch.Tensor]] = [{} for _ in views]
        for (view, group, ks, key), run in zip(jobs, runs, strict=True):
            op = views[view][0]
            names = list(op.params)
            vals, rel = norm_results(run, key, lanczos)
            vals, rel = vals.unbind(0), rel.unbind(0)  # (H,) rows: one operator each, not one per key
            for g, pair_name in enumerate(group):
                pair = pair_blocks(pair_name, names)
                for i, part in enumerate(ks):
                    heads = head_keys(op, f"{part}/{pair_name}", pair)
                    put_heads(outs[view], heads, vals[g * len(ks) + i], rel[g * len(ks) + i])
        return outs

    return Planned(makers, finish)


def put_heads(out: dict[str, torch.Tensor], keys: Sequence[str], values: torch.Tensor, residuals=None) -> None:
    """``out[keys[h]] = values[h]`` (and ``out["residual/" + keys[h]] = residuals[h]``) for the heads ``h`` of ``(H,)``
    tensors, by one ``unbind`` each (indexing dispatched one operator per head)."""
    for k, v in zip(keys, values.unbind(), strict=True):
        out[k] = v
    if residuals is not None:
        for k, r in zip(keys, residuals.unbind(), strict=True):
            out[f"residual/{k}"] = r


def norm_run(
    op, emb, mv, parts, key, diagonal: bool, lanczos: Lanczos, algebraic: bool = False, v0: torch.Tensor | None = None
) -> LanczosRun:
    """The batched Lanczos run ``(len(parts), H)`` of ``mv``, warm-started from ``lanczos.warm_start`` (or from
    ``v0`` ``(len(parts), H, n)``, when given); with ``algebraic`` it finds the largest eigenvalues instead of the
    norms (drive it with :func:`solve`)."""
    warm = lanczos.warm_start
    shape = (len(parts), emb.H, emb.n)
    v0 = v0 if v0 is not None else None if warm is None else warm.get(key, shape, op.dtype, op.device)
    return LanczosRun(
        mv,
        start_vectors(shape[:2], emb.n, op.dtype, op.device, v0, lanczos.seed),
        tol=lanczos.tol,
        max_iter=lanczos.max_iter,
        max_basis=lanczos.max_basis,
        pass_live=True,
        both_ends=_both_ends(parts, diagonal=diagonal),
        algebraic=algebraic,
        seed=lanczos.seed,
        second_look=lanczos.second_look,
    )


def norm_results(run: LanczosRun, key, lanczos: Lanczos) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, relative residuals)`` of a finished run; its Ritz vectors go into ``lanczos.warm_start``."""
    if lanczos.warm_start is not None:
        lanczos.warm_start.put(key, run.ritz)
    return run.norm, run.rel_residual


def _lanczos_norms(op, emb, mv, parts, key, diagonal: bool, lanczos: Lanczos, algebraic: bool = False, v0=None):
    """``(norms, relative residuals)``, each ``(len(parts), H)``, of ``mv`` by batched Lanczos, warm-started from
    and stored into ``lanczos.warm_start``; with ``algebraic`` the largest eigenvalues instead of the norms. With
    ``v0`` (start vectors made for this call) the run starts there, and its Ritz vectors are not stored (no later
    call reads them)."""
    run = norm_run(op, emb, mv, parts, key, diagonal, lanczos, algebraic, v0)
    solve([run])
    if v0 is not None:
        return run.norm, run.rel_residual
    return norm_results(run, key, lanczos)


def _both_ends(parts: Sequence[str], diagonal: bool) -> np.ndarray:
    """``(len(parts), 1)`` host mask (a numpy array: no tensor to read back): which Lanczos runs must resolve both ends
    of the spectrum.

    Outer (Gauss-Newton) blocks are PSD and off-diagonal blocks are embedded with a spectrum symmetric
    about zero: the largest-magnitude end alone decides. Functional and total diagonal blocks are
    indefinite.
    """
    return np.array([[diagonal and k != "outer"] for k in parts], dtype=bool)


def full_norms(
    op: BlockOperator,
    names: Sequence[str],
    label: str,
    *,
    parts: Sequence[str] = PARTS,
    lanczos: Lanczos,
) -> dict[str, torch.Tensor]:
    """Spectral norms of the whole multi-block Hessian over ``names`` (e.g. Q, K, V), per part and head."""
    emb = Embedding(op, names)

    def make(ks: Sequence[str]):
        rows = part_rows(ks, 1, emb)
        return lambda u: emb.extract(apply_parts(op, emb.embed(u, names), names, rows), names, u.shape[0])

    mv = skip_dead_parts(parts, make)
    vals, rel = _lanczos_norms(op, emb, mv, parts, (label, tuple(parts)), True, lanczos)
    out = {}
    for i, part in enumerate(parts):
        put_heads(out, head_keys(op, f"{part}/{label}", names), vals[i], rel[i])
    return out
