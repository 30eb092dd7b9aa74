"""Adapters: each built-in layer type, captured, then rebuilt from the extracted tensors by plain torch code.

For every sub-block the test recomputes the captured module's output from ``X``, the weights, biases and
masks the adapter read (float64, written here without curvwatch), and compares it with what the real module
produced; ``grad_output`` is compared with the gradient retained on that same output.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvwatch.adapters import (
    ADAPTERS,
    BlockSpec,
    activation_name,
    adapter_for,
    find_blocks,
    register_adapter,
)
from curvwatch.capture import Capture
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import evaluate_block, kernel_inputs
from tests.utils import TOL, assert_close_report

B, L, D, H = 3, 5, 8, 2

# --------------------------------------------------------------------------------------------------
# Plain-torch reconstructions (float64)
# --------------------------------------------------------------------------------------------------


def mha_ref(X, weights, structure):
    """The attention output from the kernel's grouped inputs (``weights``, ``structure``), written out."""
    W_Q, W_K, W_V, W_O, n_heads = weights.W_Q, weights.W_K, weights.W_V, weights.W_O, weights.n_heads
    b_Q, b_K, b_V, b_O = weights.b_Q, weights.b_K, weights.b_V, weights.b_O
    causal, key_padding_mask = structure.causal, structure.key_padding_mask
    memory, memory_padding_mask = structure.memory, structure.memory_padding_mask
    B_, L_, _ = X.shape
    source = X if memory is None else memory  # cross-attention: keys and values from the memory

    def heads(Z, W, b):
        Y = Z @ W + (0 if b is None else b)
        return Y.view(B_, Z.shape[1], n_heads, -1).transpose(1, 2)  # (B, H, L, d_K)

    Q, K, V = heads(X, W_Q, b_Q), heads(source, W_K, b_K), heads(source, W_V, b_V)
    S = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])  # (B, H, L, L_kv)
    allowed = torch.ones(B_, L_, source.shape[1], dtype=torch.bool)
    if causal:
        allowed &= torch.ones(L_, L_, dtype=torch.bool).tril()
    if memory is None and key_padding_mask is not None:
        allowed &= ~key_padding_mask[:, None, :]
    if memory_padding_mask is not None:
        allowed &= ~memory_padding_mask[:, None, :]
    A = torch.softmax(S.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    Y = (A @ V).transpose(1, 2).reshape(B_, L_, -1)  # (B, L, H d_V)
    return Y @ W_O + (0 if b_O is None else b_O)


def act_ref(Z, name):
    if name == "relu":
        return Z.clamp_min(0)
    if name == "gelu":
        return 0.5 * Z * (1 + torch.erf(Z / math.sqrt(2)))
    assert name == "gelu_tanh"
    return 0.5 * Z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (Z + 0.044715 * Z**3)))


def ffn_ref(Y, W_1, W_2, b_1, b_2, activation, residual):
    assert residual is False
    return act_ref(Y @ W_1 + (0 if b_1 is None else b_1), activation) @ W_2 + (0 if b_2 is None else b_2)


def ln_ref(X, eps, weight, bias):
    mu = X.mean(-1, keepdim=True)
    var = ((X - mu) ** 2).mean(-1, keepdim=True)
    Y = (X - mu) / torch.sqrt(var + eps)
    return Y * (1 if weight is None else weight) + (0 if bias is None else bias)


def reconstruct(block):
    kw = kernel_inputs(block, torch.float64)
    if block.spec.kind in ("attention", "cross_attention"):
        return mha_ref(kw["X"], kw["weights"], kw["structure"])
    if block.spec.kind == "ffn":
        w = kw["weights"]
        return ffn_ref(kw["Y"], w.W_1, w.W_2, w.b_1, w.b_2, kw["activation"], kw["residual"])
    kw.pop("grad_output")
    kw.pop("row_mask")
    return ln_ref(**kw)


