"""Recognising nanoGPT-style layers by their structure, for layer classes that are in no adapter table.

nanoGPT's ``model.py`` is copied into many projects under many names, so its layer is recognised by what it
holds rather than by its class: :func:`recognize` looks at a module's children (names, types, shapes) and
returns an adapter or ``None``; :func:`curvwatch.adapters.find_blocks` tries it for every module whose type is
not in :data:`~curvwatch.adapters.ADAPTERS`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from curvwatch.adapters._shared import check_probability_dropout, leftover
from curvwatch.adapters.base import (
    Adapter,
    BlockSpec,
    Masks,
    UnsupportedBlockError,
    _capture,
    _four_specs,
    _layernorm,
    activation_name,
)
from curvwatch.adapters.projections import _ffn, _linear, projection_features

__all__ = ["NanoGPTBlockAdapter", "recognize"]

#: nanoGPT's own ``LayerNorm`` (optional bias) calls ``F.layer_norm(..., 1e-5)`` with the eps hard-coded.
NANOGPT_LN_EPS = 1e-5


def _layernorm_like(module: Any, d: int) -> bool:
    """``nn.LayerNorm(d)``, or a module holding only ``weight (d,)`` and an optional ``bias (d,)`` whose class name
    says LayerNorm (nanoGPT's ``LayerNorm(ndim, bias)``)."""
    if isinstance(module, nn.LayerNorm):
        return tuple(module.normalized_shape) == (d,)
    if not isinstance(module, nn.Module) or "layernorm" not in type(module).__name__.lower():
        return False
    params = dict(module.named_parameters())
    if set(params) - {"weight", "bias"} or "weight" not in params or list(module.children()):
        return False
    return all(tuple(p.shape) == (d,) for p in params.values())


def _activation(mlp: nn.Module) -> nn.Module | None:
    """The one parameter-free child of ``mlp`` that :func:`activation_name` knows, else ``None``."""
    found = []
    for child in mlp.children():
        if isinstance(child, (nn.Linear, nn.Dropout)):
            continue
        try:
            activation_name(child)
        except UnsupportedBlockError:
            continue
        found.append(child)
    return found[0] if len(found) == 1 else None


def _is_causal(attn: nn.Module) -> bool:
    """Evidence that ``attn`` is causal: ``is_causal=True`` in its forward's source, or a lower-triangular ``bias``
    buffer of ones (nanoGPT's non-flash path)."""
    bias = getattr(attn, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.ndim >= 2 and bias.shape[-1] == bias.shape[-2]:
        b = bias.reshape(-1, *bias.shape[-2:])[0]
        if bool((b == torch.ones_like(b).tril()).all()):
            return True
    try:
        source = inspect.getsource(type(attn).forward)
    except (OSError, TypeError):
        return False
    return "is_causal=True" in source.replace(" ", "")


def recognize(module: nn.Module) -> Adapter | None:
    """The adapter for a nanoGPT-style layer, or ``None`` if ``module`` is not one.

    A nanoGPT-style layer has children ``ln_1``, ``attn``, ``ln_2``, ``mlp`` with (each projection an ``nn.Linear`` or
    a LoRA wrapper of one): ``attn.c_attn`` an ``nn.Linear(d, 3 d)``, ``attn.c_proj`` an ``nn.Linear(d, d)``, an int
    ``attn.n_head`` dividing ``d`` and causal attention (``is_causal=True`` in the forward or a lower-triangular
    ``bias`` buffer); ``mlp.c_fc`` an ``nn.Linear(d, d_ff)``, ``mlp.c_proj`` an ``nn.Linear(d_ff, d)`` and exactly one
    known activation child; and ``ln_1``, ``ln_2`` LayerNorms of size ``d`` (``nn.LayerNorm`` or nanoGPT's own
    ``LayerNorm``).

    Args:
        module: Any module.

    Returns:
        A :class:`NanoGPTBlockAdapter`, or ``None``.

    Example:
        >>> recognize(torch.nn.Linear(2, 2)) is None
        True
    """
    attn, mlp = getattr(module, "attn", None), getattr(module, "mlp", None)
    if not isinstance(attn, nn.Module) or not isinstance(mlp, nn.Module):
        return None
    c_attn, a_proj = getattr(attn, "c_attn", None), getattr(attn, "c_proj", None)
    c_fc, m_proj = getattr(mlp, "c_fc", None), getattr(mlp, "c_proj", None)
    features = [projection_features(m) if isinstance(m, nn.Module) else None for m in (c_attn, a_proj, c_fc, m_proj)]
    if any(f is None for f in features):
        return None
    (d, qkv), attn_out, (fc_in, d_ff), mlp_out = features
    n_head = getattr(attn, "n_head", None)
    shapes_ok = (
        qkv == 3 * d
        and attn_out == (d, d)
        and fc_in == d
        and mlp_out == (d_ff, d)
        and isinstance(n_head, int)
        and not isinstance(n_head, bool)
        and n_head > 0
        and d % n_head == 0
    )
    if not shapes_ok or not all(_layernorm_like(getattr(module, n, None), d) for n in ("ln_1", "ln_2")):
        return None
    if _activation(mlp) is None or not _is_causal(attn):
        return None
    return _NANOGPT


class NanoGPTBlockAdapter(Adapter):
    """A nanoGPT-style layer (see :func:`recognize`): ``ln_1, attn (c_attn, c_proj), ln_2, mlp (c_fc, act, c_proj)``.

    Blocks: ``attn``: ``attn.c_attn -> attn.c_proj`` (before ``resid_dropout``), ``W_Q, W_K, W_V`` the column
    thirds of ``c_attn`` (``q, k, v = c_attn(x).split(d, dim=2)``, heads ``view(B, T, n_head, d / n_head)``),
    causal, scale ``1/sqrt(d_K)``; ``ln_1``, ``ln_2``: ``"layernorm"`` (eps from ``.eps``, else nanoGPT's
    hard-coded ``1e-5``); ``ffn``: ``mlp.c_fc -> mlp.c_proj``. The residual arrangement does not matter: each
    block's ``X`` is captured at its own input. Attention dropout in training (``attn.dropout > 0``) raises.
    """

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        return _four_specs(layer, index, self, layer.attn.c_attn, layer.ln_1, layer.ln_2, layer.mlp.c_fc)

    def capture_modules(self, spec):
        layer = spec.layer_module
        return _capture(spec, layer.attn, {"attention": layer.attn.c_proj, "ffn": layer.mlp.c_proj})

    def unmonitored(self, layer):
        return leftover(layer, [layer.attn, layer.ln_1, layer.ln_2, layer.mlp])

    def read_masks(self, spec, args, kwargs):
        return Masks(causal=True)

    def read_params(self, spec):
        layer = spec.layer_module
        if spec.kind == "layernorm":
            ln = spec.module
            if isinstance(ln, nn.LayerNorm):
                return _layernorm(ln)
            return {"eps": float(getattr(ln, "eps", NANOGPT_LN_EPS)), "weight": ln.weight, "bias": ln.bias}
        if spec.kind == "ffn":
            return _ffn(layer.mlp.c_fc, layer.mlp.c_proj, _activation(layer.mlp))
        attn = layer.attn
        p = getattr(attn, "dropout", 0.0)
        if not isinstance(p, (int, float)):
            p = getattr(getattr(attn, "attn_dropout", None), "p", 0.0)
        check_probability_dropout(attn, float(p), "nanoGPT attention", "set dropout=0.0 in the GPTConfig")
        d = projection_features(attn.c_attn)[0]
        W, b = _linear(attn.c_attn)
        W_Q, W_K, W_V = W.split(d, dim=1)
        b_Q = b_K = b_V = None
        if b is not None:
            b_Q, b_K, b_V = b.split(d)
        W_O, b_O = _linear(attn.c_proj)
        return dict(
            W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, n_heads=attn.n_head, n_kv_heads=None, b_Q=b_Q, b_K=b_K, b_V=b_V,
            b_O=b_O, scale=None, qk_norm=None,
        )  # fmt: skip


_NANOGPT = NanoGPTBlockAdapter()
