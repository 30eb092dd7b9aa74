"""Tests of curvwatch.models.gpt: shapes, LayerNorm placement, attention, causality, gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvwatch.models import GPT, MLP, Block, CausalSelfAttention, GPTConfig
from tests.utils import TOL, assert_close_report

CASES = [
    {"norm": "pre", "activation": "gelu", "bias": True},
    {"norm": "post", "activation": "relu", "bias": False},
]


def _config(**kwargs) -> GPTConfig:
    base = {"vocab_size": 12, "block_size": 9, "n_layer": 2, "n_head": 2, "d_model": 16}
    return GPTConfig(**{**base, **kwargs})


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['norm']}-{c['activation']}")
def test_shapes(case):
    model = GPT(_config(**case))
    idx = torch.randint(0, 12, (3, 7))
    assert model(idx).shape == (3, 7, 12)
    block = model.blocks[0]
    assert block.attn.q_proj.weight.shape == (16, 16)
    assert block.mlp.fc.weight.shape == (64, 16)  # d_ff defaults to 4 * d_model
    assert block.mlp.proj.weight.shape == (16, 64)
    assert (block.attn.q_proj.bias is not None) == case["bias"]
    assert model.head.bias is None


def test_structure_names():
    model = GPT(_config())
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2
    for block in model.blocks:
        assert isinstance(block, Block)
        assert isinstance(block.attn, CausalSelfAttention)
        assert isinstance(block.mlp, MLP)
        assert isinstance(block.ln_1, nn.LayerNorm) and isinstance(block.ln_2, nn.LayerNorm)
        assert block.attn.n_head == 2 and block.attn.causal is True
        assert block.ln_1.eps == 1e-5


def test_pre_vs_post_ln_structure():
    pre, post = GPT(_config(norm="pre")), GPT(_config(norm="post"))
    assert isinstance(pre.ln_f, nn.LayerNorm)
    assert isinstance(post.ln_f, nn.Identity)
    assert all(b.norm == "pre" for b in pre.blocks) and all(b.norm == "post" for b in post.blocks)
    # A post-LN block's output is the output of ln_2, so each row is normalised; a pre-LN one's is not.
    x = torch.randn(2, 5, 16) * 3 + 1
    for model, normalised in ((pre, False), (post, True)):
        with torch.no_grad():
            for block in model.blocks:
                block.ln_2.weight.fill_(1.0), block.ln_2.bias.zero_()
            y = model.blocks[0](x)
        row_mean_zero = torch.allclose(y.mean(-1), torch.zeros(2, 5), atol=1e-5)
        assert row_mean_zero == normalised


def test_post_ln_equation():
    block = Block(_config(norm="post")).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    h = block.ln_1(x + block.attn(x))
    expected = block.ln_2(h + block.mlp(h))
    assert_close_report(block(x), expected, TOL["float64"], "post-LN block")


def test_sdpa_matches_math_attention():
    torch.manual_seed(1)
    sdpa = GPT(_config(attention="sdpa")).double()
    math_model = GPT(_config(attention="math")).double()
    math_model.load_state_dict(sdpa.state_dict())
    idx = torch.randint(0, 12, (4, 9))
    assert_close_report(math_model(idx), sdpa(idx), TOL["float64"], "sdpa vs math logits")


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_causal(attention):
    model = GPT(_config(attention=attention)).double()
    idx = torch.randint(0, 12, (2, 9))
    changed = idx.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 12
    before, after = model(idx), model(changed)
    assert_close_report(after[:, :6], before[:, :6], TOL["float64"], "logits before the changed token")
    assert (after[:, 6:] - before[:, 6:]).abs().max() > 1e-6  # the change is visible from position 6 on


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["norm"])
def test_all_parameters_receive_gradients(case):
    model = GPT(_config(**case))
    logits = model(torch.randint(0, 12, (2, 9)))
    logits.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, name


def test_nanogpt_init():
    model = GPT(_config(n_layer=8, d_model=64))
    assert abs(model.blocks[0].attn.q_proj.weight.std().item() - 0.02) < 2e-3
    assert abs(model.blocks[0].attn.out_proj.weight.std().item() - 0.02 / 4) < 1e-3
    assert model.blocks[0].mlp.fc.bias.abs().sum() == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"norm": "sandwich"}, "Invalid norm='sandwich'"),
        ({"activation": "tanh"}, "Invalid activation"),
        ({"attention": "flash"}, "Invalid attention"),
        ({"n_head": 3}, "n_head must divide d_model"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)


def test_sequence_too_long():
    with pytest.raises(ValueError, match="exceeds block_size=9"):
        GPT(_config())(torch.zeros(1, 10, dtype=torch.long))
