"""The kernels' grouped inputs: a block's weights, the attention's structure and the loss at the block output.

Every kernel of :mod:`curvwatch.closed_form` takes its input tensor first, then the block's weights as one object
(:class:`AttentionWeights`, :class:`FFNWeights`, :class:`GatedFFNWeights`), and keywords: the loss at the block output
(:class:`OutputLoss`), for attention its structure (:class:`AttentionStructure`), the low-rank adapters whose
parameters the optimizer steps (:class:`LowRankUpdate`), and what to compute (``pairs``, ``parts``, ``lanczos``,
``dense``, ...). The ground truths of :mod:`curvwatch.reference` take the same objects, so a
test calls both the same way.

Weights follow the math convention ``X @ W``: a weight is ``(d_in, d_out)`` (pass ``nn.Linear.weight.T``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["AttentionStructure", "AttentionWeights", "FFNWeights", "GatedFFNWeights", "LowRankUpdate", "OutputLoss"]


@dataclass(frozen=True, eq=False)
class OutputLoss:
    """The loss at the block output ``F`` (``(L, m)``, or ``(B, L, m)`` for a batched input): exactly one of
    ``target`` and ``grad_output``.

    * ``target``: the papers' loss ``||F_b - target_b||_F^2 / (L_b m)``, averaged over the batch (output curvature
      ``c_b = 2 / (L_b m B)``, ``L_b`` the kept rows of sequence ``b``).
    * ``grad_output``: the local quadratic model of a block inside a network,
      ``sum_b <G_b, F_b'> + (c/2) ||F_b' - F_b||^2`` around the current output, with ``G = dl/dF`` back-propagated.

    Args:
        target: ``F``-shaped target, ``(L, m)`` or ``(B, L, m)``.
        grad_output: ``F``-shaped back-propagated gradient ``dl/dF``, ``(L, m)`` or ``(B, L, m)``.
        output_curvature: ``c`` of the quadratic model, ``>= 0`` (default ``2 / (L m)``); grad_output mode only.
        output_samples: ``(k, B, L, m)`` (``(k, L, m)`` unbatched), grad_output mode only: ``k`` sampled gradients
            ``s_j`` of the loss in ``F`` (e.g. back-propagated from labels drawn from the model's own predictive
            distribution). They define the Monte-Carlo output curvature ``C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T``
            (block diagonal over the sequences, dropped rows zeroed) of the sampled keys (``ggn/...``,
            ``sharpness/...``); every other key is unchanged.

    Example:
        >>> loss = OutputLoss(grad_output=torch.ones(4, 3))
        >>> loss.target is None, tuple(loss.grad_output.shape)
        (True, (4, 3))
    """

    target: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    output_curvature: float | None = None
    output_samples: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class AttentionWeights:
    """The weights of a (multi-head) attention block, packed as the layers hold them.

    Head ``h`` owns columns ``h d_K:(h+1) d_K`` of ``W_Q`` and rows ``h d_V:(h+1) d_V`` of ``W_O``; kv head ``g``
    owns columns ``g d_K:(g+1) d_K`` of ``W_K`` and ``g d_V:(g+1) d_V`` of ``W_V``; query head ``h`` reads kv head
    ``h // (H / H_kv)`` (Hugging Face's ``repeat_kv``, litgpt's query groups).

    Args:
        W_Q: ``(d, H d_K)``.
        W_K: ``(d_kv, H_kv d_K)``.
        W_V: ``(d_kv, H_kv d_V)``; ``d_kv = d`` without a cross-attention memory.
        W_O: ``(H d_V, m)`` output projection (pass ``out_proj.weight.T``), or None: one head without projection
            (:func:`~curvwatch.closed_form.self_attention`).
        n_heads: ``H``, the query heads.
        n_kv_heads: ``H_kv`` key/value heads, dividing ``H`` (grouped-query attention; ``1``: multi-query); ``None``:
            ``H``.
        b_Q: ``(H d_K,)``; b_K: ``(H_kv d_K,)``; b_V: ``(H_kv d_V,)``; b_O: ``(m,)``; optional biases.
        qk_norm: per-head QK-norm of Qwen3, OLMo-style per-head norms and Gemma 3, applied to the queries and keys of
            every head before the rotary embedding: ``None`` or a dict with ``"kind"`` (``"rmsnorm"`` or
            ``"layernorm"``), ``"eps"``, optional ``"weight_q"``, ``"weight_k"`` ``(d_K,)``, ``"bias_q"``,
            ``"bias_k"`` ``(d_K,)`` (layernorm only) and ``"weight_offset"`` (``0.0``, or ``1.0`` for Gemma's
            ``(1 + weight)``).

    Example:
        >>> W = torch.zeros(8, 8)
        >>> weights = AttentionWeights(W, W[:, :4], W[:, :4], W, n_heads=4, n_kv_heads=2)
        >>> weights.n_heads, weights.n_kv_heads, weights.W_O.shape
        (4, 2, torch.Size([8, 8]))
    """

    W_Q: torch.Tensor
    W_K: torch.Tensor
    W_V: torch.Tensor
    W_O: torch.Tensor | None = None
    n_heads: int = 1
    n_kv_heads: int | None = None
    b_Q: torch.Tensor | None = None
    b_K: torch.Tensor | None = None
    b_V: torch.Tensor | None = None
    b_O: torch.Tensor | None = None
    qk_norm: Mapping | None = None


@dataclass(frozen=True, eq=False)
class AttentionStructure:
    """Which keys each query sees and how the scores are formed: masks, window, scale, rotary embedding, memory.

    Args:
        causal: query ``i`` sees keys ``j <= i`` (also across, in cross-attention).
        key_padding_mask: ``(B, L)`` or ``(L,)`` bool, True = padded query position: dropped from the loss and, in
            self-attention, never attended to.
        window: sliding window ``w >= 1``: with ``causal`` query ``i`` sees keys ``i - w < j <= i`` (Mistral, Gemma 2,
            Qwen sliding layers), without it ``|i - j| < w``. ``None``: no window.
        scale: softmax scale ``s``, a positive float (Gemma: ``query_pre_attn_scalar**-0.5``, T5: ``1.0``), or
            ``None`` for ``1/sqrt(d_K)``.
        rotary: ``(cos, sin)`` rotary tables, each ``(L, r)`` or ``(B, L, r)`` (``(1, L, r)`` broadcasts), ``r <= d_K``
            even, the frequencies' halves duplicated (``cos[..., i] == cos[..., i + r/2]``), as Hugging Face and
            litgpt pass them; only the first ``r`` dims of each head's queries and keys rotate. Self-attention only.
        rotary_interleaved: ``False``: half-split layout (LLaMA, NeoX, Hugging Face), dim ``i`` pairs with
            ``i + r/2``; ``True``: GPT-J layout, dim ``2i`` pairs with ``2i + 1``.
        memory: ``(B, L_kv, d_kv)`` (``(L_kv, d_kv)`` unbatched) cross-attention source: keys and values are
            ``memory W_K``, ``memory W_V``; queries come from ``X``. ``None``: self-attention.
        memory_padding_mask: ``(B, L_kv)`` or ``(L_kv,)`` bool, True = padded memory position (never attended to).

    Example:
        >>> AttentionStructure(causal=True, window=4).window
        4
    """

    causal: bool = False
    key_padding_mask: torch.Tensor | None = None
    window: int | None = None
    scale: float | None = None
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None
    rotary_interleaved: bool = False
    memory: torch.Tensor | None = None
    memory_padding_mask: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class FFNWeights:
    """The weights of a feed-forward block ``act(Y W_1 + b_1) W_2 + b_2``.

    Args:
        W_1: ``(d, f)``.
        W_2: ``(f, m)``.
        b_1: ``(f,)`` or None; b_2: ``(m,)`` or None.

    Example:
        >>> FFNWeights(torch.zeros(3, 5), torch.zeros(5, 3)).W_1.shape
        torch.Size([3, 5])
    """

    W_1: torch.Tensor
    W_2: torch.Tensor
    b_1: torch.Tensor | None = None
    b_2: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class GatedFFNWeights:
    """The weights of a gated MLP ``(act(Y W_gate + b_gate) * (Y W_up + b_up)) W_down + b_down`` (SwiGLU, GeGLU).

    Args:
        W_gate: ``(d, f)`` (LLaMA's ``w1``); W_up: ``(d, f)`` (``w3``); W_down: ``(f, m)`` (``w2``).
        b_gate: ``(f,)``, b_up: ``(f,)``, b_down: ``(m,)``; optional.

    Example:
        >>> GatedFFNWeights(torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(5, 3)).W_down.shape
        torch.Size([5, 3])
    """

    W_gate: torch.Tensor
    W_up: torch.Tensor
    W_down: torch.Tensor
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class LowRankUpdate:
    """A low-rank adapter ``s A B`` inside the block's weights, whose factors ``A``, ``B`` the optimizer steps (LoRA).

    The weights the kernel is given are the effective ones (``W_0 + s A B`` in the columns the update writes); a
    kernel's ``adapters=`` adds the curvature of the loss in ``theta = [vec(A), vec(B)]`` (row-major, ``A`` first),
    by the chain rule ``dW = s (dA B + A dB)`` (:mod:`curvwatch.closed_form.adapted`).

    Args:
        A: ``(d_in, r)`` (peft's ``lora_A.weight.T``).
        B: ``(r, k)`` (peft's ``lora_B.weight.T``).
        scale: ``s`` (peft and litgpt: ``lora_alpha / r``).
        writes: Weight argument (``"W_Q"``, ``"W_1"`` ...) -> ``(source, dest)``, two ``(n,)`` ``LongTensor`` s: the
            columns of ``B`` that land in that weight and their columns there (packed as the weight is passed, head
            ``h`` owning columns ``h d_K:(h+1) d_K``). An update of one whole weight is ``{"W_Q": (arange(k),
            arange(k))}``; one over a fused ``[W_Q | W_K | W_V]`` writes three weights.

    Example:
        >>> A, B = torch.zeros(4, 2), torch.zeros(2, 6)
        >>> update = LowRankUpdate(A, B, 2.0, {"W_1": (torch.arange(6), torch.arange(6))})
        >>> update.A.shape, sorted(update.writes)
        (torch.Size([4, 2]), ['W_1'])
    """

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    writes: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
