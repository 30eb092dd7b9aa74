"""Adapters of litgpt, Hugging Face LLaMA-style/GPT-NeoX/ViT/BART and nanoGPT-style layers, checked by recomputation.

For every sub-block of every tiny model of ``tests/zoo.py`` the test captures ``X``, the weights and the masks the
adapter reads (rotary tables, sliding window, padding, memory), recomputes the sub-block's output with the plain
torch reference forwards below (float64, written here without curvwatch) and compares it with the output of the
real module; ``grad_output`` is compared with the gradient retained on that output. A wrong head layout, GQA
grouping, rotary layout/width, window, scale, norm offset or bias shows up as an O(1) error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvwatch.adapters import ADAPTERS, Masks, UnsupportedBlockError, find_blocks
from curvwatch.adapters import hf as hf_adapters
from curvwatch.adapters.structural import NanoGPTBlockAdapter, recognize
from curvwatch.capture import Capture
from tests import zoo
from tests.utils import TOL, assert_close_report

#: Modules that compute in float32 whatever the input dtype (every RMSNorm of litgpt and transformers casts
#: to float32; transformers' eager attention takes its softmax in float32): their float64 recomputation agrees
#: to float32 round-off only. Everything else is compared at TOL["float64"].
TOL_FLOAT32_INSIDE = 1e-6

# --------------------------------------------------------------------------------------------------
# Plain-torch reference forwards (float64)
# --------------------------------------------------------------------------------------------------


def act_ref(Z, name):
    if name == "relu":
        return Z.clamp_min(0)
    if name == "silu":
        return Z * torch.sigmoid(Z)
    if name == "gelu":
        return 0.5 * Z * (1 + torch.erf(Z / math.sqrt(2)))
    assert name == "gelu_tanh", name
    return 0.5 * Z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (Z + 0.044715 * Z**3)))


def _b(b):
    return 0 if b is None else b


def layernorm_ref(X, eps, weight, bias):
    mu = X.mean(-1, keepdim=True)
    Y = (X - mu) / torch.sqrt(((X - mu) ** 2).mean(-1, keepdim=True) + eps)
    return Y * (1 if weight is None else weight) + _b(bias)


def rmsnorm_ref(X, eps, weight, weight_offset):
    Y = X / torch.sqrt((X**2).mean(-1, keepdim=True) + eps)
    return Y if weight is None else Y * (weight_offset + weight)


def ffn_ref(X, W_1, W_2, b_1, b_2, activation, residual):
    assert residual is False
    return act_ref(X @ W_1 + _b(b_1), activation) @ W_2 + _b(b_2)


def gated_ffn_ref(X, W_gate, W_up, W_down, b_gate, b_up, b_down, activation):
    return (act_ref(X @ W_gate + _b(b_gate), activation) * (X @ W_up + _b(b_up))) @ W_down + _b(b_down)


def rope_ref(x, cos, sin, interleaved):
    """Rotate the first ``r = cos.shape[-1]`` dims of each head of ``x (B, H, L, d_K)``: ``x cos + rot(x) sin``."""
    r = cos.shape[-1]
    cos, sin = (t[None, None] if t.ndim == 2 else t[:, None] for t in (cos, sin))  # (B|1, 1, L, r)
    xr, xp = x[..., :r], x[..., r:]
    if interleaved:  # 2i pairs with 2i + 1
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:  # i pairs with i + r/2
        rot = torch.cat((-xr[..., r // 2 :], xr[..., : r // 2]), dim=-1)
    return torch.cat((xr * cos + rot * sin, xp), dim=-1)


def attention_ref(X, masks, W_Q, W_K, W_V, W_O, n_heads, n_kv_heads, b_Q, b_K, b_V, b_O, scale, qk_norm):
    """Multi-head attention with GQA, QK-norm, rotary, causal/window/padding masks, cross-attention memory."""
    B, L, _ = X.shape
    src = X if masks.memory is None else masks.memory
    L_kv, H, H_kv = src.shape[1], n_heads, n_kv_heads or n_heads
    d_K = W_Q.shape[1] // H
    Q = (X @ W_Q + _b(b_Q)).view(B, L, H, d_K).transpose(1, 2)  # (B, H, L, d_K)
    K = (src @ W_K + _b(b_K)).view(B, L_kv, H_kv, d_K).transpose(1, 2)  # (B, H_kv, L_kv, d_K)
    V = (src @ W_V + _b(b_V)).view(B, L_kv, H_kv, -1).transpose(1, 2)  # (B, H_kv, L_kv, d_V)
    if qk_norm is not None:
        if qk_norm["kind"] == "rmsnorm":
            Q = rmsnorm_ref(Q, qk_norm["eps"], qk_norm["weight_q"], qk_norm["weight_offset"])
            K = rmsnorm_ref(K, qk_norm["eps"], qk_norm["weight_k"], qk_norm["weight_offset"])
        else:
            Q = layernorm_ref(Q, qk_norm["eps"], qk_norm["weight_q"], qk_norm["bias_q"])
            K = layernorm_ref(K, qk_norm["eps"], qk_norm["weight_k"], qk_norm["bias_k"])
    if masks.rotary is not None:
        Q = rope_ref(Q, *masks.rotary, masks.rotary_interleaved)
        K = rope_ref(K, *masks.rotary, masks.rotary_interleaved)
    group = torch.arange(H) // (H // H_kv)  # query head h uses kv head h // (H / H_kv)
    K, V = K[:, group], V[:, group]  # (B, H, L_kv, .)
    S = Q @ K.transpose(-2, -1) * (d_K**-0.5 if scale is None else scale)  # (B, H, L, L_kv)
    i, j = torch.arange(L)[:, None], torch.arange(L_kv)[None, :]
    allowed = torch.ones(B, L, L_kv, dtype=torch.bool)
    if masks.causal:
        allowed &= j <= i
    if masks.window is not None:
        allowed &= i - j < masks.window
    kpm = masks.memory_padding_mask if masks.memory is not None else masks.key_padding_mask
    if kpm is not None:
        allowed &= ~kpm[:, None, :]
    A = torch.softmax(S.masked_fill(~allowed[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    Y = (A @ V).transpose(1, 2).reshape(B, L, -1)  # (B, L, H d_V)
    return Y @ W_O + _b(b_O)


def recompute(kind, X, params, masks):
    params = {k: v for k, v in params.items() if k != "causal"}
    if kind in ("attention", "cross_attention"):
        return attention_ref(X, masks, **params)
    return {"layernorm": layernorm_ref, "rmsnorm": rmsnorm_ref, "ffn": ffn_ref, "gated_ffn": gated_ffn_ref}[kind](
        X, **params
    )


# --------------------------------------------------------------------------------------------------
# Capture with our own mask and output hooks
# --------------------------------------------------------------------------------------------------


def _capture_kinds() -> set[str]:
    """The block kinds :class:`~curvwatch.capture.Capture` can turn into blocks in this tree."""
    try:
        from curvwatch.kinds import KINDS
    except ImportError:
        return {"attention", "layernorm", "ffn"}
    return set(KINDS)


@dataclass
class Record:
    X: torch.Tensor | None = None
    params: dict | None = None
    masks: Masks | None = None
    out: torch.Tensor | None = None
    reason: str | None = None


def capture(tiny):
    """Record, for every block of ``tiny``, what the adapter reads at the capture points and the real output.

    Our own hooks on ``adapter.capture_modules(spec)`` call ``read_input``/``read_params`` (input pre-hook),
    ``read_masks`` (mask pre-hook: the full :class:`Masks`, rotary tables and memory included) and keep the
    output (gradient retained). :class:`Capture` runs on the same step for the blocks whose kind it knows; its
    ``X`` and ``grad_output`` must equal ours and the real gradient.
    """
    specs = find_blocks(tiny.model)
    recs = {s.name: Record() for s in specs}
    handles = []

    def on_input(spec, module, args, kwargs):
        rec = recs[spec.name]
        if rec.X is None and rec.reason is None and torch.is_grad_enabled():
            try:
                rec.X = spec.adapter.read_input(spec, args, kwargs)
                rec.params = spec.adapter.read_params(spec)
            except UnsupportedBlockError as err:
                rec.reason = str(err)

    def on_mask(spec, module, args, kwargs):
        rec = recs[spec.name]
        if rec.masks is None and rec.reason is None and torch.is_grad_enabled():
            try:
                rec.masks = spec.adapter.read_masks(spec, args, kwargs)
            except UnsupportedBlockError as err:
                rec.reason = str(err)

    def on_output(spec, module, args, output):
        rec = recs[spec.name]
        if rec.out is None and torch.is_grad_enabled():
            rec.out = spec.adapter.read_output(spec, output)
            rec.out.retain_grad()

    for spec in specs:
        input_module, output_module, mask_module = spec.adapter.capture_modules(spec)
        for module, hook in ((input_module, on_input), (mask_module, on_mask)):
            handles.append(module.register_forward_pre_hook(partial(hook, spec), with_kwargs=True))
        handles.append(output_module.register_forward_hook(partial(on_output, spec)))
    known = [s for s in specs if s.kind in _capture_kinds()]
    try:
        with Capture(known or specs[:1], max_tokens=10**6) as cap:
            tiny.loss(tiny.model).backward()
    finally:
        for h in handles:
            h.remove()
    for block in cap.blocks() if known else []:
        rec = recs[block.spec.name]
        if rec.reason is not None:
            assert block.reason is not None, block.spec.name
            continue
        assert block.reason is None, f"{block.spec.name}: {block.reason}"
        assert torch.equal(block.inputs["X"], rec.X.detach()), block.spec.name
        assert torch.equal(block.inputs["grad_output"], rec.out.grad), block.spec.name
    return specs, recs


def _tolerance(kind, params, eager):
    f32 = kind == "rmsnorm" or (kind in ("attention", "cross_attention") and eager)
    qk = params.get("qk_norm")
    f32 = f32 or (qk is not None and qk["kind"] == "rmsnorm")
    return TOL_FLOAT32_INSIDE if f32 else TOL["float64"]


def check_block(spec, rec, padding, eager=False):
    """Recompute one block's output from what its adapter read and compare with the real output (real rows)."""
    assert rec.reason is None, f"{spec.name}: {rec.reason}"
    assert rec.X is not None and rec.masks is not None and rec.out is not None, spec.name
    if padding is None:
        assert rec.masks.key_padding_mask is None, spec.name
    else:
        assert torch.equal(rec.masks.key_padding_mask, padding), spec.name
    rows = slice(None) if padding is None else ~padding  # padded rows are not compared
    Y = recompute(spec.kind, rec.X.detach(), rec.params, rec.masks)
    tol = _tolerance(spec.kind, rec.params, eager)
    return assert_close_report(Y[rows], rec.out[rows], tol, f"{spec.name} output")


