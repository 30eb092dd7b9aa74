"""Corrected spectral-norm bounds for self-attention blocks and the softmax factors that drive them.

The published bound of Petrov et al. (P1, Thm 1) uses ``||dA/dT||_2 <= 1/L``, true only for uniform
attention, and omits the KK/VK blocks; both make it fail (formula sheet §3b, errata 1-2). The bounds here
follow the sheet's corrected ones (§3b), written with measured norms so they are valid for biases and an
output projection too. Per sequence ``b`` and head ``h``, with ``x = ||X||_2``, ``p = ||X W_Q + b_Q||_2``,
``kappa = ||X W_K + b_K||_2``, ``nu = ||X W_V + b_V||_2``, ``omega = ||W_O^h||_2``, ``gamma = ||g W_O^h^T||_F``,
``alpha = ||dA/dT||_2`` (measured, <= 1/2), ``beta`` = Frobenius norm of the softmax second derivative
(measured per row, max over rows):

* Jacobian norms: ``||J_V|| <= sqrt(L) x omega``, ``||J_Q|| <= alpha x kappa nu omega / sqrt(d_K)``,
  ``||J_K|| <= alpha x p nu omega / sqrt(d_K)``; outer blocks ``||H_o(XY)|| <= c ||J_X|| ||J_Y||``.
* functional: ``H_f(VV) = 0``; ``||H_f(VQ)|| <= alpha x^2 kappa gamma / sqrt(d_K)`` (``kappa -> p`` for VK);
  ``||H_f(QQ)|| <= beta gamma nu x^2 kappa^2 / d_K`` (``kappa -> p`` for KK);
  ``||H_f(QK)|| <= beta gamma nu x^2 kappa p / d_K + alpha gamma nu x^2 / sqrt(d_K)``.
* totals: ``||H(XY)|| <= bound_o + bound_f``; the whole QKV Hessian is bounded by the spectral norm of the
  3x3 matrix of block bounds (<= 3 max, the sheet's form). Batches add: ``||sum_b H_b|| <= sum_b ||H_b||``.

With ``kappa = x ||W_K||``, ``nu = x ||W_V||`` and ``gamma = c r`` these are exactly the sheet's §3b bounds.
The only L-dependence left is through ``c = 2/(L d_V)`` and ``sqrt(L)`` in ``J_V``.
"""

from __future__ import annotations

import math

import torch


def softmax_jacobian_norm(A: torch.Tensor, iters: int = 60) -> torch.Tensor:
    """``||dA/dT||_2`` per matrix: ``max_i lambda_max(diag(a_i) - a_i a_i^T)``, by bisection on the secular equation.

    For a row ``a`` the largest eigenvalue of ``diag(a) - a a^T`` lies in ``[a_(2), a_(1)]`` (the two largest
    entries) and solves ``1 = sum_j a_j^2 / (a_j - lambda)``; that function of lambda is monotone there. Cost
    ``O(iters * L^2)``, no ``L x L`` eigen-decomposition per row.

    Args:
        A: ``(..., L, L)`` row-stochastic (rows may be all zero: fully masked).

    Returns:
        ``(...)`` tensor, max over rows.
    """
    top2 = A.topk(min(2, A.shape[-1]), dim=-1).values
    hi = top2[..., 0]
    lo = top2[..., 1] if A.shape[-1] > 1 else torch.zeros_like(hi)
    lam_lo, lam_hi = lo.clone(), hi.clone()
    for _ in range(iters):
        mid = 0.5 * (lam_lo + lam_hi)
        denom = A - mid.unsqueeze(-1)
        # entries equal to mid (ties) contribute a pole; treat them as +/- inf by sign of the denominator
        f = 1.0 - (A * A / torch.where(denom == 0, torch.full_like(denom, torch.finfo(A.dtype).tiny), denom)).sum(-1)
        go_up = f > 0
        lam_lo = torch.where(go_up, mid, lam_lo)
        lam_hi = torch.where(go_up, lam_hi, mid)
    lam = 0.5 * (lam_lo + lam_hi)
    return lam.amax(-1)


