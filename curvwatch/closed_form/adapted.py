"""Curvature in a low-rank adapter's own parameters: a block operator through the chain rule ``dW = s (dA B + A dB)``.

With LoRA the optimizer steps the factors ``theta = (A, B)`` of the updates ``W = W_0 + s A B`` (math convention,
``A`` ``(d_in, r)``, ``B`` ``(r, d_out)``: peft's ``lora_A.weight.T`` and ``lora_B.weight.T``), not ``W``. The map
``D: theta -> dW``, ``D(dA, dB) = s (dA B + A dB)``, is linear, so the block Hessian in ``theta`` is

    H_theta = D^T H_W D + K,        K(dA, dB) = s (G dB^T, dA^T G),

with ``H_W`` the block's operator in its weights (Gauss-Newton and functional parts, sampled output curvature or the
stand-in) and ``K`` the curvature of ``W(theta)`` itself, bilinear in ``(A, B)``, contracted with the gradient of the
loss in the adapted weight, ``G = dL/dW`` ``(d_in, d_out)``. The Gauss-Newton part is ``D^T J^T C J D``: ``K`` belongs
to the functional part. :class:`AdaptedOperator` is that operator: a
:class:`~curvwatch.closed_form.solver.BlockOperator` whose blocks are the adapters, each one flat vector
``theta = [vec(A), vec(B)]``, built on the block's operator and nothing else. So every solver of the package runs on it
unchanged: :func:`~curvwatch.closed_form.solver.sampled_norms` gives ``ggn/XX``, ``sharpness/XX`` and, with Adam's
``P = sqrt(v_hat) + eps`` of the adapter parameters as ``scale = P^{-1/2}``, ``precond_ggn/XX`` and
``precond_sharpness/XX`` of each adapter ``X`` (:func:`adapter_norms`); the stability ratio is
then the optimizer's threshold applied to them, as for a plain weight.

An adapter may write several blocks of the operator (peft's LoRA on GPT-2's fused ``c_attn`` moves ``Q``, ``K`` and
``V``) and only some columns of a block (litgpt's fused ``qkv`` with LoRA on its query and value parts): each
:class:`LowRankTarget` names a block, the columns of ``B`` that land in it and their places there.

The kernels take adapters as a grouped input (:class:`~curvwatch.closed_form.inputs.LowRankUpdate`, by weight
argument: ``adapters=``); :func:`check_adapters` validates them and :func:`adapted_plan` plans their keys
``ggn/lora/<name>``, ``sharpness/lora/<name>`` (``precond_...`` with a preconditioner ``"lora/<name>"``) next to the
kernel's own, for one solve. ``G`` comes from the operator itself (its ``weight_gradient``) where an adapter has none.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .inputs import LowRankUpdate
from .settings import Lanczos
from .solver import BlockOperator, ParamInfo, Planned, sampled_norms, sampled_plan
from .solver.operator import rows_times

__all__ = [
    "ADAPTER_PREFIX",
    "AdaptedOperator",
    "LowRankAdapter",
    "LowRankTarget",
    "adapted_plan",
    "adapter_norms",
    "adapter_shapes",
    "check_adapters",
]

#: The keys of adapter ``<name>``: ``{prefix}/lora/<name>`` (``ggn/lora/q_proj``); its preconditioner's name.
ADAPTER_PREFIX = "lora/"


@dataclass(frozen=True)
class LowRankTarget:
    """Where an adapter's update lands in one block of an operator.

    Args:
        block: The operator's block name (``"Q"``, ``"K"``, ``"V"``, ``"W1"`` ...).
        source: ``(k,)`` ``LongTensor``: the columns of the update (of ``B``) that land in this block.
        dest: ``(k,)`` ``LongTensor``: their places among the block's columns, ``h k_b + j`` for column ``j`` of head
            ``h`` of a block with heads (``k_b`` columns per head). The block's input dimension is ``A``'s ``d_in``;
            columns of the block that no ``dest`` names do not move.
        heads: The block's heads (its leading dimension in the operator's layout: ``H`` for ``Q``, ``H_kv`` for ``K``,
            ``V`` of an attention), or ``None`` for a block without heads.
    """

    block: str
    source: torch.Tensor
    dest: torch.Tensor
    heads: int | None = None

    @classmethod
    def whole(cls, block: str, start: int, width: int, heads: int | None = None) -> LowRankTarget:
        """The update's columns ``start ... start + width - 1`` are the whole block, in order (heads as consecutive
        column groups, as ``view(..., H, d_K)`` reads them)."""
        return cls(block, torch.arange(start, start + width), torch.arange(width), heads)


@dataclass(frozen=True)
class LowRankAdapter:
    """One adapter ``s A B`` and the blocks it writes.

    Args:
        A: ``(d_in, r)``.
        B: ``(r, d_out)``.
        scale: ``s``.
        targets: The blocks its update moves.
        grad: ``G = dL/dW`` ``(d_in, d_out)``, the loss gradient in the columns of ``W`` it updates (needed for the
            functional part, ``K``), or ``None``: read from the operator's ``weight_gradient`` where it has one (else
            the Gauss-Newton part only).
    """

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    targets: tuple[LowRankTarget, ...]
    grad: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.A.numel() + self.B.numel()


def _check_targets(op: BlockOperator, adapters: Mapping[str, LowRankAdapter]) -> None:
    """Raise unless every target is a block of ``op`` with the adapter's ``d_in`` and places inside it."""
    for name, a in adapters.items():
        for t in a.targets:
            info = op.params.get(t.block)
            if info is None:
                raise ValueError(f"Adapter {name!r}: {t.block!r} is not a block of the operator ({list(op.params)}).")
            width = info.shape[-1] * (t.heads or 1)
            ok = (
                info.headed == (t.heads is not None)
                and info.shape[0] == a.A.shape[0]
                and t.source.shape == t.dest.shape
                and t.source.ndim == 1
                and (t.dest.numel() == 0 or (int(t.dest.max()) < width and int(t.source.max()) < a.B.shape[1]))
            )
            if not ok:
                raise ValueError(
                    f"Adapter {name!r} (A {tuple(a.A.shape)}, B {tuple(a.B.shape)}): its target {t.block!r} "
                    f"(source {tuple(t.source.shape)}, dest {tuple(t.dest.shape)}, heads {t.heads}) does not fit the "
                    f"block's shape {info.shape} ({'per head' if info.headed else 'no heads'})."
                )


