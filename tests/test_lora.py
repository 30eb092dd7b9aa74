"""Low-rank adapters: the closed forms read the weight the forward uses, the set-up table says so, the rest is refused.

A model with adapters computes what its merged copy computes, so every curvature key of a monitored step must be the
same on both (:mod:`benchmarks.lora_merged` builds, trains and compares them): peft LoRA on Hugging Face Llama
(``q_proj``/``v_proj`` and every projection) and GPT-2 (``Conv1D``, ``fan_in_fan_out``, ``lora_bias``), DoRA,
litgpt's LoRA GPT (fused ``qkv``), and a wrapper of one's own through the ``lowrank_parts`` protocol. Wrappers that are
not understood (another peft tuner, quantised weights, an unknown wrapper) leave their blocks out with the reason,
named in the set-up table, and adapter dropout in training leaves the block out of that step.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from benchmarks.lora_merged import VOCAB, Adapted, compare, hf_adapted, litgpt_adapted, step_keys, with_peft
from curvwatch import Sharpness
from curvwatch.adapters import find_blocks
from curvwatch.adapters.projections import UnsupportedWrapperError, read_projection
from curvwatch.adapters.updates import kernel_updates
from curvwatch.models.gpt import GPT, GPTConfig
from curvwatch.report import weight_notes

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

#: keys of a LoRA model against those of its merged copy: float64 closed forms and Lanczos to 1e-9 on both, so the
#: differences are round-off (1e-3 would pass a key one part in a thousand off)
RTOL = 1e-6

SMALL = dict(steps=3, batch=2, length=8, sharpness=Sharpness(samples=4))


# --------------------------------------------------------------------------------------------------
# A wrapper of one's own, through the protocol
# --------------------------------------------------------------------------------------------------


class MyLoRA(nn.Module):
    """``base(x) + s (x A^T) B^T`` with the ``lowrank_parts`` protocol."""

    def __init__(self, base: nn.Linear, r: int = 3, alpha: float = 6.0):
        super().__init__()
        self.base, self.s = base, alpha / r
        self.A = nn.Parameter(0.3 * torch.randn(r, base.in_features, dtype=base.weight.dtype))
        self.B = nn.Parameter(0.3 * torch.randn(base.out_features, r, dtype=base.weight.dtype))

    def forward(self, x):
        return self.base(x) + self.s * (x @ self.A.T) @ self.B.T

    def lowrank_parts(self):
        return self.base, [(self.A, self.B, self.s)]


def _gpt_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def protocol_adapted(hidden: int = 32) -> Adapted:
    """curvwatch's GPT with ``q_proj`` and ``v_proj`` of every layer in :class:`MyLoRA`, the rest frozen."""
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, d_model=hidden, attention="math"))
    model.requires_grad_(False)
    for block in model.blocks:
        block.attn.q_proj, block.attn.v_proj = MyLoRA(block.attn.q_proj), MyLoRA(block.attn.v_proj)

    def merge(m: nn.Module) -> nn.Module:
        out = copy.deepcopy(m)
        for block in out.blocks:
            for name in ("q_proj", "v_proj"):
                w = getattr(block.attn, name)
                with torch.no_grad():
                    w.base.weight += w.s * w.B @ w.A
                setattr(block.attn, name, w.base)
        return out

    return Adapted(model, merge, _gpt_loss)


# --------------------------------------------------------------------------------------------------
# Every key as the merged model's
# --------------------------------------------------------------------------------------------------