def check_recomputation(tiny, expected_parts, eager=False):
    """Assert block names/kinds of every layer, then recompute every block's output and compare."""
    specs, recs = capture(tiny)
    n = len(tiny.layers)
    assert {s.layer for s in specs} == set(range(n))
    for i in range(n):
        got = {s.name.split("/")[1]: s.kind for s in specs if s.layer == i}
        assert got == expected_parts, f"layer {i}: {got} != {expected_parts}"
    for spec in specs:
        check_block(spec, recs[spec.name], tiny.padding, eager)
        assert spec.adapter.unmonitored(tiny.layers[spec.layer]) == []
    return specs, recs


LLAMA_PARTS = {"attn": "attention", "ln_1": "rmsnorm", "ln_2": "rmsnorm", "ffn": "gated_ffn"}
NEOX_PARTS = {"attn": "attention", "ln_1": "layernorm", "ln_2": "layernorm", "ffn": "ffn"}
SHARED_NORM_PARTS = {"attn": "attention", "ln_1": "layernorm", "ffn": "ffn"}

# --------------------------------------------------------------------------------------------------
# litgpt
# --------------------------------------------------------------------------------------------------

LITGPT_CASES = {
    "llama3": LLAMA_PARTS,
    "llama2": LLAMA_PARTS,
    "mistral": LLAMA_PARTS,
    "qwen2.5": LLAMA_PARTS,
    "qwen3": LLAMA_PARTS,
    "gemma": LLAMA_PARTS,
    "gemma3": {**LLAMA_PARTS, "ln_post_attn": "rmsnorm", "ln_post_ffn": "rmsnorm"},
    "pythia": NEOX_PARTS,
    "phi2": SHARED_NORM_PARTS,
    "falcon": SHARED_NORM_PARTS,
    "interleave": LLAMA_PARTS,
}


