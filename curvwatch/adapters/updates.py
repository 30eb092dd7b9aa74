"""Where each low-rank update of a block lands in its kernel's weight arguments (for the curvature in the adapters).

An adapter's ``read_params`` turns projections into kernel arguments by re-indexing only (transposes, fused-QKV
splits, head layouts): :func:`kernel_updates` reads the block once with every adapted projection's weight replaced by
the positions of its entries (:func:`~curvwatch.adapters.projections.tracing`) and decodes, for each argument
(``W_Q``, ``W_1`` ...), which columns of which update's ``B`` it holds. That is what the chain rule in the adapter's
parameters needs (:class:`curvwatch.closed_form.adapted.LowRankTarget`), for any adapter, without knowing its layout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from curvwatch.adapters.base import BlockSpec
from curvwatch.adapters.projections import TRACE_STRIDE, LowRank, UnsupportedWrapperError, tracing

__all__ = ["KernelUpdate", "kernel_updates"]


@dataclass(frozen=True)
class KernelUpdate:
    """One low-rank update as it lands in one weight argument of a block's kernel.

    Args:
        weight: The kernel argument (``"W_Q"``, ``"W_V"``, ``"W_1"`` ...), math convention ``(d_in, k)``.
        update: The update ``s A B`` (its factors, live views of the parameters the optimizer steps).
        source: ``(n,)`` ``LongTensor``: the columns of ``update.B`` that land in the argument.
        dest: ``(n,)`` ``LongTensor``: the argument's columns they land in.
    """

    weight: str
    update: LowRank
    source: Tensor
    dest: Tensor


def kernel_updates(
    spec: BlockSpec, read_params: Callable[[BlockSpec], Mapping[str, Any]] | None = None
) -> list[KernelUpdate]:
    """The low-rank updates of ``spec``'s weights, by kernel argument (see the module docstring).

    Args:
        spec: The block.
        read_params: Its reader (default ``spec.adapter.read_params``).

    Returns:
        One entry per (argument, update) pair; empty for a block without adapters.

    Raises:
        UnsupportedWrapperError: If an argument mixes a projection's entries with others, or reads its rows out of
            order (a reader that computes with the weights instead of re-indexing them).
    """
    read = spec.adapter.read_params if read_params is None else read_params
    with tracing() as traced, torch.no_grad():
        args = read(spec)
    out = []
    for name, value in args.items():
        if not isinstance(value, Tensor) or value.ndim != 2 or value.dtype != torch.float64:
            continue
        for projection, offset in traced:
            out += _decode(spec.name, name, value, projection, offset)
    return out


def _decode(block: str, name: str, value: Tensor, projection, offset: int) -> list[KernelUpdate]:
    """The updates of ``projection`` (its positions start at ``offset``) in argument ``value`` ``(d_in, k)``."""
    d_in, d_out = projection.W.shape
    rel = value - offset
    inside = (rel >= 0) & (rel < d_in * d_out)
    if not bool(inside.any()):
        return []
    columns = inside.all(dim=0)  # (k,) the argument's columns that are this projection's
    bad = bool((inside.any(dim=0) & ~columns).any()) or value.shape[0] != d_in or bool(rel.abs().max() >= TRACE_STRIDE)
    rel = rel[:, columns].round().long()
    rows, cols = rel // d_out, rel % d_out  # (d_in, n)
    if bad or not torch.equal(rows, torch.arange(d_in, device=rows.device)[:, None].expand_as(rows)):
        raise UnsupportedWrapperError(
            f"{block}: the adapter's {name} is not a column selection of an adapted projection's weight, so the "
            "curvature in the adapter's parameters cannot be mapped onto it."
        )
    dest = columns.nonzero().reshape(-1).cpu()
    c = cols[0].cpu()  # (n,) the projection's column of each
    out = []
    for u in projection.updates:
        if u.columns is None:
            source, keep = c, torch.ones_like(c, dtype=torch.bool)
        else:  # the update writes some columns (litgpt's fused qkv): B's column of each projection column it writes
            where = torch.full((d_out,), -1, dtype=torch.long)
            where[u.columns.cpu()] = torch.arange(u.columns.numel())
            source = where[c]
            keep = source >= 0
        if bool(keep.any()):
            out.append(KernelUpdate(name, u, source[keep], dest[keep]))
    return out
