"""End to end: the numbers CurvatureMonitor logs are the curvature of the model's own computation (issue 13).

For each tiny model below (float64, batch 2, sequences of 8 tokens) one optimizer step runs with a real
``lightning.Trainer``, a ``CurvatureMonitor`` evaluating step 0 (float64, Lanczos to a relative residual of 1e-10 with
up to 500 steps and no basis limit, every token kept) and an in-memory logger. Then, independently of curvwatch's
adapters, capture and kernels, a deep copy of the initial model runs the same batch forward and backward with our own
hooks (each sub-block's call arguments and the gradient ``G`` at its output), and ``torch.func`` differentiates the
model's own modules, called with ``functional_call`` on those arguments (the real rotary tables, masks, GQA layout,
QK-norm, memory), in one slice of weights at a time: ``J`` the dense Jacobian of the block output, ``c = 2 / (L m)``,

* ``outer/XY = lambda_max(c J^T J)``, ``functional/XY = ||Hess <G, F>||_2``, ``hessian/XY`` the norm of their sum,
  for ``W_Q`` of the first and last query head (``QQ/h{i}``), ``W_K``, ``W_V`` of the first and last kv head
  (``KK``/``VV``, keyed ``/g{j}`` under grouped-query attention, ``/h{j}`` otherwise), the QK-norm weights of Qwen3
  (``N1N1`` = the query norm's, ``N2N2`` = the key norm's, shared by every head), the whole FFN weights
  (``W1W1`` = gate or ``W_1``, ``W3W3`` = up, ``W2W2`` = down or ``W_2``);
* ``ln/var_min`` (LayerNorm) and ``rms/ms_min`` (RMSNorm) from the norm's recorded input.

Every monitored block is checked and the set-up table (``CurvatureMonitor.coverage``) must leave no part of a layer
out. Tolerance: ``TOL["end_to_end"]`` (1e-9) relative, an absolute ``1e-3 TOL * ||H||`` where a norm is zero
(``functional/VV``, ``functional/W2W2``, ``functional/W3W3``: ``F`` is linear there). Where the model computes in
float32 whatever the dtype, the comparison is at float32 round-off (``TOL_FLOAT32_INSIDE``, 1e-5): Qwen3's
``q_norm``/``k_norm`` (``Qwen3RMSNorm`` and litgpt's ``RMSNorm`` cast to float32) gave 1.1e-7 (HF) and 3.1e-7 (litgpt);
the same forward with that cast patched out, on the same ``X``, ``G`` and weights, agrees to 1.5e-15 and 1.2e-15
(checked at 1e-9 too). The RMSNorms in front of the blocks also
cast, but their float32-rounded output is the block input both sides see, and the rotary tables, computed in
float32, are the same tensors both sides use. Hugging Face attention runs SDPA (eager takes its softmax in float32);
the reference differentiates under the SDPA math backend (the CPU flash kernel has no forward-mode derivative), whose
output matches the recorded call to 1e-12. Hugging Face weights are drawn with std 0.25 (not 0.02) so that the
scores are O(1): dropping the rotary tables, the window or the cross-attention memory's last position then moves the
norms by 19-53 %, not by 1e-5.

=================================  =====================================  =================  =================
model (layers, d, heads/kv)        blocks monitored per layer (kind)      not monitored       worst rel. error
=================================  =====================================  =================  =================
litgpt LLaMA-3.2 (2, 16, 4/2):     attn (attention: GQA, full rotary      none               1.4e-15
full rotary + llama3 frequencies,  r = 4), ln_1, ln_2 (rmsnorm),
RMSNorm, LLaMAMLP                  ffn (gated_ffn)
litgpt pythia (1, 32, 4/4):        attn (attention: rotary r = 2 of 8),   none               1.7e-15
LayerNorm, parallel residual,      ln_1, ln_2 (layernorm), ffn (ffn,
partial rotary, GptNeoxMLP         gelu)
litgpt Qwen3 (1, 16, 4/2,          attn (GQA, QK-norm with N1N1, N2N2),   none               3.1e-7 (float32
head_size 4)                       ln_1, ln_2, ffn (gated_ffn)                               QK-norm; twin
                                                                                             1.2e-15)
HF LlamaForCausalLM (1, 16, 4/2)   attn (GQA), ln_1, ln_2 (rmsnorm),      none               1.4e-15
                                   ffn (gated_ffn)
HF Qwen3ForCausalLM (1, 16, 4/2,   attn (GQA, QK-norm with N1N1, N2N2),   none               1.1e-7 (float32
head_dim 4)                        ln_1, ln_2, ffn (gated_ffn)                               QK-norm; twin
                                                                                             1.5e-15)
HF MistralForCausalLM (1, 16,      attn (GQA, window 3 < L = 8), ln_1,    none               1.7e-15
4/2)                               ln_2, ffn (gated_ffn)
HF BartForConditionalGeneration    encoder: attn, ln_1, ln_2, ffn;        none               1.8e-15
(1 + 1, 16, 4/4; L_enc = 7)        decoder: attn (causal), ln_1,
                                   cross_attn (cross_attention), ln_2,
                                   ln_3, ffn (ffn, gelu)
nanoGPT-style, tests/zoo.py        attn (fused c_attn, SDPA is_causal),   none               4.8e-15
(2, 16, 4/4)                       ln_1, ln_2 (layernorm), ffn (ffn)
hand-written LLaMA-style layer,    attn (GQA, rotary from the call),      none               3.3e-15
plain torch, LayerDescription      norm1, norm2 (rmsnorm), ffn
(tests/zoo.py; 2, 16, 4/2)         (gated_ffn)
hand-written nanoGPT-style layer,  attn (one fused c_attn, GQA, causal    none               1.7e-15
fused qkv, LayerDescription(qkv=)  SDPA), ln_1, ln_2 (layernorm), ffn
(tests/zoo.py; 2, 16, 4/2)         (ffn, gelu)
=================================  =====================================  =================  =================

"Not monitored" is what the set-up table lists inside the layers. Outside them, and not in the table: the
embeddings, the final norm (litgpt and nanoGPT ``ln_f``, Hugging Face ``model.norm``, BART's ``layernorm_embedding``
of the encoder and the decoder) and ``lm_head``.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacfwd, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.loggers import MemoryLogger
from curvwatch import Cadence, CurvatureMonitor, Evaluation
from tests import zoo
from tests.utils import TOL, WORST, rel_err

B, SEQ, VOCAB = 2, 8, zoo.VOCAB

# --------------------------------------------------------------------------------------------------
# The models, and where their sub-blocks are (read from the models' own code, not from the adapters)
# --------------------------------------------------------------------------------------------------

Slice = tuple[str, int, int]  # (parameter name in the ref's root, first row, end row) of an nn.Linear weight


@dataclass
class Ref:
    """One sub-block as the reference sees it.

    ``root`` is called with the arguments its forward pre-hook recorded (tensors detached); its output (first element
    of a tuple) is the block output, whose gradient a tensor hook records. ``slices`` maps a logged pair key
    (``"QQ/h0"``, ``"KK/g1"``, ``"W1W1"``) to rows of an ``nn.Linear`` weight ``(out, in)``: the columns of the math
    ``W`` in ``X @ W`` (the order of the variables does not change a spectral norm). ``stat`` (norm blocks): the
    logged statistic, ``"ln/var_min"`` or ``"rms/ms_min"``, computed from the recorded input.
    """

    block: str
    root: nn.Module
    slices: dict[str, Slice] = field(default_factory=dict)
    stat: str | None = None
    float32_inside: bool = False  # part of the module's forward runs in float32 (see TOL_FLOAT32_INSIDE)
    hooked: tuple[nn.Module, nn.Module] | None = None  # (input, output) modules to hook where root itself is not called


@dataclass
class Case:
    model: nn.Module
    batch: tuple[Tensor, ...]
    loss: Callable[[nn.Module, tuple[Tensor, ...]], Tensor]
    refs: Callable[[nn.Module], list[Ref]]  # the blocks of a model of this case (called on the copy)
    pairs: tuple[str, ...]
    sanity: Callable[[nn.Module, dict], None] | None = None  # the feature under test is really exercised
    float64_twin: Callable[[nn.Module], None] | None = None  # patches out the float32 casts of float32_inside blocks


def _attn_slices(q: str, k: str, v: str, H: int, H_kv: int, d_K: int, off_k: int = 0, off_v: int = 0):
    """W_Q of the first and last query head, W_K and W_V of the first and last kv head (``g{j}`` under GQA, where the
    kernel keys the kv blocks by group; ``h{j}`` otherwise). Parameters ``q``, ``k``, ``v``, kv rows from ``off_k``,
    ``off_v`` (fused projections)."""
    out = {f"QQ/h{h}": (q, h * d_K, (h + 1) * d_K) for h in sorted({0, H - 1})}
    tag = "g" if H_kv < H else "h"
    for g in sorted({0, H_kv - 1}):
        out[f"KK/{tag}{g}"] = (k, off_k + g * d_K, off_k + (g + 1) * d_K)
        out[f"VV/{tag}{g}"] = (v, off_v + g * d_K, off_v + (g + 1) * d_K)
    return out


def _whole(module: nn.Module, **names: str) -> dict[str, Slice]:
    """Whole weights: ``pair key -> parameter name`` (``W1W1="fc.weight"``)."""
    return {key: (name, 0, module.get_parameter(name).shape[0]) for key, name in names.items()}


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
    stat = "rms/ms_min" if cfg.norm_class_name == "RMSNorm" else "ln/var_min"
    model = _perturb(tiny.model) if cfg.norm_qk else tiny.model  # QK-norm: its weights off their ones

    def refs(model):
        out = []
        for i, layer in enumerate(model.transformer.h):
            # CausalSelfAttention: q, k, v = qkv(x).split((H hs, H_kv hs, H_kv hs)), then .view(B, T, n, hs)
            sl = _attn_slices("qkv.weight", "qkv.weight", "qkv.weight", H, H_kv, hs, H * hs, (H + H_kv) * hs)
            if cfg.norm_qk:  # norm_q / norm_k of each head, before the rotary embedding: the blocks N1, N2
                sl.update(N1N1=("norm_q.weight", 0, hs), N2N2=("norm_k.weight", 0, hs))
            out += [Ref(f"layer{i}/attn", layer.attn, sl, float32_inside=cfg.norm_qk)]
            out += [Ref(f"layer{i}/ln_1", layer.norm_1, stat=stat), Ref(f"layer{i}/ln_2", layer.norm_2, stat=stat)]
            if gated:  # LLaMAMLP: proj(silu(fc_1(x)) * fc_2(x))
                sl = _whole(layer.mlp, W1W1="fc_1.weight", W3W3="fc_2.weight", W2W2="proj.weight")
            else:  # GptNeoxMLP: proj(gelu(fc(x)))
                sl = _whole(layer.mlp, W1W1="fc.weight", W2W2="proj.weight")
            out.append(Ref(f"layer{i}/ffn", layer.mlp, sl))
        return out

    def sanity(model, recs):
        if family == "llama3":  # GQA, rotary over the whole head, llama3 frequency adjustments
            assert H_kv < H and cfg.rope_n_elem == hs and cfg.rope_adjustments is not None
        elif family == "qwen3":  # GQA, per-head QK-norm
            assert H_kv < H and cfg.norm_qk and type(model.transformer.h[0].attn.norm_q).__name__ == "RMSNorm"
        else:  # pythia: parallel residual, partial rotary
            assert cfg.parallel_residual and 0 < cfg.rope_n_elem < hs and cfg.norm_class_name == "LayerNorm"

    def float64_twin(model):
        for layer in model.transformer.h:
            for norm in (layer.attn.norm_q, layer.attn.norm_k):
                norm.forward = types.MethodType(_float64_litgpt_rmsnorm, norm)

    idx, targets = _tokens(B, SEQ), _tokens(B, SEQ)
    pairs = ("VV", "QQ", "KK", "W1W1", "W2W2") + (("W3W3",) if gated else ())
    pairs += ("N1N1", "N2N2") if cfg.norm_qk else ()
    twin = float64_twin if cfg.norm_qk else None
    return Case(model, (idx, targets), lambda m, b: _ce(m(b[0]), b[1]), refs, pairs, sanity, twin)


def _float64_litgpt_rmsnorm(norm: nn.Module, x: Tensor) -> Tensor:
    """litgpt ``RMSNorm.forward`` without its casts to float32 and back."""
    weight = (1 + norm.weight) if norm.add_unit_offset else norm.weight
    return x * torch.rsqrt(torch.mean(x * x, dim=norm.dim, keepdim=True) + norm.eps) * weight


def _float64_rmsnorm(norm: nn.Module, x: Tensor) -> Tensor:
    """``Qwen3RMSNorm.forward`` without its casts to float32 and back."""
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _hf_causal_lm(family: str) -> Case:
    tf = pytest.importorskip("transformers")
    config_name, model_name, own = zoo.HF_FAMILIES[family]
    # initializer_range 0.25 (not 0.02): scores of O(1), so the softmax, rotary and window matter at O(1e-2)
    config = getattr(tf, config_name)(**{**zoo._HF_DECODER, **own, "num_hidden_layers": 1, "initializer_range": 0.25})
    config._attn_implementation = "sdpa"  # eager attention takes its softmax in float32
    torch.manual_seed(1)
    model = _perturb(getattr(tf, model_name.replace("Model", "ForCausalLM"))(config))
    H, H_kv = config.num_attention_heads, config.num_key_value_heads
    d_K = getattr(config, "head_dim", None) or config.hidden_size // H

    def refs(m):
        out = []
        for i, layer in enumerate(m.model.layers):
            # q_proj(x).view(B, L, H, d_K); repeat_kv: query head h reads kv head h // (H / H_kv)
            sl = _attn_slices("q_proj.weight", "k_proj.weight", "v_proj.weight", H, H_kv, d_K)
            if family == "qwen3":  # q_norm / k_norm of each head, before the rotary embedding: the blocks N1, N2
                sl.update(N1N1=("q_norm.weight", 0, d_K), N2N2=("k_norm.weight", 0, d_K))
            out.append(Ref(f"layer{i}/attn", layer.self_attn, sl, float32_inside=family == "qwen3"))
            out.append(Ref(f"layer{i}/ln_1", layer.input_layernorm, stat="rms/ms_min"))
            out.append(Ref(f"layer{i}/ln_2", layer.post_attention_layernorm, stat="rms/ms_min"))
            sl = _whole(layer.mlp, W1W1="gate_proj.weight", W3W3="up_proj.weight", W2W2="down_proj.weight")
            out.append(Ref(f"layer{i}/ffn", layer.mlp, sl))
        return out

    def sanity(m, recs):
        assert type(m).__name__.endswith("ForCausalLM") and H_kv < H
        if family == "qwen3":
            assert type(m.model.layers[0].self_attn.q_norm).__name__ == "Qwen3RMSNorm"
        if family == "mistral":  # the mask the attention really got: a window of 3 < L keys
            allowed = recs["layer0/attn"].kwargs["attention_mask"][0, 0]
            assert allowed.dtype == torch.bool and allowed[SEQ - 1].tolist() == [False] * (SEQ - 3) + [True] * 3

    def float64_twin(m):
        for layer in m.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.forward = types.MethodType(_float64_rmsnorm, norm)

    ids, targets = _tokens(B, SEQ, low=1), _tokens(B, SEQ)
    loss = lambda m, b: _ce(m(input_ids=b[0]).logits, b[1])
    pairs = ("VV", "QQ", "KK", "W1W1", "W2W2", "W3W3") + (("N1N1", "N2N2") if family == "qwen3" else ())
    return Case(model, (ids, targets), loss, refs, pairs, sanity, float64_twin if family == "qwen3" else None)


class _BartFFN(nn.Module):
    """BART's FFN as its layers compute it, ``fc2(activation_fn(fc1(x)))`` (the dropouts are 0), on the layer's own
    modules: BART has no module of its own for it (hooks go on ``fc1`` and ``fc2``)."""

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
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, init_std=0.25,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = _perturb(tf.BartForConditionalGeneration(config))

    def refs(m):
        out = []
        for i, layer in enumerate((m.model.encoder.layers[0], m.model.decoder.layers[0])):
            sl = _attn_slices("q_proj.weight", "k_proj.weight", "v_proj.weight", 4, 4, 4)
            out.append(Ref(f"layer{i}/attn", layer.self_attn, sl))
            out.append(Ref(f"layer{i}/ln_1", layer.self_attn_layer_norm, stat="ln/var_min"))
            if i == 1:  # encoder_attn(hidden_states, key_value_states=encoder output): the memory is held fixed
                out.append(Ref("layer1/cross_attn", layer.encoder_attn, sl))
                out.append(Ref("layer1/ln_2", layer.encoder_attn_layer_norm, stat="ln/var_min"))
            out.append(Ref(f"layer{i}/{'ln_3' if i else 'ln_2'}", layer.final_layer_norm, stat="ln/var_min"))
            ffn = _BartFFN(layer)
            sl = _whole(ffn, W1W1="fc1.weight", W2W2="fc2.weight")
            out.append(Ref(f"layer{i}/ffn", ffn, sl, hooked=(layer.fc1, layer.fc2)))
        return out

    def sanity(m, recs):  # cross-attention on an encoder memory of another length
        memory = recs["layer1/cross_attn"].kwargs["key_value_states"]
        assert memory.shape == (B, SEQ - 1, 16) and recs["layer1/cross_attn"].out.shape == (B, SEQ, 16)

    enc_ids, dec_ids, targets = _tokens(B, SEQ - 1, low=3), _tokens(B, SEQ, low=3), _tokens(B, SEQ)
    loss = lambda m, b: _ce(m(input_ids=b[0], decoder_input_ids=b[1]).logits, b[2])
    return Case(model, (enc_ids, dec_ids, targets), loss, refs, ("VV", "QQ", "KK", "W1W1", "W2W2"), sanity)


def _nanogpt() -> Case:
    model = zoo.nanogpt(seed=1).model
    d, H = 16, 4

    def refs(m):
        out = []
        for i, layer in enumerate(m.transformer.h):
            # q, k, v = c_attn(x).split(d, dim=2), each .view(B, T, H, d / H)
            sl = _attn_slices("c_attn.weight", "c_attn.weight", "c_attn.weight", H, H, d // H, d, 2 * d)
            out.append(Ref(f"layer{i}/attn", layer.attn, sl))
            out.append(Ref(f"layer{i}/ln_1", layer.ln_1, stat="ln/var_min"))
            out.append(Ref(f"layer{i}/ln_2", layer.ln_2, stat="ln/var_min"))
            out.append(Ref(f"layer{i}/ffn", layer.mlp, _whole(layer.mlp, W1W1="c_fc.weight", W2W2="c_proj.weight")))
        return out

    def sanity(m, recs):  # the fused c_attn, and no adapter table entry: found by structure
        layer = m.transformer.h[0]
        assert type(layer).__module__ == "tests.zoo" and layer.attn.c_attn.out_features == 3 * d

    idx, targets = _tokens(B, SEQ), _tokens(B, SEQ)
    loss = lambda m, b: _ce(m(b[0]), b[1])
    return Case(model, (idx, targets), loss, refs, ("VV", "QQ", "KK", "W1W1", "W2W2"), sanity)


def _hand_written() -> Case:
    """A LLaMA-style layer written in plain torch (GQA 4/2, rotary passed by the caller, RMSNorm, SwiGLU), known to
    curvwatch only through a LayerDescription."""
    model = zoo.hand_written(seed=1).model
    H, H_kv, d_K = 4, 2, 4

    def refs(m):
        out = []
        for i, layer in enumerate(m.layers):
            sl = _attn_slices("wq.weight", "wk.weight", "wv.weight", H, H_kv, d_K)
            out.append(Ref(f"layer{i}/attn", layer.attn, sl))
            out.append(Ref(f"layer{i}/norm1", layer.norm1, stat="rms/ms_min"))
            out.append(Ref(f"layer{i}/norm2", layer.norm2, stat="rms/ms_min"))
            sl = _whole(layer.mlp, W1W1="gate.weight", W3W3="up.weight", W2W2="down.weight")
            out.append(Ref(f"layer{i}/ffn", layer.mlp, sl))
        return out

    idx, targets = _tokens(B, SEQ), _tokens(B, SEQ)
    pairs = ("VV", "QQ", "KK", "W1W1", "W2W2", "W3W3")
    return Case(model, (idx, targets), lambda m, b: _ce(m(b[0]), b[1]), refs, pairs)


def _fused_qkv() -> Case:
    """A nanoGPT-style layer written in plain torch with one fused ``c_attn`` for q, k and v under GQA (4/2), causal
    SDPA, LayerNorm, GELU FFN, known to curvwatch only through a LayerDescription with ``qkv=``."""
    model = zoo.fused_qkv(seed=1).model
    H, H_kv, d_K = 4, 2, 4

    def refs(m):
        out = []
        for i, layer in enumerate(m.h):
            # q, k, v = c_attn(x).split([H d_K, H_kv d_K, H_kv d_K], dim=2), each .view(B, T, heads, d_K)
            c = "c_attn.weight"
            sl = _attn_slices(c, c, c, H, H_kv, d_K, H * d_K, (H + H_kv) * d_K)
            out.append(Ref(f"layer{i}/attn", layer.attn, sl))
            out.append(Ref(f"layer{i}/ln_1", layer.ln_1, stat="ln/var_min"))
            out.append(Ref(f"layer{i}/ln_2", layer.ln_2, stat="ln/var_min"))
            out.append(Ref(f"layer{i}/ffn", layer.mlp, _whole(layer.mlp, W1W1="c_fc.weight", W2W2="c_proj.weight")))
        return out

    def sanity(m, recs):  # one fused Linear with the GQA widths (not nanoGPT's 3 d: not found by structure), biased
        attn = m.h[0].attn
        assert attn.layout == "concat" and attn.c_attn.out_features == (H + 2 * H_kv) * d_K != 3 * 16
        assert attn.c_attn.bias is not None and H_kv < H

    idx, targets = _tokens(B, SEQ), _tokens(B, SEQ)
    pairs = ("VV", "QQ", "KK", "W1W1", "W2W2")
    return Case(model, (idx, targets), lambda m, b: _ce(m(b[0]), b[1]), refs, pairs, sanity)


CASES: dict[str, Callable[[], Case]] = {
    "litgpt-llama3": lambda: _litgpt("llama3"),
    "litgpt-pythia": lambda: _litgpt("pythia", n_layer=1, intermediate_size=32),
    "litgpt-qwen3": lambda: _litgpt("qwen3", n_layer=1),
    "hf-llama": lambda: _hf_causal_lm("llama"),
    "hf-qwen3": lambda: _hf_causal_lm("qwen3"),
    "hf-mistral": lambda: _hf_causal_lm("mistral"),
    "hf-bart": _bart,
    "nanogpt": _nanogpt,
    "hand-written": _hand_written,
    "fused-qkv": _fused_qkv,
}


# --------------------------------------------------------------------------------------------------
# One real training step with the monitor
# --------------------------------------------------------------------------------------------------


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
        log_level="all",
        every_n_train_steps=1,
        log_heatmap=False,
        on_error="raise",
        cadence=Cadence(max_overhead=None),
        evaluation=Evaluation(
            dtype="float64", tol=1e-10, max_iter=500, max_basis=None, max_tokens=B * SEQ, pairs=list(case.pairs)
        ),
    )
    logger = MemoryLogger()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=logger, callbacks=[monitor], default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*case.batch), batch_size=B)
    trainer.fit(Wrapped(case.model, case.loss), data)
    logged = {k: v for step, m in logger.calls if step == 0 for k, v in m.items() if k.startswith("curv/")}
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


def reference_norms(ref: Ref, rec: Recorded, replay_rtol: float = 1e-12) -> dict[str, float]:
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
            Wn = torch.cat([W[:lo], theta.view(hi - lo, *W.shape[1:]), W[hi:]])  # rows of a Linear; a norm's weight
            return _first(functional_call(ref.root, {**params, name: Wn}, rec.args, rec.kwargs))

        with sdpa_kernel(SDPBackend.MATH):  # the CPU flash kernel has no forward-mode derivative
            # the replay is the recorded call (the math backend rounds differently from the fused one, at 1e-16)
            err = rel_err(f(theta0), rec.out)
            assert err <= replay_rtol, f"{ref.block}: the replayed forward differs from the recorded call by {err:.1e}"
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

#: Blocks whose module computes part of its forward in float32 whatever the input dtype (Qwen3's q_norm/k_norm,
#: ``Qwen3RMSNorm`` casts to float32): the reference's derivatives through them are float32-accurate (seen: 1.9e-7),
#: the kernel's float64. Compared at float32 round-off; the float64 twin below is then held to TOL["end_to_end"].
TOL_FLOAT32_INSIDE = 1e-5


def _check(logged: dict[str, float], key: str, expected: float, tol: float, scale: float) -> float:
    """Assert the logged number is ``expected`` to ``tol`` relative (``tol * 1e-3 * scale`` absolute where it is
    zero, e.g. ``functional/VV``: ``F`` is linear in ``W_V``); returns the relative error."""
    assert key in logged, f"{key} was not logged; logged: {sorted(k for k in logged if k.startswith(key[:20]))}"
    actual, ref = logged[key], max(abs(expected), 1e-3 * scale)
    err = abs(actual - expected) / ref
    assert err <= tol, f"{key}: logged {actual!r}, torch.func {expected!r}: relative error {err:.2e} > {tol:.0e}"
    WORST[("test_end_to_end.py", tol)] = max(WORST.get(("test_end_to_end.py", tol), 0.0), err)
    return err


def _check_block(logged, ref: Ref, rec: Recorded, tol: float, replay_rtol: float = 1e-12) -> float:
    expected = reference_norms(ref, rec, replay_rtol)
    scale = max(v for k, v in expected.items() if k.startswith("hessian/"))
    return max(_check(logged, f"curv/{ref.block}/{k}", v, tol, scale) for k, v in expected.items())


@pytest.fixture
def one_thread():
    """Tiny matrices: one thread. With two threads on two busy cores LAPACK's eigvalsh stalled for seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(CASES))
