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
:class:`SampledCurvature`. The norms then run through the existing pair machinery on a copy of the operator
(:func:`with_sampled`), under the grouped-query views where needed, with :class:`Preconditioned` wrapping the base
operator.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence

import torch

from ._lanczos import solve
from ._operator import BlockOperator, _norm_results, _norm_run, _pair_blocks, head_keys, pair_matvec
from .settings import Lanczos

#: Estimate the sampled keys through the token-diagonal curvature (:func:`estimate`, see :func:`sampled_norms`);
#: ``False`` reports the plain Monte-Carlo values (the benchmark's "before").
DEBIAS = True

#: The new keys per diagonal pair: ``{prefix}{name}/{XX}[/{head}]`` for prefix ``""`` and ``"precond_"``.
SAMPLED_NAMES = ("ggn", "sharpness")


class SampledCurvature:
    """The output curvature ``C = sum_b (1/k) sum_j s_{j,b} s_{j,b}^T`` applied in the space of an operator's
    output tangents.

    Args:
        sigma: ``(k, B, H, n)``: sample ``j`` as seen by unit ``h`` of sequence ``b``, flattened. For a block whose
            output is the tangent itself (FFN), ``H = 1`` and ``sigma = s``; for attention, whose tangents are the
            per-head outputs ``dF_h`` with ``F = sum_h F_h W_O^h``, ``sigma_{j,h} = s_j W_O^h^T``
            (see :meth:`of_tokens`, :meth:`of_heads`).
    """

    def __init__(self, sigma: torch.Tensor, L: int = 1, tokens: bool = False):
        self.sigma = sigma
        self.k = sigma.shape[0]
        self.L, self.tokens = L, tokens
        self.record: list[torch.Tensor] | None = None  # a list: each call appends its coefficients <sigma_j, dF>

    @classmethod
    def of_tokens(cls, samples: torch.Tensor) -> SampledCurvature:
        """From samples ``(k, B, L, m)`` of a token-wise block whose tangents are ``(n, B L, m)``."""
        k, B, L = samples.shape[:3]
        return cls(samples.reshape(k, B, 1, -1), L)

    @classmethod
    def of_heads(cls, samples: torch.Tensor, W_O: torch.Tensor | None) -> SampledCurvature:
        """From samples ``(k, B, L, m)`` of attention with per-head output projection ``W_O`` ``(H, d_V, m)`` (None:
        one head, ``F = F_0``): ``sigma_{j,h} = s_j W_O^h^T`` ``(k, B, H, L d_V)``."""
        k, B, L = samples.shape[:3]
        sigma = samples.unsqueeze(2) if W_O is None else torch.einsum("kblm,hvm->kbhlv", samples, W_O)
        return cls(sigma.reshape(k, B, sigma.shape[2], -1), L)

    def halves(self) -> tuple[SampledCurvature, SampledCurvature]:
        """The curvatures of the first ``k // 2`` samples and of the others (independent estimates of ``C``)."""
        h = self.k // 2
        return (SampledCurvature(self.sigma[:h], self.L, self.tokens),
                SampledCurvature(self.sigma[h:], self.L, self.tokens))  # fmt: skip

    def token_diagonal(self) -> SampledCurvature:
        """The same samples with ``C``'s blocks between different tokens dropped:
        ``C_td = sum_{b, t} (1/k) sum_j s_{j,b,t} s_{j,b,t}^T`` (``k B L`` rank-one terms instead of ``k B``)."""
        return SampledCurvature(self.sigma, self.L, tokens=True)

    def __call__(self, dF: torch.Tensor, group: int = 1) -> torch.Tensor:
        """``u = C dF`` for tangents ``dF`` ``(n, B, H, ...)`` (or ``(n, B L, m)`` with ``H = 1``), same shape.

        Per sequence ``b`` and unit ``h``: ``u_h = (1/k) sum_j <sigma_{j,h}, dF_h>_b sigma_{j,h}``. With ``group > 1``
        the coefficient of ``h`` is summed over its group of ``group`` consecutive units (heads sharing a kv head,
        whose outputs a perturbation of the shared weights moves together), like the stand-in's ``mix``.
        """
        k, B, H, _ = self.sigma.shape
        n = dF.shape[0]
        if self.tokens:  # one coefficient per sample, sequence, unit and token
            sigma = self.sigma.unflatten(-1, (self.L, -1))  # (k, B, H, L, x)
            a = torch.einsum("nbhtx,kbhtx->nkbht", dF.reshape(n, B, H, self.L, -1), sigma) / k
        else:
            a = torch.einsum("nbhx,kbhx->nkbh", dF.reshape(n, B, H, -1), self.sigma) / k  # (n, k, B, H)
        if self.record is not None:
            self.record.append(a * k)
        if group > 1:
            a = a.movedim(3, -1) if self.tokens else a
            shape = a.shape
            a = a.unflatten(-1, (H // group, group)).sum(-1, keepdim=True).expand(*shape[:-1], H // group, group)
            a = a.flatten(-2)
            a = a.movedim(-1, 3) if self.tokens else a
        if self.tokens:
            return torch.einsum("nkbht,kbhtx->nbhtx", a, sigma).reshape(dF.shape)
        return torch.einsum("nkbh,kbhx->nbhx", a, self.sigma).reshape(dF.shape)


def with_sampled(op: BlockOperator, curvature: SampledCurvature) -> BlockOperator:
    """A shallow copy of ``op`` (sharing its tensors and cached factors) that applies ``curvature`` as its output
    curvature instead of the stand-in ``c``; ``op`` itself is unchanged."""
    new = copy.copy(op)
    new.sampled = curvature
    return new


class Preconditioned:
    """``D H D`` for a block operator ``H`` and positive diagonal scalings ``D`` (``P^{-1/2}``) of some of its blocks.

    Scales the tangent of each block in ``scale`` before :meth:`apply` and every part of the result after; blocks
    without a scaling pass unchanged. Every other attribute is the wrapped operator's, so the grouped-query views
    (:class:`~curvwatch.closed_form.attention._QueryView`, ``_GroupView``) can sit on top of it.

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
        p = p.to(dtype=ref.dtype, device=ref.device)
        if not bool((torch.isfinite(p) & (p > 0)).all()):
            raise ValueError(
                f"Invalid precondition[{name!r}]: every entry must be finite and > 0 (the diagonal of a positive "
                f"preconditioner, e.g. Adam's sqrt(v_hat) + eps); smallest entry {float(p.min()):.3g}."
            )
        out[name] = p.rsqrt()
    return out


def sampled_norms(
    op: BlockOperator,
    pairs: Sequence[str],
    *,
    lanczos: Lanczos,
    scale: Mapping[str, torch.Tensor] | None = None,
    view: Callable[[BlockOperator], BlockOperator] | None = None,
) -> dict[str, torch.Tensor]:
    """``ggn/XX[/h{i}]``, ``sharpness/XX[/h{i}]`` and, where ``scale`` holds ``X``, ``precond_ggn/XX[/h{i}]``,
    ``precond_sharpness/XX[/h{i}]``, each with its ``residual/...`` key, for the diagonal ``pairs``.

    The GGN is the outer part and the sharpness the total of ``op`` (whose output curvature is sampled); the
    preconditioned ones those of :class:`Preconditioned` ``(op, {X: D})``. All kinds of one pair run in one batched
    Lanczos for the largest *algebraic* eigenvalue (``lanczos_max_abs(algebraic=True)``; for the PSD GGN it is also
    the norm), warm-started under the key ``("sharpness", XX, prefixes, estimator)``.

    The largest eigenvalue of the Monte-Carlo matrix with all of ``C`` is biased upward, badly at large blocks: its
    ``k B`` rank-one terms (``k`` samples, ``B`` sequences) see ``C``'s blocks between different tokens, which are
    mostly sampling noise (the labels of different tokens are drawn independently; only attention downstream of the
    block correlates them). With ``DEBIAS`` (the default) each key is :func:`estimate`: the Lanczos runs on the
    *token-diagonal* ``C`` (:meth:`SampledCurvature.token_diagonal`, ``k B L`` terms, little bias), and the key is
    the Rayleigh quotient of the matrix with all of ``C`` at its top Ritz vector (which adds back the between-token
    part that downstream attention makes real, to first order); ``sharpness_spread/XX[/h{i}]`` is its uncertainty,
    relative. Cost: one Lanczos member per key (as the plain value) plus three products at the Ritz vector.

    Args:
        op: the base operator with sampled curvature (:func:`with_sampled`).
        pairs: diagonal pair names such as ``"QQ"``, ``"W1W1"``.
        lanczos: the Lanczos settings.
        scale: ``block name -> D = P^{-1/2}`` in ``op``'s layout (see :class:`Preconditioned`).
        view: maps the (possibly preconditioned) base operator to the operator the blocks are read from (the
            grouped-query ``_QueryView`` / ``_GroupView``); default the operator itself.
    """
    scale = {} if scale is None else scale
    view = (lambda o: o) if view is None else view
    curvature = getattr(op, "sampled", None)
    tokens = DEBIAS and curvature is not None
    search = with_sampled(op, curvature.token_diagonal()) if tokens else op  # the operator Lanczos runs on
    # the operators the Rayleigh quotients read: all samples, and with k >= 2 each half (for the spread)
    split = tokens and curvature.k >= 2
    checks = ([op, *(with_sampled(op, c) for c in curvature.halves())] if split else [op]) if tokens else []
    out: dict[str, torch.Tensor] = {}
    for pair_name in pairs:
        plain = view(op)
        X, Y = _pair_blocks(pair_name, list(plain.params))
        if X != Y:
            raise ValueError(f"Sampled sharpness is defined for diagonal pairs only; got {pair_name!r}.")
        prefixes = [""] + (["precond_"] if X in scale else [])

        def wrap(o: BlockOperator, prefix: str, X: str = X) -> BlockOperator:
            return view(Preconditioned(o, {X: scale[X]})) if prefix else view(o)

        # run i (variant i) owns the rows 2i (ggn) and 2i + 1 (sharpness)
        runs = [pair_matvec(wrap(search, prefix), (X, X), ("outer", "hessian")) for prefix in prefixes]
        emb = runs[0][0]

        def mv(u: torch.Tensor, live: torch.Tensor | None = None, runs=runs) -> torch.Tensor:
            parts = []
            for i, (_, f) in enumerate(runs):  # two members (ggn, sharpness) per run, each its own operator
                rows = slice(2 * i, 2 * i + 2)
                parts.append(f(u[rows], None if live is None else live[rows]))
            return torch.cat(parts)

        kinds = ("outer", "hessian") * len(runs)
        key = ("sharpness", pair_name, tuple(prefixes), "tokens" if tokens else "plain")
        run = _norm_run(plain, emb, mv, kinds, key, True, lanczos, algebraic=True)
        solve([run])
        vals, rel = _norm_results(run, key, lanczos)
        quotients = None
        if tokens:
            v = run.ritz  # (rows, H, n)
            quotients = []  # per operator of `checks`: (q (rows, H), r (rows, H, n))
            for o in checks:
                parts = [_rayleigh(pair_matvec(wrap(o, p), (X, X), ("outer", "hessian"))[1], v[2 * i : 2 * i + 2])
                         for i, p in enumerate(prefixes)]  # fmt: skip
                quotients.append((torch.cat([q for q, _ in parts]), torch.cat([r for _, r in parts])))
        for i, prefix in enumerate(prefixes):
            for j, name in enumerate(SAMPLED_NAMES):
                row = 2 * i + j
                value, spread = vals[row], None
                if tokens:
                    halves = None
                    if split:  # the halves' quotients and <r_a, r_b> of their residuals
                        halves = (quotients[1][0][row], quotients[2][0][row],
                                  (quotients[1][1][row] * quotients[2][1][row]).sum(-1))  # fmt: skip
                    value, spread = estimate(vals[row], quotients[0][0][row], halves, psd=name == "ggn")
                heads = head_keys(wrap(op, prefix), f"{prefix}{name}/{pair_name}", (X,))
                for h, k in enumerate(heads):
                    out[k] = value[h]
                    out[f"residual/{k}"] = rel[row][h]
                if spread is not None and name == "sharpness" and not prefix:
                    for h, k in enumerate(head_keys(wrap(op, prefix), f"sharpness_spread/{pair_name}", (X,))):
                        if bool(torch.isfinite(spread[h])) and bool(value[h] != 0):  # 0/0 is "no data": none
                            out[k] = spread[h]
    return out


def _rayleigh(matvec, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, r)``: the Rayleigh quotient ``q = <v, M v> / <v, v>`` ``(rows, H)`` per row and head of ``v``
    ``(rows, H, n)`` (0 where ``v`` is 0) and the residual ``r = (M v - q v) / |v|`` ``(rows, H, n)``."""
    Mv = matvec(v, None)
    vv = (v * v).sum(-1)
    q = torch.where(vv > 0, (v * Mv).sum(-1) / vv.clamp_min(torch.finfo(v.dtype).tiny), 0.0)
    return q, (Mv - q[..., None] * v) / vv.clamp_min(torch.finfo(v.dtype).tiny).sqrt()[..., None]


def estimate(
    search: torch.Tensor,
    quotient: torch.Tensor,
    halves: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    psd: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(estimate, relative uncertainty)`` of a largest eigenvalue from the token-diagonal matrix's largest
    eigenvalue ``search``, the Rayleigh quotient ``quotient`` of the matrix with all of ``C`` at its Ritz vector
    ``v``, and ``halves = (q_a, q_b, <r_a, r_b>)``: the quotients at ``v`` with each half of the samples and the inner
    product of their residuals ``r = M v - q v`` (None: fewer than 2 samples, no uncertainty).

    The estimate is ``quotient``. Its uncertainty adds three parts, relative to ``|estimate|``: the half-difference
    of the halves' quotients (the sampling noise of the mean); ``|quotient - search|``, the between-token part,
    which is added to first order only (at the token-diagonal Ritz vector, which that part also turns); and
    ``sqrt(max(<r_a, r_b>, 0))``, the residual of the *expected* matrix at ``v`` (the halves' noises are
    independent, so ``<r_a, r_b>`` estimates ``|(E M - q) v|^2`` without their noise): how far ``v`` is from an
    eigenvector, which bounds how far ``quotient`` can be from an eigenvalue.

    Args:
        search, quotient: ``(H,)`` the values per head.
        halves: ``(H,)`` each, or None.
        psd: The matrix is positive semi-definite (the Gauss-Newton block): the estimate is at least 0.

    Example:
        >>> one = torch.tensor([1.0])
        >>> est, spread = estimate(one, 1.2 * one, (1.1 * one, 1.3 * one, 0.0025 * one))
        >>> round(float(est), 6), round(float(spread), 3)
        (1.2, 0.292)
    """
    est = quotient.clamp_min(0) if psd else quotient
    if halves is None:
        return est, None
    q_a, q_b, rr = halves
    width = (q_a - q_b).abs() / 2 + (quotient - search).abs() + rr.clamp_min(0).sqrt()
    return est, width / est.abs()  # inf or nan where the estimate is 0 (the caller logs none)
