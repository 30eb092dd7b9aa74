"""Closed-form RMSNorm curvature: per-row mean-square statistics, exact Jacobian/Hessian norms, contracted Hessian.

Row-wise (LLaMA, Mistral, Qwen, Gemma): for a row ``x`` of length ``n``, ``m = ||x||^2 / n``, ``r = sqrt(m + eps)``,
``y = xhat = x / r`` and the affine output ``(c + w) * y`` with ``c = weight_offset`` (Gemma: ``c = 1``). Write
``rho^2 = ||y||^2 = n m / r^2`` and ``delta = eps / r^2 = 1 - rho^2 / n``, both in ``[0, n]`` and ``[0, 1]``
(``delta = 0`` when ``eps = 0``). With ``phi = 1/r``: ``d phi / dx_a = -x_a / (n r^3)`` and
``d^2 phi / dx_a dx_b = -I_ab / (n r^3) + 3 x_a x_b / (n^2 r^5)``.

* Jacobian ``J = (1/r)(I - y y^T / n)`` (symmetric): eigenvalue ``1/r`` on ``y``-perp (``n - 1`` times) and
  ``(1 - rho^2/n)/r = eps/r^3`` along ``y``. Hence ``||J|| = 1/r`` for ``n >= 2`` and ``eps/r^3`` for ``n = 1``.
* Hessian, from ``y_k = x_k phi``: ``d^2 y_k / dx_a dx_b = (1/(n r^2)) [-I_ka y_b - I_kb y_a - y_k I_ab +
  (3/n) y_k y_a y_b]`` (LayerNorm's with ``C`` replaced by ``I``). Slice ``T_b = (d^2 y_k / dx_a dx_b)_{k,a}
  n r^2 = -y_b I - e_b y^T - y e_b^T + (3/n) y_b y y^T``; summing the sixteen Frobenius products of the four
  terms (``A = -y_b I``, ``B = -e_b y^T``, ``C = -y e_b^T``, ``D = (3/n) y_b y y^T``; ``<A,A> = n y_b y_c``,
  ``<A,B> = <A,C> = <B,C> = y_b y_c``, ``<B,B> = <C,C> = rho^2 I_bc``, ``<A,D> = <B,D> = <C,D> = -(3/n) rho^2
  y_b y_c``, ``<D,D> = (9/n^2) rho^4 y_b y_c``, mixed pairs counted twice) gives the Gram matrix of the
  ``(n^2 x n)`` flattening: ``<T_b, T_c> = 2 rho^2 I_bc + (n + 6 - 18 rho^2/n + 9 rho^4/n^2) y_b y_c = 2 rho^2
  I_bc + (n - 3 + 9 delta^2) y_b y_c`` [derived here]. Its eigenvalues are
  ``2 rho^2`` on ``y``-perp and ``rho^2 (n - 1 + 9 delta^2)`` along ``y``, so
  ``||H|| = rho sqrt(max(2 [n >= 2], n - 1 + 9 delta^2)) / (n r^2)`` (exact; the max is the second term for
  ``n >= 3``). With ``eps = 0``: ``sqrt((n - 1)/n) / r^2`` for ``n >= 3``, ``1/r^2`` for ``n = 2``, 0 for ``n = 1``.
* Contracted with ``g' = (c + w) * g`` (``t = g'.y``): ``S = sum_k g'_k nabla^2 y_k = (1/(n r^2)) [-(g' y^T +
  y g'^T) - t I + (3t/n) y y^T]``. Off ``span{g', y}`` it is ``-t/(n r^2)``. In the orthonormal basis
  ``e1 = y/rho``, ``e2`` (``g' = a e1 + b e2``, ``a = t/rho``) it is ``(1/(n r^2)) [[-3 t delta, -rho b],
  [-rho b, -t]]``, whose largest absolute eigenvalue is ``|t| (1 + 3 delta)/2 + hypot(t (1 - 3 delta)/2, rho b)``;
  it dominates ``|t|`` (a diagonal entry), so this is ``n r^2 ||S||`` for ``n >= 2``. For ``n = 1`` only
  ``e1`` exists: ``||S|| = 3 |t| delta / r^2``. Exact, ``O(n)`` per row.
* Bound (key ``contracted_hessian_bound``): ``||S|| <= 4 ||g'|| rho / (n r^2) <= 4 ||g'|| / (sqrt(n) r^2)``.
  Proof: ``g' y^T + y g'^T`` has eigenvalues ``t +- rho ||g'||``, so norm ``<= 2 rho ||g'||`` (Cauchy-Schwarz);
  ``-t I + (3t/n) y y^T`` has eigenvalues ``-t`` and ``t (2 - 3 delta)``, so norm ``<= 2 |t| <= 2 rho ||g'||``
  (``0 <= delta <= 1``); add the two (triangle inequality).

The affine weight scales output ``k`` by ``c + w_k``; the exact norms above are those of the normalisation, and
``max|c + w|`` times them bounds the affine RMSNorm's (keys ``*_affine_bound``). The contracted Hessian uses
``g'`` and so is exact for the affine RMSNorm. Rows with ``r = 0`` (a zero row with ``eps = 0``) have infinite
curvature and are reported as ``inf``, never NaN.
"""

