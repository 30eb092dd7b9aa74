"""Model discovery: the table of Transformer layer types, their adapters and the ``BlockSpec``s they yield.

An adapter knows one layer type: which of its sub-modules carry each sub-block (``"attention"``, one
``"layernorm"`` per LayerNorm, ``"ffn"``), how to read their weights in the math convention ``X @ W``, which
module's forward input is ``X``, which module's output carries ``grad_output``, and how to read the
attention masks from the attention call. ``ADAPTERS`` is the one table from module type to adapter;
:func:`register_adapter` extends it and :func:`find_blocks` walks a model with it.

Built-in adapters, as ``layer type: attention X-module -> output-module; ffn X-module -> output-module``
(``X`` is the forward input of the first module, ``grad_output`` the gradient at the output of the second):

* ``curvwatch.models.gpt.Block``: ``attn -> attn.out_proj``; ``mlp.fc -> mlp.proj``.
* ``torch.nn.TransformerEncoderLayer`` and ``TransformerDecoderLayer`` (self-attention only):
  ``self_attn -> self_attn`` (its output 0); ``linear1 -> linear2``.
* Hugging Face ``GPT2Block``: ``attn.c_attn -> attn.c_proj``; ``mlp.c_fc -> mlp.c_proj``.
* Hugging Face ``BertLayer``: ``attention.self -> attention.output.dense``;
  ``intermediate.dense -> output.dense``.

Every LayerNorm is its own block, captured at the LayerNorm module itself: ``ln_1``/``ln_2`` of the GPTs,
``norm1``/``norm2`` (``norm3`` of the decoder: ``ln_3``) of the PyTorch layers, ``attention.output.LayerNorm``
(``ln_1``) and ``output.LayerNorm`` (``ln_2``) of BERT.

Why these capture points: the gradient is taken at the innermost module that computes ``... W_O + b_O`` (or
``... W_2 + b_2``), before any residual dropout, so the sub-block is exactly the deterministic map the
closed forms model, and the residual (outside the FFN/attention module) is excluded (``residual=False``).
``nn.MultiheadAttention`` calls ``out_proj`` functionally, so hooks on ``out_proj`` never fire; its block
output is the module's own output 0 (it has no dropout after ``out_proj``). Not modelled: dropout on the
attention probabilities (run monitored steps with ``attn_pdrop=0`` or in eval mode if it matters), the
cross-attention of decoder layers (only their self-attention is monitored), KV caches with past tokens.

Activations are reported as strings: ``"relu"``, ``"gelu"`` (exact erf) and ``"gelu_tanh"``, the tanh
approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` used by GPT-2 (Hugging Face
``"gelu_new"``, ``"gelu_pytorch_tanh"``, ``"gelu_fast"``; ``nn.GELU(approximate="tanh")``). If the closed
form does not implement an activation, evaluating that FFN block raises a ``ValueError`` naming it.
"""

from __future__ import annotations

import inspect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ADAPTERS",
    "Adapter",
    "BlockSpec",
    "Masks",
    "UnsupportedBlockError",
    "activation_name",
    "adapter_for",
    "find_blocks",
    "register_adapter",
]

KINDS = ("attention", "layernorm", "ffn")


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
    """Attention masks of one call, normalised.

    Args:
        causal: Whether query ``i`` sees only keys ``j <= i``.
        key_padding_mask: ``(B, L)`` bool, True = padded position (excluded), or ``None``.
    """

    causal: bool = False
    key_padding_mask: Tensor | None = None


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


def _linear(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W, b)`` of an ``nn.Linear`` in math convention: ``W = weight.T`` of shape ``(d_in, d_out)``."""
    return module.weight.T, module.bias


def _conv1d(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W, b)`` of a Hugging Face ``Conv1D``, whose weight already is ``(d_in, d_out)``."""
    return module.weight, module.bias


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


# --------------------------------------------------------------------------------------------------
# Built-in adapters
# --------------------------------------------------------------------------------------------------


