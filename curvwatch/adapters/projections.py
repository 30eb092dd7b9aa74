"""Reading a projection's weight as its forward uses it: plain, Conv1D, with low-rank adapters, or refused.

Every adapter reads its projections (``q_proj``, ``c_attn``, ``fc_1`` ...) through :func:`read_projection`, which
returns the *effective* weight in the math convention ``X @ W``, ``W`` of shape ``(d_in, d_out)``:

* ``nn.Linear`` (``weight.T``) and Hugging Face's ``Conv1D`` (``weight``, already ``(d_in, d_out)``);
* peft's LoRA ``Linear`` (``peft.tuners.lora.layer.Linear``, around an ``nn.Linear`` or a ``Conv1D``, any
  ``fan_in_fan_out``): ``W + sum_a s_a A_a^T B_a^T`` over the active adapters ``a`` (``lora_A[a].weight`` ``(r, d_in)``,
  ``lora_B[a].weight`` ``(d_out, r)``, ``s_a = scaling[a]``), the bias plus ``s_a lora_B[a].bias`` with ``lora_bias``;
  with ``use_dora`` peft's DoRA weight ``diag(m / ||W + s B A||) (W + s B A)`` per adapter (norm per output feature);
  the base weight alone when the adapters are merged into it or disabled;
* litgpt's ``LoRALinear`` and ``LoRAQKVLinear`` (``litgpt.lora``): ``W + s A^T B^T``, each enabled part of the fused
  ``qkv`` its own update of its own columns;
* your own wrapper, through the protocol :class:`LowRankWrapper` (a method ``lowrank_parts``).

What is not understood is refused with :class:`UnsupportedWrapperError`, never read as its base weight: other peft
tuners (IA3, LoHa, VeRA ...), LoRA variants other than DoRA, quantised base weights (bitsandbytes ``Linear4bit`` /
``Linear8bitLt``, any integer weight), and modules holding parameters besides ``weight`` and ``bias`` that none of
the above describes. The set-up table names the adapted blocks (:func:`weights_note`) and leaves refused ones out
with the reason. Dropout on the adapter's input in training mode (``lora_dropout > 0``) is not modelled: the block is
left out of that evaluation (:class:`~curvwatch.adapters.UnsupportedBlockError`), as for attention dropout.

The low-rank factors of each update (:class:`LowRank`) come with the effective weight: the optimizer steps them, not
``W``, so the curvature in the adapter's own parameters follows from the block's by the chain rule
(:mod:`curvwatch.closed_form.adapted`).

Nothing here imports ``peft``, ``litgpt``, ``transformers`` or ``bitsandbytes``: their classes are named by
``"module:QualName"`` strings.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from curvwatch.adapters.base import BlockSpec, UnsupportedBlockError, activation_name

__all__ = [
    "LowRank",
    "LowRankWrapper",
    "Projection",
    "UnsupportedWrapperError",
    "collecting",
    "projection_features",
    "read_projection",
    "recording",
    "tracing",
    "weights_note",
]

CONV1D = "transformers.pytorch_utils:Conv1D"
PEFT_LORA = "peft.tuners.lora.layer:Linear"
LITGPT_LORA = "litgpt.lora:LoRALinear"
LITGPT_LORA_QKV = "litgpt.lora:LoRAQKVLinear"
PEFT_DORA = "peft.tuners.lora.variants:DoraLinearVariant"

#: Classes whose weight is quantised (``"module:QualName"`` -> what it is): the forward dequantises it, and the
#: closed forms would read the packed integers. Any module with an integer weight is refused as well.
QUANTISED: dict[str, str] = {
    "bitsandbytes.nn.modules:Linear4bit": "bitsandbytes 4-bit",
    "bitsandbytes.nn.modules:LinearFP4": "bitsandbytes 4-bit (FP4)",
    "bitsandbytes.nn.modules:LinearNF4": "bitsandbytes 4-bit (NF4)",
    "bitsandbytes.nn.modules:Linear8bitLt": "bitsandbytes 8-bit",
    "peft.tuners.lora.bnb:Linear4bit": "bitsandbytes 4-bit base with peft LoRA",
    "peft.tuners.lora.bnb:Linear8bitLt": "bitsandbytes 8-bit base with peft LoRA",
}


class UnsupportedWrapperError(UnsupportedBlockError):
    """A projection is wrapped (an adapter, a quantised weight) in a way the readers do not understand."""


@dataclass(frozen=True)
class LowRank:
    """One low-rank update ``s A B`` of a projection's weight, math convention.

    Args:
        A: ``(d_in, r)``, the transposed ``lora_A`` weight (a view of the live parameter).
        B: ``(r, k)``, the transposed ``lora_B`` weight, ``k`` the columns it updates.
        scale: ``s`` (peft and litgpt: ``lora_alpha / r``).
        columns: The output columns ``(k,)`` of ``W`` it updates (``LongTensor``), or ``None`` for all.
        params: The parameters the optimizer steps, ``(lora_A, lora_B)`` as the module holds them (``A`` and ``B``
            are their transposes, or row slices of them for litgpt's fused ``qkv``).
        part: Which of the module's updates it is, where a module has several: peft's adapter name, litgpt's fused
            ``qkv`` part (``"q"``, ``"k"``, ``"v"``), the index in a :class:`LowRankWrapper`'s list.
    """

    A: Tensor
    B: Tensor
    scale: float
    columns: Tensor | None = None
    params: tuple[Tensor, Tensor] | None = None
    part: str | None = None

    @property
    def rank(self) -> int:
        return self.A.shape[1]


@dataclass(frozen=True)
class Projection:
    """A projection as its forward computes it: ``X @ W + b``.

    Args:
        W: ``(d_in, d_out)`` effective weight (a view of the parameter for a plain projection).
        b: ``(d_out,)`` effective bias, or ``None``.
        updates: The low-rank updates included in ``W`` whose factors the optimizer steps (LoRA).
        label: What ``W`` is made of, for the set-up table (``"LoRA r=4"``, ``"DoRA r=8"``), or ``None`` for a plain
            weight.
        factored: ``W`` is a frozen weight plus ``updates``, so that the chain rule through the updates' factors is
            the curvature in the trainable parameters (``False`` for DoRA, whose magnitudes and column norms enter
            otherwise).
    """

    W: Tensor
    b: Tensor | None
    updates: tuple[LowRank, ...] = ()
    label: str | None = None
    factored: bool = True


@runtime_checkable
class LowRankWrapper(Protocol):
    """The protocol of your own low-rank wrapper around a projection.

    A module whose forward is ``base(x) + sum_i s_i (x @ A_i^T) @ B_i^T`` defines ``lowrank_parts`` returning
    ``base`` (an ``nn.Linear``, a ``Conv1D`` or another wrapper) and the updates ``(A_i, B_i, s_i)`` that its next
    forward applies, in ``nn.Linear``'s layout: ``A_i`` ``(r, d_in)``, ``B_i`` ``(d_out, r)`` (tensors or parameters),
    ``s_i`` a float. Return no updates while they are merged into ``base`` or disabled. Parameters the forward
    applies otherwise (a dropout, a scaling vector) break the promise: do not define the method then.

    Example:
        >>> class LoRA(torch.nn.Module):
        ...     def __init__(self, base, r=2, alpha=4.0):
        ...         super().__init__()
        ...         self.base, self.s = base, alpha / r
        ...         self.A = torch.nn.Parameter(torch.randn(r, base.in_features))
        ...         self.B = torch.nn.Parameter(torch.randn(base.out_features, r))
        ...     def forward(self, x):
        ...         return self.base(x) + self.s * (x @ self.A.T) @ self.B.T
        ...     def lowrank_parts(self):
        ...         return self.base, [(self.A, self.B, self.s)]
        >>> m = LoRA(torch.nn.Linear(3, 5))
        >>> x = torch.randn(4, 3)
        >>> p = read_projection(m)
        >>> torch.allclose(x @ p.W + p.b, m(x), atol=1e-6), p.label
        (True, 'low-rank r=2')
    """

    def lowrank_parts(self) -> tuple[nn.Module, Sequence[tuple[Tensor, Tensor, float]]]: ...


# --------------------------------------------------------------------------------------------------
# What was read: the set-up table's note, and the probe that reads the structure only
# --------------------------------------------------------------------------------------------------


@dataclass
class _Log:
    compute: bool
    read: list[tuple[nn.Module, str]] = field(default_factory=list)
    # with tracing: (projection, offset, module) of each projection with updates, whose weight was read as its positions
    traced: list[tuple[Projection, int, nn.Module]] | None = None
    # with collecting: every projection read that has updates, as read
    found: list[Projection] | None = None


_LOG: contextvars.ContextVar[_Log | None] = contextvars.ContextVar("curvwatch_projection_log", default=None)


@contextlib.contextmanager
def recording(compute: bool = True) -> Iterator[list[tuple[nn.Module, str]]]:
    """Record ``(module, label)`` of every adapted projection read inside the block.

    Args:
        compute: ``False`` reads the structure only: the wrappers are checked (and refused) as always, but the
            returned weights are the base ones (no product is formed; the set-up probe of :func:`weights_note`).
    """
    with _logging(_Log(compute)) as log:
        yield log.read


@contextlib.contextmanager
def _logging(log: _Log) -> Iterator[_Log]:
    """``log`` as the reads' log inside the ``with`` (the previous one restored after it)."""
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


#: The positions of a traced projection's weight entries start at a multiple of this (far above any weight value,
#: exact in float64 for 8192 projections of up to 2^40 entries each).
TRACE_STRIDE = 2.0**40


@contextlib.contextmanager
def tracing() -> Iterator[list[tuple[Projection, int, nn.Module]]]:
    """Read every projection that has low-rank updates as the *positions* of its weight's entries: entry ``(i, c)``
    of the ``k``-th such projection (``W`` ``(d_in, d_out)``) reads ``(k + 1) TRACE_STRIDE + i d_out + c`` (float64).
    An adapter's ``read_params`` only re-indexes its projections' weights, so where each position lands in a kernel
    argument says which entry of which projection it is (:func:`curvwatch.adapters.updates.kernel_updates`). Yields
    ``[(projection, offset, module)]`` (offset ``(k + 1) TRACE_STRIDE``, ``module`` the wrapper read); no product is
    formed."""
    with _logging(_Log(compute=False, traced=[])) as log:
        yield log.traced


@contextlib.contextmanager
def collecting() -> Iterator[list[Projection]]:
    """Read as always (the effective weights) and collect every projection read that has low-rank updates, so that
    their factors (:class:`LowRank`, views of the live parameters) come with the read that snapshots the weights."""
    with _logging(_Log(compute=True, found=[])) as log:
        yield log.found


def _traced(module: nn.Module, p: Projection) -> Projection:
    """``p``, or while :func:`tracing` and ``p`` has updates, ``p`` with its weight's positions as ``W`` (while
    :func:`collecting`, ``p`` is collected)."""
    log = _LOG.get()
    if log is not None and log.found is not None and p.updates:
        log.found.append(p)
    if log is None or log.traced is None:
        return p
    if not p.factored:
        raise UnsupportedWrapperError(
            f"{p.label}: its weight is not a frozen weight plus low-rank updates (DoRA's magnitudes and column norms), "
            "so the curvature in its parameters does not follow from the factors' chain rule."
        )
    if not p.updates:
        return p
    offset = int(TRACE_STRIDE) * (len(log.traced) + 1)
    d_in, d_out = p.W.shape
    W = torch.arange(d_in * d_out, dtype=torch.float64, device=p.W.device).add_(offset).view(d_in, d_out)
    log.traced.append((p, offset, module))
    return Projection(W, p.b, p.updates, p.label, p.factored)


def weights_note(
    read_params: Callable[[BlockSpec], Mapping[str, Any]], spec: BlockSpec, names: Mapping[int, str]
) -> str | None:
    """What a block's weights are made of, for the set-up table, or ``None`` for plain weights.

    Reads the block's structure once (:func:`recording` with ``compute=False``: no product is formed).

    Args:
        read_params: ``spec.adapter.read_params``.
        spec: The block.
        names: ``id(module) -> name`` used to name the adapted projections.

    Returns:
        E.g. ``"base + LoRA r=4 on q_proj, v_proj; merged view"``.

    Raises:
        UnsupportedWrapperError: If a projection of the block is wrapped in a way that is not understood. Other
            errors (settings read at each call, such as dropout in training mode) are not raised here.
    """
    with recording(compute=False) as read:
        try:
            with torch.no_grad():
                read_params(spec)
        except UnsupportedWrapperError:
            raise
        except Exception:  # decided at each evaluation, with the state of that step
            pass
    if not read:
        return None
    by_label: dict[str, list[str]] = {}
    for module, label in read:
        name = names.get(id(module), type(module).__name__)
        by_label.setdefault(label, [])
        if name not in by_label[label]:
            by_label[label].append(name)
    parts = [f"{label} on {', '.join(mods)}" for label, mods in by_label.items()]
    return f"base + {'; '.join(parts)}; merged view"


# --------------------------------------------------------------------------------------------------
# The readers
# --------------------------------------------------------------------------------------------------


def _type_key(module: object) -> str:
    t = type(module)
    return f"{t.__module__}:{t.__qualname__}"


def _check_not_quantised(module: nn.Module) -> None:
    key = _type_key(module)
    weight = getattr(module, "weight", None)
    what = QUANTISED.get(key)
    if what is None and isinstance(weight, Tensor) and not (weight.is_floating_point() or weight.is_complex()):
        what = f"a {weight.dtype} weight"
    if what is not None:
        raise UnsupportedWrapperError(
            f"{type(module).__name__} holds a quantised weight ({what}); the forward dequantises it and the closed "
            "forms would read the packed values. Blocks reading it are not monitored (monitor a copy with "
            "dequantised weights, e.g. peft's merge_and_unload on a float model)."
        )


def _plain(module: nn.Module, layout: str) -> tuple[Tensor, Tensor | None]:
    """``(W, b)`` of a projection without adapters; ``layout`` for a module that is neither ``nn.Linear`` nor
    ``Conv1D``: ``"out_in"`` (``weight.T``) or ``"in_out"``."""
    _check_not_quantised(module)
    own = {name for name, _ in module.named_parameters()}
    weight = getattr(module, "weight", None)
    if hasattr(module, "base_layer") or own - {"weight", "bias"} or not isinstance(weight, Tensor):
        raise UnsupportedWrapperError(
            f"{type(module).__name__} ({_type_key(module)}) wraps a projection in a way curvwatch does not read "
            f"(its parameters: {sorted(own)[:6]}); its weight as the forward uses it is unknown. Supported: nn.Linear, "
            "Conv1D, peft LoRA/DoRA, litgpt LoRA, and wrappers with a lowrank_parts method "
            "(curvwatch.adapters.projections.LowRankWrapper)."
        )
    if isinstance(module, nn.Linear):
        return module.weight.T, module.bias
    if _type_key(module) == CONV1D or layout == "in_out":
        return module.weight, getattr(module, "bias", None)
    return module.weight.T, getattr(module, "bias", None)


def _label(kind: str, ranks: Sequence[int], parts: str = "") -> str:
    r = "/".join(str(x) for x in dict.fromkeys(ranks))
    return f"{kind} r={r}{parts}"


def _combine(
    module: nn.Module,
    base: tuple[Tensor, Tensor | None],
    updates: Sequence[LowRank],
    label: str,
    *,
    extra: Tensor | None = None,
    bias: Tensor | None = None,
    factored: bool = True,
) -> Projection:
    """``W + extra + sum s A B`` (each update on its columns) and ``b + bias``, recorded for the set-up note."""
    log = _LOG.get()
    if log is not None:
        log.read.append((module, label))
    W, b = base
    if log is not None and not log.compute:
        return Projection(W, b, tuple(updates), label, factored)
    with torch.no_grad():
        if extra is not None:
            W = W + extra
        if updates:
            W = W.to(torch.promote_types(W.dtype, updates[0].A.dtype), copy=True)  # (never the parameter itself)
            for u in updates:
                delta = (u.A @ u.B).mul_(u.scale).to(W.dtype)  # (d_in, k)
                if u.columns is None:
                    W += delta
                else:
                    W[:, u.columns] += delta
        if bias is not None:
            b = bias if b is None else b + bias
    return Projection(W, b, tuple(updates), label, factored)


def _dropout_check(module: nn.Module, dropout: object, where: str) -> None:
    """Raise if the adapter's input dropout is active on this call (not in the structure-only probe)."""
    log = _LOG.get()
    if log is not None and not log.compute:
        return
    if module.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
        raise UnsupportedBlockError(
            f"{where} applies dropout p={dropout.p} to the adapter's input in training mode, which the closed forms "
            "do not model (the forward is then not X @ W). Fix: lora_dropout=0.0, or run the monitored steps in "
            "eval mode."
        )


def _peft_lora(module: nn.Module, layout: str) -> Projection:
    """peft's LoRA ``Linear`` (see the module docstring)."""
    base_layer = module.get_base_layer()
    base = _plain(base_layer, layout)
    where = f"peft {type(module).__name__}"
    if getattr(module, "merged", False):
        if module.disable_adapters:
            raise UnsupportedBlockError(
                f"{where} has adapters disabled while merged (its forward unmerges them first); the weight it will "
                "use is not the one held now. Unmerge before the monitored step."
            )
        return _combine(module, base, (), "LoRA (merged into the weight)")
    if module.disable_adapters:
        return Projection(*base)
    updates, ranks, extra, bias, dora = [], [], None, None, False
    W0 = base[0]  # (d_in, d_out)
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        lora_A, lora_B = module.lora_A[name], module.lora_B[name]
        variant = module.lora_variant.get(name) if hasattr(module, "lora_variant") else None
        vkey = None if variant is None else _type_key(variant)
        if vkey is None and getattr(module, "use_dora", {}).get(name):  # DoRA of a peft without variant classes
            vkey = "DoRA of an older peft"
        if vkey not in (None, PEFT_DORA) or not (isinstance(lora_A, nn.Linear) and isinstance(lora_B, nn.Linear)):
            raise UnsupportedWrapperError(
                f"{where}: adapter {name!r} is a LoRA variant ({vkey or type(lora_A).__name__}) that curvwatch does "
                "not read; only plain LoRA and DoRA are."
            )
        _dropout_check(module, module.lora_dropout[name], where)
        s = float(module.scaling[name])
        u = LowRank(lora_A.weight.T, lora_B.weight.T, s, params=(lora_A.weight, lora_B.weight), part=name)
        ranks.append(u.rank)
        if vkey is None:
            updates.append(u)
            if lora_B.bias is not None:
                bias = s * lora_B.bias if bias is None else bias + s * lora_B.bias
            continue
        if lora_B.bias is not None:
            raise UnsupportedWrapperError(f"{where}: DoRA with lora_bias is not read by curvwatch.")
        dora = True
        log = _LOG.get()
        if log is not None and not log.compute:
            continue
        with torch.no_grad():
            # peft's DoRA forward: the output column j scaled by m_j / ||W_j + s (B A)_j|| (||.|| over the inputs)
            from_peft = module.lora_magnitude_vector[name]
            W_oi = base_layer.weight.T if module.fan_in_fan_out else base_layer.weight  # (d_out, d_in) as peft reads
            V = W_oi + s * (lora_B.weight @ lora_A.weight)  # (d_out, d_in)
            factor = from_peft.weight / torch.linalg.norm(V, dim=1).to(V.dtype)  # (d_out,)
            term = (V * factor[:, None]).T - W0  # (d_in, d_out): this adapter's change of the weight
            extra = term if extra is None else extra + term
    if not ranks:
        return Projection(*base)
    if dora and updates:
        raise UnsupportedWrapperError(f"{where}: DoRA and plain LoRA adapters active together are not read.")
    if dora:
        return _combine(module, base, (), _label("DoRA", ranks), extra=extra, factored=False)
    return _combine(module, base, updates, _label("LoRA", ranks), bias=bias)


def _litgpt_lora(module: nn.Module, layout: str) -> Projection:
    """litgpt's ``LoRALinear`` / ``LoRAQKVLinear``: ``linear(x) + s dropout(x) A^T B^T`` (fused: per enabled part)."""
    base = _plain(module.linear, layout)
    enabled = getattr(module, "enable_lora", None)
    if module.merged:
        return _combine(module, base, (), "LoRA (merged into the weight)")
    if module.r == 0 or (enabled is not None and not any(enabled)):
        return Projection(*base)
    _dropout_check(module, module.lora_dropout, f"litgpt {type(module).__name__}")
    s, r = float(module.scaling), module.r
    params = (module.lora_A, module.lora_B)
    if enabled is None:
        update = LowRank(module.lora_A.T, module.lora_B.T, s, params=params)  # (d_in, r), (r, d_out)
        return _combine(module, base, [update], _label("LoRA", [r]))
    # the fused qkv, [q (n_head hs) | k (n_query_groups hs) | v (n_query_groups hs)]: enabled part i has rank rows
    # [i r, (i + 1) r) of lora_A and its own rows of lora_B, and writes its q, k or v columns (litgpt's grouped conv1d
    # and zero_pad)
    q, kv = module.head_size * module.n_head, module.head_size * module.n_query_groups
    spans = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    updates, row = [], 0
    on = [(part, span) for part, span, yes in zip("qkv", spans, enabled, strict=True) if yes]
    for i, (part, (lo, hi)) in enumerate(on):
        A = module.lora_A[i * r : (i + 1) * r].T  # (d_in, r)
        B = module.lora_B[row : row + hi - lo].T  # (r, hi - lo)
        columns = torch.arange(lo, hi, device=module.lora_A.device)
        updates.append(LowRank(A, B, s, columns=columns, params=params, part=part))
        row += hi - lo
    parts = ", ".join(n for n, on in zip("qkv", enabled, strict=True) if on)
    return _combine(module, base, updates, _label("LoRA", [r], f" ({parts})"))


def _protocol(module: nn.Module, layout: str) -> Projection:
    """A :class:`LowRankWrapper`: its base as read here, plus its updates."""
    base_module, parts = module.lowrank_parts()
    inner = read_projection(base_module, layout)
    updates = [LowRank(A.T, B.T, float(s), params=(A, B), part=str(i)) for i, (A, B, s) in enumerate(parts)]
    if not updates:
        return inner
    label = _label("low-rank", [u.rank for u in updates])
    if inner.label is not None:
        label = f"{inner.label} + {label}"
    out = _combine(module, (inner.W, inner.b), updates, label, factored=inner.factored)
    return Projection(out.W, out.b, inner.updates + out.updates, label, inner.factored)


def read_projection(module: nn.Module, layout: str = "out_in") -> Projection:
    """The projection ``module`` as its forward computes it (see the module docstring).

    Args:
        module: An ``nn.Linear``, ``Conv1D``, or a wrapper of one.
        layout: How a module of another class lays out its ``weight``: ``"out_in"`` (as ``nn.Linear``) or
            ``"in_out"`` (as ``Conv1D``).

    Raises:
        UnsupportedWrapperError: For a wrapper or quantised weight that is not understood.
        UnsupportedBlockError: For a setting outside what the closed forms model on this call (adapter dropout in
            training mode).

    Example:
        >>> lin = torch.nn.Linear(3, 2)
        >>> read_projection(lin).W.shape
        torch.Size([3, 2])
    """
    key = _type_key(module)
    if key == PEFT_LORA:
        return _traced(module, _peft_lora(module, layout))
    if key in (LITGPT_LORA, LITGPT_LORA_QKV):
        return _traced(module, _litgpt_lora(module, layout))
    if isinstance(module, LowRankWrapper):
        return _traced(module, _protocol(module, layout))
    if key.startswith("peft.") and key not in QUANTISED:
        raise UnsupportedWrapperError(
            f"{type(module).__name__} ({key}) is a peft tuner layer curvwatch does not read (LoRA and DoRA on "
            "nn.Linear/Conv1D are read); its blocks are not monitored."
        )
    return Projection(*_plain(module, layout))


def projection_features(module: nn.Module) -> tuple[int, int] | None:
    """``(d_in, d_out)`` of a projection (``nn.Linear``, ``Conv1D`` or a wrapper of one), or ``None`` for another
    module. Reads shapes only (no weight is formed)."""
    seen = 0
    while seen < 8:
        seen += 1
        if isinstance(module, nn.Linear):
            return module.in_features, module.out_features
        key = _type_key(module)
        if key == CONV1D:
            return tuple(module.weight.shape)  # (d_in, d_out)
        if key == PEFT_LORA or hasattr(module, "base_layer"):
            module = module.get_base_layer() if hasattr(module, "get_base_layer") else module.base_layer
        elif key in (LITGPT_LORA, LITGPT_LORA_QKV):
            module = module.linear
        elif isinstance(module, LowRankWrapper):
            module = module.lowrank_parts()[0]
        else:
            return None
    return None


# --------------------------------------------------------------------------------------------------
# The readers the adapters call
# --------------------------------------------------------------------------------------------------


def _linear(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W, b)`` of an ``nn.Linear`` (or a wrapper of one) in math convention, ``W`` ``(d_in, d_out)`` as the forward
    uses it (:func:`read_projection`)."""
    p = read_projection(module, "out_in")
    return p.W, p.b


def _conv1d(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W, b)`` of a Hugging Face ``Conv1D`` (``weight`` already ``(d_in, d_out)``) or a wrapper of one."""
    p = read_projection(module, "in_out")
    return p.W, p.b


def _ffn(
    fc1: nn.Module, fc2: nn.Module, act: Any, read: Callable[[nn.Module], tuple[Tensor, Tensor | None]] = _linear
) -> dict[str, Any]:
    """``W_1, W_2, b_1, b_2, activation, residual=False`` of an FFN ``act(X W_1 + b_1) W_2 + b_2``.

    ``read`` gives ``(W, b)`` of a projection: :func:`_linear` for ``nn.Linear``, :func:`_conv1d` for ``Conv1D``.
    """
    (W_1, b_1), (W_2, b_2) = read(fc1), read(fc2)
    return dict(W_1=W_1, W_2=W_2, b_1=b_1, b_2=b_2, activation=activation_name(act), residual=False)