from __future__ import annotations

import math

import torch

from ._common import as_batched, check_row_mask, norm_statistics

#: The RMSNorm's row statistics (:func:`~curvwatch.closed_form._common.row_statistics`), in their order.
STATISTICS = ("ms_min", "ms_mean", "inv_rms_max", "inv_ms_max", "ms_min_over_eps", "collapsed_fraction")

__all__ = ["RMSNormRows", "rmsnorm"]


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_eps(eps: float) -> float:
    if not _is_real(eps) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"Invalid eps={eps!r}. Must be a finite number >= 0 (pass the RMSNorm module's eps).")
    return float(eps)


def _scale(weight: torch.Tensor | None, weight_offset: float, n: int, like: torch.Tensor) -> torch.Tensor | None:
    """Validate ``weight`` / ``weight_offset`` and return the affine scale ``weight_offset + weight`` (or None)."""
    if not _is_real(weight_offset) or not math.isfinite(weight_offset):
        raise ValueError(
            f"Invalid weight_offset={weight_offset!r}. Must be a finite number: 0.0 (LLaMA, Mistral, Qwen) "
            "or 1.0 (Gemma's (1 + weight))."
        )
    if weight is None:
        if weight_offset != 0.0:
            raise ValueError(
                f"weight_offset={weight_offset} needs a weight: the offset is added to it. Pass weight= "
                "(torch.zeros(n) for a pure (1 + 0) scale) or drop weight_offset."
            )
        return None
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (n,):
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(
            f"Invalid weight shape {got}. Expected ({n},): one scale per feature of the last dimension of X "
            "(pass the RMSNorm module's .weight, or None for no affine)."
        )
    return weight.to(dtype=like.dtype, device=like.device) + weight_offset


