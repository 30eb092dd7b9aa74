"""Curvature of the real training loss: Monte-Carlo output gradients, optimizer thresholds, stability ratios.

The closed forms' ``outer/...`` keys use a stand-in output curvature. This module supplies what the real one
needs, as pure functions (the capture and the callback call them; no ``Trainer`` here):

* **Sampled output gradients.** For a loss ``l = sum_n w_n ell(z_n, y_n)`` over the rows ``z_n`` of the logits,
  the Gauss-Newton matrix at the logits is ``sum_n w_n H_n`` with ``H_n = diag(p_n) - p_n p_n^T`` (softmax
  cross-entropy, ``p_n = softmax(z_n)``) or ``2 I`` (squared error). A sampled gradient ``r = sqrt(w) (p - e_y)``
  with ``y ~ Categorical(p)`` (cross-entropy) or ``r = sqrt(2 w) eps`` with ``eps ~ N(0, I)`` (squared error) has
  ``E[r r^T] = w H``, rows independent (the Monte-Carlo Fisher of K-FAC and BackPACK). Back-propagated to a block
  output (:meth:`curvwatch.capture.Capture.sample_outputs`) each sample ``s_j`` gives ``E[s s^T]`` = the
  Gauss-Newton matrix of the real loss at that output, which the kernels turn into ``ggn/...`` and
  ``sharpness/...`` keys (``output_samples``).
* **Loss weights** ``w_n``, read from the real loss's gradient at the logits (:func:`loss_weights`), so the mean
  over tokens, ignored labels (``ignore_index``), a sum, per-token weights, gradient accumulation and AMP scaling
  need no configuration.
* **Stability thresholds** of the optimizer that updates a block (:func:`stability_rule`): gradient descent with
  heavy-ball momentum ``beta`` is stable on a quadratic while ``lambda_max < (2 + 2 beta) / lr``; Adam/AdamW
  (preconditioned by ``P = diag(sqrt(v_hat) + eps)``) while ``lambda_max(P^-1 H) < (2 + 2 beta_1) / ((1 - beta_1)
  lr)`` (38/lr at ``beta_1 = 0.9``; Cohen et al. 2021, 2022). The ratio sharpness / threshold is the block's
  ``stability/...`` key: ``>= 1`` means past the edge of stability.

Example:
    >>> z = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]], requires_grad=True)
    >>> loss = torch.nn.functional.cross_entropy(z, torch.tensor([0, 2]))
    >>> g, = torch.autograd.grad(loss, z)
    >>> w, kind, note = loss_weights(z.detach(), g, "auto")
    >>> kind.value, [round(float(v), 6) for v in w], note
    ('cross_entropy', [0.5, 0.5], None)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = [
    "LOGITS_NAMES",
    "InputDraws",
    "LinearLogits",
    "LogitSampler",
    "LossKind",
    "StabilityRule",
    "find_logits_module",
    "loss_weights",
    "param_index_map",
    "param_positions",
    "soft_divisor",
    "stability_keys",
    "unresolved_keys",
    "stability_rule",
    "total_weight",
]

#: Module names tried, in this order, for the module whose output is the logits (``logits_module=None``).
LOGITS_NAMES = ("lm_head", "head", "classifier", "output", "score", "fc_out", "decoder")

#: Weight arguments of the kernels that a preconditioner can be read for (see :func:`param_index_map`); a dotted name
#: is an entry of a dict argument (``"qk_norm.weight_q"``: the attention's QK-norm parameters, blocks ``N1``, ``N2``).
PRECONDITIONED = (
    "W_Q", "W_K", "W_V", "W_1", "W_2", "W_gate", "W_up", "W_down",
    "qk_norm.weight_q", "qk_norm.bias_q", "qk_norm.weight_k", "qk_norm.bias_k",
)  # fmt: skip


def _read_weight(read: Mapping[str, Any], name: str) -> Any:
    """``read[name]``, or ``read["qk_norm"]["weight_q"]`` for a dotted ``name`` (None where absent)."""
    outer, _, inner = name.partition(".")
    value = read.get(outer)
    if inner:
        value = value.get(inner) if isinstance(value, Mapping) else None
    return value


#: Why an Adam block has no ratio on the optimizer's first step (expected: not warned about).
NO_STATE_YET = "the optimizer has no second-moment state yet (before its first step)"

# A cross-entropy gradient row g = w (p - t) sums to zero; rows summing to more than this fraction of their
# absolute sum are not cross-entropy ones (float32 round-off is ~1e-7; bfloat16 logits ~1e-3).
_CE_ROW_SUM = 1e-2
# Elements per chunk of rows of the (rows, vocabulary) float64 temporaries of loss_weights and LogitSampler: 2^20
# (8 MiB each; a chunk holds about four at once, ~31 MiB measured, whatever the batch, the kept tokens or the
# vocabulary). Each chunk costs ~43 dispatched operators (a kernel launch each on a GPU; ~90 per chunk of 2^19 before
# session 23): at 512 kept tokens and a 50K vocabulary, 26 chunks.
_CHUNK = 2**20


def _row_chunks(n: int, width: int) -> range:
    """Starts of the chunks of rows of an ``(n, width)`` table, ``_CHUNK`` elements (at least one row) each."""
    return range(0, n, _chunk_rows(width))


def _chunk_rows(width: int) -> int:
    """Rows per chunk of a table ``width`` wide (:data:`_CHUNK` elements, at least one row)."""
    return max(1, _CHUNK // max(1, width))


# Hard-label fit: per-row weights are used when the gradient equals w_n (p_n - e_y) to this relative residual.
_HARD_FIT = 1e-2


class LinearLogits:
    """The logits ``z = h W^T + b`` of a linear logits module as ``(N, V)`` rows computed on demand: no ``(N, V)``
    tensor is held, each chunk of rows is recomputed from ``h`` when read. :func:`loss_weights` and
    :class:`LogitSampler` take it where they take logits (they read ``shape``, ``device``, ``detach()``,
    ``reshape(-1, V)`` and row slices only).

    Args:
        h: ``(N, d)`` the module's input rows (detached).
        weight: ``(V, d)``; bias: ``(V,)`` or ``None``.
        dtype: Compute in it (the logits' dtype: under autocast the module ran in bfloat16 or float16, and the loss
            read those logits); ``None``: ``h``'s.

    Example:
        >>> lin = nn.Linear(3, 5)
        >>> h = torch.randn(4, 3)
        >>> z = LinearLogits(h, lin.weight, lin.bias)
        >>> tuple(z.shape), torch.allclose(z[1:3], lin(h)[1:3])
        ((4, 5), True)
    """

    def __init__(self, h: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or h.dtype
        self.h, self.weight = h.detach().to(dtype), weight.detach().to(dtype)
        self.bias = None if bias is None else bias.detach().to(dtype)
        self.shape = torch.Size((h.shape[0], weight.shape[0]))
        self.device = h.device

    def detach(self) -> LinearLogits:
        return self

    def reshape(self, *shape: int) -> LinearLogits:
        if tuple(shape) not in ((-1, self.shape[1]), tuple(self.shape)):
            raise ValueError(f"LinearLogits are (N, V) rows: reshape(-1, V) only, not {shape}")
        return self

    def __getitem__(self, rows: slice) -> Tensor:
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            return torch.nn.functional.linear(self.h[rows], self.weight, self.bias)

    def entries(self, start: int, stop: int, cols: Tensor) -> Tensor:
        """``z[n, cols[n, j]]`` of the rows ``start:stop`` (``cols`` ``(rows, j)``): ``(rows, j)`` dot products of the
        input rows with the weight's rows ``cols`` (and the bias), no ``(rows, V)`` logits; a chunk of rows at a time
        (``_CHUNK`` elements of the ``(rows, j, d)`` weight rows gathered)."""
        step = max(1, _CHUNK // (cols.shape[-1] * self.h.shape[-1]))
        parts = []
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            for i in range(0, max(1, stop - start), step):
                c = cols[i : i + step]
                out = torch.einsum("nd,njd->nj", self.h[start + i : min(start + i + step, stop)], self.weight[c])
                parts.append(out if self.bias is None else out + self.bias[c])
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class LossKind(str, Enum):
    """The training loss at the logits, for the Monte-Carlo Gauss-Newton matrix."""

    AUTO = "auto"  # cross-entropy when the gradient rows sum to zero, else an error naming the options
    CROSS_ENTROPY = "cross_entropy"
    MSE = "mse"  # mean squared error over every element of the output
    # softmax cross-entropy (or KL divergence) with soft targets of any form (distillation, mixup), whose per-row
    # weight the gradient cannot tell: the user names the reduction
    SOFT_MEAN = "soft_mean"  # divided by the rows of the logits (cross_entropy with probabilities, mean)
    SOFT_BATCHMEAN = "soft_batchmean"  # divided by the logits' first dimension (kl_div(..., "batchmean"))
    SOFT_SUM = "soft_sum"  # summed over the rows


#: The soft-target kinds: cross-entropy's curvature with a per-row weight named by the user.
SOFT = (LossKind.SOFT_MEAN, LossKind.SOFT_BATCHMEAN, LossKind.SOFT_SUM)


def soft_divisor(kind: LossKind, shape: tuple[int, ...]) -> int:
    """What a soft-target loss of ``kind`` over logits of ``shape`` ``(..., V)`` is divided by (1: a sum).

    Example:
        >>> [soft_divisor(k, (4, 128, 50)) for k in SOFT]
        [512, 4, 1]
    """
    if kind is LossKind.SOFT_MEAN:
        return max(1, math.prod(shape[:-1]))
    if kind is LossKind.SOFT_BATCHMEAN:
        return max(1, shape[0]) if len(shape) > 1 else 1
    return 1


def find_logits_module(model: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """``(name, module)`` of the module whose output is the logits the loss reads.

    Args:
        model: The LightningModule (or any module).
        name: A dotted module name (``"lm_head"``, ``"model.classifier"``); ``None``: the first of
            :data:`LOGITS_NAMES` found, searched as a suffix of every module's name, the shortest name first.

    Raises:
        ValueError: If no module matches, with the names tried and how to pass ``logits_module``.

    Example:
        >>> net = nn.Sequential()
        >>> net.add_module("body", nn.Linear(4, 4)); net.add_module("lm_head", nn.Linear(4, 9))
        >>> find_logits_module(net)[0]
        'lm_head'
    """
    modules = dict(model.named_modules())
    if name is not None:
        if name not in modules:
            close = [n for n in modules if n.endswith(name.split(".")[-1])][:5]
            raise ValueError(
                f"Invalid logits_module={name!r}: the model has no such module"
                + (f" (similar names: {close})" if close else "")
                + f". Modules whose output looks like logits: {logits_candidates(model)}. Pass the dotted name of "
                "the module whose output is the logits, as in model.named_modules()."
            )
        return name, modules[name]
    for candidate in LOGITS_NAMES:
        hits = sorted((n for n in modules if n == candidate or n.endswith("." + candidate)), key=len)
        if hits:
            return hits[0], modules[hits[0]]
    raise ValueError(
        f"Cannot find the module whose output is the logits (tried the names {list(LOGITS_NAMES)}). Modules whose "
        f"output looks like logits: {logits_candidates(model)}. Pass "
        "sharpness=curvwatch.Sharpness(logits_module='<dotted name>'), or sharpness=False to leave the real-loss "
        "curvature out."
    )


def logits_candidates(model: nn.Module, top: int = 3) -> list[str]:
    """Names of the ``nn.Linear`` modules whose output looks like logits: first those outside the repeated layers
    (no numbered part in their name, as ``layers.3.mlp``), then the widest, then the last in the model.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 50))
        >>> logits_candidates(net)
        ['1', '0']
    """
    linears = [
        (not any(part.isdigit() for part in n.split(".")[:-1]), m.out_features, i, n)
        for i, (n, m) in enumerate(model.named_modules())
        if isinstance(m, nn.Linear) and n
    ]
    return [t[-1] for t in sorted(linears, reverse=True)[:top]]


def _hard_label_pass(z_all: Tensor, g_all: Tensor, w: Tensor, active: Tensor, per_chunk: bool, on_chunk):
    """One pass of :func:`loss_weights` over ``(N, V)`` logits and gradient rows, a chunk at a time (float64
    temporaries of one chunk: memory bounded by ``_CHUNK``): writes the hard-label weights into ``w`` and the rows
    with a gradient into ``active`` ``(N,)``, calls ``on_chunk(start, p)``, and returns the device tensors ``(residual
    of the hard-label fit squared, gradient norm squared, any decisive row, any chunk whose decisive rows do not sum to
    zero)`` and whether a chunk was read as cross-entropy plus a term in logsumexp. With ``per_chunk`` each chunk whose
    rows do not sum to zero is read that way (a host read per chunk); else every chunk as hard labels (no host read).

    A chunk only reduces its rows to seven numbers each (:func:`_row_stats`); the weights and the fit's residual are
    computed from them for all rows at once after the loop (:func:`_fit_rows`): a chunk costs ~20 dispatched operators
    (it was ~57 with the per-row arithmetic in the loop: 52 chunks at 512 kept tokens and a 50K vocabulary), and no
    residual table is made."""
    N, V = g_all.shape
    stats = torch.empty((N, 7), dtype=torch.float64, device=g_all.device)
    lse_rows = None  # rows read as cross-entropy plus a term in logsumexp (per_chunk), else hard labels everywhere
    lse_term = False
    step = _chunk_rows(V)
    for i in _row_chunks(N, V):
        p = torch.softmax(z_all[i : i + step], -1, dtype=torch.float64)  # float64: 1 - p_y of confident rows
        g = g_all[i : i + step]
        y = g.argmin(-1, keepdim=True)  # the hard label: the only negative entry
        row = _row_stats(p, g, y)
        if per_chunk:
            fit = _fit_rows(row, None)
            if bool(fit.off_label.any()):
                # a term f(logsumexp z) adds f' p to the gradient: the label is where g falls short of s p
                lse_term = True
                y = _lse_term_labels(p, g.double(), fit.active)[0][:, None]
                lse_rows = torch.zeros(N, dtype=torch.bool, device=g.device) if lse_rows is None else lse_rows
                lse_rows[i : i + step] = True
                row = _row_stats(p, g, y)
        stats[i : i + step] = row
        if on_chunk is not None:
            on_chunk(i, p)
        del p, g, row
    fit = _fit_rows(stats, lse_rows)
    w.copy_(fit.w)
    active.copy_(fit.active)
    keep = fit.decisive.to(stats.dtype)
    return torch.dot(fit.resid2, keep), torch.dot(fit.norm2, keep), fit.decisive.any(), fit.off_label.any(), lse_term


def _row_stats(p: Tensor, g: Tensor, y: Tensor) -> Tensor:
    """``(rows, 7)`` float64 per row of a chunk: ``g_y``, ``p_y``, ``sum g``, ``sum |g|``, ``||g||``, ``<g, p>``,
    ``||p||``, for float64 probabilities ``p``, gradient rows ``g`` (any float dtype: each reduction converts it to
    float64 itself, a transient chunk-sized buffer at most; no copy is held) and labels ``y`` ``(rows, 1)``: what
    :func:`_fit_rows` needs of the ``(rows, V)`` tables."""
    f64 = torch.float64
    return torch.cat(
        [
            g.gather(1, y).to(f64),
            p.gather(1, y),
            torch.sum(g, -1, keepdim=True, dtype=f64),
            torch.linalg.vector_norm(g, 1, -1, keepdim=True, dtype=f64),
            torch.linalg.vector_norm(g, 2, -1, keepdim=True, dtype=f64),
            (g * p).sum(-1, keepdim=True),
            torch.linalg.vector_norm(p, 2, -1, keepdim=True),
        ],
        1,
    )


class _Fit(NamedTuple):
    """:func:`_fit_rows`' per-row results, ``(N,)`` each."""

    w: Tensor  # the weight, float32
    active: Tensor  # a gradient at all
    resid2: Tensor  # the fit's squared residual
    norm2: Tensor  # ||g||^2
    decisive: Tensor  # :func:`_label_mass`
    off_label: Tensor  # a decisive row that does not sum to zero (no cross-entropy's alone)


