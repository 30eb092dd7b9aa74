"""The adapter of litgpt's ``Block``: LLaMA 2/3, Mistral, Qwen 2.5/3, Gemma 1/3, Pythia, Phi, Falcon ... by config.

litgpt builds every family from one ``Config``; the adapter reads the settings from ``block.config`` and the
modules of the installed version (checked against litgpt 0.5.13), never from a model name.
"""

from __future__ import annotations

from torch import nn

from curvwatch.adapters._shared import (
    check_rotary_dims,
    gated_activation,
    grouped_attention_params,
    leftover,
    norm_params,
    qk_norm_params,
    split_fused_qkv,
    squeeze_rotary,
    type_key,
)
from curvwatch.adapters.base import (
    Adapter,
    BlockSpec,
    Masks,
    UnsupportedBlockError,
    _bind,
    _spec,
    activation_name,
)
from curvwatch.adapters.projections import _linear

_MLPS = {"GptNeoxMLP": "ffn", "LLaMAMLP": "gated_ffn", "GemmaMLP": "gated_ffn"}


def _litgpt_name(module: nn.Module | None) -> str | None:
    """The class name if ``module`` is an instance of a class defined in ``litgpt.model`` or in ``litgpt.lora`` (its
    LoRA model: the same classes with ``LoRALinear`` projections), else ``None``."""
    if module is None:
        return None
    key = type_key(module)
    return key.split(":", 1)[1] if key.startswith(("litgpt.model:", "litgpt.lora:")) else None


def _is_norm(module: nn.Module | None) -> bool:
    return module is not None and not isinstance(module, nn.Identity)


