"""The LayerNorm ground truth: its dense Jacobian and Hessian, and the Hessian contracted with an output gradient."""

from __future__ import annotations

import math

import torch  # noqa: F401  (the doctests use it)
from torch import Tensor
from torch.func import hessian, jacrev

from curvwatch.reference.common import check_tensor, describe, layer_norm

__all__ = ["layernorm_contracted_hessian", "layernorm_dense"]


def check_layernorm(X: Tensor, eps: float, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """Validate LayerNorm inputs; return ``X`` as ``(N, n)`` rows."""
    if not isinstance(X, Tensor) or X.ndim not in (2, 3):
        raise ValueError(f"Invalid X: expected (L, n) or (B, L, n), got {describe(X)}.")
    if not X.is_floating_point():
        raise ValueError(f"Invalid X dtype {X.dtype}. Expected a floating dtype (use float64).")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"Invalid eps={eps!r}. Must be a finite number >= 0.")
    n = X.shape[-1]
    check_tensor("weight", weight, (n,), X)
    check_tensor("bias", bias, (n,), X)
    return X.reshape(-1, n)


def layernorm_dense(
    X: Tensor, *, eps: float = 1e-5, weight: Tensor | None = None, bias: Tensor | None = None
) -> dict[str, Tensor]:
    """Dense Jacobian and Hessian of LayerNorm over the last dim, by ``torch.func``.

    :math:`y_i = (x_i - \\mu_i) / \\sqrt{\\sigma_i^2 + \\epsilon} \\odot \\text{weight} + \\text{bias}` for
    every row ``x_i`` (biased variance, as ``torch.nn.functional.layer_norm``), seen as a map of
    :math:`x = \\mathrm{vec}_r(X)` flattened over all ``N`` rows (``N = L`` or ``B L``).

    Args:
        X: ``(L, n)`` or ``(B, L, n)``.
        eps: the variance floor, ``>= 0``.
        weight: optional ``(n,)`` affine scale. bias: optional ``(n,)`` affine shift.

    Returns:
        ``jacobian``: ``(N n, N n)``, ``[k, a] = dy_k/dx_a``;
        ``hessian``: ``(N n, N n, N n)``, ``[k, a, b] = d^2 y_k / dx_a dx_b``.
        Both are block-diagonal over rows.

    Raises:
        ValueError: on a bad shape, dtype or ``eps``.

    Example:
        >>> out = layernorm_dense(torch.randn(2, 3, dtype=torch.float64))
        >>> out["jacobian"].shape, out["hessian"].shape
        (torch.Size([6, 6]), torch.Size([6, 6, 6]))
    """
    rows = check_layernorm(X, eps, weight, bias)

    def ln_flat(x: Tensor) -> Tensor:
        return layer_norm(x.reshape(rows.shape), eps, weight, bias).reshape(-1)

    x = rows.reshape(-1)
    return {"jacobian": jacrev(ln_flat)(x), "hessian": hessian(ln_flat)(x)}


def layernorm_contracted_hessian(
    X: Tensor, grad_output: Tensor, *, eps: float = 1e-5, weight: Tensor | None = None
) -> Tensor:
    """:math:`\\sum_k g_k \\nabla^2 y_k` for LayerNorm, by ``torch.func``.

    The Hessian of :math:`x \\mapsto \\langle g, \\mathrm{LN}(x)\\rangle` with
    :math:`g = \\mathrm{vec}_r(\\text{grad\\_output})` held fixed; the bias does not enter.

    Args:
        X: ``(L, n)`` or ``(B, L, n)``.
        grad_output: same shape as ``X``.
        eps: the variance floor, ``>= 0``.
        weight: optional ``(n,)`` affine scale.

    Returns:
        ``(N n, N n)``, block-diagonal over the ``N`` rows.

    Raises:
        ValueError: on a bad shape, dtype or ``eps``.

    Example:
        >>> X = torch.randn(2, 3, dtype=torch.float64)
        >>> layernorm_contracted_hessian(X, torch.ones_like(X)).shape
        torch.Size([6, 6])
    """
    rows = check_layernorm(X, eps, weight, None)
    check_tensor("grad_output", grad_output, tuple(X.shape), X)
    g = grad_output.reshape(-1).detach()

    def contracted(x: Tensor) -> Tensor:
        return (g * layer_norm(x.reshape(rows.shape), eps, weight).reshape(-1)).sum()

    return hessian(contracted)(rows.reshape(-1))
