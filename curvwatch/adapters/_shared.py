"""Readers the litgpt, Hugging Face and structural adapters share: RMSNorm, gated activations, QK-norm, coverage.

They complement the readers of :mod:`curvwatch.adapters.base` for the block kinds added with these adapters
(``"rmsnorm"``, ``"gated_ffn"``, attention with grouped keys/values, QK-norm and a non-default softmax scale).
Nothing here imports ``litgpt`` or ``transformers``: classes of those packages are named by
``"module:QualName"`` strings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvwatch.adapters.base import UnsupportedBlockError, _layernorm, activation_name

#: RMSNorm classes of Hugging Face ``transformers`` (``"module:QualName"``) -> ``weight_offset``: the output is
#: ``x / sqrt(mean(x^2) + eps) * (weight_offset + weight)``. Gemma's norms scale by ``1 + weight``. Add a row for
#: another RMSNorm class whose forward has this form.
RMSNORM_OFFSETS: dict[str, float] = {
    "transformers.models.llama.modeling_llama:LlamaRMSNorm": 0.0,
    "transformers.models.mistral.modeling_mistral:MistralRMSNorm": 0.0,
    "transformers.models.qwen2.modeling_qwen2:Qwen2RMSNorm": 0.0,
    "transformers.models.qwen3.modeling_qwen3:Qwen3RMSNorm": 0.0,
    "transformers.models.gemma.modeling_gemma:GemmaRMSNorm": 1.0,
}


def type_key(module: object) -> str:
    """``"module:QualName"`` of the type of ``module``, the key format of the adapter tables."""
    t = type(module)
    return f"{t.__module__}:{t.__qualname__}"


def rmsnorm_params(module: nn.Module) -> dict[str, Any]:
    """``eps, weight, weight_offset`` of an RMSNorm over the last dimension.

    Knows ``torch.nn.RMSNorm``, litgpt's ``RMSNorm`` (``add_unit_offset``: offset 1) and the Hugging Face classes
    of :data:`RMSNORM_OFFSETS`. ``torch.nn.RMSNorm(eps=None)`` uses the machine epsilon of the input dtype; it
    is read as that of the weight (float32 without weight).

    Raises:
        UnsupportedBlockError: For another class, or a norm over other dimensions.
    """
    key = type_key(module)
    if isinstance(module, nn.RMSNorm):
        if len(module.normalized_shape) != 1:
            raise UnsupportedBlockError(
                f"nn.RMSNorm with normalized_shape={module.normalized_shape} is not supported: only a norm over "
                "the last dimension is."
            )
        eps = module.eps
        if eps is None:
            eps = torch.finfo(module.weight.dtype if module.weight is not None else torch.float32).eps
        return {"eps": float(eps), "weight": module.weight, "weight_offset": 0.0}
    if key == "litgpt.model:RMSNorm":
        if module.dim not in (-1,):
            raise UnsupportedBlockError(f"litgpt RMSNorm with dim={module.dim} is not supported: only dim=-1 is.")
        offset = 1.0 if module.add_unit_offset else 0.0
        return {"eps": float(module.eps), "weight": module.weight, "weight_offset": offset}
    if key in RMSNORM_OFFSETS:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None:
            raise UnsupportedBlockError(
                f"{key} has neither .variance_epsilon nor .eps; this version of the class is not supported "
                "(the adapters read the layout of transformers 5.x)."
            )
        return {"eps": float(eps), "weight": module.weight, "weight_offset": RMSNORM_OFFSETS[key]}
    raise UnsupportedBlockError(
        f"Unknown RMSNorm class {key}. If its forward is x / sqrt(mean(x^2) + eps) * (c + weight), add it: "
        "curvwatch.adapters._shared.RMSNORM_OFFSETS[" + repr(key) + "] = c."
    )


def norm_params(module: nn.Module) -> tuple[str, dict[str, Any]]:
    """``("layernorm", eps/weight/bias)`` for an ``nn.LayerNorm``, else ``("rmsnorm", eps/weight/weight_offset)``."""
    if isinstance(module, nn.LayerNorm):
        return "layernorm", _layernorm(module)
    return "rmsnorm", rmsnorm_params(module)


def qk_norm_params(norm_q: nn.Module, norm_k: nn.Module, d_K: int) -> dict[str, Any]:
    """The ``qk_norm`` argument of the attention closed form: per-head norms of queries and keys.

    Both norms act on the last dimension of each head, ``(B, H, L, d_K)``, before the rotary embedding.

    Raises:
        UnsupportedBlockError: If the norms are not RMSNorm/LayerNorm of size ``d_K`` of one kind.
    """
    kind_q, q = norm_params(norm_q)
    kind_k, k = norm_params(norm_k)
    for name, p in (("query", q), ("key", k)):
        w = p["weight"]
        if w is not None and tuple(w.shape) != (d_K,):
            raise UnsupportedBlockError(
                f"The {name} norm has a weight of shape {tuple(w.shape)}, not ({d_K},): it normalises more than "
                "one head at a time (e.g. OLMo-2's norm over all heads), which the closed forms do not model."
            )
    if kind_q != kind_k or q["eps"] != k["eps"] or q.get("weight_offset") != k.get("weight_offset"):
        raise UnsupportedBlockError(
            f"The query norm ({type(norm_q).__name__}, eps={q['eps']}) and key norm ({type(norm_k).__name__}, "
            f"eps={k['eps']}) differ in kind, eps or offset; the closed forms assume one setting."
        )
    out: dict[str, Any] = {"kind": kind_q, "eps": q["eps"], "weight_q": q["weight"], "weight_k": k["weight"]}
    if kind_q == "layernorm":
        out.update(bias_q=q["bias"], bias_k=k["bias"], weight_offset=0.0)
    else:
        out["weight_offset"] = q["weight_offset"]
    return out


_SILUS = ("SiLUActivation", "SiLU")


def gated_activation(act: Any) -> str:
    """Activation of a gated FFN: ``"silu"`` (SwiGLU), ``"gelu"`` (erf) or ``"gelu_tanh"`` (GeGLU, tanh).

    Raises:
        UnsupportedBlockError: For any other activation.
    """
    if act in ("silu", "swish", F.silu) or isinstance(act, nn.SiLU) or type(act).__name__ in _SILUS:
        return "silu"
    if isinstance(act, str) and act in ("gelu", "gelu_tanh"):
        return act
    try:
        name = activation_name(act)
    except UnsupportedBlockError:
        name = None
    if name in ("gelu", "gelu_tanh"):
        return name
    raise UnsupportedBlockError(
        f"Gated FFN activation {getattr(act, '__name__', type(act).__name__)!r} is not supported. Supported: "
        "silu (SwiGLU), gelu (erf) and gelu_tanh (tanh approximation)."
    )


def softmax_scale(scale: float, d_K: int) -> float | None:
    """``None`` if ``scale`` is the default ``1/sqrt(d_K)``, else ``scale`` (the ``scale`` closed-form argument)."""
    return None if math.isclose(scale, d_K**-0.5, rel_tol=1e-9) else float(scale)


def grouped_attention_params(
    weights: tuple[Tensor, Tensor, Tensor, Tensor],
    biases: tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None],
    n_heads: int,
    n_kv_heads: int,
    scale: float,
    d_K: int,
    qk_norm: dict[str, Any] | None,
) -> dict[str, Any]:
    """Closed-form arguments of an attention whose ``n_heads`` query heads share ``n_kv_heads`` key/value heads.

    Args:
        weights: ``(W_Q, W_K, W_V, W_O)`` in math convention, ``W_Q`` ``(d, n_heads d_K)``, ``W_K, W_V``
            ``(d, n_kv_heads d_K)``, ``W_O`` ``(n_heads d_K, d)``.
        biases: ``(b_Q, b_K, b_V, b_O)``, each ``None`` or of the width of its projection.
        n_heads: Number of query heads ``H``.
        n_kv_heads: Number of key/value heads; returned as ``None`` when it equals ``n_heads`` (no grouping).
        scale: Softmax scale of the scores; returned as ``None`` when it is the default ``1/sqrt(d_K)``.
        d_K: Head size.
        qk_norm: The ``qk_norm`` argument (:func:`qk_norm_params`), or ``None``.
    """
    (W_Q, W_K, W_V, W_O), (b_Q, b_K, b_V, b_O) = weights, biases
    return dict(
        W_Q=W_Q,
        W_K=W_K,
        W_V=W_V,
        W_O=W_O,
        n_heads=n_heads,
        n_kv_heads=None if n_kv_heads == n_heads else n_kv_heads,
        b_Q=b_Q,
        b_K=b_K,
        b_V=b_V,
        b_O=b_O,
        scale=softmax_scale(scale, d_K),
        qk_norm=qk_norm,
    )


def check_probability_dropout(module: nn.Module, p: float, where: str, fix: str) -> None:
    """Raise if ``module`` drops attention probabilities (or FFN activations) on this call.

    Raises:
        UnsupportedBlockError: If ``module.training`` and ``p > 0``.
    """
    if module.training and p > 0:
        raise UnsupportedBlockError(
            f"{where} applies dropout p={p} in training mode, which the closed forms do not model. Fix: {fix}, "
            "or run the monitored steps in eval mode."
        )


def split_fused_qkv(t: Tensor, layout: str, H: int, H_kv: int, d_K: int) -> tuple[Tensor, Tensor, Tensor]:
    """The query, key and value parts of the last dimension of a fused projection's ``W`` ``(d, (H + 2 H_kv) d_K)``
    or bias ``((H + 2 H_kv) d_K,)``: ``(..., H d_K), (..., H_kv d_K), (..., H_kv d_K)``, heads as consecutive column
    groups, query head ``h`` of kv head ``h // (H / H_kv)``. Pure indexing (``param_index_map`` relies on it).

    ``layout``: ``"concat"``, the features are ``[q | k | v]`` (litgpt, nanoGPT); ``"per_head"``, for each kv head
    ``g`` its ``H / H_kv`` query heads, then its key, then its value (GPT-NeoX's ``query_key_value`` for ``H_kv = H``).

    Example:
        >>> [x.tolist() for x in split_fused_qkv(torch.arange(6.0), "concat", 2, 2, 1)]
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
        >>> [x.tolist() for x in split_fused_qkv(torch.arange(6.0), "per_head", 2, 2, 1)]
        [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    """
    if layout == "concat":
        return t.split((H * d_K, H_kv * d_K, H_kv * d_K), dim=-1)
    G = H // H_kv
    per = t.unflatten(-1, (H_kv, G + 2, d_K))  # (..., H_kv, G + 2, d_K)
    return per[..., :G, :].flatten(-3), per[..., G, :].flatten(-2), per[..., G + 1, :].flatten(-2)


def leftover(layer: nn.Module, covered: list[nn.Module | None]) -> list[tuple[str, str]]:
    """``(part, reason)`` for each sub-module of ``layer`` with parameters that no covered sub-tree holds."""
    inside = {id(m) for c in covered if c is not None for m in c.modules()}
    out = []
    for name, module in layer.named_modules():
        if not name or id(module) in inside:
            continue
        if any(True for _ in module.parameters(recurse=False)):
            out.append((name, f"{type(module).__name__} has parameters that no block spec reads"))
    return out


def squeeze_rotary(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary tables as ``(L, r)`` when shared by the batch (a leading 1), else ``(B, L, r)``."""
    if cos.ndim == 3 and cos.shape[0] == 1:
        return cos[0], sin[0]
    return cos, sin


def check_rotary_dims(r: int, d_K: int, where: str) -> None:
    """Raise unless ``0 < r <= d_K`` and ``r`` is even (pairs ``i`` and ``i + r/2`` or ``2i``, ``2i + 1``)."""
    if r % 2 or not 0 < r <= d_K:
        raise UnsupportedBlockError(
            f"{where} rotates r={r} dimensions of heads of size d_K={d_K}; only an even 0 < r <= d_K is "
            "supported (choose a rotary fraction that gives an even number of dimensions)."
        )