@pytest.mark.parametrize("family", list(LITGPT_CASES))
def test_litgpt_blocks_recompute(family):
    tiny = zoo.litgpt_gpt(family)
    _, recs = check_recomputation(tiny, LITGPT_CASES[family])
    cfg = tiny.model.config
    attn0, masks0, masks1 = recs["layer0/attn"].params, recs["layer0/attn"].masks, recs["layer1/attn"].masks
    assert attn0["n_kv_heads"] == (None if cfg.n_query_groups == cfg.n_head else cfg.n_query_groups)
    assert masks0.causal and masks0.rotary[0].shape == (zoo.L, cfg.rope_n_elem)
    expected = {"mistral": (3, 3), "gemma3": (3, None)}.get(family, (None, None))
    assert (masks0.window, masks1.window) == expected
    assert masks0.rotary_interleaved == (family == "interleave")
    if family == "gemma3":
        assert attn0["scale"] == pytest.approx(256**-0.5) and attn0["qk_norm"]["weight_offset"] == 1.0
        assert recs["layer0/ln_1"].params["weight_offset"] == 1.0
    if family in ("pythia", "phi2"):
        assert cfg.rope_n_elem < cfg.head_size
    if family == "qwen2.5":
        assert attn0["b_Q"] is not None and attn0["b_O"] is None


