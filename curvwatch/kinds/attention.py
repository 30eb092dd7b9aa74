"""The ``"attention"`` and ``"cross_attention"`` kinds: multi-head attention with its output projection, per head.

Both call the same kernel; a cross-attention block takes its keys and values from the memory (the encoder
output) its adapter reads from the call, and reports ``term/memory_norm`` besides.
"""

from __future__ import annotations

import torch

from curvwatch.closed_form.inputs import AttentionStructure, AttentionWeights
from curvwatch.kinds import BlockKind, grouped, register_kind
from curvwatch.names import KeySpec


def _call_inputs(masks, key_padding_mask, kept):
    """Padding mask, rotary tables and cross-attention memory as inputs (cut with the tokens); causality and the
    window as settings. Rotary tables ``(L, r)`` or ``(B, L, r)`` are stored per sequence, ``(k, l, r)``."""
    k, l = kept
    inputs = {} if key_padding_mask is None else {"key_padding_mask": key_padding_mask}
    params = {"causal": bool(masks.causal)}
    if masks.window is not None:
        params["window"] = int(masks.window)
    if masks.rotary is not None:
        for name, table in zip(("rotary_cos", "rotary_sin"), masks.rotary, strict=True):
            table = table.detach()
            table = table.unsqueeze(0).expand(k, *table.shape) if table.ndim == 2 else table[:k]
            inputs[name] = table[:, :l].clone()  # (k, l, r)
        params["rotary_interleaved"] = bool(masks.rotary_interleaved)
    if masks.memory is not None:
        inputs["memory"] = masks.memory.detach()[:k].clone()  # (k, L_kv, d_kv): every memory position
        if masks.memory_padding_mask is not None:
            inputs["memory_padding_mask"] = masks.memory_padding_mask.detach()[:k].to(torch.bool).clone()
    return inputs, params


def _prepare(kwargs):
    """The kernel's grouped arguments: ``X``, ``weights``, ``structure`` (the rotary tables as one ``(cos, sin)``)
    and ``loss``."""
    if "rotary_cos" in kwargs:
        kwargs["rotary"] = (kwargs.pop("rotary_cos"), kwargs.pop("rotary_sin"))
    return grouped(kwargs, "X", AttentionWeights, structure=AttentionStructure)


_KEYS = (
    KeySpec("bound/{XY}[/{head}]", "corrected upper bound of `‖H(XY)‖` (never below it; docs/closed_forms.md)"),
    KeySpec("bound/outer/{XY}[/{head}]", "corrected upper bound of `‖H_o(XY)‖`"),
    KeySpec("bound/functional/{XY}[/{head}]", "corrected upper bound of `‖H_f(XY)‖`"),
    KeySpec("term/x_norm", "`‖X‖₂` of the block input (max over sequences)"),
    KeySpec("term/x_norm6", "its 6th power (QQ and KK grow like it)"),
    KeySpec("term/grad_norm", "`‖G‖_F` of the output gradient"),
    KeySpec("term/residual_norm", "`‖F − target‖_F` (target mode of the kernels only)"),
    KeySpec("term/inv_L3", "the papers' `1/L³` (uniform-attention assumption)"),
    KeySpec("term/softmax_jac_norm[/{head}]", "measured `‖∂A/∂T‖₂` (max over rows and sequences)"),
    KeySpec("term/softmax_hess_frob[/{head}]", "measured `‖∂²A/∂T²‖_F` bound factor"),
    KeySpec("term/attn_entropy[/{head}]", "mean attention entropy over the kept query rows"),
    KeySpec("term/attn_entropy_norm[/{head}]", "the entropy divided by `log L`"),
    KeySpec("term/wq_norm[/{head}]", "spectral norm of the head's `W_Q`"),
    KeySpec("term/wk_norm[/{head}]", "spectral norm of the head's `W_K`"),
    KeySpec("term/wv_norm[/{head}]", "spectral norm of the head's `W_V`"),
    KeySpec("term/wo_norm[/{head}]", "spectral norm of the head's rows of `W_O`"),
)


def _attention_kind(name: str, extra_keys: tuple[KeySpec, ...], doc: str) -> BlockKind:
    """The attention kind declaration, shared by self- and cross-attention."""
    return BlockKind(
        name=name,
        closed_form="multi_head_attention",
        prefix="attn",
        input_name="X",
        mask_name="key_padding_mask",
        # N1N1, N2N2, N1N2: the QK-norm's own parameters (query norm N1, key norm N2), where the call has them
        pairs=("VV", "QQ", "KK", "VQ", "VK", "QK", "QKV", "N1N1", "N2N2", "N1N2"),
        exact_pairs=("VV",),
        signal_kwargs={"terms": "signals"},  # x_norm, wq/wk norms, softmax-Jacobian norm: no other term, no bound
        iterative=True,
        sampled=True,
        adapted=("W_Q", "W_K", "W_V"),
        has_norms=True,
        call_inputs=_call_inputs,
        prepare=_prepare,
        # the per-head (B, H, L, L) tangents of the Lanczos products (QQ and KK share one product: twice the rows of
        # one pair's) and the (B, L, d) intermediates
        work_elements=lambda B, L, d, p: 32 * B * int(p.get("n_heads", 1)) * L * L + 64 * B * L * d,
        # the QQ and KK runs go in lockstep (one host read per stopping test for both): both bases are held at once
        basis_numel=lambda p: p["W_Q"].numel() + p["W_K"].numel(),
        keys=_KEYS + extra_keys,
        label=name.replace("_", "-"),
        doc=doc,
    )


KIND = register_kind(
    _attention_kind(
        "attention",
        (),
        "multi-head attention `softmax(P Kᵀ/√d_K) V W_O` (rotary, GQA, windows, QK-norm): per-head Q, K, V blocks, "
        "the QK-norm weights' blocks (N1 query norm, N2 key norm), bounds and bound terms",
    )
)
CROSS_KIND = register_kind(
    _attention_kind(
        "cross_attention",
        (KeySpec("term/memory_norm", "`‖memory‖₂` of the keys/values source (max over sequences)"),),
        "cross-attention: queries from the block input, keys and values from the encoder memory",
    )
)