CASES = {
    "llama-qv": lambda: hf_adapted("llama", "qv", hidden=32),
    "llama-all-linear": lambda: hf_adapted("llama", "all-linear", hidden=32),
    "llama-dora": lambda: hf_adapted("llama", "qv", dora=True, hidden=32),
    "gpt2-conv1d-lora-bias": lambda: hf_adapted("gpt2", "all-linear", hidden=32, lora_bias=True),
    "litgpt-qv": lambda: litgpt_adapted("qv", hidden=32),
    "litgpt-all-linear": lambda: litgpt_adapted("all-linear", hidden=32),
    "protocol": protocol_adapted,
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_key_equals_the_merged_models(case):
    if case.startswith("litgpt"):
        pytest.importorskip("litgpt")
    out = compare(CASES[case](), **SMALL)
    assert out["curvature_keys"] > 100, out
    assert not out["only_merged"] and not out["only_adapted"], out
    assert out["max_rel"] <= RTOL, f"{case}: worst {out['worst']}"


def test_the_set_up_table_names_the_adapters_and_the_blocks_a_step_left_out():
    out = compare(hf_adapted("llama", "qv", hidden=32), frozen_input=True, **SMALL)
    status = {(r["layer"], r["part"]): r["status"] for r in out["coverage"]}
    assert status["0", "attn"] == "monitored (base + LoRA r=4 on self_attn.q_proj, self_attn.v_proj; merged view)"
    assert status["1", "ffn"] == "monitored"
    # the embeddings are frozen: the first layer's input norm gets no gradient, and the table says so
    assert status["0", "ln_1"].startswith("monitored; left out at step 0: the output of LlamaRMSNorm does not require")
    assert out["only_merged"] and all("/layer0/ln_1/" in k for k in out["only_merged"])
    assert out["max_rel"] <= RTOL


def test_stability_ratios_of_adapted_blocks_are_withheld_not_read_from_the_frozen_weights():
    adapted = hf_adapted("llama", "all-linear", hidden=32)
    model = adapted.model.double()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 8))
    adapted.loss(model, ids).backward()
    optimizer.step()
    optimizer.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys, _ = step_keys(model, adapted.loss, ids, optimizer, sharpness=Sharpness(samples=4))
    assert any("ratio for 'layer0/attn'" in str(w.message) for w in caught)
    assert [k for k in keys if "/sharpness/" in k] and not [k for k in keys if "stability/" in k]


# --------------------------------------------------------------------------------------------------
# What is not understood is left out, with the reason
# --------------------------------------------------------------------------------------------------


def _tiny_llama(dtype=torch.float64):
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).to(dtype)