def _label_mass(p_y: Tensor, g_abs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(active, 1 - p_y, decisive)`` per row from the label's probability and ``sum |g|``: the rows with a gradient,
    and those with enough mass off the label (``1 - p_y > 1e-3``) to decide the hard-label fit and whether the rows sum
    to zero (in a confident row the autograd gradient rounds ``p_y - 1``, to 0 where ``p_y`` rounds to 1, and its sum
    says nothing)."""
    act = g_abs > 0
    rest = (1 - p_y).clamp_min(0)
    return act, rest, act & (rest > 1e-3)


def _fit_rows(stats: Tensor, lse_rows: Tensor | None) -> _Fit:
    """The hard-label fit ``g = w (p - e_y)`` of every row (:class:`_Fit`; rows in
    ``lse_rows``: of ``g = s p - w e_y``, the label's entry free) from :func:`_row_stats`' columns, for all rows at
    once. With ``S = sum_{c != y} g_c`` and ``1 - p_y``, ``w = S / (1 - p_y)`` (the entries off the label are ``w p_c``,
    accurate where ``p_y`` rounds); the residual ``||g - w (p - e_y)||^2 = ||g||^2 - 2 w (<g, p> - g_y) + w^2 (||p||^2
    - 2 p_y + 1)`` from the row's reductions (float64: its cancellation is ~1e-16 of ``||g||^2``, the fit's test is
    at 1e-4 of it). The decisive rows decide the fit (:func:`_label_mass`)."""
    g_y, p_y, g_sum, g_abs, g_norm, gp, p_norm = stats.unbind(1)
    act, rest, decisive = _label_mass(p_y, g_abs)
    w = torch.where(act & (rest > 0), (g_sum - g_y) / rest.clamp_min(1e-300), 0.0)
    gn2, pn2 = g_norm.square(), p_norm.square()
    resid2 = gn2 - 2 * w * (gp - g_y) + w.square() * (pn2 - 2 * p_y + 1)
    if lse_rows is not None:  # off the label as above; the label's entry is min(w p_y - g_y, 0) (above s p_y: no CE's)
        short = (w * p_y - g_y).clamp_max(0)
        lse = gn2 - 2 * w * gp + w.square() * pn2 - (g_y - w * p_y).square() + short.square()
        resid2 = torch.where(lse_rows, lse, resid2)
    off_label = (g_sum.abs() > _CE_ROW_SUM * g_abs) & decisive
    return _Fit(w.float(), act, resid2.clamp_min(0), gn2, decisive, off_label)


def loss_weights(
    logits: Tensor,
    grad: Tensor,
    kind: str | LossKind = "auto",
    count: int | Callable[[], int] | None = None,
    on_chunk: Callable[[int, Tensor], None] | None = None,
) -> tuple[Tensor, LossKind, str | None]:
    """Per-row weights ``w_n`` of the loss ``l = sum_n w_n ell(z_n)``, read from its gradient at the logits.

    Cross-entropy: ``grad_n = w_n (p_n - t_n)`` with ``t_n`` the target distribution. With hard targets
    (``t_n = e_y``, found as the most negative entry) ``w_n = -grad_{n,y} / (1 - p_{n,y})`` exactly, for any
    reduction, ignored rows (``w_n = 0``) and per-token weights. Label smoothing (``t_n = (1 - eps) e_y + eps/V``,
    recognised as ``grad_{n,c}`` affine in ``p_{n,c}`` off the label): the weight of a mean over the rows with a
    non-zero gradient is used (PyTorch's ``mean`` reduction), and ``note`` says so. Other soft targets (a
    distillation KL divergence, mixup) cannot be told apart from a different weight (``kl_div(..., "batchmean")`` of
    ``(B, L, V)`` logits divides by ``B``, not by the ``B L`` tokens): an error, unless ``kind`` names the reduction
    (``"soft_mean"``, ``"soft_batchmean"``, ``"soft_sum"``: ``w_n`` = 1 over :func:`soft_divisor`). Squared error:
    ``grad = 2 w (z - y)`` cannot tell ``w`` from the residual, so the mean over every element is assumed
    (``w_n = 1/numel``).

    Args:
        logits: ``(..., V)`` the loss's input; rows are all leading dimensions (or :class:`LinearLogits`).
        grad: ``(..., V)`` the gradient of the loss (as back-propagated: Lightning's accumulation and AMP factors
            included; the caller multiplies the weights by its factor).
        kind: ``"auto"`` (cross-entropy if every gradient row sums to zero, else an error), ``"cross_entropy"``,
            ``"mse"``, or a soft-target reduction: ``"soft_mean"``, ``"soft_batchmean"``, ``"soft_sum"``.
        count: What an assumed mean runs over when these rows are part of a larger batch: the rows with a gradient
            (label smoothing) or the elements (squared error) of the whole batch, or the whole batch's
            :func:`soft_divisor` (soft kinds); ``None``: those of ``logits``. A callable (label smoothing: counted only
            when needed) is called once, where the mean is assumed.
        on_chunk: Called as ``on_chunk(start, p)`` with the float64 softmax of each chunk of rows (cross-entropy
            kinds, where the weights are read from the rows; not for ``"mse"`` and the soft kinds), e.g.
            :meth:`InputDraws.chunk`: one pass over the logits for both.

    Returns:
        ``(w, kind, note)``: ``w`` ``(N,)`` float32 (``N`` = rows), the loss kind used, and a note for the user
        (``None`` when nothing was assumed).

    Raises:
        ValueError: If ``kind`` is invalid, shapes differ, or ``"auto"``/``"cross_entropy"`` meets a gradient
            that is not a softmax cross-entropy's, or one with soft targets other than label smoothing (the message
            names the fix).
    """
    kind = LossKind(kind) if not isinstance(kind, LossKind) else kind
    if tuple(logits.shape) != tuple(grad.shape):
        raise ValueError(f"logits {tuple(logits.shape)} and their gradient {tuple(grad.shape)} differ in shape.")
    V = logits.shape[-1]
    z_all, g_all = logits.detach().reshape(-1, V), grad.detach().reshape(-1, V)  # views where contiguous
    N = z_all.shape[0]
    if kind is LossKind.MSE:
        n = N * V if count is None else count
        return (
            torch.full((N,), 1.0 / n, device=g_all.device),
            kind,
            "squared error: assumed the mean over every element",
        )
    if kind in SOFT:
        n = soft_divisor(kind, tuple(logits.shape)) if count is None else count
        return torch.full((N,), 1.0 / n, device=g_all.device), kind, None
    if V < 2 and N:
        raise ValueError(_NOT_CE.format(", and the logits have one column"))
    w = torch.zeros(N, device=g_all.device)
    active = torch.zeros(N, dtype=torch.bool, device=g_all.device)
    # every chunk read as hard labels, and whether some chunk's rows do not sum to zero, in one host read at the end
    # (a read per chunk was 52 syncs per evaluation at 512 kept tokens and a 50K vocabulary)
    resid2, norm2, decisive_any, flagged, _ = _hard_label_pass(z_all, g_all, w, active, False, on_chunk)
    fit, decisive_any, flagged = torch.stack(
        [resid2.sqrt() <= _HARD_FIT * norm2.sqrt(), decisive_any, flagged]
    ).tolist()
    lse_term = False  # rows that do not sum to zero, read as cross-entropy plus a term in logsumexp (z-loss)
    if flagged:  # (rare: a z-loss) the rows again, each chunk read as its rows need (a host read per chunk)
        resid2, norm2, decisive_any, _, lse_term = _hard_label_pass(z_all, g_all, w, active, True, None)
        fit, decisive_any = bool(resid2.sqrt() <= _HARD_FIT * norm2.sqrt()), bool(decisive_any)
    fits = fit or not decisive_any
    if lse_term and not fits:
        raise ValueError(_NOT_CE.format(""))
    if fits:
        return w, LossKind.CROSS_ENTROPY, LSE_TERM_NOTE if lse_term else None
    # not hard labels: a second pass over the rows tells a scaling of the logits from soft targets (only here: the
    # hard-label case, the usual one, does not pay for these fits)
    slope = None  # of log g_c in z_c off the label, in the first chunk with hard-label rows (1: softmax of z)
    smooth2 = off2 = torch.zeros((), dtype=torch.float64, device=g_all.device)  # the label-smoothing fit's
    for i in _row_chunks(N, V):
        z, g = z_all[i : i + _chunk_rows(V)].double(), g_all[i : i + _chunk_rows(V)].float().double()
        p, y, _, _, decisive, _ = _ce_rows(z, g)
        if slope is None:
            slope = _logit_scale(z[decisive], g[decisive], y[decisive])
        # label smoothing, g = w (p - (1 - eps) e_y - eps/V): the label is the most negative entry, or, in a row
        # predicting it with p_y > 1 - eps (where g_y > 0), the most probable class; the better fit of the two
        pd, gd = p[decisive], g[decisive]
        fits = []
        for label in (y[decisive], pd.argmax(-1)):
            r2 = _affine_residual(pd, gd, label).square().sum(-1)
            fits.append((r2, gd.square().sum(-1) - gd.gather(1, label[:, None])[:, 0].square()))
        better = fits[1][0] < fits[0][0]
        smooth2 = smooth2 + torch.where(better, fits[1][0], fits[0][0]).sum()
        off2 = off2 + torch.where(better, fits[1][1], fits[0][1]).sum()
        del z, g, p, pd, gd, fits
    if slope is not None and abs(slope - 1) > 10 * _HARD_FIT:
        raise ValueError(
            f"The loss's gradient at the logits is a hard-label cross-entropy's, but of softmax({slope:.3g} z), not "
            "of softmax(z) of the module found: the logits are scaled after it (a temperature, z / T, a soft-capping), "
            "which changes the loss's curvature. Pass sharpness=curvwatch.Sharpness(logits_module='<name>') of the "
            "module whose output the loss reads as it is (apply the scaling inside it), or sharpness=False; loss= "
            "cannot describe it."
        )
    if bool(smooth2.sqrt() > _HARD_FIT * off2.sqrt()):
        raise ValueError(
            "The loss's gradient at the logits is a softmax cross-entropy's (or KL divergence's) with soft targets "
            "(distillation, mixup), whose weight per token it cannot tell: kl_div(..., reduction='batchmean') of "
            "(B, L, V) logits divides by B, a mean by the B L tokens. Name the reduction: loss='soft_batchmean' "
            "(divided by the logits' first dimension: kl_div 'batchmean' of the logits as the module outputs them), "
            "loss='soft_mean' (divided by the rows of the logits: cross_entropy with probability targets, or "
            "kl_div 'batchmean' of (tokens, V) logits) or loss='soft_sum'; or sharpness=False."
        )
    n_active = int(active.sum()) if count is None else count() if callable(count) else count
    w = active.float() / max(n_active, 1)
    return (
        w,
        LossKind.CROSS_ENTROPY,
        (
            f"soft targets of the label-smoothing form: assumed a mean over the {n_active} rows with a gradient "
            "(PyTorch's 'mean'; pass loss='soft_sum' for a sum, loss='soft_batchmean' for a division by the "
            "logits' first dimension)"
        ),
    )


#: The error of a gradient at the logits that no cross-entropy (with or without a term in logsumexp) explains.
_NOT_CE = (
    "The loss's gradient at the logits is not a softmax cross-entropy's (its rows do not sum to zero, and the entries "
    "off the label are not proportional to the softmax, as a z-loss term would leave them{}). Pass "
    "sharpness=curvwatch.Sharpness(loss='mse') for a squared error, Sharpness(logits_module='<name>') if the module "
    "found is not the one the loss reads (a final soft-capping or scaling after it changes the loss's curvature), or "
    "sharpness=False."
)

#: :func:`loss_weights`' note when the rows are a cross-entropy's plus a term in ``logsumexp(z)`` (a z-loss).
LSE_TERM_NOTE = (
    "the loss's gradient at the logits is a cross-entropy's plus a term in logsumexp (a z-loss): its weights include "
    "that term's first-order part (f'(lse) (diag p - p p^T)); its rank-one part f''(lse) p p^T is left out"
)


def _lse_term_labels(p: Tensor, g: Tensor, act: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, 1 - p_y, decisive)`` of rows ``g = s p - w e_y`` (a cross-entropy of weight ``w`` plus a term
    ``f(logsumexp z)``, whose gradient is ``f' p``: ``s = w + f'``), where the label's entry may be positive (a
    confident row, ``p_y > w / s``) and the most negative entry then is not the label. Off the label ``g_c / p_c = s``,
    at the label it is ``s - w / p_y``, less: so ``s`` is the largest ratio (over entries above float32's range of
    round-off, ``1e-30``) and the label is the entry furthest below ``s p``.

    Example:
        >>> p = torch.softmax(torch.tensor([[4.0, 0.0, -1.0]], dtype=torch.float64), -1)  # p_0 = 0.976
        >>> g = 1.1 * p - torch.tensor([[1.0, 0, 0]], dtype=torch.float64)  # w = 1, f' = 0.1: g_0 > 0
        >>> int(g.argmin()), int(_lse_term_labels(p, g, torch.tensor([True]))[0])
        (2, 0)
    """
    usable = (p > 1e-30) & (g > 1e-30)
    s = torch.where(usable, g / p.clamp_min(1e-300), torch.zeros_like(g)).amax(-1, keepdim=True)
    y = (s * p - g).argmax(-1)
    rest = (1 - p.gather(1, y[:, None])[:, 0]).clamp_min(0)
    return y, rest, act & (rest > 1e-3)


