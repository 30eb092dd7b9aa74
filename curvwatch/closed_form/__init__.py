"""Closed-form, per-block Hessian quantities of Transformer blocks: pure functions, tensors in, named numbers out."""

from .attention import multi_head_attention, self_attention
from .block import transformer_block
from .bounds import attention_bounds, softmax_hessian_frobenius, softmax_jacobian_norm
from .ffn import ffn
from .gated_ffn import gated_ffn
from .inputs import AttentionStructure, AttentionWeights, FFNWeights, GatedFFNWeights, LowRankUpdate, OutputLoss
from .layernorm import layernorm
from .rmsnorm import rmsnorm
from .settings import EXACT, PARTS, Lanczos, LanczosWarning, WarmStart, inputs_checked

__all__ = [
    # attention
    "self_attention",
    "multi_head_attention",
    # other sub-blocks and the whole block
    "layernorm",
    "rmsnorm",
    "ffn",
    "gated_ffn",
    "transformer_block",
    # grouped inputs
    "AttentionWeights",
    "AttentionStructure",
    "FFNWeights",
    "GatedFFNWeights",
    "OutputLoss",
    "LowRankUpdate",
    # the Hessian parts
    "PARTS",
    # settings of the iterative (Lanczos) norms
    "Lanczos",
    "WarmStart",
    "EXACT",
    "LanczosWarning",
    "inputs_checked",
    # bound terms
    "attention_bounds",
    "softmax_jacobian_norm",
    "softmax_hessian_frobenius",
]
