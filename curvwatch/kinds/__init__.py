"""Block kinds as data: the one registry where each kind of sub-block (attention, LayerNorm, FFN, ...) is declared.

A :class:`BlockKind` says everything the rest of curvwatch needs to know about a kind, so that no other module
branches on a kind's name:

* its closed form (a function of :mod:`curvwatch.closed_form`), the name of its input argument and of its
  mask argument, its block pairs (those exact without Lanczos apart) and whether it takes Lanczos settings;
* how the capture turns the attention call's :class:`~curvwatch.adapters.Masks` into its inputs and settings;
* its memory estimate (what one evaluation allocates besides the Lanczos bases, and one basis vector);
* the prefix of its bare keys (``"ln"`` for ``var_min`` -> ``ln/var_min``) and the rows of its keys in the key
  table (:mod:`curvwatch.keys`: meaning and cross-rank reduction);
* its statistics for the collapse warnings and its model-wide summaries;
* its row in the docs.

Adding a kind means: its closed form and reference, one file here declaring its :class:`BlockKind` (registered
with :func:`register_kind` at import, imported below), its adapter readers, and its tests. The built-in kinds are
in the modules of this package, one kind each.

Example:
    >>> sorted(KINDS)
    ['attention', 'cross_attention', 'ffn', 'gated_ffn', 'layernorm', 'rmsnorm']
    >>> KINDS["layernorm"].prefix, KINDS["attention"].mask_name, KINDS["ffn"].input_name
    ('ln', 'key_padding_mask', 'Y')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from curvwatch.names import KeySpec, is_diagonal_pair

__all__ = ["KINDS", "BlockKind", "Summary", "grouped", "kind_of", "register_kind"]


@dataclass(frozen=True)
class Summary:
    """A model-wide summary of one block key: ``summary/{key}`` = ``reduce`` over the blocks that report ``block_key``.

    Args:
        key: Summary key without the ``summary/`` prefix, e.g. ``"ln/var_min"``.
        block_key: Relative block key it reduces, e.g. ``"ln/var_min"``.
        reduce: ``"max"`` or ``"min"``.
        meaning: One line for the key table and the docs.
        finite: Leave out infinite values (else only NaN is left out).
    """

    key: str
    block_key: str
    reduce: str
    meaning: str
    finite: bool = True


@dataclass(frozen=True)
class BlockKind:
    """Everything curvwatch knows about one kind of sub-block.

    Args:
        name: The kind's name, as in :attr:`BlockSpec.kind <curvwatch.adapters.BlockSpec>`: ``"attention"``.
        closed_form: The kernel, or the name of a function of :mod:`curvwatch.closed_form` (looked up at each
            call): keyword arguments in (those :attr:`prepare` makes of ``input_name``, ``grad_output``,
            ``mask_name`` and the adapter's parameters and, when ``iterative``, ``lanczos``, ``parts`` and
            ``pairs``), a flat dict of 0-d tensors out.
        prefix: Quantity prefix given to the kernel's bare keys (``"var_min"`` -> ``"ln/var_min"``).
        input_name: Name of the kernel's input argument (``"X"``, ``"Y"`` for the FFN kernels).
        mask_name: ``"key_padding_mask"`` (True = padded; attention) or ``"row_mask"`` (True = kept).
        pairs: The kernel's block pairs (``()`` for kinds without Hessian norms).
        exact_pairs: The pairs whose norms are exact without Lanczos over Hessian products: a terms-only
            evaluation asks for these alone.
        signal_kwargs: Extra kernel keyword arguments of a *signals* evaluation (the default terms-only tier,
            ``terms_keys="warnings"``): the kernel then computes only what the warning rules read
            (:mod:`curvwatch.rules`), e.g. ``{"stats_only": True}``. ``None``: the kind has nothing the rules read
            besides its exact pairs; a signals evaluation leaves it out unless a rule reads one of them.
        iterative: Whether the kernel takes Lanczos settings (``lanczos``, ``parts``, ``pairs``).
        has_norms: Whether the block reports Hessian norms (``hessian/...``): it then takes part in the
            norm summaries, the spike warnings and the heatmap.
        call_inputs: ``(masks, key padding mask, (k, l)) -> (inputs, params)``: what the capture stores from the
            attention call, besides ``X`` and ``grad_output``, for the captured sequences ``[:k]`` and positions
            ``[:l]`` (the key padding mask is already cut to them). ``inputs`` are detached tensors indexed by
            ``(sequence, position, ...)`` (cut again by a truncation; names starting with ``memory`` are cut by
            sequence only), ``params`` are settings.
        prepare: ``kwargs -> kwargs``, the last step from the stored inputs and params (one flat dict) to the
            kernel's arguments, e.g. the weights, the structure and the loss as the kernel's grouped inputs
            (:mod:`curvwatch.closed_form.inputs`); the ground truths of :mod:`curvwatch.reference` take the same.
        work_elements: ``(B, L, d, params) -> int``, the elements of an evaluation's largest intermediates
            besides the Lanczos bases (an upper estimate; see :meth:`CapturedBlock.evaluation_bytes`).
        basis_numel: ``params -> int``, the elements of one Lanczos vector of the block (0 without Lanczos).
        keys: Rows of the key table for the kernel's keys (relative, prefixed): meaning and reduction.
        summaries: Model-wide summaries of this kind's keys.
        input_only_keys: Whether the kernel reports statistics of ``X`` alone, which are still worth logging
            when only ``grad_output`` is non-finite (LayerNorm variances: a collapse that caused the NaN).
        sampled: Whether the kernel takes ``output_samples`` (sampled output gradients of the real loss,
            :mod:`curvwatch.realloss`; in its loss) and ``precondition``, and then returns ``ggn/...`` and
            ``sharpness/...``.
        adapted: The weight arguments whose low-rank adapters (LoRA) the kernel takes with its samples
            (``adapters=``, :class:`~curvwatch.closed_form.LowRankUpdate`): it then returns ``ggn/lora/<name>``,
            ``sharpness/lora/<name>``, the curvature in the adapter's own parameters. An adapter on another weight
            (the attention's ``W_O``) has none.
        label: A human name for messages and docs (``"LayerNorm"``).
        doc: One line for the docs' table of kinds.
    """

    name: str
    closed_form: Callable[..., dict[str, Tensor]] | str
    prefix: str
    input_name: str = "X"
    mask_name: str = "row_mask"
    pairs: tuple[str, ...] = ()
    exact_pairs: tuple[str, ...] = ()
    signal_kwargs: Mapping[str, Any] | None = None
    iterative: bool = False
    has_norms: bool = False
    call_inputs: Callable[[Any, Tensor | None, tuple[int, int]], tuple[dict[str, Tensor], dict[str, Any]]] | None = None
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    work_elements: Callable[[int, int, int, Mapping[str, Any]], int] = lambda B, L, d, params: 16 * B * L * d
    basis_numel: Callable[[Mapping[str, Any]], int] = lambda params: 0
    keys: tuple[KeySpec, ...] = ()
    summaries: tuple[Summary, ...] = ()
    input_only_keys: bool = False
    sampled: bool = False
    adapted: tuple[str, ...] = ()
    label: str = ""
    doc: str = ""
    diagonal_pairs: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "diagonal_pairs", tuple(p for p in self.pairs if is_diagonal_pair(p)))

    def kernel(self) -> Callable[..., dict[str, Tensor]]:
        """The closed form to call (a name is looked up in :mod:`curvwatch.closed_form` now)."""
        if isinstance(self.closed_form, str):
            from curvwatch import closed_form

            return getattr(closed_form, self.closed_form)
        return self.closed_form

    def qualify(self, result: Mapping[str, Any]) -> dict[str, Any]:
        """Give the kernel's bare keys this kind's prefix: ``"var_min" -> "ln/var_min"``; others stay."""
        return {(k if "/" in k else f"{self.prefix}/{k}"): v for k, v in result.items()}

    def row_inputs(self, key_padding_mask: Tensor | None) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Default :attr:`call_inputs` of a token-wise kind: the padding mask becomes its ``row_mask``."""
        return ({} if key_padding_mask is None else {"row_mask": ~key_padding_mask}), {}

    def from_call(
        self, masks: Any, key_padding_mask: Tensor | None, kept: tuple[int, int]
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """``(inputs, params)`` the capture stores from the attention call (see :attr:`call_inputs`)."""
        if self.call_inputs is None:
            return self.row_inputs(key_padding_mask)
        return self.call_inputs(masks, key_padding_mask, kept)

    def kernel_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The kernel's keyword arguments from the stored ones (see :attr:`prepare`)."""
        return kwargs if self.prepare is None else self.prepare(kwargs)


def grouped(kwargs: dict[str, Any], input_name: str, weights: type, **groups: type) -> dict[str, Any]:
    """A kernel's grouped arguments from one flat dict of stored inputs and params (a :attr:`BlockKind.prepare`):
    ``input_name`` stays, the fields of ``weights`` (a dataclass of :mod:`curvwatch.closed_form.inputs`) become its
    ``weights`` argument, ``grad_output`` and ``output_samples`` its ``loss`` (an ``OutputLoss``), the fields of each
    of ``groups`` (``name=dataclass``) that argument, and the other entries stay keyword arguments.

    Example:
        >>> from curvwatch.closed_form import FFNWeights
        >>> out = grouped({"Y": 1, "W_1": 2, "W_2": 3, "grad_output": 4, "activation": "relu"}, "Y", FFNWeights)
        >>> sorted(out), out["weights"].W_2, out["loss"].grad_output
        (['Y', 'activation', 'loss', 'weights'], 3, 4)
    """
    from curvwatch.closed_form.inputs import OutputLoss

    rest = dict(kwargs)

    def take(cls: type) -> Any:
        return cls(**{f.name: rest.pop(f.name) for f in dataclasses.fields(cls) if f.name in rest})

    out: dict[str, Any] = {input_name: rest.pop(input_name), "weights": take(weights)}
    out["loss"] = OutputLoss(grad_output=rest.pop("grad_output", None), output_samples=rest.pop("output_samples", None))
    out.update((name, take(cls)) for name, cls in groups.items())
    out.update(rest)
    return out


#: Kind name -> :class:`BlockKind`, the one table. Extend it with :func:`register_kind`.
KINDS: dict[str, BlockKind] = {}


def register_kind(kind: BlockKind) -> BlockKind:
    """Add (or replace) a block kind; returns it, so a kind module can write ``KIND = register_kind(...)``.

    Raises:
        TypeError: If ``kind`` is not a :class:`BlockKind`.
    """
    if not isinstance(kind, BlockKind):
        raise TypeError(f"Invalid kind={kind!r}. Must be a curvwatch.kinds.BlockKind.")
    KINDS[kind.name] = kind
    return kind


def kind_of(name: str) -> BlockKind:
    """The registered kind called ``name``.

    Raises:
        ValueError: For an unknown name, listing the known ones.
    """
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(
            f"Unknown block kind {name!r}. Known kinds: {sorted(KINDS)}. A new kind is declared with "
            "curvwatch.kinds.register_kind(BlockKind(...))."
        ) from None


# the built-in kinds, one module each (imported for their registration)
from curvwatch.kinds import attention, ffn, gated_ffn, layernorm, rmsnorm  # noqa: E402, F401
