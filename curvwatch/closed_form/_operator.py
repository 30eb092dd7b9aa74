"""Block Hessian operators: spectral norms and dense blocks from closed-form Hessian-vector products.

Every kernel in this package (attention, FFN, whole Transformer block) exposes its Hessian as a
:class:`BlockOperator`: a map from a tangent (one perturbation per weight block) to the Gauss-Newton
("outer") and functional parts of the Hessian applied to it, computed from closed-form Jacobians and
contracted second derivatives, never from autograd. This module turns such an operator into

* the spectral norm of any block ``H_XY`` (restriction to rows of block X, columns of block Y), by batched
  Lanczos on the symmetric operator ``H_XX`` (X = Y) or ``[[0, H_XY], [H_YX, 0]]`` (X != Y), whose
  largest |eigenvalue| is ``sigma_max(H_XY)``;
* the dense block, by applying the operator to a basis (small sizes only; used by tests and docs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._lanczos import LanczosRun, merge_runs, mergeable, solve, split_results
from .settings import Lanczos

KINDS = ("outer", "functional", "hessian")


@dataclass(frozen=True)
class ParamInfo:
    """Shape of one weight block; ``headed`` params carry a leading head dimension ``H``."""

    shape: tuple[int, ...]
    headed: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class BlockOperator:
    """Interface of a closed-form block Hessian operator.

    Attributes:
        params: ``name -> ParamInfo`` for every weight block (e.g. ``"Q"``, ``"W1"``).
        n_heads: ``H``; headed params have tangents of shape ``(nv, H, *shape)``, others ``(nv, *shape)``.
        head_diagonal: True when the operator never couples different heads (attention alone), so the
            vectors of all heads can share one tangent and the per-head blocks come out in one product.
        dtype, device: of the tensors involved.
    """

    params: dict[str, ParamInfo]
    n_heads: int
    head_diagonal: bool
    dtype: torch.dtype
    device: torch.device

    def apply(self, tangent: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Return ``(H_outer v, H_functional v)`` for a batch of ``nv`` tangents ``v``.

        Missing names in ``tangent`` mean a zero perturbation; every param name is present in the outputs.
        """
        raise NotImplementedError

    def _zeros(self, n: int, name: str) -> torch.Tensor:
        """A zero output (or tangent) of block ``name`` for ``n`` vectors: ``(n, H, *shape)`` if headed."""
        info = self.params[name]
        shape = (n, self.n_heads, *info.shape) if info.headed else (n, *info.shape)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)


def run_parts(part, outer_rows, func_rows, total_rows):
    """``(outer, functional[, total])`` of an operator's ``apply``, from ``part(idx, outer, second_order)``.

    A part whose row set is empty is not computed (``{}``); the total is computed only when
    ``total_rows`` is given (operators with ``supports_total``).
    """

    def run(idx, outer: bool, second_order: bool) -> dict:
        return {} if idx is not None and len(idx) == 0 else part(idx, outer, second_order)

    outer, func = run(outer_rows, True, False), run(func_rows, False, True)
    return (outer, func) if total_rows is None else (outer, func, run(total_rows, True, True))