def test_litgpt_rotary_tables_are_the_calls():
    """The tables read are those the block got (litgpt slices its cache to the sequence length per call)."""
    tiny = zoo.litgpt_gpt("llama3")
    _, recs = capture(tiny)
    cos, sin = recs["layer0/attn"].masks.rotary
    assert cos.shape == (zoo.L, 4)
    assert torch.equal(cos, tiny.model.cos[: zoo.L]) and torch.equal(sin, tiny.model.sin[: zoo.L])


def test_litgpt_unsupported_settings_are_reported():
    gemma2 = zoo.litgpt_gpt("gemma2")
    _, recs = capture(gemma2)
    assert "softcapping" in recs["layer0/attn"].reason
    assert recs["layer0/ffn"].reason is None

    olmo = zoo.litgpt_gpt("olmo2")
    specs, recs = capture(olmo)
    assert {s.name.split("/")[1] for s in specs if s.layer == 0} == {"attn", "ln_post_attn", "ln_post_ffn", "ffn"}
    assert "norm_qk_type='olmo2'" in recs["layer0/attn"].reason

    mixtral = zoo.litgpt_gpt("mixtral")
    specs = find_blocks(mixtral.model)
    assert "layer0/ffn" not in {s.name for s in specs}
    parts = dict(specs[0].adapter.unmonitored(mixtral.layers[0]))
    assert "mixture-of-experts" in parts["mlp"]


def test_litgpt_kv_cache_is_reported():
    tiny = zoo.litgpt_gpt("llama3")
    tiny.model.set_kv_cache(batch_size=zoo.B)
    specs = [s for s in find_blocks(tiny.model) if s.kind == "attention"]
    idx = torch.randint(0, zoo.VOCAB, (zoo.B, 2))
    with Capture(specs, max_tokens=100) as cap:
        tiny.model(idx, input_pos=torch.arange(2)).sum().backward()
    assert "input_pos" in cap.blocks()[0].reason


# --------------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------------

