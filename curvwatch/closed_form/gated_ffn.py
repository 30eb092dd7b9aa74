"""Closed-form Hessian blocks of a gated MLP (SwiGLU, GeGLU): ``F = (act(Y W_g + b_g) * (Y W_u + b_u)) W_d + b_d``.

**Block names.** The three weights are named as in the LLaMA code (``w1`` gate, ``w3`` up, ``w2`` down):
``W1`` = ``W_gate`` ``(d, f)``, ``W3`` = ``W_up`` ``(d, f)``, ``W2`` = ``W_down`` ``(f, m)``. The pair keys are
``W1W1, W3W3, W2W2`` (diagonal) and ``W1W3, W1W2, W3W2`` (cross), e.g. ``hessian/W1W3`` = gate x up. The names
read as two ``[A-Z][0-9]*`` units, as :func:`curvwatch.metrics.pair_of` and the pair parser expect.

Per token (rows of ``Y``; the MLP acts token by token), with ``Z_g = Y W_g + b_g``, ``Z_u = Y W_u + b_u``,
``A = act(Z_g)``, ``A'``, ``A''`` its derivatives, the gated hidden ``Hid = A * Z_u``, ``g = dl/dF`` and
``R = g W_d^T`` (the cotangent at ``Hid``):

* Jacobian: ``dHid = A' * Z_u * (Y dW1) + A * (Y dW3)``, ``dF = dHid W_d + Hid dW2``. Its transpose maps a
  cotangent ``u`` to ``(Y^T (P * A' * Z_u), Y^T (P * A), Hid^T u)`` with ``P = u W_d^T``.
* Outer blocks ``c J^T J``. Exactly ``||H_o(W2W2)|| = lambda_max(sum_b c_b Hid_b^T Hid_b)`` (``(.) x I_m``).
  ``H_o(W3W3) = sum_n c_n (y_n y_n^T) x (diag(a_n) W_d W_d^T diag(a_n))`` is a sum of Kronecker products whose
  factors both change from token to token: no factorisation, and its explicit Grams are ``(N m)^2`` or
  ``(d f)^2``, so it goes through Lanczos like the other blocks.
* Functional blocks, from the second differential of ``<g, F>``,
  ``<R, A'' * Z_u * dZ_g^2 + 2 A' * dZ_g * dZ_u> + 2 <g, dHid dW2>``:
  ``H_f v = (Y^T (R A'' Z_u dZ_g + R A' dZ_u + A' Z_u (g dW2^T)), Y^T (R A' dZ_g + A (g dW2^T)), dHid^T g)``.
  ``H_f(W2W2) = 0`` (``F`` is linear in ``W_d``) and ``H_f(W3W3) = 0`` (``Z_u`` enters once: ``F`` is linear
  in ``W_u`` for fixed ``W_g, W_d``), so ``hessian/W3W3 = outer/W3W3`` and ``hessian/W2W2 = outer/W2W2``.
  The gate needs ``A''``: ``H_f(W1W1) != 0`` for every smooth gate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ._common import as_batched, check_like, check_row_mask, check_weight
from .adapted import adapter_shapes, check_adapters
from .ffn import activation_derivatives, activation_value, exact_keys, loss_cotangent, token_sampled_plan
from .inputs import GatedFFNWeights, LowRankUpdate, OutputLoss
from .settings import PARTS, Lanczos, check_parts
from .solver.linalg import shared_times, times_shared
from .solver.operator import BlockOperator, ParamInfo, dense_blocks, rows_times, run_parts, select_rows
from .solver.plan import norms_with_a_linear_pair
from .solver.sampled import check_output_samples, check_precondition

__all__ = [
    "GATED_ACTIVATIONS",
    "GATED_FFN_PAIRS",
    "GATE_OFF",
    "GatedFFNOperator",
    "gated_activation_derivatives",
    "gated_ffn",
]

#: Pair names: ``W1`` = gate, ``W3`` = up, ``W2`` = down (LLaMA's w1, w3, w2); diagonal pairs first.
GATED_FFN_PAIRS = ("W1W1", "W3W3", "W2W2", "W1W3", "W1W2", "W3W2")
#: ``"silu"``: SwiGLU (LLaMA, Mistral, Qwen); ``"gelu_tanh"`` (Gemma's gelu_pytorch_tanh), ``"gelu"``: GeGLU.
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
#: A gate pre-activation below this is "off": ``|silu| < 0.073``, ``|silu'| < 0.054``, ``|gelu| < 1.3e-4``.
GATE_OFF = -4.0


def _check_activation(activation: str) -> None:
    if activation not in GATED_ACTIVATIONS:
        raise ValueError(
            f"Unknown activation={activation!r} for a gated MLP. Use one of {GATED_ACTIVATIONS}: 'silu' for "
            "SwiGLU (LLaMA, Mistral, Qwen; hidden_act='silu'), 'gelu_tanh' for Gemma's GeGLU "
            "(hidden_act='gelu_pytorch_tanh'), 'gelu' for the exact (erf) GeGLU."
        )


def gated_activation_derivatives(Z: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(act(Z), act'(Z), act''(Z))`` of a gate: ``silu``, exact ``gelu`` (erf) or ``gelu_tanh``.

    SiLU, with ``s = sigmoid(Z)``: ``silu = Z s``, ``silu' = s (1 + Z (1 - s))``,
    ``silu'' = s (1 - s) (2 + Z (1 - 2 s))``. The GELUs are those of
    :func:`curvwatch.closed_form.ffn.activation_derivatives`.

    Example:
        >>> a, a1, a2 = gated_activation_derivatives(torch.zeros(1, dtype=torch.float64), "silu")
        >>> float(a), float(a1), float(a2)
        (0.0, 0.5, 0.5)
    """
    _check_activation(activation)
    if activation == "silu":
        s = torch.sigmoid(Z)
        return Z * s, s * (1 + Z * (1 - s)), s * (1 - s) * (2 + Z * (1 - 2 * s))
    return activation_derivatives(Z, activation)


