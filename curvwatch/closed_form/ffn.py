"""Closed-form Hessian blocks of the feed-forward sub-block ``S = act(Y W_1 + b_1) W_2 + b_2 (+ Y)``.

Formula sheet §5, with ``Z = Y W_1 + b_1`` (pre-activation), ``Hid = act(Z)`` and ``g = dl/dS``:

* Jacobians: ``dS = (act'(Z) * (Y dW_1)) W_2 + Hid dW_2``.
* Outer blocks ``c J^T J``; exactly ``||H_o(W2W2)|| = lambda_max(sum_b c_b Hid_b^T Hid_b)`` (Kronecker ``x I``).
* Functional blocks: ``H_f(W2W2) = 0``; ``H_f(W1,W2) dW_2 = Y^T ((g dW_2^T) * act'(Z))`` (non-zero even for ReLU:
  this is where FFN curvature comes from); ``H_f(W1,W1) dW_1 = Y^T ((Y dW_1) * act''(Z) * (g W_2^T))``, zero
  a.e. for ReLU, as large as the cross term for GELU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ._common import (
    as_batched,
    check_like,
    check_row_mask,
    check_weight,
    gram_lambda_max,
    output_cotangent,
    shared_times,
    times_shared,
)
from ._operator import (
    KINDS,
    BlockOperator,
    ParamInfo,
    _check_kinds,
    _rows_times,
    dense_blocks,
    norms_with_a_linear_pair,
    run_parts,
    select_rows,
)
from ._sampled import SampledCurvature, check_output_samples, check_precondition, sampled_plan, with_sampled
from .settings import Lanczos

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
        # (2.4 vs 7.6 us at 8 x 32). It has no autograd formula, so it reads Z detached when Z requires grad.
        pos = torch.heaviside(Z.detach() if Z.requires_grad else Z, zero)
        # torch.relu: one kernel (1.8 us at 8 x 32 vs 9 us for Z * (Z > 0).to(Z.dtype)); equal to that product
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
        sampled: a :class:`~curvwatch.closed_form._sampled.SampledCurvature` applied as the output curvature
            instead of ``c`` (set on a copy by :func:`~curvwatch.closed_form._sampled.with_sampled`), or None.
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
        u = None if outer_mask is None else _rows_times(self._outer_cotangent(dS), outer_mask)
        if func_mask is None:
            return self._pull(u, None, None, None, False, outputs)
        return self._pull(u, *(_rows_times(t, func_mask) for t in (dZ, dHid, dW2)), True, outputs)

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
    W_1: torch.Tensor,
    W_2: torch.Tensor,
    *,
    b_1: torch.Tensor | None = None,
    b_2: torch.Tensor | None = None,
    activation: str = "relu",
    residual: bool = True,
    target: torch.Tensor | None = None,
    grad_output: torch.Tensor | None = None,
    output_curvature: float | None = None,
    row_mask: torch.Tensor | None = None,
    pairs=None,
    kinds=KINDS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    output_samples: torch.Tensor | None = None,
    precondition: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Closed-form Hessian blocks of a feed-forward sub-block in its weights ``W_1`` and ``W_2``.

    Args:
        Y: ``(L, d)`` or ``(B, L, d)`` input.
        W_1: ``(d, f)``; W_2: ``(f, m)`` (math convention); b_1 ``(f,)``, b_2 ``(m,)`` optional.
        activation: ``"relu"``, ``"gelu"`` (exact erf) or ``"gelu_tanh"``.
        residual: add ``Y`` to the output (needs ``m = d``; does not change the weight Hessian).
        target, grad_output, output_curvature: loss convention as in
            :func:`curvwatch.closed_form.self_attention` (``c = 2/(L m)``).
        row_mask: ``(B, L)`` bool, True = token included.
        pairs: subset of ``("W1W1", "W2W2", "W1W2")``.
        kinds: subset of ``("outer", "functional", "hessian")`` for the iterative norms.
        lanczos: settings of the iterative norms (:class:`~curvwatch.closed_form.Lanczos`; default
            ``Lanczos()``: tol 1e-3, at most 100 steps and 16 vectors held per norm, a warning if one does not
            converge).
        dense: also return ``dense/{outer,functional,hessian}/XY``.
        output_samples: ``(k, B, L, m)`` (``(k, L, m)`` for an unbatched ``Y``), grad_output mode only: ``k``
            sampled gradients ``s_j`` of the loss in the output ``S``. They define the Monte-Carlo output curvature
            ``C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T`` (block diagonal over the sequences ``b``, rows dropped by
            ``row_mask`` zeroed) that replaces ``c`` in the sampled keys below; the existing keys are unchanged.
        precondition: with ``output_samples``, ``{"W_1": P_1, "W_2": P_2}`` (either or both): the diagonal of a
            positive preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``), each shaped like that weight.

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
        ``P^{-1/2} (.) P^{-1/2}``; and ``residual/...`` of each (all by Lanczos, whatever ``kinds``).

    Raises:
        ValueError: on invalid shapes or options, ``output_samples`` / ``precondition`` with ``target``, or
            ``precondition`` without ``output_samples``.

    Example:
        >>> Y, T = torch.randn(6, 3, dtype=torch.float64), torch.zeros(6, 3, dtype=torch.float64)
        >>> out = ffn(Y, torch.randn(3, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64), target=T)
        >>> float(out["functional/W2W2"])
        0.0
    """
    Y3, batched = as_batched(Y, "Y")
    B, L, d = Y3.shape
    W_1 = check_weight(W_1, d, "W_1", Y3)
    W_2 = check_weight(W_2, W_1.shape[1], "W_2", Y3)
    b_1 = check_like(b_1, (W_1.shape[1],), "b_1", Y3)
    b_2 = check_like(b_2, (W_2.shape[1],), "b_2", Y3)
    if residual and W_2.shape[1] != d:
        raise ValueError(
            f"residual=True needs W_2 to map back to d={d}; got W_2 {tuple(W_2.shape)}. Pass residual=False."
        )
    keep = check_row_mask(row_mask, B, L, Y3)
    keep = torch.ones(B, L, dtype=torch.bool, device=Y3.device) if keep is None else keep
    pairs = FFN_PAIRS if pairs is None else tuple(pairs)
    iterative = [p for p in pairs if p != "W2W2"]
    m = W_2.shape[1]
    samples = check_output_samples(
        output_samples, target=target, out_shape=(B, L, m), batched=batched, row_keep=keep, ref=Y3
    )
    pre = check_precondition(
        precondition, {"W_1": tuple(W_1.shape), "W_2": tuple(W_2.shape)}, Y3, has_samples=samples is not None
    )
    # the operator (and act', act'') serves the Lanczos and dense products only
    need_op = bool(iterative) or dense or samples is not None
    Z = Y3 @ W_1 + (0 if b_1 is None else b_1)  # (B, L, f)
    if need_op:
        Hid, a1, a2 = activation_derivatives(Z, activation)
    else:
        Hid = activation_value(Z, activation)
    if target is not None:
        S = Hid @ W_2 + (0 if b_2 is None else b_2) + (Y3 if residual else 0)
    else:  # grad_output mode reads only the output's shape, dtype and device
        S = Y3.new_zeros(()).expand(B, L, m)
    g, c, _ = output_cotangent(
        S, keep, target=target, grad_output=grad_output, output_curvature=output_curvature, batched=batched
    )
    relu = activation == "relu"
    lz = Lanczos() if lanczos is None else lanczos
    for p in pairs:
        if p not in FFN_PAIRS:
            raise ValueError(f"Unknown FFN pair {p!r}; choose from {FFN_PAIRS}.")
    kinds = _check_kinds(kinds)
    op = FFNOperator(Y3, Hid, a1, a2, W_1, W_2, g, c, keep, act2_is_zero=relu) if need_op else None
    out: dict[str, torch.Tensor] = {}
    # every exact norm in one call (one eigvalsh per Gram size); masked tokens excluded from the statistics
    kf = None if row_mask is None else keep.unsqueeze(-1).to(Y3.dtype)  # (B, L, 1)
    mats = [Y3 if kf is None else Y3 * kf, Hid if kf is None else Hid * kf, W_1, W_2]
    if "W2W2" in pairs:
        mats.append((Hid * (c.sqrt()[:, None, None] * keep[..., None])).reshape(B * L, -1))  # sqrt(c_b) Hid
    y2, h2, w1, w2, *hk = gram_lambda_max(*mats)  # squared norms: (B,), (B,), (), (), [()]
    if "W2W2" in pairs:
        o = hk[0].clamp_min(0)  # ||H_o(W2W2)|| = lambda_max(sum_b c_b Hid_b^T Hid_b)
        out["outer/W2W2"] = o
        out["functional/W2W2"] = torch.zeros_like(o)
        out["hessian/W2W2"] = o
    splan = None
    if samples is not None:  # the sampled keys' Gram columns first: no Lanczos basis is held yet
        sop = with_sampled(op, SampledCurvature.of_tokens(samples))
        blocks = {"W_1": "W1", "W_2": "W2"}
        diagonal = [p for p in pairs if p in ("W1W1", "W2W2")]
        scale = {blocks[nm]: D for nm, D in pre.items()}
        splan = sampled_plan(sop, [(diagonal, None, ("W2W2",))], lanczos=lz, scale=scale)  # F linear in W_2
    # ReLU: act'' = 0, so H_f(W1W1) = 0 exactly and the Hessian block is its outer part: one Lanczos run. The engine's
    # runs and the sampled keys' in one solve
    out.update(norms_with_a_linear_pair(op, iterative, "W1W1" if relu else None, kinds=kinds, lanczos=lz, extra=splan))
    pos = Z > 0  # (B, L, f)
    Zk = Z  # pre-activations of the kept tokens, the others at -inf
    if row_mask is not None:
        pos = pos & keep.unsqueeze(-1)
        Zk = Z.masked_fill(~keep.unsqueeze(-1), float("-inf"))
    n_kept = Z.shape[-1] * (B * L if row_mask is None else keep.sum())
    # units never active on a kept token (max over tokens <= 0; a NaN max counts as active, like before)
    out["dead_fraction"] = (Zk.amax((0, 1)) <= 0).to(Y3.dtype).mean()
    out["active_fraction"] = torch.count_nonzero(pos).to(Y3.dtype) / n_kept
    out["term/y_norm"], out["term/hidden_norm"] = (t.amax().clamp_min(0).sqrt() for t in (y2, h2))
    out["term/w1_norm"], out["term/w2_norm"] = (t.clamp_min(0).sqrt() for t in (w1, w2))
    if dense:
        out.update(dense_blocks(op, FFN_PAIRS))
    lz.warn_unconverged(out, "ffn")
    return out
