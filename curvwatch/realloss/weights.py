"""Loss weights read from the real loss's gradient at the logits: which loss, and how much each row weighs."""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

import torch
from torch import Tensor

# A cross-entropy gradient row g = w (p - t) sums to zero; rows summing to more than this fraction of their
# absolute sum are not cross-entropy ones (float32 round-off is ~1e-7; bfloat16 logits ~1e-3).
_CE_ROW_SUM = 1e-2
# Elements per chunk of rows of the (rows, vocabulary) float64 temporaries of loss_weights and LogitSampler: 2^20
# (8 MiB each; a chunk holds about four at once, ~31 MiB measured, whatever the batch, the kept tokens or the
# vocabulary). Each chunk costs ~43 dispatched operators (a kernel launch each on a GPU): at 512 kept tokens and a 50K
# vocabulary, 26 chunks.
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
        >>> lin = torch.nn.Linear(3, 5)
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


def _hard_label_pass(z_all: Tensor, g_all: Tensor, w: Tensor, active: Tensor, per_chunk: bool, on_chunk):
    """One pass of :func:`loss_weights` over ``(N, V)`` logits and gradient rows, a chunk at a time (float64
    temporaries of one chunk: memory bounded by ``_CHUNK``): writes the hard-label weights into ``w`` and the rows
    with a gradient into ``active`` ``(N,)``, calls ``on_chunk(start, p)``, and returns ``(residual of the hard-label
    fit squared, gradient norm squared, any decisive row, any chunk whose decisive rows do not sum to zero, whether a
    chunk was read as cross-entropy plus a term in logsumexp, the label smoothing the fit cannot tell from hard labels
    (:func:`_hidden_smoothing`))``, all but the fifth device tensors. With ``per_chunk`` each chunk whose rows do not
    sum to zero is read that way (a host read per chunk); else every chunk as hard labels (no host read).

    A chunk only reduces its rows to seven numbers each (:func:`_row_stats`); the weights and the fit's residual are
    computed from them for all rows at once after the loop (:func:`_fit_rows`): a chunk costs ~20 dispatched operators
    and no residual table is made."""
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
    smoothing = _hidden_smoothing(stats, fit.w, keep, V)
    resid2, norm2 = torch.dot(fit.resid2, keep), torch.dot(fit.norm2, keep)
    return resid2, norm2, fit.decisive.any(), fit.off_label.any(), lse_term, smoothing


def _hidden_smoothing(stats: Tensor, w: Tensor, keep: Tensor, V: int) -> Tensor:
    """The largest label smoothing ``eps`` the hard-label fit of the ``keep`` rows cannot tell from hard labels (0-d).

    A smoothed cross-entropy row is ``g = w ((p - e_y) - eps (u - e_y))`` with ``u`` the uniform distribution: where
    the predictions off the label are even (near initialisation; with a wide vocabulary, wherever the model is not
    confident), ``u - e_y`` is nearly parallel to ``p - e_y`` and the row reads as a hard-label row of weight
    ``(1 - eps) w``. Its part off that direction has norm ``w eps |u - e_y|
    sin(theta)``; the fit accepts it while that stays within :data:`_HARD_FIT` of ``|g|``, i.e. for ``eps`` up to the
    value returned (from :func:`_row_stats`' columns: ``<u - e_y, p - e_y> = 1 - p_y``)."""
    p_y, p_norm = stats[:, 1], stats[:, 6]
    pe2 = (p_norm.square() - 2 * p_y + 1).clamp_min(0)  # |p - e_y|^2
    ue2 = (V - 1) / V  # |u - e_y|^2
    cos2 = (1 - p_y).square() / (ue2 * pe2).clamp_min(1e-300)
    w2 = w.double().square() * keep
    off = torch.dot(w2, (1 - cos2).clamp_min(0)) * ue2
    return _HARD_FIT * (torch.dot(w2, pe2) / off.clamp_min(1e-300)).sqrt()


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
    # (not one per chunk: 52 chunks at 512 kept tokens and a 50K vocabulary)
    resid2, norm2, decisive_any, flagged, _, smoothing = _hard_label_pass(z_all, g_all, w, active, False, on_chunk)
    fit, decisive_any, flagged, smoothing = torch.stack(
        [resid2.sqrt() <= _HARD_FIT * norm2.sqrt(), decisive_any, flagged, smoothing]
    ).tolist()
    lse_term = False  # rows that do not sum to zero, read as cross-entropy plus a term in logsumexp (z-loss)
    if flagged:  # (rare: a z-loss) the rows again, each chunk read as its rows need (a host read per chunk)
        resid2, norm2, decisive_any, _, lse_term, _ = _hard_label_pass(z_all, g_all, w, active, True, None)
        fit, decisive_any = bool(resid2.sqrt() <= _HARD_FIT * norm2.sqrt()), bool(decisive_any)
    fits = fit or not decisive_any
    if lse_term and not fits:
        raise ValueError(_NOT_CE.format(""))
    if fits:
        note = LSE_TERM_NOTE if lse_term else None
        if note is None and kind is LossKind.AUTO and decisive_any and smoothing >= HIDDEN_SMOOTHING:
            note = HIDDEN_SMOOTHING_NOTE.format(min(smoothing, 1.0))
        return w, LossKind.CROSS_ENTROPY, note
    # not hard labels: a second pass over the rows tells a scaling of the logits from soft targets (only here: the
    # hard-label case, the usual one, does not pay for these fits)
    _refuse_scaled_or_soft(z_all, g_all)
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


