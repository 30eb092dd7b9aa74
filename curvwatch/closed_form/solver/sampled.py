"""Monte-Carlo output curvature: sampled Gauss-Newton blocks, per-block sharpness and its preconditioned variant.

In ``grad_output`` mode the kernels model the loss around the block output ``F`` ``(B, L, m)`` by
``<G, F'> + (c/2) ||F' - F||^2`` with a stand-in curvature ``c`` per sequence. Given ``k`` sampled output gradients
``s_j`` ``(B, L, m)`` (e.g. back-propagated from labels drawn from the model's own predictive distribution, so that
``E[s s^T]`` is the loss's Gauss-Newton matrix in ``F``), this module replaces ``c`` by the Monte-Carlo curvature

    C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T        (block diagonal over the sequences b; dropped rows zeroed)

and reports, for a diagonal block ``XX`` with ``J_X = dF/dX`` and the functional part ``H_f,XX = sum g d^2F/dX^2``
(``g = grad_output``):

* ``ggn/XX``: ``lambda_max(J_X^T C J_X)`` (PSD, rank ``<= k B``);
* ``sharpness/XX``: the largest *algebraic* eigenvalue of ``J_X^T C J_X + H_f,XX``, the block of the loss Hessian
  up to the second-order part of the layers downstream of ``F`` (which ``C`` does not see);
* ``precond_ggn/XX``, ``precond_sharpness/XX``: the same of ``P^{-1/2} (.) P^{-1/2}`` for a positive diagonal
  preconditioner ``P`` (Adam's ``sqrt(v_hat) + eps``), the quantity an optimiser's stability threshold applies to
  (``2 / lr`` for gradient descent on the plain one).

Each operator applies its output curvature at one line (``FFNOperator.apply``, ``GatedFFNOperator.apply``,
``AttentionOperator._outer_cotangent``): the stand-in ``c`` unless its ``sampled`` attribute holds a
:class:`SampledCurvature`. The norms then run through the pair machinery on a copy of the operator
(:func:`with_sampled`), under the grouped-query views where needed, with :class:`Preconditioned` wrapping the base
operator. This module holds the curvature, the wrappers and the checks of the kernels' arguments;
:mod:`~.sampled_keys` plans the keys' Lanczos runs, :mod:`~.gram` the exact Gram path, :mod:`~.members` the
members' products and :mod:`~.debiasing` the few-sample bias.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from ..settings import INPUTS_CHECKED
from .operator import BlockOperator

__all__ = ["Preconditioned", "SampledCurvature", "check_output_samples", "check_precondition", "with_sampled"]


class SampledCurvature:
    """The output curvature ``C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T`` applied in the space of an operator's
    output tangents.

    Args:
        sigma: ``(k, B, H, n)``: sample ``j`` as seen by unit ``h`` of sequence ``b``, flattened. For a block whose
            output is the tangent itself (FFN), ``H = 1`` and ``sigma = s``; for attention, whose tangents are the
            per-head outputs ``dF_h`` with ``F = sum_h F_h W_O^h``, ``sigma_{j,h} = s_j W_O^h^T``
            (see :meth:`of_tokens`, :meth:`of_heads`).
    """

    def __init__(self, sigma: torch.Tensor):
        # held as (B, H, k, n) in memory (a permuted view keeps the (k, B, H, n) indexing): each sequence and unit's
        # samples are then one matrix of the products' bmm, with no copy per product. Copied once when they are not
        # (a slice of k, as halves() takes, is already: no second copy)
        memory = sigma.permute(1, 2, 0, 3)
        try:
            memory.view(-1, *memory.shape[2:])  # (B H, k, n) as a view
        except RuntimeError:
            memory = memory.contiguous()
        self.sigma = memory.permute(2, 0, 1, 3)
        self.k = sigma.shape[0]
        # (n, k) weights of each tangent row's samples (:meth:`per_row`); None: 1/k for every row and sample
        self.row_weights: torch.Tensor | None = None

    @classmethod
    def of_tokens(cls, samples: torch.Tensor) -> SampledCurvature:
        """From samples ``(k, B, L, m)`` of a token-wise block whose tangents are ``(n, B L, m)``."""
        k, B = samples.shape[:2]
        return cls(samples.reshape(k, B, 1, -1))

    @classmethod
    def of_heads(cls, samples: torch.Tensor, W_O: torch.Tensor | None) -> SampledCurvature:
        """From samples ``(k, B, L, m)`` of attention with per-head output projection ``W_O`` ``(H, d_V, m)`` (None:
        one head, ``F = F_0``): ``sigma_{j,h} = s_j W_O^h^T`` ``(k, B, H, L d_V)``."""
        k, B = samples.shape[:2]
        sigma = samples.unsqueeze(2) if W_O is None else torch.einsum("kblm,hvm->kbhlv", samples, W_O)
        return cls(sigma.reshape(k, B, sigma.shape[2], -1))

    def per_row(self, weights: torch.Tensor) -> SampledCurvature:
        """The curvature with its own sample weights per tangent row: row ``r`` of a call applies
        ``sum_j weights[r, j] sigma_j sigma_j^T`` (``1/k`` on every sample is this curvature, ``1/k_a`` on the first
        half and 0 on the others is the first half's). Shares ``sigma``; a call must then have ``n`` =
        ``len(weights)`` rows (an operator's one-pass ``apply_masked``, which applies the curvature to every row).

        Args:
            weights: ``(n, k)``.
        """
        new = copy.copy(self)
        new.row_weights = weights
        return new

    def estimate_weights(self, E: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """``E`` tensors ``(k,)``: each estimate's sample weights, made on ``device`` (no host table to copy): ``1/k``
        on every sample (the full sample) and, with ``E = 3``, ``1/k_a`` on the first half's samples and ``1/k_b`` on
        the others' (:meth:`halves`), 0 elsewhere."""
        k, ka, kb = self.counts
        weights = [torch.full((k,), 1 / k, dtype=dtype, device=device)]
        if E == 3:
            first = (torch.arange(k, device=device) < ka).to(dtype)
            weights += [first / ka, (1 - first) / kb]
        return weights

    @property
    def counts(self) -> tuple[int, int, int]:
        """``(k, k_a, k_b)``: the samples, and those of the two halves (:meth:`halves`: the first ``k // 2``, the
        others), the split every debiased estimate uses (:func:`~.debiasing.debias`, the stacked members, the Gram
        path)."""
        return self.k, self.k // 2, self.k - self.k // 2

    def halves(self) -> tuple[SampledCurvature, SampledCurvature]:
        """The curvatures of the first ``k_a`` samples and of the others (:attr:`counts`; independent estimates of
        ``C``)."""
        h = self.counts[1]
        return SampledCurvature(self.sigma[:h]), SampledCurvature(self.sigma[h:])

    def _samples(self) -> torch.Tensor:
        """``(B H, k, size)``: the samples per sequence and unit, a view (see ``__init__``)."""
        k, B, H, X = self.sigma.shape
        return self.sigma.permute(1, 2, 0, 3).reshape(B * H, k, X)

    def coefficients(self, dF: torch.Tensor, samples: torch.Tensor | None = None) -> torch.Tensor:
        """``(B H, n, k)``: ``<sigma_{j,b,h}, dF_{n,b,h}>`` of the tangents ``dF`` (as :meth:`__call__` takes them),
        by one ``bmm`` against :meth:`_samples` (``samples``, where the caller holds it already)."""
        _, B, H, X = self.sigma.shape
        s = self._samples() if samples is None else samples
        return torch.bmm(dF.reshape(dF.shape[0], B, H, X).permute(1, 2, 0, 3).reshape(B * H, dF.shape[0], X), s.mT)

    def __call__(self, dF: torch.Tensor, group: int = 1) -> torch.Tensor:
        """``u = C dF`` for tangents ``dF`` ``(n, B, H, ...)`` (or ``(n, B L, m)`` with ``H = 1``), same shape.

        Per sequence ``b`` and unit ``h``: ``u_h = (1/k) sum_j <sigma_{j,h}, dF_h>_b sigma_{j,h}``. With ``group > 1``
        the coefficient of ``h`` is summed over its group of ``group`` consecutive units (heads sharing a kv head,
        whose outputs a perturbation of the shared weights moves together), like the stand-in's ``mix``.
        """
        k, B, H, X = self.sigma.shape
        n = dF.shape[0]
        s = self._samples()
        a = self.coefficients(dF, s)  # (B H, n, k)
        if group > 1:
            a = a.view(B, H // group, group, n, k).sum(2, keepdim=True).expand(B, H // group, group, n, k)
            a = a.reshape(B * H, n, k)
        if self.row_weights is None:
            a = a / k
        elif self.row_weights.shape[0] != n:  # not reached: the stacked members call with every row
            raise RuntimeError(f"per-row sample weights for {self.row_weights.shape[0]} rows applied to {n}")
        else:
            a = a * self.row_weights  # (B H, n, k) * (n, k)
        u = torch.bmm(a, s)  # (B H, n, X)
        return u.view(B, H, n, X).permute(2, 0, 1, 3).reshape(dF.shape)


def with_sampled(op: BlockOperator, curvature: SampledCurvature) -> BlockOperator:
    """A shallow copy of ``op`` (sharing its tensors and cached factors) that applies ``curvature`` as its output
    curvature instead of the stand-in ``c``; ``op`` itself is unchanged."""
    new = copy.copy(op)
    new.sampled = curvature
    return new


class Preconditioned:
    """``D H D`` for a block operator ``H`` and positive diagonal scalings ``D`` (``P^{-1/2}``) of some of its blocks.

    Scales the tangent of each block in ``scale`` before :meth:`apply` and every part of the result after; blocks
    without a scaling pass unchanged. Every other attribute is the wrapped operator's, so the grouped-query views can
    sit on top of it (:class:`~curvwatch.closed_form.attention.views.QueryView`,
    :class:`~curvwatch.closed_form.attention.views.GroupView`).

    Args:
        op: the operator (attention, FFN or gated FFN, possibly with sampled curvature).
        scale: ``name -> D`` in the operator's layout of that block without the leading tangent dimension
            (``(H, d, d_K)`` for attention's ``Q``, ``(d, f)`` for the FFN's ``W1``).
    """

    def __init__(self, op: BlockOperator, scale: Mapping[str, torch.Tensor]):
        self.op, self.scale = op, dict(scale)

    def __getattr__(self, name: str):
        if name in ("op", "scale") or name.startswith("__"):  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.op, name)

    def _scaled(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {nm: x * self.scale[nm] if nm in self.scale else x for nm, x in t.items()}

    def apply(self, tangent, *args, **kwargs):
        """The wrapped ``apply`` (any of its arguments) with ``D`` on the way in and on every part on the way out."""
        return tuple(self._scaled(part) for part in self.op.apply(self._scaled(tangent), *args, **kwargs))

    @property
    def apply_masked(self):
        """The wrapped ``apply_masked`` with ``D`` on the way in and out, or None where the operator has none (a
        property: ``__getattr__`` would hand out the wrapped method unscaled)."""
        inner = getattr(self.op, "apply_masked", None)
        if inner is None:
            return None
        return lambda tangent, *args, **kwargs: self._scaled(inner(self._scaled(tangent), *args, **kwargs))


def check_output_samples(
    samples: torch.Tensor | None,
    *,
    target: torch.Tensor | None,
    out_shape: tuple[int, int, int],
    batched: bool,
    row_keep: torch.Tensor,
    ref: torch.Tensor,
) -> torch.Tensor | None:
    """Validate ``output_samples`` against the block output ``(B, L, m)``; return them ``(k, B, L, m)`` in ``ref``'s
    dtype and device with the rows outside ``row_keep`` ``(B, L)`` zeroed (like ``g``), or None.

    Raises:
        ValueError: with ``target`` (grad_output mode only), on a non-tensor, or on a shape other than
            ``(k, B, L, m)`` (``(k, L, m)`` unbatched) with ``k >= 1``.
    """
    if samples is None:
        return None
    if target is not None:
        raise ValueError(
            "output_samples= applies to grad_output= mode only: the sampled curvature replaces the stand-in c of "
            "the local model around a block inside a network, while target= fixes the loss and its curvature. Pass "
            "grad_output= instead of target=, or drop output_samples (and precondition)."
        )
    B, L, m = out_shape
    expected = (B, L, m) if batched else (L, m)
    shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
    if not isinstance(samples, torch.Tensor) or samples.ndim != len(expected) + 1 or samples.shape[0] < 1:
        ok = False
    else:
        ok = tuple(samples.shape[1:]) == expected
    if not ok:
        names = "(k, B, L, m)" if batched else "(k, L, m)"
        raise ValueError(
            f"Invalid output_samples shape {shape}. Expected {names} = (k, {', '.join(map(str, expected))}) with "
            "k >= 1: k sampled gradients of the loss in the block output, each shaped like grad_output."
        )
    S = samples.to(dtype=ref.dtype, device=ref.device)
    if not batched:
        S = S.unsqueeze(1)
    return S * row_keep.to(S.dtype)[None, :, :, None]


def check_precondition(
    precondition: Mapping[str, torch.Tensor] | None,
    shapes: Mapping[str, tuple[int, ...]],
    ref: torch.Tensor,
    *,
    has_samples: bool,
) -> dict[str, torch.Tensor]:
    """Validate ``precondition`` (``weight argument name -> diagonal of P``); return ``name -> D = P^{-1/2}`` in
    ``ref``'s dtype and device, each shaped like its weight argument (``{}`` for None).

    Args:
        precondition: the kernel's argument, or None.
        shapes: the kernel's weight argument names and the shapes they were passed with, e.g.
            ``{"W_1": (d, f), "W_2": (f, m)}``.
        ref: a tensor of the working dtype and device.
        has_samples: whether ``output_samples`` was given (the preconditioned keys need it).

    Raises:
        ValueError: without ``output_samples``, on a non-mapping, an unknown name, a shape other than the weight's,
            or an entry that is not finite and positive everywhere.
    """
    if precondition is None:
        return {}
    if not has_samples:
        raise ValueError(
            "precondition= needs output_samples= (grad_output mode only): it preconditions the sampled-curvature keys "
            "(precond_sharpness/..., precond_ggn/...). Pass output_samples as well, or drop precondition."
        )
    if not isinstance(precondition, Mapping):
        raise ValueError(
            f"Invalid precondition={type(precondition).__name__}. Must be a mapping from weight names "
            f"{list(shapes)} to tensors of their shapes (the diagonal of P, e.g. Adam's sqrt(v_hat) + eps)."
        )
    unknown = sorted(set(precondition) - set(shapes))
    if unknown:
        raise ValueError(f"Invalid precondition names {unknown}. Allowed: {list(shapes)} (this kernel's weights).")
    out = {}
    for name, shape in shapes.items():
        if name not in precondition:
            continue
        p = precondition[name]
        got = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != tuple(shape):
            raise ValueError(
                f"Invalid precondition[{name!r}] shape {got}. Must be {tuple(shape)}, the shape {name} was passed "
                "with (same layout: one entry of P per weight entry)."
            )
        out[name] = p.to(dtype=ref.dtype, device=ref.device)
    # every weight's entries finite and > 0, in one host read for all of them; none where the caller checked them
    # (the monitor's engine, in its one NaN/Inf read of all blocks: its P = sqrt(v_hat) + eps is positive if finite)
    valid = [True] * len(out)
    if out and not INPUTS_CHECKED.get():
        valid = torch.stack([(torch.isfinite(p) & (p > 0)).all() for p in out.values()]).tolist()
    for (name, p), ok in zip(out.items(), valid, strict=True):
        if not ok:
            raise ValueError(
                f"Invalid precondition[{name!r}]: every entry must be finite and > 0 (the diagonal of a positive "
                f"preconditioner, e.g. Adam's sqrt(v_hat) + eps); smallest entry {float(p.min()):.3g}."
            )
    return {name: p.rsqrt() for name, p in out.items()}
