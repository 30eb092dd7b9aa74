"""Closed-form Hessian blocks of the feed-forward sub-block ``S = act(Y W_1 + b_1) W_2 + b_2 (+ Y)``.

With ``Z = Y W_1 + b_1`` (pre-activation), ``Hid = act(Z)`` and ``g = dl/dS``:

* Jacobians: ``dS = (act'(Z) * (Y dW_1)) W_2 + Hid dW_2``.
* Outer blocks ``c J^T J``; exactly ``||H_o(W2W2)|| = lambda_max(sum_b c_b Hid_b^T Hid_b)`` (Kronecker ``x I``).
* Functional blocks: ``H_f(W2W2) = 0``; ``H_f(W1,W2) dW_2 = Y^T ((g dW_2^T) * act'(Z))`` (non-zero even for ReLU:
  this is where FFN curvature comes from); ``H_f(W1,W1) dW_1 = Y^T ((Y dW_1) * act''(Z) * (g W_2^T))``, zero
  a.e. for ReLU, as large as the cross term for GELU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ._common import as_batched, check_like, check_row_mask, check_weight, output_cotangent
from .adapted import adapted_plan, adapter_shapes, check_adapters
from .inputs import FFNWeights, LowRankUpdate, OutputLoss
from .settings import PARTS, Lanczos, check_parts
from .solver.linalg import gram_lambda_max, shared_times, times_shared
from .solver.operator import BlockOperator, ParamInfo, dense_blocks, rows_times, run_parts, select_rows
from .solver.plan import Planned, norms_with_a_linear_pair
from .solver.sampled import SampledCurvature, check_output_samples, check_precondition, with_sampled
from .solver.sampled_keys import sampled_plan

FFN_PAIRS = ("W1W1", "W2W2", "W1W2")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def activation_derivatives(Z: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(act(Z), act'(Z), act''(Z))`` for ``relu``, exact ``gelu`` (erf) and ``gelu_tanh`` (GPT-2's gelu_new).

    ReLU's second derivative is 0 almost everywhere (we take ``act'(0) = 0``, like autograd).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"Unknown activation={activation!r}. Use one of {ACTIVATIONS}.")
    if activation == "relu":
        zero = torch.zeros_like(Z)
        # act' = 1[Z > 0] (0 at NaN) in Z's dtype: heaviside(Z, 0) is bitwise (Z > 0).to(Z.dtype) in one kernel
        # (the comparison and the cast are two). It has no autograd formula, so it reads Z detached when Z requires
        # grad.
        pos = torch.heaviside(Z.detach() if Z.requires_grad else Z, zero)
        # torch.relu: one kernel (Z * (Z > 0).to(Z.dtype) is three); equal to that product
        # except +0 (not -0) for Z < 0 and 0 (not NaN) for Z = -inf
        return torch.relu(Z), pos, zero
    if activation == "gelu":
        phi = torch.exp(-0.5 * Z * Z) / math.sqrt(2 * math.pi)
        Phi = 0.5 * (1 + torch.erf(Z / math.sqrt(2.0)))
        return Z * Phi, Phi + Z * phi, phi * (2 - Z * Z)
    if activation == "gelu_tanh":
        k = 0.044715
        u = _SQRT_2_PI * (Z + k * Z**3)
        du = _SQRT_2_PI * (1 + 3 * k * Z * Z)
        d2u = _SQRT_2_PI * 6 * k * Z
        th = torch.tanh(u)
        sech2 = 1 - th * th
        a = 0.5 * Z * (1 + th)
        a1 = 0.5 * (1 + th) + 0.5 * Z * sech2 * du
        a2 = sech2 * du + 0.5 * Z * (-2 * th * sech2 * du * du + sech2 * d2u)
        return a, a1, a2


def activation_value(Z: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(Z)`` alone, by the same formulas as :func:`activation_derivatives` (for the exact-only path)."""
    if activation == "relu":
        return torch.relu(Z)
    if activation == "gelu":
        return Z * (0.5 * (1 + torch.erf(Z / math.sqrt(2.0))))
    return activation_derivatives(Z, activation)[0]


