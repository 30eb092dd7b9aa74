"""Closed-form LayerNorm curvature: per-row variance statistics, exact Jacobian/Hessian norms, contracted Hessian.

Row-wise: ``yhat_i = C x_i / s_i`` with ``C = I - 11^T/n``, ``s_i = sqrt(sigma_i^2 + eps)``
(biased variance), and the affine output ``y_i = gamma * yhat_i + beta``. With ``rho_i^2 = ||yhat_i||^2 =
n sigma_i^2 / s_i^2`` (``= n`` when ``eps = 0``):

* Jacobian ``J_i = (1/s_i)(C - yhat yhat^T / n)``: eigenvalues ``1/s_i`` (``n-2`` times), ``(1 - rho^2/n)/s_i``
  (direction ``yhat``) and 0 (direction ``1``). Hence ``||J|| = 1/min_i s_i`` for ``n >= 3`` (exact).
* Hessian ``d^2 yhat_k/dx_a dx_b = (1/(n s^2))[-C_ka y_b - C_kb y_a - y_k C_ab + (3/n) y_k y_a y_b]``. The Gram
  matrix of the flattened ``(n^2 x n)`` Hessian is ``(2 rho^2 C + (n + 5 - 18 rho^2/n + 9 rho^4/n^2) yhat yhat^T)
  / (n s^2)^2`` [derived here], so ``||H_i||^2 = max(2 rho^2 [n >= 3], rho^2 (n + 7 - 18 rho^2/n + 9 rho^4/n^2))
  / (n s^2)^2``; with ``eps = 0`` this is the published ``sqrt((n-2)/n)/s^2`` for ``n >= 4`` and ``sqrt(2/3)/s^2``
  for ``n = 3``.
* Contracted with an upstream gradient ``g`` (``g' = gamma * g``, ``u = C g'``, ``t = g'.yhat``):
  ``sum_k g'_k nabla^2 yhat_k = (1/(n s^2))[-(u yhat^T + yhat u^T) - t C + (3t/n) yhat yhat^T]``, whose
  eigenvalues are ``-t/(n s^2)`` off ``span{u, yhat}`` and those of a 2x2 matrix on it: exact, ``O(n)`` per row.

The affine weight scales output ``k`` by ``gamma_k``; the exact norms above are those of the normalisation,
and ``max|gamma|`` times them bounds the affine LayerNorm's (keys ``*_affine_bound``).
"""

from __future__ import annotations

from functools import cached_property

import torch

from ._common import as_batched, check_like, check_row_mask, norm_statistics

#: The LayerNorm's row statistics (:func:`~curvwatch.closed_form._common.row_statistics`), in their order.
STATISTICS = ("var_min", "var_mean", "inv_std_max", "inv_var_max", "var_min_over_eps", "collapsed_fraction")


