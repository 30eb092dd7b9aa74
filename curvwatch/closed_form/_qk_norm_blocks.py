"""Hessian blocks of the QK-norm's own parameters: ``N1`` (the query norm's weight and bias), ``N2`` (the key norm's).

Notation of :mod:`curvwatch.closed_form.attention`. The query norm ``N_q(y) = n(y) * (offset + gamma_q) + beta_q``
(``n`` the RMS or LayerNorm normalisation of one ``d_K`` row, ``beta`` LayerNorm only) is one module shared by all
``H`` query heads, the key norm ``N_k`` by all ``H_kv`` kv heads. Block ``N1`` holds the query norm's parameters,
``(p, d_K)``: row 0 ``gamma_q``, then ``beta_q`` (the rows the norm has: ``p = 2`` for a LayerNorm with weight and
bias, else 1); ``N2`` the key norm's. Pairs: ``N1N1``, ``N2N2``, ``N1N2``; no head suffix (the parameters are shared).

The norm is affine in its parameters, so the tangents are

    dP_h = R(n(Q0_h) * dgamma_q + dbeta_q)   (every query head h),   dK_g = R(n(K0_g) * dgamma_k + dbeta_k),

and ``dT_h = s (dP_h K_g^T + P_h dK_g^T)`` as for the projection weights. A cotangent ``m_h`` at ``P_h`` (the one the
``W_Q`` products form before the norm's chain rule, ``Gamma_h K_g`` for a VJP) returns summed over the heads,
sequences ``b`` and positions ``i``:

    dgamma_q <- s sum_{b,h,i} n(Q0_h)_i * R^T(m_h)_i,      dbeta_q <- s sum_{b,h,i} R^T(m_h)_i

(for ``N2`` the cotangent at ``K_g``, ``sum_{h in g} Gamma_h^T P_h``, summed over the kv heads ``g``).

* Gauss-Newton ``H_o = c J^T J``: a perturbation moves every head's output, so the output cotangent of head ``h`` is
  ``u_h = c (sum_h' dF_h' W_O^h') W_O^h^T`` (cross-head terms; the grouped ``W_K`` blocks mix one group only).
* Functional ``H_f``: ``N`` is linear in ``(gamma, beta)``, so only the softmax's second derivative and, in
  ``N1N2``, the bilinear term ``s dP dK^T`` of ``T`` remain. The norm's own second derivative pairs ``gamma`` with
  ``W_Q`` (``W_K``), blocks not computed here: a tangent may not move a norm parameter and a weight at once.

The products run through :class:`~curvwatch.closed_form.attention.AttentionOperator` (names ``"N1"``, ``"N2"``
besides ``"Q"``, ``"K"``, ``"V"``); :class:`QKNormView` is the :class:`BlockOperator` the Lanczos norms, the dense
blocks and the sampled keys read them from.
"""

from __future__ import annotations

import torch

from .solver.operator import BlockOperator, ParamInfo, dense_blocks, pair_blocks
from .solver.plan import spectral_norms
from .solver.sampled_keys import sampled_norms

#: The block pairs of the QK-norm parameters.
NORM_PAIRS = ("N1N1", "N2N2", "N1N2")
#: Block name of each side's norm parameters, and the ``qk_norm`` entries it stacks (in row order).
NORM_BLOCKS = {"q": "N1", "k": "N2"}
_ENTRIES = ("weight", "bias")


class NormAffine:
    """The affine parameters of one side's QK-norm as a block ``(p, d_K)``: tangents in, cotangents out.

    Args:
        nhat: ``(B, heads, L, d_K)`` the normalised pre-affine rows ``n(Q0)`` (or ``n(K0)``).
        entries: the parameters the norm has, in row order: ``("weight",)``, ``("bias",)`` or both.
    """

    def __init__(self, nhat: torch.Tensor, entries: tuple[str, ...]):
        self.nhat, self.entries = nhat, entries

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.entries), self.nhat.shape[-1])

    def tangent(self, t: torch.Tensor) -> torch.Tensor:
        """Tangents ``(n, p, d_K)`` -> ``(n, B, heads, L, d_K)`` at the norm's output: ``nhat dgamma + dbeta``."""
        out = None
        for i, name in enumerate(self.entries):
            ti = t[:, i, None, None, None, :]  # (n, 1, 1, 1, d_K)
            term = self.nhat * ti if name == "weight" else ti.expand(t.shape[0], *self.nhat.shape)
            out = term if out is None else out + term
        return out

    def grad(self, m: torch.Tensor) -> torch.Tensor:
        """Cotangents ``(n, B, heads, L, d_K)`` at the norm's output -> ``(n, p, d_K)``, summed over ``B, heads, L``."""
        rows = [
            torch.einsum("nbhlk,bhlk->nk", m, self.nhat) if name == "weight" else m.sum((1, 2, 3))
            for name in self.entries
        ]
        return torch.stack(rows, 1)


def norm_affine(qk_norm, rows, side: str) -> NormAffine | None:
    """The :class:`NormAffine` of ``side`` (``"q"``, ``"k"``) of a checked ``qk_norm`` (``QKNorm``) at its rows
    (``RMSNormRows``, ``LayerNormRows``); None when that norm has neither weight nor bias."""
    entries = tuple(e for e in _ENTRIES if qk_norm.weights.get(f"{e}_{side}") is not None)
    if not entries:
        return None
    return NormAffine(rows.xhat if qk_norm.kind == "rmsnorm" else rows.yhat, entries)