class RMSNormRows:
    """Forward statistics and closed-form first/second-order products of a row-wise RMSNorm.

    ``y = (weight_offset + weight) * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Args:
        X: ``(..., n)`` input.
        eps: mean-square floor, ``>= 0``.
        weight: ``(n,)`` affine scale or None (no affine).
        weight_offset: added to ``weight`` (Gemma: 1.0); must be 0 without a weight.

    A zero row with ``eps = 0`` has ``r = 0`` and a NaN output, as in ``torch.nn.RMSNorm``; :func:`rmsnorm`
    handles such rows itself.

    Raises:
        ValueError: on a bad ``eps``, ``weight`` shape or ``weight_offset``.

    Example:
        >>> rows = RMSNormRows(torch.tensor([[3.0, 4.0]], dtype=torch.float64), eps=0.0)
        >>> rows.forward()
        tensor([[0.8485, 1.1314]], dtype=torch.float64)
    """

    def __init__(
        self, X: torch.Tensor, eps: float = 1e-6, weight: torch.Tensor | None = None, weight_offset: float = 0.0
    ):
        if not isinstance(X, torch.Tensor) or X.ndim < 1 or not X.is_floating_point():
            got = f"{X.dtype} of shape {tuple(X.shape)}" if isinstance(X, torch.Tensor) else type(X).__name__
            raise ValueError(f"Invalid X: expected a floating tensor of shape (..., n), got {got}.")
        self.n = X.shape[-1]
        self.eps = _check_eps(eps)
        self.ms = (X * X).mean(-1, keepdim=True)  # (..., 1), the row mean square m
        self.r = (self.ms + self.eps).sqrt()  # (..., 1)
        self.xhat = X / self.r  # (..., n)
        self.scale = _scale(weight, weight_offset, self.n, X)  # (n,) or None

    def forward(self) -> torch.Tensor:
        """The RMSNorm output ``(..., n)``."""
        return self._scaled(self.xhat)

    def _scaled(self, v: torch.Tensor) -> torch.Tensor:
        return v if self.scale is None else v * self.scale

    def jvp(self, dx: torch.Tensor) -> torch.Tensor:
        """``J dx`` for ``dx`` broadcastable with ``X`` (extra leading dims allowed)."""
        y = self.xhat
        return self._scaled((dx - y * (y * dx).sum(-1, keepdim=True) / self.n) / self.r)

    def vjp(self, gy: torch.Tensor) -> torch.Tensor:
        """``J^T gy`` (the normalisation Jacobian is symmetric per row)."""
        g, y = self._scaled(gy), self.xhat
        return (g - y * (y * g).sum(-1, keepdim=True) / self.n) / self.r

    def hvp(self, gy: torch.Tensor, dx: torch.Tensor) -> torch.Tensor:
        """``(sum_k gy_k nabla^2 y_k) dx``: the second derivative contracted with ``gy``, applied to ``dx``."""
        g, y, n = self._scaled(gy), self.xhat, self.n
        t = (g * y).sum(-1, keepdim=True)
        y_dx = (y * dx).sum(-1, keepdim=True)
        g_dx = (g * dx).sum(-1, keepdim=True)
        return (-g * y_dx - y * g_dx - t * dx + (3.0 / n) * t * y_dx * y) / (n * self.r * self.r)


def _row_hessian_norm(rho2: torch.Tensor, delta: torch.Tensor, r2: torch.Tensor, n: int) -> torch.Tensor:
    """``||H||`` per row: ``rho sqrt(max(2 [n >= 2], n - 1 + 9 delta^2)) / (n r^2)``."""
    along = n - 1 + 9 * delta * delta
    sq = torch.clamp_min(along, 2.0) if n == 2 else along  # n >= 3: along >= 2 already
    return (rho2 * sq).sqrt() / (n * r2)


def _row_contracted_norm(
    y: torch.Tensor, g: torch.Tensor, rho: torch.Tensor, delta: torch.Tensor, r2: torch.Tensor, n: int
) -> torch.Tensor:
    """Exact ``||sum_k g_k nabla^2 y_k||`` per row, ``(N,)``, from the 2x2 block on ``span{y, g}``."""
    t = (g * y).sum(-1)  # (N,)
    if n == 1:
        return 3 * t.abs() * delta / r2
    e1 = y / rho.clamp_min(torch.finfo(y.dtype).tiny).unsqueeze(-1)  # (N, n); 0 where y = 0
    a = (g * e1).sum(-1)
    b = (g - a.unsqueeze(-1) * e1).norm(dim=-1)  # |component of g orthogonal to y|, no cancellation
    lam = 0.5 * t.abs() * (1 + 3 * delta) + torch.hypot(0.5 * t * (1 - 3 * delta), rho * b)
    return lam / (n * r2)