HF_CASES = {
    "llama-sdpa-right": (lambda: zoo.hf_decoder("llama", padding="right"), LLAMA_PARTS, False),
    # eager + left padding in float64 gives NaN rows in transformers itself (fully masked rows): right padding
    "llama-eager-right": (lambda: zoo.hf_decoder("llama", impl="eager", padding="right"), LLAMA_PARTS, True),
    "llama-bias-sdpa-cache": (lambda: zoo.hf_decoder("llama-bias", use_cache=True), LLAMA_PARTS, False),
    "mistral-sdpa-right": (lambda: zoo.hf_decoder("mistral", padding="right"), LLAMA_PARTS, False),
    "mistral-eager-nopad": (lambda: zoo.hf_decoder("mistral", impl="eager"), LLAMA_PARTS, True),
    "qwen2-sdpa-left": (lambda: zoo.hf_decoder("qwen2", padding="left"), LLAMA_PARTS, False),
    "qwen3-sdpa-right": (lambda: zoo.hf_decoder("qwen3", padding="right"), LLAMA_PARTS, False),
    "gemma-sdpa-nopad": (lambda: zoo.hf_decoder("gemma"), LLAMA_PARTS, False),
    "gemma-eager-right": (lambda: zoo.hf_decoder("gemma", impl="eager", padding="right"), LLAMA_PARTS, True),
    "neox-parallel-sdpa-right": (lambda: zoo.hf_gpt_neox(padding="right"), NEOX_PARTS, False),
    "neox-sequential-eager-right": (
        lambda: zoo.hf_gpt_neox(parallel=False, rotary=0.5, impl="eager", padding="right"),
        NEOX_PARTS,
        True,
    ),
    "neox-parallel-sdpa-left": (lambda: zoo.hf_gpt_neox(padding="left"), NEOX_PARTS, False),
    "vit-sdpa": (lambda: zoo.hf_vit(), NEOX_PARTS, False),
    "vit-eager": (lambda: zoo.hf_vit(impl="eager"), NEOX_PARTS, True),
}

BART_ENCODER = {"attn": "attention", "ln_1": "layernorm", "ln_2": "layernorm", "ffn": "ffn"}
BART_DECODER = {**BART_ENCODER, "cross_attn": "cross_attention", "ln_3": "layernorm"}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hf_blocks_recompute(case):
    build, parts, eager = HF_CASES[case]
    tiny = build()
    _, recs = check_recomputation(tiny, parts, eager=eager)
    masks0, masks1, attn = recs["layer0/attn"].masks, recs["layer1/attn"].masks, recs["layer0/attn"].params
    windows = {"mistral": (3, 3), "qwen2": (None, 3)}.get(case.split("-")[0], (None, None))
    assert (masks0.window, masks1.window) == windows
    if case.startswith(("llama", "mistral", "qwen")):
        assert attn["n_kv_heads"] == 2 and masks0.causal
    if case.startswith("qwen3"):
        assert attn["qk_norm"]["kind"] == "rmsnorm" and attn["qk_norm"]["weight_offset"] == 0.0
    if case.startswith("gemma"):
        assert attn["n_kv_heads"] == 1 and recs["layer0/ln_1"].params["weight_offset"] == 1.0
        assert recs["layer0/ffn"].params["activation"] == "gelu_tanh"
    if case.startswith("neox"):
        assert masks0.rotary[0].shape[-1] == (2 if "parallel" in case else 4) < 8  # of d_K = 8
    if case.startswith("vit"):
        assert not masks0.causal and masks0.rotary is None


@pytest.mark.parametrize(
    "impl, padding, memory_padding", [("sdpa", "right", "left"), ("eager", None, "right"), ("sdpa", None, None)]
)
def test_bart_blocks_recompute(impl, padding, memory_padding):
    tiny = zoo.hf_bart(impl=impl, padding=padding, memory_padding=memory_padding)
    specs, recs = capture(tiny)
    assert [s.name for s in specs] == [
        "layer0/attn", "layer0/ln_1", "layer0/ln_2", "layer0/ffn",
        "layer1/attn", "layer1/ln_1", "layer1/cross_attn", "layer1/ln_2", "layer1/ln_3", "layer1/ffn",
    ]  # fmt: skip
    assert {s.name: s.kind for s in specs if s.layer == 1} == {f"layer1/{k}": v for k, v in BART_DECODER.items()}
    for spec in specs:
        m = recs[spec.name].masks
        own_padding = tiny.memory_padding if spec.layer == 0 else tiny.padding  # the encoder's, the decoder's
        check_block(spec, recs[spec.name], own_padding)  # BART's eager softmax keeps the input dtype: exact
        if spec.kind == "attention":
            assert m.causal == (spec.layer == 1)
        if spec.kind == "cross_attention":
            assert not m.causal and m.memory.shape == (zoo.B, zoo.L + 1, 16)
            if tiny.memory_padding is None:
                assert m.memory_padding_mask is None
            else:
                assert torch.equal(m.memory_padding_mask, tiny.memory_padding)
    for layer in tiny.layers:
        assert ADAPTERS["transformers.models.bart.modeling_bart:BartEncoderLayer"].unmonitored(layer) == []


