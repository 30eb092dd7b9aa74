"""Grouped-query attention (``H_kv < H``) as two head-diagonal operators: the query head and the kv group as units.

The blocks with a query weight (``QQ``, ``VQ``, ``QK``) are per query head, :class:`QueryView`; those of ``W_K``,
``W_V`` alone (``KK``, ``VV``, ``VK``) and the whole ``QKV`` per kv group, :class:`GroupView`, whose keys
:func:`group_keys` renames ``/g{j}``. The grouped ``VV`` outer norm has no closed form: :func:`grouped_vv_plan`.
"""

from __future__ import annotations

import re

import torch

from ..settings import Lanczos
from ..solver.lanczos import LanczosRun, start_vectors
from ..solver.lockstep import made_together
from ..solver.operator import ALL_ROWS, BlockOperator, ParamInfo, head_keys
from ..solver.plan import Planned
from .operator import AttentionOperator, keep_start, planned_shared, warm_start

__all__ = ["GroupView", "QueryView", "group_keys", "grouped_vv_plan", "grouped_vv_run"]


class GroupView(BlockOperator):
    """The operator with the kv group as the unit (``G > 1``): blocks ``Q`` (the group's ``G`` query heads,
    ``(G, d, d_K)``), ``K`` and ``V``. Groups never meet, so the Lanczos vectors of all groups share one product."""

    supports_subsets = True
    supports_total = True
    head_diagonal = True
    suffix_heads = True
    # the blocks whose outer pull of per-head columns is the unit's column (the sampled keys' Gram path): the group's
    gram_columns = frozenset({"Q", "K", "V"})

    def __init__(self, op: AttentionOperator):
        self.op = op
        self.n_heads = op.H_kv
        self.dtype, self.device = op.dtype, op.device
        self.params = {"V": op.params["V"], "Q": ParamInfo((op.G, *op.params["Q"].shape), True), "K": op.params["K"]}

    def apply(self, tangent, outputs=("V", "Q", "K"), outer_rows=None, func_rows=None, total_rows=None):
        op = self.op
        t = {nm: x.flatten(1, 2) if nm == "Q" else x for nm, x in tangent.items()}  # Q: (n, H_kv, G, ..) -> (n, H, ..)
        parts = op.apply(t, outputs, outer_rows, func_rows, total_rows, mix=True)
        return tuple({nm: x.unflatten(1, (op.H_kv, op.G)) if nm == "Q" else x for nm, x in p.items()} for p in parts)

    def apply_masked(self, tangent, outputs, outer_mask, func_mask):
        """Every row's ``H_part v`` in one pass (:meth:`AttentionOperator.apply_masked`), in the group layout."""
        op = self.op
        t = {nm: x.flatten(1, 2) if nm == "Q" else x for nm, x in tangent.items()}
        out = op.apply_masked(t, outputs, outer_mask, func_mask, mix=True)
        return {nm: x.unflatten(1, (op.H_kv, op.G)) if nm == "Q" else x for nm, x in out.items()}