# --------------------------------------------------------------------------------------------------
# Models: each case builds (model, run(model) -> loss, padding (B, L) bool or None, batch_first,
# {spec name suffix -> module whose output the block output is})
# --------------------------------------------------------------------------------------------------


def _gpt_case(norm, activation, attention):
    gpt = pytest.importorskip("curvwatch.models.gpt")

    def build():
        cfg = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=H, d_model=D, d_ff=16, norm=norm)
        cfg.activation, cfg.attention = activation, attention
        model = gpt.GPT(cfg).double()
        idx = torch.randint(0, 11, (B, L))
        outs = {
            "attn": lambda b: b.attn.out_proj,
            "ln_1": lambda b: b.ln_1,
            "ln_2": lambda b: b.ln_2,
            "ffn": lambda b: b.mlp.proj,
        }
        return model, lambda m: m(idx).logsumexp(-1).sum(), None, True, list(model.blocks), outs

    return build


def _torch_encoder_case(batch_first, norm_first, activation, masks):
    def build():
        layer = nn.TransformerEncoderLayer(
            D, H, dim_feedforward=16, dropout=0.0, activation=activation, batch_first=batch_first,
            norm_first=norm_first,
        )  # fmt: skip
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).double()
        src = torch.randn(B, L, D, dtype=torch.float64)
        src = src if batch_first else src.transpose(0, 1)
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[0, 3:] = True
        kpm[2, 4:] = True
        kwargs = {}
        if "kpm" in masks:
            kwargs["src_key_padding_mask"] = kpm
        if "causal" in masks:  # float -inf mask, or bool (same dtype as the padding mask)
            float_mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
            kwargs["mask"] = torch.isinf(float_mask) if "kpm" in masks else float_mask
            kwargs["is_causal"] = True
        if "bool_causal" in masks:
            kwargs["mask"] = torch.ones(L, L, dtype=torch.bool).triu(1)

        def run(m):
            out = m(src, **kwargs)
            return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()

        outs = {
            "attn": lambda b: b.self_attn,
            "ln_1": lambda b: b.norm1,
            "ln_2": lambda b: b.norm2,
            "ffn": lambda b: b.linear2,
        }
        return model, run, kpm if "kpm" in masks else None, batch_first, list(model.layers), outs

    return build


