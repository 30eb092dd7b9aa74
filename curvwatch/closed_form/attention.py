"""Closed-form Hessian blocks of (multi-head) softmax self-attention: Gauss-Newton and functional parts.

Notation (formula sheet §1-§3): ``X`` (L, d) tokens, per head ``P = X W_Q + b_Q``, ``K = X W_K + b_K``,
``V = X W_V + b_V``, ``T = P K^T / sqrt(d_K)`` (masked), ``A = softmax_row(T)``, head output ``F_h = A V`` and
the layer output ``F = sum_h F_h W_O^h (+ b_O)`` (``W_O = I`` for a single head without projection).

The Hessian of the loss in the weights of head ``h`` splits into ``H = H_o + H_f``:

* ``H_o = c J^T J`` (outer / Gauss-Newton), with ``J = dF/dW`` and ``c`` the output curvature;
* ``H_f = sum_k g_k d^2 F_k / dW^2`` (functional), with ``g = dl/dF``.

We never build the ``L^2 x L^2`` softmax Jacobian nor the ``L^4 x L^2`` second derivative. Products with
``H_o`` and ``H_f`` are written directly from their closed forms:

* softmax Jacobian on a row: ``dA_i = a_i * (dT_i - <a_i, dT_i>)`` (symmetric, so it is also its VJP);
* softmax second derivative contracted with the cotangent ``G_A = g_h V^T``:
  ``d/dA <G_A, J_A dT> = G_A*dT - G_A <a_i,dT_i> - <a_i,G_A,i> dT`` (P2 Lemma C.1 contracted);
* the bilinear term of ``T`` in ``(W_Q, W_K)``: ``(X^T Gamma X) kron I / sqrt(d_K)``, ``Gamma = dl/dT``
  (formula sheet §2, erratum 7).

Each product costs ``O(L^2 (d_K + d_V) + L d (d_K + d_V))`` per head, like one forward pass.
``||H_o(VV)||`` is exact in closed form: ``(sum_b c_b ||A_b X_b||^2-Gram) * ||W_O^h||^2``.
"""

from __future__ import annotations

import math
from functools import cached_property

import torch

from ._common import as_batched, check_like, check_weight, gram_lambda_max, output_cotangent
from ._lanczos import lanczos_max_abs
from ._operator import (
    KINDS,
    BlockOperator,
    ParamInfo,
    _check_kinds,
    dense_blocks,
    full_norms,
    run_parts,
    select_rows,
    spectral_norms,
)
from .bounds import _attention_bound_table, softmax_bound_factors
from .settings import Lanczos

ATTENTION_PAIRS = ("VV", "QQ", "KK", "VQ", "VK", "QK")


def softmax_jvp(A: torch.Tensor, dT: torch.Tensor) -> torch.Tensor:
    """Row-softmax Jacobian applied to ``dT``: ``A * (dT - rowsum(A * dT))``; also its VJP (symmetric)."""
    return A * (dT - (A * dT).sum(-1, keepdim=True))