class QueryView(BlockOperator):
    """The operator with the query head as the unit (``G > 1``): ``Q`` of head ``h``, ``K`` and ``V`` of its group.

    A ``Q``-only product (``QQ``) moves each head's own output only and takes every head at once, without the
    group's mixing. A product that touches ``K`` or ``V`` runs once per position ``s`` of a head inside its group:
    tangent row ``(i, s)`` carries the vectors of heads ``(g, s)`` of every group ``g`` (heads of different groups
    never meet, those of one group do), so each vector costs ``G`` rows.
    """

    supports_subsets = True
    supports_total = True
    head_diagonal = True
    suffix_heads = True
    # the sampled keys' Gram path (see GroupView): a Q-only product is the base operator's, per head, unmixed
    gram_columns = frozenset({"Q"})

    def __init__(self, op: AttentionOperator):
        self.op = op
        self.n_heads = op.H
        self.dtype, self.device = op.dtype, op.device
        self.params = dict(op.params)

    def apply(self, tangent, outputs=("V", "Q", "K"), outer_rows=None, func_rows=None, total_rows=None):
        op = self.op
        G = op.G
        if set(tangent) <= {"Q"} and set(outputs) <= {"Q"}:
            return op.apply(tangent, outputs, outer_rows, func_rows, total_rows, mix=False)
        rows = [
            None if idx is None else (idx[:, None] * G + torch.arange(G, device=idx.device)).flatten()
            for idx in (outer_rows, func_rows, total_rows)
        ]
        parts = op.apply(self._spread(tangent), outputs, *rows, mix=True)
        return tuple({nm: self._gather(nm, x) for nm, x in p.items()} for p in parts)

    def apply_masked(self, tangent, outputs, outer_mask, func_mask):
        """Every row's ``H_part v`` in one pass (:meth:`AttentionOperator.apply_masked`); a ``K``/``V`` product
        expands each row (and its masks) to ``G`` rows as :meth:`apply` does."""
        op = self.op
        if set(tangent) <= {"Q"} and set(outputs) <= {"Q"}:
            return op.apply_masked(tangent, outputs, outer_mask, func_mask, mix=False)

        def spread(mask):
            return mask if mask is None or mask is ALL_ROWS else mask.repeat_interleave(op.G)

        out = op.apply_masked(self._spread(tangent), outputs, spread(outer_mask), spread(func_mask), mix=True)
        return {nm: self._gather(nm, x) for nm, x in out.items()}

    def _spread(self, tangent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Row ``i`` of the head-unit tangent -> rows ``(i, s)`` of the base operator, ``s`` the position in a group."""
        op = self.op
        G, H_kv = op.G, op.H_kv
        eye = torch.eye(G, dtype=op.dtype, device=op.device)
        t = {}
        for nm, x in tangent.items():
            x = x.unflatten(1, (H_kv, G))  # (n, H_kv, G, d_in, k)
            if nm == "Q":  # row (i, s) perturbs head (g, s) of every group g
                t[nm] = (x.unsqueeze(1) * eye.reshape(1, G, 1, G, 1, 1)).flatten(2, 3).flatten(0, 1)  # (n G, H, d, d_K)
            else:  # row (i, s) perturbs group g by the vector of its head (g, s)
                t[nm] = x.transpose(1, 2).flatten(0, 1)  # (n G, H_kv, d_kv, k)
        return t

    def _gather(self, nm: str, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_spread` on an output block: rows ``(i, s)`` back to the head-unit row ``i``."""
        op = self.op
        G, H_kv = op.G, op.H_kv
        x = x.unflatten(0, (-1, G))  # (m, G, heads, d_in, k)
        if nm == "Q":  # head (g, s) from row (i, s)
            return torch.diagonal(x.unflatten(2, (H_kv, G)), dim1=1, dim2=3).movedim(-1, 2).flatten(1, 2)
        return x.transpose(1, 2).flatten(1, 2)  # group g of row (i, s) -> head (g, s)


def group_keys(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys ``.../h{j}`` of a :class:`GroupView` (its unit ``j`` is a kv group) renamed ``.../g{j}``."""
    return {re.sub(r"/h(\d+)$", r"/g\1", k): v for k, v in out.items()}


def grouped_vv_plan(gv: GroupView, lanczos: Lanczos) -> Planned:
    """``VV/g{j}`` for ``G > 1`` as a :class:`Planned` (the kernel solves it with its other runs): the outer part by
    Lanczos (a sum of Kronecker products, no closed-form norm), ``H_f(VV) = 0`` (``F`` is linear in ``W_V``), so the
    total is the outer part: one run for the blocks of a Lockstep that meet here (:func:`grouped_vv_run`,
    :func:`made_together`; every layer's, in a terms-only evaluation). Its ``finish`` gives the keys. (``G > 1`` means
    several heads, hence an output projection: an operator without one has a single head.)"""
    op = gv.op
    start = warm_start(lanczos, ("VV", "grouped"), (op.H_kv, op.Xkv.shape[-1] * op.d_V), op)
    shared = made_together(grouped_vv_run, op.A, op.c, op.row_keep, op.Xkv, op.W_O, start, groups=op.G,
                           tol=lanczos.tol, max_iter=lanczos.max_iter, max_basis=lanczos.max_basis,
                           seed=lanczos.seed)  # fmt: skip

    def finish(runs: list[LanczosRun]) -> dict[str, torch.Tensor]:
        run, i = shared.solved()
        keep_start(lanczos, ("VV", "grouped"), run.ritz[i])
        keys = head_keys(gv, "outer/VV", ("V",))
        norms = dict(zip(keys, run.norm[i].unbind(), strict=True))
        norms.update(zip([f"residual/{k}" for k in keys], run.rel_residual[i].unbind(), strict=True))
        out = {}
        for key, v in group_keys(norms).items():
            out[key] = out[key.replace("outer/", "hessian/", 1)] = v
            if not key.startswith("residual/"):
                out[key.replace("outer/", "functional/", 1)] = torch.zeros_like(v)
        return out

    return planned_shared(shared, finish)


def grouped_vv_run(A: torch.Tensor, c: torch.Tensor, row_keep: torch.Tensor, X: torch.Tensor, W_O: torch.Tensor,
                    start: torch.Tensor, *, groups: int, tol: float, max_iter: int | None,
                    max_basis: int | None, seed: int = 0) -> LanczosRun:  # fmt: skip
    """The Lanczos run of ``||H_o(VV)||`` per kv group of ``m`` grouped-query attention blocks (``G = H / H_kv`` query
    heads per group), driven by :func:`solve`; its batch is ``(m, H_kv)``, its vectors ``(d_kv, d_V)`` flat.

    The group's value weights reach the output through every head of the group, ``dF = sum_h A_h X dW W_O^h``, so the
    Gauss-Newton product is ``dW -> sum_b X_b^T sum_h A_h^T c_b (dF W_O^h^T)`` (padded rows dropped): a sum of
    Kronecker products, no closed-form norm. PSD: the top end alone decides.

    Args:
        A: ``(m, B, H, L, L_kv)``; c: ``(m, B)``; row_keep: ``(m, B, L)``; X: ``(m, B, L_kv, d_kv)``;
            W_O: ``(m, H, d_V, d_out)``; start: ``(m, H_kv, d_kv d_V)``, the start vectors (zero rows: cold).
        groups: ``G``, the query heads per kv group.
        tol, max_iter, max_basis, seed: the Lanczos settings.
    """
    m, B, H, L, L_kv = A.shape
    d, d_V, d_out = X.shape[-1], W_O.shape[-2], W_O.shape[-1]
    G = groups
    H_kv = H // G
    # 3-D views made once, so that every product below is one bmm (einsums over these shapes dispatched ~90 operators
    # per product): the group's heads stacked on the rows, (m B H_kv, G L, L_kv); W_O per group, (m H_kv, G d_V, d_out)
    A3 = A.reshape(m * B * H_kv, G * L, L_kv)
    A3T = A3.mT
    # the group's output metric W_g W_g^T, (m H_kv, G d_V, G d_V), W_g = [W_O^h]_{h in g} (G d_V, d_out): the output
    # tangent's trip through W_O and back, c (sum_h A_h X dW W_O^h) W_O^h'^T, is then one (G d_V)-wide product per row
    # instead of two d_out-wide ones (the curvature c_b is a row scaling: it commutes with the metric)
    W3 = W_O.reshape(m * H_kv, G * d_V, d_out)
    Mg = torch.bmm(W3, W3.mT)
    Xf = X.reshape(m, B * L_kv, d)
    XfT = Xf.mT
    rows = (c.unsqueeze(-1) * row_keep).reshape(m, 1, B * L, 1)  # c_b on the kept rows, 0 on the padded ones

    def mv(v: torch.Tensor) -> torch.Tensor:  # (m, H_kv, d d_V) -> (m, H_kv, d d_V)
        dW = v.view(m, H_kv, d, d_V).permute(0, 2, 1, 3).reshape(m, d, H_kv * d_V)
        XdW = torch.bmm(Xf, dW).view(m, B, L_kv, H_kv, d_V).permute(0, 1, 3, 2, 4).reshape(m * B * H_kv, L_kv, d_V)
        Yh = torch.bmm(A3, XdW).view(m, B, H_kv, G, L, d_V)  # every head's output tangent A_h X dW
        Yh = Yh.permute(0, 2, 1, 4, 3, 5).reshape(m * H_kv, B * L, G * d_V)
        # c (sum_h A_h X dW W_O^h) W_O^h'^T per head h' of the group, (m, H_kv, B, L, G, d_V)
        S = torch.bmm(Yh, Mg).view(m, H_kv, B * L, G * d_V).mul_(rows).view(m, H_kv, B, L, G, d_V)
        S = S.permute(0, 2, 1, 4, 3, 5).reshape(m * B * H_kv, G * L, d_V)
        T = torch.bmm(A3T, S).view(m, B, H_kv, L_kv, d_V)  # sum_h A_h^T (U W_O^h^T), per group
        T = T.permute(0, 1, 3, 2, 4).reshape(m, B * L_kv, H_kv * d_V)
        out = torch.bmm(XfT, T).view(m, d, H_kv, d_V)  # sum_b X_b^T T_b
        return out.permute(0, 2, 1, 3).reshape(m, H_kv, d * d_V)

    return LanczosRun(mv, start_vectors((m, H_kv), d * d_V, A.dtype, A.device, start, seed), tol=tol,
                      max_iter=max_iter, max_basis=max_basis, both_ends=False, seed=seed)  # fmt: skip
