"""The adapter interface: ``BlockSpec``, ``Masks``, ``Adapter`` and the readers adapters share.

An adapter knows one Transformer layer type: which of its sub-modules carry each sub-block, how to read their
weights in the math convention ``X @ W``, which module's forward input is ``X``, which module's output carries
``grad_output``, and how to read the attention masks from the attention call. The table from layer type to
adapter and the model walk are in :mod:`curvwatch.adapters`; the built-in adapters in its submodules.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Adapter", "BlockSpec", "Masks", "UnsupportedBlockError", "activation_name"]



class UnsupportedBlockError(ValueError):
    """A layer was recognised but one of its settings is outside what the closed forms model."""


@dataclass(eq=False)
class BlockSpec:
    """One monitored sub-block of a Transformer layer.

    Args:
        name: Stable, W&B-friendly name: ``"layer3/attn"``, ``"layer3/ln_1"``, ``"layer3/ffn"``.
        layer: Index of the Transformer layer the sub-block belongs to.
        kind: ``"attention"``, ``"layernorm"`` or ``"ffn"``.
        module: Module whose forward input is the block input ``X``.
        adapter: Entry of :data:`ADAPTERS` that knows how to read the weights.
        layer_module: The Transformer layer owning the sub-block; adapters read sibling modules (output
            projection, activation, masks) from it. ``None`` when ``module`` alone suffices.

    Example:
        >>> from curvwatch.adapters import find_blocks
        >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        >>> [spec.name for spec in find_blocks(layer)]
        ['layer0/attn', 'layer0/ln_1', 'layer0/ln_2', 'layer0/ffn']
    """

    name: str
    layer: int
    kind: str
    module: nn.Module
    adapter: Adapter
    layer_module: nn.Module | None = None


@dataclass
class Masks:
    """What one attention call reads besides ``X`` and the weights: masks, rotary tables, the memory.

    Args:
        causal: Whether query ``i`` sees only keys ``j <= i``.
        key_padding_mask: ``(B, L)`` bool, True = padded position (excluded), or ``None``.
        window: Sliding-window size ``w``: query ``i`` sees keys ``i - w < j <= i`` (with ``causal``), or
            ``None`` for no window.
        rotary: ``(cos, sin)`` rotary tables of the call, each ``(L, r)`` or ``(B, L, r)`` with ``r <= d_K``
            the rotated dimensions of each head, or ``None`` when the attention has no rotary embedding.
        rotary_interleaved: ``False`` for the half-split layout (LLaMA, NeoX, Hugging Face: dimension ``i`` pairs
            with ``i + r/2``), ``True`` for the interleaved one (GPT-J: ``2i`` pairs with ``2i + 1``).
        memory: ``(B, L_kv, d_kv)`` keys/values source of a cross-attention call (encoder output), else ``None``.
        memory_padding_mask: ``(B, L_kv)`` bool, True = padded memory position, or ``None``.
    """

    causal: bool = False
    key_padding_mask: Tensor | None = None
    window: int | None = None
    rotary: tuple[Tensor, Tensor] | None = None
    rotary_interleaved: bool = False
    memory: Tensor | None = None
    memory_padding_mask: Tensor | None = None


class Adapter:
    """How to find and read the sub-blocks of one Transformer layer type.

    Subclass it for a layer type curvwatch does not know and register it with :func:`register_adapter`,
    or pass explicit :class:`BlockSpec` objects to :func:`find_blocks`. All returned tensors are the live
    ones; the capture detaches and copies them.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        """The sub-blocks of ``layer``, the ``index``-th Transformer layer of the model."""
        raise NotImplementedError

    def capture_modules(self, spec: BlockSpec) -> tuple[nn.Module, nn.Module, nn.Module]:
        """``(input_module, output_module, mask_module)``.

        ``X`` is read from ``input_module``'s forward arguments, ``grad_output`` is the gradient at
        ``output_module``'s output, the masks come from ``mask_module``'s forward arguments (the attention
        module of the layer, also for LayerNorm and FFN blocks, whose row mask is its key padding mask).
        """
        raise NotImplementedError

    def read_input(self, spec: BlockSpec, args: tuple, kwargs: dict) -> Tensor:
        """``X`` of shape ``(B, L, d)`` from the input module's forward arguments."""
        X = args[0] if args else next(iter(kwargs.values()))
        return self.to_batch_first(spec, X)

    def read_output(self, spec: BlockSpec, output: Any) -> Tensor:
        """The output tensor whose gradient is ``grad_output`` (layout as produced by the module)."""
        return output if isinstance(output, Tensor) else output[0]

    def to_batch_first(self, spec: BlockSpec, t: Tensor) -> Tensor:
        """Bring an input or output tensor of the block to ``(B, L, d)``."""
        return t.unsqueeze(0) if t.ndim == 2 else t

    def read_masks(self, spec: BlockSpec, args: tuple, kwargs: dict) -> Masks:
        """Masks of the attention call (``mask_module``'s forward arguments)."""
        return Masks()

    def unmonitored(self, layer: nn.Module) -> list[tuple[str, str]]:
        """``(part, reason)`` for each component of ``layer`` that none of its specs covers.

        The monitor reports them once at setup (and in the W&B run config), so nothing is left out silently:
        e.g. ``("mlp.router", "mixture-of-experts routing is not modelled")``.
        """
        return []

    def read_params(self, spec: BlockSpec) -> dict[str, Any]:
        """Closed-form keyword arguments other than ``X``, ``grad_output`` and masks.

        Attention: ``W_Q, W_K, W_V, W_O, n_heads, b_Q, b_K, b_V, b_O``; layernorm: ``eps, weight, bias``;
        ffn: ``W_1, W_2, b_1, b_2, activation, residual``. Weights in math convention ``(d_in, d_out)``.

        Raises:
            UnsupportedBlockError: If a setting of the layer is outside what the closed forms model.
        """
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
# Readers shared by the adapters
# --------------------------------------------------------------------------------------------------


