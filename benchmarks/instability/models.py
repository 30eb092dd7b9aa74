"""The suite's architectures, one table from name to builder, and the max-attention-logit probe.

Each entry of :data:`ARCHITECTURES` builds a causal byte-level LM from a :class:`ModelSpec` and says where its
attention modules are and how to turn a module's input ``X`` into the scaled scores ``Q K^T / sqrt(d_K)``:

* ``"gpt"``: :class:`curvwatch.models.gpt.GPT` as it ships (pre-LN or post-LN);
* ``"torch"``: a stack of ``nn.TransformerEncoderLayer`` (``norm_first`` for pre-LN) under a causal mask, with
  token and position embeddings and an untied head;
* ``"llama"``: litgpt's ``GPT`` as a LLaMA-style model (RMSNorm, SwiGLU, rotary, grouped-query attention).

**Adding an architecture**: write a builder
``(ModelSpec) -> nn.Module`` whose forward maps ``(B, L)`` ids to ``(B, L, 256)`` logits, and a function
``(model) -> list[(attention module, scores_fn)]`` where ``scores_fn(module, X) -> (B, H, L, L)`` computes the
pre-mask scores from the module's first forward input (apply the rotary embedding there for RoPE models), then
add ``Architecture(build, attention_scores)`` under a new key. The monitor must know the model's layer type
(``curvwatch.register_adapter``); nothing else in the suite changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.instability.corpus import VOCAB_SIZE
from curvwatch.models.gpt import GPT, GPTConfig

ScoresFn = Callable[[nn.Module, Tensor], Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters of one suite model.

    Args:
        arch: Key of :data:`ARCHITECTURES`.
        n_layer: Transformer layers.
        n_head: Attention heads (divides ``d_model``).
        d_model: Residual width; the FFN is ``4 d_model`` wide.
        seq_len: Context length ``L``.
        norm: ``"pre"`` or ``"post"`` LayerNorm placement.
        ln_eps: ``eps`` of every LayerNorm.
        final_norm: Whether a pre-LN model normalises before the head (``"gpt"`` always does).
        emb_std: Standard deviation of the token and position embeddings at initialisation.
        bias: Whether the Linear layers (and, for ``"torch"``, the LayerNorms) have biases.
    """

    arch: str = "gpt"
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    seq_len: int = 64
    norm: str = "pre"
    ln_eps: float = 1e-5
    final_norm: bool = True
    emb_std: float = 0.02
    bias: bool = True


def build_gpt(spec: ModelSpec) -> nn.Module:
    """curvwatch's GPT, vocabulary 256, no dropout, embeddings re-drawn with ``spec.emb_std``."""
    config = GPTConfig(
        vocab_size=VOCAB_SIZE,
        block_size=spec.seq_len,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        d_model=spec.d_model,
        norm=spec.norm,
        ln_eps=spec.ln_eps,
        bias=spec.bias,
    )
    model = GPT(config)
    for emb in (model.tok_emb, model.pos_emb):
        nn.init.normal_(emb.weight, std=spec.emb_std)
    return model


def gpt_scores(model: nn.Module) -> list[tuple[nn.Module, ScoresFn]]:
    """The attention modules of a :class:`GPT` and their score functions."""

    def scores(attn: nn.Module, X: Tensor) -> Tensor:
        B, L, d = X.shape
        d_K = d // attn.n_head
        q = attn.q_proj(X).view(B, L, attn.n_head, d_K).transpose(1, 2)  # (B, H, L, d_K)
        k = attn.k_proj(X).view(B, L, attn.n_head, d_K).transpose(1, 2)
        return q @ k.transpose(-2, -1) / math.sqrt(d_K)  # (B, H, L, L)

    return [(block.attn, scores) for block in model.blocks]


