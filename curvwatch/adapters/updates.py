"""Where each low-rank update of a block lands in its kernel's weight arguments (for the curvature in the adapters).

An adapter's ``read_params`` turns projections into kernel arguments by re-indexing only (transposes, fused-QKV
splits, head layouts): :func:`kernel_updates` reads the block once with every adapted projection's weight replaced by
the positions of its entries (:func:`~curvwatch.adapters.projections.tracing`) and decodes, for each argument
(``W_Q``, ``W_1`` ...), which columns of which update's ``B`` it holds. That is what the chain rule in the adapter's
parameters needs (:class:`curvwatch.closed_form.adapted.LowRankTarget`), for any adapter, without knowing its layout.

:func:`block_adapters` groups them by update into the block's adapters as the kernels take them (:class:`AdapterSite`:
a name for the keys, where the update lands, the parameters the optimizer steps), decided once per block; each
captured step then snapshots the factors of its sites (:meth:`AdapterSite.update_of`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from curvwatch.adapters.base import BlockSpec
from curvwatch.adapters.projections import TRACE_STRIDE, LowRank, Projection, UnsupportedWrapperError, tracing

__all__ = ["AdapterSite", "KernelUpdate", "block_adapters", "kernel_updates"]


@dataclass(frozen=True)
class KernelUpdate:
    """One low-rank update as it lands in one weight argument of a block's kernel.

    Args:
        weight: The kernel argument (``"W_Q"``, ``"W_V"``, ``"W_1"`` ...), math convention ``(d_in, k)``.
        update: The update ``s A B`` (its factors, live views of the parameters the optimizer steps).
        source: ``(n,)`` ``LongTensor``: the columns of ``update.B`` that land in the argument.
        dest: ``(n,)`` ``LongTensor``: the argument's columns they land in.
        module: The projection (its wrapper) the update belongs to.
    """

    weight: str
    update: LowRank
    source: Tensor
    dest: Tensor
    module: nn.Module | None = None


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
        for projection, offset, module in traced:
            out += _decode(spec.name, name, value, projection, offset, module)
    return out


def _decode(block: str, name: str, value: Tensor, projection, offset: int, module: nn.Module) -> list[KernelUpdate]:
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
            out.append(KernelUpdate(name, u, source[keep], dest[keep], module))
    return out


@dataclass(frozen=True, eq=False)
class AdapterSite:
    """One low-rank update of a block, as the kernels take it (``adapters=``), found once per block.

    Args:
        name: Its name in the keys (``ggn/lora/<name>``): the projection's attribute name (``q_proj``, ``c_attn``),
            with the update's part where the projection has several (``qkv_q``).
        scale: ``s`` of ``s A B``.
        writes: Kernel argument -> ``(source, dest)`` (:class:`KernelUpdate`): the columns of ``B`` that land in it
            and where.
        params: The parameters the optimizer steps, ``(lora_A, lora_B)`` as the module holds them.
        part: The update's :attr:`~curvwatch.adapters.projections.LowRank.part`.
    """

    name: str
    scale: float
    writes: dict[str, tuple[Tensor, Tensor]]
    params: tuple[Tensor, Tensor]
    part: str | None

    def update_of(self, found: Sequence[Projection]) -> LowRank | None:
        """This site's update among the projections of one read (:func:`~curvwatch.adapters.projections.collecting`),
        or None where the read has none (adapters disabled or merged since)."""
        for projection in found:
            for u in projection.updates:
                if (
                    u.params is not None
                    and u.part == self.part
                    and all(a is b for a, b in zip(u.params, self.params, strict=True))
                ):
                    return u
        return None


def block_adapters(
    spec: BlockSpec, weights: Collection[str], read_params: Callable[[BlockSpec], Mapping[str, Any]] | None = None
) -> tuple[dict[str, AdapterSite], dict[str, str]]:
    """The low-rank updates of ``spec``'s weights grouped by update (:func:`kernel_updates`), named.

    Args:
        spec: The block.
        weights: The kernel arguments whose adapters its kernel takes (:attr:`~curvwatch.kinds.BlockKind.adapted`).
        read_params: Its reader (default ``spec.adapter.read_params``).

    Returns:
        ``({name: site}, {name: why not})``: the updates the kernel takes, in read order, and those it does not (an
        update that writes another argument, ``W_O``), with the reason.

    Raises:
        UnsupportedWrapperError: As :func:`kernel_updates` (DoRA: not a frozen weight plus low-rank updates).
    """
    grouped: dict[int, tuple[LowRank, nn.Module | None, dict[str, tuple[Tensor, Tensor]]]] = {}
    for ku in kernel_updates(spec, read_params):
        entry = grouped.setdefault(id(ku.update), (ku.update, ku.module, {}))
        entry[2][ku.weight] = (ku.source, ku.dest)
    owner = spec.layer_module if spec.layer_module is not None else spec.module
    paths = {id(m): name for name, m in owner.named_modules()}
    found = [(paths.get(id(m), type(m).__name__) if m is not None else "update", u, w) for u, m, w in grouped.values()]
    names = _names([(path, u.part) for path, u, _ in found])
    sites: dict[str, AdapterSite] = {}
    refused: dict[str, str] = {}
    for name, (_, u, writes) in zip(names, found, strict=True):
        other = sorted(set(writes) - set(weights))
        if other:
            refused[name] = (
                f"its low-rank adapter {name!r} writes {', '.join(other)}, which has no block in the {spec.kind} "
                f"closed form (its blocks: {', '.join(weights)}), so the curvature in the adapter's parameters is not "
                "computed"
            )
            continue
        if u.params is None:
            refused[name] = f"its low-rank adapter {name!r} does not name the parameters the optimizer steps"
            continue
        sites[name] = AdapterSite(name, u.scale, writes, u.params, u.part)
    return sites, refused


def _names(found: Sequence[tuple[str, str | None]]) -> list[str]:
    """Key names of updates ``(module path, part)``: the path's last attribute (``q_proj``), the whole path where two
    modules share it, each followed by ``_<part>`` where a module has several updates; ``\\w`` characters only."""
    short = [path.rsplit(".", 1)[-1] for path, _ in found]
    paths = {path for path, _ in found}
    clash = {s for s in short if len({p for p, _ in found if p.rsplit(".", 1)[-1] == s}) > 1}
    per_module = {path: sum(p == path for p, _ in found) for path in paths}
    out = []
    for (path, part), s in zip(found, short, strict=True):
        name = path if s in clash else s
        if per_module[path] > 1 and part is not None:
            name = f"{name}_{part}"
        out.append(re.sub(r"\W", "_", name))
    return out
