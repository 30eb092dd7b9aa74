"""Block Hessian operators: spectral norms and dense blocks from closed-form Hessian-vector products.

Every kernel in this package (attention, FFN, whole Transformer block) exposes its Hessian as a
:class:`BlockOperator`: a map from a tangent (one perturbation per weight block) to the Gauss-Newton
("outer") and functional parts of the Hessian applied to it, computed from closed-form Jacobians and
contracted second derivatives, never from autograd. This module holds the interface and turns such an operator into

* symmetric matvecs whose largest ``|λ|`` is the spectral norm of a block ``H_XY`` (restriction to rows of block
  X, columns of block Y): ``H_XX`` (X = Y) or ``[[0, H_XY], [H_YX, 0]]`` (X != Y), with ``sigma_max(H_XY)`` its
  largest ``|λ|`` (:mod:`~curvwatch.closed_form.solver.plan` runs Lanczos on them);
* the dense block, by applying the operator to a basis (small sizes only; used by tests and docs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

from ..settings import PARTS

__all__ = [
    "ALL_ROWS",
    "LIVE_MEMBERS",
    "BlockOperator",
    "Embedding",
    "ParamInfo",
    "RowMask",
    "SlotMask",
    "apply_parts",
    "dense_blocks",
    "head_keys",
    "pair_blocks",
    "pair_matvec",
    "part_rows",
    "rows_times",
    "run_parts",
    "select_rows",
    "skip_dead_parts",
    "stackable",
    "stacked_matvec",
]


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


def pair_blocks(pair: str, names: Sequence[str]) -> tuple[str, str]:
    """Split a pair name like ``"VQ"`` or ``"QW1"`` or ``"W1W2"`` into its two block names."""
    for a in names:
        if pair.startswith(a) and pair[len(a) :] in names:
            return a, pair[len(a) :]
    raise ValueError(f"Unknown block pair {pair!r}. Pairs are two of {list(names)} concatenated, e.g. 'VQ'.")


class Embedding:
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


def part_rows(parts: Sequence[str], repeat: int, emb: Embedding) -> tuple:
    """Tangent rows of each part: ``(outer rows, functional rows, hessian rows)``, and for operators with
    ``apply_masked`` (one pass over every row) their row masks ``(outer_mask, func_mask)`` (:func:`_row_masks`).

    The tangent batch is ``repeat`` copies (2 for off-diagonal pairs) of one row per part, each expanded to
    one row per head when the operator couples heads (see :meth:`Embedding.embed`).
    """
    k = len(parts)
    f = 1 if emb.op.head_diagonal else emb.H

    def of(part: str) -> list[int]:
        return [(r * k + i) * f + h for r in range(repeat) for i, pd in enumerate(parts) if pd == part
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

    #: The dimension of the masked tensors that ``values`` runs along.
    dim = 0

    def __init__(self, values: torch.Tensor):
        self.values = values
        self._shaped: dict[int, torch.Tensor] = {}

    def times(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with its index ``i`` along :attr:`dim` (a row) multiplied by ``values[i]``."""
        m = self._shaped.get(t.dim())
        if m is None:
            shape = [1] * t.dim()
            shape[self.dim] = -1
            m = self._shaped[t.dim()] = self.values.reshape(shape)
        return t * m

    def repeat_interleave(self, repeats: int) -> RowMask:
        """Each row's entry ``repeats`` times (a product that expands each row to ``repeats`` rows)."""
        return type(self)(self.values.repeat_interleave(repeats))


class SlotMask(RowMask):
    """A 0/1 mask ``values`` ``(S,)`` over the head dimension (dim 2) of ``(1, B, S, ...)`` tensors: the row mask of a
    product whose members were packed into the heads of one tangent row, a slot each (the live members,
    :meth:`~curvwatch.closed_form.attention.operator.AttentionOperator.apply_masked`)."""

    dim = 2