def _torch_decoder_case(batch_first, norm_first):
    def build():
        layer = nn.TransformerDecoderLayer(
            D, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        model = nn.TransformerDecoder(layer, 2).double()
        tgt = torch.randn(B, L, D, dtype=torch.float64)
        memory = torch.randn(B, L + 2, D, dtype=torch.float64)
        if not batch_first:
            tgt, memory = tgt.transpose(0, 1), memory.transpose(0, 1)
        kpm = torch.zeros(B, L, dtype=torch.bool)
        kpm[1, 2:] = True
        tgt_mask = torch.ones(L, L, dtype=torch.bool).triu(1)  # True = masked, same dtype as the padding

        def run(m):
            out = m(tgt, memory, tgt_mask=tgt_mask, tgt_key_padding_mask=kpm, tgt_is_causal=True)
            return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()

        outs = {
            "attn": lambda b: b.self_attn,
            "ln_1": lambda b: b.norm1,
            "ln_2": lambda b: b.norm2,
            "ln_3": lambda b: b.norm3,
            "ffn": lambda b: b.linear2,
            "cross_attn": lambda b: b.multihead_attn,  # its output 0, the block output
        }
        return model, run, kpm, batch_first, list(model.layers), outs

    return build


def _hf_padding(kind):
    mask = torch.ones(B, L, dtype=torch.long)
    if kind == "right":
        mask[0, 3:] = 0
    elif kind == "left":
        mask[1, :2] = 0
    return mask


def _gpt2_case(impl, padding, activation="gelu_new"):
    def build():
        tf = pytest.importorskip("transformers")
        cfg = tf.GPT2Config(
            n_layer=2, n_embd=D, n_head=H, vocab_size=11, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, activation_function=activation, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        cfg._attn_implementation = impl
        model = tf.GPT2Model(cfg).double()
        ids = torch.randint(0, 11, (B, L))
        am = _hf_padding(padding)

        def run(m):
            out = m(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
            return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()

        outs = {
            "attn": lambda b: b.attn.c_proj,
            "ln_1": lambda b: b.ln_1,
            "ln_2": lambda b: b.ln_2,
            "ffn": lambda b: b.mlp.c_proj,
        }
        return model, run, (am == 0) if padding else None, True, list(model.h), outs

    return build


def _bert_case(impl, padding, is_decoder=False):
    def build():
        tf = pytest.importorskip("transformers")
        cfg = tf.BertConfig(
            num_hidden_layers=2, hidden_size=D, num_attention_heads=H, intermediate_size=16, vocab_size=11,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            is_decoder=is_decoder,
        )  # fmt: skip
        cfg._attn_implementation = impl
        model = tf.BertModel(cfg, add_pooling_layer=False).double()
        ids = torch.randint(0, 11, (B, L))
        am = _hf_padding(padding)

        def run(m):
            out = m(input_ids=ids, attention_mask=am).last_hidden_state
            return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()

        outs = {
            "attn": lambda b: b.attention.output.dense,
            "ln_1": lambda b: b.attention.output.LayerNorm,
            "ln_2": lambda b: b.output.LayerNorm,
            "ffn": lambda b: b.output.dense,
        }
        return model, run, (am == 0) if padding else None, True, list(model.encoder.layer), outs

    return build


CASES = {
    "gpt-pre-gelu-sdpa": _gpt_case("pre", "gelu", "sdpa"),
    "gpt-post-relu-math": _gpt_case("post", "relu", "math"),
    "torch-enc-bf-post-relu-kpm": _torch_encoder_case(True, False, "relu", ("kpm",)),
    "torch-enc-lf-pre-gelu-causal": _torch_encoder_case(False, True, "gelu", ("causal",)),
    "torch-enc-bf-pre-tanh-boolcausal": _torch_encoder_case(True, True, nn.GELU("tanh"), ("bool_causal",)),
    "torch-enc-lf-post-gelu-kpm-causal": _torch_encoder_case(False, False, F.gelu, ("kpm", "causal")),
    "torch-dec-bf-post": _torch_decoder_case(True, False),
    "torch-dec-lf-pre": _torch_decoder_case(False, True),
    "gpt2-eager-right": _gpt2_case("eager", "right"),
    "gpt2-sdpa-left": _gpt2_case("sdpa", "left"),
    "gpt2-sdpa-nopad-relu": _gpt2_case("sdpa", None, "relu"),
    "bert-eager-right": _bert_case("eager", "right"),
    "bert-sdpa-nopad": _bert_case("sdpa", None),
    "bert-sdpa-decoder-right": _bert_case("sdpa", "right", is_decoder=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reconstruct_block_outputs_and_gradients(case):
    model, run, padding, batch_first, layers, outs = CASES[case]()
    specs = find_blocks(model)
    assert [s.name for s in specs[: len(outs)]] == [f"layer0/{p}" for p in outs]
    assert len(specs) == len(outs) * len(layers)

    seen = {}

    def keep_output(key, module, args, output):
        out = output if isinstance(output, torch.Tensor) else output[0]
        out.retain_grad()
        seen.setdefault(key, out)

    handles = [
        getter(layer).register_forward_hook(lambda m, a, o, key=(i, part): keep_output(key, m, a, o))
        for i, layer in enumerate(layers)
        for part, getter in outs.items()
    ]
    try:
        with Capture(specs, max_tokens=B * L) as capture:
            run(model).backward()
    finally:
        for h in handles:
            h.remove()

    rows = slice(None) if padding is None else ~padding  # padded query rows are not compared
    for block in capture.blocks():
        assert block.reason is None, f"{block.spec.name}: {block.reason}"
        actual = seen[(block.spec.layer, block.spec.name.split("/")[1])]
        expected_out = actual if batch_first else actual.transpose(0, 1)
        expected_grad = actual.grad if batch_first else actual.grad.transpose(0, 1)
        if block.spec.kind in ("attention", "cross_attention"):
            causal = case.startswith(("gpt", "torch-dec")) or "causal" in case or "decoder" in case
            assert block.params["causal"] == (causal and block.spec.kind == "attention")  # memory: not causal
            if padding is not None:  # the target's padding: its query rows leave the cross-attention's loss too
                assert torch.equal(block.inputs["key_padding_mask"], padding)
        elif padding is not None:
            assert torch.equal(block.inputs["row_mask"], ~padding)
        if block.spec.kind == "ffn" and case.startswith("gpt2"):
            assert block.params["activation"] == ("relu" if "relu" in case else "gelu_tanh")
        assert_close_report(reconstruct(block)[rows], expected_out[rows], TOL["float64"], f"{block.spec.name} output")
        assert_close_report(block.inputs["grad_output"], expected_grad, TOL["float64"], f"{block.spec.name} grad")


def test_float32_reconstruction_within_1e5():
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=16, dropout=0.0, batch_first=True)
    X = torch.randn(B, L, D)
    specs = find_blocks(layer)
    with Capture(specs, max_tokens=100) as capture:
        out = layer.self_attn(X, X, X, need_weights=False)[0]
        out.sum().backward()
    block = capture.blocks()[0]
    assert block.inputs["X"].dtype == torch.float32
    assert_close_report(reconstruct(block), out, 1e-5, "attn float32")


def test_unsupported_activation_and_mask_are_reported():
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=16, dropout=0.0, activation=F.silu, batch_first=True)
    window = torch.ones(L, L, dtype=torch.bool).triu(1) | torch.ones(L, L, dtype=torch.bool).tril(-2)
    with Capture(find_blocks(layer), max_tokens=100) as capture:
        layer(torch.randn(B, L, D), src_mask=window).sum().backward()
    reasons = {b.spec.name: b.reason for b in capture.blocks()}
    assert "neither causal nor empty" in reasons["layer0/attn"]
    with pytest.raises(RuntimeError, match="neither causal nor empty"):
        evaluate_block(capture.blocks()[0],
            lanczos=Lanczos(tol=1e-6, max_iter=10, max_basis=None, warn=False), dtype=torch.float64
        )
    with pytest.raises(ValueError, match="silu"):
        activation_name(F.silu)


def test_find_blocks_error_is_short_and_says_the_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError) as err:
        find_blocks(model)
    msg = str(err.value)
    for part in (
        "no known Transformer layer in Sequential: it holds only Linear x2, ReLU x1",
        "curvwatch.describe_layer",
        "blocks=[BlockSpec",
    ):
        assert part in msg, part
    assert "describe_layer(Sequential" not in msg  # a container is no layer to describe
    assert len(msg) < 600 and msg.count("\n") <= 3


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)


@pytest.mark.parametrize(
    "model, classes",
    [
        (_MLP(), ("_MLP", "Linear x2", "ReLU x1")),
        (nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 2)), ("Sequential", "Linear x2", "GELU x1")),
        (nn.Sequential(_MLP(), _MLP()), ("Sequential", "_MLP")),
    ],
    ids=["mlp", "sequential", "repeated"],
)
def test_no_layer_message_names_only_classes_the_model_has(model, classes):
    """A model without a Transformer layer is told about its own classes, never about a placeholder class."""
    with pytest.raises(ValueError) as err:
        find_blocks(model)
    msg = str(err.value)
    for name in classes:
        assert name in msg, (name, msg)
    own = {type(m).__name__ for m in model.modules()}
    described = re.findall(r"describe_layer\((\w+)", msg)
    assert all(name in own for name in described), (described, own)
    assert "MyLayer" not in msg