class FFNOperator(BlockOperator):
    """Closed-form Hessian operator of the FFN weights ``W1 (d, f)`` and ``W2 (f, m)``.

    The sequences are flattened to their ``N = B L`` tokens: the FFN acts token by token, so every product
    is a plain ``(N, .)`` matmul (no small per-sequence matmuls).

    Args:
        Y: ``(B, L, d)`` input; Hid, act1, act2: ``(B, L, f)`` activation and its first two derivatives.
        W_1: ``(d, f)``; W_2: ``(f, m)``; g: ``(B, L, m)`` cotangent at the output; c: ``(B,)`` output
            curvature; row_keep: ``(B, L)`` tokens in the loss.
        act2_is_zero: True for ReLU (``act'' = 0``: the W1W1 functional term vanishes and is skipped).

    Attributes:
        sampled: a :class:`~curvwatch.closed_form.solver.sampled.SampledCurvature` applied as the output curvature
            instead of ``c`` (set on a copy by :func:`~curvwatch.closed_form.solver.sampled.with_sampled`), or None.
    """

    supports_subsets = True
    supports_total = True
    sampled = None

    def __init__(self, Y, Hid, act1, act2, W_1, W_2, g, c, row_keep, act2_is_zero=False):
        B, L, d = Y.shape
        N = B * L
        self.Y, self.Hid, self.act1 = Y.reshape(N, d), Hid.reshape(N, -1), act1.reshape(N, -1)  # (N, .)
        self.W_2, self.g = W_2, g.reshape(N, -1)
        self.YT, self.HidT = self.Y.mT, self.Hid.mT  # (transposed views made once)
        self.act2_is_zero = act2_is_zero
        self.ck = (c[:, None] * row_keep.to(Y.dtype)).reshape(N, 1)  # output curvature per token, 0 if dropped
        self.params = {"W1": ParamInfo(tuple(W_1.shape), False), "W2": ParamInfo(tuple(W_2.shape), False)}
        self.n_heads = 1
        self.head_diagonal = True
        self.dtype, self.device = Y.dtype, Y.device
        # the W1W1 functional factor, (N, f); never used when act'' = 0
        self.gHid_a2 = None if act2_is_zero else (self.g @ W_2.mT) * act2.reshape(N, -1)

    def apply(self, tangent, outputs=("W1", "W2"), outer_rows=None, func_rows=None, total_rows=None):
        """``(H_o v, H_f v)`` for the weight blocks in ``outputs``; a missing tangent name is a zero perturbation.

        ``tangent`` maps ``"W1"`` / ``"W2"`` to ``(n, d, f)`` / ``(n, f, m)``. ``outer_rows`` / ``func_rows``
        (index tensors, default all) select the tangents that need each part; the returned tensors hold only
        those rows, in that order. With ``total_rows`` a third dict holds ``H v = (H_o + H_f) v`` for those
        rows, computed in one fused pass.
        """
        dZ, dHid, dW2, dS = self._tangents(tangent)

        def part(idx, outer: bool, second_order: bool) -> dict:
            u = self._outer_cotangent(select_rows(dS, idx)) if outer else None
            if not second_order:
                return self._pull(u, None, None, None, False, outputs)
            return self._pull(u, select_rows(dZ, idx), select_rows(dHid, idx), select_rows(dW2, idx), True, outputs)

        return run_parts(part, outer_rows, func_rows, total_rows)

    def weight_gradient(self, outputs=("W1", "W2")) -> dict[str, torch.Tensor]:
        """``G = J^T g``, the gradient of the loss in each weight block of ``outputs`` (``(d, f)``, ``(f, m)``)."""
        return {nm: G[0] for nm, G in self._pull(self.g.unsqueeze(0), None, None, None, False, outputs).items()}

    def _tangents(self, tangent, output: bool = True):
        """``(dZ, dHid, dW2, dS)``: the tangents of the pre-activation ``(n, N, f)``, the hidden activation, the
        ``W2`` perturbation itself and (with ``output``) the output ``(n, N, m)`` (None where nothing moves them)."""
        dW1, dW2 = tangent.get("W1"), tangent.get("W2")
        dZ = None if dW1 is None else shared_times(self.Y, dW1)  # (n, N, f)
        dHid = None if dZ is None else self.act1 * dZ
        if not output:  # (the functional part alone does not need the output's tangent)
            return dZ, dHid, dW2, None
        dS = None if dHid is None else dHid @ self.W_2  # (n, N, m)
        if dW2 is not None:
            t = shared_times(self.Hid, dW2)
            dS = t if dS is None else dS.add_(t)
        return dZ, dHid, dW2, dS

    def apply_masked(self, tangent, outputs, outer_mask, func_mask):
        """Every row's ``H_kind v`` in one pass (see :meth:`AttentionOperator.apply_masked
        <curvwatch.closed_form.attention.AttentionOperator.apply_masked>`)."""
        dZ, dHid, dW2, dS = self._tangents(tangent, output=outer_mask is not None)
        u = None if outer_mask is None else rows_times(self._outer_cotangent(dS), outer_mask)
        if func_mask is None:
            return self._pull(u, None, None, None, False, outputs)
        return self._pull(u, *(rows_times(t, func_mask) for t in (dZ, dHid, dW2)), True, outputs)

    def _outer_cotangent(self, dS: torch.Tensor) -> torch.Tensor:
        """``u = C dS`` for output tangents ``(n, N, m)``: the stand-in ``c`` per token (0 on dropped ones) or the
        sampled curvature."""
        return dS * self.ck if self.sampled is None else self.sampled(dS)

    def _pull(self, u, dZ, dHid, dW2, second_order, outputs):
        """Weight gradients of the output cotangent ``u`` ``(n, N, m)`` (or None) plus, with ``second_order``,
        the g-contracted second derivatives for the tangent ``(dZ, dHid, dW2)``; both parts share the final
        ``Y^T`` / ``Hid^T`` products."""
        ref = next(t for t in (u, dZ, dW2) if t is not None)
        n = ref.shape[0]
        out = {}
        if "W1" in outputs:
            gZ = None if u is None else u @ self.W_2.mT  # cotangent at the hidden activation, (n, N, f)
            if second_order and dW2 is not None:
                t = shared_times(self.g, dW2.mT)
                gZ = t if gZ is None else gZ.add_(t)
            gZ = None if gZ is None else gZ.mul_(self.act1)
            if second_order and dZ is not None and not self.act2_is_zero:
                t = self.gHid_a2 * dZ
                gZ = t if gZ is None else gZ.add_(t)
            out["W1"] = self._zeros(n, "W1") if gZ is None else shared_times(self.YT, gZ)
        if "W2" in outputs:
            w2 = None if u is None else shared_times(self.HidT, u)
            if second_order and dHid is not None:
                t = times_shared(dHid.mT, self.g)
                w2 = t if w2 is None else w2.add_(t)
            out["W2"] = self._zeros(n, "W2") if w2 is None else w2
        return out