class GPTBlockAdapter(Adapter):
    """``curvwatch.models.gpt.Block``: ``ln_1, attn (q/k/v/out_proj), ln_2, mlp (fc, proj)``, causal."""

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        return [
            _spec(layer, index, "attn", "attention", layer.attn, self),
            _spec(layer, index, "ln_1", "layernorm", layer.ln_1, self),
            _spec(layer, index, "ln_2", "layernorm", layer.ln_2, self),
            _spec(layer, index, "ffn", "ffn", layer.mlp.fc, self),
        ]

    def capture_modules(self, spec):
        layer = spec.layer_module
        output = {"attention": layer.attn.out_proj, "ffn": layer.mlp.proj}.get(spec.kind, spec.module)
        return spec.module, output, layer.attn

    def read_masks(self, spec, args, kwargs):
        return Masks(causal=bool(spec.layer_module.attn.causal))

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "attention":
            attn = layer.attn
            (W_Q, b_Q), (W_K, b_K), (W_V, b_V), (W_O, b_O) = map(
                _linear, (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj)
            )
            return dict(
                W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, n_heads=attn.n_head, b_Q=b_Q, b_K=b_K, b_V=b_V, b_O=b_O
            )
        (W_1, b_1), (W_2, b_2) = _linear(layer.mlp.fc), _linear(layer.mlp.proj)
        act = activation_name(layer.mlp.activation)
        return dict(W_1=W_1, W_2=W_2, b_1=b_1, b_2=b_2, activation=act, residual=False)


class TorchTransformerLayerAdapter(Adapter):
    """``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` (self-attention, norms, FFN).

    ``batch_first`` True or False, ``norm_first`` True or False. Attention weights come from the packed
    ``in_proj_weight`` ``(3d, d)``: ``W_Q, W_K, W_V = in_proj_weight[:d].T, [d:2d].T, [2d:].T``. Masks:
    ``key_padding_mask`` (bool True = padded, or float ``-inf``), ``attn_mask`` causal (bool or
    ``-inf``-float) or absent, ``is_causal``.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        norms = [n for n in ("norm1", "norm2", "norm3") if hasattr(layer, n)]
        return [
            _spec(layer, index, "attn", "attention", layer.self_attn, self),
            *(
                _spec(layer, index, f"ln_{i + 1}", "layernorm", getattr(layer, n), self)
                for i, n in enumerate(norms)
            ),
            _spec(layer, index, "ffn", "ffn", layer.linear1, self),
        ]

    def capture_modules(self, spec):
        layer = spec.layer_module
        output = layer.linear2 if spec.kind == "ffn" else spec.module
        return spec.module, output, layer.self_attn

    def to_batch_first(self, spec, t):
        if t.ndim == 2:
            return t.unsqueeze(0)
        return t if spec.layer_module.self_attn.batch_first else t.transpose(0, 1)

    def read_masks(self, spec, args, kwargs):
        a = _bind(spec.layer_module.self_attn, args, kwargs)
        if not (a["key"] is a["query"] and a["value"] is a["query"]):
            raise UnsupportedBlockError("self_attn was called with key/value != query (not self-attention).")
        L = self.to_batch_first(spec, a["query"]).shape[1]
        return _torch_masks(a.get("key_padding_mask"), a.get("attn_mask"), a.get("is_causal", False), L)

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            (W_1, b_1), (W_2, b_2) = _linear(layer.linear1), _linear(layer.linear2)
            act = activation_name(layer.activation)
            return dict(W_1=W_1, W_2=W_2, b_1=b_1, b_2=b_2, activation=act, residual=False)
        mha = layer.self_attn
        if mha.bias_k is not None or mha.add_zero_attn:
            raise UnsupportedBlockError(
                "nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported."
            )
        d = mha.embed_dim
        if mha._qkv_same_embed_dim:
            W_Q, W_K, W_V = (w.T for w in mha.in_proj_weight.split(d))
        else:
            W_Q, W_K, W_V = mha.q_proj_weight.T, mha.k_proj_weight.T, mha.v_proj_weight.T
        b_Q = b_K = b_V = None
        if mha.in_proj_bias is not None:
            b_Q, b_K, b_V = mha.in_proj_bias.split(d)
        W_O, b_O = _linear(mha.out_proj)
        return dict(
            W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, n_heads=mha.num_heads, b_Q=b_Q, b_K=b_K, b_V=b_V, b_O=b_O
        )


class GPT2BlockAdapter(Adapter):
    """Hugging Face ``GPT2Block``: ``ln_1, attn (c_attn packed q|k|v, c_proj), ln_2, mlp (c_fc, c_proj)``.

    Works with ``attn_implementation="eager"`` and ``"sdpa"``; causal, padding from ``attention_mask``.
    Cross-attention (``add_cross_attention``) is not monitored.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        return [
            _spec(layer, index, "attn", "attention", layer.attn.c_attn, self),
            _spec(layer, index, "ln_1", "layernorm", layer.ln_1, self),
            _spec(layer, index, "ln_2", "layernorm", layer.ln_2, self),
            _spec(layer, index, "ffn", "ffn", layer.mlp.c_fc, self),
        ]

    def capture_modules(self, spec):
        layer = spec.layer_module
        output = {"attention": layer.attn.c_proj, "ffn": layer.mlp.c_proj}.get(spec.kind, spec.module)
        return spec.module, output, layer.attn

    def read_masks(self, spec, args, kwargs):
        return _hf_masks(
            spec.layer_module.attn, _bind(spec.layer_module.attn, args, kwargs).get("attention_mask")
        )

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            (W_1, b_1), (W_2, b_2) = _conv1d(layer.mlp.c_fc), _conv1d(layer.mlp.c_proj)
            act = activation_name(layer.mlp.act)
            return dict(W_1=W_1, W_2=W_2, b_1=b_1, b_2=b_2, activation=act, residual=False)
        attn = layer.attn
        _check_scaling(attn.scaling, attn.head_dim, "GPT2Attention")
        W, b = _conv1d(attn.c_attn)
        W_Q, W_K, W_V = W.split(attn.embed_dim, dim=1)
        b_Q, b_K, b_V = b.split(attn.embed_dim)
        W_O, b_O = _conv1d(attn.c_proj)
        return dict(
            W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, n_heads=attn.num_heads, b_Q=b_Q, b_K=b_K, b_V=b_V, b_O=b_O
        )


