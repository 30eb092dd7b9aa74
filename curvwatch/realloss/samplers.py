"""Sampled logit gradients whose outer products average to the loss's Gauss-Newton matrix at the logits."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from curvwatch.realloss.weights import LossKind, _chunk_rows, _row_chunks


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