def ffn(
    Y: torch.Tensor,
    weights: FFNWeights,
    *,
    activation: str = "relu",
    residual: bool = True,
    loss: OutputLoss,
    row_mask: torch.Tensor | None = None,
    pairs: Sequence[str] | None = None,
    parts: Sequence[str] = PARTS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    precondition: Mapping[str, torch.Tensor] | None = None,
    adapters: Mapping[str, LowRankUpdate] | None = None,
) -> dict[str, torch.Tensor]:
    """Closed-form Hessian blocks of a feed-forward sub-block in its weights ``W_1`` and ``W_2``.

    Args:
        Y: ``(L, d)`` or ``(B, L, d)`` input.
        weights: ``W_1`` ``(d, f)``, ``W_2`` ``(f, m)`` (math convention), optional ``b_1`` ``(f,)``, ``b_2``
            ``(m,)`` (:class:`~curvwatch.closed_form.FFNWeights`).
        activation: ``"relu"``, ``"gelu"`` (exact erf) or ``"gelu_tanh"``.
        residual: add ``Y`` to the output ``S`` (needs ``m = d``; does not change the weight Hessian).
        loss: the loss at the output ``S`` ``(L, m)`` or ``(B, L, m)`` (:class:`~curvwatch.closed_form.OutputLoss`, as
            in :func:`curvwatch.closed_form.self_attention`; ``c = 2/(L m)``). Its ``output_samples`` ``(k, B, L, m)``
            (``(k, L, m)`` unbatched) define the Monte-Carlo output curvature ``C = sum_b (1/k) sum_j s_{j,b}
            s_{j,b}^T`` (rows dropped by ``row_mask`` zeroed) of the sampled keys below.
        row_mask: ``(B, L)`` bool, True = token included.
        pairs: subset of ``("W1W1", "W2W2", "W1W2")``.
        parts: subset of ``("outer", "functional", "hessian")`` for the iterative norms.
        lanczos: settings of the iterative norms (:class:`~curvwatch.closed_form.Lanczos`; default ``Lanczos()``).
        dense: also return ``dense/{outer,functional,hessian}/XY``.
        precondition: with ``output_samples``, ``{"W_1": P_1, "W_2": P_2}`` (either or both): the diagonal of a
            positive preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``), each shaped like that weight; and
            ``"lora/<name>"`` ``(A.numel() + B.numel(),)`` for an adapter of ``adapters`` (its ``[vec A, vec B]``).
        adapters: with ``output_samples``, ``name -> LowRankUpdate`` (:class:`~curvwatch.closed_form.LowRankUpdate`):
            low-rank adapters on ``W_1`` / ``W_2`` whose factors the optimizer steps (``weights`` holds the effective
            weights); see Returns.

    Returns:
        0-d tensors ``outer/XY``, ``functional/XY``, ``hessian/XY``, ``dead_fraction`` (hidden units never
        active on the kept tokens), ``active_fraction`` (mean fraction of positive pre-activations),
        ``term/y_norm``, ``term/hidden_norm``, ``term/w1_norm``, ``term/w2_norm``.

        With ``output_samples``, for each diagonal pair ``XX`` of ``pairs`` (``W1W1``, ``W2W2``), with ``J_X`` the
        Jacobian of ``S`` in ``W_X`` and ``H_f,XX`` the functional block (``G = grad_output``):
        ``ggn/XX`` = ``lambda_max(J_X^T C J_X)``; ``sharpness/XX``, the largest *algebraic* eigenvalue of
        ``J_X^T C J_X + H_f,XX`` (the block of the loss Hessian, except the second-order part of the layers
        downstream of ``S``, which ``C`` leaves out; negative when ``H_f`` dominates with negative curvature);
        with ``precondition`` holding ``W_X``, ``precond_ggn/XX`` and ``precond_sharpness/XX``, the same of
        ``P^{-1/2} (.) P^{-1/2}``; and ``residual/...`` of each (all by Lanczos, whatever ``parts``).

        With ``adapters``, the same keys of each adapter's parameters ``theta = [vec A, vec B]`` (the curvature of
        the loss in ``theta`` by the chain rule, :mod:`curvwatch.closed_form.adapted`): ``ggn/lora/<name>``,
        ``sharpness/lora/<name>``, with its preconditioner ``precond_ggn/lora/<name>``,
        ``precond_sharpness/lora/<name>``.

    Raises:
        ValueError: on invalid shapes or options, ``output_samples`` / ``precondition`` with ``target``, or
            ``precondition`` / ``adapters`` without ``output_samples``.

    Example:
        >>> Y, T = torch.randn(6, 3, dtype=torch.float64), torch.zeros(6, 3, dtype=torch.float64)
        >>> weights = FFNWeights(torch.randn(3, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64))
        >>> out = ffn(Y, weights, loss=OutputLoss(target=T))
        >>> float(out["functional/W2W2"])
        0.0
    """
    Y3, batched = as_batched(Y, "Y")
    W_1, W_2, b_1, b_2, keep = _checked_weights(Y3, weights, residual, row_mask)
    B, L, _ = Y3.shape
    pairs = FFN_PAIRS if pairs is None else tuple(pairs)
    iterative = [p for p in pairs if p != "W2W2"]
    m = W_2.shape[1]
    samples = check_output_samples(
        loss.output_samples, target=loss.target, out_shape=(B, L, m), batched=batched, row_keep=keep, ref=Y3
    )
    shapes = {"W_1": tuple(W_1.shape), "W_2": tuple(W_2.shape)}
    adapters = check_adapters(adapters, shapes, Y3, has_samples=samples is not None)
    pre = check_precondition(precondition, {**shapes, **adapter_shapes(adapters)}, Y3, has_samples=samples is not None)
    # the operator (and act', act'') serves the Lanczos and dense products only
    need_op = bool(iterative) or dense or samples is not None
    Z = Y3 @ W_1 + (0 if b_1 is None else b_1)  # (B, L, f)
    if need_op:
        Hid, a1, a2 = activation_derivatives(Z, activation)
    else:
        Hid = activation_value(Z, activation)
    S = None
    if loss.target is not None:
        S = Hid @ W_2 + (0 if b_2 is None else b_2) + (Y3 if residual else 0)
    g, c = loss_cotangent(S, loss, keep, (B, L, m), batched, Y3)
    relu, lz = activation == "relu", Lanczos() if lanczos is None else lanczos
    if any(p not in FFN_PAIRS for p in pairs):
        raise ValueError(f"Unknown FFN pair {next(p for p in pairs if p not in FFN_PAIRS)!r}; choose from {FFN_PAIRS}.")
    parts = check_parts(parts)
    op = FFNOperator(Y3, Hid, a1, a2, W_1, W_2, g, c, keep, act2_is_zero=relu) if need_op else None
    out, terms = exact_keys(Y3, Hid, {"w1_norm": W_1, "w2_norm": W_2}, c, keep, row_mask, "W2W2" in pairs)
    # the sampled keys' Gram columns first (no Lanczos basis is held yet); S is linear in W_2
    splans = token_sampled_plan(op, samples, pairs, {"W_1": "W1", "W_2": "W2"}, pre, ("W2W2",), lz, adapters)
    # ReLU: act'' = 0, so H_f(W1W1) = 0 exactly and the Hessian block is its outer part: one Lanczos run. The engine's
    # runs and the sampled keys' in one solve
    out.update(norms_with_a_linear_pair(op, iterative, "W1W1" if relu else None, parts=parts, lanczos=lz, extra=splans))
    out.update(_activity(Z, keep, row_mask, Y3.dtype))
    out.update(terms)
    if dense:
        out.update(dense_blocks(op, FFN_PAIRS))
    lz.warn_unconverged(out, "ffn")
    return out