class BertLayerAdapter(Adapter):
    """Hugging Face ``BertLayer`` (post-LN): self-attention, ``attention.output.LayerNorm`` (``ln_1``),
    ``intermediate``/``output`` FFN, ``output.LayerNorm`` (``ln_2``). Bidirectional unless
    ``config.is_decoder``; padding from ``attention_mask``. Cross-attention is not monitored.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        return [
            _spec(layer, index, "attn", "attention", layer.attention.self, self),
            _spec(layer, index, "ln_1", "layernorm", layer.attention.output.LayerNorm, self),
            _spec(layer, index, "ln_2", "layernorm", layer.output.LayerNorm, self),
            _spec(layer, index, "ffn", "ffn", layer.intermediate.dense, self),
        ]

    def capture_modules(self, spec):
        layer = spec.layer_module
        output = {"attention": layer.attention.output.dense, "ffn": layer.output.dense}.get(
            spec.kind, spec.module
        )
        return spec.module, output, layer.attention.self

    def read_masks(self, spec, args, kwargs):
        attn = spec.layer_module.attention.self
        return _hf_masks(attn, _bind(attn, args, kwargs).get("attention_mask"))

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            (W_1, b_1), (W_2, b_2) = _linear(layer.intermediate.dense), _linear(layer.output.dense)
            act = activation_name(layer.intermediate.intermediate_act_fn)
            return dict(W_1=W_1, W_2=W_2, b_1=b_1, b_2=b_2, activation=act, residual=False)
        attn = layer.attention.self
        _check_scaling(attn.scaling, attn.attention_head_size, "BertSelfAttention")
        (W_Q, b_Q), (W_K, b_K), (W_V, b_V) = map(_linear, (attn.query, attn.key, attn.value))
        W_O, b_O = _linear(layer.attention.output.dense)
        return dict(
            W_Q=W_Q,
            W_K=W_K,
            W_V=W_V,
            W_O=W_O,
            n_heads=attn.num_attention_heads,
            b_Q=b_Q,
            b_K=b_K,
            b_V=b_V,
            b_O=b_O,
        )


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------

_TORCH_LAYER = TorchTransformerLayerAdapter()

#: Layer type -> adapter, the one table :func:`find_blocks` consults. Keys are classes, or
#: ``"module:QualName"`` strings for classes of optional or heavy packages, so that curvwatch never imports
#: ``transformers`` itself. Exact types are matched: a subclass that changes ``forward`` needs its own entry
#: (which may be the parent's adapter). Extend it with :func:`register_adapter`.
ADAPTERS: dict[type | str, Adapter] = {
    nn.TransformerEncoderLayer: _TORCH_LAYER,
    nn.TransformerDecoderLayer: _TORCH_LAYER,
    "curvwatch.models.gpt:Block": GPTBlockAdapter(),
    "transformers.models.gpt2.modeling_gpt2:GPT2Block": GPT2BlockAdapter(),
    "transformers.models.bert.modeling_bert:BertLayer": BertLayerAdapter(),
}


def adapter_for(module_type: type) -> Adapter | None:
    """The entry of :data:`ADAPTERS` for exactly ``module_type`` (by class, then by ``"module:QualName"``).

    Example:
        >>> type(adapter_for(torch.nn.TransformerEncoderLayer)).__name__
        'TorchTransformerLayerAdapter'
        >>> adapter_for(torch.nn.Linear) is None
        True
    """
    adapter = ADAPTERS.get(module_type)
    if adapter is None:
        adapter = ADAPTERS.get(f"{module_type.__module__}:{module_type.__qualname__}")
    return adapter


def register_adapter(module_type: type, adapter: Adapter) -> None:
    """Add (or replace) the adapter used for layers of exactly ``module_type``.

    Args:
        module_type: An ``nn.Module`` subclass, e.g. your Transformer layer class.
        adapter: An :class:`Adapter` instance, possibly an existing entry of :data:`ADAPTERS` when the layer
            has the same structure as a known one.

    Raises:
        TypeError: If ``module_type`` is not an ``nn.Module`` subclass or ``adapter`` not an ``Adapter``.

    Example:
        >>> class MyLayer(torch.nn.TransformerEncoderLayer):
        ...     pass
        >>> register_adapter(MyLayer, ADAPTERS[torch.nn.TransformerEncoderLayer])
        >>> len(find_blocks(MyLayer(8, 2, dim_feedforward=16)))
        4
        >>> del ADAPTERS[MyLayer]
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"Invalid module_type={module_type!r}. Must be an nn.Module subclass.")
    if not isinstance(adapter, Adapter):
        raise TypeError(f"Invalid adapter={adapter!r}. Must be a curvwatch.adapters.Adapter instance.")
    ADAPTERS[module_type] = adapter