class LitGPTBlockAdapter(Adapter):
    """litgpt ``Block``: ``norm_1, attn (CausalSelfAttention: fused qkv, proj), norm_2, mlp``.

    Blocks, as ``name: kind, X-module -> output-module``:

    * ``attn``: ``"attention"``, ``attn -> attn.proj``. Causal; a sliding window on the layers of
      ``config.sliding_window_indices`` (Mistral, Gemma 3, Phi-3); rotary tables ``(cos, sin)`` of the call, of
      width ``r = config.rope_n_elem`` (``rotary_percentage`` of ``head_size``: partial for Pythia and Phi); grouped
      keys/values (``n_query_groups < n_head``); the softmax scale ``1/sqrt(attention_scores_scalar or
      head_size)`` (Gemma); ``norm_qk`` (Qwen3, Gemma 3) as ``qk_norm``. The fused ``qkv`` Linear of this litgpt
      version is ``[q (n_head * hs) | k (n_query_groups * hs) | v (n_query_groups * hs)]``, heads contiguous
      inside each part, and query head ``h`` uses key/value group ``h // (n_head / n_query_groups)``
      (``repeat_interleave``). With ``rope_interleave`` litgpt permutes each head's rotated dimensions to
      ``[0, 2, ..., 1, 3, ...]`` and rotates halves; as queries and keys are permuted alike this is the
      interleaved rotation (``2i`` with ``2i + 1``, angle ``i``), reported as ``rotary_interleaved=True`` with
      tables ``cos[..., :r/2]`` repeated twice per pair.
    * ``ln_1`` (``norm_1``), ``ln_2`` (``norm_2``): ``"layernorm"`` or ``"rmsnorm"`` (``weight_offset=1`` for
      Gemma's ``add_unit_offset``); absent when the config disables the norm (``norm_1=False``) or shares it
      (``shared_attention_norm``: Phi, Falcon).
    * ``ln_post_attn`` (``post_attention_norm``), ``ln_post_ffn`` (``post_mlp_norm``): Gemma 2/3, OLMo-2.
    * ``ffn``: ``mlp -> mlp.proj``; ``"ffn"`` for ``GptNeoxMLP`` (``gelu`` or ``gelu_tanh`` by
      ``gelu_approximate``), ``"gated_ffn"`` for ``LLaMAMLP`` (``silu(fc_1) * fc_2``) and ``GemmaMLP``
      (``gelu(fc_1) * fc_2``).

    Parallel residual (Pythia, Phi, Falcon: ``x + attn(norm_1(x)) + mlp(norm_2(x))``) needs nothing special:
    each sub-block's ``X`` is captured at its own input (``norm_2``'s output, or ``norm_1``'s when shared), so the
    attention and the MLP each see the norm output they really get.

    Not modelled (``unmonitored``): ``LLaMAMoE`` (Mixtral, Qwen3-MoE, DeepSeek: routing and experts), multi-head
    latent attention (DeepSeek V3). Raised as :class:`UnsupportedBlockError` when the block is read: attention
    logit softcapping (Gemma 2), OLMo-2's QK-norm over all heads, a KV cache (``input_pos``) or an explicit mask.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        out = []
        if _litgpt_name(layer.attn) == "CausalSelfAttention":
            out.append(_spec(layer, index, "attn", "attention", layer.attn, self))
        for part, name in (
            ("ln_1", "norm_1"),
            ("ln_2", "norm_2"),
            ("ln_post_attn", "post_attention_norm"),
            ("ln_post_ffn", "post_mlp_norm"),
        ):
            norm = getattr(layer, name, None)
            if _is_norm(norm):
                kind, _ = norm_params(norm)
                out.append(_spec(layer, index, part, kind, norm, self))
        kind = _MLPS.get(_litgpt_name(layer.mlp) or "")
        if kind is not None:
            out.append(_spec(layer, index, "ffn", kind, layer.mlp, self))
        return out

    def capture_modules(self, spec):
        layer = spec.layer_module
        output = {"attention": layer.attn.proj, "ffn": layer.mlp.proj, "gated_ffn": layer.mlp.proj}.get(
            spec.kind, spec.module
        )
        return spec.module, output, layer.attn

    def unmonitored(self, layer):
        out = []
        covered = [layer.attn, layer.mlp] + [
            getattr(layer, n, None) for n in ("norm_1", "norm_2", "post_attention_norm", "post_mlp_norm")
        ]
        attn_name, mlp_name = _litgpt_name(layer.attn), _litgpt_name(layer.mlp)
        if attn_name != "CausalSelfAttention":
            out.append(("attn", f"{type(layer.attn).__name__} (multi-head latent attention) is not modelled"))
        if mlp_name not in _MLPS:
            out.append(("mlp", f"{type(layer.mlp).__name__}: mixture-of-experts routing and experts are not modelled"))
        return out + leftover(layer, covered)

    def read_masks(self, spec, args, kwargs):
        attn = spec.layer_module.attn
        a = _bind(attn, args, kwargs)
        if a.get("input_pos") is not None:
            raise UnsupportedBlockError(
                "litgpt attention was called with input_pos (KV-cache inference); the closed forms model a "
                "training forward over whole sequences. Call the model without input_pos on monitored steps."
            )
        if a.get("mask") is not None:
            raise UnsupportedBlockError(
                "litgpt attention was called with an explicit mask; only the default causal mask is supported."
            )
        cfg = attn.config
        window = cfg.sliding_window_size if getattr(attn, "apply_sliding_window_attention", False) else None
        rotary, interleaved = None, False
        r = cfg.rope_n_elem
        if r > 0 and spec.kind == "attention":
            check_rotary_dims(r, cfg.head_size, "litgpt attention")
            cos, sin = a["cos"], a["sin"]
            if cos.shape[-1] != r:
                raise UnsupportedBlockError(
                    f"litgpt attention got rotary tables of width {cos.shape[-1]}, expected rope_n_elem={r}."
                )
            if cfg.rope_interleave:  # per-dimension tables of the interleaved layout (see the class docstring)
                cos = cos[..., : r // 2].repeat_interleave(2, dim=-1)
                sin = sin[..., : r // 2].repeat_interleave(2, dim=-1)
                interleaved = True
            rotary = squeeze_rotary(cos, sin)
        return Masks(causal=True, window=window, rotary=rotary, rotary_interleaved=interleaved)

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind in ("layernorm", "rmsnorm"):
            return norm_params(spec.module)[1]
        if spec.kind == "ffn":
            mlp = layer.mlp
            (W_1, b_1), (W_2, b_2) = _linear(mlp.fc), _linear(mlp.proj)
            act = activation_name("gelu_tanh" if mlp.config.gelu_approximate == "tanh" else "gelu")
            return dict(W_1=W_1, W_2=W_2, b_1=b_1, b_2=b_2, activation=act, residual=False)
        if spec.kind == "gated_ffn":
            mlp = layer.mlp
            (W_gate, b_gate), (W_up, b_up), (W_down, b_down) = map(_linear, (mlp.fc_1, mlp.fc_2, mlp.proj))
            if _litgpt_name(mlp) == "GemmaMLP":
                act = gated_activation("gelu_tanh" if mlp.config.gelu_approximate == "tanh" else "gelu")
            else:
                act = "silu"
            return dict(
                W_gate=W_gate, W_up=W_up, W_down=W_down, b_gate=b_gate, b_up=b_up, b_down=b_down, activation=act
            )
        return self._attention(layer.attn)

    def _attention(self, attn: nn.Module) -> dict:
        cfg = attn.config
        if cfg.attention_logit_softcapping is not None:
            raise UnsupportedBlockError(
                f"litgpt attention uses attention_logit_softcapping={cfg.attention_logit_softcapping} (Gemma 2), "
                "which the closed forms do not model. Exclude the attention blocks with explicit BlockSpecs."
            )
        H, H_kv, hs = cfg.n_head, cfg.n_query_groups, cfg.head_size
        W, b = _linear(attn.qkv)  # (d, (H + 2 H_kv) hs): [q | k | v], see the class docstring
        sizes = (H * hs, H_kv * hs, H_kv * hs)
        if W.shape[1] != sum(sizes):
            raise UnsupportedBlockError(
                f"litgpt qkv has {W.shape[1]} outputs, expected (n_head + 2 n_query_groups) head_size = "
                f"{sum(sizes)}; this litgpt version's layout is not supported."
            )
        W_Q, W_K, W_V = split_fused_qkv(W, "concat", H, H_kv, hs)
        b_Q = b_K = b_V = None
        if b is not None:
            b_Q, b_K, b_V = split_fused_qkv(b, "concat", H, H_kv, hs)
        W_O, b_O = _linear(attn.proj)
        qk_norm = None
        if cfg.norm_qk:
            if cfg.norm_qk_type != "default":
                raise UnsupportedBlockError(
                    f"litgpt norm_qk_type={cfg.norm_qk_type!r} (OLMo-2) normalises all heads of q and k at once; "
                    "only the per-head QK-norm (norm_qk_type='default', Qwen3, Gemma 3) is modelled."
                )
            qk_norm = qk_norm_params(attn.norm_q, attn.norm_k, hs)
        scale = (cfg.attention_scores_scalar or hs) ** -0.5 * getattr(attn, "mscale", 1.0) ** 2
        return grouped_attention_params((W_Q, W_K, W_V, W_O), (b_Q, b_K, b_V, b_O), H, H_kv, scale, hs, qk_norm)