def rows_times(t: torch.Tensor | None, mask: RowMask) -> torch.Tensor | None:
    """``t`` ``(n, ...)`` with row ``i`` multiplied by the mask's ``values[i]`` (0 or 1); an all-ones mask is
    :data:`ALL_ROWS` (no product)."""
    if t is None or mask is ALL_ROWS:
        return t
    return mask.times(t)


#: Stands for an all-ones row mask in :func:`rows_times` (every row needs that part: nothing to multiply).
ALL_ROWS = torch.ones(())


def _row_masks(rows: tuple[list[int], list[int], list[int]], n: int, dtype, device):
    """``(outer_mask, func_mask, n)`` of the row sets ``(outer, functional, hessian)`` of :func:`part_rows` (host
    lists): ``None`` where no row needs the part, :data:`ALL_ROWS` where every row does, else a 0/1 ``(n,)``
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
    """Rows ``idx`` (ascending, unique, as built by :func:`part_rows`) of ``t`` along dim 0; no copy for all rows."""
    if t is None or idx is None or len(idx) == t.shape[0]:
        return t
    return t.index_select(0, idx)


def apply_parts(op: BlockOperator, tangent: dict, outputs: Sequence[str], rows: tuple[torch.Tensor, ...]):
    """``H_part(row) v_row`` for every tangent row: outer, functional or their sum, restricted to ``outputs``.

    Operators that declare ``supports_subsets`` compute each part only for the rows that need it; those that
    also declare ``supports_total`` compute the hessian rows in one fused pass (both computed share the
    backward matmuls) instead of as outer + functional.
    """
    ro, rf, rt = rows[:3]
    n = next(iter(tangent.values())).shape[0]
    if len(rows) > 3 and rows[3][2] == n:  # one pass for every row (see part_rows); not for a batch of other rows
        return op.apply_masked(tangent, tuple(outputs), *rows[3][:2])
    computed: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
    if getattr(op, "supports_total", False):
        o, f, t = op.apply(tangent, outputs=tuple(outputs), outer_rows=ro, func_rows=rf, total_rows=rt)
        computed = [(ro, o), (rf, f), (rt, t)]
    else:  # hessian rows as outer + functional
        # sorted: the sum below takes a full-length row set for the identity (with 2 copies of the parts,
        # outer + hessian rows cover every row out of order: that read the wrong rows)
        ro_all, rf_all = torch.cat([ro, rt]).sort().values, torch.cat([rf, rt]).sort().values
        if getattr(op, "supports_subsets", False):
            o, f = op.apply(tangent, outputs=tuple(outputs), outer_rows=ro_all, func_rows=rf_all)
        else:
            o, f = op.apply(tangent)
            o, f = {nm: x[ro_all] for nm, x in o.items()}, {nm: x[rf_all] for nm, x in f.items()}
        computed = [(ro_all, o), (rf_all, f)]
    out = {}
    for nm in outputs:
        ref = next(p[nm] for _, p in computed if nm in p)
        total = torch.zeros((n, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
        for idx, p in computed:
            if len(idx) == n:  # every row: ascending and unique, so the identity
                total = total + p[nm]
            elif len(idx):
                total.index_add_(0, idx, p[nm])
        out[nm] = total
    return out


#: While a product of :func:`skip_dead_parts` runs: which of its members are live, a host bool array ``(rows, H)``
#: (``rows``: the parts it computes, in their order; ``H``: the heads), where some of them are not (else None). A
#: head-diagonal operator may compute only the live members (or the heads with one) and give the others zero rows,
#: exactly what computing them gave (their tangents are zero):
#: :class:`~curvwatch.closed_form.attention.operator.AttentionOperator` does, where its heads do not mix. An operator
#: whose tangent batch repeats the parts (``repeat`` copies: the two halves of an off-diagonal pair,
#: :func:`pair_matvec`) reads the mask tiled ``repeat`` times along the rows.
LIVE_MEMBERS: ContextVar[np.ndarray | None] = ContextVar("live_members", default=None)


@contextlib.contextmanager
def live_members(mask: np.ndarray | None) -> Iterator[None]:
    """:data:`LIVE_MEMBERS` set to ``mask`` inside the block (None: not set)."""
    if mask is None:
        yield
        return
    token = LIVE_MEMBERS.set(mask)
    try:
        yield
    finally:
        LIVE_MEMBERS.reset(token)


def skip_dead_parts(parts: Sequence, make):
    """``mv(u, live=None)`` over the batch ``(len(parts), H, n)`` from ``make(sub_parts)``, a plain ``mv`` for a
    subset of the parts (row labels: part names, or any labels ``make`` understands).

    With ``live`` (the host mask of :func:`lanczos_max_abs` with ``pass_live``), a part none of whose members
    is live (all converged: zero vectors) is left out of the product and gets zero rows, which is exactly
    what computing it gave; and where some member of the parts computed is not live, the product runs with
    :data:`LIVE_MEMBERS` naming the live ones (an operator that reads it computes those only).
    """
    full = make(parts)
    subsets: dict[tuple[int, ...], tuple] = {}

    def mv(u: torch.Tensor, live: np.ndarray | None = None) -> torch.Tensor:
        members = None
        if live is None:
            keep = None
        else:
            by_part = live.reshape(len(parts), -1)
            alive = by_part.any(-1)
            keep = alive.tolist()
            members = by_part[alive]
            if members.shape[-1] < 2 or members.all():  # (none alive: no product runs)
                members = None
        with live_members(members):
            if keep is None or all(keep):
                return full(u)
            sub = tuple(i for i, x in enumerate(keep) if x)
            out = torch.zeros_like(u)
            if not sub:
                return out
            if sub not in subsets:  # at most 2^len(parts) of them, built once per Lanczos run
                subsets[sub] = (torch.tensor(sub, device=u.device), make([parts[i] for i in sub]))
            idx, fn = subsets[sub]
            return out.index_copy_(0, idx, fn(u.index_select(0, idx)))

    return mv


def pair_matvec(op: BlockOperator, pair: tuple[str, str], parts: Sequence[str]):
    """Symmetric matvec whose largest ``|λ|`` is ``||H_XY||_2`` for each part, batched ``(len(parts), H, n)``.

    Returns ``(emb, mv)``; ``mv(u, live=None)`` leaves out the parts without a live member (see
    :func:`skip_dead_parts`).
    """
    X, Y = pair
    if X == Y:
        emb = Embedding(op, [X])

        def make_diag(ks: Sequence[str]):
            rows = part_rows(ks, 1, emb)

            def mv(u: torch.Tensor) -> torch.Tensor:
                out = apply_parts(op, emb.embed(u, [X]), [X], rows)
                return emb.extract(out, [X], u.shape[0])

            return mv

        return emb, skip_dead_parts(parts, make_diag)
    emb = Embedding(op, [X, Y])

    def make_pair(ks: Sequence[str]):
        rows = part_rows(ks, 2, emb)

        def mv(u: torch.Tensor) -> torch.Tensor:
            k = u.shape[0]
            # One batched product: the first half perturbs block Y only (we read rows X), the second half
            # perturbs block X only (we read rows Y).
            tY = emb.embed(u, [Y])[Y]
            tX = emb.embed(u, [X])[X]
            tangent = {Y: torch.cat([tY, torch.zeros_like(tY)]), X: torch.cat([torch.zeros_like(tX), tX])}
            out = apply_parts(op, tangent, [X, Y], rows)
            half = next(iter(out.values())).shape[0] // 2
            first = {nm: t[:half] for nm, t in out.items()}
            second = {nm: t[half:] for nm, t in out.items()}
            return emb.extract(first, [X], k) + emb.extract(second, [Y], k)

        return mv

    return emb, skip_dead_parts(parts, make_pair)


def stacked_matvec(op: BlockOperator, names: Sequence[str], parts: Sequence[str]):
    """One symmetric matvec for the diagonal blocks ``XX``, ``YY``, ... of same-shaped parameters ``names``, batched
    ``(len(names) * len(parts), H, n)``: rows ``i * len(parts) + j`` apply part ``j`` of block ``names[i]``.

    One operator product serves every block (the rows of block ``X`` perturb ``X`` alone and read ``X``): the
    dispatched operators of one product instead of one per block, for the arithmetic of all of them (the tangent's
    zero parts cost their share of the first and last matmuls). For head-diagonal operators with ``apply_masked``
    (see :func:`stackable`). Returns ``(emb, mv)`` as :func:`pair_matvec`.
    """
    emb = Embedding(op, [names[0]])
    shape = op.params[names[0]].shape
    labels = [(nm, part) for nm in names for part in parts]

    def make(rows_of: Sequence[tuple[str, str]]):
        present = list(dict.fromkeys(nm for nm, _ in rows_of))
        rows = part_rows([part for _, part in rows_of], 1, emb)
        m = len(rows_of)
        if len(present) == 1:
            (nm,) = present

            def single(u: torch.Tensor) -> torch.Tensor:
                out = apply_parts(op, {nm: u.reshape(m, emb.H, *shape)}, [nm], rows)
                return out[nm].reshape(m, emb.H, emb.n)

            return single
        # (m, 1, 1, 1) 0/1 masks of each block's rows, made once per run and row subset
        masks = {nm: torch.tensor([float(r == nm) for r, _ in rows_of], dtype=op.dtype, device=op.device)
                 .reshape(m, 1, *(1,) * len(shape)) for nm in present}  # fmt: skip

        def mv(u: torch.Tensor) -> torch.Tensor:
            t = u.reshape(m, emb.H, *shape)
            out = apply_parts(op, {nm: t * masks[nm] for nm in present}, present, rows)
            total = out[present[0]] * masks[present[0]]
            for nm in present[1:]:
                total = total.addcmul_(out[nm], masks[nm])
            return total.reshape(m, emb.H, emb.n)

        return mv

    return emb, skip_dead_parts(labels, make)


def stackable(op: BlockOperator, pair_names: Sequence[str]) -> bool:
    """Whether the diagonal pairs ``pair_names`` (e.g. ``QQ``, ``KK``) can share one product (:func:`stacked_matvec`):
    a head-diagonal operator with one-pass products, blocks of one shape and headedness."""
    if len(pair_names) < 2 or not op.head_diagonal or getattr(op, "apply_masked", None) is None:
        return False
    names = list(op.params)
    blocks = [pair_blocks(p, names) for p in pair_names]
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


def dense_blocks(op: BlockOperator, pairs: Sequence[str], full: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """Dense blocks ``dense/{part}/{pair}[/h{i}]`` of shape ``(n_X, n_Y)`` (vec_r order), small sizes only.

    ``full`` names blocks whose whole joint Hessian is also returned as ``dense/{part}/{''.join(full)}``.
    """
    names = list(op.params)
    H = op.n_heads
    cols: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    needed = set()
    for p in pairs:
        needed.update(pair_blocks(p, names))
    needed.update(full)
    emb = Embedding(op, names)
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

    def block(part: str, X: str, Y: str) -> torch.Tensor:
        o, f = cols[Y]
        a, b = offsets[X]
        if part == "outer":
            m = o[a:b]
        elif part == "functional":
            m = f[a:b]
        else:
            m = o[a:b] + f[a:b]
        return m.permute(1, 0, 2)  # (H, nX, nY)

    for p in pairs:
        X, Y = pair_blocks(p, names)
        for part in PARTS:
            m = block(part, X, Y)
            for key, h in zip(head_keys(op, f"dense/{part}/{p}", (X, Y)), range(H), strict=False):
                out[key] = m[h]
    if full:
        label = "".join(full)
        for part in PARTS:
            rows = [torch.cat([block(part, X, Y) for Y in full], dim=-1) for X in full]
            m = torch.cat(rows, dim=-2)
            for h, key in enumerate(head_keys(op, f"dense/{part}/{label}", full)):
                out[key] = m[h]
    return out
