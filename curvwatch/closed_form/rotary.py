"""Rotary position embeddings as the attention closed forms take them: a fixed linear map ``R`` per position.

``R`` rotates pairs of query/key features by position-dependent angles: the half-split layout of LLaMA, GPT-NeoX
and Hugging Face (feature ``i`` pairs with ``i + r/2``) or the interleaved layout of GPT-J (``2i`` with ``2i + 1``),
over the first ``r <= d_K`` features (partial rotary leaves the rest unchanged). :func:`check_rotary` turns the
``(cos, sin)`` tables a model computes into a :class:`Rotary`, whose call applies ``R`` and whose ``transpose``
applies ``R^T`` (the cotangent direction); ``R`` is linear, so it adds no second-order term.
"""

from __future__ import annotations

import torch

__all__ = ["Rotary", "apply_rotary", "check_rotary", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dimension (halves of equal width)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False, transpose: bool = False
) -> torch.Tensor:
    """Rotary embedding ``R`` (or its transpose) on the first ``r`` dimensions of ``x`` ``(..., L, d_K)``.

    The tables hold ``r`` columns in the half-split layout of Hugging Face and litgpt, the frequencies' halves
    duplicated: ``cos[..., i] == cos[..., i + r/2]`` (``torch.cat([freqs, freqs], -1)``); they broadcast against
    ``x[..., :r]``. Half-split (``interleaved=False``, LLaMA / NeoX): ``R x = x * cos + rotate_half(x) * sin`` with
    ``rotate_half([x1, x2]) = [-x2, x1]``. Interleaved (GPT-J): pair ``(2i, 2i+1)`` turns by frequency ``i``,
    ``y_2i = x_2i c_i - x_2i+1 s_i``, ``y_2i+1 = x_2i+1 c_i + x_2i s_i``. Dimensions ``r:`` pass unchanged
    (partial rotary, NeoX / pythia). ``R`` acts per position as ``r/2`` blocks ``[[c, -s], [s, c]]``; its transpose
    flips the sign of ``sin``.

    Args:
        x: ``(..., L, d_K)``.
        cos, sin: ``(..., L, r)``, ``r <= d_K`` even, broadcastable against ``x[..., :r]``.
        interleaved: the GPT-J layout.
        transpose: apply ``R^T`` (the VJP of ``R``).

    Returns:
        ``(..., L, d_K)``.

    Example:
        >>> x = torch.tensor([[1.0, 0.0]])  # one position, d_K = 2
        >>> c, s = torch.zeros(1, 2), torch.ones(1, 2)  # a quarter turn
        >>> apply_rotary(x, c, s), apply_rotary(x, c, s, transpose=True)
        (tensor([[0., 1.]]), tensor([[ 0., -1.]]))
    """
    r = cos.shape[-1]
    xr = x[..., :r]
    sin = -sin if transpose else sin
    if interleaved:
        c, s = cos[..., : r // 2], sin[..., : r // 2]
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        y = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        y = xr * cos + rotate_half(xr) * sin
    return y if r == x.shape[-1] else torch.cat([y, x[..., r:]], dim=-1)


class Rotary:
    """The rotary map of one call: validated tables ``(B or 1, L, r)`` broadcast over heads, and its norm.

    A call applies ``R`` as ``x * C + x[..., perm] * S`` (three kernels, where :func:`apply_rotary` takes seven to
    nine: a Lanczos product applies it to every tangent and cotangent): ``perm`` pairs each feature with its partner
    (``i`` with ``i +- r/2``, or ``2i`` with ``2i + 1``), ``C`` holds each feature's cosine and ``S`` its signed sine
    (``-sin`` on the feature whose partner comes second in its pair, ``R^T``'s flipped); features ``r:`` of a partial
    rotary have ``C = 1``, ``S = 0`` and themselves as partner. Tables ``(B or 1, 1, L, d_K)``.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, d_K: int):
        self.cos, self.sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # (B or 1, 1, L, r): broadcast over heads
        self.interleaved = interleaved
        r = cos.shape[-1]
        self.partial = r < d_K
        h = r // 2
        idx = torch.arange(d_K, device=cos.device)
        first = torch.zeros(d_K, dtype=torch.bool, device=cos.device)  # the features whose partner comes second
        if interleaved:  # pair (2i, 2i+1) turns by frequency i: y_2i = x_2i c_i - x_2i+1 s_i
            self.perm = torch.where(idx < r, idx ^ 1, idx)
            first[:r:2] = True
            c, s = (t[..., :h].repeat_interleave(2, -1) for t in (self.cos, self.sin))
        else:  # feature i pairs with i + r/2: y_i = x_i c_i - x_{i+r/2} s_i for i < r/2
            self.perm = torch.where(idx < h, idx + h, torch.where(idx < r, idx - h, idx))
            first[:h] = True
            c, s = self.cos, self.sin
        pad = self.cos.new_zeros((*self.cos.shape[:-1], d_K - r))
        self.C = torch.cat([c, pad + 1], -1)
        self.S = torch.cat([torch.where(first[:r], -s, s), pad], -1)
        self.S_T = -self.S

    def __call__(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """``R x`` (``R^T x`` with ``transpose``) of ``x`` ``(..., B or 1, H, L, d_K)``, as :func:`apply_rotary`."""
        return torch.addcmul(x * self.C, x.index_select(-1, self.perm), self.S_T if transpose else self.S)

    def norm(self) -> torch.Tensor:
        """``max_i ||R_i||_2`` over positions: ``max sqrt(cos^2 + sin^2)`` (1 for a rotation; YaRN scales it)."""
        n = (self.cos * self.cos + self.sin * self.sin).amax().sqrt()
        return n.clamp_min(1.0) if self.partial else n


def check_rotary(rotary, interleaved, B: int, L: int, d_K: int, ref: torch.Tensor) -> Rotary:
    """Validate ``rotary=(cos, sin)`` for ``L`` positions and heads of width ``d_K``; see :func:`apply_rotary`."""
    if not isinstance(interleaved, bool):
        raise ValueError(f"Invalid rotary_interleaved={interleaved!r}. Must be False (half-split) or True (GPT-J).")
    pair = isinstance(rotary, (tuple, list)) and len(rotary) == 2
    if not (pair and all(isinstance(t, torch.Tensor) for t in rotary)):
        raise ValueError(
            f"Invalid rotary={type(rotary).__name__}: expected a (cos, sin) pair of tensors, each (L, r) or (B, L, r) "
            "(Hugging Face: the position_embeddings of the layer; litgpt: build_rope_cache(...) cut to the sequence)."
        )
    cos, sin = rotary
    if cos.shape != sin.shape:
        raise ValueError(f"rotary cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape.")
    shape = tuple(cos.shape)
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if cos.ndim != 3 or cos.shape[0] not in (1, B) or cos.shape[1] != L:
        raise ValueError(
            f"Invalid rotary table shape {shape}. Expected (L, r) = ({L}, r) or (B, L, r) with B in (1, {B}): one row "
            "per position of the sequence (cut a longer cache to the sequence, e.g. cos[:L])."
        )
    r = cos.shape[-1]
    if r % 2 or not 2 <= r <= d_K:
        raise ValueError(
            f"Invalid rotary width r={r}. Must be even with 2 <= r <= d_K = {d_K} (the first r dims of a head rotate)."
        )
    cos, sin = cos.to(dtype=ref.dtype, device=ref.device), sin.to(dtype=ref.dtype, device=ref.device)
    h = r // 2
    # every check in one host read (one device sync per block and evaluation, not one per check)
    finite, halves_cos, halves_sin = torch.stack(
        [torch.isfinite(torch.stack([cos, sin])).all()] + [(t[..., :h] == t[..., h:]).all() for t in (cos, sin)]
    ).tolist()
    if not finite:
        raise ValueError("rotary tables hold NaN or Inf values.")
    for name, same in (("cos", halves_cos), ("sin", halves_sin)):
        if not same:
            raise ValueError(
                f"rotary {name} must repeat its frequencies' halves, {name}[..., i] == {name}[..., i + r/2] (the "
                "layout Hugging Face's rotary embeddings and litgpt's build_rope_cache return, for either "
                "rotary_interleaved). A GPT-J style table t with the frequencies repeated in pairs [c0, c0, c1, c1, "
                "...] becomes torch.cat([t[..., ::2], t[..., ::2]], -1)."
            )
    return Rotary(cos, sin, interleaved, d_K)
