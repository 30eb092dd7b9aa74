"""Low-rank adapters: the closed forms read the weight the forward uses, the set-up table says so, the rest is refused.

A model with adapters computes what its merged copy computes, so every curvature key of a monitored step must be the
same on both (:mod:`benchmarks.lora_merged` builds, trains and compares them): peft LoRA on Hugging Face Llama
(``q_proj``/``v_proj`` and every projection) and GPT-2 (``Conv1D``, ``fan_in_fan_out``, ``lora_bias``), DoRA,
litgpt's LoRA GPT (fused ``qkv``), and a wrapper of one's own through the ``lowrank_parts`` protocol. Wrappers that are
not understood (another peft tuner, quantised weights, an unknown wrapper) leave their blocks out with the reason,
named in the set-up table, and adapter dropout in training leaves the block out of that step.

The optimizer steps the adapters, so their stability ratios (``stability/lora/<name>``) are those of the curvature in
their own parameters: checked against ``torch.func`` on the peft modules' parameters (the same captured samples, the
optimizer's own state), under AdamW and SGD, and loosely against the exact Gauss-Newton matrix of the loss.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import curvwatch.engine.core as engine_core
from benchmarks.lora_merged import VOCAB, Adapted, compare, hf_adapted, litgpt_adapted, step_keys, with_peft
from curvwatch import Evaluation, Sharpness
from curvwatch.adapters import find_blocks
from curvwatch.adapters.projections import UnsupportedWrapperError, read_projection
from curvwatch.adapters.updates import kernel_updates
from curvwatch.closed_form import AttentionWeights, GatedFFNWeights
from curvwatch.closed_form.solver import debias
from curvwatch.engine.kernel import kernel_inputs
from curvwatch.models.gpt import GPT, GPTConfig
from curvwatch.reference.attention import attention_blocked, attention_forward
from curvwatch.reference.gated_ffn import gated_ffn_forward
from curvwatch.report import weight_notes
from tests.utils import TOL, assert_close_report

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

#: keys of a LoRA model against those of its merged copy: float64 closed forms and Lanczos to 1e-9 on both, so the
#: differences are round-off (1e-3 would pass a key one part in a thousand off)
RTOL = 1e-6
DT = torch.float64

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


# --------------------------------------------------------------------------------------------------
# Stability ratios of the adapters, against torch.func on the adapters' own parameters
# --------------------------------------------------------------------------------------------------

#: the monitor's Lanczos for these checks: residuals 1e-10 (its sampled members to 2e-11), no basis limit
TIGHT = Evaluation(dtype="float64", tol=1e-10, max_iter=400, max_basis=None)
#: kernel argument -> projection of a Hugging Face Llama layer
_PROJECTIONS = {
    "attention": {"W_Q": "self_attn.q_proj", "W_K": "self_attn.k_proj", "W_V": "self_attn.v_proj",
                  "W_O": "self_attn.o_proj"},
    "gated_ffn": {"W_gate": "mlp.gate_proj", "W_up": "mlp.up_proj", "W_down": "mlp.down_proj"},
}  # fmt: skip


def _trained(targets: str, optimizer: str, steps: int = 4):
    """A tiny peft Llama (float64) after a few steps of ``optimizer`` on its adapters, its optimizer and a batch."""
    adapted = hf_adapted("llama", targets, hidden=32)
    model = adapted.model.double()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(trainable, lr=2e-2, betas=(0.8, 0.95))
    else:
        opt = torch.optim.SGD(trainable, lr=0.5, momentum=0.6)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        adapted.loss(model, torch.randint(0, VOCAB, (2, 8), generator=g)).backward()
        opt.step()
        opt.zero_grad()
    return adapted, model, opt, torch.randint(0, VOCAB, (2, 8), generator=g)


def _monitored(monkeypatch, adapted, model, opt, ids, samples: int):
    """Every key of one monitored step, and ``{block: (captured block, its preconditioner)}`` as evaluated."""
    seen = {}
    evaluate = engine_core.evaluate_block

    def record(block, **kwargs):
        seen[block.spec.name] = (block, kwargs.get("precondition"))
        return evaluate(block, **kwargs)

    monkeypatch.setattr(engine_core, "evaluate_block", record)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keys, _ = step_keys(model, adapted.loss, ids, opt, evaluation=TIGHT,
                            sharpness=Sharpness(samples=samples, loss="cross_entropy"))  # fmt: skip
    return keys, seen, [str(w.message) for w in caught]


def _layer(model, block: str) -> nn.Module:
    return model.base_model.model.model.layers[int(block.split("/")[0][len("layer") :])]


def _weight(module: nn.Module, theta: dict[str, torch.Tensor]) -> torch.Tensor:
    """A projection's weight as its forward uses it, math layout ``(d_in, d_out)``: peft's ``W + s B A`` with the
    adapter's ``(A, B)`` taken from ``theta`` (by parameter) where it is there."""
    if not hasattr(module, "base_layer"):
        return module.weight.detach().T
    A, B = module.lora_A["default"].weight, module.lora_B["default"].weight
    A, B = theta.get(id(A), A.detach()), theta.get(id(B), B.detach())
    return (module.base_layer.weight.detach() + module.scaling["default"] * B @ A).T