def _bind(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Forward arguments of ``module`` by parameter name (positional ones included)."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    out = dict(bound.arguments)
    for name, param in inspect.signature(module.forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in out:
            out.update(out.pop(name))
    return out


def _layernorm(module: nn.Module) -> dict[str, Any]:
    if not isinstance(module, nn.LayerNorm) or len(module.normalized_shape) != 1:
        raise UnsupportedBlockError(
            f"{type(module).__name__} with normalized_shape={getattr(module, 'normalized_shape', None)} "
            "is not supported: only nn.LayerNorm over the last dimension is."
        )
    return {"eps": float(module.eps), "weight": module.weight, "bias": module.bias}


_TANH_GELUS = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "FastGELUActivation")


def activation_name(act: Any) -> str:
    """Name of an activation function or module: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``.

    Args:
        act: A string, a function such as ``F.gelu``, or a module such as ``nn.GELU("tanh")``.

    Raises:
        UnsupportedBlockError: For any other activation.

    Example:
        >>> activation_name(torch.nn.GELU(approximate="tanh")), activation_name(F.relu)
        ('gelu_tanh', 'relu')
    """
    if isinstance(act, str) and act in ("relu", "gelu", "gelu_tanh"):
        return act
    if act in (F.relu, torch.relu) or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    name = type(act).__name__
    if name in _TANH_GELUS:
        return "gelu_tanh"
    if name == "GELUActivation":  # transformers: exact erf GELU (torch or python implementation)
        return "gelu"
    raise UnsupportedBlockError(
        f"Activation {getattr(act, '__name__', name)!r} is not supported. Supported: relu, gelu (erf), "
        "gelu_tanh (tanh approximation)."
    )


def _allowed_to_masks(allowed: Tensor) -> Masks:
    """Split a boolean ``(B, L, L)`` "query may attend key" matrix into causal + key padding.

    Keys are padded where the last query does not see them (the last query sees every real key both with
    and without causality); rows of padded queries are not checked.

    Raises:
        UnsupportedBlockError: If the matrix is not of that form (sliding windows, document masks, ...).
    """
    B, L, _ = allowed.shape
    kpm = ~allowed[:, -1, :]  # (B, L)
    tril = torch.ones(L, L, dtype=torch.bool, device=allowed.device).tril()
    for causal in (True, False):
        expected = ~kpm[:, None, :] & (tril if causal else True)  # (B, L, L)
        if ((allowed == expected) | kpm[:, :, None]).all():
            return Masks(causal=causal, key_padding_mask=kpm if kpm.any() else None)
    raise UnsupportedBlockError(
        "The attention mask is neither causal nor bidirectional with key padding "
        "(e.g. a sliding window or a per-document mask); the closed forms do not model it."
    )


def _hf_masks(attn_module: nn.Module, mask: Tensor | None) -> Masks:
    """Masks from a Hugging Face 4-D attention mask (bool: True = attend; float: 0 = attend)."""
    if mask is None:  # SDPA path without padding: causality is a flag of the module
        return Masks(causal=bool(getattr(attn_module, "is_causal", False)))
    if mask.ndim != 4:
        raise UnsupportedBlockError(
            f"Expected a 4-D attention mask (B, 1, L, L); got shape {tuple(mask.shape)}."
        )
    if mask.dtype != torch.bool and bool(((mask != 0) & torch.isfinite(mask) & (mask > -1e4)).any()):
        raise UnsupportedBlockError("The attention mask carries additive biases (e.g. ALiBi); not supported.")
    allowed = mask if mask.dtype == torch.bool else mask == 0
    if allowed.shape[1] != 1 and not (allowed == allowed[:, :1]).all():
        raise UnsupportedBlockError("Per-head attention masks are not supported.")
    return _allowed_to_masks(allowed[:, 0].expand(-1, allowed.shape[-2], allowed.shape[-1]))


def _torch_masks(kpm: Tensor | None, attn_mask: Tensor | None, is_causal: bool, L: int) -> Masks:
    """Masks from ``nn.MultiheadAttention`` arguments (bool: True = masked; float: additive)."""
    if kpm is not None:
        if kpm.dtype != torch.bool:
            if bool((torch.isfinite(kpm) & (kpm != 0)).any()):
                raise UnsupportedBlockError("A float key_padding_mask with finite biases is not supported.")
            kpm = kpm != 0
        kpm = kpm.unsqueeze(0) if kpm.ndim == 1 else kpm
        kpm = kpm if kpm.any() else None
    causal = bool(is_causal)
    if attn_mask is not None and not causal:
        if attn_mask.ndim == 3:
            if not (attn_mask == attn_mask[:1]).all():
                raise UnsupportedBlockError("A per-sequence/per-head 3-D attn_mask is not supported.")
            attn_mask = attn_mask[0]
        if attn_mask.dtype == torch.bool:
            allowed = ~attn_mask
        else:
            if bool((torch.isfinite(attn_mask) & (attn_mask != 0)).any()):
                raise UnsupportedBlockError("A float attn_mask with finite biases is not supported.")
            allowed = attn_mask == 0
        tril = torch.ones(L, L, dtype=torch.bool, device=allowed.device).tril()
        if torch.equal(allowed, tril):
            causal = True
        elif not allowed.all():
            raise UnsupportedBlockError(
                "attn_mask is neither causal nor empty; the closed forms do not model it."
            )
    return Masks(causal=causal, key_padding_mask=kpm)


def _check_scaling(scaling: float, head_dim: int, where: str) -> None:
    if not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
        raise UnsupportedBlockError(
            f"{where} scales attention scores by {scaling:.6g}, not 1/sqrt(d_K) = {head_dim**-0.5:.6g}; "
            "the closed forms assume 1/sqrt(d_K) (GPT-2: scale_attn_weights=True, "
            "scale_attn_by_inverse_layer_idx=False)."
        )


def _spec(
    layer: nn.Module, index: int, part: str, kind: str, module: nn.Module, adapter: Adapter
) -> BlockSpec:
    return BlockSpec(f"layer{index}/{part}", index, kind, module, adapter, layer_module=layer)


def _four_specs(
    layer: nn.Module, index: int, adapter: Adapter, attn: nn.Module, ln_1: nn.Module, ln_2: nn.Module, ffn: nn.Module
) -> list[BlockSpec]:
    """The specs ``attn, ln_1, ln_2, ffn`` of a layer with one attention, two LayerNorms and one plain FFN."""
    return [
        _spec(layer, index, "attn", "attention", attn, adapter),
        _spec(layer, index, "ln_1", "layernorm", ln_1, adapter),
        _spec(layer, index, "ln_2", "layernorm", ln_2, adapter),
        _spec(layer, index, "ffn", "ffn", ffn, adapter),
    ]


def _capture(
    spec: BlockSpec, mask_module: nn.Module, outputs: dict[str, nn.Module]
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """``(input_module, output_module, mask_module)``: the output module of ``spec.kind`` in ``outputs``, else the
    input module itself (norms)."""
    return spec.module, outputs.get(spec.kind, spec.module), mask_module