def _refuse_scaled_or_soft(z_all: Tensor, g_all: Tensor) -> None:
    """The second pass of :func:`loss_weights` over ``(N, V)`` logits and gradient rows that are not hard labels: an
    error if the gradient is a hard-label cross-entropy's of scaled logits (a temperature, a soft-capping after the
    module) or of soft targets other than label smoothing, else nothing (label smoothing)."""
    N, V = g_all.shape
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


#: The error of a gradient at the logits that no cross-entropy (with or without a term in logsumexp) explains.
_NOT_CE = (
    "The loss's gradient at the logits is not a softmax cross-entropy's (its rows do not sum to zero, and the entries "
    "off the label are not proportional to the softmax, as a z-loss term would leave them{}). Pass "
    "sharpness=curvwatch.Sharpness(loss='mse') for a squared error, Sharpness(logits_module='<name>') if the module "
    "found is not the one the loss reads (a final soft-capping or scaling after it changes the loss's curvature), or "
    "sharpness=False."
)

#: The starts of :func:`loss_weights`' notes whose weights assume a mean (they sum to 1 over the whole batch).
MEAN_NOTES = ("squared error: assumed the mean", "soft targets of the label-smoothing form")


def assumes_mean(note: str | None) -> bool:
    """Whether :func:`loss_weights` assumed a mean (the note of a squared error or of label smoothing read as soft
    targets), so that its weights sum to 1 over the whole batch."""
    return note is not None and note.startswith(MEAN_NOTES)


#: Label smoothing the hard-label fit may miss before :func:`loss_weights` says so (:func:`_hidden_smoothing`): a
#: smoothing below it reads the weights at most this much low.
HIDDEN_SMOOTHING = 0.05

#: :func:`loss_weights`' note when its predictions cannot tell hard labels from label smoothing (``loss="auto"``).
HIDDEN_SMOOTHING_NOTE = (
    "assumed hard labels, but label smoothing up to eps = {:.2g} would give the same gradient here (the predictions "
    "off the label are too even: near initialisation, or a wide vocabulary before the model is confident), and would "
    "make the real-loss keys read (1 - eps) of their value; the loss form is read again at every evaluation. Pass "
    "Sharpness(loss='cross_entropy') to state the loss and silence this"
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
    ``p_y`` near 0 (an untrained model: 0.2% on the total of 7,680 such rows). Four entries per row and no reduction
    over the vocabulary: all rows at once in any dtype, with no ``(rows, V)`` temporary and no float32 sum over the
    vocabulary (3e-8 relative where a sum of the entries off the label is 3e-5). A linear logits module's two logits
    are two dot products of its input (:class:`LinearLogits`), so this costs ``O(rows d)`` instead of recomputing
    ``(rows, vocabulary)`` logits; rows without a gradient weigh 0.

    Example:
        >>> z = torch.randn(6, 5)
        >>> loss = torch.nn.functional.cross_entropy(z.requires_grad_(), torch.arange(6) % 5, reduction="sum")
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