def _one_step(model, **settings):
    ids = torch.randint(0, VOCAB, (2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys, monitor = step_keys(
            model, lambda m, x: m(input_ids=x, labels=x).loss, ids, torch.optim.SGD(model.parameters(), lr=0.1),
            **{"sharpness": False, **settings},
        )  # fmt: skip
    status = {(r["layer"], r["part"]): r["status"] for r in monitor.coverage}
    return keys, status, [str(w.message) for w in caught]


def test_another_peft_tuner_is_refused():
    config = peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    model = with_peft(_tiny_llama(), config)
    keys, status, _ = _one_step(model)
    for part in ("attn", "ffn"):
        assert status["0", part].startswith("not monitored: ") and "peft tuner" in status["0", part], status
        assert not [k for k in keys if f"/layer0/{part}/" in k]
    assert status["0", "ln_2"] == "monitored" and [k for k in keys if "/layer0/ln_2/" in k]


class FakeInt8Linear(nn.Linear):
    """A stand-in for a quantised linear layer: an int8 weight dequantised in the forward."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=False)
        self.scale = float(linear.weight.detach().abs().max()) / 127
        q = (linear.weight / self.scale).round().to(torch.int8)
        self.weight = nn.Parameter(q, requires_grad=False)

    def forward(self, x):
        return x @ (self.weight.to(x.dtype) * self.scale).T


def test_a_quantised_weight_is_refused():
    model = _tiny_llama()
    model.model.layers[1].self_attn.v_proj = FakeInt8Linear(model.model.layers[1].self_attn.v_proj)
    keys, status, _ = _one_step(model)
    assert status["1", "attn"].startswith("not monitored: FakeInt8Linear holds a quantised weight (a torch.int8")
    assert not [k for k in keys if "/layer1/attn/" in k] and [k for k in keys if "/layer0/attn/" in k]


def test_bitsandbytes_4bit_is_refused_with_and_without_lora():
    bnb = pytest.importorskip("bitsandbytes")
    lin = nn.Linear(32, 32, bias=False)
    q = bnb.nn.Linear4bit(32, 32, bias=False, compute_dtype=torch.float32)
    q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False)
    q = q.to("cpu")  # quantises on CPU
    with pytest.raises(UnsupportedWrapperError, match="bitsandbytes 4-bit"):
        read_projection(q)
    model = _tiny_llama(torch.float32)
    model.model.layers[0].self_attn.q_proj = q
    lora = with_peft(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))  # LoRA around the 4-bit layer
    with pytest.raises(UnsupportedWrapperError, match="bitsandbytes 4-bit"):
        read_projection(lora.base_model.model.model.layers[0].self_attn.q_proj)
    notes = weight_notes(find_blocks(lora))
    assert notes["layer0/attn"].startswith("not monitored: Linear4bit holds a quantised weight (bitsandbytes 4-bit)")
    assert notes["layer1/attn"] == "monitored (base + LoRA r=2 on self_attn.q_proj; merged view)"


class OpaqueAdapter(nn.Module):
    """A wrapper without the protocol: a base layer and parameters of its own."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer, self.gain = base, nn.Parameter(torch.ones(base.out_features, dtype=base.weight.dtype))

    def forward(self, x):
        return self.base_layer(x) * self.gain

    @property
    def weight(self):  # what a reader of .weight would (wrongly) take
        return self.base_layer.weight


def test_an_unknown_wrapper_is_refused():
    model = _tiny_llama()
    model.model.layers[0].mlp.up_proj = OpaqueAdapter(model.model.layers[0].mlp.up_proj)
    keys, status, _ = _one_step(model)
    assert status["0", "ffn"].startswith("not monitored: OpaqueAdapter (") and "does not read" in status["0", "ffn"]
    assert not [k for k in keys if "/layer0/ffn/" in k] and [k for k in keys if "/layer1/ffn/" in k]


def test_adapter_dropout_in_training_leaves_the_block_out_of_the_step():
    model = with_peft(_tiny_llama(), peft.LoraConfig(r=2, target_modules=["v_proj"], lora_dropout=0.1))
    model.train()
    keys, status, messages = _one_step(model)
    assert status["0", "attn"].startswith("monitored (base + LoRA r=2 on self_attn.v_proj; merged view); left out")
    assert "dropout p=0.1 to the adapter's input" in status["0", "attn"]
    assert not [k for k in keys if "/layer0/attn/" in k]
    assert any("leaves block 'layer0/attn' out" in m for m in messages)
    model.eval()  # no dropout: read
    keys, status, _ = _one_step(model)
    assert [k for k in keys if "/layer0/attn/" in k] and "left out" not in status["0", "attn"]


def test_merged_and_disabled_peft_adapters_read_the_weight_the_forward_uses():
    model = with_peft(_tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    x = torch.randn(5, 32, dtype=torch.float64)
    for state in ("active", "disabled", "merged"):
        if state == "disabled":
            layer.enable_adapters(False)
        if state == "merged":
            layer.enable_adapters(True)
            layer.merge()
        p = read_projection(layer)
        torch.testing.assert_close(x @ p.W, layer(x), rtol=1e-12, atol=1e-12, msg=state)


# --------------------------------------------------------------------------------------------------
# Where each update lands in the kernels' arguments (the chain rule in the adapters' parameters reads it)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["llama-all-linear", "gpt2-conv1d-lora-bias", "litgpt-qv", "protocol"])
def test_kernel_updates_rebuild_the_adapted_arguments(case):
    if case.startswith("litgpt"):
        pytest.importorskip("litgpt")
    model = CASES[case]().model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or name.endswith(".B"):
                p.normal_()
    base = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "lora_B" in name or name.endswith(".B"):
                p.zero_()
    found = 0
    for spec, plain in zip(find_blocks(model), find_blocks(base), strict=True):
        updates = kernel_updates(spec)
        adapted, weights = spec.adapter.read_params(spec), plain.adapter.read_params(plain)
        for name, W in adapted.items():
            if not (isinstance(W, torch.Tensor) and W.ndim == 2):
                continue
            rebuilt = weights[name].detach().clone()
            for u in (u for u in updates if u.weight == name):
                rebuilt[:, u.dest] += u.update.scale * (u.update.A @ u.update.B).detach()[:, u.source]
                found += 1
            torch.testing.assert_close(rebuilt, W.detach(), rtol=0, atol=0, msg=f"{case} {spec.name} {name}")
    assert found >= 4


def test_kernel_updates_refuse_dora():
    model = CASES["llama-dora"]().model.double()
    spec = find_blocks(model)[0]
    with pytest.raises(UnsupportedWrapperError, match="DoRA r=4: its weight is not a frozen weight plus low-rank"):
        kernel_updates(spec)