class AttentionOperator(BlockOperator):
    """Head-diagonal closed-form Hessian operator of multi-head attention for the weights of each head.

    Args:
        X: ``(B, L, d)`` block input.
        W_Q, W_K: ``(H, d, d_K)`` per-head weights; W_V: ``(H, d, d_V)``.
        W_O: ``(H, d_V, m)`` per-head output projection, or None (then ``m = d_V`` and ``H = 1``).
        b_Q, b_K: ``(H, d_K)`` or None; b_V: ``(H, d_V)`` or None.
        keep: ``(B, L, L)`` bool, True where query i may attend key j (causal and padding), or None.
        row_keep: ``(B, L)`` bool, query rows that belong to the loss.
        g: ``(B, L, m)`` cotangent ``dl/dF`` (zero on dropped rows), or None to set it later with
            :meth:`set_cotangent` (once :meth:`output` has given the loss its ``F``).
        c: ``(B,)`` output curvature per sequence (with ``g``).
    """

    suffix_heads = True
    supports_subsets = True
    supports_total = True

    def __init__(self, X, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, keep, row_keep, g, c, suffix_heads=True):
        self.X = X
        self.H, d, self.d_K = W_Q.shape
        self.d_V = W_V.shape[-1]
        self.n_heads = self.H
        self.head_diagonal = True
        self.suffix_heads = suffix_heads
        self.dtype, self.device = X.dtype, X.device
        self.params = {
            "V": ParamInfo((d, self.d_V), True),
            "Q": ParamInfo((d, self.d_K), True),
            "K": ParamInfo((d, self.d_K), True),
        }
        self.scale = 1.0 / math.sqrt(self.d_K)
        self.W_Q, self.W_K, self.W_V, self.W_O = W_Q, W_K, W_V, W_O
        # queries, keys and values in one matmul: X (B L, d) @ [W_Q | W_K | W_V] (d, H (2 d_K + d_V)), then
        # contiguous (B, H, L, k) copies (the Gram matrices and products then need no copy of their own)
        B, L = X.shape[:2]
        W_all = torch.cat([W.permute(1, 0, 2).reshape(d, -1) for W in (W_Q, W_K, W_V)], 1)  # (H, d, k) -> (d, H k)
        Y = X.reshape(B * L, d) @ W_all  # (B L, H (2 d_K + d_V))
        sizes = [self.H * self.d_K, self.H * self.d_K, self.H * self.d_V]
        self.P, self.Kk, self.Vv = (
            y.reshape(B, L, self.H, -1).transpose(1, 2).contiguous() for y in Y.split(sizes, 1)
        )  # (B, H, L, d_K), (B, H, L, d_K), (B, H, L, d_V)
        for t, b in ((self.P, b_Q), (self.Kk, b_K), (self.Vv, b_V)):
            if b is not None:
                t.add_(b[None, :, None, :])
        T = self.P @ self.Kk.mT * self.scale  # (B, H, L, L)
        if keep is not None:
            T = T.masked_fill(~keep.unsqueeze(1), float("-inf"))
        A = torch.softmax(T, dim=-1)
        self.A = torch.nan_to_num(A, nan=0.0)  # rows with every key masked carry no weight
        self.A1 = self.A.unsqueeze(0)  # (1, B, H, L, L), see set_cotangent
        self.row_keep = row_keep.to(X.dtype)  # (B, L)
        if g is not None:
            self.set_cotangent(g, c)

    def output(self, b_O: torch.Tensor | None = None) -> torch.Tensor:
        """The layer output ``F = sum_h A_h V_h W_O^h (+ b_O)``, ``(B, L, m)``."""
        Fh = self.A @ self.Vv  # (B, H, L, d_V)
        F = Fh[:, 0] if self.W_O is None else torch.einsum("bhlv,hvm->blm", Fh, self.W_O)
        return F if b_O is None else F + b_O

    def set_cotangent(self, g: torch.Tensor, c: torch.Tensor) -> None:
        """Set ``g = dl/dF`` ``(B, L, m)`` and the output curvature ``c`` ``(B,)``.

        The products' cotangent factors (``G_A``, ``Gamma``, ...) are computed on first use: an evaluation
        without Lanczos never needs them.
        """
        W_O = self.W_O
        self.c = c
        self.g_h = g.unsqueeze(1) if W_O is None else torch.einsum("blm,hvm->bhlv", g, W_O)  # (B, H, L, d_V)
        for name in ("G_A", "Gamma", "rG", "G_A1", "GmR1"):
            self.__dict__.pop(name, None)  # drop what an earlier cotangent cached

    @cached_property
    def G_A(self) -> torch.Tensor:
        """``dl/dA = g_h V^T``, ``(B, H, L, L)``."""
        return self.g_h @ self.Vv.mT

    @cached_property
    def Gamma(self) -> torch.Tensor:
        """``dl/dT``, ``(B, H, L, L)``."""
        return softmax_jvp(self.A, self.G_A)

    @cached_property
    def rG(self) -> torch.Tensor:
        """``<a_i, G_A,i>`` per row, ``(B, H, L, 1)``."""
        return (self.A * self.G_A).sum(-1, keepdim=True)

    # rank-matched views for products with (n, B, H, L, L) tangents: same-rank elementwise ops take
    # PyTorch's fast path (broadcasting over a missing leading dimension was 2x slower on CPU)
    @cached_property
    def G_A1(self) -> torch.Tensor:
        return self.G_A.unsqueeze(0)

    @cached_property
    def GmR1(self) -> torch.Tensor:
        return (self.G_A - self.rG).unsqueeze(0)

    @cached_property
    def Mo(self) -> torch.Tensor | None:
        """Per-head output metric ``W_O^h W_O^h^T``, ``(H, d_V, d_V)`` (None without projection)."""
        return None if self.W_O is None else self.W_O @ self.W_O.mT

    # ---- first order -------------------------------------------------------------------------
    def jvp(self, tangent):
        """Per-head output tangents ``dF_h`` ``(n, B, H, L, d_V)`` plus intermediates reused by the HVP.

        ``tangent`` maps any of ``"Q", "K", "V"`` to ``(n, H, d, k)``; a missing name is a zero perturbation
        and costs nothing.
        """
        X, A = self.X, self.A1
        dP = _xw(X, tangent["Q"]) if "Q" in tangent else None  # (n, B, H, L, d_K)
        dK = _xw(X, tangent["K"]) if "K" in tangent else None
        dV = _xw(X, tangent["V"]) if "V" in tangent else None  # (n, B, H, L, d_V)
        dT = None  # (n, B, H, L, L), already scaled by 1/sqrt(d_K)
        if dP is not None:
            dT = (dP * self.scale) @ self.Kk.mT
        if dK is not None:
            t = self.P @ (dK * self.scale).mT
            dT = t if dT is None else dT.add_(t)
        r = dA = None
        if dT is not None:
            r = torch.linalg.vecdot(A, dT).unsqueeze(-1)  # attention-weighted row mean of dT, (n, B, H, L, 1)
            dA = (dT - r).mul_(A)  # softmax JVP
        dF = None
        if dA is not None:
            dF = dA @ self.Vv
        if dV is not None:
            dF = self.A @ dV if dF is None else dF.add_(self.A @ dV)
        return dF, (dP, dK, dV, dT, r, dA)

    def pull(self, inter, u=None, second_order=True, outputs=("V", "Q", "K")):
        """Weight gradients of the output cotangent ``u`` plus (``second_order``) the g-contracted second derivative.

        With ``u = c dF`` and ``second_order=False`` this is ``H_o v`` (the Gauss-Newton product, i.e. the VJP
        ``J^T u``); with ``u=None`` and ``second_order=True`` it is ``H_f v``; with both, the total ``H v`` in one
        pass: the two parts share every matmul back to the weights (one softmax VJP, one ``X^T`` product per block).

        Args:
            inter: intermediates of :meth:`jvp` for the same ``n`` tangents, ``(dP, dK, dV, dT, r, dA)``.
            u: ``(n, B, H, L, d_V)`` per-head output cotangents, or None.
            second_order: add the functional (second-derivative) terms.
            outputs: weight blocks to return, a subset of ``("V", "Q", "K")``.

        Returns:
            ``{name: (n, H, d, k)}`` for the names in ``outputs``.
        """
        X, A, g_h = self.X, self.A1, self.g_h
        dP, dK, dV, dT, r, dA = inter if second_order else (None,) * 6
        ref = u if u is not None else next((t for t in inter if t is not None), None)
        out = {}
        if "V" in outputs:
            mV = None if u is None else self.A.mT @ u
            if dA is not None:
                mV = dA.mT @ g_h if mV is None else mV.add_(dA.mT @ g_h)
            out["V"] = self._zeros(ref.shape[0], "V") if mV is None else _xtm(X, mV)
        if "Q" in outputs or "K" in outputs:
            # hA = d/dA of <u, A V> + <G_A, dA> + <g_h, A dV>; the middle term is G_A*(dT - r) - rG*dT
            hA = None
            if dT is not None:
                hA = (self.GmR1 * dT).addcmul_(self.G_A1, r, value=-1.0)
            for a, b in ((u, self.Vv), (g_h, dV)):
                if a is not None and b is not None:
                    hA = a @ b.mT if hA is None else _add_matmul_(hA, a, b.mT)
            G2 = None
            if hA is not None:  # softmax VJP, in place on the temporary hA
                G2 = hA.sub_(torch.linalg.vecdot(A, hA).unsqueeze(-1)).mul_(A)
            for name, left, right, Gam in (("Q", G2, self.Kk, dK), ("K", None if G2 is None else G2.mT, self.P, dP)):
                if name not in outputs:
                    continue
                m = None if left is None else left @ right
                if Gam is not None:  # the bilinear term of T in (W_Q, W_K)
                    t = (self.Gamma if name == "Q" else self.Gamma.mT) @ Gam
                    m = t if m is None else m.add_(t)
                out[name] = self._zeros(ref.shape[0], name) if m is None else _xtm(X, m) * self.scale
        return out

    def vjp(self, u, outputs=("V", "Q", "K")):
        """``J^T u`` for per-head output cotangents ``u`` ``(n, B, H, L, d_V)``: the weight grads in ``outputs``."""
        return self.pull((None,) * 6, u=u, second_order=False, outputs=outputs)

    # ---- second order ------------------------------------------------------------------------
    def functional(self, inter, outputs=("V", "Q", "K")):
        """``H_f v = sum_k g_k d^2F_k/dW^2 v`` per head, from the intermediates of :meth:`jvp`."""
        return self.pull(inter, u=None, second_order=True, outputs=outputs)

    def _outer_cotangent(self, dF):
        """``u = c dF`` (through the output metric ``W_O W_O^T``), padded rows dropped."""
        u = dF if self.Mo is None else dF @ self.Mo
        return u * (self.c[:, None, None, None] * self.row_keep[:, None, :, None])

    def apply(self, tangent, outputs=("V", "Q", "K"), outer_rows=None, func_rows=None, total_rows=None):
        """``(H_o v, H_f v)`` restricted to the weight blocks in ``outputs`` (and ``H v`` with ``total_rows``).

        ``outer_rows`` / ``func_rows`` / ``total_rows`` (index tensors) select the tangents for which each part
        is needed; the returned tensors then hold only those rows, in that order. ``outer_rows`` and
        ``func_rows`` default to all rows; with ``total_rows`` a third dict ``H v`` (both parts, fused) is
        returned.
        """
        dF, inter = self.jvp(tangent)
        n = next(iter(tangent.values())).shape[0]
        if dF is None:  # no perturbation at all
            zero = {nm: self._zeros(n, nm) for nm in outputs}
            return (zero, zero) if total_rows is None else (zero, zero, zero)

        def part(idx, outer: bool, second_order: bool) -> dict:
            u = self._outer_cotangent(select_rows(dF, idx)) if outer else None
            inter_i = tuple(select_rows(t, idx) for t in inter) if second_order else (None,) * 6
            return self.pull(inter_i, u=u, second_order=second_order, outputs=outputs)

        return run_parts(part, outer_rows, func_rows, total_rows)

    # ---- exact pieces ------------------------------------------------------------------------
    def _vv_rows(self) -> torch.Tensor:
        """``A`` with row ``i`` of sequence ``b`` scaled by ``sqrt(c_b)`` (0 on padded rows), ``(B, H, L, L)``."""
        return self.A * (self.c.sqrt()[:, None] * self.row_keep)[:, None, :, None]

    def vv_factor(self) -> torch.Tensor:
        """``M`` with ``M^T M = sum_b c_b (A X)_b^T (A X)_b`` per head (padded rows dropped), ``(H, B L, d)``."""
        B, H, L = self.A.shape[:3]
        M1 = self._vv_rows().reshape(B, H * L, L) @ self.X  # one matmul per sequence for all heads, (B, H L, d)
        return M1.reshape(B, H, L, -1).transpose(0, 1).reshape(H, B * L, -1)  # (B, H, L, d) -> (H, B L, d)

    def _vv_matvec(self):
        """``v -> M^T M v`` per head for ``v`` ``(H, d)``, without forming :meth:`vv_factor`.

        ``M v = Aw (X v)`` costs ``O(B H L (L + d))`` per product; forming ``M`` costs ``O(B H L^2 d)``, more
        than the few products Lanczos needs.
        """
        Aw, X = self._vv_rows(), self.X  # (B, H, L, L), (B, L, d)
        B, L, d = X.shape

        def mv(v: torch.Tensor) -> torch.Tensor:
            t = (X @ v.mT).transpose(1, 2).unsqueeze(-2)  # X_b v_h as rows: (B, L, H) -> (B, H, 1, L)
            # s^T = (Aw^T Aw t)^T as row-vector products (a batched (L, L) @ (L, 1) was 10x slower on CPU)
            s = (t @ Aw.mT) @ Aw  # (B, H, 1, L)
            return s.squeeze(-2).permute(1, 0, 2).reshape(-1, B * L) @ X.reshape(B * L, d)  # sum_b X_b^T s_bh

        return mv

    @staticmethod
    def vv_exact(d: int, max_iter: int | None) -> bool:
        """Whether :meth:`outer_vv_norm` takes the ``d x d`` eigen-decomposition (else Lanczos)."""
        return d <= 256 or max_iter is None

    def outer_vv_norm(
        self,
        lanczos: Lanczos,
        gram: torch.Tensor | None = None,
        wo2: torch.Tensor | None = None,
        info: dict | None = None,
    ) -> torch.Tensor:
        """Exact ``||H_o(VV)||`` per head: ``lambda_max(sum_b c_b (A X)_b^T (A X)_b) * ||W_O^h||^2``.

        ``gram`` (that ``lambda_max``, ``(H,)``) and ``wo2`` (``||W_O^h||^2``) may be passed when the caller
        computed them already (in one batched eigen-decomposition with its other norms). When the ``d x d``
        eigenvalue is found by Lanczos (see :meth:`vv_exact`), ``info`` (a dict) receives its ``"rel_residual"``
        ``(H,)``.
        """
        if gram is None:
            d = self.X.shape[-1]
            if self.vv_exact(d, lanczos.max_iter):
                gram = gram_lambda_max(self.vv_factor())[0]
            else:
                gram, _ = lanczos_max_abs(
                    self._vv_matvec(),
                    (self.H,),
                    d,
                    dtype=self.dtype,
                    device=self.device,
                    tol=lanczos.tol,
                    max_iter=lanczos.max_iter,
                    max_basis=lanczos.max_basis,
                    info=info,
                )
        gram = gram.clamp_min(0)
        if self.W_O is not None:
            gram = gram * (gram_lambda_max(self.W_O)[0] if wo2 is None else wo2).clamp_min(0)
        return gram


