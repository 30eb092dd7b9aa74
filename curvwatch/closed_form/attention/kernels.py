"""The attention kernels :func:`self_attention` and :func:`multi_head_attention`: grouped inputs in, named numbers out.

Both check their inputs into one :class:`_Call`, then run the same evaluation: the forward pass of the
:class:`~.operator.AttentionOperator`, every exact norm in one batched call (:mod:`~.terms`), the Lanczos norms of the
block pairs (through the grouped-query views of :mod:`~.views` where ``H_kv < H``) and the sampled keys in one solve,
then the bound terms, the dense blocks and the QK-norm parameters' blocks.

Keys of :func:`multi_head_attention`: those of :func:`self_attention` suffixed by head or group. With ``H_kv = H``:
``/h{i}`` for everything, e.g. ``hessian/QQ/h0``, ``term/softmax_jac_norm/h1``, ``bound/VQ/h0``. With ``H_kv < H``:

* ``{part}/QQ/h{i}``, ``{part}/VQ/h{i}``, ``{part}/QK/h{i}`` (``i < H``): the blocks of query head ``i``'s ``W_Q``
  with itself and with its group's ``W_V`` and ``W_K``;
* ``{part}/KK/g{j}``, ``{part}/VV/g{j}``, ``{part}/VK/g{j}`` (``j < H_kv``): the blocks of kv head ``j``'s ``W_K``,
  ``W_V``, collecting every query head that reads them; ``{part}/QKV/g{j}``: the whole Hessian of group ``j``'s
  weights in block order ``Q`` (its ``G`` query heads in order), ``K``, ``V``;
* ``term/...`` per query head (``/h{i}``) except ``term/wk_norm/g{j}``, ``term/wv_norm/g{j}``; ``bound/...`` as the
  blocks; ``outer/VV/g{j}`` by Lanczos (no closed-form norm when heads share ``W_V``).

``term/memory_norm`` (``||memory||_2``, max over sequences) with a memory; ``term/x_norm`` stays the queries' input.
``bound/...`` keys cover scale, windows, rotary (through ``max ||R_i||``), grouped-query and cross-attention; **with a
QK-norm no ``bound/...`` key is returned** (the bounds do not cover it).

With ``output_samples``: ``ggn/XX``, ``sharpness/XX``, with ``precondition`` holding ``W_X`` ``precond_ggn/XX``,
``precond_sharpness/XX``, and ``residual/...`` of each, for XX in VV, QQ, KK of ``pairs``, suffixed like that pair's
other keys: ``/h{i}`` with ``H_kv = H``; with ``H_kv < H`` ``QQ/h{i}`` per query head and ``VV/g{j}``, ``KK/g{j}`` per
kv group (blocks of the head's ``W_Q`` slice, the group's ``W_K``, ``W_V`` slices).

With ``adapters`` (low-rank adapters on ``W_Q``, ``W_K``, ``W_V`` whose factors the optimizer steps):
``ggn/lora/<name>``, ``sharpness/lora/<name>``, with ``precondition`` holding ``"lora/<name>"``
``precond_ggn/lora/<name>``, ``precond_sharpness/lora/<name>``, and ``residual/...`` of each: the curvature in the
adapter's parameters, every head it moves together (:mod:`curvwatch.closed_form.adapted`).

With a QK-norm that has parameters: ``{part}/N1N1``, ``{part}/N2N2``, ``{part}/N1N2`` (and ``residual/...``,
``dense/...``), without head suffix: the blocks of the query norm's parameters ``N1`` (weight ``gamma_q``, then bias
``beta_q`` for a LayerNorm with bias; ``(p d_K)`` rows in that order) and the key norm's ``N2``, each shared by all
heads, so the Gauss-Newton part collects every head's output (cross-head terms). Only a norm with parameters gets
blocks: ``N1N1`` alone without ``weight_k``, none without any. With ``output_samples`` also ``ggn/``, ``sharpness/``
(``precond_...`` with ``precondition`` covering the block) of ``N1N1``, ``N2N2``; no ``sharpness_spread/`` for them.
Not computed: the blocks between a norm parameter and ``W_Q``, ``W_K``, ``W_V``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .._common import as_batched, check_like, check_weight, output_cotangent
from .._qk_norm import check_qk_norm
from .._qk_norm_blocks import NORM_PAIRS, block_precondition, norm_pairs, precondition_shapes, qk_norm_norms
from ..adapted import adapted_plan, adapter_shapes, check_adapters
from ..inputs import AttentionStructure, AttentionWeights, LowRankUpdate, OutputLoss
from ..masks import attention_masks, split_heads
from ..rotary import check_rotary
from ..settings import PARTS, Lanczos, check_parts
from ..solver.operator import dense_blocks
from ..solver.plan import full_norms, solve_planned, spectral_plan
from ..solver.sampled import SampledCurvature, check_output_samples, check_precondition, with_sampled
from ..solver.sampled_keys import sampled_plan
from .operator import ATTENTION_PAIRS, GROUP_PAIRS, QUERY_PAIRS, AttentionOperator, HeadWeights
from .terms import Forward, Suffixes, signal_terms, spectral_norms_of, terms_and_bounds
from .views import GroupView, QueryView, group_keys, grouped_vv_plan

__all__ = ["multi_head_attention", "self_attention"]


def self_attention(
    X: torch.Tensor,
    weights: AttentionWeights,
    *,
    loss: OutputLoss,
    structure: AttentionStructure | None = None,
    pairs: Sequence[str] | None = None,
    parts: Sequence[str] = PARTS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    terms: bool | str = True,
    precondition: Mapping[str, torch.Tensor] | None = None,
    adapters: Mapping[str, LowRankUpdate] | None = None,
) -> dict[str, torch.Tensor]:
    """Closed-form Hessian blocks of one softmax self-attention head ``F = softmax(X W_Q W_K^T X^T/sqrt(d_K)) X W_V``.

    Args:
        X: ``(L, d)`` or ``(B, L, d)`` input tokens.
        weights: ``W_Q``, ``W_K`` ``(d, d_K)`` and ``W_V`` ``(d, d_V)`` (math convention ``X @ W``), one head
            without ``W_O`` or biases; its ``qk_norm`` as in :func:`multi_head_attention` (its weights as blocks
            ``N1``, ``N2``).
        loss: the loss at the output ``F`` (:class:`~curvwatch.closed_form.OutputLoss`): ``target`` for the papers'
            ``||F - target||_F^2 / (L d_V)`` (mean over a batch) or ``grad_output`` for the local quadratic model
            with curvature ``output_curvature`` (default ``2/(L d_V)``), and ``output_samples`` ``(k, B, L, d_V)``
            (``(k, L, d_V)`` unbatched) for the sampled keys below.
        structure: the masks and the score (:class:`~curvwatch.closed_form.AttentionStructure`): ``causal``,
            ``key_padding_mask`` ``(B, L)`` or ``(L,)`` (True = padded; padded keys are masked and padded query rows
            leave the loss), ``window``, ``scale``, ``rotary`` (tables ``(L, r)`` applied to queries and keys),
            ``rotary_interleaved``, as in :func:`multi_head_attention`; no ``memory``. ``None``: none of them.
        pairs: subset of ``("VV", "QQ", "KK", "VQ", "VK", "QK", "QKV")`` (default all; with a QK-norm that has
            weights also ``"N1N1"``, ``"N2N2"``, ``"N1N2"``).
        parts: which Hessian parts the iterative norms compute, a subset of ``("outer", "functional", "hessian")``
            (each costs its own Lanczos run; ``outer/VV`` is exact and always returned with ``VV``).
        lanczos: settings of the iterative norms (:class:`~curvwatch.closed_form.Lanczos`; default ``Lanczos()``:
            relative residual 1e-3, at most 100 steps and 16 vectors held per norm, a warning when a norm does not
            converge; ``EXACT`` runs each norm to the block size). Its ``warm_start`` starts each norm from the last
            call's Ritz vectors, as the monitor does across evaluations.
        dense: also return the dense blocks ``dense/{outer,functional,hessian}/XY`` of shape ``(n_X, n_Y)``
            (vec_r order, equal to ``torch.func.hessian`` reshaped) and ``dense/*/QKV``.
        terms: also return the bound terms ``term/...`` and the corrected bounds ``bound/...`` (default);
            False computes the norms only; ``"signals"`` only the terms the warning rules read
            (:mod:`curvwatch.rules`: ``term/x_norm``, ``term/x_norm6``, ``term/softmax_jac_norm``, ``term/wq_norm``,
            ``term/wk_norm``), the same numbers at a fraction of the cost, and no bounds.
        precondition: with ``output_samples``, any of ``{"W_Q": P_Q, "W_K": P_K, "W_V": P_V}``: the diagonal of a
            positive preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``), each shaped like that weight; and
            ``"lora/<name>"`` ``(A.numel() + B.numel(),)`` for an adapter of ``adapters``.
        adapters: with ``output_samples``, ``name -> LowRankUpdate`` (:class:`~curvwatch.closed_form.LowRankUpdate`):
            low-rank adapters on ``W_Q``, ``W_K``, ``W_V`` whose factors the optimizer steps (``weights`` holds the
            effective weights); their keys ``ggn/lora/<name>``, ``sharpness/lora/<name>``, ... (module docstring).

    Returns:
        Flat dict of 0-d tensors: ``outer/XY``, ``functional/XY``, ``hessian/XY`` (spectral norms) for XY in
        VV, QQ, KK, VQ, VK, QK and QKV, corrected bounds ``bound/XY`` (and ``bound/outer/XY``,
        ``bound/functional/XY``), and bound terms ``term/x_norm``, ``term/x_norm6``, ``term/softmax_jac_norm``
        (measured ``||dA/dT||_2``), ``term/softmax_hess_frob``, ``term/inv_L3`` (the papers' ``1/L^3``,
        valid only for uniform attention), ``term/w{q,k,v}_norm``, ``term/attn_entropy``.

        With ``output_samples``, for each diagonal pair ``XX`` of ``pairs`` (VV, QQ, KK), with ``J_X = dF/dW_X``,
        ``H_f,XX`` the functional block and ``C`` the samples' curvature: ``ggn/XX`` = ``lambda_max(J_X^T C J_X)``;
        ``sharpness/XX``, the largest *algebraic* eigenvalue of ``J_X^T C J_X + H_f,XX`` (the loss Hessian's block
        without the second-order part of the layers downstream of ``F``); with ``precondition`` holding ``W_X``,
        ``precond_ggn/XX`` and ``precond_sharpness/XX``, the same of ``P^{-1/2} (.) P^{-1/2}``; ``residual/...`` of
        each. All by Lanczos (VV too), whatever ``parts``.

    Raises:
        ValueError: on shape mismatches, a ``weights`` with ``W_O``, biases or several heads, a ``memory``, unless
            exactly one of ``target`` / ``grad_output`` is given, on ``output_samples`` / ``precondition`` with
            ``target``, and on ``precondition`` without ``output_samples``.

    Example:
        >>> X, W = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
        >>> W_V, T = torch.randn(3, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
        >>> out = self_attention(X, AttentionWeights(W, W, W_V), loss=OutputLoss(target=T))
        >>> bool(out["hessian/QQ"] <= out["bound/QQ"])
        True
    """
    what = dict(pairs=pairs, parts=parts, lanczos=Lanczos() if lanczos is None else lanczos, dense=dense, terms=terms)
    return _attention(_one_head_call(X, weights, loss, AttentionStructure() if structure is None else structure,
                                     precondition, adapters, what))  # fmt: skip


def multi_head_attention(
    X: torch.Tensor,
    weights: AttentionWeights,
    *,
    loss: OutputLoss,
    structure: AttentionStructure | None = None,
    pairs: Sequence[str] | None = None,
    parts: Sequence[str] = PARTS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    terms: bool | str = True,
    precondition: Mapping[str, torch.Tensor] | None = None,
    adapters: Mapping[str, LowRankUpdate] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-head closed-form Hessian blocks of multi-head attention with the output projection inside ``F``.

    ``F = concat_h(softmax(s P_h K_g^T) V_g) W_O + b_O`` with ``P_h = R(N_q(X W_Q^h + b_Q^h))``,
    ``K_g = R(N_k(X_kv W_K^g + b_K^g))``, ``V_g = X_kv W_V^g + b_V^g`` and ``g = h // (H / H_kv)``, the way real
    models compute attention (see :mod:`~curvwatch.closed_form.attention.operator`; by default ``R``, ``N`` are the
    identity, ``s = 1/sqrt(d_K)``, ``H_kv = H`` and ``X_kv = X``). Blocks are those of each head's (each group's) own
    weights.

    Args:
        X: ``(L, d)`` or ``(B, L, d)`` queries (and keys/values without ``memory``).
        weights: the block's weights (:class:`~curvwatch.closed_form.AttentionWeights`): ``W_Q`` ``(d, H d_K)``,
            ``W_K`` ``(d_kv, H_kv d_K)``, ``W_V`` ``(d_kv, H_kv d_V)``, ``W_O`` ``(H d_V, m)`` (required here),
            ``n_heads`` ``H``, ``n_kv_heads`` ``H_kv`` (grouped-query attention; ``H_kv = H`` gives bit-identical
            numbers), optional biases ``b_Q`` ``(H d_K,)``, ``b_K`` ``(H_kv d_K,)``, ``b_V`` ``(H_kv d_V,)``, ``b_O``
            ``(m,)``, and ``qk_norm``: the per-head QK-norm, whose own parameters are blocks ``N1`` (query norm: its
            weight, then its bias when it has one, ``(p, d_K)``) and ``N2`` (key norm), shared by every head; see
            Returns. OLMo 2 normalises the whole ``H d_K`` projection instead, which couples the heads: not this.
        loss: the loss at the output ``F`` ``(B, L, m)`` (:class:`~curvwatch.closed_form.OutputLoss`; default
            ``c = 2/(L m)``); its ``output_samples`` ``(k, B, L, m)`` (``(k, L, m)`` unbatched) as in
            :func:`self_attention` (padded query rows zeroed).
        structure: the masks and the score (:class:`~curvwatch.closed_form.AttentionStructure`): ``causal``,
            ``key_padding_mask`` ``(B, L)`` or ``(L,)``, ``window``, ``scale``, ``rotary`` ``(cos, sin)`` each
            ``(L, r)`` or ``(B, L, r)`` (self-attention only; see :func:`~curvwatch.closed_form.rotary.apply_rotary`),
            ``rotary_interleaved``, ``memory`` ``(B, L_kv, d_kv)`` (cross-attention: keys and values from it) and
            ``memory_padding_mask`` ``(B, L_kv)``. A query that sees no key at all has ``A = 0`` (output ``b_O``) and
            no curvature. ``None``: none of them.
        pairs, parts, lanczos, terms, dense: as in :func:`self_attention`; ``pairs`` may also name ``"N1N1"``,
            ``"N2N2"``, ``"N1N2"`` (the QK-norm parameters' blocks; in the default), left out where the call's
            ``qk_norm`` lacks that norm's parameters.
        precondition: with ``output_samples``, any of ``{"W_Q": P_Q, "W_K": P_K, "W_V": P_V}``, each positive and of
            that weight's packed shape (``(d, H d_K)`` etc.; its heads are split like the weight's): the diagonal of a
            preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``); and ``"qk_norm.weight_q"``, ``"qk_norm.bias_q"``,
            ``"qk_norm.weight_k"``, ``"qk_norm.bias_k"`` ``(d_K,)`` for the parameters ``qk_norm`` holds (block ``N1``
            / ``N2`` is preconditioned when every one of its parameters has an entry); and ``"lora/<name>"`` for an
            adapter of ``adapters``.
        adapters: as in :func:`self_attention`.

    Returns:
        The keys of :func:`self_attention` suffixed by head (``/h{i}``) or, with ``H_kv < H``, by kv group
        (``/g{j}``), the QK-norm parameters' blocks ``N1N1``, ``N2N2``, ``N1N2``, and with a memory
        ``term/memory_norm``: see this module's docstring. With ``qk_norm`` no ``bound/...`` key.

    Raises:
        ValueError: on shape mismatches or invalid options (the message says what is allowed), unless exactly one
            of ``target`` / ``grad_output`` is given, on ``output_samples`` / ``precondition`` with ``target``, and
            on ``precondition`` without ``output_samples``.

    Example:
        >>> X = torch.randn(5, 4, dtype=torch.float64)
        >>> W = lambda *s: torch.randn(*s, dtype=torch.float64)
        >>> weights = AttentionWeights(W(4, 4), W(4, 4), W(4, 4), W(4, 4), n_heads=2)
        >>> out = multi_head_attention(X, weights, loss=OutputLoss(grad_output=W(5, 4)),
        ...                            structure=AttentionStructure(causal=True))
        >>> sorted(k for k in out if k.startswith("hessian/QQ"))
        ['hessian/QQ/h0', 'hessian/QQ/h1']
        >>> gqa = AttentionWeights(W(4, 4), W(4, 2), W(4, 2), W(4, 4), n_heads=2, n_kv_heads=1)
        >>> out = multi_head_attention(X, gqa, loss=OutputLoss(grad_output=W(5, 4)))
        >>> sorted(k[len("hessian/") :] for k in out if k.startswith("hessian/"))  # doctest: +NORMALIZE_WHITESPACE
        ['KK/g0', 'QK/h0', 'QK/h1', 'QKV/g0', 'QQ/h0', 'QQ/h1', 'VK/g0', 'VQ/h0', 'VQ/h1', 'VV/g0']
    """
    what = dict(pairs=pairs, parts=parts, lanczos=Lanczos() if lanczos is None else lanczos, dense=dense, terms=terms)
    return _attention(_heads_call(X, weights, loss, AttentionStructure() if structure is None else structure,
                                  precondition, adapters, what))  # fmt: skip


@dataclass(eq=False)
class _Call:
    """One attention kernel call, checked: queries ``X`` ``(B, L, d)`` (``batched``: as passed), the weights per head
    and ``b_O`` ``(m,)``, the loss, the structure with its checked ``rotary`` (a :class:`~..rotary.Rotary`), ``qk_norm``
    (a :class:`~.._qk_norm.QKNorm`), ``scale``, ``window`` and ``memory`` ``(B, L_kv, d_kv)``, what to compute, whether
    it is :func:`self_attention`'s one head (``single``), ``precondition``: ``D = P^{-1/2}`` per block (``"Q"``,
    ``"K"``, ``"V"``, heads split), per QK-norm parameter (``"qk_norm.weight_q"``, ...) and per adapter
    (``"lora/<name>"``), and the checked ``adapters``."""

    X: torch.Tensor
    batched: bool
    heads: HeadWeights
    b_O: torch.Tensor | None
    loss: OutputLoss
    structure: AttentionStructure
    window: int | None
    scale: float | None
    rotary: object | None
    qk_norm: object | None
    memory: torch.Tensor | None
    pairs: Sequence[str] | None
    parts: Sequence[str]
    lanczos: Lanczos
    dense: bool
    terms: bool | str
    single: bool
    precondition: dict[str, torch.Tensor]
    adapters: dict[str, LowRankUpdate]


def _one_head_call(X, weights: AttentionWeights, loss: OutputLoss, structure: AttentionStructure, precondition,
                   adapters, what: dict) -> _Call:  # fmt: skip
    """The checked :class:`_Call` of :func:`self_attention` (``what``: pairs, parts, lanczos, dense, terms)."""
    _check_one_head(weights, structure)
    X3, batched = as_batched(X)
    d = X3.shape[-1]
    W_Q = check_weight(weights.W_Q, d, "W_Q", X3)
    W_K = check_weight(weights.W_K, d, "W_K", X3)
    W_V = check_weight(weights.W_V, d, "W_V", X3)
    if W_Q.shape != W_K.shape:
        raise ValueError(f"W_Q {tuple(W_Q.shape)} and W_K {tuple(W_K.shape)} must have the same shape (d, d_K).")
    shapes = {"W_Q": tuple(W_Q.shape), "W_K": tuple(W_K.shape), "W_V": tuple(W_V.shape)}
    adapters = check_adapters(adapters, shapes, X3, has_samples=loss.output_samples is not None)
    shapes.update(precondition_shapes(weights.qk_norm, W_Q.shape[-1]))  # the QK-norm's parameters, (d_K,) each
    shapes.update(adapter_shapes(adapters))  # "lora/<name>": (A.numel() + B.numel(),)
    pre = check_precondition(precondition, shapes, X3, has_samples=loss.output_samples is not None)  # D = P^{-1/2}
    heads = HeadWeights(W_Q.unsqueeze(0), W_K.unsqueeze(0), W_V.unsqueeze(0))
    options = _modern_options(structure, weights.qk_norm, W_Q.shape[-1], X3)
    # "W_Q" -> "Q": (1, d, d_K); "qk_norm.weight_q" stays, (d_K,)
    pre = {
        (nm[-1] if nm.startswith("W_") else nm): (D.unsqueeze(0) if nm.startswith("W_") else D) for nm, D in pre.items()
    }
    return _Call(X3, batched, heads, None, loss, structure, **options, memory=None, **what, single=True,
                 precondition=pre, adapters=adapters)  # fmt: skip


def _heads_call(X, weights: AttentionWeights, loss: OutputLoss, structure: AttentionStructure, precondition,
                adapters, what: dict) -> _Call:  # fmt: skip
    """The checked :class:`_Call` of :func:`multi_head_attention` (``what``: pairs, parts, lanczos, dense, terms)."""
    n_heads, H_kv = _check_heads(weights)
    X3, batched = as_batched(X)
    M3 = _memory(structure, X, X3, batched)
    heads, b_O, pre, adapters = _split_heads(weights, X3, n_heads, H_kv, M3, precondition, adapters, loss)
    options = _modern_options(structure, weights.qk_norm, heads.W_Q.shape[-1], X3)
    return _Call(X3, batched, heads, b_O, loss, structure, **options, memory=M3, **what, single=False, precondition=pre,
                 adapters=adapters)  # fmt: skip


def _check_one_head(weights: AttentionWeights, structure: AttentionStructure) -> None:
    """:func:`self_attention` takes one head without projection, biases or memory."""
    extra = [nm for nm in ("W_O", "b_Q", "b_K", "b_V", "b_O") if getattr(weights, nm) is not None]
    if extra or weights.n_heads != 1 or weights.n_kv_heads not in (None, 1):
        raise ValueError(
            f"self_attention takes one head without output projection or biases; got n_heads={weights.n_heads}, "
            f"n_kv_heads={weights.n_kv_heads}{', ' + ', '.join(extra) if extra else ''}. Use multi_head_attention."
        )
    if structure.memory is not None or structure.memory_padding_mask is not None:
        raise ValueError("self_attention has no memory (cross-attention): use multi_head_attention.")


def _check_heads(weights: AttentionWeights) -> tuple[int, int]:
    """``(H, H_kv)`` of ``weights``, checked."""
    n_heads, n_kv_heads = weights.n_heads, weights.n_kv_heads
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"Invalid n_heads={n_heads!r}. Must be an int >= 1.")
    H_kv = n_heads if n_kv_heads is None else n_kv_heads
    if isinstance(H_kv, bool) or not isinstance(H_kv, int) or H_kv < 1 or n_heads % H_kv:
        raise ValueError(
            f"Invalid n_kv_heads={n_kv_heads!r}. Must be an int >= 1 dividing n_heads={n_heads} (query head h reads kv "
            "head h // (n_heads / n_kv_heads)), or None for n_heads."
        )
    if weights.W_O is None:
        raise ValueError(
            "multi_head_attention needs W_O (H*d_V, m), the output projection (pass out_proj.weight.T); one head "
            "without projection is self_attention."
        )
    return n_heads, H_kv


def _memory(structure: AttentionStructure, X: torch.Tensor, X3: torch.Tensor, batched: bool) -> torch.Tensor | None:
    """The cross-attention memory ``(B, L_kv, d_kv)`` in ``X``'s dtype and device, or None (self-attention)."""
    memory = structure.memory
    if memory is None:
        if structure.memory_padding_mask is not None:
            raise ValueError(
                "memory_padding_mask needs memory= (cross-attention); self-attention pads with key_padding_mask."
            )
        return None
    M3, mem_batched = as_batched(memory, "memory")
    B = X3.shape[0]
    if mem_batched != batched or M3.shape[0] != B:
        raise ValueError(
            f"memory {tuple(memory.shape)} must be batched like X {tuple(X.shape)}: (B, L_kv, d_kv) with B = {B}, "
            "or (L_kv, d_kv) for an unbatched X."
        )
    if structure.rotary is not None:
        raise ValueError(
            "rotary= applies to self-attention only: in cross-attention queries and keys sit at different positions. "
            "Drop rotary or memory."
        )
    return M3.to(dtype=X3.dtype, device=X3.device)


def _split_heads(weights: AttentionWeights, X3, n_heads: int, H_kv: int, M3, precondition, adapters, loss: OutputLoss):
    """``(HeadWeights, b_O, precondition, adapters)``: the packed weights checked and split per head, the
    preconditioner's ``D = P^{-1/2}`` per block (``"W_Q"`` -> ``"Q"``: ``(heads, d, d_K)``; ``"qk_norm.weight_q"``
    stays ``(d_K,)``, ``"lora/<name>"`` ``(size,)``), the checked adapters."""
    d = X3.shape[-1]
    d_kv = d if M3 is None else M3.shape[-1]
    W_Q = split_heads(check_weight(weights.W_Q, d, "W_Q", X3), n_heads, "W_Q")
    W_K = split_heads(check_weight(weights.W_K, d_kv, "W_K", X3), H_kv, "W_K")
    W_V = split_heads(check_weight(weights.W_V, d_kv, "W_V", X3), H_kv, "W_V")
    if W_Q.shape[-1] != W_K.shape[-1]:
        raise ValueError(
            f"W_Q and W_K must have the same shape per head (d_K columns each); got {tuple(W_Q.shape)} for "
            f"{n_heads} query heads and {tuple(W_K.shape)} for {H_kv} kv heads (pass n_kv_heads= for grouped-query "
            "attention)."
        )
    W_O = weights.W_O
    if W_O.ndim != 2 or W_O.shape[0] != n_heads * W_V.shape[-1]:
        raise ValueError(
            f"W_O must have shape (H*d_V, m) = ({n_heads * W_V.shape[-1]}, m) as used in concat(heads) @ W_O; "
            f"got {tuple(W_O.shape)} (pass out_proj.weight.T)."
        )
    W_O = split_heads(W_O.to(dtype=X3.dtype, device=X3.device), n_heads, "W_O", per_head_cols=False)
    H, _, d_K = W_Q.shape
    d_V = W_V.shape[-1]
    # the shapes the weights were passed with (check_weight and split_heads accepted them)
    shapes = {"W_Q": (d, H * d_K), "W_K": (d_kv, H_kv * d_K), "W_V": (d_kv, H_kv * d_V)}
    adapters = check_adapters(adapters, shapes, X3, has_samples=loss.output_samples is not None)
    shapes.update(precondition_shapes(weights.qk_norm, d_K))  # "qk_norm.weight_q": (d_K,), ... (the norm's parameters)
    shapes.update(adapter_shapes(adapters))  # "lora/<name>": (A.numel() + B.numel(),)
    pre = check_precondition(precondition, shapes, X3, has_samples=loss.output_samples is not None)  # D = P^{-1/2}
    n_of = {"W_Q": H, "W_K": H_kv, "W_V": H_kv}
    pre = {
        (nm[-1] if nm in n_of else nm): (split_heads(D, n_of[nm], f"precondition[{nm!r}]") if nm in n_of else D)
        for nm, D in pre.items()
    }  # "W_Q" -> "Q": (heads, d, d_K); "qk_norm.weight_q" stays, (d_K,)
    b_Q = check_like(weights.b_Q, (H * d_K,), "b_Q", X3)
    b_K = check_like(weights.b_K, (H_kv * d_K,), "b_K", X3)
    b_V = check_like(weights.b_V, (H_kv * d_V,), "b_V", X3)
    b_O = check_like(weights.b_O, (W_O.shape[-1],), "b_O", X3)
    heads = HeadWeights(
        W_Q,
        W_K,
        W_V,
        W_O,
        b_Q=None if b_Q is None else b_Q.reshape(H, d_K),
        b_K=None if b_K is None else b_K.reshape(H_kv, d_K),
        b_V=None if b_V is None else b_V.reshape(H_kv, d_V),
    )
    return heads, b_O, pre, adapters


def _modern_options(structure: AttentionStructure, qk_norm, d_K: int, X3: torch.Tensor) -> dict:
    """The checked ``window``, ``scale``, ``rotary`` and ``qk_norm`` of a call."""
    window, scale = structure.window, structure.scale
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"Invalid window={window!r}. Must be an int >= 1 (keys i - w < j <= i with causal) or None.")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf
    ):
        raise ValueError(f"Invalid scale={scale!r}. Must be a finite number > 0, or None for 1/sqrt(d_K).")
    B, L, _ = X3.shape
    rotary = structure.rotary
    rot = None if rotary is None else check_rotary(rotary, structure.rotary_interleaved, B, L, d_K, X3)
    return {"window": window, "scale": scale, "rotary": rot, "qk_norm": check_qk_norm(qk_norm, d_K, X3)}


def _attention(call: _Call) -> dict[str, torch.Tensor]:
    """The keys of one checked call: the forward pass, the exact norms, the Lanczos and sampled norms in one solve,
    the terms, the dense blocks and the QK-norm parameters' blocks, in that order."""
    terms = call.terms
    if not (isinstance(terms, bool) or terms == "signals"):
        raise ValueError(f"Invalid terms={terms!r}. Must be True, False or 'signals'.")
    fwd = _forward(call)
    op = fwd.op
    pairs, n_pairs, parts = _resolve_pairs(call, op)
    keys = Suffixes(call.single, op.H, op.H_kv)
    vv_exact, sq, norms = _exact_norms(call, fwd, pairs)
    out, sop, views = _norm_keys(call, fwd, pairs, parts, vv_exact, sq, keys)
    if terms == "signals":
        out.update(signal_terms(op, norms, keys))
    elif terms:
        target = call.loss.target is not None
        out.update(terms_and_bounds(fwd, norms, keys, target=target, bounds=call.qk_norm is None))
    if call.dense:
        if op.G == 1:
            out.update(dense_blocks(op, ATTENTION_PAIRS, full=("Q", "K", "V")))
        else:
            qv, gv = views
            out.update(dense_blocks(qv, QUERY_PAIRS))
            out.update(group_keys(dense_blocks(gv, GROUP_PAIRS, full=("Q", "K", "V"))))
    if n_pairs or call.dense:  # the QK-norm parameters' blocks, after every other key (which they leave unchanged)
        norm_pre = block_precondition(op, call.precondition or {})
        out.update(qk_norm_norms(op, n_pairs, parts=parts, lanczos=call.lanczos, dense=call.dense, sampled_op=sop,
                                 precondition=norm_pre))  # fmt: skip
    call.lanczos.warn_unconverged(out, "self_attention" if call.single else "multi_head_attention")
    return out


def _forward(call: _Call) -> Forward:
    """The operator's forward pass (which also gives the output the loss convention needs), the loss's cotangent and
    curvature, and the checked output samples."""
    X3, loss, structure, heads = call.X, call.loss, call.structure, call.heads
    B, L, d = X3.shape
    H, H_kv = heads.W_Q.shape[0], heads.W_K.shape[0]
    G = H // H_kv
    cross = call.memory is not None
    L_kv = call.memory.shape[1] if cross else L
    keep, row_keep, kv_keep = attention_masks(
        B, L, L_kv, structure.causal, call.window, structure.key_padding_mask, structure.memory_padding_mask, cross,
        X3.device,
    )  # fmt: skip
    op = AttentionOperator(
        X3, heads, keep, row_keep, suffix_heads=not call.single, memory=call.memory, rotary=call.rotary,
        scale=call.scale, qk_norm=call.qk_norm,
        # the warnings' terms alone (and the exact VV): the attention is all the forward must give
        probs_only=call.terms == "signals" and loss.target is None and loss.output_samples is None and not call.dense
        and call.pairs is not None and set(call.pairs) <= {"VV"} and (G == 1 or heads.W_O is not None),
    )  # fmt: skip
    if loss.target is not None:
        F = op.output(call.b_O)
    else:  # grad_output mode reads only the output's shape, dtype and device
        F = X3.new_zeros(()).expand(B, L, op.d_V if heads.W_O is None else heads.W_O.shape[-1])
    g, c, resid = output_cotangent(
        F,
        row_keep,
        target=loss.target,
        grad_output=loss.grad_output,
        output_curvature=loss.output_curvature,
        batched=call.batched,
    )
    op.set_cotangent(g, c)
    samples = check_output_samples(
        loss.output_samples, target=loss.target, out_shape=tuple(F.shape), batched=call.batched, row_keep=row_keep,
        ref=X3,
    )  # fmt: skip
    return Forward(X3, op, g, c, resid, row_keep, kv_keep, samples)


def _resolve_pairs(call: _Call, op: AttentionOperator) -> tuple[tuple[str, ...], list[str], tuple[str, ...]]:
    """``(the attention's pairs, the QK-norm parameters' pairs, the parts)`` of the call, checked."""
    pairs = (*ATTENTION_PAIRS, *NORM_PAIRS) if call.pairs is None else tuple(call.pairs)
    for p in pairs:
        if p not in ATTENTION_PAIRS and p not in NORM_PAIRS and p != "QKV":
            raise ValueError(f"Unknown attention pair {p!r}; choose from {ATTENTION_PAIRS + ('QKV',) + NORM_PAIRS}.")
    n_pairs = norm_pairs(op, pairs)  # those of a QK-norm with parameters: N1N1, N2N2, N1N2
    pairs = tuple(p for p in pairs if p not in NORM_PAIRS)
    return pairs, n_pairs, check_parts(call.parts)


def _exact_norms(call: _Call, fwd: Forward, pairs: tuple[str, ...]) -> tuple[bool, dict, dict]:
    """``(whether VV is exact, squared norms, spectral norms)``: every exact spectral norm of the evaluation in one
    batched call (one ``eigvalsh`` per Gram size)."""
    op, X3, terms = fwd.op, call.X, call.terms
    W_O = call.heads.W_O
    mats: dict[str, torch.Tensor] = {}
    vv_exact = "VV" in pairs and op.G == 1 and op.vv_exact(op.Xkv.shape[-1], call.lanczos.max_iter)
    if vv_exact:
        mats["vv"] = op.vv_factor()  # (H, B L, d_kv)
    if W_O is not None and ("VV" in pairs or terms is True):
        mats["wo"] = W_O
    if terms:  # ||X||_2 per sequence over the kept rows, and the projections the rules read
        kpm = call.structure.key_padding_mask
        x_kept = X3 if kpm is None else X3 * fwd.row_keep.unsqueeze(-1).to(X3.dtype)
        mats.update(x=x_kept, wq=call.heads.W_Q, wk=call.heads.W_K)
    if terms is True:  # and every other norm of the bound terms
        mats.update(P=op.P, K=op.K_kv, V=op.V_kv, wv=call.heads.W_V)
        if call.memory is not None:
            mats["mem"] = call.memory * fwd.kv_keep.unsqueeze(-1).to(X3.dtype)
    sq, norms = spectral_norms_of(mats)
    return vv_exact, sq, norms


def _norm_keys(call: _Call, fwd: Forward, pairs, parts, vv_exact: bool, sq: dict, keys: Suffixes):
    """``(keys, the operator with sampled curvature or None, the grouped-query views or None)``: the Lanczos norms of
    the pairs, the ``VV`` norm, the whole ``QKV`` Hessian and the sampled keys.

    The sampled keys' Gram columns first (no Lanczos basis is held yet); then the ``VV`` run, the engine's runs (the
    query view's and the group view's with grouped-query attention) and the sampled keys' in shared solves (their
    stopping tests share host reads), within ``lanczos.solve_bytes`` of bases."""
    op, lanczos = fwd.op, call.lanczos
    G = op.G
    iterative = [p for p in pairs if p not in ("VV", "QKV")]
    full = "QKV" in pairs or pairs == ATTENTION_PAIRS
    sop = splan = None
    if fwd.samples is not None:
        sop = with_sampled(op, SampledCurvature.of_heads(fwd.samples, call.heads.W_O))
        diagonal = [p for p in pairs if p in ("VV", "QQ", "KK")]
        if G == 1:
            s_views = [(diagonal, None, ("VV",))]
        else:  # as the other keys: QQ per query head, VV and KK per kv group
            q_diag, g_diag = [p for p in diagonal if p in QUERY_PAIRS], [p for p in diagonal if p in GROUP_PAIRS]
            s_views = [(q_diag, QueryView, ()), (g_diag, GroupView, ("VV",))]
        splan = sampled_plan(sop, s_views, lanczos=lanczos, scale=call.precondition)
    aplan = None
    if fwd.samples is not None and call.adapters:  # the adapters' keys: every head an adapter moves, together
        on = {"W_Q": ("Q", op.H), "W_K": ("K", op.H_kv), "W_V": ("V", op.H_kv)}
        aplan = adapted_plan(sop, call.adapters, on, lanczos=lanczos, scale=call.precondition,
                             apply_kwargs={"mix": "all"})  # fmt: skip
    vv_plan = views = None
    if G == 1:
        if "VV" in pairs and not vv_exact:  # the d x d Gram's lambda_max by Lanczos (d > 256)
            vv_plan = op.vv_gram_plan(lanczos)
        op_views = [(op, iterative)]
    else:  # grouped-query attention: blocks with Q per query head, the others per kv group
        views = qv, gv = QueryView(op), GroupView(op)
        if "VV" in pairs:
            vv_plan = grouped_vv_plan(gv, lanczos)
        op_views = [(qv, [p for p in iterative if p in QUERY_PAIRS]), (gv, [p for p in iterative if p in GROUP_PAIRS])]
    extra = [p for p in (splan, aplan) if p is not None]
    plans = [spectral_plan(op_views, parts=parts, lanczos=lanczos)] + extra
    solved = solve_planned(([vv_plan] if vv_plan is not None else []) + plans, lanczos.solve_bytes)
    vv_of = solved.pop(0) if vv_plan is not None else None
    norms_of = solved.pop(0)
    sampled_of = solved.pop(0) if splan is not None else None
    adapted_of = solved.pop(0) if aplan is not None else None
    out: dict[str, torch.Tensor] = {}
    if G == 1 and "VV" in pairs:
        out.update(_vv_keys(op, lanczos, sq, vv_of, keys))
    elif G > 1 and "VV" in pairs:
        out.update(vv_of)
    out.update(norms_of[0])
    if G > 1:
        out.update(group_keys(norms_of[1]))
    if full:
        if G == 1:
            out.update(full_norms(op, ["Q", "K", "V"], "QKV", parts=parts, lanczos=lanczos))
        else:
            out.update(group_keys(full_norms(views[1], ["Q", "K", "V"], "QKV", parts=parts, lanczos=lanczos)))
    if sampled_of is not None:
        out.update(sampled_of[0])
        if G > 1:
            out.update(group_keys(sampled_of[1]))
    if adapted_of is not None:
        out.update(adapted_of[0])
    return out, sop, views


def _vv_keys(op: AttentionOperator, lanczos: Lanczos, sq: dict, vv_of, keys: Suffixes) -> dict[str, torch.Tensor]:
    """The ``VV`` keys of ``G = 1``: ``||H_o(VV)||`` exact in closed form (its Gram's ``lambda_max`` from the exact
    norms, or from its Lanczos run ``vv_of``, ``(lambda_max, relative residual)``), ``H_f(VV) = 0``."""
    out: dict[str, torch.Tensor] = {}
    gram, rel = (sq.get("vv"), None) if vv_of is None else vv_of
    vv = op.outer_vv_norm(lanczos, gram=gram, wo2=sq.get("wo"))
    zero = torch.zeros((), dtype=op.dtype, device=op.device)
    rel = None if rel is None else rel.unbind()
    for h, (key, v) in enumerate(zip(keys.hk("VV"), vv.unbind(), strict=True)):
        out[f"outer/{key}"] = v
        out[f"functional/{key}"] = zero
        out[f"hessian/{key}"] = v
        if rel is not None:
            out[f"residual/outer/{key}"] = out[f"residual/hessian/{key}"] = rel[h]
    return out
