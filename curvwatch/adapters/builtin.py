"""The built-in adapters: curvwatch's own GPT, PyTorch's Transformer layers, Hugging Face GPT-2 and BERT."""

from __future__ import annotations

import torch
from torch import nn

from curvwatch.adapters.base import (
    Adapter,
    BlockSpec,
    Masks,
    UnsupportedBlockError,
    _bind,
    _capture,
    _check_scaling,
    _four_specs,
    _hf_masks,
    _layernorm,
    _spec,
    _torch_masks,
)
from curvwatch.adapters.projections import UnsupportedWrapperError, _conv1d, _ffn, _linear


class GPTBlockAdapter(Adapter):
    """``curvwatch.models.gpt.Block``: ``ln_1, attn (q/k/v/out_proj), ln_2, mlp (fc, proj)``, causal."""

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        return _four_specs(layer, index, self, layer.attn, layer.ln_1, layer.ln_2, layer.mlp.fc)

    def capture_modules(self, spec):
        layer = spec.layer_module
        return _capture(spec, layer.attn, {"attention": layer.attn.out_proj, "ffn": layer.mlp.proj})

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
        return _ffn(layer.mlp.fc, layer.mlp.proj, layer.mlp.activation)


class TorchTransformerLayerAdapter(Adapter):
    """``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` (self-attention, norms, FFN).

    ``batch_first`` True or False, ``norm_first`` True or False. Attention weights come from the packed
    ``in_proj_weight`` ``(3d, d)``: ``W_Q, W_K, W_V = in_proj_weight[:d].T, [d:2d].T, [2d:].T``. Masks:
    ``key_padding_mask`` (bool True = padded, or float ``-inf``), ``attn_mask`` causal (bool or
    ``-inf``-float) or absent, ``is_causal``.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        norms = [n for n in ("norm1", "norm2", "norm3") if hasattr(layer, n)]
        cross = []  # the decoder's attention over the encoder memory
        if hasattr(layer, "multihead_attn"):
            cross.append(_spec(layer, index, "cross_attn", "cross_attention", layer.multihead_attn, self))
        return [
            _spec(layer, index, "attn", "attention", layer.self_attn, self),
            *(
                _spec(layer, index, f"ln_{i + 1}", "layernorm", getattr(layer, n), self)
                for i, n in enumerate(norms)
            ),
            _spec(layer, index, "ffn", "ffn", layer.linear1, self),
            *cross,
        ]

    def capture_modules(self, spec):
        layer = spec.layer_module
        output = layer.linear2 if spec.kind == "ffn" else spec.module
        # cross-attention: masks and memory from the decoder layer's own call (it alone sees the target's padding)
        return spec.module, output, layer if spec.kind == "cross_attention" else layer.self_attn

    def to_batch_first(self, spec, t):
        if t.ndim == 2:
            return t.unsqueeze(0)
        return t if spec.layer_module.self_attn.batch_first else t.transpose(0, 1)

    def read_masks(self, spec, args, kwargs):
        if spec.kind == "cross_attention":
            return self._cross_masks(spec, _bind(spec.layer_module, args, kwargs))
        a = _bind(spec.layer_module.self_attn, args, kwargs)
        if not (_same_input(a["key"], a["query"]) and _same_input(a["value"], a["query"])):
            raise UnsupportedBlockError("self_attn was called with key/value != query (not self-attention).")
        L = self.to_batch_first(spec, a["query"]).shape[1]
        return _torch_masks(a.get("key_padding_mask"), a.get("attn_mask"), a.get("is_causal", False), L)

    def _cross_masks(self, spec, a):
        """The decoder layer's ``forward(tgt, memory, ..., tgt_key_padding_mask, memory_key_padding_mask)`` call."""
        memory = self.to_batch_first(spec, a["memory"])
        mask = a.get("memory_mask")
        if mask is not None and bool((mask if mask.dtype == torch.bool else mask != 0).any()):
            raise UnsupportedBlockError("A memory_mask that masks positions is not supported for cross-attention.")
        memory_kpm = _torch_masks(a.get("memory_key_padding_mask"), None, False, memory.shape[1]).key_padding_mask
        L = self.to_batch_first(spec, a["tgt"]).shape[1]
        target_kpm = _torch_masks(a.get("tgt_key_padding_mask"), None, False, L).key_padding_mask
        causal = bool(a.get("memory_is_causal", False))
        return Masks(causal=causal, key_padding_mask=target_kpm, memory=memory, memory_padding_mask=memory_kpm)

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            return _ffn(layer.linear1, layer.linear2, layer.activation)
        mha = layer.multihead_attn if spec.kind == "cross_attention" else layer.self_attn
        if not isinstance(mha, nn.MultiheadAttention):  # e.g. peft's LoRA MultiheadAttention around it
            raise UnsupportedWrapperError(
                f"The layer's attention is a {type(mha).__name__}, not an nn.MultiheadAttention: a wrapper whose "
                "weights as the forward uses them curvwatch does not read."
            )
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
    Cross-attention (``add_cross_attention``) is not monitored: :meth:`unmonitored` names it.
    """

    def unmonitored(self, layer):
        return _cross_attention_left_out(layer, "crossattention")

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        return _four_specs(layer, index, self, layer.attn.c_attn, layer.ln_1, layer.ln_2, layer.mlp.c_fc)

    def capture_modules(self, spec):
        layer = spec.layer_module
        return _capture(spec, layer.attn, {"attention": layer.attn.c_proj, "ffn": layer.mlp.c_proj})

    def read_masks(self, spec, args, kwargs):
        return _hf_masks(
            spec.layer_module.attn, _bind(spec.layer_module.attn, args, kwargs).get("attention_mask")
        )

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            return _ffn(layer.mlp.c_fc, layer.mlp.c_proj, layer.mlp.act, read=_conv1d)
        attn = layer.attn
        _check_scaling(_gpt2_scaling(attn), attn.head_dim, "GPT2Attention")
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
    ``config.is_decoder``; padding from ``attention_mask``. Cross-attention is not monitored: :meth:`unmonitored`
    names it.
    """

    def unmonitored(self, layer):
        return _cross_attention_left_out(layer, "crossattention")

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        return _four_specs(
            layer, index, self, layer.attention.self, layer.attention.output.LayerNorm, layer.output.LayerNorm,
            layer.intermediate.dense,
        )  # fmt: skip

    def capture_modules(self, spec):
        layer = spec.layer_module
        outputs = {"attention": layer.attention.output.dense, "ffn": layer.output.dense}
        return _capture(spec, layer.attention.self, outputs)

    def read_masks(self, spec, args, kwargs):
        attn = spec.layer_module.attention.self
        return _hf_masks(attn, _bind(attn, args, kwargs).get("attention_mask"))

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            return _ffn(layer.intermediate.dense, layer.output.dense, layer.intermediate.intermediate_act_fn)
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