class LayerNormRows:
    """Forward statistics and closed-form first/second-order products of a row-wise LayerNorm.

    Args:
        X: ``(B, L, n)`` input.
        eps: variance floor.
        weight: ``(n,)`` affine scale ``gamma`` or None.
    """

    def __init__(self, X: torch.Tensor, eps: float, weight: torch.Tensor | None = None):
        self.n = X.shape[-1]
        mu = X.mean(-1, keepdim=True)
        Xc = X - mu
        self.var = (Xc * Xc).mean(-1, keepdim=True)  # (B, L, 1), biased
        self.s = (self.var + eps).sqrt()
        self._Xc = Xc
        self.weight = weight

    @cached_property
    def yhat(self) -> torch.Tensor:
        """The normalised input ``(X - mu) / s``, ``(B, L, n)`` (on first use: the statistics alone need none)."""
        return self._Xc / self.s

    def forward(self, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.yhat if self.weight is None else self.yhat * self.weight
        return y if bias is None else y + bias

    def _scale(self, g: torch.Tensor) -> torch.Tensor:
        return g if self.weight is None else g * self.weight

    def jvp(self, dx: torch.Tensor) -> torch.Tensor:
        """``J dx`` for ``dx`` of shape ``(..., B, L, n)``."""
        dxc = dx - dx.mean(-1, keepdim=True)
        out = (dxc - self.yhat * (self.yhat * dx).sum(-1, keepdim=True) / self.n) / self.s
        return self._scale(out)

    def vjp(self, gy: torch.Tensor) -> torch.Tensor:
        """``J^T gy`` (the normalisation Jacobian is symmetric per row)."""
        g = self._scale(gy)
        gc = g - g.mean(-1, keepdim=True)
        return (gc - self.yhat * (self.yhat * g).sum(-1, keepdim=True) / self.n) / self.s

    def hvp(self, gy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
        """``(sum_k gy_k nabla^2 y_k) dx``: the contracted Hessian applied to ``dx``."""
        g = self._scale(gy)
        u = g - g.mean(-1, keepdim=True)
        t = (g * self.yhat).sum(-1, keepdim=True)
        y_dx = (self.yhat * dx).sum(-1, keepdim=True)
        u_dx = (u * dx).sum(-1, keepdim=True)
        dxc = dx - dx.mean(-1, keepdim=True)
        n = self.n
        return (-u * y_dx - self.yhat * u_dx - t * dxc + (3.0 / n) * t * y_dx * self.yhat) / (n * self.s * self.s)


def _row_jacobian_norm(rho2: torch.Tensor, s: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return torch.zeros_like(s)
    inv = 1.0 / s
    if n >= 3:
        return inv
    # n == 2: only the yhat direction (or all of 1-perp when yhat = 0)
    return torch.where(rho2 > 0, inv * (1 - rho2 / n).abs(), inv)


def _row_hessian_norm(rho2: torch.Tensor, s: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return torch.zeros_like(s)
    along = rho2 * (n + 7 - 18 * rho2 / n + 9 * rho2 * rho2 / (n * n))
    sq = torch.maximum(along, 2 * rho2) if n >= 3 else along
    return sq.clamp_min(0).sqrt() / (n * s * s)


def _row_contracted_norm(yhat: torch.Tensor, g: torch.Tensor, s: torch.Tensor, n: int) -> torch.Tensor:
    """Exact spectral norm of ``sum_k g_k nabla^2 yhat_k`` per row, shape ``(B, L, 1)``."""
    u = g - g.mean(-1, keepdim=True)
    t = (g * yhat).sum(-1, keepdim=True)
    rho = yhat.norm(dim=-1, keepdim=True)
    tiny = torch.finfo(yhat.dtype).tiny
    e1 = yhat / rho.clamp_min(tiny)
    a = (u * e1).sum(-1, keepdim=True)
    b = (u - a * e1).norm(dim=-1, keepdim=True)
    # 2x2 block on span{yhat, u_perp}: [[-2 rho a + 3 t rho^2 / n - t, -rho b], [-rho b, -t]]
    m11 = -2 * rho * a + 3 * t * rho * rho / n - t
    m12 = -rho * b
    m22 = -t
    if n == 2:
        lam = m11.abs()
    else:
        half_tr = 0.5 * (m11 + m22)
        disc = (0.25 * (m11 - m22) ** 2 + m12 * m12).sqrt()
        lam = torch.maximum((half_tr + disc).abs(), (half_tr - disc).abs())
        if n >= 4:
            lam = torch.maximum(lam, t.abs())
    lam = torch.where(rho > 0, lam, torch.zeros_like(lam))
    return lam / (n * s * s)


def layernorm(
    X: torch.Tensor,
    *,
    eps: float = 1e-5,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    grad_output: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    dense: bool = False,
    stats_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Closed-form curvature of a LayerNorm over the last dimension.

    Args:
        X: ``(L, n)`` or ``(B, L, n)`` LayerNorm input.
        eps: the LayerNorm's epsilon (0 allowed; then zero-variance rows have infinite curvature and are
            reported as such in the statistics, never as NaN).
        weight, bias: ``(n,)`` affine parameters or None.
        grad_output: ``X``-shaped gradient at the LayerNorm output, for the contracted Hessian.
        row_mask: ``(B, L)`` or ``(L,)`` bool, True = row included in the statistics (padding excluded).
        dense: also return ``dense/jacobian`` ``(N n, N n)`` and ``dense/hessian`` ``(N n, N n, N n)`` of the
            affine LayerNorm over the kept rows' vec_r order (all rows when no mask), small sizes only.
        stats_only: return the row statistics alone (``var_min`` ... ``collapsed_fraction``, what the collapse
            warnings read), no norms (the monitor's terms-only evaluations, :mod:`curvwatch.rules`).

    Returns:
        0-d tensors: ``var_min``, ``var_mean``, ``inv_std_max`` (``1/min sqrt(var + eps)``), ``inv_var_max``
        (``1/min(var + eps)``), ``var_min_over_eps`` (``inf`` when ``eps = 0``), ``jacobian_norm`` and
        ``hessian_norm`` (exact, of the normalisation), ``jacobian_norm_affine_bound``,
        ``hessian_norm_affine_bound``; with ``grad_output`` also ``contracted_hessian_norm`` (exact) and
        ``contracted_hessian_bound`` (``6||g||/(sqrt(n) s^2)``).

    Example:
        >>> out = layernorm(torch.tensor([[1.0, -1.0, 0.5, -0.5]], dtype=torch.float64), eps=0.0)
        >>> round(float(out["jacobian_norm"] * out["var_min"].sqrt()), 6)
        1.0
    """
    X3, batched = as_batched(X)
    B, L, n = X3.shape
    eps = float(eps)
    if not eps >= 0:
        raise ValueError(f"Invalid eps={eps}. Must be >= 0.")
    weight = check_like(weight, (n,), "weight", X3)
    bias = check_like(bias, (n,), "bias", X3)
    keep = check_row_mask(row_mask, B, L, X3, nonempty=True)  # None: all rows

    def rows(t: torch.Tensor) -> torch.Tensor:  # (B, L, k) -> (N, k), the kept rows
        return t.reshape(B * L, -1) if keep is None else t[keep]

    out = norm_statistics(X3, keep, eps, STATISTICS, centered=True)
    if stats_only:
        return out
    ln = LayerNormRows(X3, eps, weight)
    s = rows(ln.s).squeeze(-1)
    inf = torch.tensor(float("inf"), dtype=X3.dtype, device=X3.device)
    inv_std_max = out["inv_std_max"]  # inf when a row has zero variance and eps = 0
    with torch.no_grad():
        yhat = rows(ln.yhat)  # (N, n)
        rho2 = (yhat * yhat).sum(-1)
        s_safe = s.clamp_min(torch.finfo(X3.dtype).tiny)
        if n >= 3:  # ||J_i|| = 1/s_i, so the max is 1/min s (exactly: the reciprocal is monotone)
            out["jacobian_norm"] = inv_std_max
        else:
            out["jacobian_norm"] = torch.where(s > 0, _row_jacobian_norm(rho2, s_safe, n), inf).max()
        out["hessian_norm"] = torch.where(s > 0, _row_hessian_norm(rho2, s_safe, n), inf).max()
        gmax = None if weight is None else weight.abs().max()
        out["jacobian_norm_affine_bound"] = out["jacobian_norm"] if gmax is None else gmax * out["jacobian_norm"]
        out["hessian_norm_affine_bound"] = out["hessian_norm"] if gmax is None else gmax * out["hessian_norm"]
        if grad_output is not None:
            expected = (B, L, n) if batched else (L, n)
            if tuple(grad_output.shape) != expected:
                raise ValueError(f"grad_output must have shape {expected}; got {tuple(grad_output.shape)}.")
            G = grad_output.to(dtype=X3.dtype, device=X3.device).reshape(B, L, n)
            g = rows(G if weight is None else G * weight)  # (N, n)
            g_norm = g.norm(dim=-1)
            cn = _row_contracted_norm(yhat, g, s_safe.unsqueeze(-1), n).squeeze(-1)
            cn = torch.where(s > 0, cn, torch.where(g_norm > 0, inf, torch.zeros_like(cn)))
            out["contracted_hessian_norm"] = cn.max()
            bnd = 6 * g_norm / (n**0.5 * s_safe * s_safe)
            out["contracted_hessian_bound"] = torch.where(s > 0, bnd, inf).max()
    if dense:
        out.update(_dense(yhat, s, n, weight))
    return out


def _dense(yhat: torch.Tensor, s: torch.Tensor, n: int, weight: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Block-diagonal dense Jacobian ``(N n, N n)`` and Hessian ``(N n, N n, N n)`` from the per-row formulas."""
    N = yhat.shape[0]
    dtype, device = yhat.dtype, yhat.device
    C = torch.eye(n, dtype=dtype, device=device) - 1.0 / n
    gam = torch.ones(n, dtype=dtype, device=device) if weight is None else weight
    Jr = gam[None, :, None] * (C - yhat[:, :, None] * yhat[:, None, :] / n) / s[:, None, None]  # (N, n, n)
    # Hr[i, k, a, b] = gamma_k/(n s^2) [-C_ka y_b - C_kb y_a - y_k C_ab + 3/n y_k y_a y_b]
    y = yhat
    Hr = (
        -C[None, :, :, None] * y[:, None, None, :]
        - C[None, :, None, :] * y[:, None, :, None]
        - y[:, :, None, None] * C[None, None, :, :]
        + (3.0 / n) * y[:, :, None, None] * y[:, None, :, None] * y[:, None, None, :]
    ) / (n * s * s)[:, None, None, None]
    Hr = gam[None, :, None, None] * Hr
    J = torch.block_diag(*Jr) if N > 0 else torch.zeros(0, 0, dtype=dtype)
    H = torch.zeros(N * n, N * n, N * n, dtype=dtype, device=device)
    for i in range(N):
        sl = slice(i * n, (i + 1) * n)
        H[sl, sl, sl] = Hr[i]
    return {"dense/jacobian": J, "dense/hessian": H}