def _add_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in place (``baddbmm_``, no temporary of ``acc``'s size); ``b`` may lack ``a``'s lead dim."""
    if acc.is_contiguous():
        *lead, p, q = acc.shape
        k = a.shape[-1]
        a3 = a.expand(*lead, p, k).reshape(-1, p, k)
        b3 = b.expand(*lead, k, q).reshape(-1, k, q)
        acc.view(-1, p, q).baddbmm_(a3, b3)
        return acc
    return acc.add_(a @ b)


def _xw(X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``X W`` for a batch of per-head weights: X ``(B, L, d)``, W ``(n, H, d, k)`` -> ``(n, B, H, L, k)``.

    One ``(B L, d) @ (d, H k)`` matmul per tangent (a strided view is returned), not ``n B H`` small ones.
    """
    n, H, d, k = W.shape
    B, L, _ = X.shape
    Y = X.reshape(B * L, d) @ W.permute(0, 2, 1, 3).reshape(n, d, H * k)  # (n, B L, H k)
    return Y.reshape(n, B, L, H, k).permute(0, 1, 3, 2, 4)


def _xtm(X: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """``sum_b X_b^T M_b``: X ``(B, L, d)``, M ``(n, B, H, L, k)`` -> ``(n, H, d, k)`` in one matmul over B*L."""
    n, B, H, L, k = M.shape
    Mr = M.permute(0, 2, 1, 3, 4).reshape(n, H, B * L, k)
    return torch.matmul(X.reshape(B * L, -1).mT, Mr)


def _split_heads(W: torch.Tensor, n_heads: int, name: str, per_head_cols: bool = True) -> torch.Tensor:
    """(d, H*k) -> (H, d, k) for column-packed heads; (H*k, m) -> (H, k, m) for row-packed W_O."""
    if per_head_cols:
        d, hk = W.shape
        if hk % n_heads:
            raise ValueError(f"{name} has {hk} columns, not divisible by n_heads={n_heads}.")
        return W.reshape(d, n_heads, hk // n_heads).permute(1, 0, 2)
    hk, m = W.shape
    if hk % n_heads:
        raise ValueError(f"{name} has {hk} rows, not divisible by n_heads={n_heads}.")
    return W.reshape(n_heads, hk // n_heads, m)


def _keep_masks(B: int, L: int, causal: bool, key_padding_mask, device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(keep (B, L, L) or None, row_keep (B, L))`` from the causal flag and a padding mask (True = padded)."""
    row_keep = torch.ones(B, L, dtype=torch.bool, device=device)
    keep = None
    if causal:
        keep = torch.ones(L, L, dtype=torch.bool, device=device).tril().expand(B, L, L)
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device=device, dtype=torch.bool)
        if kpm.ndim == 1:
            kpm = kpm.unsqueeze(0)
        if tuple(kpm.shape) != (B, L):
            raise ValueError(f"key_padding_mask must have shape (B, L) = {(B, L)}; got {tuple(kpm.shape)}.")
        row_keep = ~kpm
        kk = (~kpm).unsqueeze(1).expand(B, L, L)
        keep = kk if keep is None else keep & kk
    return keep, row_keep


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
    kinds=KINDS,
    terms=True,
):
    """Shared body of :func:`self_attention` and :func:`multi_head_attention`; ``X3`` ``(B, L, d)`` is checked."""
    B, L, d = X3.shape
    H = W_Q.shape[0]
    keep, row_keep = _keep_masks(B, L, causal, key_padding_mask, X3.device)
    # one forward pass: the operator's, which also gives the output the loss convention needs
    op = AttentionOperator(X3, W_Q, W_K, W_V, W_O, b_Q, b_K, b_V, keep, row_keep, None, None, suffix_heads=not single)
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
    pairs = ATTENTION_PAIRS if pairs is None else tuple(pairs)
    for p in pairs:
        if p not in ATTENTION_PAIRS and p != "QKV":
            raise ValueError(f"Unknown attention pair {p!r}; choose from {ATTENTION_PAIRS + ('QKV',)}.")
    kinds = _check_kinds(kinds)

    def hk(base):  # per-head keys
        return [base] if single else [f"{base}/h{h}" for h in range(H)]

    # every exact spectral norm of the evaluation in one batched call (one eigvalsh per Gram size)
    mats: dict[str, torch.Tensor] = {}
    vv_exact = "VV" in pairs and op.vv_exact(d, lanczos.max_iter)
    if vv_exact:
        mats["vv"] = op.vv_factor()  # (H, B L, d)
    if W_O is not None and ("VV" in pairs or terms):
        mats["wo"] = W_O
    if terms:
        mats.update(x=X3 * row_keep.unsqueeze(-1).to(X3.dtype), P=op.P, K=op.Kk, V=op.Vv, wq=W_Q, wk=W_K, wv=W_V)
    sq = dict(zip(mats, gram_lambda_max(*mats.values()), strict=True))  # squared norms

    out: dict[str, torch.Tensor] = {}
    if "VV" in pairs:
        info: dict = {}
        vv = op.outer_vv_norm(lanczos, gram=sq.get("vv"), wo2=sq.get("wo"), info=info)
        zero = torch.zeros((), dtype=X3.dtype, device=X3.device)
        for h, (key, v) in enumerate(zip(hk("VV"), vv.unbind(), strict=True)):
            out[f"outer/{key}"] = v
            out[f"functional/{key}"] = zero
            out[f"hessian/{key}"] = v
            if "rel_residual" in info:  # found by Lanczos (d > 256), not exactly
                out[f"residual/outer/{key}"] = out[f"residual/hessian/{key}"] = info["rel_residual"][h]
    iterative = [p for p in pairs if p not in ("VV", "QKV")]
    if iterative:
        out.update(spectral_norms(op, iterative, kinds=kinds, lanczos=lanczos))
    if "QKV" in pairs or pairs == ATTENTION_PAIRS:
        out.update(full_norms(op, ["Q", "K", "V"], "QKV", kinds=kinds, lanczos=lanczos))

    if terms:
        norms = {k: v.clamp_min(0).sqrt() for k, v in sq.items() if k != "vv"}  # spectral norms
        out.update(_terms_and_bounds(X3, op, g, c, resid, row_keep, norms, target, hk))
    if dense:
        out.update(dense_blocks(op, ATTENTION_PAIRS, full=("Q", "K", "V")))
    lanczos.warn_unconverged(out, "self_attention" if single else "multi_head_attention")
    return out


def _terms_and_bounds(X3, op, g, c, resid, row_keep, norms, target, hk) -> dict[str, torch.Tensor]:
    """Bound terms (``term/...``) and corrected bounds (``bound/...``) of :func:`_attention`.

    ``norms`` holds the spectral norms computed with the exact ones: ``x`` ``(B,)`` (padded rows excluded),
    ``P``, ``K``, ``V`` ``(B, H)`` and ``wq``, ``wk``, ``wv``, ``wo`` ``(H,)`` (no ``wo`` without projection).
    """
    A = op.A
    B, H, L = A.shape[:3]
    x_b = norms["x"]  # (B,)
    alpha, beta = softmax_bound_factors(A)  # ||dA/dT||_2 and the softmax second derivative's bound, (B, H)
    ent = -torch.special.xlogy(A, A).sum(-1)  # (B, H, L); 0 log 0 = 0
    rk = row_keep.to(A.dtype).unsqueeze(1)  # (B, 1, L)
    entropy = (ent * rk).sum((0, 2)) / rk.sum((0, 2)).clamp_min(1)  # (H,)
    w_o = norms.get("wo")
    L_b = row_keep.sum(-1).to(X3.dtype)
    x_max = x_b.max()
    out: dict[str, torch.Tensor] = {
        "term/x_norm": x_max,
        "term/x_norm6": x_max**6,
        "term/inv_L3": torch.tensor(1.0 / L**3, dtype=X3.dtype, device=X3.device),
        "term/grad_norm": g.norm(),
    }
    if target is not None:
        out["term/residual_norm"] = resid.norm()
    per_head = {
        "softmax_jac_norm": alpha.amax(0),
        "softmax_hess_frob": beta.amax(0),
        "attn_entropy": entropy,
        "attn_entropy_norm": entropy / torch.log(L_b.clamp_min(2)).mean(),
        "wq_norm": norms["wq"],
        "wk_norm": norms["wk"],
        "wv_norm": norms["wv"],
    }
    if w_o is not None:
        per_head["wo_norm"] = w_o
    names, table = _attention_bound_table(
        x=x_b,
        p=norms["P"],
        kap=norms["K"],
        nu=norms["V"],
        gam=op.g_h.flatten(-2).norm(dim=-1).expand(B, H),
        c=c,
        alpha=alpha,
        beta=beta,
        w_o=torch.ones(H, dtype=X3.dtype, device=X3.device) if w_o is None else w_o,
        L_b=L_b,
        d_K=op.d_K,
    )  # (n_bounds, H)
    keys = [f"term/{key}" for name in per_head for key in hk(name)]
    keys += [f"bound/{key}" for name in names for key in hk(name)]
    vals = torch.cat([torch.stack(list(per_head.values())), table])  # (n_terms + n_bounds, H)
    out.update(zip(keys, vals.flatten().unbind(), strict=True))  # one view per (quantity, head)
    return out


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
    pairs=None,
    kinds=KINDS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    terms: bool = True,
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
        pairs: subset of ``("VV", "QQ", "KK", "VQ", "VK", "QK", "QKV")`` (default all).
        kinds: which iterative norms to compute, a subset of ``("outer", "functional", "hessian")``
            (each costs its own Lanczos run; ``outer/VV`` is exact and always returned with ``VV``).
        lanczos: settings of the iterative norms (:class:`~curvwatch.closed_form.Lanczos`; default
            ``Lanczos()``: relative residual 1e-3, at most 100 steps and 16 vectors held per norm, a
            :class:`~curvwatch.closed_form.LanczosWarning` when a norm does not converge; ``EXACT`` runs each
            norm to the block size, for small blocks). Its ``warm_start`` (a
            :class:`~curvwatch.closed_form.WarmStart` kept between calls) starts each norm from the last Ritz
            vectors, as the monitor does across evaluations.
        terms: also return the bound terms ``term/...`` and the corrected bounds ``bound/...`` (default);
            False computes the norms only.
        dense: also return the dense blocks ``dense/{outer,functional,hessian}/XY`` of shape ``(n_X, n_Y)``
            (vec_r order, equal to ``torch.func.hessian`` reshaped) and ``dense/*/QKV``.

    Returns:
        Flat dict of 0-d tensors: ``outer/XY``, ``functional/XY``, ``hessian/XY`` (spectral norms) for XY in
        VV, QQ, KK, VQ, VK, QK and QKV, corrected bounds ``bound/XY`` (and ``bound/outer/XY``,
        ``bound/functional/XY``), and bound terms ``term/x_norm``, ``term/x_norm6``, ``term/softmax_jac_norm``
        (measured ``||dA/dT||_2``), ``term/softmax_hess_frob``, ``term/inv_L3`` (the papers' ``1/L^3``,
        valid only for uniform attention), ``term/w{q,k,v}_norm``, ``term/attn_entropy``.

    Raises:
        ValueError: on shape mismatches, or unless exactly one of ``target`` / ``grad_output`` is given.

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
        kinds=kinds,
        terms=terms,
    )


def multi_head_attention(
    X: torch.Tensor,
    W_Q: torch.Tensor,
    W_K: torch.Tensor,
    W_V: torch.Tensor,
    W_O: torch.Tensor,
    n_heads: int,
    *,
    b_Q: torch.Tensor | None = None,
    b_K: torch.Tensor | None = None,
    b_V: torch.Tensor | None = None,
    b_O: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    grad_output: torch.Tensor | None = None,
    output_curvature: float | None = None,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    pairs=None,
    kinds=KINDS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
    terms: bool = True,
) -> dict[str, torch.Tensor]:
    """Per-head closed-form Hessian blocks of multi-head attention with the output projection inside ``F``.

    ``F = concat_h(softmax(P_h K_h^T / sqrt(d_K)) V_h) W_O + b_O`` with ``P_h = X W_Q^h + b_Q^h`` etc., the way
    real models compute attention. Blocks are those of each head's own ``W_Q^h, W_K^h, W_V^h``.

    Args:
        X: ``(L, d)`` or ``(B, L, d)``.
        W_Q, W_K: ``(d, H d_K)``; W_V: ``(d, H d_V)``; W_O: ``(H d_V, m)``; head ``h`` owns columns
            ``h d_K:(h+1) d_K`` (rows ``h d_V:(h+1) d_V`` of ``W_O``).
        n_heads: ``H``.
        b_Q, b_K: ``(H d_K,)``; b_V: ``(H d_V,)``; b_O: ``(m,)``; optional.
        target, grad_output, output_curvature, causal, key_padding_mask, pairs, kinds, lanczos, terms,
            dense: as in :func:`self_attention` (default ``c = 2/(L m)``).

    Returns:
        The keys of :func:`self_attention` suffixed ``/h{i}`` for per-head quantities, e.g.
        ``hessian/QQ/h0``, ``term/softmax_jac_norm/h1``, ``bound/VQ/h0``.

    Example:
        >>> X = torch.randn(5, 4, dtype=torch.float64)
        >>> W = lambda *s: torch.randn(*s, dtype=torch.float64)
        >>> out = multi_head_attention(X, W(4, 4), W(4, 4), W(4, 4), W(4, 4), 2, grad_output=W(5, 4), causal=True)
        >>> sorted(k for k in out if k.startswith("hessian/QQ"))
        ['hessian/QQ/h0', 'hessian/QQ/h1']
    """
    if not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"Invalid n_heads={n_heads!r}. Must be an int >= 1.")
    X3, batched = as_batched(X)
    d = X3.shape[-1]
    W_Q = _split_heads(check_weight(W_Q, d, "W_Q", X3), n_heads, "W_Q")
    W_K = _split_heads(check_weight(W_K, d, "W_K", X3), n_heads, "W_K")
    W_V = _split_heads(check_weight(W_V, d, "W_V", X3), n_heads, "W_V")
    if W_Q.shape != W_K.shape:
        raise ValueError(
            f"W_Q and W_K must have the same shape; got {tuple(W_Q.shape)} and {tuple(W_K.shape)} per head."
        )
    if W_O.ndim != 2 or W_O.shape[0] != n_heads * W_V.shape[-1]:
        raise ValueError(
            f"W_O must have shape (H*d_V, m) = ({n_heads * W_V.shape[-1]}, m) as used in concat(heads) @ W_O; "
            f"got {tuple(W_O.shape)} (pass out_proj.weight.T)."
        )
    W_O = _split_heads(W_O.to(dtype=X3.dtype, device=X3.device), n_heads, "W_O", per_head_cols=False)
    H, _, d_K = W_Q.shape
    d_V = W_V.shape[-1]
    b_Q = check_like(b_Q, (H * d_K,), "b_Q", X3)
    b_K = check_like(b_K, (H * d_K,), "b_K", X3)
    b_V = check_like(b_V, (H * d_V,), "b_V", X3)
    b_O = check_like(b_O, (W_O.shape[-1],), "b_O", X3)
    return _attention(
        X3,
        batched,
        W_Q,
        W_K,
        W_V,
        W_O,
        b_Q=None if b_Q is None else b_Q.reshape(H, d_K),
        b_K=None if b_K is None else b_K.reshape(H, d_K),
        b_V=None if b_V is None else b_V.reshape(H, d_V),
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
        kinds=kinds,
        terms=terms,
    )