def precondition_shapes(qk_norm: dict | None, d_K: int) -> dict[str, tuple[int]]:
    """``{"qk_norm.weight_q": (d_K,), ...}``: the ``precondition`` names of the QK-norm parameters ``qk_norm`` holds."""
    if not isinstance(qk_norm, dict):
        return {}
    names = [f"{e}_{s}" for s in NORM_BLOCKS for e in _ENTRIES]
    return {f"qk_norm.{nm}": (d_K,) for nm in names if qk_norm.get(nm) is not None}


def block_precondition(op, D: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``D = P^{-1/2}`` of the blocks ``N1``, ``N2`` ``(p, d_K)`` from the checked ``{"qk_norm.weight_q": (d_K,)}``;
    a block is preconditioned only when every one of its parameters has an entry."""
    out = {}
    for side, block in NORM_BLOCKS.items():
        aff = op.q_affine if side == "q" else op.k_affine
        names = [] if aff is None else [f"qk_norm.{e}_{side}" for e in aff.entries]
        if names and all(nm in D for nm in names):
            out[block] = torch.stack([D[nm] for nm in names])
    return out


def affine_tangent(op, tangent: dict, side: str) -> torch.Tensor | None:
    """The tangent at the norm's output of ``side`` from ``tangent[N1 or N2]``, or None."""
    name = NORM_BLOCKS[side]
    if name not in tangent:
        return None
    if any(nm in tangent for nm in ("Q", "K", "V")):
        raise ValueError(
            "A tangent may not move a QK-norm parameter (N1, N2) together with W_Q, W_K or W_V: the blocks between "
            "them (the norm's second derivative in gamma and W) are not computed. Perturb one set at a time."
        )
    return (op.q_affine if side == "q" else op.k_affine).tangent(tangent[name])


def affine_grad(op, m: torch.Tensor | None, side: str, n: int) -> torch.Tensor:
    """``(n, p, d_K)``: the cotangent ``m`` at ``P`` (``K``, summed over groups), unscaled, back to ``N1`` (``N2``)."""
    aff = op.q_affine if side == "q" else op.k_affine
    if m is None:
        return torch.zeros((n, *aff.shape), dtype=op.dtype, device=op.device)
    if op.rotary is not None:
        m = op.rotary(m, transpose=True)
    return aff.grad(m) * op.scale


class QKNormView(BlockOperator):
    """The attention operator restricted to the QK-norm parameter blocks ``N1``, ``N2`` (those the norms have).

    Not headed (the parameters are shared by every head): one Lanczos vector per norm, products over all heads with
    the output cotangents mixed across heads (``AttentionOperator.apply(mix="all")``).
    """

    supports_subsets = True
    supports_total = True
    head_diagonal = True
    suffix_heads = False

    def __init__(self, op):
        self.op = op
        self.n_heads = 1
        self.dtype, self.device = op.dtype, op.device
        affine = {NORM_BLOCKS["q"]: op.q_affine, NORM_BLOCKS["k"]: op.k_affine}
        self.params = {nm: ParamInfo(a.shape, False) for nm, a in affine.items() if a is not None}

    def apply(self, tangent, outputs=None, outer_rows=None, func_rows=None, total_rows=None):
        outputs = tuple(self.params) if outputs is None else tuple(outputs)
        return self.op.apply(tangent, outputs, outer_rows, func_rows, total_rows, mix="all")


def norm_pairs(op, pairs) -> list[str]:
    """The pairs of ``pairs`` among :data:`NORM_PAIRS` whose blocks the call's QK-norm has (none without one)."""
    have = {nm for side, nm in NORM_BLOCKS.items() if (op.q_affine if side == "q" else op.k_affine) is not None}
    return [p for p in NORM_PAIRS if p in pairs and set(pair_blocks(p, list(NORM_BLOCKS.values()))) <= have]


def qk_norm_norms(op, pairs, *, parts, lanczos, dense: bool, sampled_op=None, precondition=None) -> dict:
    """``{part}/N1N1``, ... (and ``residual/...``) by Lanczos, ``dense/{part}/...`` with ``dense``, and with
    ``sampled_op`` (the operator with sampled curvature) ``ggn/``, ``sharpness/`` (``precond_...`` where
    ``precondition``, ``{"N1": D}``, holds the block) of the diagonal pairs; ``pairs`` from :func:`norm_pairs`."""
    out: dict[str, torch.Tensor] = {}
    if pairs:
        view = QKNormView(op)
        out.update(spectral_norms(view, pairs, parts=parts, lanczos=lanczos))
        if sampled_op is not None:
            diagonal = [p for p in pairs if p[:2] == p[2:]]
            out.update(sampled_norms(sampled_op, diagonal, lanczos=lanczos, scale=precondition, view=QKNormView))
    if dense:
        every = norm_pairs(op, NORM_PAIRS)
        if every:
            out.update(dense_blocks(QKNormView(op), every))
    return out
