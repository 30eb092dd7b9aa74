"""Closed-form Jacobians of LayerNorm, the FFN and the post-LN block output (docs: the mathematics page).

Conventions (``docs/design.md``): a layer computes ``X @ W (+ b)``, so ``W_1`` is ``(d, d_ff)`` and ``W_2`` is
``(d_ff, d_out)``; Jacobians are taken with row-major flattening, ``vec_r(W) = W.reshape(-1)``, so
``d vec_r(S) / d vec_r(W)`` is what ``torch.func.jacrev`` returns, reshaped to ``(S.numel(), W.numel())``.
Every function is row-wise over tokens: an input of shape ``(B, L, d)`` is treated as ``N = B * L`` rows.

Two forms are offered for each Jacobian:

* **dense**: the matrix autograd would give. Its size grows like ``N * d * d * d_ff``, so it is only for small
  problems and for tests.
* **structured**: the same object without materialising Kronecker products or block diagonals. LayerNorm gives
  per-row blocks ``(N, n, n)``. The FFN and the block output give a :class:`RowKronecker`, whose row block for
  token ``i`` is ``left_i ⊗ right_i``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor

from .ffn import activation_derivatives, activation_value

__all__ = [
    "Activation",
    "RowKronecker",
    "layernorm_jacobian_blocks",
    "layernorm_jacobian_dense",
    "ffn_jacobian_W2",
    "ffn_jacobian_W2_structured",
    "ffn_jacobian_W1",
    "ffn_jacobian_W1_structured",
    "block_output_jacobians",
    "block_output_jacobians_structured",
]

_FLOAT_DTYPES = (torch.float32, torch.float64)


class Activation(str, Enum):
    """FFN non-linearity. ``"gelu"`` is the exact (erf) GELU, PyTorch's default ``approximate="none"``."""

    RELU = "relu"
    GELU = "gelu"


@dataclass(frozen=True)
class RowKronecker:
    """A Jacobian stored as one Kronecker product per token row.

    The rows of token ``i`` (``m`` output features) are ``left_i ⊗ right_i``, with ``left_i`` a ``1 × p`` row
    and ``right_i`` an ``m × q`` matrix, so that

    ``J[(i, k), (a, b)] = left[i, a] * right[i, k, b]``,  ``J`` of shape ``(N * m, p * q)``.

    The column index ``(a, b)`` is ``vec_r`` of a ``(p, q)`` weight. Storage is ``N * (p + m * q)`` numbers
    instead of ``N * m * p * q``.

    Attributes:
        left: ``(N, p)``.
        right: ``(N, m, q)``; may be a stride-0 view (e.g. an expanded identity).

    Example:
        >>> K = RowKronecker(torch.ones(2, 3), torch.eye(4).expand(2, 4, 4))
        >>> K.shape, K.to_dense().shape
        ((8, 12), torch.Size([8, 12]))
    """

    left: Tensor
    right: Tensor

    def __post_init__(self) -> None:
        if self.left.ndim != 2 or self.right.ndim != 3 or self.left.shape[0] != self.right.shape[0]:
            raise ValueError(
                f"RowKronecker needs left (N, p) and right (N, m, q) with the same N; got left "
                f"{tuple(self.left.shape)} and right {tuple(self.right.shape)}."
            )

    @classmethod
    def _unchecked(cls, left: Tensor, right: Tensor) -> RowKronecker:
        """The same object as ``RowKronecker(left, right)``, without the shape check of ``__post_init__``.

        Only for this module's closed forms, whose factors have the right shapes by construction (half the cost
        per object); public construction always validates.
        """
        self = object.__new__(cls)
        object.__setattr__(self, "left", left)  # what the frozen dataclass __init__ does
        object.__setattr__(self, "right", right)
        return self

    @property
    def shape(self) -> tuple[int, int]:
        """Shape ``(N * m, p * q)`` of the dense Jacobian."""
        N, p = self.left.shape
        _, m, q = self.right.shape
        return (N * m, p * q)

    def to_dense(self) -> Tensor:
        """Materialise the Jacobian, ``(N * m, p * q)``: one broadcast multiply, no matmul."""
        N, p = self.left.shape
        _, m, q = self.right.shape
        dense = self.left.new_empty(N * m, p * q)  # explicit layout: a broadcast product may come out permuted
        # view / unsqueeze rather than [:, None, :, None] indexing: half the cost each at the papers' size
        torch.mul(self.left.view(N, 1, p, 1), self.right.unsqueeze(2), out=dense.view(N, m, p, q))
        return dense

    def mv(self, V: Tensor) -> Tensor:
        """Jacobian-vector product ``J vec_r(V)`` for a ``(p, q)`` tangent ``V``; returns ``(N, m)``."""
        return torch.einsum("ikb,ib->ik", self.right, self.left @ V)

    def rmv(self, U: Tensor) -> Tensor:
        """Vector-Jacobian product ``J^T vec_r(U)`` for an ``(N, m)`` cotangent ``U``; returns ``(p, q)``."""
        return self.left.T @ torch.einsum("ik,ikb->ib", U, self.right)