def test_logged_numbers_are_the_models_curvature(name, tmp_path, one_thread):
    case = CASES[name]()
    initial = copy.deepcopy(case.model)  # the weights the monitored step 0 sees
    logged, monitor = train_one_step(case, tmp_path)
    moved = [n for (n, p), q in zip(initial.named_parameters(), case.model.parameters(), strict=True) if p.ne(q).any()]
    assert moved, "the optimizer step did not happen"

    rows = [r for r in monitor.coverage if r["layer"] != "-"]  # "-": embeddings, final norm, head (named apart)
    assert [r for r in rows if r["status"] != "monitored"] == [], "a part of a layer is left out"
    initial.train()  # as Lightning runs the step (every dropout is 0)
    refs = case.refs(initial)
    assert sorted(f"layer{r['layer']}/{r['part']}" for r in rows) == sorted(r.block for r in refs), "a block unchecked"
    recs = record(initial, refs, case.loss, case.batch)
    if case.sanity is not None:
        case.sanity(initial, recs)

    worst = 0.0
    for ref in refs:
        rec = recs[ref.block]
        if ref.stat is not None:
            stat = reference_stat(ref, rec)
            worst = max(worst, _check(logged, f"curv/{ref.block}/{ref.stat}", stat, TOL["end_to_end"], abs(stat)))
        elif not ref.float32_inside:
            worst = max(worst, _check_block(logged, ref, rec, TOL["end_to_end"]))
        else:
            worst = max(worst, _check_block(logged, ref, rec, TOL_FLOAT32_INSIDE))
            case.float64_twin(initial)  # the same forward without its float32 casts, on the same X, G and weights
            twin = _check_block(logged, ref, rec, TOL["end_to_end"], replay_rtol=1e-6)
            print(f"{name}: {ref.block} against its float64 twin: worst relative error {twin:.1e}")
    print(f"{name}: {len(refs)} blocks, worst relative error {worst:.1e}")