def test_hf_kv_cache_with_past_tokens_is_reported():
    tiny = zoo.hf_decoder("llama", use_cache=True)
    tf = pytest.importorskip("transformers")
    ids = torch.randint(1, zoo.VOCAB, (zoo.B, 4))
    with torch.no_grad():
        cache = tiny.model(input_ids=ids, use_cache=True).past_key_values
    assert isinstance(cache, tf.DynamicCache) and cache.get_seq_length() == 4
    specs = [s for s in find_blocks(tiny.model) if s.kind == "attention"]
    with Capture(specs, max_tokens=100) as cap:
        tiny.model(input_ids=ids[:, :1], cache=cache, use_cache=True).last_hidden_state.sum().backward()
    assert "KV cache" in cap.blocks()[0].reason


def test_hf_attention_dropout_in_training_is_reported():
    tiny = zoo.hf_decoder("llama", attention_dropout=0.1)
    tiny.model.train()
    _, recs = capture(tiny)
    assert "dropout p=0.1" in recs["layer0/attn"].reason
    tiny.model.eval()
    _, recs = capture(tiny)
    assert recs["layer0/attn"].reason is None


def test_hf_mask_parser_rejects_what_it_cannot_model():
    attn = nn.Module()
    Lq = 5
    tril = torch.ones(Lq, Lq, dtype=torch.bool).tril()
    docs = tril.clone()
    docs[3:, :3] = False  # two documents packed in one sequence
    with pytest.raises(UnsupportedBlockError, match="per-document"):
        hf_adapters._self_masks(attn, docs[None, None].expand(2, 1, Lq, Lq), "test", True)
    alibi = torch.zeros(2, 1, Lq, Lq, dtype=torch.float64) - torch.arange(Lq, dtype=torch.float64)
    with pytest.raises(UnsupportedBlockError, match="additive biases"):
        hf_adapters._self_masks(attn, alibi, "test", True)
    window = tril & ~torch.ones(Lq, Lq, dtype=torch.bool).tril(-2)
    got = hf_adapters._self_masks(attn, window[None, None].expand(2, 1, Lq, Lq), "test", True)
    assert (got.causal, got.window, got.key_padding_mask) == (True, 2, None)


def test_hf_unknown_parts_are_unmonitored():
    tiny = zoo.hf_decoder("llama")
    layer = tiny.layers[0]
    layer.adapter_gate = nn.Linear(2, 2)
    adapter = ADAPTERS["transformers.models.llama.modeling_llama:LlamaDecoderLayer"]
    assert [p for p, _ in adapter.unmonitored(layer)] == ["adapter_gate"]


# --------------------------------------------------------------------------------------------------
# RMSNorm eps and offsets, where eps dominates (small inputs)
# --------------------------------------------------------------------------------------------------


def _rmsnorms():
    lit = zoo.litgpt_gpt("gemma3")
    hf_gemma, hf_qwen3 = zoo.hf_decoder("gemma"), zoo.hf_decoder("qwen3")
    return [
        ("litgpt gemma3 norm_1", lit.layers[0].norm_1, 1.0),
        ("litgpt gemma3 norm_q", lit.layers[0].attn.norm_q, 1.0),
        ("hf gemma input_layernorm", hf_gemma.layers[0].input_layernorm, 1.0),
        ("hf qwen3 q_norm", hf_qwen3.layers[0].self_attn.q_norm, 0.0),
        ("torch RMSNorm", nn.RMSNorm(16, eps=1e-4).double(), 0.0),
    ]