def rmsnorm(
    X: torch.Tensor,
    *,
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    weight_offset: float = 0.0,
    grad_output: torch.Tensor | None = None,
    row_mask: torch.Tensor | None = None,
    dense: bool = False,
    stats_only: bool = False,
) -> dict[str, torch.Tensor]:
    """Closed-form curvature of an RMSNorm over the last dimension.

    Args:
        X: ``(L, n)`` or ``(B, L, n)`` RMSNorm input.
        eps: the RMSNorm's epsilon (0 allowed; then zero rows have infinite curvature and are reported as
            such in the statistics, never as NaN).
        weight: ``(n,)`` affine scale or None (no affine).
        weight_offset: added to ``weight``: 0.0 (LLaMA, Mistral, Qwen) or 1.0 (Gemma); 0 without a weight.
        grad_output: ``X``-shaped gradient at the RMSNorm output, for the contracted Hessian.
        row_mask: ``(B, L)`` or ``(L,)`` bool, True = row included in the statistics (padding excluded).
        dense: also return ``dense/jacobian`` ``(N n, N n)`` and ``dense/hessian`` ``(N n, N n, N n)`` of the
            affine RMSNorm over the kept rows' vec_r order (all rows when no mask), small sizes only.
        stats_only: return the row statistics alone (``ms_min`` ... ``collapsed_fraction``, what the collapse
            warnings read), no norms (the monitor's terms-only evaluations, :mod:`curvwatch.rules`).

    Returns:
        0-d tensors in ``X``'s dtype: ``ms_min`` and ``ms_mean`` (row mean square ``m``), ``inv_rms_max``
        (``1/min r``), ``inv_ms_max`` (``1/min(m + eps)``), ``ms_min_over_eps`` (``inf`` when ``eps = 0``),
        ``collapsed_fraction`` (rows with ``m <= 10 eps``; ``m == 0`` when ``eps = 0``), ``jacobian_norm`` and
        ``hessian_norm`` (exact, of the normalisation, max over rows), ``jacobian_norm_affine_bound``,
        ``hessian_norm_affine_bound`` (times ``max|weight_offset + weight|``); with ``grad_output`` also
        ``contracted_hessian_norm`` (exact, of the affine RMSNorm) and ``contracted_hessian_bound``
        (``4 ||g'|| rho / (n r^2)``, max over rows).

    Raises:
        ValueError: on a bad ``X``, ``eps``, ``weight``, ``weight_offset``, ``grad_output`` or ``row_mask``.

    Example:
        >>> out = rmsnorm(torch.tensor([[3.0, 4.0, 0.0]], dtype=torch.float64), eps=0.0)
        >>> round(float(out["jacobian_norm"] * out["ms_min"].sqrt()), 6)
        1.0
    """
    X3, batched = as_batched(X)
    B, L, n = X3.shape
    eps = _check_eps(eps)
    keep = check_row_mask(row_mask, B, L, X3, nonempty=True)  # None: all rows

    def rows(t: torch.Tensor) -> torch.Tensor:  # (B, L, k) -> (N, k), the kept rows
        return t.reshape(B * L, -1) if keep is None else t[keep]

    out = norm_statistics(X3, keep, eps, STATISTICS, centered=False)
    if stats_only:
        return out
    with torch.no_grad():
        rn = RMSNormRows(X3, eps, weight, weight_offset)
        scale = rn.scale
        ms = rows(rn.ms).squeeze(-1)  # (N,)
        r2 = ms + eps  # (N,), r^2
        r = rows(rn.r).squeeze(-1)
        alive = r > 0  # False only for zero rows with eps = 0
        tiny = torch.finfo(X3.dtype).tiny
        r2_safe = r2.clamp_min(tiny)
        y = rows(X3) / r.clamp_min(tiny).unsqueeze(-1)  # (N, n); 0 (not NaN) on dead rows
        delta = eps / r2_safe  # (N,), 1 - rho^2/n without cancellation
        rho2 = n * ms / r2_safe
        inf = torch.tensor(float("inf"), dtype=X3.dtype, device=X3.device)
        zero = torch.zeros((), dtype=X3.dtype, device=X3.device)
        # (inv_rms_max is inf when a zero row meets eps = 0)
        if n >= 2:  # ||J_i|| = 1/r_i, so the max is 1/min r (exactly: the reciprocal is monotone)
            out["jacobian_norm"] = out["inv_rms_max"]
        else:  # ||J_i|| = eps / r_i^3
            out["jacobian_norm"] = torch.where(alive, eps / (r2_safe * r.clamp_min(tiny)), inf).max()
        out["hessian_norm"] = torch.where(alive, _row_hessian_norm(rho2, delta, r2_safe, n), inf).max()
        smax = None if scale is None else scale.abs().max()
        for key in ("jacobian_norm", "hessian_norm"):
            out[f"{key}_affine_bound"] = out[key] if smax is None else smax * out[key]
        if grad_output is not None:
            expected = (B, L, n) if batched else (L, n)
            if not isinstance(grad_output, torch.Tensor) or tuple(grad_output.shape) != expected:
                got = tuple(grad_output.shape) if isinstance(grad_output, torch.Tensor) else type(grad_output).__name__
                raise ValueError(f"grad_output must have X's shape {expected}; got {got}.")
            G = grad_output.to(dtype=X3.dtype, device=X3.device).reshape(B, L, n)
            g = rows(G if scale is None else G * scale)  # (N, n), g' = (c + w) * g
            g_norm = g.norm(dim=-1)
            dead = torch.where(g_norm > 0, inf, zero)  # r = 0: infinite unless nothing is contracted
            rho = rho2.sqrt()
            cn = _row_contracted_norm(y, g, rho, delta, r2_safe, n)
            out["contracted_hessian_norm"] = torch.where(alive, cn, dead).max()
            out["contracted_hessian_bound"] = torch.where(alive, 4 * g_norm * rho / (n * r2_safe), dead).max()
        if dense:
            if not bool(alive.all()):
                raise ValueError(
                    "dense=True needs r > 0 on every kept row: a zero row with eps = 0 has no derivative. "
                    "Pass eps > 0 or mask the row out with row_mask."
                )
            out.update(_dense(y, r, n, scale))
    return out


