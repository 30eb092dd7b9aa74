"""Small reference models used by the demo, the tests and the benchmarks."""

from curvwatch.models.gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP"]