def _no_layer_message(model: nn.Module) -> str:
    counts = Counter(type(m).__name__ for m in model.modules())
    found = ", ".join(f"{name} ({n})" for name, n in counts.most_common(8))
    known = sorted(k.rsplit(":", 1)[-1] if isinstance(k, str) else k.__name__ for k in ADAPTERS)
    return (
        f"find_blocks found no known Transformer layer in {type(model).__name__}. Module types found (most "
        f"frequent first): {found}. Known layer types: {', '.join(known)}.\n"
        "Fix: if your layer has the structure of a known one, register it before building the monitor:\n"
        "    curvwatch.register_adapter(MyLayer, curvwatch.adapters.ADAPTERS[nn.TransformerEncoderLayer])\n"
        "or subclass curvwatch.adapters.Adapter and pass explicit specs:\n"
        "    blocks=[curvwatch.BlockSpec(name='layer0/attn', layer=0, kind='attention', "
        "module=model.layers[0].attn, adapter=MyAdapter(), layer_module=model.layers[0])]"
    )


def find_blocks(model: nn.Module, blocks: str | Sequence[BlockSpec] = "auto") -> list[BlockSpec]:
    """The monitored sub-blocks of ``model``, in module order.

    With ``blocks="auto"`` every module whose exact type is in :data:`ADAPTERS` is a Transformer layer
    (numbered 0, 1, ... in ``model.modules()`` order; its descendants are not searched further) and yields
    its attention, each LayerNorm, and its FFN. An explicit list of :class:`BlockSpec` is validated and
    returned as is.

    Args:
        model: The model to search.
        blocks: ``"auto"`` or a list of :class:`BlockSpec`.

    Returns:
        The specs, names unique.

    Raises:
        ValueError: If ``"auto"`` finds no known layer (the message lists the module types found and how
            to register an adapter or pass specs), or an explicit list is empty, has duplicate names, unknown
            kinds or modules outside ``model``.

    Example:
        >>> find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        Traceback (most recent call last):
        ...
        ValueError: find_blocks found no known Transformer layer in Sequential. Module types found ...
    """
    if isinstance(blocks, str):
        if blocks != "auto":
            raise ValueError(f"Invalid blocks={blocks!r}. Must be 'auto' or a list of BlockSpec.")
        specs: list[BlockSpec] = []
        inside: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(p + ".") for p in inside):
                continue
            adapter = adapter_for(type(module))
            if adapter is not None:
                specs.extend(adapter.specs(module, len(inside)))
                inside.append(name)
        if not specs:
            raise ValueError(_no_layer_message(model))
        return specs
    specs = list(blocks)
    if not specs:
        raise ValueError("Invalid blocks=[]. Pass 'auto' or a non-empty list of BlockSpec.")
    modules = {id(m) for m in model.modules()}
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, BlockSpec):
            raise ValueError(f"Invalid entry {spec!r} in blocks. Must be a curvwatch.BlockSpec.")
        if spec.kind not in KINDS:
            raise ValueError(
                f"Invalid kind={spec.kind!r} in BlockSpec {spec.name!r}. Must be one of {KINDS}."
            )
        if spec.name in seen:
            raise ValueError(f"Duplicate BlockSpec name {spec.name!r}. Names must be unique.")
        if id(spec.module) not in modules:
            raise ValueError(f"BlockSpec {spec.name!r}: its module is not a submodule of the model.")
        if not isinstance(spec.adapter, Adapter):
            raise ValueError(f"BlockSpec {spec.name!r}: adapter={spec.adapter!r} is not an Adapter instance.")
        seen.add(spec.name)
    return specs
