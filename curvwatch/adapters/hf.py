"""Adapters of Hugging Face ``transformers`` layers: LLaMA-style decoders, GPT-NeoX, ViT and BART.

Written against the module layout of transformers 5.x (checked with 5.24): attention modules with
``q_proj/k_proj/v_proj/o_proj`` (``out_proj`` for BART), ``scaling``, ``is_causal``, rotary tables passed as
``position_embeddings=(cos, sin)`` and 4-D masks made by ``transformers.masking_utils`` (bool, True = attend,
for SDPA; additive float for eager; ``None`` when SDPA's ``is_causal`` suffices; 2-D padding for flash
attention). Nothing here imports ``transformers``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from curvwatch.adapters._shared import (
    check_probability_dropout,
    check_rotary_dims,
    gated_activation,
    grouped_attention_params,
    leftover,
    norm_params,
    qk_norm_params,
    softmax_scale,
    split_fused_qkv,
    squeeze_rotary,
)
from curvwatch.adapters.base import (
    Adapter,
    BlockSpec,
    Masks,
    UnsupportedBlockError,
    _bind,
    _capture,
    _four_specs,
    _layernorm,
    _spec,
)
from curvwatch.adapters.projections import _ffn, _linear

# --------------------------------------------------------------------------------------------------
# Masks, caches, rotary tables, attention weights
# --------------------------------------------------------------------------------------------------

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _check_no_past(attn: nn.Module, bound: dict) -> None:
    """Raise if the call carries a KV cache that already holds tokens (an empty training cache is fine)."""
    for name in _CACHE_KWARGS:
        cache = bound.get(name)
        if cache is None:
            continue
        cache = getattr(cache, "self_attention_cache", cache)
        get = getattr(cache, "get_seq_length", None)
        past = int(get(getattr(attn, "layer_idx", None) or 0)) if callable(get) else -1
        if past != 0:
            raise UnsupportedBlockError(
                f"{type(attn).__name__} was called with a KV cache ({type(cache).__name__}) holding "
                f"{'past' if past > 0 else 'unknown'} tokens; the closed forms model a training forward over "
                "whole sequences. Run monitored steps with use_cache=False."
            )


def _allowed(mask: Tensor, where: str) -> Tensor:
    """``(B, L_q, L_kv)`` bool "query may attend key" from a 4-D Hugging Face mask (bool or additive float)."""
    if mask.ndim != 4:
        raise UnsupportedBlockError(
            f"{where}: expected a 4-D attention mask (B, 1, L_q, L_kv), got shape {tuple(mask.shape)}."
        )
    if mask.dtype != torch.bool:
        if bool((torch.isfinite(mask) & (mask != 0) & (mask > -1e4)).any()):
            raise UnsupportedBlockError(
                f"{where}: the attention mask carries additive biases (e.g. ALiBi, relative positions); not supported."
            )
        mask = mask == 0
    if mask.shape[1] != 1 and not (mask == mask[:, :1]).all():
        raise UnsupportedBlockError(f"{where}: per-head attention masks are not supported.")
    return mask[:, 0]


def _band(L: int, causal: bool, window: int | None, device) -> Tensor:
    i = torch.arange(L, device=device)
    diff = i[:, None] - i[None, :]  # (L, L): query i - key j
    ok = diff >= 0 if causal else torch.ones(L, L, dtype=torch.bool, device=device)
    return ok & (diff < window) if window is not None else ok


def _self_masks(attn: nn.Module, mask: Tensor | None, where: str, causal_default: bool) -> Masks:
    """Causal flag, sliding window and key padding from a self-attention mask.

    A key is padded where no query sees it (every real key is seen at least by its own query, also with a
    window); the rows of padded queries are not checked. ``None``: SDPA's ``is_causal`` (``causal_default``).

    Raises:
        UnsupportedBlockError: For a mask that is not (causal | bidirectional) x (window) x key padding.
    """
    if mask is None:
        return Masks(causal=causal_default)
    if mask.ndim == 2:  # flash attention: (B, L) 1 = real token; causality and window are module settings
        kpm = mask == 0
        window = getattr(attn, "sliding_window", None)
        return Masks(causal=causal_default, key_padding_mask=kpm if kpm.any() else None, window=window)
    allowed = _allowed(mask, where)
    B, L, L_kv = allowed.shape
    if L != L_kv:
        raise UnsupportedBlockError(f"{where}: {L} queries attend {L_kv} keys (past tokens); not supported.")
    kpm = ~allowed.any(dim=1)  # (B, L)
    real_rows = ~kpm[:, :, None]
    candidates = [(False, None), (True, None)]
    i = torch.arange(L, device=allowed.device)
    reach = torch.where(allowed & real_rows, i[:, None] - i[None, :], torch.zeros((), dtype=i.dtype, device=i.device))
    candidates.append((True, int(reach.max()) + 1))
    for causal, window in candidates:
        expected = ~kpm[:, None, :] & _band(L, causal, window, allowed.device)  # (B, L, L)
        if ((allowed == expected) | ~real_rows).all():
            return Masks(causal=causal, key_padding_mask=kpm if kpm.any() else None, window=window)
    raise UnsupportedBlockError(
        f"{where}: the attention mask is not causal or bidirectional with an optional sliding window and key "
        "padding (e.g. a per-document or chunked mask); the closed forms do not model it."
    )


def _memory_padding(mask: Tensor | None, where: str) -> Tensor | None:
    """``(B, L_kv)`` padded memory positions of a cross-attention mask (every query sees the same keys)."""
    if mask is None:
        return None
    allowed = _allowed(mask, where)
    mpm = ~allowed.any(dim=1)  # (B, L_kv)
    if not (allowed == ~mpm[:, None, :]).all():
        raise UnsupportedBlockError(f"{where}: the cross-attention mask is not a key padding mask; not supported.")
    return mpm if mpm.any() else None


def _causal_default(attn: nn.Module) -> bool:
    """Causality of a call without mask: eager attention then is unmasked, SDPA/flash use ``is_causal``."""
    impl = getattr(getattr(attn, "config", None), "_attn_implementation", None) or "eager"
    return impl != "eager" and bool(getattr(attn, "is_causal", False))


def _check_impl(attn: nn.Module) -> None:
    impl = getattr(getattr(attn, "config", None), "_attn_implementation", None) or "eager"
    if impl not in ("eager", "sdpa") and not impl.startswith("flash"):
        raise UnsupportedBlockError(
            f"{type(attn).__name__} uses attn_implementation={impl!r}; supported: 'eager', 'sdpa', 'flash_*'."
        )


def _rotary(bound: dict, d_K: int, where: str) -> tuple[Tensor, Tensor] | None:
    pe = bound.get("position_embeddings")
    if pe is None:
        return None
    cos, sin = pe
    check_rotary_dims(cos.shape[-1], d_K, where)
    return squeeze_rotary(cos, sin)


def _scaling(attn: nn.Module, d_K: int) -> float:
    """The softmax scale of the module; Hugging Face uses ``d_K**-0.5`` where a module has no ``scaling``."""
    scaling = getattr(attn, "scaling", None)
    if scaling is None:
        import transformers

        if getattr(getattr(attn, "config", None), "query_pre_attn_scalar", None) is not None:
            raise UnsupportedBlockError(
                f"{type(attn).__name__} of transformers {transformers.__version__} has no .scaling but its config "
                "sets query_pre_attn_scalar; cannot tell the softmax scale."
            )
        return d_K**-0.5
    return float(scaling)


def _proj_attention(attn: nn.Module, out_proj: nn.Module, d_K: int, p_drop: float) -> dict:
    """Closed-form arguments of an attention with separate ``q_proj, k_proj, v_proj`` and an output projection."""
    _check_impl(attn)
    check_probability_dropout(attn, p_drop, type(attn).__name__, "set the config's attention dropout to 0.0")
    (W_Q, b_Q), (W_K, b_K), (W_V, b_V), (W_O, b_O) = map(_linear, (attn.q_proj, attn.k_proj, attn.v_proj, out_proj))
    H, H_kv = W_Q.shape[1] // d_K, W_K.shape[1] // d_K
    if H * d_K != W_Q.shape[1] or H_kv * d_K != W_K.shape[1] or H % H_kv:
        raise UnsupportedBlockError(
            f"{type(attn).__name__}: q/k projections of widths {W_Q.shape[1]}/{W_K.shape[1]} do not split into "
            f"heads of size {d_K} with the number of query heads a multiple of the key/value heads."
        )
    qk_norm = None
    if getattr(attn, "q_norm", None) is not None:
        qk_norm = qk_norm_params(attn.q_norm, attn.k_norm, d_K)
    weights, biases = (W_Q, W_K, W_V, W_O), (b_Q, b_K, b_V, b_O)
    return grouped_attention_params(weights, biases, H, H_kv, _scaling(attn, d_K), d_K, qk_norm)


class _HFAdapter(Adapter):
    """Shared by the Hugging Face adapters: ``X`` is the ``hidden_states`` argument (positional or keyword)."""

    def read_input(self, spec, args, kwargs):
        if args:
            return self.to_batch_first(spec, args[0])
        X = kwargs.get("hidden_states", kwargs.get("x"))
        if X is None:
            X = next(iter(kwargs.values()))
        return self.to_batch_first(spec, X)


# --------------------------------------------------------------------------------------------------
# LLaMA-style decoder layers: LLaMA, Mistral, Qwen2, Qwen3, Gemma
# --------------------------------------------------------------------------------------------------


class HFDecoderLayerAdapter(_HFAdapter):
    """``LlamaDecoderLayer``, ``MistralDecoderLayer``, ``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``,
    ``GemmaDecoderLayer``: ``input_layernorm, self_attn, post_attention_layernorm, mlp`` (pre-norm).

    Blocks, as ``name: kind, X-module -> output-module``: ``attn``: ``"attention"``, ``self_attn ->
    self_attn.o_proj``; ``ln_1`` (``input_layernorm``), ``ln_2`` (``post_attention_layernorm``): ``"rmsnorm"``
    (Gemma: ``weight_offset=1``); ``ffn``: ``"gated_ffn"``, ``mlp -> mlp.down_proj``, ``act(gate_proj) *
    up_proj`` (``silu``; Gemma ``gelu_tanh``).

    Attention: rotary tables from ``position_embeddings`` (half-split layout), grouped keys/values (query head
    ``h`` uses key/value head ``h // num_key_value_groups``, ``repeat_kv``), q/k/v biases (Qwen2), per-head
    ``q_norm``/``k_norm`` before the rotation (Qwen3) as ``qk_norm``, the sliding window (Mistral, Qwen2/3 with
    ``use_sliding_window``) read from the mask the layer really gets.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        out = [
            _spec(layer, index, "attn", "attention", layer.self_attn, self),
            _spec(layer, index, "ln_1", norm_params(layer.input_layernorm)[0], layer.input_layernorm, self),
            _spec(
                layer, index, "ln_2", norm_params(layer.post_attention_layernorm)[0], layer.post_attention_layernorm,
                self,
            ),
        ]  # fmt: skip
        if all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            out.append(_spec(layer, index, "ffn", "gated_ffn", layer.mlp, self))
        return out

    def capture_modules(self, spec):
        layer = spec.layer_module
        return _capture(spec, layer.self_attn, {"attention": layer.self_attn.o_proj, "gated_ffn": layer.mlp.down_proj})

    def unmonitored(self, layer):
        mlp_known = all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))
        out = [] if mlp_known else [("mlp", f"{type(layer.mlp).__name__} (e.g. mixture of experts) is not modelled")]
        covered = [layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm, layer.mlp]
        return out + leftover(layer, covered)

    def read_masks(self, spec, args, kwargs):
        attn = spec.layer_module.self_attn
        a = _bind(attn, args, kwargs)
        _check_no_past(attn, a)
        masks = _self_masks(attn, a.get("attention_mask"), type(attn).__name__, _causal_default(attn))
        if spec.kind == "attention":
            masks.rotary = _rotary(a, attn.head_dim, type(attn).__name__)
        return masks

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind in ("rmsnorm", "layernorm"):
            return norm_params(spec.module)[1]
        if spec.kind == "gated_ffn":
            mlp = layer.mlp
            (W_gate, b_gate), (W_up, b_up), (W_down, b_down) = map(_linear, (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            return dict(
                W_gate=W_gate, W_up=W_up, W_down=W_down, b_gate=b_gate, b_up=b_up, b_down=b_down,
                activation=gated_activation(mlp.act_fn),
            )  # fmt: skip
        attn = layer.self_attn
        return _proj_attention(attn, attn.o_proj, attn.head_dim, float(getattr(attn, "attention_dropout", 0.0)))


# --------------------------------------------------------------------------------------------------
# GPT-NeoX (Pythia)
# --------------------------------------------------------------------------------------------------


class GPTNeoXLayerAdapter(_HFAdapter):
    """``GPTNeoXLayer``: ``input_layernorm, attention (query_key_value, dense), post_attention_layernorm, mlp``.

    Blocks: ``attn``: ``attention -> attention.dense``; ``ln_1`` (``input_layernorm``), ``ln_2``
    (``post_attention_layernorm``): ``"layernorm"``; ``ffn``: ``mlp.dense_h_to_4h -> mlp.dense_4h_to_h``.

    The fused ``query_key_value`` is laid out per head, ``[q_h | k_h | v_h]`` for ``h = 0 .. H-1`` (``view(B, L,
    H, 3 d_K).chunk(3)``), de-interleaved into ``W_Q, W_K, W_V``. Partial rotary: the tables of the call have
    ``r = rotary_ndims`` columns and rotate the first ``r`` dimensions of each head (half-split). With
    ``use_parallel_residual`` (Pythia's default) the layer computes ``x + attn(ln_1(x)) + mlp(ln_2(x))``; each
    block's ``X`` is captured at its own input, so the attention and the MLP each see their own norm's output.
    ``post_attention_dropout``/``post_mlp_dropout`` act after the captured outputs (residual dropout).
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        return _four_specs(
            layer, index, self, layer.attention, layer.input_layernorm, layer.post_attention_layernorm,
            layer.mlp.dense_h_to_4h,
        )  # fmt: skip

    def capture_modules(self, spec):
        layer = spec.layer_module
        return _capture(spec, layer.attention, {"attention": layer.attention.dense, "ffn": layer.mlp.dense_4h_to_h})

    def unmonitored(self, layer):
        return leftover(layer, [layer.attention, layer.input_layernorm, layer.post_attention_layernorm, layer.mlp])

    def read_masks(self, spec, args, kwargs):
        attn = spec.layer_module.attention
        a = _bind(attn, args, kwargs)
        _check_no_past(attn, a)
        masks = _self_masks(attn, a.get("attention_mask"), type(attn).__name__, _causal_default(attn))
        if spec.kind == "attention":
            masks.rotary = _rotary(a, attn.head_size, "GPTNeoXAttention")
            r = masks.rotary[0].shape[-1] if masks.rotary is not None else 0
            if r != attn.rotary_ndims:
                raise UnsupportedBlockError(
                    f"GPTNeoXAttention got rotary tables of width {r}, expected rotary_ndims={attn.rotary_ndims}."
                )
        return masks

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            return _ffn(layer.mlp.dense_h_to_4h, layer.mlp.dense_4h_to_h, layer.mlp.act)
        attn = layer.attention
        _check_impl(attn)
        check_probability_dropout(attn, float(attn.attention_dropout), "GPTNeoXAttention", "set attention_dropout=0.0")
        d_K = attn.head_size
        W, b = _linear(attn.query_key_value)  # (d, H * 3 d_K), per head [q | k | v]
        H = W.shape[1] // (3 * d_K)
        W_Q, W_K, W_V = split_fused_qkv(W, "per_head", H, H, d_K)
        b_Q = b_K = b_V = None
        if b is not None:
            b_Q, b_K, b_V = split_fused_qkv(b, "per_head", H, H, d_K)
        W_O, b_O = _linear(attn.dense)
        return dict(
            W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, n_heads=H, n_kv_heads=None, b_Q=b_Q, b_K=b_K, b_V=b_V, b_O=b_O,
            scale=softmax_scale(_scaling(attn, d_K), d_K), qk_norm=None,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# ViT
# --------------------------------------------------------------------------------------------------


class ViTLayerAdapter(_HFAdapter):
    """``ViTLayer`` (pre-norm, bidirectional): ``layernorm_before, attention (q/k/v/o_proj), layernorm_after,
    mlp (fc1, activation_fn, fc2)``.

    Blocks: ``attn``: ``attention -> attention.o_proj``; ``ln_1`` (``layernorm_before``), ``ln_2``
    (``layernorm_after``); ``ffn``: ``mlp.fc1 -> mlp.fc2``. No mask (every patch sees every patch; a
    ``head_mask``-free call). Written for the layout of transformers 5.x; the 4.x layout
    (``attention.attention.query``) is rejected with a message.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        if not hasattr(layer.attention, "q_proj") or not hasattr(layer, "mlp"):
            raise UnsupportedBlockError(
                "This ViTLayer has the transformers 4.x layout (attention.attention.query, intermediate, output); "
                "the adapter reads the 5.x layout (attention.q_proj, mlp.fc1). Upgrade transformers or register "
                "an adapter."
            )
        return _four_specs(
            layer, index, self, layer.attention, layer.layernorm_before, layer.layernorm_after, layer.mlp.fc1
        )

    def capture_modules(self, spec):
        layer = spec.layer_module
        return _capture(spec, layer.attention, {"attention": layer.attention.o_proj, "ffn": layer.mlp.fc2})

    def unmonitored(self, layer):
        return leftover(layer, [layer.attention, layer.layernorm_before, layer.layernorm_after, layer.mlp])

    def read_masks(self, spec, args, kwargs):
        attn = spec.layer_module.attention
        return _self_masks(attn, _bind(attn, args, kwargs).get("attention_mask"), "ViTAttention", False)

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            return _ffn(layer.mlp.fc1, layer.mlp.fc2, layer.mlp.activation_fn)
        attn = layer.attention
        return _proj_attention(attn, attn.o_proj, attn.head_dim, float(attn.attention_dropout))


# --------------------------------------------------------------------------------------------------
# BART (encoder and decoder layers)
# --------------------------------------------------------------------------------------------------


class BartLayerAdapter(_HFAdapter):
    """``BartEncoderLayer`` and ``BartDecoderLayer`` (post-norm): self-attention, [cross-attention,] FFN.

    Blocks, in forward order: ``attn``: ``"attention"``, ``self_attn -> self_attn.out_proj`` (bidirectional in
    the encoder, causal in the decoder); ``ln_1`` (``self_attn_layer_norm``); decoder only: ``cross_attn``:
    ``"cross_attention"``, ``encoder_attn -> encoder_attn.out_proj``, and ``ln_2`` (``encoder_attn_layer_norm``);
    ``ln_2`` (encoder) / ``ln_3`` (decoder): ``final_layer_norm``; ``ffn``: ``fc1 -> fc2``.

    Cross-attention masks are read from the decoder layer's call: ``memory`` is ``encoder_hidden_states``,
    ``memory_padding_mask`` the padded encoder positions (from ``encoder_attention_mask``) and
    ``key_padding_mask`` the padded decoder positions (queries; from the self-attention mask), so that its padded
    rows are dropped like those of the other blocks. Dropout on the FFN activations (``activation_dropout > 0``
    in training) is not modelled and raises.
    """

    @staticmethod
    def _is_decoder(layer: nn.Module) -> bool:
        return hasattr(layer, "encoder_attn")

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        out = [
            _spec(layer, index, "attn", "attention", layer.self_attn, self),
            _spec(layer, index, "ln_1", "layernorm", layer.self_attn_layer_norm, self),
        ]
        if self._is_decoder(layer):
            out += [
                _spec(layer, index, "cross_attn", "cross_attention", layer.encoder_attn, self),
                _spec(layer, index, "ln_2", "layernorm", layer.encoder_attn_layer_norm, self),
                _spec(layer, index, "ln_3", "layernorm", layer.final_layer_norm, self),
            ]
        else:
            out.append(_spec(layer, index, "ln_2", "layernorm", layer.final_layer_norm, self))
        out.append(_spec(layer, index, "ffn", "ffn", layer.fc1, self))
        return out

    def capture_modules(self, spec):
        layer = spec.layer_module
        if spec.kind == "cross_attention":
            return spec.module, layer.encoder_attn.out_proj, layer
        return _capture(spec, layer.self_attn, {"attention": layer.self_attn.out_proj, "ffn": layer.fc2})

    def unmonitored(self, layer):
        covered = [layer.self_attn, layer.self_attn_layer_norm, layer.fc1, layer.fc2, layer.final_layer_norm]
        if self._is_decoder(layer):
            covered += [layer.encoder_attn, layer.encoder_attn_layer_norm]
        return leftover(layer, covered)

    def read_masks(self, spec, args, kwargs):
        layer = spec.layer_module
        if spec.kind != "cross_attention":
            attn = layer.self_attn
            a = _bind(attn, args, kwargs)
            if a.get("key_value_states") is not None:
                raise UnsupportedBlockError("BART self_attn was called with key_value_states (cross-attention).")
            _check_no_past(attn, a)
            return _self_masks(attn, a.get("attention_mask"), "BartAttention", _causal_default(attn))
        a = _bind(layer, args, kwargs)
        _check_no_past(layer.self_attn, a)
        own = _self_masks(layer.self_attn, a.get("attention_mask"), "BartAttention", _causal_default(layer.self_attn))
        memory = a.get("encoder_hidden_states")
        return Masks(
            causal=False,
            key_padding_mask=own.key_padding_mask,
            memory=memory,
            memory_padding_mask=_memory_padding(a.get("encoder_attention_mask"), "BART encoder_attn"),
        )

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            return _layernorm(spec.module)
        if spec.kind == "ffn":
            check_probability_dropout(
                layer, float(layer.activation_dropout), "BART's FFN (activation_dropout)", "set activation_dropout=0.0"
            )
            return _ffn(layer.fc1, layer.fc2, layer.activation_fn)
        attn = layer.encoder_attn if spec.kind == "cross_attention" else layer.self_attn
        return _proj_attention(attn, attn.out_proj, attn.head_dim, float(attn.dropout))