def _block_output(model, block, kind: str, kwargs: dict):
    """``theta -> F``: the block output (o_proj's, down_proj's) of the captured input as a function of the weights,
    by the ground truths' forwards, every projection read from the model (``theta``: ``{id(parameter): value}``)."""
    layer = _layer(model, block)
    modules = {w: layer.get_submodule(path) for w, path in _PROJECTIONS[kind].items()}
    if kind == "gated_ffn":
        return lambda theta: gated_ffn_forward(kwargs["Y"], GatedFFNWeights(
            **{w: _weight(m, theta) for w, m in modules.items()}), "silu")  # fmt: skip
    X, structure, heads = kwargs["X"], kwargs["structure"], kwargs["weights"]
    blocked, dead = attention_blocked(X.shape[0], X.shape[1], X.shape[1], structure.causal, None, None, X.device)

    def forward(theta):
        W = {w: _weight(m, theta) for w, m in modules.items()}
        weights = AttentionWeights(**W, n_heads=heads.n_heads, n_kv_heads=heads.n_kv_heads)
        return attention_forward(X, weights, blocked, rotary=structure.rotary, dead=dead)

    return forward


def _expected(model, opt, block, precondition_used: bool, name: str) -> dict[str, float]:
    """The adapter's ``sharpness``, ``precond_sharpness`` and ``stability`` by ``torch.func`` from the captured block:
    the Monte-Carlo Gauss-Newton matrix of its output samples plus the Hessian of ``<g, F>`` in the peft parameters
    ``theta = [lora_A, lora_B]``, debiased over the halves of the samples as the monitor's keys are, ``P`` and the
    threshold read from the optimizer itself."""
    kind = block.spec.kind
    kwargs = kernel_inputs(block, torch.float64)
    layer = _layer(model, block.spec.name)
    module = next(layer.get_submodule(p) for p in _PROJECTIONS[kind].values() if p.endswith(name))
    params = [module.lora_A["default"].weight, module.lora_B["default"].weight]
    sizes = [p.numel() for p in params]
    theta0 = torch.cat([p.detach().reshape(-1) for p in params])
    forward = _block_output(model, block.spec.name, kind, kwargs)

    def F(theta):
        parts = theta.split(sizes)
        return forward({id(p): t.view(p.shape) for p, t in zip(params, parts, strict=True)})

    S, g = kwargs["loss"].output_samples, kwargs["loss"].grad_output  # (k, B, L, m), (B, L, m)
    J = torch.func.jacrev(F)(theta0)  # (B, L, m, P)
    V = torch.einsum("kblm,blmp->kbp", S, J)  # J_b^T s_jb
    func = torch.func.hessian(lambda t: (g * F(t)).sum())(theta0)
    k = S.shape[0]
    halves = ((0, k), (0, k // 2), (k // 2, k))
    ggn = [torch.einsum("kbp,kbq->pq", V[a:b], V[a:b]) / (b - a) for a, b in halves]  # full sample, its halves
    group = opt.param_groups[0]
    out = {}
    if precondition_used:  # Adam's P = sqrt(v_hat) + eps of the adapter's own parameters
        beta1, beta2 = group["betas"]
        step = float(opt.state[params[0]]["step"])
        # (the monitor reads the second moments in float32: so does the reference, P to 1e-7 either way)
        v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1).float() for p in params]) / (1 - beta2**step)
        D = (v.sqrt() + group["eps"]).double().rsqrt()
        threshold = (2 + 2 * beta1) / ((1 - beta1) * group["lr"])
    else:
        D, threshold = None, (2 + 2 * group["momentum"]) / group["lr"]
    for prefix, scale in (("", None), ("precond_", D)):
        if prefix and scale is None:
            continue
        tops = []
        for M in ggn:
            M = M + func
            M = M if scale is None else scale[:, None] * M * scale[None, :]
            tops.append(torch.linalg.eigvalsh(M)[-1:])
        out[f"{prefix}sharpness"] = float(debias(*tops, (k, k // 2, k - k // 2))[0])
    out["stability"] = out["precond_sharpness" if D is not None else "sharpness"] / threshold
    return out


@pytest.mark.parametrize(
    "targets,optimizer",
    [("qv", "adamw"), ("all-linear", "adamw"), ("qv", "sgd")],
    ids=["qv-adamw", "all-linear-adamw", "qv-sgd"],
)
def test_adapter_stability_ratios_match_torch_func(monkeypatch, targets, optimizer):
    """``stability/lora/<name>`` (and ``sharpness/lora/<name>``, ``precond_sharpness/lora/<name>``) of every adapter
    equals what torch.func gives from the same samples within ``TOL["end_to_end"]`` (1e-9 relative; Lanczos residuals
    1e-10; seen: round-off, below 1e-14); the blocks' frozen weights get no ratio, an adapter on ``o_proj`` none with
    its reason; the block, layer and model maxima include the adapters' ratios."""
    adapted, model, opt, ids = _trained(targets, optimizer)
    keys, seen, messages = _monitored(monkeypatch, adapted, model, opt, ids, samples=8)
    expected_names = {"attention": ["q_proj", "v_proj"] if targets == "qv" else ["q_proj", "k_proj", "v_proj"],
                      "gated_ffn": [] if targets == "qv" else ["gate_proj", "up_proj", "down_proj"]}  # fmt: skip
    checked = 0
    for name, (block, precondition) in seen.items():
        if block.spec.kind not in expected_names:
            continue
        assert sorted(block.params.get("adapters", {})) == sorted(expected_names[block.spec.kind]), name
        if not expected_names[block.spec.kind]:
            continue
        assert block.sample_scale == 1.0
        for adapter in expected_names[block.spec.kind]:
            uses_p = optimizer == "adamw"
            assert (f"lora/{adapter}" in (precondition or {})) == uses_p
            want = _expected(model, opt, block, uses_p, adapter)
            for key, value in want.items():
                got, value = (
                    torch.tensor(keys[f"curv/{name}/{key}/lora/{adapter}"], dtype=DT),
                    torch.tensor(value, dtype=DT),
                )
                assert_close_report(got, value, TOL["end_to_end"], f"{targets} {optimizer} {name} {key}/lora/{adapter}")
                checked += 1
        # the adapted block's frozen weights are not what the optimizer steps: no ratio of theirs
        weights = [k for k in keys if k.startswith(f"curv/{name}/stability/") and "/lora/" not in k]
        assert weights == [f"curv/{name}/stability/max"], name
        ratios = [v for k, v in keys.items() if k.startswith(f"curv/{name}/stability/lora/")]
        if ratios:
            assert keys[f"curv/{name}/stability/max"] == max(ratios)
    assert checked >= (8 if optimizer == "adamw" else 4)
    layer_max = max(v for k, v in keys.items() if k.startswith("curv_stability/layer"))
    assert keys["curv/summary/stability/max"] == layer_max
    o_proj = [m for m in messages if "'layer0/attn/lora/o_proj'" in m]
    assert (len(o_proj) == 1 and "writes W_O, which has no block" in o_proj[0]) == (targets == "all-linear")


def test_adapter_ggn_agrees_with_the_exact_gauss_newton_matrix(monkeypatch):
    """With many samples ``ggn/lora/q_proj`` approaches the exact Gauss-Newton matrix of the mean cross-entropy in
    ``q_proj``'s adapter parameters, ``J^T (diag p - p p^T) J / N`` over the logits of the whole model (torch.func
    through the peft model): a loose check (Monte-Carlo error, within 15%; seen: 0.8-4.8% for the four adapters with
    256 samples) that the samples are those of the loss trained."""
    adapted, model, opt, ids = _trained("qv", "adamw")
    keys, _, _ = _monitored(monkeypatch, adapted, model, opt, ids, samples=256)
    for layer, name in ((0, "q_proj"), (0, "v_proj"), (1, "q_proj"), (1, "v_proj")):
        module = model.base_model.model.model.layers[layer].self_attn.get_submodule(name)
        params = {n: p for n, p in model.named_parameters() if p is module.lora_A["default"].weight
                  or p is module.lora_B["default"].weight}  # fmt: skip
        names, sizes = list(params), [p.numel() for p in params.values()]
        theta0 = torch.cat([p.detach().reshape(-1) for p in params.values()])

        def logits(theta, names=names, sizes=sizes, params=params):
            values = {n: t.view(params[n].shape) for n, t in zip(names, theta.split(sizes), strict=True)}
            return torch.func.functional_call(model, values, (ids,)).logits[:, :-1]  # (B, L - 1, V): for ids[1:]

        with torch.no_grad():  # (the other parameters' graph: torch.func's own transforms are not affected)
            J = torch.func.jacrev(logits)(theta0).reshape(-1, VOCAB, theta0.numel())  # (N, V, P)
            p = logits(theta0).softmax(-1).reshape(-1, VOCAB)  # (N, V)
            H = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
            exact = float(torch.linalg.eigvalsh(torch.einsum("nvp,nvw,nwq->pq", J, H, J) / J.shape[0])[-1])
        got = keys[f"curv/layer{layer}/attn/ggn/lora/{name}"]
        assert abs(got - exact) <= 0.15 * exact, (layer, name, got, exact)


def test_dora_and_o_proj_adapters_get_no_ratio_and_say_why(monkeypatch):
    adapted = hf_adapted("llama", "qv", dora=True, hidden=32)
    model = adapted.model.double()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 8))
    adapted.loss(model, ids).backward()
    opt.step()
    opt.zero_grad()
    keys, seen, messages = _monitored(monkeypatch, adapted, model, opt, ids, samples=4)
    assert [k for k in keys if "/attn/sharpness/" in k] and not [k for k in keys if "stability/" in k]
    assert not seen["layer0/attn"][0].params.get("adapters")
    assert any("ratio for 'layer0/attn'" in m and "DoRA r=4: its weight is not a frozen weight" in m for m in messages)