def _cross_attention_left_out(layer: nn.Module, name: str) -> list[tuple[str, str]]:
    """``[(name, reason)]`` when ``layer`` has an (unmonitored) cross-attention sub-module called ``name``."""
    if getattr(layer, name, None) is None:
        return []
    return [(name, "cross-attention of this layer type is not modelled yet (BART's and PyTorch's decoders are)")]


def _gpt2_scaling(attn: nn.Module) -> float:
    """The softmax scale of a Hugging Face ``GPT2Attention``, across transformers versions.

    Newer versions store it (``attn.scaling``); older 5.x ones (5.3) do not and compute it from the config flags
    ``scale_attn_weights`` (``1/sqrt(head_dim)``, else 1) and ``scale_attn_by_inverse_layer_idx`` (an extra
    ``1/(layer_idx + 1)``), which are read here the same way.
    """
    scaling = getattr(attn, "scaling", None)
    if scaling is not None:
        return float(scaling)
    if not hasattr(attn, "scale_attn_weights"):
        import transformers

        raise UnsupportedBlockError(
            f"GPT2Attention of transformers {transformers.__version__} has neither `scaling` nor "
            "`scale_attn_weights`; curvwatch cannot read its softmax scale. Use transformers >= 5.24 (tested)."
        )
    scale = attn.head_dim**-0.5 if attn.scale_attn_weights else 1.0
    if getattr(attn, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(attn.layer_idx + 1)
    return scale


def _same_input(a: object, b: object) -> bool:
    """Whether two arguments of a call hold the same tensor: the same object, the same memory (an alias such as the
    ones FSDP2's pre-forward hook of a ``fully_shard``-ed attention module makes of each input that requires grad),
    or equal values (a cast copy). The value comparison runs on captured steps only, when the others fail.
    """
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a.detach(), b.detach()))