def test_rmsnorm_eps_and_offset_are_read_exactly():
    from curvwatch.adapters._shared import rmsnorm_params

    for name, module, offset in _rmsnorms():
        p = rmsnorm_params(module)
        assert p["weight_offset"] == offset, name
        n = p["weight"].shape[0]
        X = 1e-3 * torch.randn(4, n, dtype=torch.float64)  # mean square ~1e-6: eps matters at O(1)
        with torch.no_grad():
            assert_close_report(rmsnorm_ref(X, **p), module(X), TOL_FLOAT32_INSIDE, name)
            wrong = rmsnorm_ref(X, p["eps"] * 10, p["weight"], p["weight_offset"])
            assert (wrong - module(X)).norm() > 1e-3 * module(X).norm(), f"{name}: eps does not matter here"


# --------------------------------------------------------------------------------------------------
# nanoGPT-style, by structure
# --------------------------------------------------------------------------------------------------

NANO_CASES = {
    "flash-bias-nanoLN": dict(flash=True, bias=True),
    "tril-nobias-nanoLN": dict(flash=False, bias=False),
    "flash-torchLN": dict(flash=True, torch_ln=True),
}


@pytest.mark.parametrize("case", list(NANO_CASES))
def test_nanogpt_blocks_recompute(case):
    tiny = zoo.nanogpt(**NANO_CASES[case])
    assert isinstance(recognize(tiny.layers[0]), NanoGPTBlockAdapter)
    assert all(key != "tests.zoo:Block" for key in ADAPTERS)  # found by structure, not by the table
    _, recs = check_recomputation(tiny, NEOX_PARTS)
    assert recs["layer0/ffn"].params["activation"] == "gelu"
    assert recs["layer0/ln_1"].params["eps"] == 1e-5


def test_nanogpt_recognition_looks_at_structure():
    layer = zoo.nanogpt().layers[0]
    assert recognize(layer.attn) is None and recognize(layer.mlp) is None
    broken = zoo.nanogpt().layers[0]
    broken.attn.c_attn = nn.Linear(16, 32)  # not 3 d outputs
    assert recognize(broken) is None

    class NonCausal(zoo.NanoSelfAttention):
        def forward(self, x):  # bidirectional: no evidence of causality
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            return self.c_proj(F.scaled_dot_product_attention(q, k, v))

    bidirectional = zoo.nanogpt().layers[0]
    bidirectional.attn = NonCausal(16, 4, 16, True, True, 0.0)
    assert recognize(bidirectional) is None


def test_nanogpt_dropout_in_training_is_reported():
    tiny = zoo.nanogpt(dropout=0.1)
    tiny.model.train()
    _, recs = capture(tiny)
    assert "dropout p=0.1" in recs["layer0/attn"].reason


class Block(nn.Module):
    """Named like litgpt's, nanoGPT's and curvwatch's layers, but none of them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


def test_no_layer_message_names_the_likeliest_layer_and_describe_layer():
    """Short (issue 25: it was a wall of module paths and known layer types): the repeated layer type by name, and the
    describe_layer call to write for it, with the dotted names of its submodules."""
    with pytest.raises(ValueError) as err:
        find_blocks(nn.Sequential(Block(), Block()))
    msg = str(err.value)
    for part in ("no known Transformer layer in Sequential", "most repeated module with submodules: Block",
                 "describe_layer(Block", "blocks=[BlockSpec"):  # fmt: skip
        assert part in msg, (part, msg)
    assert len(msg) < 600 and msg.count("\n") <= 3


def test_zoo_builds_fast_and_seeded():
    import time

    zoo.litgpt_gpt("llama3")  # imports
    zoo.hf_decoder("llama")
    for build in (lambda: zoo.litgpt_gpt("gemma3"), lambda: zoo.hf_decoder("qwen3"), zoo.hf_bart, zoo.nanogpt):
        t = time.perf_counter()
        a = build()
        assert time.perf_counter() - t < 1.0
        b = build()
        assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))