def _check_kinds(kinds) -> tuple[str, ...]:
    """Validate a ``kinds`` argument (``"outer"``, ``"functional"``, ``"hessian"``) and keep the canonical order."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"Invalid kinds={kinds!r}. Choose a non-empty subset of {KINDS}.")
    return tuple(k for k in KINDS if k in kinds)


def _pair_blocks(pair: str, names: Sequence[str]) -> tuple[str, str]:
    """Split a pair name like ``"VQ"`` or ``"QW1"`` or ``"W1W2"`` into its two block names."""
    for a in names:
        if pair.startswith(a) and pair[len(a) :] in names:
            return a, pair[len(a) :]
    raise ValueError(f"Unknown block pair {pair!r}. Pairs are two of {list(names)} concatenated, e.g. 'VQ'.")


class _Embedding:
    """Moves Lanczos vectors ``(k, H, n)`` in and out of an operator's tangent layout for one block set."""

    def __init__(self, op: BlockOperator, names: Sequence[str]):
        self.op = op
        self.names = list(names)
        self.sizes = [op.params[nm].numel for nm in self.names]
        self.n = sum(self.sizes)
        # blocks without a head dimension need a single operator, not one per head
        self.H = op.n_heads if any(op.params[nm].headed for nm in self.names) else 1

    def embed(self, u: torch.Tensor, which: Sequence[str]) -> dict[str, torch.Tensor]:
        """Tangent holding the parts of ``u`` (shape ``(k, H, n)``) that belong to blocks ``which``."""
        op, H = self.op, self.H
        k = u.shape[0]
        parts = torch.split(u, self.sizes, dim=-1) if len(self.names) > 1 else (u,)
        tangent: dict[str, torch.Tensor] = {}
        for nm, part in zip(self.names, parts, strict=True):
            if nm not in which:
                continue
            info = op.params[nm]
            if op.head_diagonal:
                # (k, H, n) -> (k, H, *shape); heads are independent operators
                tangent[nm] = part.reshape(k, H, *info.shape) if info.headed else part[:, 0].reshape(k, *info.shape)
            elif info.headed:
                # batch member (k, h) perturbs head h only: (k*H, H, *shape), "diagonal" placement
                t = torch.zeros(k, H, H, info.numel, dtype=u.dtype, device=u.device)
                idx = torch.arange(H, device=u.device)
                t[:, idx, idx] = part
                tangent[nm] = t.reshape(k * H, H, *info.shape)
            else:
                tangent[nm] = part.reshape(k * H, *info.shape)
        return tangent

    def extract(self, out: dict[str, torch.Tensor], which: Sequence[str], k: int) -> torch.Tensor:
        """Inverse of :meth:`embed` on an operator output: ``(k, H, n)`` with zeros outside ``which``."""
        op, H = self.op, self.H
        pieces = []
        for nm, size in zip(self.names, self.sizes, strict=True):
            info = op.params[nm]
            if nm not in which:
                pieces.append(torch.zeros(k, H, size, dtype=op.dtype, device=op.device))
                continue
            o = out[nm]
            if op.head_diagonal:
                piece = o.reshape(k, H, size) if info.headed else o.reshape(k, 1, size).expand(k, H, size)
            elif info.headed:
                o = o.reshape(k, H, H, size)
                idx = torch.arange(H, device=o.device)
                piece = o[:, idx, idx]
            else:
                piece = o.reshape(k, H, size)
            pieces.append(piece)
        return torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0]


def _rows(kinds: Sequence[str], repeat: int, emb: _Embedding) -> tuple:
    """Tangent rows of each kind: ``(outer rows, functional rows, hessian rows)``, and for operators with
    ``apply_masked`` (one pass over every row) their row masks ``(outer_mask, func_mask)`` (:func:`_row_masks`).

    The tangent batch is ``repeat`` copies (2 for off-diagonal pairs) of one row per kind, each expanded to
    one row per head when the operator couples heads (see :meth:`_Embedding.embed`).
    """
    k = len(kinds)
    f = 1 if emb.op.head_diagonal else emb.H

    def of(kind: str) -> list[int]:
        return [(r * k + i) * f + h for r in range(repeat) for i, kd in enumerate(kinds) if kd == kind
                for h in range(f)]  # fmt: skip

    lists = (of("outer"), of("functional"), of("hessian"))
    rows = tuple(torch.tensor(idx, dtype=torch.long, device=emb.op.device) for idx in lists)
    if getattr(emb.op, "apply_masked", None) is None:
        return rows
    return (*rows, _row_masks(lists, repeat * k * f, emb.op.dtype, emb.op.device))