def softmax_hessian_frobenius(A: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of the softmax second derivative, max over rows: an upper bound of every unfolding's norm.

    For a row ``a``, ``d^2 a_j / dT_k dT_l = a_j E_jkl`` with ``E_j = 2 a a^T + e_j e_j^T - diag(a) - e_j a^T -
    a e_j^T`` (P2 Lemma C.1). With ``p_2 = sum a^2``, ``p_3 = sum a^3``:
    ``||E_j||_F^2 = 4 p_2^2 - 4 p_3 + 3 p_2 + 1 + 10 a_j^2 - 8 a_j p_2 - 6 a_j``, so the row's squared norm is
    ``sum_j a_j^2 ||E_j||_F^2``, computed in ``O(L)``.

    Args:
        A: ``(..., L, L)``.

    Returns:
        ``(...)`` tensor.
    """
    p2 = (A * A).sum(-1, keepdim=True)
    p3 = (A * A * A).sum(-1, keepdim=True)
    e2 = 4 * p2 * p2 - 4 * p3 + 3 * p2 + 1 + 10 * A * A - 8 * A * p2 - 6 * A
    row = (A * A * e2).sum(-1).clamp_min(0).sqrt()
    return row.amax(-1)


def _spec(M: torch.Tensor) -> torch.Tensor:
    p, q = M.shape[-2:]
    G = M.mT @ M if q <= p else M @ M.mT
    return torch.linalg.eigvalsh(G)[..., -1].clamp_min(0).sqrt()


def attention_bounds(*, x, P, Kk, Vv, g_h, c, alpha, beta, w_o, L_b, d_K) -> dict[str, torch.Tensor]:
    """Corrected per-head bounds, summed over the batch.

    Args:
        x: ``(B,)`` ``||X_b||_2``.
        P, Kk: ``(B, H, L, d_K)`` queries and keys; Vv: ``(B, H, L, d_V)`` values.
        g_h: ``(B, H, L, d_V)`` per-head cotangent ``g W_O^h^T``.
        c: ``(B,)`` output curvature per sequence.
        alpha, beta: ``(B, H)`` from :func:`softmax_jacobian_norm` and :func:`softmax_hessian_frobenius`.
        w_o: ``(H,)`` ``||W_O^h||_2`` (ones without projection).
        L_b: ``(B,)`` sequence lengths (kept rows).
        d_K: key width.

    Returns:
        ``{"XY": (H,), "outer/XY": (H,), "functional/XY": (H,), "QKV": (H,)}`` for the six pairs.
    """
    p, kap, nu = _spec(P), _spec(Kk), _spec(Vv)  # (B, H)
    gam = g_h.flatten(-2).norm(dim=-1)  # (B, H)
    xb = x[:, None]
    cb = c[:, None]
    s = 1.0 / math.sqrt(d_K)
    JV = L_b.sqrt()[:, None] * xb * w_o[None]
    JQ = alpha * xb * kap * nu * w_o[None] * s
    JK = alpha * xb * p * nu * w_o[None] * s
    x2 = xb * xb
    outer = {
        "VV": cb * JV * JV,
        "QQ": cb * JQ * JQ,
        "KK": cb * JK * JK,
        "VQ": cb * JV * JQ,
        "VK": cb * JV * JK,
        "QK": cb * JQ * JK,
    }
    func = {
        "VV": torch.zeros_like(JV),
        "VQ": alpha * x2 * kap * gam * s,
        "VK": alpha * x2 * p * gam * s,
        "QQ": beta * gam * nu * x2 * kap * kap * s * s,
        "KK": beta * gam * nu * x2 * p * p * s * s,
        "QK": beta * gam * nu * x2 * kap * p * s * s + alpha * gam * nu * x2 * s,
    }
    out: dict[str, torch.Tensor] = {}
    for k in outer:
        o, f = outer[k].sum(0), func[k].sum(0)
        out[f"outer/{k}"] = o
        out[f"functional/{k}"] = f
        out[k] = o + f
    # whole QKV Hessian: spectral norm of the 3x3 matrix of block bounds (order Q, K, V)
    N = torch.stack(
        [
            torch.stack([out["QQ"], out["QK"], out["VQ"]], -1),
            torch.stack([out["QK"], out["KK"], out["VK"]], -1),
            torch.stack([out["VQ"], out["VK"], out["VV"]], -1),
        ],
        -2,
    )  # (H, 3, 3), symmetric non-negative
    out["QKV"] = torch.linalg.eigvalsh(N)[..., -1]
    return out