def test_find_blocks_validates_explicit_specs():
    layer = nn.TransformerEncoderLayer(D, H, dim_feedforward=16)
    specs = find_blocks(layer)
    assert find_blocks(layer, specs[:2]) == specs[:2]
    with pytest.raises(ValueError, match="Duplicate"):
        find_blocks(layer, [specs[0], specs[0]])
    with pytest.raises(ValueError, match="not a submodule"):
        find_blocks(nn.Linear(2, 2), specs[:1])
    bad = BlockSpec("x", 0, "mlp", layer.linear1, specs[0].adapter, layer)
    with pytest.raises(ValueError, match="Invalid kind='mlp'"):
        find_blocks(layer, [bad])
    with pytest.raises(ValueError, match="Invalid blocks='all'"):
        find_blocks(layer, "all")


def test_register_adapter_and_exact_type_match(monkeypatch):
    monkeypatch.setattr("curvwatch.adapters.ADAPTERS", dict(ADAPTERS))

    class MyLayer(nn.TransformerEncoderLayer):
        pass

    model = nn.ModuleList([MyLayer(D, H, dim_feedforward=16)])
    with pytest.raises(ValueError, match="MyLayer"):
        find_blocks(model)
    register_adapter(MyLayer, adapter_for(nn.TransformerEncoderLayer))
    assert [s.name for s in find_blocks(model)][-1] == "layer0/ffn"
    with pytest.raises(TypeError, match="module_type"):
        register_adapter(int, adapter_for(nn.TransformerEncoderLayer))
    with pytest.raises(TypeError, match="adapter"):
        register_adapter(MyLayer, object())