# ----------------------------------------------------------------------------------------------------------
# validation helpers


# These run on every call. At the papers' size (L=8, d=16, d_ff=32) a closed form is 17-90 us on one CPU thread:
# each torch call costs ~2-5 us there (a view such as unsqueeze included) and each Python call or tensor attribute
# read (.shape, .dtype, .device) ~0.1-0.5 us. So the checks read each attribute once and make no torch call when
# the input is already right (no reshape of a 2-D input).


def _check_tensor(name: str, t: Tensor, ndims: Sequence[int], shape_hint: str) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"Invalid {name}: expected a torch.Tensor of shape {shape_hint}, got {type(t).__name__}.")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"Invalid {name}.dtype={t.dtype}. Must be torch.float32 or torch.float64; cast with "
            f"{name}.float() or {name}.double()."
        )
    if t.ndim not in ndims:
        raise ValueError(f"Invalid {name}.shape={tuple(t.shape)}. Must be {shape_hint}.")


def _check_like(name: str, t: Tensor | None, ref: Tensor, shape: tuple[int, ...], hint: str) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise ValueError(f"Invalid {name}: expected a torch.Tensor of shape {shape}, got {type(t).__name__}.")
    if tuple(t.shape) != shape:
        raise ValueError(f"Invalid {name}.shape={tuple(t.shape)}. Must be {shape} ({hint}).")
    _check_same(name, t, ref.dtype, ref.device)


def _check_same(name: str, t: Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """``t`` has the input's dtype and device (read once by the caller: each ``.device`` builds an object)."""
    if t.dtype != dtype or t.device != device:
        raise ValueError(
            f"Invalid {name}: dtype {t.dtype} on {t.device}, but the input is {dtype} on {device}. "
            f"Move it with {name}.to(input)."
        )


def _check_eps(eps: float) -> float:
    if type(eps) is float and 0.0 <= eps < math.inf:  # the common case, in one comparison (NaN fails it)
        return eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"Invalid eps={eps!r}. Must be a finite float >= 0 (PyTorch's LayerNorm default is 1e-5).")
    return float(eps)


# Activation is a str enum: a member hashes and compares like its name, so this finds members and names alike
_ACTIVATION_NAMES = {a.value: a.value for a in Activation}


def _check_activation(activation: str | Activation) -> str:
    """The activation's name, the key of the formula table in :mod:`curvwatch.closed_form.ffn`."""
    try:
        return _ACTIVATION_NAMES[activation]  # 0.1 us; Activation(activation).value is 1.2 us
    except (KeyError, TypeError):
        pass
    try:
        return Activation(activation).value  # anything else the Enum accepts
    except ValueError:
        allowed = ", ".join(repr(a.value) for a in Activation)
        raise ValueError(f"Invalid activation={activation!r}. Must be one of {allowed}.") from None