def loss_cotangent(F, loss: OutputLoss, keep: torch.Tensor, shape: tuple[int, int, int], batched: bool, ref):
    """``(g, c)``: the cotangent ``dl/dF`` ``(B, L, m)`` and the output curvature ``(B,)`` of the loss at the output
    ``F`` of ``shape`` (computed in target mode only: grad_output mode reads only its shape, dtype and device)."""
    if F is None:
        F = ref.new_zeros(()).expand(*shape)
    g, c, _ = output_cotangent(F, keep, target=loss.target, grad_output=loss.grad_output,
                               output_curvature=loss.output_curvature, batched=batched)  # fmt: skip
    return g, c


def token_sampled_plan(
    op, samples, pairs, blocks: dict[str, str], pre: dict, linear: tuple[str, ...], lanczos, adapters=None
) -> list[Planned]:
    """The sampled keys' plans of a token-wise block (FFN, gated FFN): its diagonal pairs of ``pairs`` with the samples
    ``(k, B, L, m)`` as output curvature (:func:`~.solver.sampled_keys.sampled_plan`), ``pre`` (``D`` per weight
    argument) renamed to the operator's ``blocks``, ``linear`` the pairs whose functional block is zero; then, with
    ``adapters`` (:func:`~.adapted.check_adapters`), their keys' plan (:func:`~.adapted.adapted_plan`, ``pre``'s
    ``"lora/<name>"``); none without samples."""
    if samples is None:
        return []
    sop = with_sampled(op, SampledCurvature.of_tokens(samples))
    diagonal = [p for p in pairs if p[: len(p) // 2] == p[len(p) // 2 :]]
    scale = {blocks[nm]: D for nm, D in pre.items() if nm in blocks}
    plans = [sampled_plan(sop, [(diagonal, None, linear)], lanczos=lanczos, scale=scale)]
    if adapters:
        on = {w: (block, None) for w, block in blocks.items()}
        plans.append(adapted_plan(sop, adapters, on, lanczos=lanczos, scale=pre))
    return plans


def _checked_weights(Y3: torch.Tensor, weights: FFNWeights, residual: bool, row_mask):
    """``(W_1, W_2, b_1, b_2, keep)`` checked against the input ``Y3`` ``(B, L, d)``, in its dtype and device;
    ``keep`` ``(B, L)`` bool (all True without ``row_mask``)."""
    B, L, d = Y3.shape
    W_1 = check_weight(weights.W_1, d, "W_1", Y3)
    W_2 = check_weight(weights.W_2, W_1.shape[1], "W_2", Y3)
    b_1 = check_like(weights.b_1, (W_1.shape[1],), "b_1", Y3)
    b_2 = check_like(weights.b_2, (W_2.shape[1],), "b_2", Y3)
    if residual and W_2.shape[1] != d:
        raise ValueError(
            f"residual=True needs W_2 to map back to d={d}; got W_2 {tuple(W_2.shape)}. Pass residual=False."
        )
    keep = check_row_mask(row_mask, B, L, Y3)
    keep = torch.ones(B, L, dtype=torch.bool, device=Y3.device) if keep is None else keep
    return W_1, W_2, b_1, b_2, keep


def exact_keys(Y3, Hid, weights: dict[str, torch.Tensor], c, keep, row_mask, w2w2: bool) -> tuple[dict, dict]:
    """``(W2W2 keys, terms)`` of a token-wise block (FFN, gated FFN) from every exact norm in one call (one
    ``eigvalsh`` per Gram size; masked tokens excluded from the statistics): with ``w2w2`` the keys of the output
    weight's block, in which the output is linear, ``outer`` and ``hessian`` ``lambda_max(sum_b c_b Hid_b^T Hid_b)``
    and ``functional`` 0; the terms ``term/y_norm``, ``term/hidden_norm`` (max over sequences) and the spectral norms
    ``term/{name}`` of ``weights``.

    Args:
        Y3: ``(B, L, d)`` input; Hid: ``(B, L, f)`` hidden activations; weights: ``term name -> weight``;
            c: ``(B,)`` output curvature; keep: ``(B, L)`` kept tokens; row_mask: the kernel's argument.
    """
    B, L, _ = Y3.shape
    kf = None if row_mask is None else keep.unsqueeze(-1).to(Y3.dtype)  # (B, L, 1)
    mats = [Y3 if kf is None else Y3 * kf, Hid if kf is None else Hid * kf, *weights.values()]
    if w2w2:
        mats.append((Hid * (c.sqrt()[:, None, None] * keep[..., None])).reshape(B * L, -1))  # sqrt(c_b) Hid
    y2, h2, *squared = gram_lambda_max(*mats)  # squared norms: (B,), (B,), () per weight, [()]
    out = {}
    if w2w2:
        o = squared.pop().clamp_min(0)
        out = {"outer/W2W2": o, "functional/W2W2": torch.zeros_like(o), "hessian/W2W2": o}
    terms = {"term/y_norm": y2.amax().clamp_min(0).sqrt(), "term/hidden_norm": h2.amax().clamp_min(0).sqrt()}
    terms.update((f"term/{name}", t.clamp_min(0).sqrt()) for name, t in zip(weights, squared, strict=True))
    return out, terms


def _activity(Z: torch.Tensor, keep: torch.Tensor, row_mask, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``dead_fraction`` and ``active_fraction`` of the pre-activations ``Z`` ``(B, L, f)`` over the kept tokens."""
    B, L, f = Z.shape
    pos = Z > 0  # (B, L, f)
    Zk = Z  # pre-activations of the kept tokens, the others at -inf
    if row_mask is not None:
        pos = pos & keep.unsqueeze(-1)
        Zk = Z.masked_fill(~keep.unsqueeze(-1), float("-inf"))
    n_kept = f * (B * L if row_mask is None else keep.sum())
    # units never active on a kept token (max over tokens <= 0; a NaN max counts as active)
    return {
        "dead_fraction": (Zk.amax((0, 1)) <= 0).to(dtype).mean(),
        "active_fraction": torch.count_nonzero(pos).to(dtype) / n_kept,
    }