def _dense(y: torch.Tensor, r: torch.Tensor, n: int, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Block-diagonal dense Jacobian ``(N n, N n)`` and Hessian ``(N n, N n, N n)`` from the per-row formulas."""
    N = y.shape[0]
    dtype, device = y.dtype, y.device
    eye = torch.eye(n, dtype=dtype, device=device)
    gam = torch.ones(n, dtype=dtype, device=device) if scale is None else scale
    Jr = gam[None, :, None] * (eye - y[:, :, None] * y[:, None, :] / n) / r[:, None, None]  # (N, n, n)
    # Hr[i, k, a, b] = gam_k / (n r^2) [-I_ka y_b - I_kb y_a - y_k I_ab + 3/n y_k y_a y_b]
    Hr = (
        -eye[None, :, :, None] * y[:, None, None, :]
        - eye[None, :, None, :] * y[:, None, :, None]
        - y[:, :, None, None] * eye[None, None, :, :]
        + (3.0 / n) * y[:, :, None, None] * y[:, None, :, None] * y[:, None, None, :]
    ) / (n * r * r)[:, None, None, None]
    Hr = gam[None, :, None, None] * Hr  # (N, n, n, n)
    J = torch.block_diag(*Jr)
    H = torch.zeros(N * n, N * n, N * n, dtype=dtype, device=device)
    for i in range(N):
        sl = slice(i * n, (i + 1) * n)
        H[sl, sl, sl] = Hr[i]
    return {"dense/jacobian": J, "dense/hessian": H}
