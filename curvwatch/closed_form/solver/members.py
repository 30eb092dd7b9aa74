"""The Lanczos members of the sampled keys as rows of few operator products, and each sample's share of their values.

A sampled key of a diagonal block ``XX`` has several Lanczos members: the plain and the preconditioned variant, each
on the full sample and (debiased keys) on its two halves. They differ only in their samples' weights and in a
diagonal scaling, so :func:`members_matvec` applies up to :data:`MEMBER_ROWS` members of any of them in **one**
operator product; :func:`member_shares` reads each sample's part of their values at their Ritz vectors (the debiased
keys' noise, :func:`~.debiasing.debias`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .operator import BlockOperator, Embedding, apply_parts, pair_matvec, part_rows, skip_dead_parts
from .sampled import SampledCurvature, with_sampled

__all__ = ["MEMBER_ROWS", "Recorder", "member_shares", "members_matvec"]

#: At most this many rows per operator product of the stacked members (:func:`members_matvec`): the rows of the
#: engine's own largest product (attention's ``QQ`` and ``KK``, three parts each), so that a product's temporaries (the
#: attention's ``(B, H, L, L)`` tangents per row) stay within what the engine's evaluation of the block takes anyway.
#: (12 rows, the attention's ``QQ`` and ``KK`` members in one product, save ~5% of one attention block's operators at
#: a GPU shape and raise its peak memory by ~32%.)
MEMBER_ROWS = 6


@dataclass
class _Members:
    """What every product of :func:`members_matvec` shares: the base operator and its ``view``, the blocks' names,
    their ``D`` in the view's layout and their Gram columns, the estimates' sample weights (``(k,)`` each; per column,
    ``(k B,)``, where the columns are held), and the embedding of one block."""

    op: BlockOperator
    view: Callable[[BlockOperator], BlockOperator]
    curvature: SampledCurvature
    names: list[str]
    Ds: list[torch.Tensor | None]
    columns: list[torch.Tensor | None]
    estimates: list[torch.Tensor]
    column_weights: list[torch.Tensor] | None
    emb: Embedding
    layout: tuple[int, ...]


def members_matvec(
    op: BlockOperator,
    blocks: Sequence[tuple[str, torch.Tensor | None, torch.Tensor | None]],
    curvature: SampledCurvature,
    E: int,
    parts_one: Sequence[str],
    view: Callable[[BlockOperator], BlockOperator] = lambda o: o,
):
    """``(emb, mv)`` for the Lanczos members of the sampled keys of the diagonal blocks ``XX`` of ``blocks``, in few
    operator products.

    ``blocks``: ``[(X, D, columns)]``, one or more blocks of one shape and headedness (:func:`~.operator.stackable`:
    the attention's ``Q`` and ``K``), each with ``D`` (``P^{-1/2}`` in the base operator's layout of ``X``, as
    :class:`~.sampled.Preconditioned` takes it; given for all of them or for none) and ``columns`` (below; for all or
    none). The members are ``(block b, variant i, estimate e)``: ``i = 0`` plain and, with ``D``, ``i = 1``
    preconditioned; ``e = 0`` the full sample and, with ``E = 3``, ``e = 1, 2`` its halves (as
    :meth:`SampledCurvature.halves`). Member ``r = (b P + i) E + e`` (``P`` variants) owns the rows ``m r ... m r + m -
    1`` (``m`` = ``len(parts_one)``): the layout of one :func:`~.operator.pair_matvec` per member, concatenated. The
    estimates differ only in their samples' weights (``1/k`` on all, or ``1/k_a`` on one half's), applied per row
    (:meth:`SampledCurvature.per_row`); the preconditioned rows are scaled by their block's ``D`` on the way in and
    out, and the rows of block ``b`` perturb ``X_b`` alone and read ``X_b`` (0/1 row masks, as
    :func:`~.operator.stacked_matvec`): so up to :data:`MEMBER_ROWS` rows of any members share **one** product, the
    same numbers as one product per member in the dispatched operators of one (only the arithmetic grows with the
    rows). ``view`` maps an operator to the one the blocks are read from (the grouped-query views); it must be
    head-diagonal and have ``apply_masked`` (one pass over every row: the curvature sees every row, in order).

    With ``columns``, the samples' Gram columns ``A`` ``(H, k B, size)`` of the block (:func:`~.gram.gram_columns`;
    only ``"hessian"`` parts), a product is the operator's **functional** part plus the Gauss-Newton part from the
    columns: ``J_X^T C_e J_X v = sum_c w_{e,c} A_c <A_c, v>`` per head, ``w_{e,c}`` the member's weight of column
    ``c``'s sample (column ``j B + b`` is sample ``j``): the same numbers, without the operator's first-order pass and
    the sampled curvature (two ``(H, rows, k B)`` products against each block's ``A`` instead).
    """
    if len({D is None for _, D, _ in blocks}) > 1 or len({A is None for _, _, A in blocks}) > 1:
        raise ValueError("The stacked blocks take D and columns all or none.")
    members = _members(op, blocks, curvature, E, view)
    if members.column_weights is not None and set(parts_one) != {"hessian"}:
        raise ValueError(f"Gram columns serve the 'hessian' members only, not {parts_one}.")
    labels = [(b, i, e, part) for b in range(len(blocks)) for i in range(1 if members.Ds[0] is None else 2)
              for e in range(E) for part in parts_one]  # fmt: skip

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
        products = [_product(members, c) for c in chunks]
        if len(products) == 1:
            return products[0]
        bounds = [0]
        for c in chunks:
            bounds.append(bounds[-1] + len(c))

        def mv(u: torch.Tensor) -> torch.Tensor:
            return torch.cat([f(u[a:z]) for f, a, z in zip(products, bounds[:-1], bounds[1:], strict=True)])

        return mv

    return members.emb, skip_dead_parts(labels, make)


def _members(op, blocks, curvature: SampledCurvature, E: int, view) -> _Members:
    """The :class:`_Members` of :func:`members_matvec`'s arguments."""
    estimates = curvature.estimate_weights(E, op.dtype, op.device)  # (k,) sample weights of each estimate
    names = [X for X, _, _ in blocks]
    emb = Embedding(view(op), names[:1])
    info = view(op).params[names[0]]
    layout = (emb.H, *info.shape) if info.headed else tuple(info.shape)  # a tangent row (head-diagonal operator)
    Ds = [None if D is None else D.reshape(layout) for _, D, _ in blocks]  # the view's layout (same entries, order)
    columns = [A for _, _, A in blocks]
    column_weights = None
    if columns[0] is not None:
        B = columns[0].shape[1] // curvature.k  # (the columns of sample j are j B ... j B + B - 1)
        column_weights = [w.repeat_interleave(B) for w in estimates]  # (k B,) per estimate
    return _Members(op, view, curvature, names, Ds, columns, estimates, column_weights, emb, layout)


def _scaled_rows(rows_of) -> list[tuple[int, int, int]]:
    """The preconditioned rows of a product, as runs ``(block, start, stop)`` of consecutive rows of one block (the
    labels stay in order)."""
    scaled: list[tuple[int, int, int]] = []
    for r, (b, i, _, _) in enumerate(rows_of):
        if i == 0:
            continue
        if scaled and scaled[-1][0] == b and scaled[-1][2] == r:
            scaled[-1] = (b, scaled[-1][1], r + 1)
        else:
            scaled.append((b, r, r + 1))
    return scaled


def _product(members: _Members, rows_of):
    """One operator product for the member rows ``rows_of`` (labels ``(block, variant, estimate, part)``)."""
    op, emb, layout, Ds = members.op, members.emb, members.layout, members.Ds
    n = len(rows_of)
    W = None
    if members.column_weights is None:
        rows = part_rows([part for *_, part in rows_of], 1, emb)
        weights = torch.stack([members.estimates[e] for _, _, e, _ in rows_of])  # (n, k)
        member_op = members.view(with_sampled(op, members.curvature.per_row(weights)))
    else:  # the operator's functional part; the Gauss-Newton part from the columns
        rows = part_rows(["functional"] * n, 1, emb)
        member_op = members.view(op)
        W = torch.stack([members.column_weights[e] for _, _, e, _ in rows_of])  # (n, k B)
    present = list(dict.fromkeys(b for b, *_ in rows_of))
    scaled = _scaled_rows(rows_of)
    whole = scaled[0][0] if len(scaled) == 1 and scaled[0][1:] == (0, n) else None  # (no slices then)
    # (n, 1, ...) 0/1 masks of each block's rows where several blocks share the product, made once per row set
    masks = None
    if len(present) > 1:
        masks = {b: torch.tensor([float(rb == b) for rb, *_ in rows_of], dtype=op.dtype, device=op.device)
                 .reshape(n, *(1,) * len(layout)) for b in present}  # fmt: skip
    outputs = [members.names[b] for b in present]

    def mv(u: torch.Tensor) -> torch.Tensor:
        v = u.reshape(n, *layout)  # (the Lanczos vectors, its basis's: not changed)
        if whole is not None:  # every row preconditioned, by one block's D
            v = v * Ds[whole]
        elif scaled:
            v = v.clone()
            for b, start, stop in scaled:
                v[start:stop].mul_(Ds[b])
        tangent = {members.names[b]: v if masks is None else v * masks[b] for b in present}
        out = apply_parts(member_op, tangent, outputs, rows)
        total = None
        for b in present:
            o = out[members.names[b]]
            if W is not None:  # + sum_c w_c A_c <A_c, v> per head, through (H, n, k B) coefficients
                A = members.columns[b]
                coeff = torch.bmm(tangent[members.names[b]].reshape(n, emb.H, emb.n).transpose(0, 1), A.mT).mul_(W)
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


class Recorder:
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


def member_shares(
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
    quotient of each Lanczos member ``(variant i, estimate e, name n)`` at its unit Ritz vector ``v``
    (:func:`~.debiasing.debias`'s ``shares``; the block's own functional part is exact and has none), ``w_{e,j}`` =
    ``weights[e, j]`` the estimate's sample weight (``1/k`` on all, ``1/k_a`` on one half's:
    :meth:`SampledCurvature.counts`), ``D_0 = 1`` and ``D_1 = D`` (``P = 2``; ``D`` None: ``P = 1``).

    ``ritz`` ``(P E m, H, size)``: the members' Ritz vectors in the rows' order of
    :func:`~.sampled_keys.sampled_plan` (row ``m (i E + e) + n``); ``view``: maps the operator to the one the block
    is read from; ``D``: the block's ``P^{-1/2}`` in the base operator's layout (the view's: same entries, order).
    Products of at most :data:`MEMBER_ROWS` rows (the members' own) through the operator's outer part
    (:class:`Recorder`), the preconditioned rows scaled on the way in."""
    E, k = weights.shape
    v = ritz / ritz.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(ritz.dtype).tiny)  # (a zero vector: no share)
    if D is not None:
        v[E * m :] *= D.reshape(v.shape[1:])
    recorder = Recorder(curvature)
    member_op = view(with_sampled(op, recorder))
    products = range(0, v.shape[0], MEMBER_ROWS)
    for start in products:
        rows = v[start : start + MEMBER_ROWS]
        pair_matvec(member_op, (X, X), ("outer",) * rows.shape[0])[1](rows)
    if len(recorder.coefficients) != len(products):  # (an operator applies its output curvature once per product)
        raise RuntimeError(f"{len(recorder.coefficients)} applications of the output curvature in {len(products)}")
    q = torch.cat(recorder.coefficients).square().sum(2)  # (P E m, k, H)
    return q.view(-1, E, m, k, q.shape[-1]) * weights.view(1, E, 1, k, 1)