def _ce_rows(z: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(p, y, 1 - p_y, active, decisive, |g| row sums)`` of a chunk of float64 logits and gradient rows
    (:func:`loss_weights`' soft-target fits): the softmax, the hard label (the only negative entry) and
    :func:`_label_mass`."""
    absum = g.abs().sum(-1)
    p = torch.softmax(z, -1)  # float64: 1 - p_y of confident rows
    y = g.argmin(-1)
    act, rest, decisive = _label_mass(p.gather(1, y[:, None])[:, 0], absum)
    return p, y, rest, act, decisive, absum


def _affine_residual(p: Tensor, g: Tensor, y: Tensor) -> Tensor:
    """The residual, off the label ``y``, of the per-row least-squares fit ``g_c = a p_c + b`` (label smoothing:
    ``g = w (p - (1 - eps) e_y - eps/V)``, so ``a = w``, ``b = -w eps/V``; a hard label has ``b = 0``). ``(rows, V)``,
    zero at the label.

    Example:
        >>> p = torch.softmax(torch.tensor([[2.0, 0.0, -1.0, 0.5]], dtype=torch.float64), -1)
        >>> t = 0.9 * torch.nn.functional.one_hot(torch.tensor([1]), 4) + 0.1 / 4
        >>> float(_affine_residual(p, 0.5 * (p - t), torch.tensor([1])).abs().max()) < 1e-15
        True
    """
    off = torch.ones_like(p, dtype=torch.bool).scatter_(1, y[:, None], False)
    n = max(p.shape[-1] - 1, 1)
    x = torch.where(off, p - (p * off).sum(-1, keepdim=True) / n, 0)
    t = torch.where(off, g - (g * off).sum(-1, keepdim=True) / n, 0)
    a = (x * t).sum(-1, keepdim=True) / x.square().sum(-1, keepdim=True).clamp_min(1e-300)
    return t - a * x


def total_weight(logits: Tensor, grad: Tensor) -> float:
    """``sum_n w_n`` of a hard-label cross-entropy's rows (:func:`loss_weights` found hard labels on some of them),
    from the gradient and **two logits per row**, not the whole rows: with ``y`` the label (the only negative entry of
    ``g_n``), ``S = sum_{c != y} g_c = w (1 - p_y) = -g_y`` (a cross-entropy row sums to zero) and ``c`` the largest
    entry off the label (``g_c = w p_c``), ``p_y / p_c = exp(z_y - z_c)`` gives ``w = -g_y + g_c exp(z_y - z_c)``
    (both terms non-negative: no cancellation). Autograd's ``g_y = w (p_y - 1)`` from a float32 ``p_y`` is within
    ``6e-8 w`` of the truth, so ``w`` is too, whatever ``p_y`` (a confident row's ``w`` is its second term); bfloat16
    gradients round ``g_y`` to 0.4%, which averages out over rows of different ``p_y`` but not where every row has
    ``p_y`` near 0 (an untrained model: 0.2% on the total of 7,680 such rows, measured). Four entries per row and no
    reduction over the vocabulary: all rows at once in any dtype, with no ``(rows, V)`` temporary (the sum of the
    entries off the label, before, took a float32 copy of bfloat16 rows, in chunks: ~5,000 dispatched operators for
    7,680 rows, about the 7,168 a batch of 8 x 1024 leaves outside its kept sequence; its float32 sum was 3e-5 off
    where this is 3e-8). A linear logits module's two logits are two dot products of its input
    (:class:`LinearLogits`), so this costs ``O(rows d)`` instead of recomputing ``(rows, vocabulary)`` logits; rows
    without a gradient weigh 0.

    Example:
        >>> z = torch.randn(6, 5)
        >>> loss = nn.functional.cross_entropy(z.requires_grad_(), torch.arange(6) % 5, reduction="sum")
        >>> g, = torch.autograd.grad(loss, z)
        >>> round(total_weight(z.detach(), g), 4)
        6.0
    """
    V = grad.shape[-1]
    g_all = grad.detach().reshape(-1, V)
    z_all = logits.detach().reshape(-1, V)
    ends = torch.cat([g_all.argmin(-1, keepdim=True), g_all.argmax(-1, keepdim=True)], -1)  # y; the largest entry c
    gy, gc = g_all.gather(-1, ends).double().unbind(-1)
    zy, zc = _entries(z_all, 0, g_all.shape[0], ends).double().unbind(-1)
    odds = torch.where(gc > 0, gc * (zy - zc).exp(), 0.0)  # w p_y (0 when g has no mass off y)
    return float((odds - gy).sum())


def _entries(z: Tensor | LinearLogits, start: int, stop: int, cols: Tensor) -> Tensor:
    """``z[n, cols[n, j]]`` for the rows ``start:stop`` of ``(N, V)`` logits, ``(rows, j)`` in the logits' dtype: a
    gather, or for :class:`LinearLogits` the dot products of those rows of its input with the weight's rows ``cols``
    (``O(rows j d)``: no ``(rows, V)`` logits)."""
    if isinstance(z, LinearLogits):
        return z.entries(start, stop, cols)
    return z[start:stop].gather(-1, cols)


def _logit_scale(z: Tensor, g: Tensor, y: Tensor) -> float | None:
    """The scale ``s`` with ``g_c ∝ softmax(s z)_c`` off the label ``y`` in every row (a hard-label cross-entropy of
    logits scaled by ``s`` after ``z``), or ``None`` when the rows are not of that form (soft targets: some entry off
    the label is not positive, or ``log g_c`` is not linear in ``z_c`` to 1e-3) or there are none.

    Example:
        >>> z = torch.tensor([[2.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
        >>> g = torch.softmax(z / 4, -1) - torch.nn.functional.one_hot(torch.tensor([1]), 4)
        >>> round(_logit_scale(z, g, torch.tensor([1])), 6)
        0.25
    """
    if z.shape[0] == 0 or z.shape[-1] < 3:
        return None
    off = torch.ones_like(z, dtype=torch.bool).scatter_(1, y[:, None], False)
    gz = g[off].reshape(z.shape[0], -1)
    if not bool((gz > 0).all()):
        return None
    x, t = z[off].reshape(z.shape[0], -1), gz.log()
    x, t = x - x.mean(-1, keepdim=True), t - t.mean(-1, keepdim=True)
    var = x.square().sum()
    if float(var) == 0:
        return None
    slope = float((x * t).sum() / var)
    if float((t - slope * x).norm()) > 1e-3 * max(float(t.norm()), 1e-300):
        return None
    return slope


class LogitSampler:
    """Sampled gradients ``r`` at the logits with ``E[r r^T]`` = the loss's Gauss-Newton matrix at them.

    Softmax cross-entropy: row ``n``'s curvature ``w_n H_n``, ``H_n = diag(p_n) - p_n p_n^T = sum_c a_c a_c^T`` with
    ``a_c = sqrt(p_c) (e_c - p_n)``, is sampled one column at a time by *length-squared* importance sampling
    (``q_c ∝ ||a_c||^2``, Drineas, Kannan & Mahoney 2006) with a random sign: ``r_n = sigma sqrt(w_n) a_c /
    sqrt(q_c)``, ``sigma = ±1``. It is unbiased (``E[r_n r_n^T] = w_n H_n``; ``E[r_n] = 0``, so different rows are
    uncorrelated) and every draw of a row has the same norm ``sqrt(w_n tr H_n)``. Drawing the label from the
    model's own prediction (``q = p``, the textbook Monte-Carlo Fisher) is unbiased too, but for a confident model
    it almost always draws the predicted class, whose column is nearly zero, and rarely a class whose column is
    large: on the converged test models its estimate read ~0 most of the time and up to 14x too high otherwise
    (``benchmarks/results/sharpness.md``). Squared error: ``r_n = sqrt(2 w_n) sigma`` with Rademacher ``sigma``
    (``E[sigma sigma^T] = I``).

    Args:
        logits: ``(..., V)`` the rows to sample (the kept sequences' logits), or :class:`LinearLogits`.
        weights: ``(N,)`` their loss weights (:func:`loss_weights`, times the caller's factor).
        kind: ``LossKind.MSE``, or any other (cross-entropy's curvature: hard labels or soft targets).

    Example:
        >>> z, w = torch.tensor([[4.0, 0.0, 0.0]]), torch.ones(1)
        >>> r = LogitSampler(z, w, LossKind.CROSS_ENTROPY).draw(torch.Generator().manual_seed(0))
        >>> p = torch.softmax(z, -1)
        >>> bool(torch.isclose(r.square().sum(), (p - p.square()).sum()))  # ||r||^2 = w tr(H)
        True
    """

    def __init__(self, logits: Tensor, weights: Tensor, kind: LossKind, norms: bool = True) -> None:
        # soft targets have cross-entropy's curvature at the logits (their weights come from loss_weights)
        self.shape, self.kind = logits.shape, (LossKind.MSE if kind is LossKind.MSE else LossKind.CROSS_ENTROPY)
        kind = self.kind
        self.root = weights.clamp_min(0).sqrt()[:, None].float()  # (N, 1)
        # no (N, V) table is kept: each draw recomputes a chunk of rows at a time from the logits (a view of the
        # live ones), so the extra memory is that of one chunk (_CHUNK) whatever the rows and the vocabulary
        self.z = logits.detach().reshape(-1, logits.shape[-1])
        self._one: tuple[Tensor, ...] | None = None  # the tables, kept when they are one chunk (no more memory)
        self.norm: Tensor | None = None
        self.unit: float | None = None
        if kind is LossKind.CROSS_ENTROPY:
            starts = _row_chunks(*self.z.shape)
            if len(starts) == 1:
                self._one = self._tables(0)
                self._set_norms(self._one[3][:, 0].sqrt().float())  # (N,) sqrt(tr H)
            elif norms:  # only the norms (tr H_n = 1 - ||p_n||^2 = sum_c p_c (1 - p_c)), not every chunk's tables
                self._set_norms(torch.cat([self._trace(i) for i in starts]).sqrt().float())
            # else: input_draws reads them in its one pass over the tables
        else:
            self._set_norms(torch.full((self.z.shape[0],), math.sqrt(2.0 * self.z.shape[-1]), device=self.z.device))

    def _set_norms(self, root_trace: Tensor) -> None:
        self.norm = root_trace * self.root[:, 0]  # ||r_n|| of every draw
        self.unit = float(self.norm.max()) if self.norm.numel() else 0.0  # every entry of a draw is at most this

    def _trace(self, i: int) -> Tensor:
        """``tr H_n`` of the rows of the chunk starting at ``i``, float64 (:meth:`_tables`' sum of ``||a_c||^2``)."""
        p = torch.softmax(self.z[i : i + _chunk_rows(self.z.shape[-1])].double(), -1)
        return p.mul_(1 - p).sum(-1)

    def _tables(self, i: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:func:`_tables_of` the rows of the chunk starting at ``i``, float64."""
        return _tables_of(self._softmax(i))

    def _softmax(self, i: int) -> Tensor:
        """``p``, float64, of the rows of the chunk starting at ``i`` (as :func:`loss_weights` computes it)."""
        return torch.softmax(self.z[i : i + _chunk_rows(self.z.shape[-1])].double(), -1)

    def draw(self, generator: torch.Generator | None = None) -> Tensor:
        """One sample ``r``, float32, shaped like the logits (``unit``: the largest row norm of a draw, so every entry
        of a draw is at most it in magnitude)."""
        out = torch.empty(self.z.shape, device=self.z.device)
        return self.draw_into(out, generator).mul_(self.unit).reshape(self.shape)

    def draw_into(self, out: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One sample ``r / unit`` (:attr:`unit`: entries of magnitude at most 1, so low-precision logits do not
        underflow) written into ``out`` (``(N, V)`` or any view of that shape, in its own dtype), a chunk of rows at a
        time; returns ``out``. The random numbers are drawn for all rows at once (one sign and one uniform per row),
        so a draw does not depend on the chunking."""
        n, V = self.z.shape
        if not out.is_contiguous():  # e.g. the kept sequences of (L, B, V) logits: through a buffer
            out.copy_(
                self.draw_into(torch.empty((n, V), dtype=out.dtype, device=out.device), generator).view(out.shape)
            )
            return out
        flat = out.view(n, V)
        scale = self.root / max(self.unit, 1e-30)  # (N, 1)
        columns = V if self.kind is LossKind.MSE else 1  # one sign per element, or per row
        sign = torch.randint(0, 2, (n, columns), generator=generator, device=self.z.device).float().mul_(2).sub_(1)
        if self.kind is LossKind.MSE:
            flat.copy_(math.sqrt(2.0) * scale * sign)
            return out
        u = torch.rand((n, 1), generator=generator, device=self.z.device, dtype=torch.float64)
        for i in _row_chunks(n, V):
            rows = slice(i, i + _chunk_rows(V))
            p, cdf, sq, total = self._one if self._one is not None else self._tables(i)
            c = torch.searchsorted(cdf, u[rows] * cdf[:, -1:]).clamp_max(V - 1)  # (rows, 1): c ~ q
            r = -p
            r.scatter_add_(1, c, torch.ones_like(c, dtype=r.dtype))  # e_c - p
            flat[rows] = (r * (scale[rows] * sign[rows] * _coefs(sq, total, c))).to(out.dtype)
        return out

    def input_draws(
        self, weight: Tensor, samples: int, generator: torch.Generator | None = None, plan: InputDraws | None = None
    ) -> Iterator[Tensor]:
        """The draws of :meth:`draw_into` carried back through a linear logits module ``z = h W^T + b``: one
        ``(r / unit) W`` per sample, ``(N, d)`` in ``weight``'s dtype, the cotangents at its input ``h`` (kept rows).

        The same random numbers in the same order as ``samples`` calls of :meth:`draw_into`, so the same draws; but no
        ``(N, V)`` draw exists: a cross-entropy draw of row ``n`` is ``f (e_c - p_n)``, whose product with ``W`` is
        ``f (W_c - p_n W)``. The tables are built once per chunk of rows for all samples (not once per draw), and
        ``p W`` once, in one pass made before this returns (it also sets :attr:`unit` of a sampler built with
        ``norms=False``); the extra memory is one chunk of tables and ``(N, d)`` tensors, whatever the vocabulary.
        Squared error draws each ``(N, V)`` sign table and multiplies it by ``W``.

        Args:
            weight: ``(V, d)`` the logits module's weight.
            samples: Draws.
            generator: Random source (as for :meth:`draw_into`).
            plan: Its random numbers and the chunks already read (:class:`InputDraws`, made with the same ``weight``,
                ``samples`` and ``generator`` before any other use of it; handed to :func:`loss_weights` as
                ``on_chunk``); ``generator`` is then not used.
        """
        n, V = self.z.shape
        if self.kind is LossKind.MSE:
            buf = torch.empty((n, V), dtype=weight.dtype, device=weight.device)
            return (self.draw_into(buf, generator) @ weight for _ in range(samples))
        if plan is None:
            plan = InputDraws(n, V, weight, samples, generator)
        for i in _row_chunks(n, V):  # the chunks the plan was not handed (all of them, unless by loss_weights)
            if i not in plan.traces:
                plan.chunk(i, self._one[0] if self._one is not None else self._softmax(i))
        if self.unit is None:
            self._set_norms(torch.cat([plan.traces[i] for i in _row_chunks(n, V)]).sqrt().float())
        return plan.draws(self.root / max(self.unit, 1e-30))


class InputDraws:
    """The random numbers and per-chunk tables of :meth:`LogitSampler.input_draws` (cross-entropy), apart from the
    sampler: its random numbers are drawn at once, in :meth:`LogitSampler.draw_into`'s order (a sign, then a uniform,
    per draw), and each chunk of rows is read once, from its softmax :meth:`chunk`, which :func:`loss_weights` can
    hand over from its own pass over the same rows (``on_chunk``): then the logits of the kept rows are computed once
    for the weights and the draws, not twice. The tables do not depend on the loss weights, which scale the draws
    only at the end (:meth:`draws`).

    Args:
        n, V: the rows and the vocabulary.
        weight: ``(V, d)`` the linear logits module's weight.
        samples: Draws.
        generator: Random source.
    """

    def __init__(self, n: int, V: int, weight: Tensor, samples: int, generator: torch.Generator | None) -> None:
        device = weight.device
        signs, uniforms = [], []
        for _ in range(samples):  # the order of draw_into's numbers: a sign, then a uniform, per draw
            signs.append(torch.randint(0, 2, (n, 1), generator=generator, device=device))
            uniforms.append(torch.rand((n, 1), generator=generator, device=device, dtype=torch.float64))
        self.sign = torch.cat(signs, 1).float().mul_(2).sub_(1)  # (N, samples)
        self.u = torch.cat(uniforms, 1)
        self.classes = torch.empty((n, samples), dtype=torch.long, device=device)
        self.coefs = torch.empty((n, samples), dtype=torch.float64, device=device)
        self.pw = torch.empty((n, weight.shape[1]), dtype=weight.dtype, device=device)  # p_n W
        self.traces: dict[int, Tensor] = {}  # chunk start -> tr H_n of its rows
        self.weight, self.V, self.samples = weight, V, samples

    def chunk(self, i: int, p: Tensor) -> None:
        """Read the chunk of rows starting at ``i`` from its softmax ``p`` (float64)."""
        p, cdf, sq, total = _tables_of(p)
        rows = slice(i, i + p.shape[0])
        # (rows, samples): c ~ q, written in place (out=: no copy)
        c = torch.searchsorted(cdf, self.u[rows] * cdf[:, -1:], out=self.classes[rows]).clamp_max_(self.V - 1)
        self.coefs[rows] = _coefs(sq, total, c)
        torch.mm(p.to(self.weight.dtype), self.weight, out=self.pw[rows])
        self.traces[i] = total[:, 0]

    def draws(self, scale: Tensor) -> Iterator[Tensor]:
        """``(r / unit) W`` per sample, with ``scale`` ``(N, 1)`` = ``sqrt(w) / unit`` (as draw_into's)."""
        factor = scale * self.sign * self.coefs
        weight, classes, pw = self.weight, self.classes, self.pw
        return ((weight[classes[:, j]] - pw).mul_(factor[:, j, None].to(weight.dtype)) for j in range(self.samples))


def _tables_of(p: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(p, cdf, ||e_c - p||^2, tr H)`` of rows of float64 probabilities ``p`` (:class:`LogitSampler`): ``cdf`` the
    running sum of ``||a_c||^2 = p_c ||e_c - p||^2``, ``q`` up to its row's total (``tr H``, ``(rows, 1)``): a class
    ``c ~ q`` is ``searchsorted(cdf, u cdf[:, -1:])``, its coefficient :func:`_coefs`. ~10 dispatched operators per
    chunk (the normalised ``q`` and a ``(rows, V)`` table of coefficients cost 11 more, and two more tables' memory)."""
    # ||e_c - p||^2 = (1 - p_c)^2 + sum_{c' != c} p_c'^2, in float64 (confident rows cancel)
    p2 = p.square()
    sq = (1 - p).square_().add_((p2.sum(-1, keepdim=True) - p2).clamp_min_(0))
    del p2
    a2 = p * sq  # ||a_c||^2
    total = a2.sum(-1, keepdim=True)  # tr H_n
    # a row with tr H = 0 (a one-hot p) draws a zero row whatever its class: its coefficient is 0
    return p, a2.cumsum_(-1), sq, total


def _coefs(sq: Tensor, total: Tensor, c: Tensor) -> Tensor:
    """``sqrt(p_c / q_c) = sqrt(tr H / ||e_c - p||^2)`` at the drawn classes ``c`` ``(rows, j)``, from
    :func:`_tables_of`' ``sq`` and ``total`` (float64)."""
    return (total / sq.gather(1, c).clamp_min(1e-300)).sqrt()


# -- optimizers --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StabilityRule:
    """The stability threshold of the optimizer updating one block.

    Args:
        optimizer: ``"sgd"`` or ``"adam"`` (Adam and AdamW).
        lr: Learning rate of the block's parameter group.
        beta: Momentum (SGD) or ``beta_1`` (Adam).
        threshold: ``(2 + 2 beta) / lr`` (SGD) or ``(2 + 2 beta_1) / ((1 - beta_1) lr)`` (Adam).
        precondition: ``{kernel weight name: (same shape) P}`` with ``P = sqrt(v_hat) + eps`` (Adam), else
            ``None``: the ratio then reads ``sharpness/...``, with it ``precond_sharpness/...``.
    """

    optimizer: str
    lr: float
    beta: float
    threshold: float
    precondition: dict[str, Tensor] | None = None


def _param_groups(optimizer: Any) -> dict[int, dict]:
    """``id(param) -> param group`` of a torch optimizer (Lightning's wrapper unwrapped)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    return {id(p): group for group in getattr(opt, "param_groups", []) for p in group["params"]}


def _full(t: Tensor) -> Tensor:
    """``t`` as a full tensor: a ``DTensor`` (FSDP2's optimizer state, sharded as its parameter) all-gathered (a
    collective: every rank asks for the same states in the same order), any other tensor as it is."""
    if type(t).__name__ == "DTensor":
        return t.full_tensor()
    return t


def stability_rule(
    optimizer: Any, params: Mapping[str, tuple[list[Tensor], Tensor]], steps: Mapping[int, float] | None = None
) -> tuple[StabilityRule | None, str | None]:
    """The rule of the optimizer for one block, or ``(None, why not)``.

    Args:
        optimizer: The optimizer (``torch.optim.SGD``, ``Adam``, ``AdamW``; Lightning's ``LightningOptimizer``), or a
            list of them (several optimizers, manual optimization): the one whose parameter groups hold the block's
            weights.
        params: ``{kernel weight name: (module parameters, index)}`` from :func:`param_index_map`: ``index`` is
            the weight's elements as positions in the concatenation of the flattened parameters.
        steps: ``{id(parameter): Adam's step count}`` read already (:func:`adam_steps`, one host read for every
            block), or None: read here, one host read for the block.

    Supported: ``SGD`` without Nesterov and without dampening (plain or heavy-ball), ``Adam`` and ``AdamW``
    without ``amsgrad`` (after their first step, when ``exp_avg_sq`` exists). For the others no ratio is logged
    (a wrong one would be worse than none); the reason says which. Under FSDP2 the parameters and ``exp_avg_sq``
    are sharded ``DTensor`` s: the map holds their full shapes, and the second moments the block reads are
    all-gathered here (every rank calls this for the same blocks in the same order).
    """
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    plist = list(dict.fromkeys(id(p) for ps, _ in params.values() for p in ps))
    found = [(o, _param_groups(o)) for o in (getattr(o, "optimizer", o) for o in optimizers)]
    opt, groups = next(((o, g) for o, g in found if plist and all(i in g for i in plist)), (None, {}))
    if opt is None:
        if sum(any(i in g for i in plist) for _, g in found) > 1:
            return None, "its weights are split between optimizers"
        where = "the optimizer's" if len(found) == 1 else f"any of the {len(found)} optimizers'"
        return None, f"some of its weights are not in {where} parameter groups"
    used = [groups[i] for i in plist]
    keys = ("lr", "momentum", "betas", "dampening", "nesterov", "amsgrad")
    first = {k: used[0].get(k) for k in keys}
    if any({k: g.get(k) for k in keys} != first for g in used[1:]):
        return None, "its weights are in parameter groups with different learning rates or momenta"
    lr = float(first["lr"] if not isinstance(first["lr"], Tensor) else first["lr"].item())
    if lr < 0 or not math.isfinite(lr):
        return None, f"its learning rate is {lr}"
    name = type(opt).__name__
    if isinstance(opt, torch.optim.SGD):
        if first["nesterov"] or first["dampening"]:
            return None, "SGD with Nesterov momentum or dampening has no ratio here (plain or heavy-ball SGD only)"
        beta = float(first["momentum"] or 0.0)
        return StabilityRule("sgd", lr, beta, (2 + 2 * beta) / lr if lr > 0 else math.inf), None
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        if first["amsgrad"]:
            return None, "Adam with amsgrad has no ratio here"
        beta1, beta2 = (float(b) for b in first["betas"])
        eps = float(used[0]["eps"])
        precondition = {}
        # the step counts in one host read (a device tensor under fused or capturable Adam: one sync each)
        if steps is None:
            steps = adam_steps(opt, [ps for ps, _ in params.values()])
        for weight, (ps, index) in params.items():
            step = steps.get(id(ps[0]), 0.0) if ps else 0.0
            states = [opt.state.get(p, {}) for p in ps]
            if any("exp_avg_sq" not in s for s in states) or step < 1:
                return None, NO_STATE_YET
            flat = torch.cat([_full(s["exp_avg_sq"]).detach().reshape(-1).float() for s in states])
            v_hat = flat[index.to(flat.device)] / (1 - beta2**step)
            P = v_hat.sqrt() + eps
            if eps <= 0 and bool((P <= 0).any()):  # a coordinate that never had a gradient: its smallest positive P
                positive = P[P > 0]
                P = P.clamp_min(float(positive.min()) if positive.numel() else 1.0)
            precondition[weight] = P
        threshold = (2 + 2 * beta1) / ((1 - beta1) * lr) if lr > 0 else math.inf  # lr = 0 (warm-up): ratio 0
        return StabilityRule("adam", lr, beta1, threshold, precondition), None
    return None, f"{name} is not supported for stability ratios (SGD, Adam and AdamW are)"


def adam_steps(optimizer: Any, params: Iterable[list[Tensor]]) -> dict[int, float]:
    """``{id(p): step}`` of the first parameter ``p`` of each list in ``params`` that has state in ``optimizer``: its
    ``state["step"]`` (0 without one), every tensor read in one host read per device."""
    opt = getattr(optimizer, "optimizer", optimizer)
    firsts = list({id(ps[0]): ps[0] for ps in params if ps and ps[0] in opt.state}.values())
    values = _host_floats([opt.state[p].get("step", 0) for p in firsts])
    return dict(zip((id(p) for p in firsts), values, strict=True))


def _host_floats(values: list[Any]) -> list[float]:
    """``values`` (numbers and one-element tensors) as floats: one host read per device for the tensors.

    Example:
        >>> _host_floats([1, torch.tensor(2.0), torch.tensor([3])])
        [1.0, 2.0, 3.0]
    """
    out = [float(v) if not isinstance(v, Tensor) else 0.0 for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, Tensor):
            by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        for i, x in zip(idx, torch.stack([values[i].reshape(()) for i in idx]).tolist(), strict=True):
            out[i] = float(x)
    return out


def param_index_map(spec: Any, weights: Iterable[str] = PRECONDITIONED) -> dict[str, tuple[list[Tensor], Tensor]]:
    """Where each element of a block's weights (as its adapter reads them) lives in the module parameters.

    The adapter reads weights by indexing (transposes, head splits, fused-QKV slices). Reading them once with
    every parameter's values replaced by their positions ``0, 1, ...`` (in float64, exact) gives that map, for
    any adapter, without knowing its layout: optimizer state (Adam's ``exp_avg_sq``) indexed by it is in the
    kernel's layout.

    Args:
        spec: A :class:`~curvwatch.adapters.BlockSpec`.
        weights: The weight names wanted (those of the adapter's ``read_params`` found among them are mapped); a dotted
            name reads an entry of a dict parameter (``"qk_norm.weight_q"``).

    Returns:
        ``{name: (parameters, index)}``: ``parameters`` the module parameters the weight reads (in order),
        ``index`` a ``LongTensor`` of the weight's shape into their concatenated flattened values.

    Raises:
        ValueError: If a weight is not a pure re-indexing of the parameters (its positions are not whole numbers
            in range), e.g. an adapter that scales a weight.
    """
    owner = spec.layer_module if spec.layer_module is not None else spec.module
    params = list(dict.fromkeys(p for p in owner.parameters()))
    sizes = [p.numel() for p in params]
    positions, offset = {}, 0
    for p, n in zip(params, sizes, strict=True):
        positions[id(p)] = torch.arange(offset, offset + n, dtype=torch.float64, device=p.device).reshape(p.shape)
        offset += n
    # the positions stand in for the parameters as module attributes; the parameters themselves are not touched
    # (assigning .data of another dtype would reset their gradient accumulators, and DDP's hooks on them)
    swapped = []
    try:
        for module in owner.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in positions:
                    module._parameters[name] = positions[id(p)]
                    swapped.append((module, name, p))
        with torch.no_grad():
            read = spec.adapter.read_params(spec)
            found = {k: _read_weight(read, k).detach().clone() for k in weights
                     if isinstance(_read_weight(read, k), Tensor)}  # fmt: skip
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
    out = {}
    starts = torch.tensor([0, *sizes]).cumsum(0)  # (n_params + 1,) where each parameter's positions begin
    for name, pos in found.items():
        idx = pos.round().long()
        if pos.dtype != torch.float64 or not torch.equal(idx.double(), pos) or idx.min() < 0 or idx.max() >= offset:
            raise ValueError(
                f"{spec.name}: the adapter's {name} is not a re-indexing of the module parameters (it computes "
                "with them), so the optimizer state cannot be mapped onto it."
            )
        flat = idx.reshape(-1).cpu()
        which = torch.bucketize(flat, starts[1:], right=True)  # the parameter of each element
        used = which.unique()  # sorted
        new_starts = torch.zeros(len(params), dtype=torch.long)
        new_starts[used] = torch.tensor([0, *[sizes[i] for i in used.tolist()]]).cumsum(0)[:-1]
        local = flat - starts[which] + new_starts[which]  # position in the concatenation of the used ones
        out[name] = ([params[i] for i in used.tolist()], local.reshape(idx.shape))
    return out


def param_positions(params: list[Tensor], index: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``(parameter, elements, positions)`` for each of ``params`` holding some of a weight's elements.

    Args:
        params, index: One entry of :func:`param_index_map` (``index`` into the concatenated flattened ``params``).

    Returns:
        ``elements``: which entries of ``index.reshape(-1)`` the parameter holds; ``positions``: where they are in its
        flattened values (both ``LongTensor``, on the CPU).
    """
    flat = index.reshape(-1)
    starts = torch.tensor([0, *[p.numel() for p in params]]).cumsum(0)
    which = torch.bucketize(flat, starts[1:], right=True)  # the parameter of each element
    out = []
    for j, p in enumerate(params):
        elements = (which == j).nonzero().reshape(-1)
        if elements.numel():
            out.append((p, elements, flat[elements] - starts[j]))
    return out


def stability_keys(result: Mapping[str, Any], rule: StabilityRule) -> dict[str, Tensor | float]:
    """``stability/XX[/h{i}]`` = sharpness / threshold for each sharpness key of one block's result.

    SGD reads ``sharpness/...``, Adam ``precond_sharpness/...`` (the sharpness of ``P^-1/2 H P^-1/2``).

    Example:
        >>> rule = StabilityRule("sgd", lr=0.1, beta=0.0, threshold=20.0)
        >>> stability_keys({"sharpness/QQ/h0": 30.0, "ggn/QQ/h0": 29.0}, rule)
        {'stability/QQ/h0': 1.5}
    """
    source = "precond_sharpness/" if rule.optimizer == "adam" else "sharpness/"
    return {
        "stability/" + key[len(source) :]: value / rule.threshold
        for key, value in result.items()
        if key.startswith(source)
    }


def unresolved_keys(flat: Mapping[tuple[str, str], float], limit: float | None = None) -> list[str]:
    """``"block pair[/head]"`` of every sharpness the kernels withheld as unresolved: a logged ``sharpness_spread``
    above ``limit`` (default :data:`~curvwatch.closed_form._sampled.SPREAD_LIMIT`) whose ``sharpness`` key has no
    value (the estimate's uncertainty is larger than the value: docs/sharpness.md, "Unresolved keys").

    Example:
        >>> unresolved_keys({("layer0/ffn", "sharpness_spread/W2W2"): 3.1, ("layer0/ffn", "sharpness/W1W1"): 0.2,
        ...                  ("layer0/ffn", "sharpness_spread/W1W1"): 0.05}, limit=0.5)
        ['layer0/ffn W2W2']
    """
    if limit is None:
        from curvwatch.closed_form.solver.debiasing import SPREAD_LIMIT as limit
    out = []
    for (block, key), value in flat.items():
        if key.startswith("sharpness_spread/") and value > limit:
            name = key[len("sharpness_spread/") :]
            if (block, f"sharpness/{name}") not in flat:
                out.append(f"{block} {name}")
    return out


def backward_hooks_note(model: nn.Module) -> str | None:
    """What to tell the user at set-up when ``model`` has backward hooks of its own (module full backward hooks,
    backward pre-hooks, global module backward hooks), else ``None``.

    The sampled backward passes (:meth:`curvwatch.capture.Capture.sample_outputs`) run from the logits to the block
    outputs, through every hook on that path: no PyTorch API runs a backward pass without them. Every
    :class:`~curvwatch.capture.Capture` (a second monitor's too) ignores these passes; a user's hooks cannot, and
    tensor hooks (``Tensor.register_hook``) cannot be seen at set-up at all.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> backward_hooks_note(net) is None
        True
        >>> _ = net.register_full_backward_hook(lambda m, gi, go: None)
        >>> backward_hooks_note(net)[:60]
        "the model has backward hooks (on ''): the sampled backward p"
    """
    from torch.nn.modules import module as nn_module

    hooked = [n for n, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]
    if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        hooked.insert(0, "<global module hooks>")
    if not hooked:
        return None
    return (
        f"the model has backward hooks (on {', '.join(repr(n) for n in hooked[:3])}"
        + (f" and {len(hooked) - 3} more" if len(hooked) > 3 else "")
        + "): the sampled backward passes (sharpness_samples per evaluation) run through them too, as they do "
        "through tensor hooks on the path; pass sharpness=False if your hooks must see only the training's own "
        "backward"
    )


# -- the monitor's real-loss settings -------------------------------------------------------------------


class RealLoss:
    """What a monitor needs for the real-loss keys: the logits module, the sampling, the optimizer rules.

    Trainer-free: :class:`~curvwatch.CurvatureMonitor` resolves it in ``setup`` (:meth:`resolve`), samples in
    ``on_before_backward`` (:meth:`sample`) and asks for the rules before the optimizer step (:meth:`rules`).

    Args:
        enabled: ``True`` (an error in :meth:`resolve` if it cannot work), ``False``, or ``"auto"`` (on when a
            logits module is found and the strategy can run the sampled passes: not FSDP1; the set-up table says
            which).
        samples: Sampled output gradients per evaluation (one backward pass from the logits each).
        loss: ``"auto"``, ``"cross_entropy"`` or ``"mse"`` (see :func:`loss_weights`).
        logits_module: Dotted name of the module whose output is the logits, or ``None`` (:data:`LOGITS_NAMES`).
        seed: Seed of the sampled labels (evaluation ``i`` uses ``seed + step``).

    Raises:
        ValueError: If an argument is invalid.
    """

    def __init__(
        self,
        enabled: bool | str = "auto",
        samples: int = 16,
        loss: str | LossKind = "auto",
        logits_module: str | None = None,
        seed: int = 0,
    ) -> None:
        if enabled not in (True, False, "auto"):
            raise ValueError(f"Invalid sharpness={enabled!r}. Must be True, False or 'auto'.")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"Invalid sharpness_samples={samples!r}. Must be an int >= 1 (default 16).")
        try:
            self.loss = LossKind(loss)
        except ValueError:
            raise ValueError(f"Invalid loss={loss!r}. Must be one of {[k.value for k in LossKind]}.") from None
        if logits_module is not None and not isinstance(logits_module, str):
            raise ValueError(f"Invalid logits_module={logits_module!r}. Must be a module name such as 'lm_head'.")
        self.enabled, self.samples, self.logits_name, self.seed = enabled, samples, logits_module, int(seed)
        self.module: nn.Module | None = None  # set by resolve when on
        self.hooks_note: str | None = None  # set by resolve: backward hooks the sampled passes run through
        self.status = "off"
        self._maps: dict[str, dict[str, tuple[list[Tensor], Tensor]] | str] = {}
        self.verified: dict[str, dict[str, float]] = {}  # the last before_backward's true block sharpness

    def resolve(self, model: nn.Module, unsupported: str | None = None) -> str:
        """Find the logits module; returns the status line of the set-up table (``"on: ..."`` / ``"off: ..."``).

        Args:
            model: The model.
            unsupported: Why the training's set-up cannot run the sampled backward passes (FSDP1:
                :func:`curvwatch.sharding.real_loss_support`), else ``None`` (single device, DDP, FSDP2).

        Raises:
            ValueError: With ``enabled=True``, if it cannot work (no logits module, ``unsupported``).
        """
        self.module = None
        self.hooks_note = None  # a previous fit's model may have had hooks
        self._maps = {}  # maps of weights to parameters, by block name: a new model (or fit) has its own
        if self.enabled is False:
            self.status = "off (sharpness=False)"
            return self.status
        if unsupported:
            if self.enabled is True:
                raise ValueError(f"sharpness=True is not supported under {unsupported}. Pass sharpness=False.")
            self.status = f"off: {unsupported}"
            return self.status
        try:
            name, self.module = find_logits_module(model, self.logits_name)
        except ValueError as err:
            if self.enabled is True or self.logits_name is not None:
                raise
            self.status = f"off: {err}"
            return self.status
        self.status = (
            f"on: logits from '{name}', {self.samples} samples, loss {self.loss.value}; stability/... and "
            "stability/max under Adam/AdamW from the optimizer's first step on (none at step 0: no second moments yet)"
        )
        self.hooks_note = backward_hooks_note(model)
        if self.hooks_note:
            self.status += f"; {self.hooks_note}"
        return self.status

    def sample(
        self,
        capture: Any,
        loss: Tensor | None,
        factor: float,
        step: int,
        grad_logits: Tensor | None = None,
        agree: Any = None,
    ) -> int:
        """Sampled output gradients into ``capture`` (:meth:`curvwatch.capture.Capture.sample_outputs`), from the
        ``loss`` before its backward or from ``grad_logits``, its gradient at the logits, during it; ``agree``:
        the ranks' agreement to run the passes (several ranks).

        The labels are drawn from a generator seeded with ``seed + step``: every rank, and every strategy (DDP,
        FSDP2), draws the same random numbers at a step."""
        fallback = (loss if grad_logits is None else grad_logits).device
        z_device = next((p.device for p in self.module.parameters()), fallback) if self.module else fallback
        generator = torch.Generator(device=z_device).manual_seed(self.seed + int(step))
        return capture.sample_outputs(
            loss, self.samples, kind=self.loss, factor=factor, generator=generator, grad_logits=grad_logits, agree=agree
        )

    def before_backward(
        self,
        capture: Any,
        loss: Tensor | None,
        factor: float,
        step: int,
        verify: bool,
        warn_once: Any,
        grad_logits: Tensor | None = None,
        agree: Any = None,
    ) -> None:
        """The monitor's ``on_before_backward``: sample (:meth:`sample`), with ``verify`` also the true block sharpness
        (:func:`true_sharpness`, kept for :meth:`add_verified`); what it cannot do is warned once, never raised.
        Called from the backward with ``grad_logits`` (and no ``loss``), it samples from the logits' gradient.
        ``agree`` (several ranks): see :meth:`curvwatch.capture.Capture.sample_outputs`."""
        self.verified = {}
        try:
            sampled = self.sample(capture, loss, factor, step, grad_logits, agree)
            if capture.sample_note:
                warn_once("sharpness_note", f"CurvatureMonitor (real-loss sharpness): {capture.sample_note}.")
            if capture.unsampled:
                warn_once(
                    "sharpness_unsampled",
                    f"CurvatureMonitor has no real-loss keys for {', '.join(capture.unsampled)}: their outputs were "
                    "not "
                    "in the forward graph when the loss was ready (reentrant activation checkpointing runs the forward "
                    "under no_grad: use torch.utils.checkpoint(..., use_reentrant=False)), or do not reach the logits.",
                )
        except Exception as err:
            capture._release()
            warn_once(
                "sharpness_failed",
                f"CurvatureMonitor leaves the real-loss keys (sharpness/..., stability/...) out at step {step}: "
                f"sampling the output gradients raised {type(err).__name__}: {err}",
            )
            return
        if not (verify and sampled) or loss is None:
            return
        from curvwatch.capture import monitor_passes
        from curvwatch.verify import VERIFIED, true_sharpness

        maps = {}
        for spec in capture.specs:
            found = self.map_of(spec) if spec.name not in capture.unsampled else "-"
            if spec.kind in VERIFIED and not isinstance(found, str):
                maps[spec.name] = (spec, found)
        try:
            with monitor_passes():  # no capture reads them (gradients, backward passes)
                self.verified = true_sharpness(loss, maps, factor)
        except RuntimeError as err:
            warn_once(
                "verify_failed",
                "CurvatureMonitor cannot check the sharpness against the true block Hessian (verify_every_n_evals): "
                f"its Hessian-vector products need double backward, which this model's graph lacks ({err}). Use an "
                "attention without fused kernels for the check (e.g. attn_implementation='eager').",
            )

    def add_verified(self, results: dict[str, dict[str, Any]]) -> None:
        """``verify/hessian/XX[/h0]`` and ``verify/ratio/XX[/h0]`` (true / sharpness) of the last
        :meth:`before_backward` into an evaluation's results (then forgotten)."""
        verified, self.verified = self.verified, {}
        for block, found in verified.items():
            result = results.get(block)
            for key, value in found.items() if result else ():
                pair = key.rsplit("/", 1)[-1]
                suffix = next((s for s in ("/h0", "/g0", "") if f"sharpness/{pair}{s}" in result), None)
                if suffix is not None:
                    sharp = float(result[f"sharpness/{pair}{suffix}"])
                    result[f"{key}{suffix}"] = value
                    if sharp != 0 and not math.isnan(sharp):  # (NaN: an unresolved sharpness, no value)
                        result[f"verify/ratio/{pair}{suffix}"] = value / sharp

    def note_unresolved(self, flat: Mapping[tuple[str, str], float], warn_once: Any) -> None:
        """Name once the sharpness keys an evaluation withheld as unresolved (:func:`unresolved_keys`), with the fix."""
        found = unresolved_keys(flat)
        if not found:
            return
        from curvwatch.closed_form.solver.debiasing import SPREAD_LIMIT

        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        warn_once(
            "sharpness_unresolved",
            f"CurvatureMonitor gives no sharpness/... (nor its stability/... ratio) for {', '.join(found[:4])}{more}: "
            f"the estimate's uncertainty (sharpness_spread, still logged) is above {SPREAD_LIMIT:.0%} of it: the "
            "value is not known to within its own size. The Monte-Carlo Gauss-Newton estimate has (samples x kept "
            "sequences) independent columns, too few for blocks this large; more samples "
            f"(Sharpness(samples={4 * self.samples}): 4x the sampling's cost) or more kept sequences (max_tokens=, "
            "shorter sequences) narrow it; with one long kept sequence an FFN's W2 may stay unresolved even so "
            "(docs/sharpness.md, 'Unresolved keys'). Said once; the set can change from one evaluation to the next.",
        )

    def stability_rules(self, optimizer: Any, blocks: Iterable[Any], warn_once: Any) -> dict[str, StabilityRule]:
        """The optimizer's rule per captured block with samples (:meth:`rules`); the reasons for none warned once
        (Adam before its first step is expected and not warned about)."""
        sampled = [b.spec for b in blocks if "output_samples" in b.inputs]
        if optimizer is None or not sampled:
            return {}
        rules, why = self.rules(optimizer, sampled)
        for name, reason in why.items():
            if reason != NO_STATE_YET:
                warn_once(
                    f"stability:{reason}",
                    f"CurvatureMonitor logs no stability/... ratio for '{name}' (nor for other blocks with the same "
                    f"reason): {reason}.",
                )
        return rules

    def map_of(self, spec: Any) -> dict[str, tuple[list[Tensor], Tensor]] | str:
        """:func:`param_index_map` of ``spec``, computed once; the reason as a string when it cannot be mapped."""
        if spec.name not in self._maps:
            try:
                self._maps[spec.name] = param_index_map(spec)
            except Exception as err:  # an adapter computing with its weights: no ratio, named
                self._maps[spec.name] = str(err)
        return self._maps[spec.name]

    def rules(self, optimizer: Any, specs: Iterable[Any]) -> tuple[dict[str, StabilityRule], dict[str, str]]:
        """``({block: rule}, {block: why none})`` for the blocks of kinds with sampled keys.

        The maps from weights to parameters (:func:`param_index_map`) are computed once per block.
        """
        from curvwatch.kinds import KINDS

        rules, why = {}, {}
        found_of = {spec.name: self.map_of(spec) for spec in specs if KINDS[spec.kind].sampled}
        # Adam's step counts of every block's weights in one host read (per optimizer)
        lists = [ps for found in found_of.values() if not isinstance(found, str) for ps, _ in found.values()]
        opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        steps: dict[int, float] = {}
        for opt in opts:
            if isinstance(getattr(opt, "optimizer", opt), (torch.optim.Adam, torch.optim.AdamW)):
                steps.update(adam_steps(opt, lists))  # (a parameter has state in one optimizer only)
        for name, found in found_of.items():
            if isinstance(found, str):
                why[name] = found
                continue
            rule, reason = stability_rule(optimizer, found, steps=steps if steps else None)
            if rule is None:
                why[name] = reason
            else:
                rules[name] = rule
        return rules, why