def test_activation_names():
    pytest.importorskip("transformers")
    from transformers.activations import ACT2FN

    assert activation_name(ACT2FN["gelu_new"]) == "gelu_tanh"
    assert activation_name(ACT2FN["gelu_pytorch_tanh"]) == "gelu_tanh"
    assert activation_name(ACT2FN["gelu"]) == "gelu"
    assert activation_name(ACT2FN["relu"]) == "relu"
    assert activation_name(nn.GELU()) == "gelu"
    with pytest.raises(ValueError, match="not supported"):
        activation_name(ACT2FN["quick_gelu"])


def test_decoder_cross_attention_is_monitored_and_matches_the_reference():
    """nn.TransformerDecoderLayer's multihead_attn (queries from the target, keys and values from the memory, with
    memory padding) is its own cross_attention block; its norms equal the torch.func ground truth."""
    from curvwatch import reference as ref
    from curvwatch.closed_form.settings import EXACT

    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(D, H, dim_feedforward=16, dropout=0.0, batch_first=True).double()
    tgt, memory = torch.randn(B, L, D, dtype=torch.float64), torch.randn(B, L + 2, D, dtype=torch.float64)
    padded = torch.zeros(B, L + 2, dtype=torch.bool)
    padded[1, -3:] = True
    specs = find_blocks(layer)
    assert [s.name for s in specs] == ["layer0/attn", "layer0/ln_1", "layer0/ln_2", "layer0/ln_3", "layer0/ffn",
                                       "layer0/cross_attn"]  # fmt: skip
    with Capture(specs, max_tokens=100) as capture:
        layer(tgt, memory, memory_key_padding_mask=padded).square().sum().backward()
    cross = capture.blocks()[-1]
    assert cross.reason is None and torch.equal(cross.inputs["memory_padding_mask"], padded)
    torch.testing.assert_close(cross.inputs["memory"], memory)
    out = evaluate_block(cross, lanczos=EXACT, dtype=torch.float64)
    expected = ref.dense_to_norms(ref.multi_head_attention_blocks(**kernel_inputs(cross, torch.float64)))
    common = sorted(k for k in set(out) & set(expected) if k.split("/")[1] in ("QQ", "KK", "VV"))
    assert len(common) == 3 * 3 * H
    for key in common:
        assert_close_report(out[key], expected[key], TOL["float64"], key, atol=1e-12)