def _rows(name: str, X: Tensor) -> Tensor:
    """Validate a ``(L, n)`` or ``(B, L, n)`` input and return it as ``(N, n)`` rows."""
    _check_tensor(name, X, (2, 3), "(L, n) or (B, L, n)")
    return X if X.ndim == 2 else X.reshape(-1, X.shape[-1])  # a no-op reshape is still a ~1.5 us torch call


def _check_ffn(Y: Tensor, W_1: Tensor, W_2: Tensor | None, b_1: Tensor | None, need_w2: bool = True) -> Tensor:
    """Validate the FFN inputs and return ``Y`` as ``(N, d)`` rows; ``b_1`` is optional, ``W_2`` too where
    ``need_w2`` is False (the ∂S/∂W_2 forms do not read it)."""
    # Fast accept of the usual call (Y, W_1, W_2 given, no b_1), each attribute read once: about half the cost of
    # the step-by-step checks below at the papers' size. It accepts only
    # what those checks accept; everything else, every invalid input included, goes through them.
    if isinstance(Y, Tensor) and isinstance(W_1, Tensor) and isinstance(W_2, Tensor) and b_1 is None:
        dtype, device, shape, shape_1, shape_2 = Y.dtype, Y.device, Y.shape, W_1.shape, W_2.shape
        if (
            dtype in _FLOAT_DTYPES
            and W_1.dtype == dtype
            and W_2.dtype == dtype
            and W_1.device == device
            and W_2.device == device
            and len(shape) in (2, 3)
            and len(shape_1) == 2
            and len(shape_2) == 2
            and shape_1[0] == shape[-1]
            and shape_2[0] == shape_1[1]
        ):
            return Y if len(shape) == 2 else Y.reshape(-1, shape[-1])
    Y_rows = _rows("Y", Y)
    d = Y_rows.shape[1]
    dtype, device = Y.dtype, Y.device
    _check_tensor("W_1", W_1, (2,), "(d, d_ff)")
    d_in, d_ff = W_1.shape
    if d_in != d:
        raise ValueError(
            f"Invalid W_1.shape={tuple(W_1.shape)}. Must be (d, d_ff) with d={d} = Y.shape[-1]; "
            "curvwatch uses the X @ W convention, so pass nn.Linear.weight.T."
        )
    _check_same("W_1", W_1, dtype, device)
    if W_2 is not None or need_w2:  # W_2=None where it is needed: "expected a torch.Tensor", not AttributeError
        _check_tensor("W_2", W_2, (2,), "(d_ff, d_out)")
        if W_2.shape[0] != d_ff:
            raise ValueError(
                f"Invalid W_2.shape={tuple(W_2.shape)}. Must be (d_ff, d_out) with d_ff={d_ff} = "
                "W_1.shape[1]; "
                "curvwatch uses the X @ W convention, so pass nn.Linear.weight.T."
            )
        _check_same("W_2", W_2, dtype, device)
    _check_like("b_1", b_1, Y, (d_ff,), "one bias per hidden unit")
    return Y_rows


# ----------------------------------------------------------------------------------------------------------
# shared forward pieces


