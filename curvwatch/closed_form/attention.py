"""Closed-form Hessian blocks of multi-head softmax attention: Gauss-Newton and functional parts.

Notation (formula sheet §1-§3, docs "Modern attention"): ``X`` (L, d) query tokens, ``X_kv`` (L_kv, d_kv) the
tokens keys and values are read from (``X_kv = X`` in self-attention, the encoder output ``memory`` in
cross-attention). ``H`` query heads share ``H_kv`` key/value heads (grouped-query attention, ``G = H / H_kv``
query heads per group; ``H_kv = H`` is plain multi-head attention). Query head ``h`` reads kv head ``g = h // G``:

* ``Q0_h = X W_Q^h + b_Q^h``, ``K0_g = X_kv W_K^g + b_K^g``, ``V_g = X_kv W_V^g + b_V^g``;
* ``P_h = R(N_q(Q0_h))``, ``K_g = R(N_k(K0_g))``: ``N`` the optional per-head QK-norm (RMSNorm or LayerNorm over
  ``d_K``), ``R`` the optional rotary embedding, a fixed linear map per position (both the identity by default);
* ``T_h = s P_h K_g^T`` (masked), ``s`` the softmax scale (``1/sqrt(d_K)`` by default), ``A_h = softmax_row(T_h)``;
* head output ``F_h = A_h V_g`` and the layer output ``F = sum_h F_h W_O^h (+ b_O)`` (``W_O = I`` for one head
  without projection).

The Hessian of the loss in the weights splits into ``H = H_o + H_f``:

* ``H_o = c J^T J`` (outer / Gauss-Newton), with ``J = dF/dW`` and ``c`` the output curvature;
* ``H_f = sum_k g_k d^2 F_k / dW^2`` (functional), with ``g = dl/dF``.

We never build the ``L^2 x L^2`` softmax Jacobian nor the ``L^4 x L^2`` second derivative. Products with
``H_o`` and ``H_f`` are written directly from their closed forms:

* softmax Jacobian on a row: ``dA_i = a_i * (dT_i - <a_i, dT_i>)`` (symmetric, so it is also its VJP);
* softmax second derivative contracted with the cotangent ``G_A = g_h V^T``:
  ``d/dA <G_A, J_A dT> = G_A*dT - G_A <a_i,dT_i> - <a_i,G_A,i> dT`` (P2 Lemma C.1 contracted);
* the bilinear term of ``T`` in ``(P, K)``: ``s Gamma dK`` and ``s Gamma^T dP``, ``Gamma = dl/dT``
  (formula sheet §2, erratum 7);
* the maps in front of ``P`` and ``K``: tangents go through ``dP = R(J_N dQ0)``, cotangents back through
  ``J_N^T R^T``; the functional products add the norm's second derivative contracted with the cotangent at its
  output, ``N''[R^T dl/dP] dQ0`` (and the same for K). ``R`` is linear, so it has no second-order term.

Key and value blocks of a group collect every query head that reads them (``J_K^g = sum_{h in g} J_K^h``); the
operator works per query head and sums each group's heads where a product returns to ``W_K``, ``W_V``. Each
product costs ``O(L L_kv (d_K + d_V) + (L d + L_kv d_kv)(d_K + d_V))`` per head, like one forward pass.
``||H_o(VV)||`` is exact in closed form for ``G = 1``: ``(sum_b c_b ||A_b X_kv,b||^2-Gram) * ||W_O^h||^2``.
The QK-norm's own parameters (blocks ``N1``, ``N2``, shared by every head) run through the same products; their
tangents and cotangents are in :mod:`curvwatch.closed_form._qk_norm_blocks`.

The other parts live beside this module: ``R`` in :mod:`curvwatch.closed_form.rotary`, ``N`` in ``_qk_norm``, head
splitting and the masks in ``_masks``, the bounds in ``bounds``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any

import torch

from ._common import as_batched, check_like, check_weight, output_cotangent
from ._masks import attention_masks, split_heads
from ._qk_norm import check_qk_norm
from ._qk_norm_blocks import (
    NORM_PAIRS,
    affine_grad,
    affine_tangent,
    block_precondition,
    norm_pairs,
    precondition_shapes,
    qk_norm_norms,
)
from .bounds import (
    _attention_bound_table,
    _grouped_attention_bound_tables,
    softmax_bound_factors,
    softmax_jacobian_norm,
)
from .rotary import apply_rotary, check_rotary
from .settings import PARTS, Lanczos, check_parts
from .solver.lanczos import LanczosRun, start_vectors
from .solver.linalg import gram_lambda_max
from .solver.lockstep import Shared, gathered, made_together
from .solver.operator import ALL_ROWS, BlockOperator, ParamInfo, dense_blocks, head_keys, rows_times, run_parts, select_rows
from .solver.plan import Planned, full_norms, solve_planned, spectral_plan
from .solver.sampled import SampledCurvature, check_output_samples, check_precondition, with_sampled
from .solver.sampled_plan import sampled_plan

ATTENTION_PAIRS = ("VV", "QQ", "KK", "VQ", "VK", "QK")
# with grouped-query attention: pairs with a query block are per query head (h{i}), the others per kv group (g{j})
QUERY_PAIRS = ("QQ", "VQ", "QK")
GROUP_PAIRS = ("VV", "KK", "VK")


def softmax_jvp(A: torch.Tensor, dT: torch.Tensor) -> torch.Tensor:
    """Row-softmax Jacobian applied to ``dT``: ``A * (dT - rowsum(A * dT))``; also its VJP (symmetric)."""
    return A * (dT - (A * dT).sum(-1, keepdim=True))


# ---- the operator ------------------------------------------------------------------------------------


class AttentionOperator(BlockOperator):
    """Closed-form Hessian operator of multi-head attention, per query head (and per kv group where shared).

    The products take per-query-head ``Q`` tangents ``(n, H, d, d_K)`` and per-kv-head ``K``, ``V`` tangents
    ``(n, H_kv, d_kv, k)`` and return the weight-space results in the same layout. With ``H_kv = H`` (``G = 1``) it
    is a head-diagonal :class:`BlockOperator` as is; with ``G > 1`` the Lanczos norms go through
    :class:`_QueryView` (blocks with ``Q``, per query head) and :class:`_GroupView` (``K``, ``V``, the whole group).

    Args:
        X: ``(B, L, d)`` block input (queries).
        W_Q: ``(H, d, d_K)`` per-head weights; W_K: ``(H_kv, d_kv, d_K)``; W_V: ``(H_kv, d_kv, d_V)``.
        W_O: ``(H, d_V, m)`` per-head output projection, or None (then ``m = d_V`` and ``H = 1``).
        b_Q: ``(H, d_K)`` or None; b_K: ``(H_kv, d_K)`` or None; b_V: ``(H_kv, d_V)`` or None.
        keep: ``(B, L, L_kv)`` bool, True where query i may attend key j (causal, window and padding), or None.
        row_keep: ``(B, L)`` bool, query rows that belong to the loss.
        g: ``(B, L, m)`` cotangent ``dl/dF`` (zero on dropped rows), or None to set it later with
            :meth:`set_cotangent` (once :meth:`output` has given the loss its ``F``).
        c: ``(B,)`` output curvature per sequence (with ``g``).
        memory: ``(B, L_kv, d_kv)`` keys/values source (cross-attention), or None (``X``).
        rotary: a :class:`Rotary` (from :func:`check_rotary`) or None.
        scale: the softmax scale ``s``, or None for ``1/sqrt(d_K)``.
        qk_norm: a :class:`QKNorm` (from :func:`check_qk_norm`) or None.

    Attributes:
        sampled: a :class:`~curvwatch.closed_form.solver.sampled.SampledCurvature` (``of_heads``) applied by
            :meth:`_outer_cotangent` instead of ``c`` (set on a copy by
            :func:`~curvwatch.closed_form.solver.sampled.with_sampled`), or None.
    """

    suffix_heads = True
    supports_subsets = True
    supports_total = True
    sampled = None

    def __init__(
        self,
        X,
        W_Q,
        W_K,
        W_V,
        W_O,
        b_Q,
        b_K,
        b_V,
        keep,
        row_keep,
        g,
        c,
        suffix_heads=True,
        *,
        memory=None,
        rotary=None,
        scale=None,
        qk_norm=None,
        probs_only=False,
    ):
        self.X = X
        self.Xkv = X if memory is None else memory
        self.H, d, self.d_K = W_Q.shape
        self.H_kv, d_kv = W_K.shape[:2]
        self.G = self.H // self.H_kv
        self.d_V = W_V.shape[-1]
        self.n_heads = self.H
        self.head_diagonal = True
        self.suffix_heads = suffix_heads
        self.dtype, self.device = X.dtype, X.device
        self.params = {
            "V": ParamInfo((d_kv, self.d_V), True),
            "Q": ParamInfo((d, self.d_K), True),
            "K": ParamInfo((d_kv, self.d_K), True),
        }
        self.scale = 1.0 / math.sqrt(self.d_K) if scale is None else float(scale)
        self.rotary = rotary
        self.W_Q, self.W_K, self.W_V, self.W_O = W_Q, W_K, W_V, W_O
        self.row_keep = row_keep.to(X.dtype)  # (B, L)
        self.q_rows = self.k_rows = None  # QK-norm row products at the pre-norm queries and keys
        self.q_affine = self.k_affine = None  # the QK-norm parameters as blocks N1, N2 (see _qk_norm_blocks)
        if probs_only and memory is None and qk_norm is None:
            # the attention alone (what the warnings' terms read; no products): one gathered call for the blocks of
            # a Lockstep that meet here
            tables = () if rotary is None else (rotary.cos, rotary.sin)
            given = [t for t in (b_Q, b_K, keep, *tables) if t is not None]
            self.A = gathered(_attention_probs, X, W_Q, W_K, *given, scale=self.scale, bias_q=b_Q is not None,
                              bias_k=b_K is not None, masked=keep is not None, rotary=rotary is not None,
                              interleaved=rotary is not None and rotary.interleaved)  # fmt: skip
            self.P = self.K_kv = self.V_kv = self.Kk = self.Vv = None
            if g is not None:
                self.set_cotangent(g, c)
            return
        # queries, keys and values in one matmul per source: X (B L, d) @ [W_Q | W_K | W_V] (d, H d_K + H_kv (d_K +
        # d_V)), then contiguous (B, heads, L, k) copies (the Gram matrices and products then need no copy of their own)
        B, L = X.shape[:2]
        heads = (self.H, self.H_kv, self.H_kv)
        sizes = [self.H * self.d_K, self.H_kv * self.d_K, self.H_kv * self.d_V]
        if memory is None:
            W_all = torch.cat([W.permute(1, 0, 2).reshape(d, -1) for W in (W_Q, W_K, W_V)], 1)  # (H, d, k) -> (d, H k)
            ys, lengths = (X.reshape(B * L, d) @ W_all).split(sizes, 1), (L, L, L)  # (B L, H d_K + ...)
        else:
            L_kv = memory.shape[1]
            W_kv = torch.cat([W.permute(1, 0, 2).reshape(d_kv, -1) for W in (W_K, W_V)], 1)
            ys = (X.reshape(B * L, d) @ W_Q.permute(1, 0, 2).reshape(d, -1),)
            ys += (memory.reshape(B * L_kv, d_kv) @ W_kv).split(sizes[1:], 1)
            lengths = (L, L_kv, L_kv)
        P, Kk, Vv = (
            y.reshape(B, n, h, -1).transpose(1, 2).contiguous() for y, n, h in zip(ys, lengths, heads, strict=True)
        )  # (B, H, L, d_K), (B, H_kv, L_kv, d_K), (B, H_kv, L_kv, d_V)
        for t, b in ((P, b_Q), (Kk, b_K), (Vv, b_V)):
            if b is not None:
                t.add_(b[None, :, None, :])
        if qk_norm is not None:
            self.q_rows, P = qk_norm.rows(P, "q")
            self.k_rows, Kk = qk_norm.rows(Kk, "k")
            self.q_affine, self.k_affine = qk_norm.affine(self.q_rows, "q"), qk_norm.affine(self.k_rows, "k")
        if rotary is not None:
            P, Kk = rotary(P), rotary(Kk)
        self.P, self.K_kv, self.V_kv = P, Kk, Vv
        self.Kk, self.Vv = self._rep(Kk), self._rep(Vv)  # read by every query head: (B, H, L_kv, k)
        self.A = _probabilities(self.P, self.Kk, self.scale, keep)  # (B, H, L, L_kv)
        self.A1 = self.A.unsqueeze(0)  # (1, B, H, L, L_kv), see set_cotangent
        if g is not None:
            self.set_cotangent(g, c)

    # ---- kv groups -------------------------------------------------------------------------------
    def _rep(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """kv-head tensor ``(..., H_kv, L, k)`` -> per query head ``(..., H, L, k)`` (head ``h`` reads ``h // G``)."""
        return t if t is None or self.G == 1 else t.repeat_interleave(self.G, dim=-3)

    def _grp(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Per query head ``(..., H, L, k)`` -> summed over each group's heads ``(..., H_kv, L, k)`` (``_rep^T``)."""
        return t if t is None or self.G == 1 else t.unflatten(-3, (self.H_kv, self.G)).sum(-3)

    # ---- the maps in front of P and K (QK-norm, then rotary) ---------------------------------------
    def _fwd(self, d0: torch.Tensor | None, side: str, dn: torch.Tensor | None = None) -> torch.Tensor | None:
        """Tangent of the pre-norm queries (keys) ``dQ0`` -> ``dP = R(J_N dQ0)``; ``dn``: a tangent at the norm's
        output (its parameters moving, :func:`~._qk_norm_blocks.affine_tangent`), ``dP = R(dn)``."""
        rows = self.q_rows if side == "q" else self.k_rows
        if d0 is None and dn is None:
            return None
        if d0 is None:
            d0 = dn
        elif rows is not None:
            d0 = rows.jvp(d0)
        return d0 if self.rotary is None else self.rotary(d0)

    def _back(self, m: torch.Tensor | None, d0: torch.Tensor | None, side: str) -> torch.Tensor | None:
        """Cotangent at ``P`` (``K``) -> at the pre-norm queries (keys): ``J_N^T R^T m``, plus ``N''[R^T dl/dP] dQ0``
        (unscaled by ``s``, as ``m``) when the tangent ``d0`` of a second-order product is given."""
        rows = self.q_rows if side == "q" else self.k_rows
        if m is not None and self.rotary is not None:
            m = self.rotary(m, transpose=True)
        if rows is None:
            return m
        if m is not None:
            m = rows.vjp(m)
        if d0 is not None:
            h = rows.hvp(self.GQn if side == "q" else self.GKn, d0)
            m = h if m is None else m + h
        return m

    def output(self, b_O: torch.Tensor | None = None) -> torch.Tensor:
        """The layer output ``F = sum_h A_h V_h W_O^h (+ b_O)``, ``(B, L, m)``."""
        Fh = self.A @ self.Vv  # (B, H, L, d_V)
        F = Fh[:, 0] if self.W_O is None else torch.einsum("bhlv,hvm->blm", Fh, self.W_O)
        return F if b_O is None else F + b_O

    def set_cotangent(self, g: torch.Tensor, c: torch.Tensor) -> None:
        """Set ``g = dl/dF`` ``(B, L, m)`` and the output curvature ``c`` ``(B,)``.

        The products' cotangent factors (``g_h``, ``G_A``, ``Gamma``, ...) are computed on first use: an
        evaluation without Lanczos never needs them (the exact ``VV`` reads ``c`` alone).
        """
        self.c = c
        self._g = g
        for name in ("g_h", "G_A", "Gamma", "rG", "G_A1", "GmR1", "GQn", "GKn", "c_rows"):
            self.__dict__.pop(name, None)  # drop what an earlier cotangent cached

    @cached_property
    def g_h(self) -> torch.Tensor:
        """The per-head cotangent ``g W_O^h^T``, ``(B, H, L, d_V)`` (``g`` itself, one head, without ``W_O``)."""
        W_O = self.W_O
        return self._g.unsqueeze(1) if W_O is None else torch.einsum("blm,hvm->bhlv", self._g, W_O)

    @cached_property
    def G_A(self) -> torch.Tensor:
        """``dl/dA = g_h V^T``, ``(B, H, L, L_kv)``."""
        return self.g_h @ self.Vv.mT

    @cached_property
    def Gamma(self) -> torch.Tensor:
        """``dl/dT``, ``(B, H, L, L_kv)``."""
        return softmax_jvp(self.A, self.G_A)

    @cached_property
    def rG(self) -> torch.Tensor:
        """``<a_i, G_A,i>`` per row, ``(B, H, L, 1)``."""
        return (self.A * self.G_A).sum(-1, keepdim=True)

    # rank-matched views for products with (n, B, H, L, L_kv) tangents: same-rank elementwise ops take
    # PyTorch's fast path (broadcasting over a missing leading dimension was 2x slower on CPU)
    @cached_property
    def G_A1(self) -> torch.Tensor:
        return self.G_A.unsqueeze(0)

    @cached_property
    def GmR1(self) -> torch.Tensor:
        return (self.G_A - self.rG).unsqueeze(0)

    @cached_property
    def GQn(self) -> torch.Tensor:
        """``dl/dN_q / s = R^T(Gamma K)``, the cotangent at the normalised queries (QK-norm), ``(B, H, L, d_K)``."""
        m = self.Gamma @ self.Kk
        return m if self.rotary is None else self.rotary(m, transpose=True)

    @cached_property
    def GKn(self) -> torch.Tensor:
        """``dl/dN_k / s = R^T(sum_{h in g} Gamma_h^T P_h)`` at the normalised keys, ``(B, H_kv, L_kv, d_K)``."""
        m = self._grp(self.Gamma.mT @ self.P)
        return m if self.rotary is None else self.rotary(m, transpose=True)

    @cached_property
    def KsT(self) -> torch.Tensor:
        """``s K^T`` per query head, ``(B, H, d_K, L_kv)``: ``dT = dP (s K^T)`` in :meth:`jvp`."""
        return (self.Kk * self.scale).mT

    @cached_property
    def Ps(self) -> torch.Tensor:
        """``s P``, ``(B, H, L, d_K)``: ``dT = (s P) dK^T`` in :meth:`jvp`."""
        return self.P * self.scale

    @cached_property
    def Mo(self) -> torch.Tensor | None:
        """Per-head output metric ``W_O^h W_O^h^T``, ``(H, d_V, d_V)`` (None without projection)."""
        return None if self.W_O is None else self.W_O @ self.W_O.mT

    def _zero_out(self, n: int, name: str) -> torch.Tensor:
        """A zero result of block ``name`` for ``n`` tangents: ``(n, H, d, d_K)`` for Q, ``(n, H_kv, d_kv, k)`` for K,
        V, ``(n, p, d_K)`` for the QK-norm parameters N1, N2."""
        if name not in self.params:
            return affine_grad(self, None, "q" if name == "N1" else "k", n)
        heads = self.H if name == "Q" else self.H_kv
        return torch.zeros((n, heads, *self.params[name].shape), dtype=self.dtype, device=self.device)

    def _bh(self, name: str, transpose: bool = False) -> torch.Tensor:
        """The shared ``(B, H, p, q)`` tensor ``self.<name>`` (``transpose``: its ``.mT``) as the ``(B H, p, q)``
        operand of :func:`_left` / :func:`_right`, made once per operator and tensor (a view where the strides allow,
        as :func:`_as`): every Lanczos product reads the same few (``KsT``, ``Vv``, ``Kk``, ``A``, ...), and remaking
        the view dispatched one or two operators per matmul (issue 23). A cached cotangent that is replaced
        (:meth:`set_cotangent`) is a new tensor: its view is made again."""
        cache = self.__dict__.setdefault("_bh_views", {})
        S = getattr(self, name)
        hit = cache.get((name, transpose))
        if hit is not None and hit[0] is S:
            return hit[1]
        S4 = S.mT if transpose else S
        B, H, p, q = S4.shape
        view = _as(S4, (0, 1, 2, 3), (B * H, p, q))
        cache[(name, transpose)] = (S, view)
        return view

    # ---- first order -------------------------------------------------------------------------
    def jvp(self, tangent):
        """Per-head output tangents ``dF_h`` ``(n, B, H, L, d_V)`` plus intermediates reused by the HVP.

        ``tangent`` maps ``"Q"`` to ``(n, H, d, d_K)`` and ``"K"``, ``"V"`` to ``(n, H_kv, d_kv, k)``, or (alone) the
        QK-norm parameters ``"N1"``, ``"N2"`` to ``(n, p, d_K)``; a missing name is a zero perturbation and costs
        nothing.
        """
        X, A = self.X, self.A1
        dQ0 = _xw(X, tangent["Q"]) if "Q" in tangent else None  # (n, B, H, L, d_K)
        dK0 = _xw(self.Xkv, tangent["K"]) if "K" in tangent else None  # (n, B, H_kv, L_kv, d_K)
        dV = self._rep(_xw(self.Xkv, tangent["V"])) if "V" in tangent else None  # (n, B, H, L_kv, d_V)
        dnq, dnk = affine_tangent(self, tangent, "q"), affine_tangent(self, tangent, "k")  # QK-norm parameters
        dP, dK = self._fwd(dQ0, "q", dnq), self._rep(self._fwd(dK0, "k", dnk))
        dT = None  # (n, B, H, L, L_kv), already scaled by s
        if dP is not None:
            dT = _right(dP, self._bh("KsT"))
        if dK is not None:
            t = _left(self._bh("Ps"), dK.mT)
            dT = t if dT is None else dT.add_(t)
        r = dA = None
        if dT is not None:
            r = torch.linalg.vecdot(A, dT).unsqueeze(-1)  # attention-weighted row mean of dT, (n, B, H, L, 1)
            dA = (dT - r).mul_(A)  # softmax JVP
        dF = None
        if dA is not None:
            dF = _right(dA, self._bh("Vv"))
        if dV is not None:
            dF = _left(self._bh("A"), dV) if dF is None else dF.add_(_left(self._bh("A"), dV))
        if self.q_rows is None:  # the pre-norm tangents serve only the QK-norm's second derivative
            dQ0 = dK0 = None
        return dF, (dP, dK, dV, dT, r, dA, dQ0, dK0)

    def pull(self, inter, u=None, second_order=True, outputs=("V", "Q", "K")):
        """Weight gradients of the output cotangent ``u`` plus (``second_order``) the g-contracted second derivative.

        With ``u = c dF`` and ``second_order=False`` this is ``H_o v`` (the Gauss-Newton product, i.e. the VJP
        ``J^T u``); with ``u=None`` and ``second_order=True`` it is ``H_f v``; with both, the total ``H v`` in one
        pass: the two parts share every matmul back to the weights (one softmax VJP, one ``X^T`` product per block).

        Args:
            inter: intermediates of :meth:`jvp` for the same ``n`` tangents, ``(dP, dK, dV, dT, r, dA, dQ0, dK0)``.
            u: ``(n, B, H, L, d_V)`` per-head output cotangents, or None.
            second_order: add the functional (second-derivative) terms.
            outputs: weight blocks to return, a subset of ``("V", "Q", "K")``, or of the QK-norm parameters
                ``("N1", "N2")``.

        Returns:
            ``{name: (n, heads, d_in, k)}`` for the names in ``outputs`` (``H`` heads for Q, ``H_kv`` for K, V;
            ``(n, p, d_K)`` for N1, N2).
        """
        X, A = self.X, self.A1
        dP, dK, dV, dT, r, dA, dQ0, dK0 = inter if second_order else (None,) * 8
        ref = u if u is not None else next((t for t in inter if t is not None), None)
        out = {}
        if "V" in outputs:
            mV = None if u is None else _left(self._bh("A", True), u)
            if dA is not None:
                g3 = self._bh("g_h")
                mV = _right(dA.mT, g3) if mV is None else mV.add_(_right(dA.mT, g3))
            out["V"] = self._zero_out(ref.shape[0], "V") if mV is None else _xtm(self.Xkv, self._grp(mV))
        if any(nm in outputs for nm in ("Q", "K", "N1", "N2")):
            # hA = d/dA of <u, A V> + <G_A, dA> + <g_h, A dV>; the middle term is G_A*(dT - r) - rG*dT
            hA = None
            if dT is not None:
                hA = (self.GmR1 * dT).addcmul_(self.G_A1, r, value=-1.0)
            for t in (
                None if u is None else _right(u, self._bh("Vv", True)),
                None if dV is None else _left(self._bh("g_h"), dV.mT),
            ):
                if t is not None:
                    hA = t if hA is None else hA.add_(t)
            G2 = None
            if hA is not None:  # softmax VJP, in place on the temporary hA
                G2 = hA.sub_(torch.linalg.vecdot(A, hA).unsqueeze(-1)).mul_(A)
            sides = (("Q", "N1", G2, "Kk", dK), ("K", "N2", None if G2 is None else G2.mT, "P", dP))
            for name, norm, left, right, Gam in sides:
                if name not in outputs and norm not in outputs:
                    continue
                m = None if left is None else _right(left, self._bh(right))
                if Gam is not None:  # the bilinear term of T in (P, K)
                    t = _left(self._bh("Gamma", name == "K"), Gam)
                    m = t if m is None else m.add_(t)
                side = "q" if name == "Q" else "k"
                if name == "K":
                    m = self._grp(m)
                if norm in outputs:  # the cotangent at P (K) back to the norm's parameters
                    out[norm] = affine_grad(self, m, side, ref.shape[0])
                if name not in outputs:
                    continue
                m, source = self._back(m, dQ0 if name == "Q" else dK0, side), X if name == "Q" else self.Xkv
                out[name] = self._zero_out(ref.shape[0], name) if m is None else _xtm(source, m) * self.scale
        return out

    def vjp(self, u, outputs=("V", "Q", "K")):
        """``J^T u`` for per-head output cotangents ``u`` ``(n, B, H, L, d_V)``: the weight grads in ``outputs``."""
        return self.pull((None,) * 8, u=u, second_order=False, outputs=outputs)

    # ---- second order ------------------------------------------------------------------------
    def functional(self, inter, outputs=("V", "Q", "K")):
        """``H_f v = sum_k g_k d^2F_k/dW^2 v`` per head, from the intermediates of :meth:`jvp`."""
        return self.pull(inter, u=None, second_order=True, outputs=outputs)

    def _outer_cotangent(self, dF, mix: bool | str = True):
        """``u = c dF`` through the output metric, padded rows dropped.

        Without ``mix`` (or with ``G = 1``) head ``h`` sees only its own output, ``u_h = c dF_h W_O^h W_O^h^T`` (the
        diagonal head block); with ``mix`` it sees its group's, ``u_h = c (sum_{h' in g} dF_h' W_O^h') W_O^h^T``,
        which the blocks of the shared ``W_K``, ``W_V`` need; with ``mix="all"`` every head's (the QK-norm parameters,
        shared by all heads). With :attr:`sampled` the curvature is the sampled ``C`` (mixed the same way).
        """
        if self.sampled is not None:
            group = self.H if mix == "all" else self.G
            return self.sampled(dF, group=group if mix and self.W_O is not None else 1)
        if mix == "all" and self.W_O is not None and self.H > 1:
            Y = torch.einsum("nbhlv,hvm->nblm", dF, self.W_O)  # the layer's output tangent
            u = torch.einsum("nblm,hvm->nbhlv", Y, self.W_O)
        elif self.G == 1 or not mix or self.W_O is None:
            u = dF if self.Mo is None else _per_head(dF, self.Mo)
        else:
            W_O = self.W_O.unflatten(0, (self.H_kv, self.G))  # (H_kv, G, d_V, m)
            Y = torch.einsum("nbgslv,gsvm->nbglm", dF.unflatten(2, (self.H_kv, self.G)), W_O)  # group output tangent
            u = torch.einsum("nbglm,gsvm->nbgslv", Y, W_O).flatten(2, 3)  # (n, B, H, L, d_V)
        return u * self.c_rows

    @cached_property
    def c_rows(self) -> torch.Tensor:
        """``c_b`` on the kept rows, 0 on the others, ``(B, 1, L, 1)``: the curvature of :meth:`_outer_cotangent`."""
        return self.c[:, None, None, None] * self.row_keep[:, None, :, None]

    def apply(self, tangent, outputs=("V", "Q", "K"), outer_rows=None, func_rows=None, total_rows=None, mix=True):
        """``(H_o v, H_f v)`` restricted to the weight blocks in ``outputs`` (and ``H v`` with ``total_rows``).

        ``outer_rows`` / ``func_rows`` / ``total_rows`` (index tensors) select the tangents for which each part
        is needed; the returned tensors then hold only those rows, in that order. ``outer_rows`` and
        ``func_rows`` default to all rows; with ``total_rows`` a third dict ``H v`` (both parts, fused) is
        returned. ``mix``: see :meth:`_outer_cotangent`. ``outputs`` and ``tangent`` may name the QK-norm
        parameters ``"N1"``, ``"N2"`` instead (see :class:`~._qk_norm_blocks.QKNormView`).
        """
        dF, inter = self.jvp(tangent)
        n = next(iter(tangent.values())).shape[0]
        if dF is None:  # no perturbation at all
            zero = {nm: self._zero_out(n, nm) for nm in outputs}
            return (zero, zero) if total_rows is None else (zero, zero, zero)

        def part(idx, outer: bool, second_order: bool) -> dict:
            u = self._outer_cotangent(select_rows(dF, idx), mix) if outer else None
            inter_i = tuple(select_rows(t, idx) for t in inter) if second_order else (None,) * 8
            return self.pull(inter_i, u=u, second_order=second_order, outputs=outputs)

        return run_parts(part, outer_rows, func_rows, total_rows)

    def apply_masked(self, tangent, outputs, outer_mask, func_mask, mix=True):
        """``H_kind(row) v_row`` for every tangent row in **one** pass: the Gauss-Newton part where ``outer_mask``
        ``(n,)`` is 1, the functional part where ``func_mask`` is 1 (both: the total ``H v``). Either mask may be
        None (no row needs that part). The same numbers as :meth:`apply` with row subsets, in a third of its
        operators: one cotangent and one pull for all rows instead of one per part (zero rows cost arithmetic, not
        dispatches)."""
        dF, inter = self.jvp(tangent)
        if dF is None:
            n = next(iter(tangent.values())).shape[0]
            return {nm: self._zero_out(n, nm) for nm in outputs}
        u = None if outer_mask is None else rows_times(self._outer_cotangent(dF, mix), outer_mask)
        inter = (None,) * 8 if func_mask is None else tuple(rows_times(t, func_mask) for t in inter)
        return self.pull(inter, u=u, second_order=func_mask is not None, outputs=outputs)

    # ---- exact pieces (G = 1) ----------------------------------------------------------------
    def _vv_rows(self) -> torch.Tensor:
        """``A`` with row ``i`` of sequence ``b`` scaled by ``sqrt(c_b)`` (0 on padded rows), ``(B, H, L, L_kv)``."""
        return _vv_rows(self.A, self.c, self.row_keep)

    def vv_factor(self) -> torch.Tensor:
        """``M``, ``M^T M = sum_b c_b (A X_kv)_b^T (A X_kv)_b`` per head (padded rows dropped), ``(H, B L, d_kv)``."""
        B, H, L, L_kv = self.A.shape
        M1 = self._vv_rows().reshape(B, H * L, L_kv) @ self.Xkv  # one matmul per sequence for all heads, (B, H L, d_kv)
        return M1.reshape(B, H, L, -1).transpose(0, 1).reshape(H, B * L, -1)  # (B, H, L, d_kv) -> (H, B L, d_kv)

    @staticmethod
    def vv_exact(d: int, max_iter: int | None) -> bool:
        """Whether :meth:`outer_vv_norm` takes the ``d x d`` eigen-decomposition (else Lanczos)."""
        return d <= 256 or max_iter is None

    def vv_gram_plan(self, lanczos: Lanczos) -> Planned:
        """The Lanczos run of :meth:`outer_vv_norm`'s ``lambda_max`` per head where :meth:`vv_exact` says Lanczos, as
        a :class:`Planned` (the kernel solves it with its other runs: their stopping tests share host reads): one run
        for the blocks of a Lockstep that meet here (:func:`made_together`; every layer's, in a terms-only
        evaluation). Its ``finish`` gives ``(lambda_max, relative residual)``, ``(H,)`` each."""
        start = _warm_start(lanczos, ("VV", "gram"), (self.H, self.Xkv.shape[-1]), self)
        shared = made_together(_vv_gram_run, self.A, self.c, self.row_keep, self.Xkv, start, tol=lanczos.tol,
                               max_iter=lanczos.max_iter, max_basis=lanczos.max_basis)  # fmt: skip

        def finish(runs: list[LanczosRun]) -> tuple[torch.Tensor, torch.Tensor]:
            run, i = shared.solved()
            _keep_start(lanczos, ("VV", "gram"), run.ritz[i])
            return run.norm[i], run.rel_residual[i]

        return _planned_shared(shared, finish)

    def outer_vv_norm(
        self,
        lanczos: Lanczos,
        gram: torch.Tensor | None = None,
        wo2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Exact ``||H_o(VV)||`` per head (``G = 1``): ``lambda_max(sum_b c_b (A X_kv)_b^T (A X_kv)_b) ||W_O^h||^2``.

        ``gram`` (that ``lambda_max``, ``(H,)``) and ``wo2`` (``||W_O^h||^2``) may be passed when the caller
        computed them already (in one batched eigen-decomposition with its other norms, or by the Lanczos run of
        :meth:`vv_gram_plan` solved with its other runs, which also gives the relative residuals). Otherwise the ``d x
        d`` eigenvalue is found here, by Lanczos where :meth:`vv_exact` says so.
        """
        if gram is None:
            if self.vv_exact(self.Xkv.shape[-1], lanczos.max_iter):
                gram = gram_lambda_max(self.vv_factor())[0]
            else:
                gram = solve_planned([self.vv_gram_plan(lanczos)], lanczos.solve_bytes)[0][0]
        gram = gram.clamp_min(0)
        if self.W_O is not None:
            gram = gram * (gram_lambda_max(self.W_O)[0] if wo2 is None else wo2).clamp_min(0)
        return gram


class _GroupView(BlockOperator):
    """The operator with the kv group as the unit (``G > 1``): blocks ``Q`` (the group's ``G`` query heads,
    ``(G, d, d_K)``), ``K`` and ``V``. Groups never meet, so the Lanczos vectors of all groups share one product."""

    supports_subsets = True
    supports_total = True
    head_diagonal = True
    suffix_heads = True
    # the blocks whose outer pull of per-head columns is the unit's column (the sampled keys' Gram path): the group's
    gram_columns = frozenset({"Q", "K", "V"})

    def __init__(self, op: AttentionOperator):
        self.op = op
        self.n_heads = op.H_kv
        self.dtype, self.device = op.dtype, op.device
        self.params = {"V": op.params["V"], "Q": ParamInfo((op.G, *op.params["Q"].shape), True), "K": op.params["K"]}

    def apply(self, tangent, outputs=("V", "Q", "K"), outer_rows=None, func_rows=None, total_rows=None):
        op = self.op
        t = {nm: x.flatten(1, 2) if nm == "Q" else x for nm, x in tangent.items()}  # Q: (n, H_kv, G, ..) -> (n, H, ..)
        parts = op.apply(t, outputs, outer_rows, func_rows, total_rows, mix=True)
        return tuple({nm: x.unflatten(1, (op.H_kv, op.G)) if nm == "Q" else x for nm, x in p.items()} for p in parts)

    def apply_masked(self, tangent, outputs, outer_mask, func_mask):
        """Every row's ``H_kind v`` in one pass (:meth:`AttentionOperator.apply_masked`), in the group layout."""
        op = self.op
        t = {nm: x.flatten(1, 2) if nm == "Q" else x for nm, x in tangent.items()}
        out = op.apply_masked(t, outputs, outer_mask, func_mask, mix=True)
        return {nm: x.unflatten(1, (op.H_kv, op.G)) if nm == "Q" else x for nm, x in out.items()}


class _QueryView(BlockOperator):
    """The operator with the query head as the unit (``G > 1``): ``Q`` of head ``h``, ``K`` and ``V`` of its group.

    A ``Q``-only product (``QQ``) moves each head's own output only and takes every head at once, without the
    group's mixing. A product that touches ``K`` or ``V`` runs once per position ``s`` of a head inside its group:
    tangent row ``(i, s)`` carries the vectors of heads ``(g, s)`` of every group ``g`` (heads of different groups
    never meet, those of one group do), so each vector costs ``G`` rows.
    """

    supports_subsets = True
    supports_total = True
    head_diagonal = True
    suffix_heads = True
    # the sampled keys' Gram path (see _GroupView): a Q-only product is the base operator's, per head, unmixed
    gram_columns = frozenset({"Q"})

    def __init__(self, op: AttentionOperator):
        self.op = op
        self.n_heads = op.H
        self.dtype, self.device = op.dtype, op.device
        self.params = dict(op.params)

    def apply(self, tangent, outputs=("V", "Q", "K"), outer_rows=None, func_rows=None, total_rows=None):
        op = self.op
        G = op.G
        if set(tangent) <= {"Q"} and set(outputs) <= {"Q"}:
            return op.apply(tangent, outputs, outer_rows, func_rows, total_rows, mix=False)
        rows = [
            None if idx is None else (idx[:, None] * G + torch.arange(G, device=idx.device)).flatten()
            for idx in (outer_rows, func_rows, total_rows)
        ]
        parts = op.apply(self._spread(tangent), outputs, *rows, mix=True)
        return tuple({nm: self._gather(nm, x) for nm, x in p.items()} for p in parts)

    def apply_masked(self, tangent, outputs, outer_mask, func_mask):
        """Every row's ``H_kind v`` in one pass (:meth:`AttentionOperator.apply_masked`); a ``K``/``V`` product
        expands each row (and its masks) to ``G`` rows as :meth:`apply` does."""
        op = self.op
        if set(tangent) <= {"Q"} and set(outputs) <= {"Q"}:
            return op.apply_masked(tangent, outputs, outer_mask, func_mask, mix=False)

        def spread(mask):
            return mask if mask is None or mask is ALL_ROWS else mask.repeat_interleave(op.G)

        out = op.apply_masked(self._spread(tangent), outputs, spread(outer_mask), spread(func_mask), mix=True)
        return {nm: self._gather(nm, x) for nm, x in out.items()}

    def _spread(self, tangent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Row ``i`` of the head-unit tangent -> rows ``(i, s)`` of the base operator, ``s`` the position in a group."""
        op = self.op
        G, H_kv = op.G, op.H_kv
        eye = torch.eye(G, dtype=op.dtype, device=op.device)
        t = {}
        for nm, x in tangent.items():
            x = x.unflatten(1, (H_kv, G))  # (n, H_kv, G, d_in, k)
            if nm == "Q":  # row (i, s) perturbs head (g, s) of every group g
                t[nm] = (x.unsqueeze(1) * eye.reshape(1, G, 1, G, 1, 1)).flatten(2, 3).flatten(0, 1)  # (n G, H, d, d_K)
            else:  # row (i, s) perturbs group g by the vector of its head (g, s)
                t[nm] = x.transpose(1, 2).flatten(0, 1)  # (n G, H_kv, d_kv, k)
        return t

    def _gather(self, nm: str, x: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_spread` on an output block: rows ``(i, s)`` back to the head-unit row ``i``."""
        op = self.op
        G, H_kv = op.G, op.H_kv
        x = x.unflatten(0, (-1, G))  # (m, G, heads, d_in, k)
        if nm == "Q":  # head (g, s) from row (i, s)
            return torch.diagonal(x.unflatten(2, (H_kv, G)), dim1=1, dim2=3).movedim(-1, 2).flatten(1, 2)
        return x.transpose(1, 2).flatten(1, 2)  # group g of row (i, s) -> head (g, s)


def _group_keys(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys ``.../h{j}`` of a :class:`_GroupView` (its unit ``j`` is a kv group) renamed ``.../g{j}``."""
    return {re.sub(r"/h(\d+)$", r"/g\1", k): v for k, v in out.items()}


def _grouped_vv_plan(gv: _GroupView, lanczos: Lanczos) -> Planned:
    """``VV/g{j}`` for ``G > 1`` as a :class:`Planned` (the kernel solves it with its other runs): the outer part by
    Lanczos (a sum of Kronecker products, no closed-form norm), ``H_f(VV) = 0`` (``F`` is linear in ``W_V``), so the
    total is the outer part: one run for the blocks of a Lockstep that meet here (:func:`_grouped_vv_run`,
    :func:`made_together`; every layer's, in a terms-only evaluation). Its ``finish`` gives the keys. (``G > 1`` means
    several heads, hence an output projection: an operator without one has a single head.)"""
    op = gv.op
    start = _warm_start(lanczos, ("VV", "grouped"), (op.H_kv, op.Xkv.shape[-1] * op.d_V), op)
    shared = made_together(_grouped_vv_run, op.A, op.c, op.row_keep, op.Xkv, op.W_O, start, groups=op.G,
                           tol=lanczos.tol, max_iter=lanczos.max_iter, max_basis=lanczos.max_basis)  # fmt: skip

    def finish(runs: list[LanczosRun]) -> dict[str, torch.Tensor]:
        run, i = shared.solved()
        _keep_start(lanczos, ("VV", "grouped"), run.ritz[i])
        keys = head_keys(gv, "outer/VV", ("V",))
        norms = dict(zip(keys, run.norm[i].unbind(), strict=True))
        norms.update(zip([f"residual/{k}" for k in keys], run.rel_residual[i].unbind(), strict=True))
        out = {}
        for key, v in _group_keys(norms).items():
            out[key] = out[key.replace("outer/", "hessian/", 1)] = v
            if not key.startswith("residual/"):
                out[key.replace("outer/", "functional/", 1)] = torch.zeros_like(v)
        return out

    return _planned_shared(shared, finish)


def _planned_shared(shared: Shared, finish: Callable[[list[LanczosRun]], Any]) -> Planned:
    """A run made already (:func:`made_together`, shared by the blocks of a Lockstep that meet) as a one-run
    :class:`Planned`: its maker returns it, its bytes are its basis's at most."""
    run = shared.run
    size = 0 if run.done else run.b * run.cap * run.n * run.dtype.itemsize
    return Planned([(lambda: run, size)], finish)


def _attention_probs(X: torch.Tensor, W_Q: torch.Tensor, W_K: torch.Tensor, *given: torch.Tensor, scale: float,
                     bias_q: bool, bias_k: bool, masked: bool, rotary: bool,
                     interleaved: bool) -> torch.Tensor:  # fmt: skip
    """The attention ``A = softmax(s (X W_Q + b_Q)(X W_K + b_K)^T)`` of self-attention, ``(..., B, H, L, L)``, as the
    operator's forward computes it (masked rows all zero), for any leading dimensions ``...`` (the blocks of a
    gathered call).

    Args:
        X: ``(..., B, L, d)``. W_Q: ``(..., H, d, d_K)``; W_K: ``(..., H_kv, d, d_K)`` (a kv head serves ``H / H_kv``
            query heads).
        given: ``b_Q`` ``(..., H, d_K)`` if ``bias_q``, ``b_K`` ``(..., H_kv, d_K)`` if ``bias_k``, then ``keep``
            ``(..., B, L, L)`` bool (True where query ``i`` may attend key ``j``) if ``masked``, then the rotary tables
            ``cos``, ``sin`` ``(..., B or 1, 1, L, r)`` (:class:`~.rotary.Rotary`'s) if ``rotary``.
        scale: the softmax scale ``s``.
        interleaved: the rotary tables' GPT-J layout (:func:`~.rotary.apply_rotary`).
    """
    rest = iter(given)
    b_Q, b_K = next(rest) if bias_q else None, next(rest) if bias_k else None
    keep = next(rest) if masked else None
    cos, sin = (next(rest), next(rest)) if rotary else (None, None)
    H, H_kv = W_Q.shape[-3], W_K.shape[-3]

    # queries and keys in one (b)mm: X (..., B L, d) @ [W_Q | W_K] (..., d, (H + H_kv) d_K), as the operator's forward
    W_all = torch.cat([W.transpose(-3, -2).flatten(-2) for W in (W_Q, W_K)], -1)
    ys = torch.matmul(X.flatten(-3, -2), W_all).split([H * W_Q.shape[-1], H_kv * W_K.shape[-1]], -1)

    def heads(Y: torch.Tensor, h: int, b: torch.Tensor | None) -> torch.Tensor:  # per head, (..., B, h, L, d_K)
        Y = Y.unflatten(-2, X.shape[-3:-1]).unflatten(-1, (h, -1)).transpose(-3, -2).contiguous()
        return Y if b is None else Y + b.unsqueeze(-2).unsqueeze(-4)

    P, K = heads(ys[0], H, b_Q), heads(ys[1], H_kv, b_K)
    if rotary:
        P, K = apply_rotary(P, cos, sin, interleaved), apply_rotary(K, cos, sin, interleaved)
    if H != H_kv:
        K = K.repeat_interleave(H // H_kv, dim=-3)
    return _probabilities(P, K, scale, keep)


def _probabilities(P: torch.Tensor, K: torch.Tensor, scale: float, keep: torch.Tensor | None) -> torch.Tensor:
    """``softmax(s P K^T)`` ``(..., B, H, L, L_kv)`` for queries ``P`` ``(..., B, H, L, d_K)`` and keys ``K``
    ``(..., B, H, L_kv, d_K)`` (one per query head), masked by ``keep`` ``(..., B, L, L_kv)`` (None: no mask); rows with
    every key masked are zero."""
    T = P @ K.mT * scale
    if keep is not None:
        T = T.masked_fill(~keep.unsqueeze(-3), float("-inf"))
    return torch.nan_to_num(torch.softmax(T, dim=-1), nan=0.0)


def _warm_start(lanczos: Lanczos, key: tuple, shape: tuple[int, int], op: AttentionOperator) -> torch.Tensor:
    """The start vectors ``shape`` of a gathered run's request: the Ritz vectors kept under ``key`` in the block's
    ``lanczos.warm_start``, or zeros (a cold start, :func:`start_vectors`'s ``v0``)."""
    warm = None if lanczos.warm_start is None else lanczos.warm_start.get(key, shape, op.dtype, op.device)
    return torch.zeros(shape, dtype=op.dtype, device=op.device) if warm is None else warm


def _keep_start(lanczos: Lanczos, key: tuple, ritz: torch.Tensor) -> None:
    """Keep a gathered run's Ritz vectors of this block for its next evaluation (:func:`_warm_start`)."""
    if lanczos.warm_start is not None:
        lanczos.warm_start.put(key, ritz)


def _grouped_vv_run(A: torch.Tensor, c: torch.Tensor, row_keep: torch.Tensor, X: torch.Tensor, W_O: torch.Tensor,
                    start: torch.Tensor, *, groups: int, tol: float, max_iter: int | None,
                    max_basis: int | None) -> LanczosRun:  # fmt: skip
    """The Lanczos run of ``||H_o(VV)||`` per kv group of ``m`` grouped-query attention blocks (``G = H / H_kv`` query
    heads per group), driven by :func:`solve`; its batch is ``(m, H_kv)``, its vectors ``(d_kv, d_V)`` flat.

    The group's value weights reach the output through every head of the group, ``dF = sum_h A_h X dW W_O^h``, so the
    Gauss-Newton product is ``dW -> sum_b X_b^T sum_h A_h^T c_b (dF W_O^h^T)`` (padded rows dropped): a sum of
    Kronecker products, no closed-form norm. PSD: the top end alone decides.

    Args:
        A: ``(m, B, H, L, L_kv)``; c: ``(m, B)``; row_keep: ``(m, B, L)``; X: ``(m, B, L_kv, d_kv)``;
            W_O: ``(m, H, d_V, d_out)``; start: ``(m, H_kv, d_kv d_V)``, the start vectors (zero rows: cold).
        groups: ``G``, the query heads per kv group.
        tol, max_iter, max_basis: the Lanczos settings.
    """
    m, B, H, L, L_kv = A.shape
    d, d_V, d_out = X.shape[-1], W_O.shape[-2], W_O.shape[-1]
    G = groups
    H_kv = H // G
    # 3-D views made once, so that every product below is one bmm (einsums over these shapes dispatched ~90 operators
    # per product): the group's heads stacked on the rows, (m B H_kv, G L, L_kv); W_O per group, (m H_kv, G d_V, d_out)
    A3 = A.reshape(m * B * H_kv, G * L, L_kv)
    A3T = A3.mT
    W3 = W_O.reshape(m * H_kv, G * d_V, d_out)
    W3T = W3.mT
    Xf = X.reshape(m, B * L_kv, d)
    XfT = Xf.mT
    rows = (c.unsqueeze(-1) * row_keep).reshape(m, 1, B * L, 1)  # c_b on the kept rows, 0 on the padded ones

    def mv(v: torch.Tensor) -> torch.Tensor:  # (m, H_kv, d d_V) -> (m, H_kv, d d_V)
        dW = v.view(m, H_kv, d, d_V).permute(0, 2, 1, 3).reshape(m, d, H_kv * d_V)
        XdW = torch.bmm(Xf, dW).view(m, B, L_kv, H_kv, d_V).permute(0, 1, 3, 2, 4).reshape(m * B * H_kv, L_kv, d_V)
        Yh = torch.bmm(A3, XdW).view(m, B, H_kv, G, L, d_V)  # every head's output tangent A_h X dW
        Yh = Yh.permute(0, 2, 1, 4, 3, 5).reshape(m * H_kv, B * L, G * d_V)
        U = torch.bmm(Yh, W3).view(m, H_kv, B * L, d_out).mul_(rows)  # c (sum_h A_h X dW W_O^h), per group
        S = torch.bmm(U.view(m * H_kv, B * L, d_out), W3T).view(m, H_kv, B, L, G, d_V)  # U W_O^h^T per head
        S = S.permute(0, 2, 1, 4, 3, 5).reshape(m * B * H_kv, G * L, d_V)
        T = torch.bmm(A3T, S).view(m, B, H_kv, L_kv, d_V)  # sum_h A_h^T (U W_O^h^T), per group
        T = T.permute(0, 1, 3, 2, 4).reshape(m, B * L_kv, H_kv * d_V)
        out = torch.bmm(XfT, T).view(m, d, H_kv, d_V)  # sum_b X_b^T T_b
        return out.permute(0, 2, 1, 3).reshape(m, H_kv, d * d_V)

    return LanczosRun(mv, start_vectors((m, H_kv), d * d_V, A.dtype, A.device, start), tol=tol, max_iter=max_iter,
                      max_basis=max_basis, both_ends=False)  # fmt: skip


def _vv_rows(A: torch.Tensor, c: torch.Tensor, row_keep: torch.Tensor) -> torch.Tensor:
    """``A`` ``(..., B, H, L, L_kv)`` with row ``i`` of sequence ``b`` scaled by ``sqrt(c_b)`` (``c`` ``(..., B)``) and
    by ``row_keep`` ``(..., B, L)`` (0 on padded rows)."""
    return A * (c.sqrt().unsqueeze(-1) * row_keep).unsqueeze(-2).unsqueeze(-1)


def _exact_norms(*Ms: torch.Tensor, batch_dims: tuple[int, ...]) -> torch.Tensor:
    """``||M||_2^2`` of each matrix of every batch ``Ms[i]`` ``(..., *batch_i, p_i, q_i)`` (:func:`gram_lambda_max`),
    then ``||M||_2``, flat along the last dimension: ``(..., 2 sum_i n_i)`` with ``n_i = prod(batch_i)``, for leading
    dimensions ``...`` (the blocks of a gathered call); ``batch_dims[i] = len(batch_i)``."""
    lead = Ms[0].dim() - 2 - batch_dims[0]
    sq = [t.flatten(lead) if t.dim() > lead else t.unsqueeze(-1) for t in gram_lambda_max(*Ms)]
    flat = torch.cat(sq, -1)
    return torch.cat([flat, flat.clamp_min(0).sqrt()], -1)


def _head_softmax_norm(A: torch.Tensor) -> torch.Tensor:
    """:func:`softmax_jacobian_norm` of ``A`` ``(..., B, H, L, L_kv)``, max over the sequences: ``(..., H)``."""
    return softmax_jacobian_norm(A).amax(-2)


def _vv_gram_run(A: torch.Tensor, c: torch.Tensor, row_keep: torch.Tensor, X: torch.Tensor, start: torch.Tensor, *,
                 tol: float, max_iter: int | None, max_basis: int | None) -> LanczosRun:  # fmt: skip
    """The Lanczos run of ``lambda_max(M^T M)`` per head of ``m`` attention blocks (:meth:`AttentionOperator.vv_factor`
    ``M``), driven by :func:`solve`; its batch is ``(m, H)``.

    The product ``v -> M^T M v = X^T Aw^T Aw X v`` costs ``O(B H L (L_kv + d_kv))``; forming ``M`` would cost
    ``O(B H L L_kv d_kv)``, more than the few products Lanczos needs.

    Args:
        A: ``(m, B, H, L, L_kv)``, each block's attention.
        c: ``(m, B)``, each block's output curvature per sequence.
        row_keep: ``(m, B, L)``, each block's kept rows (1) and padded ones (0).
        X: ``(m, B, L_kv, d_kv)``, each block's key/value input.
        start: ``(m, H, d_kv)``, the start vectors (zero rows: a cold start).
        tol, max_iter, max_basis: the Lanczos settings.
    """
    Aw = _vv_rows(A, c, row_keep)
    m, B, H, L, L_kv = Aw.shape
    d = X.shape[-1]
    # 3-D views made once: every product below is one bmm (matmuls over 4-D tensors dispatch ~6 operators)
    Xf, A3 = X.reshape(m, B * L_kv, d), Aw.reshape(m * B * H, L, L_kv)
    A3T = A3.mT

    def mv(v: torch.Tensor) -> torch.Tensor:  # (m, H, d) -> (m, H, d)
        t = torch.bmm(Xf, v.mT).view(m, B, L_kv, H).permute(0, 1, 3, 2).reshape(m * B * H, 1, L_kv)  # X_b v_h, rows
        # s^T = (Aw^T Aw t)^T as row-vector products (a batched (L, L) @ (L, 1) was 10x slower on CPU)
        s = torch.bmm(torch.bmm(t, A3T), A3)  # (m B H, 1, L_kv)
        return torch.bmm(s.view(m, B, H, L_kv).permute(0, 2, 1, 3).reshape(m, H, B * L_kv), Xf)  # sum_b X_b^T s_bh

    return LanczosRun(mv, start_vectors((m, H), d, Aw.dtype, Aw.device, start), tol=tol, max_iter=max_iter,
                      max_basis=max_basis, both_ends=False)  # fmt: skip


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def _as(t: torch.Tensor, perm: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """``t.permute(perm).reshape(shape)`` in **one** dispatched operator where that is a view (an ``as_strided`` view:
    each dimension of ``shape`` merges consecutive dimensions of the permuted tensor whose strides nest), else a copy in
    two (``permute_copy``, a view; ``permute``, ``reshape`` took three).

    The products below move tangent rows between the layouts ``(n, B, H, ...)`` and ``(B H, ...)``; each
    permute-then-reshape dispatches two or three operators, and on a GPU a Lanczos product of the attention is bound
    by what the host dispatches (issue 23). Reading sizes and strides dispatches nothing.
    """
    dims = [(t.shape[i], t.stride(i)) for i in perm if t.shape[i] != 1]  # size-1 dimensions have any stride
    strides = []
    for size in reversed(shape):  # each target dimension takes the innermost permuted dimensions left
        group, inner, nested = 1, 1, None  # sizes taken, the innermost's stride, the stride the next one must have
        while group < size:
            if not dims:
                return _copy(t, perm, shape)
            n, stride = dims.pop()
            if nested is None:
                inner = stride
            elif stride != nested:
                return _copy(t, perm, shape)
            nested, group = stride * n, group * n
        if group != size:
            return _copy(t, perm, shape)
        strides.append(inner)
    if dims:
        return _copy(t, perm, shape)
    return t.as_strided(shape, tuple(reversed(strides)), t.storage_offset())


def _copy(t: torch.Tensor, perm: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """``t.permute(perm).reshape(shape)`` as a contiguous copy: two dispatched operators."""
    return torch.permute_copy(t, perm).view(shape)


def _unflat(t: torch.Tensor, memory: Sequence[int], perm: Sequence[int]) -> torch.Tensor:
    """``t.view(memory).permute(perm)`` for a contiguous ``t`` (a matmul's result) in one dispatched operator."""
    strides = _strides(memory)
    return t.as_strided([memory[i] for i in perm], [strides[i] for i in perm], t.storage_offset())


def _left(S: torch.Tensor, T: torch.Tensor) -> torch.Tensor:
    """``S @ T`` for a shared ``S`` ``(B, H, p, q)`` and tangent rows ``T`` ``(n, B, H, q, r)`` -> ``(n, B, H, p, r)``.

    One ``bmm`` over ``B H`` with the rows beside ``r`` (``(B H, q, n r)``: a copy of ``T`` at most, never of ``S``):
    a matmul broadcasting ``S`` over ``n`` dispatches ~8 operators and copies ``S`` ``n`` times. The result is a
    permuted view whose memory is ``(B, H, p, n, r)``.
    """
    n, B, H, q, r = T.shape
    p = S.shape[-2]
    S3 = S if S.dim() == 3 else _as(S, (0, 1, 2, 3), (B * H, p, q))  # (a (B H, p, q) operand: AttentionOperator._bh)
    out = torch.bmm(S3, _as(T, (1, 2, 3, 0, 4), (B * H, q, n * r)))
    return _unflat(out, (B, H, p, n, r), (3, 0, 1, 2, 4))


def _right(T: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``T @ S`` for tangent rows ``T`` ``(n, B, H, p, q)`` and a shared ``S`` ``(B, H, q, r)`` -> ``(n, B, H, p, r)``.

    One ``bmm`` over ``B H`` with the rows stacked (``(B H, n p, q)``; no copy when ``T``'s memory is already
    ``(B, H, n, p, q)``, as :func:`_right`'s results are). The result is a permuted view of ``(B, H, n, p, r)``.
    """
    n, B, H, p, q = T.shape
    r = S.shape[-1]
    S3 = S if S.dim() == 3 else _as(S, (0, 1, 2, 3), (B * H, q, r))  # (a (B H, q, r) operand: AttentionOperator._bh)
    out = torch.bmm(_as(T, (1, 2, 0, 3, 4), (B * H, n * p, q)), S3)
    return _unflat(out, (B, H, n, p, r), (2, 0, 1, 3, 4))


def _per_head(T: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``T @ M_h`` for tangent rows ``T`` ``(n, B, H, p, q)``, per-head ``M`` ``(H, q, r)`` -> ``(n, B, H, p, r)``."""
    n, B, H, p, q = T.shape
    r = M.shape[-1]
    out = torch.bmm(_as(T, (2, 0, 1, 3, 4), (H, n * B * p, q)), M)
    return _unflat(out, (H, n, B, p, r), (1, 2, 0, 3, 4))


def _xw(X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``X W`` for a batch of per-head weights: X ``(B, L, d)``, W ``(n, H, d, k)`` -> ``(n, B, H, L, k)``.

    One ``(B L, d) @ (d, n H k)`` matmul for every tangent and head (a permuted view is returned): no copy of ``X``.
    """
    n, H, d, k = W.shape
    B, L, _ = X.shape
    Y = torch.mm(_as(X, (0, 1, 2), (B * L, d)), _as(W, (2, 0, 1, 3), (d, n * H * k)))  # (B L, n H k)
    return _unflat(Y, (B, L, n, H, k), (2, 0, 3, 1, 4))


def _xtm(X: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``sum_b X_b^T M_b``: X ``(B, L, d)``, M ``(n, B, H, L, k)`` -> ``(n, H, d, k)`` in one matmul over B*L."""
    n, B, H, L, k = M.shape
    d = X.shape[-1]
    out = torch.mm(_as(X, (2, 0, 1), (d, B * L)), _as(M, (1, 3, 0, 2, 4), (B * L, n * H * k)))
    return _unflat(out, (d, n, H, k), (1, 2, 0, 3))


def _attention(
    X3,
    batched,
    W_Q,
    W_K,
    W_V,
    W_O,
    *,
    b_Q,
    b_K,
    b_V,
    b_O,
    target,
    grad_output,
    output_curvature,
    causal,
    key_padding_mask,
    pairs,
    lanczos,
    dense,
    single,
    parts=PARTS,
    terms=True,
    window=None,
    scale=None,
    rotary=None,
    qk_norm=None,
    memory=None,
    memory_padding_mask=None,
    output_samples=None,
    precondition=None,
):
    """Shared body of :func:`self_attention` and :func:`multi_head_attention`; every argument is checked except
    ``output_samples``; ``precondition`` is ``D = P^{-1/2}`` per block (``"Q"``, ``"K"``, ``"V"``), heads split, and
    per QK-norm parameter (``"qk_norm.weight_q"``, ...)."""
    if not (isinstance(terms, bool) or terms == "signals"):
        raise ValueError(f"Invalid terms={terms!r}. Must be True, False or 'signals'.")
    B, L, d = X3.shape
    H, H_kv = W_Q.shape[0], W_K.shape[0]
    G = H // H_kv
    cross = memory is not None
    L_kv = memory.shape[1] if cross else L
    keep, row_keep, kv_keep = attention_masks(
        B, L, L_kv, causal, window, key_padding_mask, memory_padding_mask, cross, X3.device
    )
    # one forward pass: the operator's, which also gives the output the loss convention needs
    op = AttentionOperator(
        X3, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, keep, row_keep, None, None, suffix_heads=not single,
        memory=memory, rotary=rotary, scale=scale, qk_norm=qk_norm,
        # the warnings' terms alone (and the exact VV): the attention is all the forward must give
        probs_only=terms == "signals" and target is None and output_samples is None and not dense
        and pairs is not None and set(pairs) <= {"VV"} and (G == 1 or W_O is not None),
    )  # fmt: skip
    if target is not None:
        F = op.output(b_O)
    else:  # grad_output mode reads only the output's shape, dtype and device
        F = X3.new_zeros(()).expand(B, L, op.d_V if W_O is None else W_O.shape[-1])
    g, c, resid = output_cotangent(
        F,
        row_keep,
        target=target,
        grad_output=grad_output,
        output_curvature=output_curvature,
        batched=batched,
    )
    op.set_cotangent(g, c)
    samples = check_output_samples(
        output_samples, target=target, out_shape=tuple(F.shape), batched=batched, row_keep=row_keep, ref=X3
    )
    pairs = (*ATTENTION_PAIRS, *NORM_PAIRS) if pairs is None else tuple(pairs)
    for p in pairs:
        if p not in ATTENTION_PAIRS and p not in NORM_PAIRS and p != "QKV":
            raise ValueError(f"Unknown attention pair {p!r}; choose from {ATTENTION_PAIRS + ('QKV',) + NORM_PAIRS}.")
    n_pairs = norm_pairs(op, pairs)  # those of a QK-norm with parameters: N1N1, N2N2, N1N2
    pairs = tuple(p for p in pairs if p not in NORM_PAIRS)
    parts = check_parts(parts)

    def hk(base):  # per-query-head keys
        return [base] if single else [f"{base}/h{h}" for h in range(H)]

    def gk(base):  # per-kv-group keys (the head keys without grouping)
        return hk(base) if G == 1 else [f"{base}/g{j}" for j in range(H_kv)]

    # every exact spectral norm of the evaluation in one batched call (one eigvalsh per Gram size)
    mats: dict[str, torch.Tensor] = {}
    vv_exact = "VV" in pairs and G == 1 and op.vv_exact(op.Xkv.shape[-1], lanczos.max_iter)
    if vv_exact:
        mats["vv"] = op.vv_factor()  # (H, B L, d_kv)
    if W_O is not None and ("VV" in pairs or terms is True):
        mats["wo"] = W_O
    if terms:  # ||X||_2 per sequence over the kept rows, and the projections the rules read
        x_kept = X3 if key_padding_mask is None else X3 * row_keep.unsqueeze(-1).to(X3.dtype)
        mats.update(x=x_kept, wq=W_Q, wk=W_K)
    if terms is True:  # and every other norm of the bound terms
        mats.update(P=op.P, K=op.K_kv, V=op.V_kv, wv=W_V)
        if cross:
            mats["mem"] = memory * kv_keep.unsqueeze(-1).to(X3.dtype)
    # the squared norms (and their square roots) of every block of a Lockstep that meets here in one call: one
    # (sum of sizes,) tensor per block, split into its 1-D pieces
    shapes = [M.shape[:-2] for M in mats.values()]
    sizes = [math.prod(shape) for shape in shapes]
    flat = () if not mats else gathered(_exact_norms, *mats.values(), batch_dims=tuple(map(len, shapes)))
    flat = () if not mats else flat.split(sizes + sizes)
    flat = [t if len(shape) == 1 else t.view(shape) for t, shape in zip(flat, shapes + shapes, strict=True)]
    sq = dict(zip(mats, flat[: len(mats)], strict=True))
    norms = {k: v for k, v in zip(mats, flat[len(mats) :], strict=True) if k != "vv"}  # spectral norms

    out: dict[str, torch.Tensor] = {}
    iterative = [p for p in pairs if p not in ("VV", "QKV")]
    full = "QKV" in pairs or pairs == ATTENTION_PAIRS
    sop = splan = None
    if samples is not None:  # the sampled keys' Gram columns first: no Lanczos basis is held yet
        sop = with_sampled(op, SampledCurvature.of_heads(samples, W_O))
        diagonal = [p for p in pairs if p in ("VV", "QQ", "KK")]
        if G == 1:
            s_parts = [(diagonal, None, ("VV",))]
        else:  # as the other keys: QQ per query head, VV and KK per kv group
            q_diag, g_diag = [p for p in diagonal if p in QUERY_PAIRS], [p for p in diagonal if p in GROUP_PAIRS]
            s_parts = [(q_diag, _QueryView, ()), (g_diag, _GroupView, ("VV",))]
        splan = sampled_plan(sop, s_parts, lanczos=lanczos, scale=precondition)
    vv_plan = None
    if G == 1:
        if "VV" in pairs and not vv_exact:  # the d x d Gram's lambda_max by Lanczos (d > 256)
            vv_plan = op.vv_gram_plan(lanczos)
        views = [(op, iterative)]
    else:  # grouped-query attention: blocks with Q per query head, the others per kv group
        qv, gv = _QueryView(op), _GroupView(op)
        if "VV" in pairs:
            vv_plan = _grouped_vv_plan(gv, lanczos)
        views = [(qv, [p for p in iterative if p in QUERY_PAIRS]), (gv, [p for p in iterative if p in GROUP_PAIRS])]
    # the VV run, the engine's runs (the query view's and the group view's with grouped-query attention) and the
    # sampled keys' in shared solves (their stopping tests share host reads), within lanczos.solve_bytes of bases
    plans = [spectral_plan(views, parts=parts, lanczos=lanczos)] + ([splan] if splan is not None else [])
    solved = solve_planned(([vv_plan] if vv_plan is not None else []) + plans, lanczos.solve_bytes)
    vv_of = solved.pop(0) if vv_plan is not None else None
    norms_of, *sampled_of = solved
    if G == 1 and "VV" in pairs:
        gram, rel = (sq.get("vv"), None) if vv_plan is None else vv_of
        vv = op.outer_vv_norm(lanczos, gram=gram, wo2=sq.get("wo"))
        zero = torch.zeros((), dtype=X3.dtype, device=X3.device)
        rel = None if rel is None else rel.unbind()
        for h, (key, v) in enumerate(zip(hk("VV"), vv.unbind(), strict=True)):
            out[f"outer/{key}"] = v
            out[f"functional/{key}"] = zero
            out[f"hessian/{key}"] = v
            if rel is not None:
                out[f"residual/outer/{key}"] = out[f"residual/hessian/{key}"] = rel[h]
    elif G > 1 and "VV" in pairs:
        out.update(vv_of)
    out.update(norms_of[0])
    if G > 1:
        out.update(_group_keys(norms_of[1]))
    if full:
        if G == 1:
            out.update(full_norms(op, ["Q", "K", "V"], "QKV", parts=parts, lanczos=lanczos))
        else:
            out.update(_group_keys(full_norms(gv, ["Q", "K", "V"], "QKV", parts=parts, lanczos=lanczos)))
    if sampled_of:
        out.update(sampled_of[0][0])
        if G > 1:
            out.update(_group_keys(sampled_of[0][1]))

    if terms:
        if terms == "signals":
            out.update(_signal_terms(op, norms, hk, gk))
        else:
            out.update(
                _terms_and_bounds(X3, op, g, c, resid, row_keep, kv_keep, norms, target, hk, gk, bounds=qk_norm is None)
            )
    if dense:
        if G == 1:
            out.update(dense_blocks(op, ATTENTION_PAIRS, full=("Q", "K", "V")))
        else:
            out.update(dense_blocks(qv, QUERY_PAIRS))
            out.update(_group_keys(dense_blocks(gv, GROUP_PAIRS, full=("Q", "K", "V"))))
    if n_pairs or dense:  # the QK-norm parameters' blocks, after every other key (which they leave unchanged)
        norm_pre = block_precondition(op, precondition or {})
        out.update(qk_norm_norms(op, n_pairs, parts=parts, lanczos=lanczos, dense=dense, sampled_op=sop,
                                 precondition=norm_pre))  # fmt: skip
    lanczos.warn_unconverged(out, "self_attention" if single else "multi_head_attention")
    return out


def _signal_terms(op, norms, hk, gk) -> dict[str, torch.Tensor]:
    """The bound terms the warning rules read (:mod:`curvwatch.rules`), no others and no bounds: ``term/x_norm``,
    ``term/x_norm6``, ``term/softmax_jac_norm/h*``, ``term/wq_norm/h*``, ``term/wk_norm/h*`` (``/g*`` per kv group),
    each the same number :func:`_terms_and_bounds` gives. ``norms`` holds ``x`` ``(B,)``, ``wq`` ``(H,)``,
    ``wk`` ``(H_kv,)``."""
    x_max = norms["x"].max()
    out = {"term/x_norm": x_max, "term/x_norm6": x_max**6}
    per_head = torch.stack([gathered(_head_softmax_norm, op.A), norms["wq"]])  # (2, H)
    out.update(zip([f"term/{k}" for name in ("softmax_jac_norm", "wq_norm") for k in hk(name)],
                   per_head.flatten().unbind(), strict=True))  # fmt: skip
    wk = hk("wk_norm") if op.G == 1 else gk("wk_norm")
    out.update(zip([f"term/{k}" for k in wk], norms["wk"].unbind(), strict=True))
    return out


def _terms_and_bounds(
    X3, op, g, c, resid, row_keep, kv_keep, norms, target, hk, gk, bounds: bool = True
) -> dict[str, torch.Tensor]:
    """Bound terms (``term/...``) and corrected bounds (``bound/...``) of :func:`_attention`.

    ``norms`` holds the spectral norms computed with the exact ones: ``x`` ``(B,)`` (padded rows excluded),
    ``mem`` ``(B,)`` (cross-attention), ``P`` ``(B, H)``, ``K``, ``V`` ``(B, H_kv)`` and ``wq`` ``(H,)``, ``wk``,
    ``wv`` ``(H_kv,)``, ``wo`` ``(H,)`` (no ``wo`` without projection). ``bounds=False`` (QK-norm) leaves out every
    ``bound/...`` key: the bounds do not cover a normalised ``P``, ``K``.
    """
    A = op.A
    B, H, L = A.shape[:3]
    G = op.G
    x_b = norms["x"]  # (B,)
    alpha, beta = gathered(softmax_bound_factors, A)  # ||dA/dT||_2 and the softmax second derivative's bound, (B, H)
    ent = -torch.special.xlogy(A, A).sum(-1)  # (B, H, L); 0 log 0 = 0
    rk = row_keep.to(A.dtype).unsqueeze(1)  # (B, 1, L)
    entropy = (ent * rk).sum((0, 2)) / rk.sum((0, 2)).clamp_min(1)  # (H,)
    w_o = norms.get("wo")
    L_b = row_keep.sum(-1).to(X3.dtype)
    L_kv_b = kv_keep.sum(-1).to(X3.dtype)  # keys per sequence, the entropy's ceiling is log(L_kv_b)
    x_max = x_b.max()
    out: dict[str, torch.Tensor] = {
        "term/x_norm": x_max,
        "term/x_norm6": x_max**6,
        "term/inv_L3": torch.tensor(1.0 / L**3, dtype=X3.dtype, device=X3.device),
        "term/grad_norm": g.norm(),
    }
    if "mem" in norms:
        out["term/memory_norm"] = norms["mem"].max()
    if target is not None:
        out["term/residual_norm"] = resid.norm()
    per_head = {
        "softmax_jac_norm": alpha.amax(0),
        "softmax_hess_frob": beta.amax(0),
        "attn_entropy": entropy,
        "attn_entropy_norm": entropy / torch.log(L_kv_b.clamp_min(2)).mean(),
        "wq_norm": norms["wq"],
    }
    per_group = {"wk_norm": norms["wk"], "wv_norm": norms["wv"]}  # (H_kv,)
    if G == 1:
        per_head.update(per_group)
        per_group = {}
    if w_o is not None:
        per_head["wo_norm"] = w_o
    head_keys = [f"term/{key}" for name in per_head for key in hk(name)]
    head_vals = [torch.stack(list(per_head.values()))]  # (n_terms, H)
    group_keys = [f"term/{key}" for name in per_group for key in gk(name)]
    group_vals = [torch.stack(list(per_group.values()))] if per_group else []  # (n_terms, H_kv)
    if bounds:
        rmax = None if op.rotary is None else op.rotary.norm()  # ||R_i||_2: 1 for a rotation
        x_kv = norms.get("mem")  # None: keys and values read X
        x_k = x_kv if rmax is None else (x_b if x_kv is None else x_kv) * rmax
        kw = dict(
            x=x_b,
            p=norms["P"],
            kap=norms["K"].repeat_interleave(G, 1) if G > 1 else norms["K"],  # per query head (B, H)
            nu=norms["V"].repeat_interleave(G, 1) if G > 1 else norms["V"],
            gam=op.g_h.flatten(-2).norm(dim=-1).expand(B, H),
            c=c,
            alpha=alpha,
            beta=beta,
            w_o=torch.ones(H, dtype=X3.dtype, device=X3.device) if w_o is None else w_o,
            L_b=L_b,
            d_K=op.d_K,
            scale=abs(op.scale),
            x_q=None if rmax is None else x_b * rmax,
            x_k=x_k,
            x_v=x_kv,
        )
        if G == 1:
            names, table = _attention_bound_table(**kw)  # (n_bounds, H)
            head_keys += [f"bound/{key}" for name in names for key in hk(name)]
            head_vals.append(table)
        else:
            (names_h, table_h), (names_g, table_g) = _grouped_attention_bound_tables(groups=G, **kw)
            head_keys += [f"bound/{key}" for name in names_h for key in hk(name)]
            head_vals.append(table_h)
            group_keys += [f"bound/{key}" for name in names_g for key in gk(name)]
            group_vals.append(table_g)
    for keys, vals in ((head_keys, head_vals), (group_keys, group_vals)):
        if keys:  # one view per (quantity, head or group)
            out.update(zip(keys, torch.cat(vals).flatten().unbind(), strict=True))
    return out


def _modern_options(window, scale, rotary, rotary_interleaved, qk_norm, d_K: int, X3: torch.Tensor) -> dict:
    """The checked ``window``, ``scale``, ``rotary`` and ``qk_norm`` arguments of :func:`_attention`."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"Invalid window={window!r}. Must be an int >= 1 (keys i - w < j <= i with causal) or None.")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf
    ):
        raise ValueError(f"Invalid scale={scale!r}. Must be a finite number > 0, or None for 1/sqrt(d_K).")
    B, L, _ = X3.shape
    rot = None if rotary is None else check_rotary(rotary, rotary_interleaved, B, L, d_K, X3)
    return {"window": window, "scale": scale, "rotary": rot, "qk_norm": check_qk_norm(qk_norm, d_K, X3)}


def self_attention(
    X: torch.Tensor,
    W_Q: torch.Tensor,
    W_K: torch.Tensor,
    W_V: torch.Tensor,
    *,
    target: torch.Tensor | None = None,
    grad_output: torch.Tensor | None = None,
    output_curvature: float | None = None,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotary_interleaved: bool = False,
    qk_norm: dict | None = None,
    pairs=None,
    parts=PARTS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    terms: bool | str = True,
    output_samples: torch.Tensor | None = None,
    precondition: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Closed-form Hessian blocks of one softmax self-attention head ``F = softmax(X W_Q W_K^T X^T/sqrt(d_K)) X W_V``.

    Args:
        X: ``(L, d)`` or ``(B, L, d)`` input tokens.
        W_Q, W_K: ``(d, d_K)``; W_V: ``(d, d_V)`` (math convention ``X @ W``).
        target: ``F``-shaped target of the papers' loss ``||F - target||_F^2 / (L d_V)`` (mean over a batch).
        grad_output: ``F``-shaped back-propagated ``dl/dF`` (local quadratic model, summed over a batch).
        output_curvature: ``c`` of the quadratic model (default ``2/(L d_V)``), grad_output mode only.
        causal: mask future keys before the softmax.
        key_padding_mask: ``(B, L)`` or ``(L,)`` bool, True = padded; padded keys are masked and padded
            query rows leave the loss.
        window, scale, rotary, rotary_interleaved, qk_norm: attention as modern models compute it, exactly as in
            :func:`multi_head_attention` (sliding window, softmax scale, rotary tables ``(L, d_K/2..)`` applied to
            queries and keys, per-head QK-norm with its weights as blocks ``N1``, ``N2``); one head without ``W_O``.
        pairs: subset of ``("VV", "QQ", "KK", "VQ", "VK", "QK", "QKV")`` (default all; with a QK-norm that has
            weights also ``"N1N1"``, ``"N2N2"``, ``"N1N2"``).
        parts: which iterative norms to compute, a subset of ``("outer", "functional", "hessian")``
            (each costs its own Lanczos run; ``outer/VV`` is exact and always returned with ``VV``).
        lanczos: settings of the iterative norms (:class:`~curvwatch.closed_form.Lanczos`; default
            ``Lanczos()``: relative residual 1e-3, at most 100 steps and 16 vectors held per norm, a
            :class:`~curvwatch.closed_form.LanczosWarning` when a norm does not converge; ``EXACT`` runs each
            norm to the block size, for small blocks). Its ``warm_start`` (a
            :class:`~curvwatch.closed_form.WarmStart` kept between calls) starts each norm from the last Ritz
            vectors, as the monitor does across evaluations.
        terms: also return the bound terms ``term/...`` and the corrected bounds ``bound/...`` (default);
            False computes the norms only; ``"signals"`` only the terms the warning rules read
            (:mod:`curvwatch.rules`: ``term/x_norm``, ``term/x_norm6``, ``term/softmax_jac_norm``, ``term/wq_norm``,
            ``term/wk_norm``), the same numbers at a fraction of the cost, and no bounds.
        dense: also return the dense blocks ``dense/{outer,functional,hessian}/XY`` of shape ``(n_X, n_Y)``
            (vec_r order, equal to ``torch.func.hessian`` reshaped) and ``dense/*/QKV``.
        output_samples: ``(k, B, L, m)`` (``(k, L, m)`` for an unbatched ``X``; ``m`` the output width), grad_output
            mode only: ``k`` sampled gradients ``s_j`` of the loss in the output ``F``. They define the Monte-Carlo
            output curvature ``C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T`` (block diagonal over the sequences ``b``,
            padded query rows zeroed) of the sampled keys below; every other key is unchanged.
        precondition: with ``output_samples``, any of ``{"W_Q": P_Q, "W_K": P_K, "W_V": P_V}``: the diagonal of a
            positive preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``), each shaped like that weight argument.

    Returns:
        Flat dict of 0-d tensors: ``outer/XY``, ``functional/XY``, ``hessian/XY`` (spectral norms) for XY in
        VV, QQ, KK, VQ, VK, QK and QKV, corrected bounds ``bound/XY`` (and ``bound/outer/XY``,
        ``bound/functional/XY``), and bound terms ``term/x_norm``, ``term/x_norm6``, ``term/softmax_jac_norm``
        (measured ``||dA/dT||_2``), ``term/softmax_hess_frob``, ``term/inv_L3`` (the papers' ``1/L^3``,
        valid only for uniform attention), ``term/w{q,k,v}_norm``, ``term/attn_entropy``.

        With ``output_samples``, for each diagonal pair ``XX`` of ``pairs`` (VV, QQ, KK), with ``J_X = dF/dW_X`` and
        ``H_f,XX`` the functional block (``G = grad_output``): ``ggn/XX`` = ``lambda_max(J_X^T C J_X)``;
        ``sharpness/XX``, the largest *algebraic* eigenvalue of ``J_X^T C J_X + H_f,XX``: the block of the loss
        Hessian except the second-order part of the layers downstream of ``F``, which ``C`` leaves out (negative
        where ``H_f`` dominates with negative curvature); with ``precondition`` holding ``W_X``, ``precond_ggn/XX``
        and ``precond_sharpness/XX``, the same of ``P^{-1/2} (.) P^{-1/2}``; and ``residual/...`` of each. All by
        Lanczos (VV too), whatever ``parts``.

    Raises:
        ValueError: on shape mismatches, unless exactly one of ``target`` / ``grad_output`` is given, on
            ``output_samples`` / ``precondition`` with ``target``, and on ``precondition`` without
            ``output_samples``.

    Example:
        >>> X, W = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
        >>> W_V, T = torch.randn(3, 3, dtype=torch.float64), torch.zeros(4, 3, dtype=torch.float64)
        >>> out = self_attention(X, W, W, W_V, target=T)
        >>> bool(out["hessian/QQ"] <= out["bound/QQ"])
        True
    """
    X3, batched = as_batched(X)
    d = X3.shape[-1]
    W_Q = check_weight(W_Q, d, "W_Q", X3)
    W_K = check_weight(W_K, d, "W_K", X3)
    W_V = check_weight(W_V, d, "W_V", X3)
    if W_Q.shape != W_K.shape:
        raise ValueError(f"W_Q {tuple(W_Q.shape)} and W_K {tuple(W_K.shape)} must have the same shape (d, d_K).")
    shapes = {"W_Q": tuple(W_Q.shape), "W_K": tuple(W_K.shape), "W_V": tuple(W_V.shape)}
    shapes.update(precondition_shapes(qk_norm, W_Q.shape[-1]))  # the QK-norm's parameters, (d_K,) each
    pre = check_precondition(precondition, shapes, X3, has_samples=output_samples is not None)  # D = P^{-1/2}
    return _attention(
        X3,
        batched,
        W_Q.unsqueeze(0),
        W_K.unsqueeze(0),
        W_V.unsqueeze(0),
        None,
        b_Q=None,
        b_K=None,
        b_V=None,
        b_O=None,
        target=target,
        grad_output=grad_output,
        output_curvature=output_curvature,
        causal=causal,
        key_padding_mask=key_padding_mask,
        pairs=pairs,
        lanczos=Lanczos() if lanczos is None else lanczos,
        dense=dense,
        single=True,
        parts=parts,
        terms=terms,
        **_modern_options(window, scale, rotary, rotary_interleaved, qk_norm, W_Q.shape[-1], X3),
        output_samples=output_samples,
        # "W_Q" -> "Q": (1, d, d_K); "qk_norm.weight_q" stays, (d_K,)
        precondition={
            (nm[-1] if nm.startswith("W_") else nm): (D.unsqueeze(0) if nm.startswith("W_") else D)
            for nm, D in pre.items()
        },
    )


def multi_head_attention(
    X: torch.Tensor,
    W_Q: torch.Tensor,
    W_K: torch.Tensor,
    W_V: torch.Tensor,
    W_O: torch.Tensor,
    n_heads: int,
    *,
    n_kv_heads: int | None = None,
    b_Q: torch.Tensor | None = None,
    b_K: torch.Tensor | None = None,
    b_V: torch.Tensor | None = None,
    b_O: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    grad_output: torch.Tensor | None = None,
    output_curvature: float | None = None,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    window: int | None = None,
    scale: float | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotary_interleaved: bool = False,
    qk_norm: dict | None = None,
    memory: torch.Tensor | None = None,
    memory_padding_mask: torch.Tensor | None = None,
    pairs=None,
    parts=PARTS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    terms: bool | str = True,
    output_samples: torch.Tensor | None = None,
    precondition: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-head closed-form Hessian blocks of multi-head attention with the output projection inside ``F``.

    ``F = concat_h(softmax(s P_h K_g^T) V_g) W_O + b_O`` with ``P_h = R(N_q(X W_Q^h + b_Q^h))``,
    ``K_g = R(N_k(X_kv W_K^g + b_K^g))``, ``V_g = X_kv W_V^g + b_V^g`` and ``g = h // (H / H_kv)``, the way real
    models compute attention (see the module docstring; by default ``R``, ``N`` are the identity, ``s = 1/sqrt(d_K)``,
    ``H_kv = H`` and ``X_kv = X``). Blocks are those of each head's (each group's) own weights.

    Args:
        X: ``(L, d)`` or ``(B, L, d)`` queries (and keys/values without ``memory``).
        W_Q: ``(d, H d_K)``; W_K: ``(d_kv, H_kv d_K)``; W_V: ``(d_kv, H_kv d_V)``; W_O: ``(H d_V, m)``; head ``h``
            owns columns ``h d_K:(h+1) d_K`` of ``W_Q`` (rows ``h d_V:(h+1) d_V`` of ``W_O``), kv head ``g`` columns
            ``g d_K:(g+1) d_K`` of ``W_K`` (``g d_V:(g+1) d_V`` of ``W_V``). ``d_kv = d`` without ``memory``.
        n_heads: ``H``.
        n_kv_heads: ``H_kv`` key/value heads, dividing ``H`` (grouped-query attention; ``1``: multi-query); query head
            ``h`` reads kv head ``h // (H / H_kv)`` (Hugging Face's ``repeat_kv``, litgpt's query groups). ``None``:
            ``H``, plain multi-head attention (``H_kv = H`` gives bit-identical numbers).
        b_Q: ``(H d_K,)``; b_K: ``(H_kv d_K,)``; b_V: ``(H_kv d_V,)``; b_O: ``(m,)``; optional.
        target, grad_output, output_curvature, pairs, parts, lanczos, terms, dense: as in :func:`self_attention`
            (default ``c = 2/(L m)``); ``pairs`` may also name ``"N1N1"``, ``"N2N2"``, ``"N1N2"`` (the QK-norm
            parameters' blocks; in the default), left out where the call's ``qk_norm`` lacks that norm's parameters.
        causal: query ``i`` sees keys ``j <= i`` (also across, in cross-attention).
        key_padding_mask: ``(B, L)`` or ``(L,)`` bool, True = padded query position: dropped from the loss and, in
            self-attention, never attended to.
        window: sliding window ``w >= 1``: with ``causal`` query ``i`` sees keys ``i - w < j <= i`` (Mistral, Gemma 2,
            Qwen sliding layers), without it ``|i - j| < w``. ``None``: no window.
        scale: softmax scale ``s``, a positive float (Gemma: ``query_pre_attn_scalar**-0.5``, T5: ``1.0``), or
            ``None`` for ``1/sqrt(d_K)``.
        rotary: ``(cos, sin)`` rotary tables, each ``(L, r)`` or ``(B, L, r)`` (``(1, L, r)`` broadcasts), ``r <= d_K``
            even, in the form Hugging Face (``LlamaRotaryEmbedding(x, position_ids)`` gives ``(B, L, d_K)``) and
            litgpt (``build_rope_cache(L, rope_n_elem)`` gives ``(L, r)``) pass them: ``r`` columns with the
            frequencies' halves duplicated, ``cos[..., i] == cos[..., i + r/2]`` (checked exactly), for either layout.
            Only the first ``r`` dims of each head's queries and keys rotate (partial rotary when ``r < d_K``,
            NeoX / pythia). Self-attention only. See :func:`apply_rotary`.
        rotary_interleaved: ``False``: half-split layout (LLaMA, NeoX, Hugging Face), dim ``i`` pairs with
            ``i + r/2``; ``True``: GPT-J layout, dim ``2i`` pairs with ``2i + 1`` (frequency ``i`` = column ``i``).
        qk_norm: per-head QK-norm of Qwen3, OLMo-style per-head norms and Gemma 3, applied to the queries and keys of
            every head before the rotary embedding (the Hugging Face and litgpt order): ``None`` or a dict with
            ``"kind"`` (``"rmsnorm"`` or ``"layernorm"``), ``"eps"``, optional ``"weight_q"``, ``"weight_k"``
            ``(d_K,)``, ``"bias_q"``, ``"bias_k"`` ``(d_K,)`` (layernorm only) and ``"weight_offset"`` (``0.0``, or
            ``1.0`` for Gemma's ``(1 + weight)``). The norms' own parameters are blocks ``N1`` (query norm: its weight,
            then its bias when it has one, ``(p, d_K)``) and ``N2`` (key norm), shared by every head; see Returns.
            OLMo 2 normalises the whole ``H d_K`` projection instead, which couples the heads: not this.
        memory: ``(B, L_kv, d_kv)`` (``(L_kv, d_kv)`` unbatched) cross-attention source: keys and values are
            ``memory W_K``, ``memory W_V``; queries come from ``X``. ``None``: self-attention.
        memory_padding_mask: ``(B, L_kv)`` or ``(L_kv,)`` bool, True = padded memory position (never attended to).
            A query that sees no key at all has ``A = 0`` (output ``b_O``) and no curvature.
        output_samples: ``(k, B, L, m)`` (``(k, L, m)`` unbatched): sampled output gradients defining the Monte-Carlo
            output curvature ``C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T`` of the sampled keys, as in
            :func:`self_attention` (grad_output mode only; padded query rows zeroed).
        precondition: with ``output_samples``, any of ``{"W_Q": P_Q, "W_K": P_K, "W_V": P_V}``, each positive and of
            that weight argument's packed shape (``(d, H d_K)`` etc.; its heads are split like the weight's): the
            diagonal of a preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``); and ``"qk_norm.weight_q"``,
            ``"qk_norm.bias_q"``, ``"qk_norm.weight_k"``, ``"qk_norm.bias_k"`` ``(d_K,)`` for the parameters ``qk_norm``
            holds (block ``N1`` / ``N2`` is preconditioned when every one of its parameters has an entry).

    Returns:
        The keys of :func:`self_attention` suffixed by head or group. With ``H_kv = H``: ``/h{i}`` for everything,
        e.g. ``hessian/QQ/h0``, ``term/softmax_jac_norm/h1``, ``bound/VQ/h0``. With ``H_kv < H``:

        * ``{part}/QQ/h{i}``, ``{part}/VQ/h{i}``, ``{part}/QK/h{i}`` (``i < H``): the blocks of query head ``i``'s
          ``W_Q`` with itself and with its group's ``W_V`` and ``W_K``;
        * ``{part}/KK/g{j}``, ``{part}/VV/g{j}``, ``{part}/VK/g{j}`` (``j < H_kv``): the blocks of kv head ``j``'s
          ``W_K``, ``W_V``, collecting every query head that reads them; ``{part}/QKV/g{j}``: the whole Hessian of
          group ``j``'s weights in block order ``Q`` (its ``G`` query heads in order), ``K``, ``V``;
        * ``term/...`` per query head (``/h{i}``) except ``term/wk_norm/g{j}``, ``term/wv_norm/g{j}``;
          ``bound/...`` as the blocks; ``outer/VV/g{j}`` by Lanczos (no closed-form norm when heads share ``W_V``).

        ``term/memory_norm`` (``||memory||_2``, max over sequences) with ``memory``; ``term/x_norm`` stays the
        queries' input. ``bound/...`` keys cover scale, windows, rotary (through ``max ||R_i||``), grouped-query
        and cross-attention; **with ``qk_norm`` no ``bound/...`` key is returned** (the bounds do not cover it).

        With ``output_samples``: ``ggn/XX``, ``sharpness/XX`` (the largest *algebraic* eigenvalue of
        ``J_X^T C J_X + H_f,XX``, leaving out the second-order part of the layers downstream of ``F``), with
        ``precondition`` holding ``W_X`` ``precond_ggn/XX``, ``precond_sharpness/XX`` (of ``P^{-1/2} (.) P^{-1/2}``),
        and ``residual/...`` of each, for XX in VV, QQ, KK of ``pairs`` (see :func:`self_attention`), suffixed like
        that pair's other keys: ``/h{i}`` with ``H_kv = H``; with ``H_kv < H`` ``QQ/h{i}`` per query head and
        ``VV/g{j}``, ``KK/g{j}`` per kv group (blocks of the head's ``W_Q`` slice, the group's ``W_K``, ``W_V`` slices).

        With a ``qk_norm`` that has parameters: ``{part}/N1N1``, ``{part}/N2N2``, ``{part}/N1N2`` (and
        ``residual/...``, ``dense/...``), without head suffix: the blocks of the query norm's parameters ``N1`` (weight
        ``gamma_q``, then bias ``beta_q`` for a LayerNorm with bias; ``(p d_K)`` rows in that order) and the key
        norm's ``N2``, each shared by all heads, so the Gauss-Newton part collects every head's output (cross-head
        terms). Only a norm with parameters gets blocks: ``N1N1`` alone without ``weight_k``, none without any.
        With ``output_samples`` also ``ggn/``, ``sharpness/`` (``precond_...`` with ``precondition`` covering the
        block) of ``N1N1``, ``N2N2``; no ``sharpness_spread/`` for them. Not computed: the blocks between a norm
        parameter and ``W_Q``, ``W_K``, ``W_V``.

    Raises:
        ValueError: on shape mismatches or invalid options (the message says what is allowed), unless exactly one
            of ``target`` / ``grad_output`` is given, on ``output_samples`` / ``precondition`` with ``target``, and
            on ``precondition`` without ``output_samples``.

    Example:
        >>> X = torch.randn(5, 4, dtype=torch.float64)
        >>> W = lambda *s: torch.randn(*s, dtype=torch.float64)
        >>> out = multi_head_attention(X, W(4, 4), W(4, 4), W(4, 4), W(4, 4), 2, grad_output=W(5, 4), causal=True)
        >>> sorted(k for k in out if k.startswith("hessian/QQ"))
        ['hessian/QQ/h0', 'hessian/QQ/h1']
        >>> out = multi_head_attention(X, W(4, 4), W(4, 2), W(4, 2), W(4, 4), 2, n_kv_heads=1, grad_output=W(5, 4))
        >>> sorted(k[len("hessian/") :] for k in out if k.startswith("hessian/"))  # doctest: +NORMALIZE_WHITESPACE
        ['KK/g0', 'QK/h0', 'QK/h1', 'QKV/g0', 'QQ/h0', 'QQ/h1', 'VK/g0', 'VQ/h0', 'VQ/h1', 'VV/g0']
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"Invalid n_heads={n_heads!r}. Must be an int >= 1.")
    H_kv = n_heads if n_kv_heads is None else n_kv_heads
    if isinstance(H_kv, bool) or not isinstance(H_kv, int) or H_kv < 1 or n_heads % H_kv:
        raise ValueError(
            f"Invalid n_kv_heads={n_kv_heads!r}. Must be an int >= 1 dividing n_heads={n_heads} (query head h reads kv "
            "head h // (n_heads / n_kv_heads)), or None for n_heads."
        )
    X3, batched = as_batched(X)
    B, L, d = X3.shape
    M3 = None
    if memory is not None:
        M3, mem_batched = as_batched(memory, "memory")
        if mem_batched != batched or M3.shape[0] != B:
            raise ValueError(
                f"memory {tuple(memory.shape)} must be batched like X {tuple(X.shape)}: (B, L_kv, d_kv) with B = {B}, "
                "or (L_kv, d_kv) for an unbatched X."
            )
        M3 = M3.to(dtype=X3.dtype, device=X3.device)
    elif memory_padding_mask is not None:
        raise ValueError(
            "memory_padding_mask needs memory= (cross-attention); self-attention pads with key_padding_mask."
        )
    d_kv = d if M3 is None else M3.shape[-1]
    W_Q = split_heads(check_weight(W_Q, d, "W_Q", X3), n_heads, "W_Q")
    W_K = split_heads(check_weight(W_K, d_kv, "W_K", X3), H_kv, "W_K")
    W_V = split_heads(check_weight(W_V, d_kv, "W_V", X3), H_kv, "W_V")
    if W_Q.shape[-1] != W_K.shape[-1]:
        raise ValueError(
            f"W_Q and W_K must have the same shape per head (d_K columns each); got {tuple(W_Q.shape)} for "
            f"{n_heads} query heads and {tuple(W_K.shape)} for {H_kv} kv heads (pass n_kv_heads= for grouped-query "
            "attention)."
        )
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
    shapes.update(precondition_shapes(qk_norm, d_K))  # "qk_norm.weight_q": (d_K,), ... (the norm's parameters)
    pre = check_precondition(precondition, shapes, X3, has_samples=output_samples is not None)  # D = P^{-1/2}
    heads = {"W_Q": H, "W_K": H_kv, "W_V": H_kv}
    pre = {
        (nm[-1] if nm in heads else nm): (split_heads(D, heads[nm], f"precondition[{nm!r}]") if nm in heads else D)
        for nm, D in pre.items()
    }  # "W_Q" -> "Q": (heads, d, d_K); "qk_norm.weight_q" stays, (d_K,)
    b_Q = check_like(b_Q, (H * d_K,), "b_Q", X3)
    b_K = check_like(b_K, (H_kv * d_K,), "b_K", X3)
    b_V = check_like(b_V, (H_kv * d_V,), "b_V", X3)
    b_O = check_like(b_O, (W_O.shape[-1],), "b_O", X3)
    if rotary is not None and M3 is not None:
        raise ValueError(
            "rotary= applies to self-attention only: in cross-attention queries and keys sit at different positions. "
            "Drop rotary or memory."
        )
    return _attention(
        X3,
        batched,
        W_Q,
        W_K,
        W_V,
        W_O,
        b_Q=None if b_Q is None else b_Q.reshape(H, d_K),
        b_K=None if b_K is None else b_K.reshape(H_kv, d_K),
        b_V=None if b_V is None else b_V.reshape(H_kv, d_V),
        b_O=b_O,
        target=target,
        grad_output=grad_output,
        output_curvature=output_curvature,
        causal=causal,
        key_padding_mask=key_padding_mask,
        pairs=pairs,
        lanczos=Lanczos() if lanczos is None else lanczos,
        dense=dense,
        single=False,
        parts=parts,
        terms=terms,
        **_modern_options(window, scale, rotary, rotary_interleaved, qk_norm, d_K, X3),
        memory=M3,
        memory_padding_mask=memory_padding_mask,
        output_samples=output_samples,
        precondition=pre,
    )
