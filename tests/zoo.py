"""Tiny models of the families curvwatch's adapters know, built from configs (no weights are ever downloaded).

Every builder is seeded, returns a :class:`Tiny` in float64 by default and takes well under a second once its
package is imported. All 1-D parameters (norm weights, biases) are perturbed away from their ones/zeros
initialisation, so that a reader that drops a bias or a norm offset is caught. Tests reuse them for adapter
and end-to-end checks; ``pytest.importorskip`` guards the optional packages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

B, L, VOCAB = 3, 6, 11


@dataclass
class Tiny:
    """A tiny model and a step on it.

    Args:
        model: The model (float64 unless asked otherwise).
        loss: ``loss(model)``: forward on the fixed batch to a scalar with non-trivial gradients.
        layers: The Transformer layers, in the order :func:`~curvwatch.adapters.find_blocks` numbers them.
        padding: ``(B, L)`` bool, True = padded position of the (decoder) sequence, or ``None``.
        memory_padding: ``(B, L_kv)`` bool padded encoder positions (encoder-decoder models), or ``None``.
    """

    model: nn.Module
    loss: Callable[[nn.Module], Tensor]
    layers: list[nn.Module]
    padding: Tensor | None = None
    memory_padding: Tensor | None = None


def _weighted_sum(out: Tensor) -> Tensor:
    """A loss whose gradient differs at every output entry."""
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()


def _finish(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    model = model.to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _padding_mask(kind: str | None, length: int = L) -> Tensor:
    """``(B, length)`` long mask, 1 = real token: ``"right"`` pads the end of sequence 0, ``"left"`` the start
    of sequence 1."""
    mask = torch.ones(B, length, dtype=torch.long)
    if kind == "right":
        mask[0, length - 2 :] = 0
    elif kind == "left":
        mask[1, :2] = 0
    elif kind is not None:
        raise ValueError(f"Invalid padding={kind!r}. Must be None, 'right' or 'left'.")
    return mask


# --------------------------------------------------------------------------------------------------
# litgpt
# --------------------------------------------------------------------------------------------------

_LIT_COMMON = dict(n_layer=2, n_embd=16, n_head=4, block_size=16, vocab_size=VOCAB, padded_vocab_size=VOCAB)

#: family -> (litgpt config name, overrides). Sizes keep even rotary widths (litgpt's odd widths are unusual).
LITGPT_FAMILIES: dict[str, tuple[str, dict]] = {
    # LLaMA 3.2: RMSNorm, SwiGLU, full rotary with llama3 frequency adjustments, GQA (4 heads, 2 groups)
    "llama3": ("Llama-3.2-1B", dict(n_query_groups=2, intermediate_size=24)),
    "llama2": ("Llama-2-7b-hf", dict(intermediate_size=24)),
    # Mistral: sliding window 3 < L on every layer
    "mistral": ("Mistral-7B-v0.1", dict(n_query_groups=2, intermediate_size=24, sliding_window_size=3)),
    # Qwen 2.5: q/k/v biases
    "qwen2.5": ("Qwen2.5-0.5B", dict(n_query_groups=2, intermediate_size=24)),
    # Qwen3: per-head RMSNorm QK-norm
    "qwen3": ("Qwen3-0.6B", dict(n_query_groups=2, intermediate_size=24, head_size=4)),
    # Gemma: GeGLU (tanh), RMSNorm (1 + w), scaled embeddings, multi-query attention
    "gemma": ("Gemma-2b", dict(n_query_groups=1, intermediate_size=24)),
    # Gemma 3: QK-norm with unit offset, post-attention/MLP norms, softmax scale 1/sqrt(256) != 1/sqrt(d_K),
    # layer 0 local (sliding window, local rotary base), layer 1 global
    "gemma3": (
        "Gemma-3-1b-it",
        dict(
            n_query_groups=2,
            intermediate_size=24,
            head_size=4,
            sliding_window_size=3,
            sliding_window_indices=[1, 0],
            rope_indices=[1, 0],
        ),
    ),
    # Pythia: LayerNorm, parallel residual, partial rotary (0.25 of head_size 8), GELU MLP with biases
    "pythia": ("pythia-14m", dict(n_embd=32)),
    # Phi-2: parallel residual with a shared norm, partial rotary 0.4 of head_size 10, GELU (tanh)
    "phi2": ("phi-2", dict(n_embd=40)),
    # Falcon: multi-query, shared attention norm, no biases
    "falcon": ("falcon-7b", dict(n_query_groups=1)),
    # interleaved rotary layout (litgpt's rope_interleave)
    "interleave": ("Llama-3.2-1B", dict(n_query_groups=2, intermediate_size=24, rope_interleave=True)),
    # not supported: Gemma 2 attention logit softcapping, Mixtral MoE, OLMo-2 QK-norm over all heads
    "gemma2": ("Gemma-2-2b", dict(n_query_groups=2, intermediate_size=24, head_size=4, sliding_window_size=3)),
    "mixtral": ("Mixtral-8x7B-v0.1", dict(n_query_groups=2, intermediate_size=24, n_expert=4, n_expert_per_token=2)),
    "olmo2": ("OLMo-2-1124-7B", dict(n_query_groups=4, intermediate_size=24)),
}


def litgpt_gpt(family: str, *, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> Tiny:
    """A 2-layer litgpt ``GPT`` of ``family`` (a key of :data:`LITGPT_FAMILIES`), via ``Config.from_name``."""
    litgpt = pytest.importorskip("litgpt")
    name, own = LITGPT_FAMILIES[family]
    config = litgpt.Config.from_name(name, **{**_LIT_COMMON, **own, **overrides})
    torch.manual_seed(seed)
    model = _finish(litgpt.GPT(config), dtype)
    idx = torch.randint(0, VOCAB, (B, L))
    return Tiny(model, lambda m: _weighted_sum(m(idx)), list(model.transformer.h))


# --------------------------------------------------------------------------------------------------
# Hugging Face transformers
# --------------------------------------------------------------------------------------------------

_HF_DECODER = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, attention_dropout=0.0, use_cache=False, pad_token_id=0,
)  # fmt: skip

#: family -> (config class name, model class name, config overrides)
HF_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaModel", {}),
    "llama-bias": ("LlamaConfig", "LlamaModel", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", "MistralModel", dict(sliding_window=3)),
    # layer 0 full attention, layer 1 sliding window 3
    "qwen2": ("Qwen2Config", "Qwen2Model", dict(use_sliding_window=True, sliding_window=3, max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3Model", dict(head_dim=4)),
    "gemma": ("GemmaConfig", "GemmaModel", dict(num_key_value_heads=1, head_dim=4, hidden_act="gelu_pytorch_tanh")),
}


def hf_decoder(
    family: str, *, impl: str = "sdpa", padding: str | None = None, dtype=torch.float64, seed: int = 0, **overrides
) -> Tiny:
    """A 2-layer Hugging Face decoder-only model of ``family`` (a key of :data:`HF_FAMILIES`)."""
    tf = pytest.importorskip("transformers")
    config_name, model_name, own = HF_FAMILIES[family]
    config = getattr(tf, config_name)(**{**_HF_DECODER, **own, **overrides})
    config._attn_implementation = impl
    torch.manual_seed(seed)
    model = _finish(getattr(tf, model_name)(config), dtype)
    ids = torch.randint(1, VOCAB, (B, L))
    am = _padding_mask(padding)

    def loss(m):
        return _weighted_sum(m(input_ids=ids, attention_mask=am).last_hidden_state)

    return Tiny(model, loss, list(model.layers), padding=(am == 0) if padding else None)


def hf_gpt_neox(
    *, parallel: bool = True, rotary: float = 0.25, impl: str = "sdpa", padding: str | None = None,
    dtype=torch.float64, seed: int = 0,
) -> Tiny:  # fmt: skip
    """A 2-layer ``GPTNeoXModel`` (Pythia): partial rotary, fused per-head q|k|v, optional parallel residual."""
    tf = pytest.importorskip("transformers")
    config = tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32, attention_dropout=0.0, hidden_dropout=0.0, use_parallel_residual=parallel,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary},
        attention_bias=True, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = impl
    torch.manual_seed(seed)
    model = _finish(tf.GPTNeoXModel(config), dtype)
    ids = torch.randint(1, VOCAB, (B, L))
    am = _padding_mask(padding)

    def loss(m):
        return _weighted_sum(m(input_ids=ids, attention_mask=am).last_hidden_state)

    return Tiny(model, loss, list(model.layers), padding=(am == 0) if padding else None)


def hf_vit(*, impl: str = "sdpa", dtype=torch.float64, seed: int = 0) -> Tiny:
    """A 2-layer ``ViTModel`` on 8x8 images with 4x4 patches (4 patches + CLS = 5 tokens)."""
    tf = pytest.importorskip("transformers")
    config = tf.ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=24, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, image_size=8, patch_size=4, num_channels=3,
    )  # fmt: skip
    config._attn_implementation = impl
    torch.manual_seed(seed)
    model = _finish(tf.ViTModel(config, add_pooling_layer=False), dtype)
    pixels = torch.randn(B, 3, 8, 8, dtype=dtype)
    return Tiny(model, lambda m: _weighted_sum(m(pixel_values=pixels).last_hidden_state), list(model.layers))


def hf_bart(
    *, impl: str = "sdpa", padding: str | None = None, memory_padding: str | None = None, dtype=torch.float64,
    seed: int = 0,
) -> Tiny:  # fmt: skip
    """A ``BartModel`` with one encoder and one decoder layer; sequences of length 6 (decoder) and 7 (encoder)."""
    tf = pytest.importorskip("transformers")
    config = tf.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    config._attn_implementation = impl
    torch.manual_seed(seed)
    model = _finish(tf.BartModel(config), dtype)
    L_enc = L + 1
    ids, dec_ids = torch.randint(3, VOCAB, (B, L_enc)), torch.randint(3, VOCAB, (B, L))
    am, dam = _padding_mask(memory_padding, L_enc), _padding_mask(padding)

    def loss(m):
        out = m(input_ids=ids, attention_mask=am, decoder_input_ids=dec_ids, decoder_attention_mask=dam)
        return _weighted_sum(out.last_hidden_state)

    layers = list(model.encoder.layers) + list(model.decoder.layers)
    return Tiny(
        model, loss, layers, padding=(dam == 0) if padding else None,
        memory_padding=(am == 0) if memory_padding else None,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# A nanoGPT-style model (written here; the typical structure of nanoGPT's model.py)
# --------------------------------------------------------------------------------------------------


class NanoLayerNorm(nn.Module):
    """LayerNorm with an optional bias and the eps hard-coded in the forward, as nanoGPT writes it."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoSelfAttention(nn.Module):
    def __init__(self, d: int, n_head: int, block_size: int, bias: bool, flash: bool, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout, self.flash = n_head, d, dropout, flash
        if not flash:
            tril = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
            self.register_buffer("bias", tril)

    def forward(self, x: Tensor) -> Tensor:
        Bx, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(Bx, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, H, T, d_K)
        if self.flash:
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, H, T, T)
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(Bx, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, d: int, bias: bool, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """nanoGPT's layer, named ``Block`` like litgpt's and curvwatch's own."""

    def __init__(self, d, n_head, block_size, bias, flash, dropout, torch_ln) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, bias=bias) if torch_ln else NanoLayerNorm(d, bias)
        self.attn = NanoSelfAttention(d, n_head, block_size, bias, flash, dropout)
        self.ln_2 = nn.LayerNorm(d, bias=bias) if torch_ln else NanoLayerNorm(d, bias)
        self.mlp = NanoMLP(d, bias, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, d=16, n_head=4, n_layer=2, block_size=16, bias=True, flash=True, dropout=0.0, torch_ln=False):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, d),
                wpe=nn.Embedding(block_size, d),
                h=nn.ModuleList(Block(d, n_head, block_size, bias, flash, dropout, torch_ln) for _ in range(n_layer)),
                ln_f=NanoLayerNorm(d, bias),
            )
        )
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nanogpt(
    *, flash: bool = True, bias: bool = True, torch_ln: bool = False, dropout: float = 0.0, dtype=torch.float64,
    seed: int = 0,
) -> Tiny:  # fmt: skip
    """A 2-layer nanoGPT-style model (SDPA ``is_causal=True`` path, or the explicit ``bias`` tril mask path)."""
    torch.manual_seed(seed)
    model = _finish(NanoGPT(bias=bias, flash=flash, dropout=dropout, torch_ln=torch_ln), dtype)
    idx = torch.randint(0, VOCAB, (B, L))
    return Tiny(model, lambda m: _weighted_sum(m(idx)), list(model.transformer.h))