def _layernorm_stats(X: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Normalised rows ``ŷ = (x - μ) / s`` and ``1/s``, ``s = sqrt(σ² + eps)`` (biased variance).

    One fused kernel (``torch.native_layer_norm``, the op behind ``F.layer_norm``); ``(N, n)``, ``(N, 1)``.
    """
    y, _, rstd = torch.native_layer_norm(X, (X.shape[-1],), None, None, eps)
    if eps == 0.0 and bool(torch.isinf(rstd).any()):
        raise ValueError(
            "LayerNorm with eps=0 is undefined for a row with zero variance (the Jacobian scales as 1/σ). "
            "Pass eps > 0, e.g. PyTorch's default eps=1e-5."
        )
    return y, rstd


@functools.lru_cache(maxsize=8)
def _centering(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``C = I_n - 1 1ᵀ / n``, cached (read-only: never modify the returned tensor)."""
    return torch.eye(n, dtype=dtype, device=device) - 1.0 / n


def _layernorm_unit_blocks(y: Tensor, weight: Tensor | None) -> Tensor:
    """``s_i J_i = diag(w) (C - ŷ_i ŷ_iᵀ / n)``, ``(N, n, n)``: rank-1 update of a broadcast ``C``.

    ``C`` comes from a cache keyed on (n, dtype, device): 0.3 us per lookup (device hashing included), where
    building it (eye, sub) would be two more torch calls, ~5 us at the papers' size.
    """
    n = y.shape[-1]
    C = _centering(n, y.dtype, y.device)
    if weight is not None:
        C, y_left = weight.unsqueeze(1) * C, y * weight
    else:
        y_left = y
    return torch.addcmul(C, y_left.unsqueeze(2), y.unsqueeze(1), value=-1.0 / n)  # one fused broadcast pass


# ----------------------------------------------------------------------------------------------------------
# LayerNorm


def layernorm_jacobian_blocks(X: Tensor, eps: float = 1e-5, weight: Tensor | None = None) -> Tensor:
    """Per-row LayerNorm Jacobians (compact form), without the block-diagonal zeros.

    For row ``x_i`` with ``y_i = (x_i - μ_i 1) / s_i``, ``s_i = sqrt(σ_i² + eps)`` (biased variance) and
    ``C = I_n - 1 1ᵀ / n``:

    ``J_i = ∂ LN(x_i) / ∂ x_i = diag(weight) (1 / s_i) (C - y_i y_iᵀ / n)``.

    The LayerNorm bias does not enter. Rows do not interact, so the full Jacobian is ``blockdiag_i(J_i)``
    (see :func:`layernorm_jacobian_dense`).

    Args:
        X: ``(N, n)`` or ``(B, L, n)``, flattened to ``N = B * L`` rows; float32 or float64.
        eps: Variance floor, ``>= 0``. With ``eps = 0`` every row must have non-zero variance.
        weight: Optional LayerNorm gain ``(n,)``.

    Returns:
        ``(N, n, n)``, ``J[i, k, a] = ∂ LN(X)_{ik} / ∂ X_{ia}``, on ``X``'s device and in its dtype.

    Raises:
        ValueError: for a wrong shape or dtype, ``eps < 0``, or a zero-variance row with ``eps = 0``.

    Example:
        >>> X = torch.randn(2, 3, 4)
        >>> layernorm_jacobian_blocks(X).shape
        torch.Size([6, 4, 4])
    """
    X_rows = _rows("X", X)
    eps = _check_eps(eps)
    if weight is not None:
        _check_like("weight", weight, X, (X_rows.shape[1],), "the LayerNorm gain over the last dim")
    y, rstd = _layernorm_stats(X_rows, eps)
    return _layernorm_unit_blocks(y, weight).mul_(rstd.unsqueeze(2))


def layernorm_jacobian_dense(X: Tensor, eps: float = 1e-5, weight: Tensor | None = None) -> Tensor:
    """Dense LayerNorm Jacobian ``∂ vec_r LN(X) / ∂ vec_r X = blockdiag_i(J_i)``, the object autograd gives.

    ``J_i`` as in :func:`layernorm_jacobian_blocks`. Memory is ``(N n)²`` numbers; prefer the blocks.

    Args:
        X: ``(N, n)`` or ``(B, L, n)``; float32 or float64.
        eps: Variance floor, ``>= 0``.
        weight: Optional LayerNorm gain ``(n,)``.

    Returns:
        ``(N n, N n)``, block-diagonal.

    Raises:
        ValueError: as :func:`layernorm_jacobian_blocks`.

    Example:
        >>> layernorm_jacobian_dense(torch.randn(3, 4)).shape
        torch.Size([12, 12])
    """
    blocks = layernorm_jacobian_blocks(X, eps=eps, weight=weight)  # (N, n, n)
    N, n, _ = blocks.shape
    dense = blocks.new_zeros(N * n, N * n)
    # the diagonal blocks as one (N, n, n) view, [i, k, a] = dense[i n + k, i n + a]: one as_strided call where
    # view + diagonal + permute + reshape would be four (~2 us each at the papers' size)
    dense.as_strided((N, n, n), (n * N * n + n, N * n, 1)).copy_(blocks)
    return dense


# ----------------------------------------------------------------------------------------------------------
# FFN: S = σ(Y W_1 + b_1) W_2 + b_2 (+ Y)


def ffn_jacobian_W2_structured(
    Y: Tensor,
    W_1: Tensor,
    b_1: Tensor | None = None,
    activation: str | Activation = "relu",
    d_out: int | None = None,
) -> RowKronecker:
    """``∂S/∂W_2 = σ(Y W_1 + b_1) ⊗ I_{d_out}`` as a :class:`RowKronecker` (left = ``σ(Y W_1 + b_1)``).

    ``b_2`` and the residual ``+ Y`` do not enter, and neither does ``W_2`` itself (``S`` is linear in it).

    Args:
        Y: ``(L, d)`` or ``(B, L, d)``.
        W_1: ``(d, d_ff)``.
        b_1: Optional ``(d_ff,)``.
        activation: ``"relu"`` or ``"gelu"`` (exact erf).
        d_out: Output width ``W_2.shape[1]``; defaults to ``d`` (the residual block).

    Returns:
        ``RowKronecker(left=(N, d_ff), right=I_{d_out} expanded to (N, d_out, d_out))``.

    Example:
        >>> ffn_jacobian_W2_structured(torch.randn(5, 4), torch.randn(4, 8)).shape
        (20, 32)
    """
    Y_rows = _check_ffn(Y, W_1, None, b_1, need_w2=False)
    act = _check_activation(activation)
    d_out = Y_rows.shape[1] if d_out is None else d_out
    if isinstance(d_out, bool) or not isinstance(d_out, int) or d_out < 1:
        raise ValueError(f"Invalid d_out={d_out!r}. Must be an int >= 1 (W_2.shape[1]).")
    Z_pre = torch.addmm(b_1, Y_rows, W_1) if b_1 is not None else torch.mm(Y_rows, W_1)  # (N, d_ff)
    H = activation_value(Z_pre, act)  # σ alone: one kernel for ReLU (1.8 us at 8 x 32; with σ', σ'': 5.5 us)
    eye = torch.eye(d_out, dtype=Y.dtype, device=Y.device).expand(Y_rows.shape[0], d_out, d_out)
    return RowKronecker._unchecked(H, eye)


def ffn_jacobian_W2(
    Y: Tensor,
    W_1: Tensor,
    b_1: Tensor | None = None,
    activation: str | Activation = "relu",
    d_out: int | None = None,
) -> Tensor:
    """Dense ``∂ vec_r S / ∂ vec_r W_2 = σ(Y W_1 + b_1) ⊗ I_{d_out}`` (``B_2``).

    Args: as :func:`ffn_jacobian_W2_structured`.

    Returns:
        ``(N d_out, d_ff d_out)``.

    Example:
        >>> ffn_jacobian_W2(torch.randn(5, 4), torch.randn(4, 8)).shape
        torch.Size([20, 32])
    """
    return ffn_jacobian_W2_structured(Y, W_1, b_1, activation, d_out).to_dense()


def ffn_jacobian_W1_structured(
    Y: Tensor,
    W_1: Tensor,
    W_2: Tensor,
    b_1: Tensor | None = None,
    activation: str | Activation = "relu",
) -> RowKronecker:
    """``∂S/∂W_1`` as a :class:`RowKronecker`: left = ``Y``, right ``[i, m, b] = W_2[b, m] σ'(Z_pre)_{ib}``.

    Elementwise, with ``Z_pre = Y W_1 + b_1``:
    ``[B_1]_{(i,m),(a,b)} = W_2[b, m] σ'(Z_pre)_{ib} Y_{ia}``;
    equivalently ``B_1 = (I_N ⊗ W_2ᵀ) diag(vec_r σ'(Z_pre)) (Y ⊗ I_{d_ff})``.

    Args:
        Y: ``(L, d)`` or ``(B, L, d)``.
        W_1: ``(d, d_ff)``.
        W_2: ``(d_ff, d_out)``.
        b_1: Optional ``(d_ff,)``.
        activation: ``"relu"`` or ``"gelu"``.

    Returns:
        ``RowKronecker(left=(N, d), right=(N, d_out, d_ff))``.

    Example:
        >>> ffn_jacobian_W1_structured(torch.randn(5, 4), torch.randn(4, 8), torch.randn(8, 4)).shape
        (20, 32)
    """
    Y_rows = _check_ffn(Y, W_1, W_2, b_1)
    act = _check_activation(activation)
    Z_pre = torch.addmm(b_1, Y_rows, W_1) if b_1 is not None else torch.mm(Y_rows, W_1)  # (N, d_ff)
    _, dsigma, _ = activation_derivatives(Z_pre, act)
    right = W_2.T.contiguous() * dsigma.unsqueeze(1)  # (N, d_out, d_ff), row-major
    return RowKronecker._unchecked(Y_rows, right)


def ffn_jacobian_W1(
    Y: Tensor,
    W_1: Tensor,
    W_2: Tensor,
    b_1: Tensor | None = None,
    activation: str | Activation = "relu",
) -> Tensor:
    """Dense ``∂ vec_r S / ∂ vec_r W_1``: ``[B_1]_{(i,m),(a,b)} = W_2[b,m] σ'(Z_pre)_{ib} Y_{ia}``.

    Args: as :func:`ffn_jacobian_W1_structured`.

    Returns:
        ``(N d_out, d d_ff)``.

    Example:
        >>> ffn_jacobian_W1(torch.randn(5, 4), torch.randn(4, 8), torch.randn(8, 4)).shape
        torch.Size([20, 32])
    """
    return ffn_jacobian_W1_structured(Y, W_1, W_2, b_1, activation).to_dense()


# ----------------------------------------------------------------------------------------------------------
# post-LN block output (P1 Thm 4): Z = LN(S), ∂Z/∂W_i = J_Z B_i


_WRT = ("W_1", "W_2")


def _check_wrt(wrt: Sequence[str]) -> tuple[str, ...]:
    """``wrt`` as a tuple (a plain loop: a comprehension is a function call of its own)."""
    wrt = tuple(wrt)
    if not wrt:
        raise ValueError(f"Invalid wrt={wrt!r}. Must be a non-empty subset of {_WRT}.")
    for w in wrt:
        if w not in _WRT:
            raise ValueError(f"Invalid wrt={wrt!r}. Must be a non-empty subset of {_WRT}.")
    return wrt


def block_output_jacobians_structured(
    Y: Tensor,
    W_1: Tensor,
    W_2: Tensor,
    eps: float = 1e-5,
    activation: str | Activation = "relu",
    *,
    b_1: Tensor | None = None,
    b_2: Tensor | None = None,
    residual: bool = True,
    weight: Tensor | None = None,
    wrt: Sequence[str] = _WRT,
) -> dict[str, RowKronecker]:
    """``∂Z/∂W_1`` and ``∂Z/∂W_2`` of ``Z = LN(S)``, ``S = σ(Y W_1 + b_1) W_2 + b_2 (+ Y)``, kept structured.

    P1 Thm 4: ``∂Z/∂W_i = J_Z B_i`` with ``J_Z = blockdiag_i(J_i)`` the LayerNorm Jacobian at ``S``. The
    per-row blocks are applied row by row, never as a dense block-diagonal matmul:

    * ``∂Z/∂W_2``: the rows of token ``i`` are ``σ(z_i) ⊗ J_i``.
    * ``∂Z/∂W_1``: the rows of token ``i`` are ``y_i ⊗ (J_i W_2ᵀ diag σ'(z_i))``.

    Here ``z_i = y_i W_1 + b_1``, ``s_i`` is the LayerNorm scale of row ``i`` of ``S``, ``ŷ_i`` its normalised
    row, and ``s_i J_i = diag(w) (C - ŷ_i ŷ_iᵀ / n)``. The scalar ``1/s_i`` is kept on the left factor, so:

    * ``W_2``: left ``σ(z_i) / s_i``, ``(N, d_ff)``; right ``diag(w) (C - ŷ_i ŷ_iᵀ / n)``,
      ``(N, d_out, d_out)``.
    * ``W_1``: left ``y_i / s_i`` ``(N, d)``, right ``diag(w) (C W_2ᵀ - ŷ_i (W_2 ŷ_i)ᵀ / n) diag σ'(z_i)``
      ``(N, d_out, d_ff)``. The rank-1 form costs ``O(d d_ff)`` per row, not a ``d × d × d_ff`` matmul.

    The LayerNorm bias does not enter.

    Args:
        Y: Block input ``(L, d)`` or ``(B, L, d)``.
        W_1: ``(d, d_ff)``.
        W_2: ``(d_ff, d_out)``; ``d_out = d`` when ``residual``.
        eps: LayerNorm variance floor, ``>= 0``.
        activation: ``"relu"`` or ``"gelu"`` (exact erf).
        b_1: Optional ``(d_ff,)``.
        b_2: Optional ``(d_out,)``.
        residual: Add ``Y`` to the FFN output (the papers' block).
        weight: Optional LayerNorm gain ``(d_out,)``.
        wrt: Which Jacobians to compute, a subset of ``("W_1", "W_2")``.

    Returns:
        ``{"W_1": RowKronecker((N, d), (N, d_out, d_ff)),``
        ``"W_2": RowKronecker((N, d_ff), (N, d_out, d_out))}``, restricted to ``wrt``; factors as above.

    Raises:
        ValueError: for wrong shapes or dtypes, an unknown activation or ``wrt`` name, ``eps < 0``, or
            ``residual=True`` with ``d_out != d``.

    Example:
        >>> Y, W_1, W_2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
        >>> jac = block_output_jacobians_structured(Y, W_1, W_2)
        >>> jac["W_1"].shape, jac["W_2"].shape
        ((128, 512), (128, 512))
    """
    # Per-call overhead matters at the papers' size (W_2 alone: ~35 us, of which ~25 us are the 8 torch calls), so
    # optional checks are skipped here when their argument is None and the result is built with a plain loop.
    Y_rows = _check_ffn(Y, W_1, W_2, b_1)
    act = _check_activation(activation)
    eps = _check_eps(eps)
    d, d_out = Y_rows.shape[1], W_2.shape[1]
    if b_2 is not None:
        _check_like("b_2", b_2, Y, (d_out,), "one bias per output feature")
    if weight is not None:
        _check_like("weight", weight, Y, (d_out,), "the LayerNorm gain over the FFN output")
    if residual and d_out != d:
        raise ValueError(
            f"Invalid residual=True with W_2.shape={tuple(W_2.shape)}: the residual Y + FFN(Y) needs "
            f"d_out = d = {d}. "
            "Pass residual=False or a (d_ff, d) W_2."
        )
    wrt = _check_wrt(wrt)

    Z_pre = torch.addmm(b_1, Y_rows, W_1) if b_1 is not None else torch.mm(Y_rows, W_1)  # (N, d_ff)
    # (N, d_ff) each; σ' only for W_1 (σ alone is one kernel for ReLU: 1.8 us at 8 x 32; with σ', σ'': 5.5 us)
    if "W_1" in wrt:
        H, dsigma, _ = activation_derivatives(Z_pre, act)
    else:
        H, dsigma = activation_value(Z_pre, act), None
    if residual:
        S = torch.addmm(Y_rows if b_2 is None else Y_rows + b_2, H, W_2)  # (N, d_out)
    else:
        S = torch.addmm(b_2, H, W_2) if b_2 is not None else torch.mm(H, W_2)
    y, rstd = _layernorm_stats(S, eps)  # (N, d_out), (N, 1): ŷ_i and 1/s_i

    out: dict[str, RowKronecker] = {}  # in the order of wrt
    for name in wrt:
        if name in out:
            continue
        if name == "W_2":
            # σ(z_i) ⊗ J_i = (σ(z_i) / s_i) ⊗ (s_i J_i)
            out[name] = RowKronecker._unchecked(H * rstd, _layernorm_unit_blocks(y, weight))
        else:
            out[name] = _block_jacobian_W1(Y_rows, W_2, dsigma, y, rstd, weight)
    return out


def _block_jacobian_W1(
    Y_rows: Tensor, W_2: Tensor, dsigma: Tensor, y: Tensor, rstd: Tensor, weight: Tensor | None
) -> RowKronecker:
    """``∂Z/∂W_1`` of :func:`block_output_jacobians_structured` from its forward pieces.

    ``y_i ⊗ J_i W_2ᵀ diag σ'(z_i) = (y_i / s_i) ⊗ diag(w) (C W_2ᵀ - ŷ_i (W_2 ŷ_i)ᵀ / n) diag σ'(z_i)``.
    """
    d_out = W_2.shape[1]
    C_W2T = (W_2 - W_2.mean(dim=1, keepdim=True)).T.contiguous()  # (d_out, d_ff): C W_2ᵀ
    y_left = y
    if weight is not None:
        C_W2T, y_left = weight.unsqueeze(1) * C_W2T, y * weight
    right = C_W2T * dsigma.unsqueeze(1)  # (N, d_out, d_ff); (d_out, d_ff) broadcasts, no unsqueeze(0) call
    V = F.linear(y, W_2).mul_(dsigma)  # (N, d_ff): (W_2 ŷ_i) ⊙ σ'(z_i); = torch.mm(y, W_2.T) without the .T call
    right.addcmul_(y_left.unsqueeze(2), V.unsqueeze(1), value=-1.0 / d_out)
    return RowKronecker._unchecked(Y_rows * rstd, right)


def block_output_jacobians(
    Y: Tensor,
    W_1: Tensor,
    W_2: Tensor,
    eps: float = 1e-5,
    activation: str | Activation = "relu",
    *,
    b_1: Tensor | None = None,
    b_2: Tensor | None = None,
    residual: bool = True,
    weight: Tensor | None = None,
    wrt: Sequence[str] = _WRT,
) -> dict[str, Tensor]:
    """Dense ``∂ vec_r Z / ∂ vec_r W_1`` and ``∂ vec_r Z / ∂ vec_r W_2`` of the post-LN block (P1 Thm 4).

    ``Z = LN(S)``, ``S = σ(Y W_1 + b_1) W_2 + b_2 (+ Y)``, ``∂Z/∂W_i = J_Z B_i``; computed through
    :func:`block_output_jacobians_structured` and materialised once, with no dense block-diagonal matmul:

    ``[∂Z/∂W_2]_{(i,k),(b,e)} = σ(z_i)_b J_i[k, e]``,
    ``[∂Z/∂W_1]_{(i,k),(a,b)} = Y_{ia} (J_i W_2ᵀ)_{kb} σ'(z_i)_b``.

    Args: as :func:`block_output_jacobians_structured`.

    Returns:
        ``{"W_1": (N d_out, d d_ff), "W_2": (N d_out, d_ff d_out)}``, restricted to ``wrt``.

    Raises:
        ValueError: as :func:`block_output_jacobians_structured`.

    Example:
        >>> Y, W_1, W_2 = torch.randn(8, 16), torch.randn(16, 32), torch.randn(32, 16)
        >>> {k: tuple(v.shape) for k, v in block_output_jacobians(Y, W_1, W_2).items()}
        {'W_1': (128, 512), 'W_2': (128, 512)}
    """
    structured = block_output_jacobians_structured(
        Y, W_1, W_2, eps, activation, b_1=b_1, b_2=b_2, residual=residual, weight=weight, wrt=wrt
    )
    return {k: v.to_dense() for k, v in structured.items()}