class TorchCausalLM(nn.Module):
    """Token + position embeddings, ``nn.TransformerEncoder`` under a causal mask, optional final LayerNorm, head.

    Example:
        >>> model = TorchCausalLM(ModelSpec(arch="torch", d_model=16, seq_len=8))
        >>> model(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 256])
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        d = spec.d_model
        self.tok_emb = nn.Embedding(VOCAB_SIZE, d)
        self.pos_emb = nn.Embedding(spec.seq_len, d)
        for emb in (self.tok_emb, self.pos_emb):
            nn.init.normal_(emb.weight, std=spec.emb_std)
        layer = nn.TransformerEncoderLayer(
            d,
            spec.n_head,
            dim_feedforward=4 * d,
            dropout=0.0,
            activation="gelu",
            layer_norm_eps=spec.ln_eps,
            batch_first=True,
            norm_first=spec.norm == "pre",
            bias=spec.bias,
        )
        self.encoder = nn.TransformerEncoder(layer, spec.n_layer, enable_nested_tensor=False)
        pre = spec.norm == "pre" and spec.final_norm
        self.ln_f: nn.Module = nn.LayerNorm(d, eps=spec.ln_eps, bias=spec.bias) if pre else nn.Identity()
        self.head = nn.Linear(d, VOCAB_SIZE, bias=False)
        nn.init.normal_(self.head.weight, std=0.02)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(spec.seq_len), persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        """``(B, L)`` ids -> ``(B, L, 256)`` logits."""
        L = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(L, device=idx.device))  # (B, L, d)
        x = self.encoder(x, mask=self.mask[:L, :L], is_causal=True)
        return self.head(self.ln_f(x))


def torch_scores(model: nn.Module) -> list[tuple[nn.Module, ScoresFn]]:
    """The ``self_attn`` modules of a :class:`TorchCausalLM` and their score functions (packed ``in_proj``)."""

    def scores(mha: nn.Module, X: Tensor) -> Tensor:
        B, L, d = X.shape
        H, d_K = mha.num_heads, d // mha.num_heads
        W_q, W_k, _ = mha.in_proj_weight.split(d)
        b_q, b_k, _ = mha.in_proj_bias.split(d) if mha.in_proj_bias is not None else (None, None, None)
        q = F.linear(X, W_q, b_q).view(B, L, H, d_K).transpose(1, 2)  # (B, H, L, d_K)
        k = F.linear(X, W_k, b_k).view(B, L, H, d_K).transpose(1, 2)
        return q @ k.transpose(-2, -1) / math.sqrt(d_K)  # (B, H, L, L)

    return [(layer.self_attn, scores) for layer in model.encoder.layers]


def build_llama(spec: ModelSpec) -> nn.Module:
    """litgpt's ``GPT`` as a LLaMA-style model: RMSNorm before each sub-block and the head, SwiGLU MLP (the demo's
    width), rotary positions on whole heads, grouped-query attention (``n_head // 2`` key/value groups), no biases;
    initialised like the demo's ``--arch llama`` (normal std 0.02, ``0.02 / sqrt(2 n_layer)`` into the residual)."""
    from examples.demo import build_model as build_demo_model
    from examples.demo import llama_ffn_width

    config = {
        "name": "suite-llama", "block_size": spec.seq_len, "vocab_size": VOCAB_SIZE, "padded_vocab_size": VOCAB_SIZE,
        "n_layer": spec.n_layer, "n_head": spec.n_head, "n_query_groups": max(1, spec.n_head // 2),
        "n_embd": spec.d_model, "rotary_percentage": 1.0, "parallel_residual": False, "bias": False,
        "norm_class_name": "RMSNorm", "norm_eps": spec.ln_eps, "mlp_class_name": "LLaMAMLP",
        "intermediate_size": llama_ffn_width(spec.d_model),
    }  # fmt: skip
    return build_demo_model("llama", config)


def llama_scores(model: nn.Module) -> list[tuple[nn.Module, ScoresFn]]:
    """The attention modules of a litgpt ``GPT`` and their scores ``R(q) R(k)^T / sqrt(d_K)`` (rotary applied, keys
    of each group repeated over its query heads), from the weights as curvwatch's litgpt adapter reads them."""
    from litgpt.model import apply_rope

    def scores(attn: nn.Module, X: Tensor) -> Tensor:
        cfg = attn.config
        B, L, _ = X.shape
        H, H_kv, hs = cfg.n_head, cfg.n_query_groups, cfg.head_size
        q, k, _ = attn.qkv(X).split((H * hs, H_kv * hs, H_kv * hs), dim=-1)
        q = q.view(B, L, H, hs).transpose(1, 2)  # (B, H, L, hs)
        k = k.view(B, L, H_kv, hs).transpose(1, 2).repeat_interleave(H // H_kv, dim=1)
        cos, sin = model.cos[:L].to(X.dtype)[None], model.sin[:L].to(X.dtype)[None]  # (1, L, hs)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, H, L, L)

    return [(block.attn, scores) for block in model.transformer.h]


@dataclass(frozen=True)
class Architecture:
    """How the suite builds one architecture and reads its attention scores."""

    build: Callable[[ModelSpec], nn.Module]
    attention_scores: Callable[[nn.Module], list[tuple[nn.Module, ScoresFn]]]


#: Name -> architecture (see the module docstring for adding one).
ARCHITECTURES: dict[str, Architecture] = {
    "gpt": Architecture(build_gpt, gpt_scores),
    "torch": Architecture(TorchCausalLM, torch_scores),
    "llama": Architecture(build_llama, llama_scores),
}


def build_model(spec: ModelSpec) -> nn.Module:
    """The model of ``spec``.

    Raises:
        ValueError: For an architecture not in :data:`ARCHITECTURES`.
    """
    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"Invalid arch={spec.arch!r}. Must be one of {sorted(ARCHITECTURES)}.")
    return ARCHITECTURES[spec.arch].build(spec)


class MaxLogitProbe:
    """Forward pre-hooks that record ``max |q_i . k_j| / sqrt(d_K)`` over allowed (causal) pairs, all heads.

    :meth:`pop` returns the largest value over the modules since the last call (the training forward of one
    step) and resets it. The scores are recomputed from the module input under ``no_grad``, so training is
    unchanged; :meth:`remove` takes the hooks off.

    Example:
        >>> model = build_model(ModelSpec(d_model=16, seq_len=8))
        >>> probe = MaxLogitProbe(model, "gpt")
        >>> _ = model(torch.zeros(1, 8, dtype=torch.long))
        >>> probe.pop() >= 0.0
        True
        >>> probe.remove()
    """

    def __init__(self, model: nn.Module, arch: str) -> None:
        self.value = -math.inf
        self._handles = [
            module.register_forward_pre_hook(self._hook(fn))
            for module, fn in ARCHITECTURES[arch].attention_scores(model)
        ]

    def _hook(self, fn: ScoresFn) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            with torch.no_grad():
                S = fn(module, args[0])  # (B, H, L, L)
                L = S.shape[-1]
                allowed = torch.ones(L, L, dtype=torch.bool, device=S.device).tril()
                self.value = max(self.value, float(S.abs().masked_fill(~allowed, 0).amax()))

        return hook

    def pop(self) -> float:
        """The largest logit since the last call (``-inf`` if no attention ran)."""
        value, self.value = self.value, -math.inf
        return value

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