# -- a LLaMA-style layer written by hand, monitored through a LayerDescription ------------------------------------


def _rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split rotary: dimension i pairs with i + d/2; ``cos``, ``sin`` ``(L, d_K)``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class HandAttention(nn.Module):
    """q/k/v/o projections, GQA (4 query heads, 2 kv heads), rotary from the caller, causal softmax."""

    def __init__(self, d: int = 16, n_heads: int = 4, n_kv: int = 2) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d_K = n_heads, n_kv, d // n_heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, n_kv * self.d_K, bias=False)
        self.wv = nn.Linear(d, n_kv * self.d_K, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, self.d_K).transpose(1, 2)  # (B, H, L, d_K)
        k = self.wk(x).view(B, L, self.n_kv, self.d_K).transpose(1, 2)
        v = self.wv(x).view(B, L, self.n_kv, self.d_K).transpose(1, 2)
        q, k = _rope_half(q, cos, sin), _rope_half(k, cos, sin)
        g = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        s = q @ k.transpose(-2, -1) / math.sqrt(self.d_K)
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=x.device).tril(), float("-inf"))
        y = torch.softmax(s, -1) @ v  # (B, H, L, d_K)
        return self.wo(y.transpose(1, 2).reshape(B, L, -1))


class HandMLP(nn.Module):
    def __init__(self, d: int = 16, f: int = 24) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d)

    def forward(self, h: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(h)) * self.up(h))


