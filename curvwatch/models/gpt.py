"""A small decoder-only Transformer (nanoGPT-like) used by the demo and the tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_NORMS = ("pre", "post")
_ACTIVATIONS = ("gelu", "relu")
_ATTENTIONS = ("sdpa", "math")


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`GPT`.

    Args:
        vocab_size: Number of token ids.
        block_size: Longest sequence the position embedding covers.
        n_layer: Number of Transformer blocks.
        n_head: Number of attention heads; must divide ``d_model``.
        d_model: Width of the residual stream.
        d_ff: Hidden width of the MLP; ``None`` means ``4 * d_model``.
        norm: ``"pre"`` (LayerNorm before each sub-block, GPT-2) or ``"post"`` (after the residual sum,
            original Transformer).
        activation: MLP nonlinearity, ``"gelu"`` (tanh-free, exact erf) or ``"relu"``.
        dropout: Dropout probability on embeddings, attention weights and residual branches.
        bias: Whether the Linear layers have biases (the LM head never has one).
        attention: ``"sdpa"`` uses the fused :func:`torch.nn.functional.scaled_dot_product_attention`
            (fast, but on some backends without double backward); ``"math"`` computes the softmax
            explicitly (twice differentiable, for reference computations).
        ln_eps: ``eps`` of every LayerNorm.

    Raises:
        ValueError: If an option is outside its allowed set or ``n_head`` does not divide ``d_model``.

    Example:
        >>> GPTConfig(vocab_size=12, block_size=17).d_ff
        256
    """

    vocab_size: int
    block_size: int
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    d_ff: int | None = None
    norm: str = "pre"
    activation: str = "gelu"
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"
    ln_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name, allowed in (("norm", _NORMS), ("activation", _ACTIVATIONS), ("attention", _ATTENTIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Invalid {name}={value!r}. Must be one of {allowed}.")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"Invalid n_head={self.n_head} for d_model={self.d_model}. n_head must divide d_model."
            )
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"Invalid {name}={getattr(self, name)}. Must be >= 1.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"Invalid dropout={self.dropout}. Must be in [0, 1).")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate Q, K, V and output projections.

    Computes ``softmax(Q K^T / sqrt(d_K) + causal mask) V W_O`` per head, where ``Q = X W_Q`` etc. and
    head ``h`` owns columns ``h*d_K:(h+1)*d_K`` of ``W_Q = q_proj.weight.T`` (and of ``W_K, W_V``).

    Example:
        >>> attn = CausalSelfAttention(GPTConfig(vocab_size=12, block_size=8, d_model=16, n_head=2))
        >>> attn(torch.randn(3, 8, 16)).shape
        torch.Size([3, 8, 16])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.q_proj = nn.Linear(d, d, bias=config.bias)
        self.k_proj = nn.Linear(d, d, bias=config.bias)
        self.v_proj = nn.Linear(d, d, bias=config.bias)
        self.out_proj = nn.Linear(d, d, bias=config.bias)
        self.n_head = config.n_head
        self.causal = True
        self.attention = config.attention
        self.dropout = config.dropout
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Attend causally over the sequence.

        Args:
            x: Input of shape ``(B, L, d_model)``.

        Returns:
            Output of shape ``(B, L, d_model)``.
        """
        B, L, d = x.shape
        d_K = d // self.n_head
        # (B, L, d) -> (B, H, L, d_K)
        q = self.q_proj(x).view(B, L, self.n_head, d_K).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_head, d_K).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_head, d_K).transpose(1, 2)
        if self.attention == "sdpa":
            dropout_p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(d_K)  # (B, H, L, L)
            future = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
            A = self.attn_dropout(torch.softmax(scores, dim=-1))
            y = A @ v  # (B, H, L, d_K)
        y = y.transpose(1, 2).reshape(B, L, d)  # heads side by side: (B, L, H * d_K)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network ``act(X W_1 + b_1) W_2 + b_2``.

    Example:
        >>> mlp = MLP(GPTConfig(vocab_size=12, block_size=8, d_model=16))
        >>> mlp(torch.randn(2, 8, 16)).shape
        torch.Size([2, 8, 16])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d_ff = config.d_ff or 4 * config.d_model
        self.fc = nn.Linear(config.d_model, d_ff, bias=config.bias)
        self.proj = nn.Linear(d_ff, config.d_model, bias=config.bias)
        self.activation = config.activation
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP to ``x`` of shape ``(B, L, d_model)``; returns the same shape."""
        h = self.fc(x)
        h = F.gelu(h) if self.activation == "gelu" else F.relu(h)
        return self.dropout(self.proj(h))


class Block(nn.Module):
    """One Transformer layer: attention and MLP sub-blocks with residuals and LayerNorms.

    ``norm="pre"``: ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))``.
    ``norm="post"``: ``x = ln_1(x + attn(x)); x = ln_2(x + mlp(x))``.

    Example:
        >>> block = Block(GPTConfig(vocab_size=12, block_size=8, d_model=16, norm="post"))
        >>> block(torch.randn(2, 8, 16)).shape
        torch.Size([2, 8, 16])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.ln_eps)
        self.mlp = MLP(config)
        self.norm = config.norm

    def forward(self, x: Tensor) -> Tensor:
        """Apply the layer to ``x`` of shape ``(B, L, d_model)``; returns the same shape."""
        if self.norm == "pre":
            x = x + self.attn(self.ln_1(x))
            x = x + self.mlp(self.ln_2(x))
        else:
            x = self.ln_1(x + self.attn(x))
            x = self.ln_2(x + self.mlp(x))
        return x


class GPT(nn.Module):
    """Decoder-only language model: token + position embeddings, ``n_layer`` blocks, LM head.

    Weights are initialised as in nanoGPT: normal with std 0.02, zero biases, and std
    ``0.02 / sqrt(2 * n_layer)`` on the projections that write into the residual stream
    (``attn.out_proj`` and ``mlp.proj``). The head is not tied to the token embedding.

    Args:
        config: The hyperparameters.

    Example:
        >>> model = GPT(GPTConfig(vocab_size=12, block_size=8, d_model=16))
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 12])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        # Post-LN blocks already end in a LayerNorm, so a final one would be redundant.
        self.ln_f: nn.Module = (
            nn.LayerNorm(config.d_model, eps=config.ln_eps) if config.norm == "pre" else nn.Identity()
        )
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        residual_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.out_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Compute next-token logits.

        Args:
            idx: Token ids of shape ``(B, L)``, dtype long, with ``L <= block_size``.

        Returns:
            Logits of shape ``(B, L, vocab_size)``.

        Raises:
            ValueError: If the sequence is longer than ``block_size``.
        """
        B, L = idx.shape
        if L > self.config.block_size:
            raise ValueError(
                f"Sequence length {L} exceeds block_size={self.config.block_size}. "
                "Build the model with a larger GPTConfig.block_size."
            )
        pos = torch.arange(L, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, L, d)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, L, vocab)

    def num_parameters(self) -> int:
        """Number of trainable parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