class RowMask:
    """A 0/1 row mask ``values`` ``(n,)`` of an operator's one-pass product (``apply_masked``) and its views shaped
    for ``(n, ...)`` tensors of each rank, each made once (a product masks several tensors of one rank: one view for
    all of them, not a dispatched ``view`` each)."""

    def __init__(self, values: torch.Tensor):
        self.values = values
        self._shaped: dict[int, torch.Tensor] = {}

    def times(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` ``(n, ...)`` with row ``i`` multiplied by ``values[i]``."""
        m = self._shaped.get(t.dim())
        if m is None:
            m = self._shaped[t.dim()] = self.values.reshape(-1, *(1,) * (t.dim() - 1))
        return t * m

    def repeat_interleave(self, repeats: int) -> RowMask:
        """Each row's entry ``repeats`` times (a product that expands each row to ``repeats`` rows)."""
        return RowMask(self.values.repeat_interleave(repeats))


def _rows_times(t: torch.Tensor | None, mask: RowMask) -> torch.Tensor | None:
    """``t`` ``(n, ...)`` with row ``i`` multiplied by the mask's ``values[i]`` (0 or 1); an all-ones mask is
    :data:`ALL_ROWS` (no product)."""
    if t is None or mask is ALL_ROWS:
        return t
    return mask.times(t)


#: Stands for an all-ones row mask in :func:`_rows_times` (every row needs that part: nothing to multiply).
ALL_ROWS = torch.ones(())


def _row_masks(rows: tuple[list[int], list[int], list[int]], n: int, dtype, device):
    """``(outer_mask, func_mask, n)`` of the row sets ``(outer, functional, hessian)`` of :func:`_rows` (host lists):
    ``None`` where no row needs the part, :data:`ALL_ROWS` where every row does, else a 0/1 ``(n,)``
    :class:`RowMask`."""
    ro, rf, rt = rows

    def mask(idx: list[int]):
        if not idx:
            return None
        if len(idx) == n:
            return ALL_ROWS
        m = [0.0] * n
        for i in idx:
            m[i] = 1.0
        return RowMask(torch.tensor(m, dtype=dtype, device=device))

    return mask(ro + rt), mask(rf + rt), n


def select_rows(t: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor | None:
    """Rows ``idx`` (ascending, unique, as built by :func:`_rows`) of ``t`` along dim 0; no copy for all rows."""
    if t is None or idx is None or len(idx) == t.shape[0]:
        return t
    return t.index_select(0, idx)


def apply_kinds(op: BlockOperator, tangent: dict, outputs: Sequence[str], rows: tuple[torch.Tensor, ...]):
    """``H_kind(row) v_row`` for every tangent row: outer, functional or their sum, restricted to ``outputs``.

    Operators that declare ``supports_subsets`` compute each part only for the rows that need it; those that
    also declare ``supports_total`` compute the hessian rows in one fused pass (both parts share the
    backward matmuls) instead of as outer + functional.
    """
    ro, rf, rt = rows[:3]
    n = next(iter(tangent.values())).shape[0]
    if len(rows) > 3 and rows[3][2] == n:  # one pass for every row (see _rows); not for a batch of other rows
        return op.apply_masked(tangent, tuple(outputs), *rows[3][:2])
    parts: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    if getattr(op, "supports_total", False):
        o, f, t = op.apply(tangent, outputs=tuple(outputs), outer_rows=ro, func_rows=rf, total_rows=rt)
        parts = [(ro, o), (rf, f), (rt, t)]
    else:  # hessian rows as outer + functional
        # sorted: the sum below takes a full-length row set for the identity (with 2 copies of the kinds,
        # outer + hessian rows cover every row out of order: that read the wrong rows)
        ro_all, rf_all = torch.cat([ro, rt]).sort().values, torch.cat([rf, rt]).sort().values
        if getattr(op, "supports_subsets", False):
            o, f = op.apply(tangent, outputs=tuple(outputs), outer_rows=ro_all, func_rows=rf_all)
        else:
            o, f = op.apply(tangent)
            o, f = {nm: x[ro_all] for nm, x in o.items()}, {nm: x[rf_all] for nm, x in f.items()}
        parts = [(ro_all, o), (rf_all, f)]
    out = {}
    for nm in outputs:
        ref = next(p[nm] for _, p in parts if nm in p)
        total = torch.zeros((n, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
        for idx, p in parts:
            if len(idx) == n:  # every row: ascending and unique, so the identity
                total = total + p[nm]
            elif len(idx):
                total.index_add_(0, idx, p[nm])
        out[nm] = total
    return out


def _skip_dead_kinds(kinds: Sequence, make):
    """``mv(u, live=None)`` over the batch ``(len(kinds), H, n)`` from ``make(sub_kinds)``, a plain ``mv`` for a
    subset of the kinds (row labels: kind names, or any labels ``make`` understands).

    With ``live`` (the host mask of :func:`lanczos_max_abs` with ``pass_live``), a kind none of whose members
    is live (all converged: zero vectors) is left out of the product and gets zero rows, which is exactly
    what computing it gave.
    """
    full = make(kinds)
    subsets: dict[tuple[int, ...], tuple] = {}

    def mv(u: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        keep = None if live is None else live.reshape(len(kinds), -1).any(-1).tolist()
        if keep is None or all(keep):
            return full(u)
        sub = tuple(i for i, x in enumerate(keep) if x)
        out = torch.zeros_like(u)
        if not sub:
            return out
        if sub not in subsets:  # at most 2^len(kinds) of them, built once per Lanczos run
            subsets[sub] = (torch.tensor(sub, device=u.device), make([kinds[i] for i in sub]))
        idx, fn = subsets[sub]
        return out.index_copy_(0, idx, fn(u.index_select(0, idx)))

    return mv


def pair_matvec(op: BlockOperator, pair: tuple[str, str], kinds: Sequence[str]):
    """Symmetric matvec whose largest |eigenvalue| is ``||H_XY||_2`` for each kind, batched ``(len(kinds), H, n)``.

    Returns ``(emb, mv)``; ``mv(u, live=None)`` leaves out the kinds without a live member (see
    :func:`_skip_dead_kinds`).
    """
    X, Y = pair
    if X == Y:
        emb = _Embedding(op, [X])

        def make_diag(ks: Sequence[str]):
            rows = _rows(ks, 1, emb)

            def mv(u: torch.Tensor) -> torch.Tensor:
                out = apply_kinds(op, emb.embed(u, [X]), [X], rows)
                return emb.extract(out, [X], u.shape[0])

            return mv

        return emb, _skip_dead_kinds(kinds, make_diag)
    emb = _Embedding(op, [X, Y])

    def make_pair(ks: Sequence[str]):
        rows = _rows(ks, 2, emb)

        def mv(u: torch.Tensor) -> torch.Tensor:
            k = u.shape[0]
            # One batched product: the first half perturbs block Y only (we read rows X), the second half
            # perturbs block X only (we read rows Y).
            tY = emb.embed(u, [Y])[Y]
            tX = emb.embed(u, [X])[X]
            tangent = {Y: torch.cat([tY, torch.zeros_like(tY)]), X: torch.cat([torch.zeros_like(tX), tX])}
            out = apply_kinds(op, tangent, [X, Y], rows)
            half = next(iter(out.values())).shape[0] // 2
            first = {nm: t[:half] for nm, t in out.items()}
            second = {nm: t[half:] for nm, t in out.items()}
            return emb.extract(first, [X], k) + emb.extract(second, [Y], k)

        return mv

    return emb, _skip_dead_kinds(kinds, make_pair)


def stacked_matvec(op: BlockOperator, names: Sequence[str], kinds: Sequence[str]):
    """One symmetric matvec for the diagonal blocks ``XX``, ``YY``, ... of same-shaped parameters ``names``, batched
    ``(len(names) * len(kinds), H, n)``: rows ``i * len(kinds) + j`` apply kind ``j`` of block ``names[i]``.

    One operator product serves every block (the rows of block ``X`` perturb ``X`` alone and read ``X``): the
    dispatched operators of one product instead of one per block, for the arithmetic of all of them (the tangent's
    zero parts cost their share of the first and last matmuls). For head-diagonal operators with ``apply_masked``
    (see :func:`stackable`). Returns ``(emb, mv)`` as :func:`pair_matvec`.
    """
    emb = _Embedding(op, [names[0]])
    shape = op.params[names[0]].shape
    labels = [(nm, kind) for nm in names for kind in kinds]

    def make(rows_of: Sequence[tuple[str, str]]):
        present = list(dict.fromkeys(nm for nm, _ in rows_of))
        rows = _rows([kind for _, kind in rows_of], 1, emb)
        m = len(rows_of)
        if len(present) == 1:
            (nm,) = present

            def single(u: torch.Tensor) -> torch.Tensor:
                out = apply_kinds(op, {nm: u.reshape(m, emb.H, *shape)}, [nm], rows)
                return out[nm].reshape(m, emb.H, emb.n)

            return single
        # (m, 1, 1, 1) 0/1 masks of each block's rows, made once per run and row subset
        masks = {nm: torch.tensor([float(r == nm) for r, _ in rows_of], dtype=op.dtype, device=op.device)
                 .reshape(m, 1, *(1,) * len(shape)) for nm in present}  # fmt: skip

        def mv(u: torch.Tensor) -> torch.Tensor:
            t = u.reshape(m, emb.H, *shape)
            out = apply_kinds(op, {nm: t * masks[nm] for nm in present}, present, rows)
            total = out[present[0]] * masks[present[0]]
            for nm in present[1:]:
                total = total.addcmul_(out[nm], masks[nm])
            return total.reshape(m, emb.H, emb.n)

        return mv

    return emb, _skip_dead_kinds(labels, make)


def stackable(op: BlockOperator, pair_names: Sequence[str]) -> bool:
    """Whether the diagonal pairs ``pair_names`` (e.g. ``QQ``, ``KK``) can share one product (:func:`stacked_matvec`):
    a head-diagonal operator with one-pass products, blocks of one shape and headedness."""
    if len(pair_names) < 2 or not op.head_diagonal or getattr(op, "apply_masked", None) is None:
        return False
    names = list(op.params)
    blocks = [_pair_blocks(p, names) for p in pair_names]
    if any(x != y for x, y in blocks):
        return False
    infos = [op.params[x] for x, _ in blocks]
    return all(i.shape == infos[0].shape and i.headed == infos[0].headed for i in infos)


def head_keys(op: BlockOperator, base: str, names: Sequence[str]) -> list[str]:
    """Metric keys for a block pair (or the joint Hessian of several blocks, e.g. ``("Q", "K", "V")``): ``base``
    alone, or ``base/h{i}`` when one of the ``names`` is a headed param."""
    headed = any(op.params[nm].headed for nm in names)
    if headed and op.n_heads >= 1 and getattr(op, "suffix_heads", True):
        return [f"{base}/h{h}" for h in range(op.n_heads)]
    return [base]


def spectral_norms(
    op: BlockOperator,
    pairs: Sequence[str],
    *,
    kinds: Sequence[str] = KINDS,
    lanczos: Lanczos,
    skip: Sequence[tuple[str, str]] = (),
) -> dict[str, torch.Tensor]:
    """Spectral norms ``{kind}/{pair}[/h{i}]`` of the requested block pairs, by batched Lanczos.

    Args:
        op: the block operator.
        pairs: pair names such as ``"QQ"``, ``"VK"``, ``"W1W2"``.
        kinds: subset of ``("outer", "functional", "hessian")``.
        lanczos: the Lanczos settings (tolerance, steps, basis, warm start); the Ritz vectors of each norm
            are stored in its ``warm_start`` and used as start vectors next time.
        skip: ``(kind, pair)`` combinations computed elsewhere (exactly) and not needed here.

    Returns:
        Flat dict of 0-d tensors: the norms ``{kind}/{pair}[/h{i}]`` and, for each, ``residual/{kind}/{pair}[/h{i}]``,
        the relative Lanczos residual of that norm (see :func:`lanczos_max_abs`'s ``info``; ``<= tol`` once
        converged, larger when ``max_iter`` stopped it).
    """
    plan = spectral_plan([(op, pairs)], kinds=kinds, lanczos=lanczos, skip=skip)
    return solve_planned([plan], lanczos.solve_bytes)[0][0]


@dataclass
class Planned:
    """Lanczos runs planned but not made yet (:func:`solve_planned` makes and solves them).

    Attributes:
        makers: ``[(make, bytes)]``: ``make()`` makes one run (its basis is allocated at its first step), ``bytes``
            its basis at most (:func:`run_basis_bytes`).
        finish: ``finish(runs)``: the plan's results from its runs, solved, in the order of ``makers``.
        together: Its runs always in one solve, whatever their bytes (the engine's own keys, as they always were);
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
#: (``CapturedBlock.basis_bytes``), at least this. At GPT-2-small width (d 768, 12 heads, 16 vectors) the attention's
#: engine run and its two sampled runs hold 3 x 216 MiB, the FFN's engine run 432 MiB and its sampled run 864 MiB
#: (within the FFN's estimate, 2,592 MiB of bases: one solve since session 20); called directly, at d 4096 one sampled
#: run alone holds 6 GiB, and there the sampled runs go one at a time.
SOLVE_BYTES = 2**30


def run_basis_bytes(rows: int, emb: _Embedding, lanczos: Lanczos, dtype: torch.dtype) -> int:
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
            if run.parts:
                split_results(run)  # (and releases the merged product: the plans' finish reads results only)
        for i, run in made:
            runs[i].append(run)
    return [plan.finish(r) for plan, r in zip(plans, runs, strict=True)]


#: Runs of one solve whose vectors have one size (the attention's own ``QQ``+``KK`` run and its sampled members'
#: run, both ``(rows, H, d d_K)``; the FFN's and its sampled run; the grouped-query attention's query-view runs,
#: ``(rows, H, d d_K)``, its group-view runs, ``(rows, G, d d_K)``, and its grouped ``VV`` run) become **one**
#: :class:`LanczosRun` (:func:`~._lanczos.merge_runs`): one Lanczos step (two Gram-Schmidt passes, the norm, the next
#: vector: ~17 dispatched operators) per step for all of their members instead of one per run, and their stopping tests
#: in one host copy. Each member keeps its own start, tolerance and end of the spectrum (the sampled members are
#: algebraic, at a tighter tolerance); every member of a Lanczos run is its own recurrence, so the keys and warm starts
#: are those of one run each, to the bit on CPU (tests/test_sampled_curvature.py,
#: ``test_a_kernels_own_and_sampled_runs_merged_into_one_lanczos_run_...``). A run that several evaluations hold (a
#: ``made_together`` run of a window of several blocks) is never merged. ``False``: one run per maker (the benchmark's
#: "before").
MERGE_RUNS = True


def _made(group: Sequence[tuple[int, Callable[[], LanczosRun]]]):
    """The runs of one solve, made: ``([(plan, run)], the runs to solve)``. With :data:`MERGE_RUNS` the
    :func:`~._lanczos.mergeable` runs whose vectors have one size, dtype and device and whose ``max_iter`` and
    ``max_basis`` agree are solved as one (:func:`~._lanczos.merge_runs`; :func:`solve_planned` hands each its results);
    the others as they are."""
    made = [(i, make()) for i, make in group]
    clusters: dict[tuple, list[LanczosRun]] = {}
    for _, run in made:
        if MERGE_RUNS and mergeable(run):
            clusters.setdefault((run.n, run.dtype, run.device, run.k_max, run.cap), []).append(run)
    solved = [merge_runs(runs) for runs in clusters.values() if len(runs) > 1]
    merged = {id(r) for run in solved for r, _, _ in run.parts}
    return made, solved + [run for _, run in made if id(run) not in merged]


def norms_with_a_linear_pair(
    op: BlockOperator,
    pairs: Sequence[str],
    linear: str | None,
    *,
    kinds: Sequence[str],
    lanczos: Lanczos,
    extra: Planned | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`spectral_norms` of ``pairs`` where the functional block of the diagonal pair ``linear`` is exactly zero
    (the FFN's ``W1W1`` under ReLU, the gated FFN's ``W3W3``: ``F`` linear in that weight): one outer-only run for it,
    its ``hessian`` keys the outer part and its ``functional`` key 0. The runs and those of ``extra`` (the sampled
    keys' :func:`~._sampled.sampled_plan`) in one :func:`solve_planned` (their stopping tests share host reads, within
    ``lanczos.solve_bytes`` of bases); ``extra``'s keys come last."""
    iterative = [p for p in pairs if p != linear]
    zero = linear is not None and linear in pairs
    outer = zero and ("outer" in kinds or "hessian" in kinds)
    plans = [spectral_plan([(op, [linear])], kinds=["outer"], lanczos=lanczos)] if outer else []
    if iterative:
        plans.append(spectral_plan([(op, iterative)], kinds=kinds, lanczos=lanczos))
    solved = iter(solve_planned(plans + ([extra] if extra is not None else []), lanczos.solve_bytes))
    out: dict[str, torch.Tensor] = {}
    if outer:
        o = next(solved)[0]
        for k in kinds:
            if k != "functional":
                out[f"{k}/{linear}"] = o[f"outer/{linear}"]
                out[f"residual/{k}/{linear}"] = o[f"residual/outer/{linear}"]
    if zero and "functional" in kinds:
        out[f"functional/{linear}"] = torch.zeros((), dtype=op.dtype, device=op.device)
    if iterative:
        out.update(next(solved)[0])
    if extra is not None:
        out.update(next(solved)[0])
    return out


def spectral_plan(
    parts: Sequence[tuple[BlockOperator, Sequence[str]]],
    *,
    kinds: Sequence[str] = KINDS,
    lanczos: Lanczos,
    skip: Sequence[tuple[str, str]] = (),
) -> Planned:
    """The Lanczos runs of :func:`spectral_norms` for several ``(operator, pairs)`` parts (the grouped-query
    kernel's query and group views of one attention) as a :class:`Planned`, all in one solve (their stopping tests
    share host reads; their bases are held at once, their products made one at a time); its ``finish`` gives the
    dicts of keys, one per part."""
    jobs = []  # (part, pair names, kinds, warm-start key): one run per pair, or one for diagonal pairs sharing
    makers: list[tuple[Callable[[], LanczosRun], int]] = []
    for part, (op, pairs) in enumerate(parts):
        names = list(op.params)
        todo: dict[tuple[str, ...], list[str]] = {}  # the kinds to compute -> the pairs that need them
        for pair_name in pairs:
            ks = tuple(k for k in kinds if (k, pair_name) not in skip)
            if ks:
                todo.setdefault(ks, []).append(pair_name)
        for ks, group in todo.items():
            diag = [p for p in group if len(set(_pair_blocks(p, names))) == 1]
            stack = diag if stackable(op, diag) else []
            if stack:
                emb, mv = stacked_matvec(op, [_pair_blocks(p, names)[0] for p in stack], ks)
                key = (tuple(stack), ks)
                rows = list(ks) * len(stack)
                jobs.append((part, stack, ks, key))
                make = functools.partial(_norm_run, op, emb, mv, rows, key, True, lanczos)
                makers.append((make, run_basis_bytes(len(rows), emb, lanczos, op.dtype)))
            for pair_name in group:
                if pair_name in stack:
                    continue
                pair = _pair_blocks(pair_name, names)
                emb, mv = pair_matvec(op, pair, ks)
                key = (pair_name, ks)
                jobs.append((part, [pair_name], ks, key))
                make = functools.partial(_norm_run, op, emb, mv, ks, key, pair[0] == pair[1], lanczos)
                makers.append((make, run_basis_bytes(len(ks), emb, lanczos, op.dtype)))

    def finish(runs: list[LanczosRun]) -> list[dict[str, torch.Tensor]]:
        outs: list[dict[str, torch.Tensor]] = [{} for _ in parts]
        for (part, group, ks, key), run in zip(jobs, runs, strict=True):
            op = parts[part][0]
            names = list(op.params)
            vals, rel = _norm_results(run, key, lanczos)
            vals, rel = vals.unbind(0), rel.unbind(0)  # (H,) rows: one operator each, not one per key
            for g, pair_name in enumerate(group):
                pair = _pair_blocks(pair_name, names)
                for i, kind in enumerate(ks):
                    heads = head_keys(op, f"{kind}/{pair_name}", pair)
                    _put_heads(outs[part], heads, vals[g * len(ks) + i], rel[g * len(ks) + i])
        return outs

    return Planned(makers, finish)


def _put_heads(out: dict[str, torch.Tensor], keys: Sequence[str], values: torch.Tensor, residuals=None) -> None:
    """``out[keys[h]] = values[h]`` (and ``out["residual/" + keys[h]] = residuals[h]``) for the heads ``h`` of ``(H,)``
    tensors, by one ``unbind`` each (indexing dispatched one operator per head)."""
    for k, v in zip(keys, values.unbind(), strict=True):
        out[k] = v
    if residuals is not None:
        for k, r in zip(keys, residuals.unbind(), strict=True):
            out[f"residual/{k}"] = r


def _norm_run(
    op, emb, mv, kinds, key, diagonal: bool, lanczos: Lanczos, algebraic: bool = False, v0: torch.Tensor | None = None
) -> LanczosRun:
    """The batched Lanczos run ``(len(kinds), H)`` of ``mv``, warm-started from ``lanczos.warm_start`` (or from
    ``v0`` ``(len(kinds), H, n)``, when given); with ``algebraic`` it finds the largest eigenvalues instead of the
    norms (drive it with :func:`solve`)."""
    warm = lanczos.warm_start
    shape = (len(kinds), emb.H, emb.n)
    return LanczosRun(
        mv,
        shape[:2],
        emb.n,
        dtype=op.dtype,
        device=op.device,
        tol=lanczos.tol,
        max_iter=lanczos.max_iter,
        max_basis=lanczos.max_basis,
        pass_live=True,
        v0=v0 if v0 is not None else None if warm is None else warm.get(key, shape, op.dtype, op.device),
        both_ends=_both_ends(kinds, diagonal=diagonal),
        algebraic=algebraic,
    )


def _norm_results(run: LanczosRun, key, lanczos: Lanczos) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norms, relative residuals)`` of a finished run; its Ritz vectors go into ``lanczos.warm_start``."""
    if lanczos.warm_start is not None:
        lanczos.warm_start.put(key, run.ritz)
    return run.norm, run.rel_residual


def _lanczos_norms(op, emb, mv, kinds, key, diagonal: bool, lanczos: Lanczos, algebraic: bool = False, v0=None):
    """``(norms, relative residuals)``, each ``(len(kinds), H)``, of ``mv`` by batched Lanczos, warm-started from
    and stored into ``lanczos.warm_start``; with ``algebraic`` the largest eigenvalues instead of the norms. With
    ``v0`` (start vectors made for this call) the run starts there, and its Ritz vectors are not stored (no later
    call reads them)."""
    run = _norm_run(op, emb, mv, kinds, key, diagonal, lanczos, algebraic, v0)
    solve([run])
    if v0 is not None:
        return run.norm, run.rel_residual
    return _norm_results(run, key, lanczos)


def _both_ends(kinds: Sequence[str], diagonal: bool) -> np.ndarray:
    """``(len(kinds), 1)`` host mask (a numpy array: no tensor to read back): which Lanczos runs must resolve both ends
    of the spectrum.

    Outer (Gauss-Newton) blocks are PSD and off-diagonal blocks are embedded with a spectrum symmetric
    about zero: the largest-magnitude end alone decides. Functional and total diagonal blocks are
    indefinite.
    """
    return np.array([[diagonal and k != "outer"] for k in kinds], dtype=bool)


def full_norms(
    op: BlockOperator,
    names: Sequence[str],
    label: str,
    *,
    kinds: Sequence[str] = KINDS,
    lanczos: Lanczos,
) -> dict[str, torch.Tensor]:
    """Spectral norms of the whole multi-block Hessian over ``names`` (e.g. Q, K, V), per kind and head."""
    emb = _Embedding(op, names)

    def make(ks: Sequence[str]):
        rows = _rows(ks, 1, emb)
        return lambda u: emb.extract(apply_kinds(op, emb.embed(u, names), names, rows), names, u.shape[0])

    mv = _skip_dead_kinds(kinds, make)
    vals, rel = _lanczos_norms(op, emb, mv, kinds, (label, tuple(kinds)), True, lanczos)
    out = {}
    for i, kind in enumerate(kinds):
        _put_heads(out, head_keys(op, f"{kind}/{label}", names), vals[i], rel[i])
    return out


def dense_blocks(op: BlockOperator, pairs: Sequence[str], full: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Dense blocks ``dense/{kind}/{pair}[/h{i}]`` of shape ``(n_X, n_Y)`` (vec_r order), small sizes only.

    ``full`` names blocks whose whole joint Hessian is also returned as ``dense/{kind}/{''.join(full)}``.
    """
    names = list(op.params)
    H = op.n_heads
    cols: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    needed = set()
    for p in pairs:
        needed.update(_pair_blocks(p, names))
    needed.update(full)
    emb = _Embedding(op, names)
    offsets = {}
    start = 0
    for nm, size in zip(emb.names, emb.sizes, strict=True):
        offsets[nm] = (start, start + size)
        start += size
    for Y in needed:
        a, b = offsets[Y]
        nY = b - a
        basis = torch.zeros(nY, H, emb.n, dtype=op.dtype, device=op.device)
        basis[:, :, a:b] = torch.eye(nY, dtype=op.dtype, device=op.device).unsqueeze(1)
        o, f = op.apply(emb.embed(basis, [Y]))
        # columns of every block row, shape (n_total, H, nY) after transposing
        cols[Y] = (emb.extract(o, names, nY).permute(2, 1, 0), emb.extract(f, names, nY).permute(2, 1, 0))
    out: dict[str, torch.Tensor] = {}

    def block(kind: str, X: str, Y: str) -> torch.Tensor:
        o, f = cols[Y]
        a, b = offsets[X]
        if kind == "outer":
            m = o[a:b]
        elif kind == "functional":
            m = f[a:b]
        else:
            m = o[a:b] + f[a:b]
        return m.permute(1, 0, 2)  # (H, nX, nY)

    for p in pairs:
        X, Y = _pair_blocks(p, names)
        for kind in KINDS:
            m = block(kind, X, Y)
            for key, h in zip(head_keys(op, f"dense/{kind}/{p}", (X, Y)), range(H), strict=False):
                out[key] = m[h]
    if full:
        label = "".join(full)
        for kind in KINDS:
            rows = [torch.cat([block(kind, X, Y) for Y in full], dim=-1) for X in full]
            m = torch.cat(rows, dim=-2)
            for h, key in enumerate(head_keys(op, f"dense/{kind}/{label}", full)):
                out[key] = m[h]
    return out