class HandLayer(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.attn, self.mlp = HandAttention(d), HandMLP(d)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class HandLM(nn.Module):
    def __init__(self, d: int = 16, n_layer: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(HandLayer(d) for _ in range(n_layer))
        self.norm, self.lm_head = nn.RMSNorm(d, eps=1e-6), nn.Linear(d, VOCAB, bias=False)
        self.d_K = d // 4

    def forward(self, idx: Tensor) -> Tensor:
        L = idx.shape[1]
        inv = 1.0 / 10000 ** (torch.arange(0, self.d_K, 2, dtype=torch.float64) / self.d_K)
        angles = torch.arange(L, dtype=torch.float64)[:, None] * inv[None]  # (L, d_K / 2)
        angles = torch.cat((angles, angles), dim=-1).to(self.emb.weight.dtype)
        cos, sin = angles.cos(), angles.sin()
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def hand_written(*, dtype: torch.dtype = torch.float64, seed: int = 0) -> Tiny:
    """:class:`HandLM`, its layer described to curvwatch with :class:`curvwatch.LayerDescription`."""
    from curvwatch import LayerDescription, describe_layer

    describe_layer(
        HandLayer,
        LayerDescription(
            q="attn.wq", k="attn.wk", v="attn.wv", o="attn.wo", n_heads=4, n_kv_heads=2,
            rotary=lambda args, kwargs: (args[1], args[2]),  # HandAttention.forward(x, cos, sin)
            norms=("norm1", "norm2"), gate="mlp.gate", up="mlp.up", down="mlp.down", activation="silu",
        ),
    )  # fmt: skip
    torch.manual_seed(seed)
    model = _finish(HandLM(), dtype)
    ids = torch.randint(0, VOCAB, (B, L))
    return Tiny(model, lambda m: _weighted_sum(m(ids)), list(model.layers))


# -- a nanoGPT-style layer with a fused qkv projection and GQA, monitored through a LayerDescription with qkv= ------


class FusedAttention(nn.Module):
    """One ``c_attn`` for q, k and v, GQA (4 query heads, 2 kv heads), causal SDPA, ``c_proj``.

    ``layout="concat"``: ``q, k, v = c_attn(x).split([H d_K, H_kv d_K, H_kv d_K], dim=2)`` (nanoGPT);
    ``"per_head"``: ``c_attn(x).view(B, L, H_kv, H / H_kv + 2, d_K)``, each kv head's query heads, key, value.
    """

    def __init__(self, d: int = 16, n_heads: int = 4, n_kv: int = 2, layout: str = "concat") -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.d_K, self.layout = n_heads, n_kv, d // n_heads, layout
        self.c_attn = nn.Linear(d, (n_heads + 2 * n_kv) * self.d_K)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        B, L, d = x.shape
        H, H_kv, d_K = self.n_heads, self.n_kv, self.d_K
        qkv = self.c_attn(x)
        if self.layout == "concat":
            q, k, v = qkv.split([H * d_K, H_kv * d_K, H_kv * d_K], dim=2)
            q = q.view(B, L, H, d_K).transpose(1, 2)  # (B, H, L, d_K)
            k = k.view(B, L, H_kv, d_K).transpose(1, 2)  # (B, H_kv, L, d_K)
            v = v.view(B, L, H_kv, d_K).transpose(1, 2)
        else:
            per = qkv.view(B, L, H_kv, H // H_kv + 2, d_K)
            q = per[:, :, :, :-2].reshape(B, L, H, d_K).transpose(1, 2)  # (B, H, L, d_K)
            k, v = per[:, :, :, -2].transpose(1, 2), per[:, :, :, -1].transpose(1, 2)  # (B, H_kv, L, d_K)
        g = H // H_kv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # query head h reads kv head h // g
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, d_K)
        return self.c_proj(y.transpose(1, 2).reshape(B, L, d))


class FusedMLP(nn.Module):
    def __init__(self, d: int = 16, f: int = 24) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class FusedBlock(nn.Module):
    def __init__(self, d: int = 16, layout: str = "concat") -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), FusedAttention(d, layout=layout)
        self.ln_2, self.mlp = nn.LayerNorm(d), FusedMLP(d)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class FusedLM(nn.Module):
    def __init__(self, d: int = 16, n_layer: int = 2, block_size: int = 16, layout: str = "concat") -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(block_size, d)
        self.h = nn.ModuleList(FusedBlock(d, layout) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def fused_qkv_description(**changes):
    """The :class:`curvwatch.LayerDescription` of :class:`FusedBlock` (``changes`` override its fields)."""
    from curvwatch import LayerDescription

    fields = dict(qkv="attn.c_attn", o="attn.c_proj", n_heads=4, n_kv_heads=2, norms=("ln_1", "ln_2"),
                  up="mlp.c_fc", down="mlp.c_proj", activation="gelu")  # fmt: skip
    return LayerDescription(**{**fields, **changes})


def fused_qkv(*, layout: str = "concat", dtype: torch.dtype = torch.float64, seed: int = 0) -> Tiny:
    """:class:`FusedLM` (its ``c_attn`` in ``layout``), its layer described with ``qkv=`` and that layout."""
    from curvwatch import describe_layer

    describe_layer(FusedBlock, fused_qkv_description(qkv_layout=layout))
    torch.manual_seed(seed)
    model = _finish(FusedLM(layout=layout), dtype)
    ids = torch.randint(0, VOCAB, (B, L))
    return Tiny(model, lambda m: _weighted_sum(m(ids)), list(model.h))