class AdaptedOperator(BlockOperator):
    """``H_theta v = D^T H_W D v + K v`` for adapters ``theta`` of blocks of the operator ``op`` (module docstring).

    Its blocks are the adapters, each ``(A.numel() + B.numel(),)`` flat (``vec(A)`` first, row-major), without heads.
    The outer part is ``D^T H_o D``; the functional part ``D^T H_f D + K`` (``K`` needs each adapter's ``grad``).

    Args:
        op: The block operator (its ``sampled`` curvature is this operator's:
            :func:`~curvwatch.closed_form.solver.with_sampled` on an ``AdaptedOperator`` replaces the wrapped one's).
        adapters: ``name -> LowRankAdapter``; the names are this operator's blocks (pairs ``"XX"``).
        apply_kwargs: Extra keyword arguments of ``op.apply`` / ``op.apply_masked``: ``{"mix": "all"}`` for an
            :class:`~curvwatch.closed_form.attention.AttentionOperator`, whose heads an adapter moves together (the
            full block, not its head-diagonal part).
        check: Check the targets against ``op``'s blocks (a host read per target: off where :func:`check_adapters`
            checked them on the host already).

    Raises:
        ValueError: For a target that is not a block of ``op`` or does not fit the block's shape.
    """

    supports_subsets = True
    supports_total = True

    def __init__(
        self,
        op: BlockOperator,
        adapters: Mapping[str, LowRankAdapter],
        apply_kwargs: Mapping[str, object] | None = None,
        *,
        check: bool = True,
    ):
        self.op, self.adapters, self.apply_kwargs = op, dict(adapters), dict(apply_kwargs or {})
        if check:
            _check_targets(op, self.adapters)
        self.params = {name: ParamInfo((a.size,), False) for name, a in self.adapters.items()}
        self.blocks = tuple(dict.fromkeys(t.block for a in self.adapters.values() for t in a.targets))
        self.n_heads = 1
        self.head_diagonal = True
        self.dtype, self.device = op.dtype, op.device

    # ``with_sampled`` copies an operator and sets ``sampled``: here it is the wrapped operator's, on a copy of it
    @property
    def sampled(self):
        return getattr(self.op, "sampled", None)

    @sampled.setter
    def sampled(self, curvature) -> None:
        self.op = copy.copy(self.op)
        self.op.sampled = curvature

    def _factors(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dA, dB)`` ``(n, d_in, r)``, ``(n, r, d_out)`` of flat tangents ``(n, size)`` of adapter ``name``."""
        a = self.adapters[name]
        dA, dB = t.split((a.A.numel(), a.B.numel()), dim=-1)
        return dA.reshape(-1, *a.A.shape), dB.reshape(-1, *a.B.shape)

    def _push(self, tangent: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The operator's tangent ``D v``: each adapter's ``s (dA B + A dB)`` in the blocks it writes (summed)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in tangent.items():
            a = self.adapters[name]
            dA, dB = self._factors(name, t)
            dW = (dA @ a.B + a.A @ dB).mul_(a.scale)  # (n, d_in, d_out)
            for t in a.targets:
                k = self.op.params[t.block].shape[-1]
                flat = dW.new_zeros(*dW.shape[:2], k * (t.heads or 1))  # (n, d_in, heads k)
                flat[..., t.dest] = dW[..., t.source]
                block = flat if t.heads is None else flat.unflatten(-1, (t.heads, k)).movedim(2, 1)  # (n, H, d_in, k)
                out[t.block] = block if t.block not in out else out[t.block] + block
        return out

    def _columns(self, out: Mapping[str, torch.Tensor], name: str, n: int) -> torch.Tensor:
        """``M`` ``(n, d_in, d_out)``: adapter ``name``'s columns of the operator's block outputs ``out``."""
        a = self.adapters[name]
        M = torch.zeros((n, a.A.shape[0], a.B.shape[1]), dtype=self.dtype, device=self.device)  # (n, d_in, d_out)
        for t in a.targets:
            block = out[t.block]  # (n, d_in, k) or (n, H, d_in, k)
            flat = block if t.heads is None else block.movedim(1, 2).flatten(2)  # (n, d_in, heads k)
            M[..., t.source] += flat[..., t.dest]
        return M

    def _pull(self, out: Mapping[str, torch.Tensor], names: Sequence[str], n: int) -> dict[str, torch.Tensor]:
        """``D^T`` of the operator's block outputs: ``s (M B^T, A^T M)`` flat, ``M`` the adapter's columns of them."""
        result = {}
        for name in names:
            a = self.adapters[name]
            M = self._columns(out, name, n)
            gA, gB = (M @ a.B.mT).mul_(a.scale), (a.A.mT @ M).mul_(a.scale)  # (n, d_in, r), (n, r, d_out)
            result[name] = torch.cat([gA.flatten(1), gB.flatten(1)], dim=1)
        return result

    def _read_gradients(self) -> None:
        """Each adapter's ``grad`` where it has none, from the operator's ``weight_gradient`` (``J^T g`` of its blocks,
        one product for every adapter). Computed once: the copies :func:`~curvwatch.closed_form.solver.with_sampled`
        makes share the adapters, and ``G`` does not depend on the output curvature."""
        missing = [nm for nm, a in self.adapters.items() if a.grad is None]
        gradient = getattr(self.op, "weight_gradient", None)
        if not missing or gradient is None:
            return
        grads = {block: G.unsqueeze(0) for block, G in gradient(self.blocks).items()}  # (1, [H,] d_in, k)
        for nm in missing:
            self.adapters[nm] = dataclasses.replace(self.adapters[nm], grad=self._columns(grads, nm, 1)[0])

    def _curvature_of_w(self, tangent: Mapping[str, torch.Tensor], names: Sequence[str], n: int):
        """``K v`` ``(n, size)`` per adapter in ``names`` (zeros where ``tangent`` has none)."""
        self._read_gradients()
        out = {}
        for name in names:
            a = self.adapters[name]
            t = tangent.get(name)
            if t is None:
                out[name] = torch.zeros((n, a.size), dtype=self.dtype, device=self.device)
                continue
            if a.grad is None:
                raise ValueError(
                    f"Adapter {name!r} has no grad: the functional part of the curvature in its parameters needs the "
                    "loss gradient in the adapted weight (LowRankAdapter.grad)."
                )
            dA, dB = self._factors(name, t)
            kA, kB = (a.grad @ dB.mT).mul_(a.scale), (dA.mT @ a.grad).mul_(a.scale)  # (n, d_in, r), (n, r, d_out)
            out[name] = torch.cat([kA.flatten(1), kB.flatten(1)], dim=1)
        return out

    def apply(self, tangent, outputs=None, outer_rows=None, func_rows=None, total_rows=None):
        """``(H_o v, H_f v)`` (and ``H v`` with ``total_rows``) for the adapters in ``outputs`` (default all), rows as
        :meth:`~curvwatch.closed_form.ffn.FFNOperator.apply` selects them."""
        names = tuple(self.params) if outputs is None else tuple(outputs)
        n = next(iter(tangent.values())).shape[0]
        parts = self.op.apply(
            self._push(tangent), outputs=self.blocks, outer_rows=outer_rows, func_rows=func_rows,
            total_rows=total_rows, **self.apply_kwargs,
        )  # fmt: skip
        rows = (outer_rows, func_rows, total_rows)
        out = []
        for i, (part, idx) in enumerate(zip(parts, rows, strict=False)):
            m = n if idx is None else len(idx)
            pulled = self._pull(part, names, m) if part else {nm: self._zeros(m, nm) for nm in names}
            if i > 0:  # the functional and total rows: + K v
                sub = tangent if idx is None else {nm: t.index_select(0, idx) for nm, t in tangent.items()}
                for nm, k in self._curvature_of_w(sub, names, m).items():
                    pulled[nm] = pulled[nm] + k
            out.append(pulled)
        return tuple(out)

    @property
    def apply_masked(self):
        """The wrapped ``apply_masked`` through the chain rule (``K`` on the rows of ``func_mask``), or None where the
        operator has none."""
        inner = getattr(self.op, "apply_masked", None)
        if inner is None:
            return None

        def masked(tangent, outputs, outer_mask, func_mask):
            names = tuple(outputs)
            n = next(iter(tangent.values())).shape[0]
            pulled = self._pull(inner(self._push(tangent), self.blocks, outer_mask, func_mask, **self.apply_kwargs),
                                names, n)  # fmt: skip
            if func_mask is not None:
                for nm, k in self._curvature_of_w(tangent, names, n).items():
                    pulled[nm] = pulled[nm] + rows_times(k, func_mask)
            return pulled

        return masked


def adapter_norms(
    op: BlockOperator,
    adapters: Mapping[str, LowRankAdapter],
    *,
    lanczos: Lanczos,
    precondition: Mapping[str, torch.Tensor] | None = None,
    apply_kwargs: Mapping[str, object] | None = None,
) -> dict[str, torch.Tensor]:
    """``ggn/XX``, ``sharpness/XX`` (and, for the adapters in ``precondition``, ``precond_ggn/XX``,
    ``precond_sharpness/XX``) of each adapter ``X``, with their ``residual/...`` keys (and ``sharpness_spread/...``
    with ``k >= 2`` samples), by :func:`~curvwatch.closed_form.solver.sampled_norms` on :class:`AdaptedOperator`.

    Args:
        op: The block operator with sampled output curvature (:func:`~curvwatch.closed_form.solver.with_sampled`).
        adapters: ``name -> LowRankAdapter``; ``sharpness/XX`` needs each one's ``grad``.
        lanczos: The Lanczos settings.
        precondition: ``name -> P`` ``(size,)``: the diagonal of the optimizer's preconditioner of the adapter's
            parameters ``[vec(A), vec(B)]`` in that order (Adam: ``sqrt(v_hat) + eps``, transposed from peft's
            ``lora_A``/``lora_B`` layout), positive.
        apply_kwargs: See :class:`AdaptedOperator`.
    """
    adapted = AdaptedOperator(op, adapters, apply_kwargs)
    scale = {name: P.to(op.dtype).rsqrt() for name, P in (precondition or {}).items()}
    return sampled_norms(adapted, [name + name for name in adapters], lanczos=lanczos, scale=scale)


def check_adapters(
    adapters: Mapping[str, LowRankUpdate] | None,
    weights: Mapping[str, tuple[int, int]],
    ref: torch.Tensor,
    *,
    has_samples: bool,
) -> dict[str, LowRankUpdate]:
    """Validate a kernel's ``adapters``; return them with ``A``, ``B`` in ``ref``'s dtype and device and their columns
    as ``LongTensor`` s there (``{}`` for None).

    Every adapter's columns are checked in one host read (the capture holds them on the host: no device sync).

    Args:
        adapters: ``name -> LowRankUpdate``; a name is a word (``\\w+``: it becomes a key, ``ggn/lora/<name>``).
        weights: The kernel's weight arguments that have blocks, and their shapes as passed (``{"W_1": (d, f)}``).
        ref: A tensor of the working dtype and device.
        has_samples: Whether ``output_samples`` was given (the adapters' keys are sampled keys).

    Raises:
        ValueError: Without ``output_samples``, for a name that is not a word, factors that do not multiply, a
            weight without a block (``W_O``), or columns outside ``B`` or the weight.
    """
    if not adapters:
        return {}
    if not has_samples:
        raise ValueError(
            "adapters= needs output_samples= (grad_output mode): the curvature in the adapters' parameters is given by "
            "the sampled keys (ggn/lora/..., sharpness/lora/...). Pass output_samples as well, or drop adapters."
        )
    if not isinstance(adapters, Mapping):
        raise ValueError(f"Invalid adapters={type(adapters).__name__}. Must be a mapping name -> LowRankUpdate.")
    columns = []  # (name, weight, source, dest) of every write, shapes checked
    for name, u in adapters.items():
        if not isinstance(name, str) or not re.fullmatch(r"\w+", name):
            raise ValueError(f"Invalid adapter name {name!r}: a word (letters, digits, _), as it becomes a key.")
        if not isinstance(u, LowRankUpdate):
            raise ValueError(f"Adapter {name!r} is a {type(u).__name__}; pass a curvwatch.closed_form.LowRankUpdate.")
        A, B = u.A, u.B
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[0] or not u.writes:
            raise ValueError(
                f"Adapter {name!r}: A {tuple(A.shape)} must be (d_in, r) and B {tuple(B.shape)} (r, k), writing at "
                "least one weight."
            )
        for w, (source, dest) in u.writes.items():
            if w not in weights:
                raise ValueError(
                    f"Adapter {name!r} writes {w!r}, which has no block in this kernel's curvature (blocks of "
                    f"{list(weights)}): its adapter's curvature is not computed here; leave it out of adapters."
                )
            if A.shape[0] != weights[w][0] or source.ndim != 1 or source.shape != dest.shape:
                raise ValueError(
                    f"Adapter {name!r} (A {tuple(A.shape)}, B {tuple(B.shape)}) does not fit {w} {weights[w]}: A has "
                    f"{w}'s input rows, and its columns are two (n,) tensors (source, dest); got "
                    f"{tuple(source.shape)}, {tuple(dest.shape)}."
                )
            columns.append((name, w, source, dest))
    flat = torch.cat([t.reshape(-1).long().cpu() for _, _, src, dst in columns for t in (src, dst)]).tolist()
    out: dict[str, LowRankUpdate] = {}
    at = 0
    for name, w, source, _ in columns:
        n = source.numel()
        src, dst = flat[at : at + n], flat[at + n : at + 2 * n]
        at += 2 * n
        u = adapters[name]
        if any(not 0 <= c < u.B.shape[1] for c in src) or any(not 0 <= c < weights[w][1] for c in dst):
            raise ValueError(
                f"Adapter {name!r}: its columns of {w} must be columns of B ({u.B.shape[1]}) landing in columns of {w} "
                f"({weights[w][1]})."
            )
        if name not in out:
            out[name] = LowRankUpdate(u.A.to(ref), u.B.to(ref), float(u.scale), {})
        out[name].writes[w] = (torch.as_tensor(src, dtype=torch.long, device=ref.device),
                               torch.as_tensor(dst, dtype=torch.long, device=ref.device))  # fmt: skip
    return out


def adapter_shapes(adapters: Mapping[str, LowRankUpdate]) -> dict[str, tuple[int]]:
    """The preconditioner entries of the adapters: ``"lora/<name>" -> (A.numel() + B.numel(),)`` (``[vec A, vec
    B]``)."""
    return {ADAPTER_PREFIX + name: (u.A.numel() + u.B.numel(),) for name, u in adapters.items()}


def adapted_plan(
    op: BlockOperator,
    adapters: Mapping[str, LowRankUpdate],
    blocks: Mapping[str, tuple[str, int | None]],
    *,
    lanczos: Lanczos,
    scale: Mapping[str, torch.Tensor] | None = None,
    apply_kwargs: Mapping[str, object] | None = None,
) -> Planned:
    """The sampled keys of a kernel's adapters as a :class:`~curvwatch.closed_form.solver.Planned` (solved with the
    kernel's own runs): ``ggn/lora/<name>``, ``sharpness/lora/<name>``, with ``scale`` holding ``"lora/<name>"``
    ``precond_ggn/lora/<name>`` and ``precond_sharpness/lora/<name>``, their ``residual/...`` and (``k >= 2``)
    ``sharpness_spread/lora/<name>``, by :func:`~curvwatch.closed_form.solver.sampled_plan` on the
    :class:`AdaptedOperator` of ``op``.

    Args:
        op: The block operator with sampled output curvature (:func:`~curvwatch.closed_form.solver.with_sampled`).
        adapters: From :func:`check_adapters`.
        blocks: Weight argument -> ``(block of op, its heads or None)``: ``{"W_Q": ("Q", H), "W_1": ("W1", None)}``.
        lanczos: The Lanczos settings.
        scale: ``"lora/<name>" -> D = P^{-1/2}`` ``(size,)`` (the kernel's checked preconditioner); other entries are
            ignored.
        apply_kwargs: See :class:`AdaptedOperator`.
    """
    scale = scale or {}
    inner = {f"a{i}": name for i, name in enumerate(adapters)}  # the operator's block names: plain words
    low = {}
    for a, name in inner.items():
        u = adapters[name]
        targets = tuple(LowRankTarget(blocks[w][0], src, dst, blocks[w][1]) for w, (src, dst) in u.writes.items())
        low[a] = LowRankAdapter(u.A, u.B, u.scale, targets)
    adapted = AdaptedOperator(op, low, apply_kwargs, check=False)
    D = {a: scale[ADAPTER_PREFIX + name] for a, name in inner.items() if ADAPTER_PREFIX + name in scale}
    plan = sampled_plan(adapted, [([a + a for a in low], None, ())], lanczos=lanczos, scale=D)
    renamed = {a + a: ADAPTER_PREFIX + name for a, name in inner.items()}

    def finish(runs: list) -> list[dict[str, torch.Tensor]]:
        keys = plan.finish(runs)[0]
        return [{_renamed(key, renamed): value for key, value in keys.items()}]

    makers, plan.makers = plan.makers, []  # (the solve consumes the wrapper's: the products are released as made)
    return Planned(makers, finish, together=plan.together, merge=plan.merge)


def _renamed(key: str, renamed: Mapping[str, str]) -> str:
    """``ggn/a0a0`` -> ``ggn/lora/q_proj``: the key's last segment, an inner pair name, replaced."""
    head, _, last = key.rpartition("/")
    return f"{head}/{renamed[last]}" if last in renamed else key