def _activation_value(Z: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(Z)`` alone, by the formulas of :func:`gated_activation_derivatives` (the exact-only path)."""
    return Z * torch.sigmoid(Z) if activation == "silu" else activation_value(Z, activation)


def _acc(total: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    """``total + term``, in place on ``total`` (always a fresh product here), or ``term`` when ``total`` is None."""
    return term if total is None else total.add_(term)


class GatedFFNOperator(BlockOperator):
    """Closed-form Hessian operator of a gated MLP's weights ``W1`` (gate), ``W3`` (up), ``W2`` (down).

    The sequences are flattened to their ``N = B L`` tokens: every product is a plain ``(N, .)`` matmul.

    Args:
        Y: ``(B, L, d)`` input; Z_up: ``(B, L, f)`` up projection; act, act1, act2: ``(B, L, f)`` the gate
            activation and its first two derivatives at ``Z_g``.
        W_down: ``(f, m)``; g: ``(B, L, m)`` cotangent at the output; c: ``(B,)`` output curvature;
            row_keep: ``(B, L)`` tokens in the loss.

    Attributes:
        sampled: a sampled output curvature used instead of ``c``, as in
            :class:`~curvwatch.closed_form.ffn.FFNOperator`.
    """

    supports_subsets = True
    supports_total = True
    sampled = None

    def __init__(self, Y, Z_up, act, act1, act2, W_down, g, c, row_keep):
        B, L, d = Y.shape
        N, f = B * L, Z_up.shape[-1]
        Zu, A, A1 = Z_up.reshape(N, f), act.reshape(N, f), act1.reshape(N, f)  # (N, f)
        self.Y, self.W_down, self.g = Y.reshape(N, d), W_down, g.reshape(N, -1)
        self.A = A  # dHid / dZ_u
        self.A1Zu = A1 * Zu  # dHid / dZ_g
        self.Hid = A * Zu  # dF / dW2 factor
        self.YT, self.HidT = self.Y.mT, self.Hid.mT  # (transposed views made once)
        self.ck = (c[:, None] * row_keep.to(Y.dtype)).reshape(N, 1)  # output curvature per token, 0 if dropped
        R = self.g @ W_down.mT  # cotangent at Hid, (N, f)
        self.RA1 = R * A1  # d^2 <g, F> / dZ_g dZ_u
        self.RA2Zu = R * act2.reshape(N, f) * Zu  # d^2 <g, F> / dZ_g^2
        self.params = {
            "W1": ParamInfo((d, f), False),
            "W3": ParamInfo((d, f), False),
            "W2": ParamInfo(tuple(W_down.shape), False),
        }
        self.n_heads = 1
        self.head_diagonal = True
        self.dtype, self.device = Y.dtype, Y.device

    def apply(self, tangent, outputs=("W1", "W3", "W2"), outer_rows=None, func_rows=None, total_rows=None):
        """``(H_o v, H_f v)`` for the weight blocks in ``outputs``; a missing tangent name is a zero perturbation.

        ``tangent`` maps ``"W1"`` / ``"W3"`` / ``"W2"`` to ``(n, d, f)`` / ``(n, d, f)`` / ``(n, f, m)``.
        ``outer_rows`` / ``func_rows`` / ``total_rows`` as in :meth:`FFNOperator.apply
        <curvwatch.closed_form.ffn.FFNOperator.apply>`.
        """
        dZg, dZu, dHid, dW2, dF = self._tangents(tangent)

        def part(idx, outer: bool, second_order: bool) -> dict:
            u = self._outer_cotangent(select_rows(dF, idx)) if outer else None
            if not second_order:
                return self._pull(u, None, None, None, None, False, outputs)
            sel = (select_rows(t, idx) for t in (dZg, dZu, dHid, dW2))
            return self._pull(u, *sel, True, outputs)

        return run_parts(part, outer_rows, func_rows, total_rows)

    def weight_gradient(self, outputs=("W1", "W3", "W2")) -> dict[str, torch.Tensor]:
        """``G = J^T g``, the gradient of the loss in each weight block of ``outputs`` (``(d, f)``, ``(d, f)``,
        ``(f, m)``)."""
        grads = self._pull(self.g.unsqueeze(0), None, None, None, None, False, outputs)
        return {nm: G[0] for nm, G in grads.items()}

    def _tangents(self, tangent, output: bool = True):
        """``(dZg, dZu, dHid, dW2, dF)``: the tangents of the gate and up pre-activations ``(n, N, f)``, the hidden
        activation, the ``W2`` perturbation itself and (with ``output``) the output ``(n, N, m)`` (None where nothing
        moves them)."""
        dW1, dW3, dW2 = tangent.get("W1"), tangent.get("W3"), tangent.get("W2")
        dZg = None if dW1 is None else shared_times(self.Y, dW1)  # (n, N, f)
        dZu = None if dW3 is None else shared_times(self.Y, dW3)  # (n, N, f)
        dHid = None if dZg is None else self.A1Zu * dZg
        if dZu is not None:
            dHid = _acc(dHid, self.A * dZu)
        if not output:  # (the functional part alone does not need the output's tangent)
            return dZg, dZu, dHid, dW2, None
        dF = None if dHid is None else dHid @ self.W_down  # (n, N, m)
        if dW2 is not None:
            dF = _acc(dF, shared_times(self.Hid, dW2))
        return dZg, dZu, dHid, dW2, dF

    def apply_masked(self, tangent, outputs, outer_mask, func_mask):
        """Every row's ``H_kind v`` in one pass (see :meth:`AttentionOperator.apply_masked
        <curvwatch.closed_form.attention.AttentionOperator.apply_masked>`)."""
        dZg, dZu, dHid, dW2, dF = self._tangents(tangent, output=outer_mask is not None)
        u = None if outer_mask is None else rows_times(self._outer_cotangent(dF), outer_mask)
        if func_mask is None:
            return self._pull(u, None, None, None, None, False, outputs)
        return self._pull(u, *(rows_times(t, func_mask) for t in (dZg, dZu, dHid, dW2)), True, outputs)

    def _outer_cotangent(self, dF: torch.Tensor) -> torch.Tensor:
        """``u = C dF`` for output tangents ``(n, N, m)``: the stand-in ``c`` per token or the sampled curvature."""
        return dF * self.ck if self.sampled is None else self.sampled(dF)

    def _pull(self, u, dZg, dZu, dHid, dW2, second_order, outputs):
        """Weight gradients of the output cotangent ``u`` ``(n, N, m)`` (or None) plus, with ``second_order``,
        the g-contracted second derivatives for the tangent ``(dZg, dZu, dHid, dW2)``; both parts share the
        final ``Y^T`` / ``Hid^T`` products."""
        n = next(t for t in (u, dZg, dZu, dW2) if t is not None).shape[0]
        P = None if u is None else u @ self.W_down.mT  # cotangent at Hid, (n, N, f)
        if second_order and dW2 is not None:
            P = _acc(P, shared_times(self.g, dW2.mT))
        out = {}
        if "W1" in outputs:
            t = None if P is None else P * self.A1Zu
            if second_order and dZg is not None:
                t = _acc(t, self.RA2Zu * dZg)
            if second_order and dZu is not None:
                t = _acc(t, self.RA1 * dZu)
            out["W1"] = self._zeros(n, "W1") if t is None else shared_times(self.YT, t)
        if "W3" in outputs:
            t = None if P is None else P * self.A
            if second_order and dZg is not None:
                t = _acc(t, self.RA1 * dZg)
            out["W3"] = self._zeros(n, "W3") if t is None else shared_times(self.YT, t)
        if "W2" in outputs:
            t = None if u is None else shared_times(self.HidT, u)
            if second_order and dHid is not None:
                t = _acc(t, times_shared(dHid.mT, self.g))
            out["W2"] = self._zeros(n, "W2") if t is None else t
        return out


def gated_ffn(
    Y: torch.Tensor,
    weights: GatedFFNWeights,
    *,
    activation: str = "silu",
    loss: OutputLoss,
    row_mask: torch.Tensor | None = None,
    pairs: Sequence[str] | str | None = None,
    parts: Sequence[str] = PARTS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    precondition: Mapping[str, torch.Tensor] | None = None,
    adapters: Mapping[str, LowRankUpdate] | None = None,
) -> dict[str, torch.Tensor]:
    """Closed-form Hessian blocks of a gated MLP (SwiGLU / GeGLU) in its three weights.

    ``F = (act(Y W_gate + b_gate) * (Y W_up + b_up)) W_down + b_down``; the residual is not part of the block
    (it does not change the weight Hessian). **Block names:** ``W1`` = ``W_gate``, ``W3`` = ``W_up``,
    ``W2`` = ``W_down`` (LLaMA's w1, w3, w2), so ``hessian/W1W3`` is the gate x up block.

    Args:
        Y: ``(L, d)`` or ``(B, L, d)`` input.
        weights: ``W_gate``, ``W_up`` ``(d, f)``; ``W_down`` ``(f, m)`` (math convention: pass
            ``gate_proj.weight.T`` etc.); optional ``b_gate``, ``b_up`` ``(f,)``, ``b_down`` ``(m,)``
            (:class:`~curvwatch.closed_form.GatedFFNWeights`).
        activation: ``"silu"`` (SwiGLU), ``"gelu_tanh"`` (Gemma) or ``"gelu"`` (exact erf).
        loss: the loss at the output ``F`` ``(L, m)`` or ``(B, L, m)`` (:class:`~curvwatch.closed_form.OutputLoss`, as
            in :func:`curvwatch.closed_form.ffn`; ``c = 2/(L m)``); its ``output_samples`` ``(k, B, L, m)`` (``(k, L,
            m)`` unbatched) define the Monte-Carlo output curvature of the sampled keys below.
        row_mask: ``(B, L)`` bool (``(L,)`` unbatched), True = token included.
        pairs: subset of ``("W1W1", "W3W3", "W2W2", "W1W3", "W1W2", "W3W2")``.
        parts: subset of ``("outer", "functional", "hessian")`` for the iterative norms.
        lanczos: settings of the iterative norms (:class:`~curvwatch.closed_form.Lanczos`; default ``Lanczos()``).
        dense: also return ``dense/{outer,functional,hessian}/XY`` for the six pairs (small sizes only).
        precondition: with ``output_samples``, any of ``{"W_gate": P_g, "W_up": P_u, "W_down": P_d}``: the diagonal
            of a positive preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``), each shaped like that weight; and
            ``"lora/<name>"`` for an adapter of ``adapters``, as in :func:`curvwatch.closed_form.ffn`.
        adapters: with ``output_samples``, low-rank adapters on ``W_gate``, ``W_up``, ``W_down`` whose factors the
            optimizer steps, as in :func:`curvwatch.closed_form.ffn` (their keys ``ggn/lora/<name>``, ...).

    Returns:
        0-d tensors ``outer/XY``, ``functional/XY``, ``hessian/XY`` (with ``residual/{part}/XY`` for the Lanczos
        ones; ``W2W2`` is exact, ``functional/W2W2 = functional/W3W3 = 0`` exactly), and the statistics
        over the kept tokens: ``gate_saturation`` (fraction of gate pre-activations below ``GATE_OFF = -4``,
        where the gate is off and passes almost no gradient), ``dead_fraction`` (hidden units whose gate is
        below ``GATE_OFF`` on every kept token), ``active_fraction`` (fraction of positive gate
        pre-activations), ``term/y_norm`` (``max_b ||Y_b||_2``), ``term/hidden_norm`` (``max_b ||Hid_b||_2``
        of the gated hidden ``Hid = act(Z_g) * Z_u``), ``term/wgate_norm``, ``term/wup_norm``,
        ``term/wdown_norm`` (spectral norms).

        With ``output_samples``, for each diagonal pair ``XX`` of ``pairs`` (``W1W1``, ``W3W3``, ``W2W2``), the keys
        ``ggn/XX``, ``sharpness/XX`` (``precond_...`` with ``precondition`` holding that weight) and ``residual/...``
        of :func:`curvwatch.closed_form.ffn` (``H_f,XX`` is zero for ``W3W3`` and ``W2W2``).

    Raises:
        ValueError: on an unknown ``activation``, pair or part, inconsistent shapes, unless exactly one of
            ``target`` and ``grad_output`` is given, on ``output_samples`` / ``precondition`` with ``target``, and
            on ``precondition`` / ``adapters`` without ``output_samples``.

    Example:
        >>> Y, G = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
        >>> weights = GatedFFNWeights(*(torch.randn(*s, dtype=torch.float64) for s in ((3, 5), (3, 5), (5, 2))))
        >>> out = gated_ffn(Y, weights, loss=OutputLoss(grad_output=G))
        >>> float(out["functional/W2W2"]), float(out["functional/W3W3"]), bool(out["functional/W1W1"] > 0)
        (0.0, 0.0, True)
    """
    _check_activation(activation)
    Y3, batched = as_batched(Y, "Y")
    W_gate, W_up, W_down, b_gate, b_up, b_down, keep = _checked_weights(Y3, weights, row_mask)
    B, L, _ = Y3.shape
    f, m = W_down.shape
    pairs = _checked_pairs(pairs)
    parts = check_parts(parts)
    iterative = [p for p in pairs if p != "W2W2"]
    samples = check_output_samples(
        loss.output_samples, target=loss.target, out_shape=(B, L, m), batched=batched, row_keep=keep, ref=Y3
    )
    shapes = {"W_gate": tuple(W_gate.shape), "W_up": tuple(W_up.shape), "W_down": tuple(W_down.shape)}
    adapters = check_adapters(adapters, shapes, Y3, has_samples=samples is not None)
    pre = check_precondition(precondition, {**shapes, **adapter_shapes(adapters)}, Y3, has_samples=samples is not None)
    # act', act'' and the operator serve the Lanczos and dense products only
    need_op = bool(iterative) or dense or samples is not None
    Z_g = Y3 @ W_gate + (0 if b_gate is None else b_gate)  # (B, L, f)
    Z_u = Y3 @ W_up + (0 if b_up is None else b_up)  # (B, L, f)
    value = None if need_op else _activation_value(Z_g, activation)
    A, A1, A2 = gated_activation_derivatives(Z_g, activation) if need_op else (value, None, None)
    Hid = A * Z_u  # (B, L, f)
    F = None if loss.target is None else Hid @ W_down + (0 if b_down is None else b_down)  # (B, L, m)
    g, c = loss_cotangent(F, loss, keep, (B, L, m), batched, Y3)
    lz = Lanczos() if lanczos is None else lanczos
    op = GatedFFNOperator(Y3, Z_u, A, A1, A2, W_down, g, c, keep) if need_op else None
    norms = {"wgate_norm": W_gate, "wup_norm": W_up, "wdown_norm": W_down}
    out, terms = exact_keys(Y3, Hid, norms, c, keep, row_mask, "W2W2" in pairs)  # F is linear in W_down
    # the sampled keys' Gram columns first (no Lanczos basis is held yet); F is linear in W_down and W_up
    blocks = {"W_gate": "W1", "W_up": "W3", "W_down": "W2"}
    splans = token_sampled_plan(op, samples, pairs, blocks, pre, ("W2W2", "W3W3"), lz, adapters)
    # F is linear in W_up: H_f(W3W3) = 0 exactly, the Hessian block is its outer part (one Lanczos run). The engine's
    # runs and the sampled keys' in one solve
    out.update(norms_with_a_linear_pair(op, iterative, "W3W3", parts=parts, lanczos=lz, extra=splans))
    out.update(_gate_activity(Z_g, keep, row_mask, Y3.dtype))
    out.update(terms)
    if dense:
        out.update(dense_blocks(op, GATED_FFN_PAIRS))
    lz.warn_unconverged(out, "gated_ffn")
    return out


def _checked_weights(Y3: torch.Tensor, weights: GatedFFNWeights, row_mask):
    """``(W_gate, W_up, W_down, b_gate, b_up, b_down, keep)`` checked against the input ``Y3`` ``(B, L, d)``, in its
    dtype and device; ``keep`` ``(B, L)`` bool (all True without ``row_mask``)."""
    B, L, d = Y3.shape
    W_gate = check_weight(weights.W_gate, d, "W_gate", Y3)
    W_up = check_weight(weights.W_up, d, "W_up", Y3)
    if W_up.shape != W_gate.shape:
        raise ValueError(
            f"W_up must have W_gate's shape (d, f) = {tuple(W_gate.shape)}; got {tuple(W_up.shape)}. Both map "
            "the input to the hidden width f (gate_proj.weight.T and up_proj.weight.T)."
        )
    f = W_gate.shape[1]
    W_down = check_weight(weights.W_down, f, "W_down", Y3)
    m = W_down.shape[1]
    b_gate = check_like(weights.b_gate, (f,), "b_gate", Y3)
    b_up = check_like(weights.b_up, (f,), "b_up", Y3)
    b_down = check_like(weights.b_down, (m,), "b_down", Y3)
    keep = check_row_mask(row_mask, B, L, Y3)
    keep = torch.ones(B, L, dtype=torch.bool, device=Y3.device) if keep is None else keep
    return W_gate, W_up, W_down, b_gate, b_up, b_down, keep


def _checked_pairs(pairs) -> tuple[str, ...]:
    """The ``pairs`` argument as a tuple of the gated MLP's pairs (default all of them)."""
    pairs = GATED_FFN_PAIRS if pairs is None else ((pairs,) if isinstance(pairs, str) else tuple(pairs))
    for p in pairs:
        if p not in GATED_FFN_PAIRS:
            raise ValueError(
                f"Unknown gated-MLP pair {p!r}; choose from {GATED_FFN_PAIRS} (W1 = gate, W3 = up, W2 = down)."
            )
    return pairs


def _gate_activity(Z_g: torch.Tensor, keep: torch.Tensor, row_mask, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``gate_saturation``, ``dead_fraction`` and ``active_fraction`` of the gate pre-activations ``Z_g``
    ``(B, L, f)`` over the kept tokens."""
    B, L, f = Z_g.shape
    kept = keep.unsqueeze(-1)  # (B, L, 1)
    n_kept = f * (B * L if row_mask is None else keep.sum())
    off, pos = Z_g < GATE_OFF, Z_g > 0  # (B, L, f)
    Zk = Z_g  # gate pre-activations of the kept tokens, the others at -inf
    if row_mask is not None:
        off, pos, Zk = off & kept, pos & kept, Z_g.masked_fill(~kept, float("-inf"))
    return {
        "gate_saturation": torch.count_nonzero(off).to(dtype) / n_kept,
        "dead_fraction": (Zk.amax((0, 1)) < GATE_OFF).to(dtype).mean(),
        "active_fraction": torch.count_nonzero(pos).to(dtype) / n_kept,
    }
