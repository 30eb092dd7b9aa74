"""End to end: the numbers CurvatureMonitor logs are the curvature of the model's own computation (issue 13).

DOCSTRING_TABLE
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacfwd, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from curvwatch import CurvatureMonitor
from tests import zoo
from tests.utils import TOL, assert_close_report

B, SEQ, VOCAB = 2, 8, zoo.VOCAB
PARTS = ("outer", "functional", "hessian")


# --------------------------------------------------------------------------------------------------
# What each model is, and where its sub-blocks are (read from the models' own code, not from the adapters)
# --------------------------------------------------------------------------------------------------


@dataclass
class Ref:
    """One sub-block as the reference sees it.

    ``root`` is called with the arguments its forward pre-hook recorded (tensors detached): its output (first
    element of a tuple) is the block output, whose gradient a tensor hook records. ``slices`` maps a logged pair
    key (``"QQ/h0"``, ``"W1W1"``) to ``(parameter name in root, first row, end row)`` of an ``nn.Linear`` weight:
    rows of ``weight (out, in)`` are the columns of the math ``W`` in ``X @ W``. ``stat`` (norm blocks) is the
    logged statistic, ``"ln/var_min"`` or ``"rms/ms_min"``, computed from the recorded input.
    """

    block: str
    root: nn.Module
    slices: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    stat: str | None = None
    float32_inside: bool = False  # the module computes part of its forward in float32 (see TOL_FLOAT32_INSIDE)
    hooked: tuple[nn.Module, nn.Module] | None = None  # (input, output) modules to hook when root is not called


@dataclass
class Case:
    model: nn.Module
    batch: tuple[Tensor, ...]
    loss: Callable[[nn.Module, tuple[Tensor, ...]], Tensor]
    refs: Callable[[nn.Module], list[Ref]]  # the refs of a model of this case (called on the copy)
    pairs: tuple[str, ...]


def _attn_slices(
    prefix_q: str, prefix_k: str, prefix_v: str, H: int, H_kv: int, d_K: int, off_k: int = 0, off_v: int = 0
) -> dict[str, tuple[str, int, int]]:
    """Q of the first and last query head, K and V of the first and last kv head (group suffix ``g`` under GQA)."""
    out = {}
    for h in sorted({0, H - 1}):
        out[f"QQ/h{h}"] = (prefix_q, h * d_K, (h + 1) * d_K)
    tag = "g" if H_kv < H else "h"
    for g in sorted({0, H_kv - 1}):
        out[f"KK/{tag}{g}"] = (prefix_k, off_k + g * d_K, off_k + (g + 1) * d_K)
        out[f"VV/{tag}{g}"] = (prefix_v, off_v + g * d_K, off_v + (g + 1) * d_K)
    return out


def _full(name: str, module: nn.Module) -> tuple[str, int, int]:
    return (name, 0, module.get_parameter(name).shape[0])


def _perturb(model: nn.Module) -> nn.Module:
    """float64, and every 1-D parameter (norm weights, biases) moved off its ones/zeros initialisation."""
    model = model.to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _tokens(*shape: int, low: int = 0) -> Tensor:
    return torch.randint(low, VOCAB, shape)


def _ce(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _litgpt(family: str, **overrides) -> Case:
    tiny = zoo.litgpt_gpt(family, seed=1, **overrides)
    cfg = tiny.model.config
    H, H_kv, hs = cfg.n_head, cfg.n_query_groups, cfg.head_size
    gated = cfg.mlp_class_name == "LLaMAMLP"

    def refs(model):
        out = []
        for i, layer in enumerate(model.transformer.h):
            # litgpt's qkv rows: [q (H hs) | k (H_kv hs) | v (H_kv hs)], `qkv.split(...)` then `view(B, T, n, hs)`
            out.append(
                Ref(f"layer{i}/attn", layer.attn, _attn_slices("qkv.weight", "qkv.weight", "qkv.weight", H, H_kv, hs,
                                                               H * hs, (H + H_kv) * hs))
            )  # fmt: skip
            stat = "rms/ms_min" if cfg.norm_class_name == "RMSNorm" else "ln/var_min"
            out += [Ref(f"layer{i}/ln_1", layer.norm_1, stat=stat), Ref(f"layer{i}/ln_2", layer.norm_2, stat=stat)]
            mlp = layer.mlp
            names = {"W1W1": "fc_1.weight", "W3W3": "fc_2.weight", "W2W2": "proj.weight"} if gated else {
                "W1W1": "fc.weight", "W2W2": "proj.weight"}  # fmt: skip
            out.append(Ref(f"layer{i}/ffn", mlp, {k: _full(n, mlp) for k, n in names.items()}))
        return out

    idx, targets = _tokens(B, SEQ), _tokens(B, SEQ)
    pairs = ("VV", "QQ", "KK", "W1W1", "W2W2") + (("W3W3",) if gated else ())
    return Case(tiny.model, (idx, targets), lambda m, b: _ce(m(b[0]), b[1]), refs, pairs)


def _hf_causal_lm(family: str) -> Case:
    tf = pytest.importorskip("transformers")
    config_name, model_name, own = zoo.HF_FAMILIES[family]
    config = getattr(tf, config_name)(**{**zoo._HF_DECODER, **own, "num_hidden_layers": 1})
    config._attn_implementation = "sdpa"  # eager takes its softmax in float32
    torch.manual_seed(1)
    model = _perturb(getattr(tf, model_name.replace("Model", "ForCausalLM"))(config))
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    d_K = getattr(config, "head_dim", None) or config.hidden_size // H
    qk_norm = family == "qwen3"

    def refs(m):
        out = []
        for i, layer in enumerate(m.model.layers):
            a = layer.self_attn
            ref = Ref(f"layer{i}/attn", a, _attn_slices("q_proj.weight", "k_proj.weight", "v_proj.weight", H, H_kv, d_K))
            ref.float32_inside = qk_norm  # Qwen3RMSNorm (q_norm, k_norm) computes in float32
            out += [ref, Ref(f"layer{i}/ln_1", layer.input_layernorm, stat="rms/ms_min")]
            out.append(Ref(f"layer{i}/ln_2", layer.post_attention_layernorm, stat="rms/ms_min"))
            mlp = layer.mlp
            names = {"W1W1": "gate_proj.weight", "W3W3": "up_proj.weight", "W2W2": "down_proj.weight"}
            out.append(Ref(f"layer{i}/ffn", mlp, {k: _full(n, mlp) for k, n in names.items()}))
        return out

    ids, targets = _tokens(B, SEQ, low=1), _tokens(B, SEQ)
    loss = lambda m, b: _ce(m(input_ids=b[0]).logits, b[1])
    return Case(model, (ids, targets), loss, refs, ("VV", "QQ", "KK", "W1W1", "W2W2", "W3W3"))


class _BartFFN(nn.Module):
    """BART's FFN as its layer computes it, ``fc2(activation_fn(fc1(x)))`` (dropouts are 0), on the layer's own
    modules: BART has no module of its own for it."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = layer.fc1, layer.fc2, layer.activation_fn

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _bart() -> Case:
    tf = pytest.importorskip("transformers")
    config = tf.BartConfig(
        vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=24, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = _perturb(tf.BartForConditionalGeneration(config))
    slices = lambda: _attn_slices("q_proj.weight", "k_proj.weight", "v_proj.weight", 4, 4, 4)

    def refs(m):
        enc, dec = m.model.encoder.layers[0], m.model.decoder.layers[0]
        out = []
        for i, layer in enumerate((enc, dec)):
            out += [Ref(f"layer{i}/attn", layer.self_attn, slices())]
            out.append(Ref(f"layer{i}/ln_1", layer.self_attn_layer_norm, stat="ln/var_min"))
            if i == 1:
                out.append(Ref("layer1/cross_attn", layer.encoder_attn, slices()))
                out.append(Ref("layer1/ln_2", layer.encoder_attn_layer_norm, stat="ln/var_min"))
            out.append(Ref(f"layer{i}/{'ln_3' if i else 'ln_2'}", layer.final_layer_norm, stat="ln/var_min"))
            ffn = _BartFFN(layer)
            sl = {"W1W1": _full("fc1.weight", ffn), "W2W2": _full("fc2.weight", ffn)}
            out.append(Ref(f"layer{i}/ffn", ffn, sl, hooked=(layer.fc1, layer.fc2)))
        return out

    enc_ids, dec_ids, targets = _tokens(B, SEQ - 1, low=3), _tokens(B, SEQ, low=3), _tokens(B, SEQ)
    loss = lambda m, b: _ce(m(input_ids=b[0], decoder_input_ids=b[1]).logits, b[2])
    return Case(model, (enc_ids, dec_ids, targets), loss, refs, ("VV", "QQ", "KK", "W1W1", "W2W2"))


def _nanogpt() -> Case:
    model = zoo.nanogpt(seed=1).model
    d, H = 16, 4

    def refs(m):
        out = []
        for i, layer in enumerate(m.transformer.h):
            # q, k, v = c_attn(x).split(d, dim=2), then view(B, T, H, d / H)
            sl = _attn_slices("c_attn.weight", "c_attn.weight", "c_attn.weight", H, H, d // H, d, 2 * d)
            out += [Ref(f"layer{i}/attn", layer.attn, sl), Ref(f"layer{i}/ln_1", layer.ln_1, stat="ln/var_min")]
            out.append(Ref(f"layer{i}/ln_2", layer.ln_2, stat="ln/var_min"))
            mlp = layer.mlp
            out.append(Ref(f"layer{i}/ffn", mlp, {"W1W1": _full("c_fc.weight", mlp), "W2W2": _full("c_proj.weight", mlp)}))
        return out

    idx, targets = _tokens(B, SEQ), _tokens(B, SEQ)
    return Case(model, (idx, targets), lambda m, b: _ce(m(b[0]), b[1]), refs, ("VV", "QQ", "KK", "W1W1", "W2W2"))


CASES: dict[str, Callable[[], Case]] = {
    "litgpt-llama3": lambda: _litgpt("llama3"),
    "litgpt-pythia": lambda: _litgpt("pythia", n_layer=1, intermediate_size=48),
    "hf-llama": lambda: _hf_causal_lm("llama"),
    "hf-qwen3": lambda: _hf_causal_lm("qwen3"),
    "hf-mistral": lambda: _hf_causal_lm("mistral"),
    "hf-bart": _bart,
    "nanogpt": _nanogpt,
}


# --------------------------------------------------------------------------------------------------
# One real training step with the monitor
# --------------------------------------------------------------------------------------------------


class MemoryLogger(Logger):
    """Keeps what ``log_metrics`` received."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.records.append((step, dict(metrics)))


class Wrapped(L.LightningModule):
    def __init__(self, model: nn.Module, loss: Callable) -> None:
        super().__init__()
        self.model, self._loss = model, loss

    def training_step(self, batch, batch_idx):
        return self._loss(self.model, tuple(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def train_one_step(case: Case, tmp_path) -> tuple[dict[str, float], CurvatureMonitor]:
    monitor = CurvatureMonitor(
        every_n_train_steps=1, max_overhead=None, dtype="float64", tol=1e-10, max_iter=500, max_basis=None,
        max_tokens=B * SEQ, pairs=list(case.pairs), log_heatmap=False, on_error="raise",
    )  # fmt: skip
    logger = MemoryLogger()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=logger, callbacks=[monitor], default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*case.batch), batch_size=B)
    trainer.fit(Wrapped(case.model, case.loss), data)
    logged = {k: v for step, m in logger.records if step == 0 for k, v in m.items() if k.startswith("curv/")}
    return logged, monitor


# --------------------------------------------------------------------------------------------------
# The reference: the model's own modules, torch.func
# --------------------------------------------------------------------------------------------------


def _detach(x):
    if isinstance(x, Tensor):
        return x.detach()
    if isinstance(x, (tuple, list)):
        return type(x)(_detach(t) for t in x)
    if isinstance(x, dict):
        return {k: _detach(v) for k, v in x.items()}
    return x


def _first(out) -> Tensor:
    return out if isinstance(out, Tensor) else out[0]


@dataclass
class Recorded:
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    out: Tensor | None = None
    grad: Tensor | None = None


def record(model: nn.Module, refs: list[Ref], loss: Callable, batch) -> dict[str, Recorded]:
    """Forward and backward of the batch with our own hooks: each ref root's call arguments and output gradient."""
    recs = {r.block: Recorded() for r in refs}
    handles = []

    def pre(rec, module, args, kwargs):
        if rec.out is None:
            rec.args, rec.kwargs = _detach(args), _detach(kwargs)

    def post(rec, module, args, output):
        if rec.out is None:
            rec.out = _first(output)
            rec.out.register_hook(lambda g: setattr(rec, "grad", g))

    try:
        for r in refs:
            rec = recs[r.block]
            inp, outp = r.hooked or (r.root, r.root)
            handles.append(inp.register_forward_pre_hook(lambda m, a, k, rec=rec: pre(rec, m, a, k), with_kwargs=True))
            handles.append(outp.register_forward_hook(lambda m, a, o, rec=rec: post(rec, m, a, o)))
        loss(model, batch).backward()
    finally:
        for h in handles:
            h.remove()
    for r in refs:
        assert recs[r.block].out is not None and (r.stat or recs[r.block].grad is not None), r.block
    return recs


def reference_norms(ref: Ref, rec: Recorded) -> dict[str, float]:
    """``outer``, ``functional``, ``hessian`` of every slice of ``ref``, dense, through the module's own forward."""
    params = {k: v.detach() for k, v in ref.root.named_parameters()}
    G = rec.grad.detach()
    L_b, m = G.shape[-2], G.shape[-1]
    c = 2.0 / (L_b * m)
    out = {}
    for key, (name, lo, hi) in ref.slices.items():
        W = params[name]
        theta0 = W[lo:hi].reshape(-1).clone()

        def f(theta, W=W, name=name, lo=lo, hi=hi):
            Wn = torch.cat([W[:lo], theta.view(hi - lo, W.shape[1]), W[hi:]])
            return _first(functional_call(ref.root, {**params, name: Wn}, rec.args, rec.kwargs))

        with sdpa_kernel(SDPBackend.MATH):  # the CPU flash kernel has no forward-mode derivative
            replayed = f(theta0)  # the math backend rounds differently from the fused one, at 1e-16
            assert_close_report(replayed, rec.out, 1e-12, f"{ref.block}: the replayed forward")
            J = (jacfwd if theta0.numel() <= G.numel() else jacrev)(f)(theta0).reshape(-1, theta0.numel())
            H_f = hessian(lambda t: (G * f(t)).sum())(theta0)
        H_o = c * J.T @ J
        H_f = (H_f + H_f.T) / 2
        out[f"outer/{key}"] = torch.linalg.eigvalsh(H_o)[-1].item()
        out[f"functional/{key}"] = torch.linalg.eigvalsh(H_f).abs().max().item()
        out[f"hessian/{key}"] = torch.linalg.eigvalsh(H_o + H_f).abs().max().item()
    return out


def reference_stat(ref: Ref, rec: Recorded) -> float:
    X = rec.args[0] if rec.args else next(iter(rec.kwargs.values()))
    X = X.reshape(-1, X.shape[-1])
    if ref.stat == "ln/var_min":
        return X.var(-1, unbiased=False).min().item()
    assert ref.stat == "rms/ms_min", ref.stat
    return X.square().mean(-1).min().item()


# --------------------------------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------------------------------

#: Modules that compute in float32 whatever the input dtype (Qwen3's q_norm/k_norm): the reference's derivatives
#: through them are float32-accurate, the kernel's float64.
TOL_FLOAT32_INSIDE = 1e-5
WORST_SEEN: dict[str, float] = {}


@pytest.mark.parametrize("name", list(CASES))
def test_logged_numbers_are_the_models_curvature(name, tmp_path):
    case = CASES[name]()
    initial = copy.deepcopy(case.model)
    logged, monitor = train_one_step(case, tmp_path)
    assert logged, "the monitor logged nothing at step 0"
    assert not any(p.equal(q) for p, q in zip(initial.parameters(), case.model.parameters(), strict=True) if p.ndim == 2)

    initial.train()
    refs = case.refs(initial)
    recs = record(initial, refs, case.loss, case.batch)
    monitored = {r["layer"] + "/" + r["part"] for r in monitor.coverage if r["status"] == "monitored"}
    assert {r.block.replace("layer", "", 1) for r in refs} <= monitored
    worst = 0.0
    for ref in refs:
        rec = recs[ref.block]
        p = f"curv/{ref.block}/"
        if ref.stat is not None:
            worst = max(worst, assert_close_report(logged[p + ref.stat], reference_stat(ref, rec), TOL["float64"],
                                                   p + ref.stat))  # fmt: skip
            continue
        expected = reference_norms(ref, rec)
        scale = max(v for k, v in expected.items() if k.startswith("hessian/"))
        tol = TOL_FLOAT32_INSIDE if ref.float32_inside else TOL["end_to_end"]
        for key, value in expected.items():
            assert p + key in logged, f"{p + key} not logged; logged keys: {sorted(k for k in logged if k.startswith(p))}"
            err = assert_close_report(logged[p + key], value, tol, p + key, atol=1e-3 * tol * scale)
            worst = max(worst, err if abs(value) > 1e-3 * scale else abs(logged[p + key] - value) / scale)
    WORST_SEEN[name] = worst
    print(f"{name}: worst relative error {worst:.2e}")
    for row in monitor.coverage:
        print(row)
