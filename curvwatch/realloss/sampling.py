"""The sampled backward passes: Monte-Carlo output gradients of the real loss, from the logits to every block.

For a loss ``l = sum_n w_n ell(z_n, y_n)`` over the rows ``z_n`` of the logits, the Gauss-Newton matrix at the logits
is ``sum_n w_n H_n`` with ``H_n = diag(p_n) - p_n p_n^T`` (softmax cross-entropy, ``p_n = softmax(z_n)``) or ``2 I``
(squared error). A sampled gradient ``r = sqrt(w) (p - e_y)`` with ``y ~ Categorical(p)`` (cross-entropy) or
``r = sqrt(2 w) eps`` with ``eps ~ N(0, I)`` (squared error) has ``E[r r^T] = w H``, rows independent (the Monte-Carlo
Fisher of K-FAC and BackPACK). :func:`sample_outputs` back-propagates ``k`` such draws from the logits to every kept
block output at once (``torch.autograd.grad`` with ``retain_graph``: no parameter gradient is touched, and every
:class:`~curvwatch.capture.Capture` ignores these passes) and stores them in the capture: each block of a kind that
takes them then holds ``"output_samples"`` ``(k, B, L, d_out)``, cut to the same tokens as ``X``, whose outer products
average to the Gauss-Newton matrix of the real loss at that output. The kernels turn them into the ``ggn/...`` and
``sharpness/...`` keys.

Off a CPU the ``k`` passes run as batched backward passes (``torch.func.vmap`` over the cotangents of one
``torch.autograd.grad``: one dispatched operator per backward operator for a batch of samples instead of one per
sample) of as many samples as the memory allows: each sample in a batch holds its own cotangent and gradients at every
block output at once (:func:`passes_at_once`, the one place that chooses, and where the passes run one at a time).
A backward operator without a batching rule runs once per sample inside the batch (its warning is not passed on); a
batched pass that raises (a backward hook that reads a value, an operator vmap cannot run) is run again one sample at
a time, with the same draws.

Call it with the loss after the forward and before its backward (Lightning's ``on_before_backward``), or with the
loss's gradient at the logits from inside the backward (:attr:`Capture.on_logits_grad
<curvwatch.capture.Capture.on_logits_grad>`), while the graph below the logits lives.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from curvwatch.capture import Capture, LiveOutput, first_tokens, monitor_passes, token_slice
from curvwatch.realloss.samplers import InputDraws, LogitSampler
from curvwatch.realloss.weights import (
    LSE_TERM_NOTE,
    SOFT,
    LinearLogits,
    LossKind,
    _chunk_rows,
    assumes_mean,
    loss_weights,
    soft_divisor,
    total_weight,
)

__all__ = ["BATCH_MEMORY_MB", "Sampled", "passes_at_once", "sample_outputs"]

#: Most memory, in MiB, one batched sampled backward pass may take (:func:`passes_at_once`) when no budget is given.
BATCH_MEMORY_MB = 1024.0

#: Whether the passes run batched on a CPU when the caller leaves it to the device (``batched=None``). A CPU is bound by
#: the passes' arithmetic and memory traffic, not by dispatched operators: 16 passes as one batch took 0.97-1.09x the
#: CPU time of the passes one at a time (``benchmarks/bench_sharpness.py --cost``), so a CPU runs them one at a time;
#: ``benchmarks/bench_dispatch.py`` sets it to count on a CPU what a GPU dispatches.
BATCH_ON_CPU = False

# functorch's warning for a backward operator without a batching rule (it then runs once per sample, correctly)
_NO_BATCHING_RULE = "There is a performance drop because we have not yet implemented the batching rule"


@dataclass
class Sampled:
    """What :func:`sample_outputs` did on one capture.

    Args:
        blocks: The blocks that received every sample.
        unsampled: Blocks of kinds that take samples which none reached (their outputs were not in the graph when the
            loss was ready, or do not reach the logits); empty when the step diverged (the engine flags those blocks).
        note: What the loss weights had to assume about the loss (:func:`~curvwatch.realloss.weights.loss_weights`),
            or ``None``.
        at_once: The most passes run as one batched backward pass (:func:`passes_at_once`; 1: one at a time).
        unbatched: Why a batched pass was run again one sample at a time (its error), or ``None``.
    """

    blocks: list[str] = field(default_factory=list)
    unsampled: list[str] = field(default_factory=list)
    note: str | None = None
    at_once: int = 1
    unbatched: str | None = None


def sample_outputs(
    capture: Capture,
    loss: Tensor | None,
    samples: int,
    *,
    kind: str | LossKind = "auto",
    factor: float = 1.0,
    generator: torch.Generator | None = None,
    grad_logits: Tensor | None = None,
    agree: Callable[[bool], bool] | None = None,
    batched: bool | None = None,
    memory_mb: float | None = None,
) -> Sampled:
    """Back-propagate ``samples`` sampled logit gradients to every kept block output of ``capture``.

    Args:
        capture: An open capture with a ``logits_module``, after the forward of its step.
        loss: The loss tensor about to be back-propagated (its gradient at the logits gives the loss weights,
            :func:`~curvwatch.realloss.weights.loss_weights`).
        samples: ``k``, the samples per block (one backward pass from the logits each).
        kind: The loss at the logits: ``"auto"``, ``"cross_entropy"``, ``"mse"``, or soft targets with their
            reduction, ``"soft_mean"``, ``"soft_batchmean"``, ``"soft_sum"``.
        factor: Multiplies the loss weights (undoes gradient accumulation and AMP factors of ``loss``).
        generator: Random source for the sampled labels.
        grad_logits: The loss's gradient at the logits, when called from the backward instead of before it; ``loss``
            is then not used.
        agree: Several ranks: called once on every rank, whatever happens locally, just before the sampled passes,
            with whether this rank can run them; returns whether every rank can. Under FSDP2 each pass all-gathers the
            weights of the layers it runs through (a collective), so either every rank runs the ``samples`` passes or
            none does (the others then raise a ``RuntimeError`` saying so).
        batched: Whether the passes may run as batched backward passes (:func:`passes_at_once`): ``None`` where the
            device gains from it (not a CPU), ``True`` on any device, ``False`` never (the model has backward hooks of
            its own, which would see a batch of gradients).
        memory_mb: Most memory one batched pass may take (default :data:`BATCH_MEMORY_MB`).

    Returns:
        The blocks sampled, those left without samples, and what the loss weights assumed. A second call on the same
        capture (a later micro-batch's backward) keeps the first call's samples and returns an empty result.

    Raises:
        RuntimeError: If no logits were recorded (the logits module was not called with gradient tracking), or (with
            ``agree``) another rank cannot sample.
        ValueError: If the loss at the logits is not of ``kind``, or the kept tokens carry no loss weight.
    """
    if capture.sampled:  # a later backward of the same step (micro-batches): the first one's samples are kept
        capture.release()
        return Sampled()
    live = capture.live_outputs()
    out = Sampled()
    diverged = False
    capture.mark_sampled()
    buffers: dict[str, list[Any]] = {}  # block -> [samples (k, B, L, d_out) float32, rows as views, count]
    try:
        with monitor_passes():
            ready: tuple | None = None
            error: Exception | None = None
            try:
                if capture.logits is None and capture.logits_input is None:
                    raise RuntimeError(
                        f"the logits module {type(capture.logits_module).__name__} produced no output with gradient "
                        "tracking on this step; pass sharpness=curvwatch.Sharpness(logits_module='<name>') for the "
                        "module whose output the loss reads"
                    )
                if live:
                    ready = _prepare(capture, live, loss, kind, factor, grad_logits, samples, generator)
                    diverged = ready is None
            except Exception as err:
                ready, error = None, err
            if agree is not None and not agree(ready is not None) and ready is not None:
                raise RuntimeError(
                    "another rank cannot sample its output gradients at this step (its own message says why); every "
                    "rank skips the sampled backward passes, which run collectives under sharded training"
                )
            if error is not None:
                raise error
            if ready is None:  # no block output to sample, or a diverged loss (the engine flags the blocks)
                return out
            rows, sampler, draws, scale, out.note = ready
            start = capture.logits if capture.logits is not None else capture.logits_input
            sharded = capture.read_params is not None
            out.at_once = passes_at_once(live, start, samples, batched=batched, sharded=sharded, memory_mb=memory_mb)
            out.unbatched = _run_passes(capture, live, rows, sampler, samples, generator, draws, buffers, out.at_once)
            unit = max(sampler.unit, 1e-30)  # unit-sized cotangents: no underflow in low precision
            for item in live:
                samples_of = buffers.get(item.spec.name)
                if samples_of is not None and samples_of[2] == samples:
                    samples_of[0].mul_(unit)  # the draws were unit-sized (no underflow in low precision)
                    capture.store_samples(item.spec, samples_of[0], scale)
    finally:
        done = {name for name, b in buffers.items() if b[2] == samples}
        out.blocks = [item.spec.name for item in live if item.spec.name in done]
        out.unsampled = [] if diverged else [s.name for s in capture.sampleable() if s.name not in done]
        capture.release()
    return out


def passes_at_once(live: Sequence[LiveOutput], start: Tensor, samples: int, *, batched: bool | None = None,
                   sharded: bool = False, memory_mb: float | None = None) -> int:  # fmt: skip
    """How many of the ``samples`` sampled passes run as one batched backward pass; 1: one at a time.

    One at a time where a batch cannot run or should not:

    * ``batched=False``: the model has backward hooks of its own (the caller knows them), which would receive a batch
      of gradients in one call instead of one gradient per call;
    * ``batched=None`` on a CPU (unless :data:`BATCH_ON_CPU`): no faster there, and more memory;
    * ``sharded`` weights (FSDP2: the capture reads them with ``read_params``): every pass runs FSDP2's hooks, which
      all-gather each layer's weights for its backward and reshard them after, as for one backward pass;
    * memory: a batch of ``n`` samples holds ``n`` cotangents and ``n`` gradients at every block output at once
      (:func:`pass_bytes` each), so ``n`` is the most that fit in ``memory_mb`` (default :data:`BATCH_MEMORY_MB`).

    Args:
        live: The capture's live block outputs (:meth:`~curvwatch.capture.Capture.live_outputs`).
        start: Where the passes start: the logits, or a linear logits module's input.
        samples: ``k``.
        batched: ``True``: batch on any device; ``None``: where the device gains from it; ``False``: never.
        sharded: Whether the weights are sharded (FSDP2).
        memory_mb: Most memory one batched pass may take, in MiB.

    Example:
        >>> from curvwatch.capture import LiveOutput
        >>> outputs = [LiveOutput(None, torch.zeros(2, 4, 8), (2, 4))]
        >>> passes_at_once(outputs, torch.zeros(2, 4, 8), 16, batched=True, memory_mb=1)
        16
        >>> passes_at_once(outputs, torch.zeros(2, 4, 8), 16, batched=True, memory_mb=0.01)  # 10,485 B / 3,584 a sample
        2
        >>> passes_at_once(outputs, torch.zeros(2, 4, 8), 16, batched=True, sharded=True)
        1
        >>> passes_at_once(outputs, torch.zeros(2, 4, 8), 16)  # on a CPU
        1
    """
    if batched is None:
        batched = start.device.type != "cpu" or BATCH_ON_CPU
    if not batched or sharded or samples < 2:
        return 1
    budget = (BATCH_MEMORY_MB if memory_mb is None else memory_mb) * 2**20
    return int(max(1, min(samples, budget // max(pass_bytes(live, start), 1))))


def pass_bytes(live: Sequence[LiveOutput], start: Tensor) -> int:
    """Rough upper estimate of the memory one sample takes in a batched sampled pass, in bytes: its cotangent at
    ``start`` and its gradients at every block output in ``live`` (all held until the pass returns), and the backward's
    temporaries inside one block, 12 times the largest output (an FFN of width ``4 d``: its hidden gradients before and
    after the activation, measured 10-11 on CPU). An attention that materialises its ``(B, H, L, L)`` scores takes more
    where ``H L > 12 d``.

    Example:
        >>> from curvwatch.capture import LiveOutput
        >>> pass_bytes([LiveOutput(None, torch.zeros(2, 4, 8), (2, 4))], torch.zeros(2, 4, 8))  # (1 + 1 + 12) x 64 x 4
        3584
    """
    sizes = [item.output.numel() * item.output.element_size() for item in live]
    return start.numel() * start.element_size() + sum(sizes) + 12 * max(sizes, default=0)


def _run_passes(capture: Capture, live: list[LiveOutput], rows, sampler: LogitSampler, samples: int, generator,
                draws, buffers: dict[str, list[Any]], at_once: int = 1) -> str | None:  # fmt: skip
    """The ``samples`` backward passes, ``at_once`` at a time (batched backward passes), each pass's or batch's samples
    of every block copied into their float32 buffers in one ``_foreach_copy_`` (the buffer made at the first one): the
    samples are held once, in one dispatched operator per pass or batch instead of two to four per block and sample.
    Returns why a batched pass was run again one sample at a time (its error), or ``None``."""
    outputs = [item.output for item in live]
    unbatched, j = None, 0
    for start, cotangent in _cotangents(capture, rows, sampler, samples, generator, draws, at_once):
        if at_once > 1 and unbatched is None:
            try:
                cut = _batched_grads(capture, live, start, outputs, cotangent)
            except Exception as err:  # the same draws again one at a time (a hook or operator vmap cannot run)
                unbatched = f"{type(err).__name__}: {err}"
            else:
                _store(live, cut, buffers, samples, j, cotangent.shape[0])
                j += cotangent.shape[0]
                continue
        for one in cotangent.unbind(0) if at_once > 1 else (cotangent,):
            grads = torch.autograd.grad(start, outputs, grad_outputs=one, retain_graph=True, allow_unused=True)
            _store(live, [None if g is None else _first(capture, item, g) for item, g in zip(live, grads, strict=True)],
                   buffers, samples, j, 0)  # fmt: skip
            j += 1
    return unbatched


def _batched_grads(capture: Capture, live: list[LiveOutput], start: Tensor, outputs: list[Tensor],
                   cotangents: Tensor) -> list[Tensor | None]:  # fmt: skip
    """The gradients at every block output of the ``n`` ``cotangents`` ``(n, *start.shape)`` in one batched
    backward pass, each cut to the captured tokens: ``(n, k, l, d_out)`` per block (views), ``None`` for an output
    that does not reach ``start``."""
    unused: list[bool] = []

    def vjp(cotangent: Tensor) -> tuple[Tensor, ...]:
        grads = torch.autograd.grad(start, outputs, grad_outputs=cotangent, retain_graph=True, allow_unused=True)
        unused[:] = [g is None for g in grads]
        return tuple(_cut(capture, item, g) for item, g in zip(live, grads, strict=True) if g is not None)

    with warnings.catch_warnings():  # an operator without a batching rule runs once per sample: not the user's concern
        warnings.filterwarnings("ignore", message=_NO_BATCHING_RULE)
        found = iter(torch.func.vmap(vjp)(cotangents))
    return [None if skipped else next(found) for skipped in unused]


def _first(capture: Capture, item: LiveOutput, g: Tensor) -> Tensor:
    """A block output's gradient ``g`` cut to the captured tokens, batch-first ``(k, l, d_out)``, one view."""
    return first_tokens(item.spec.adapter.to_batch_first(item.spec, g), capture.max_tokens)


def _cut(capture: Capture, item: LiveOutput, g: Tensor) -> Tensor:
    """A block output's gradient ``g`` (the adapter's layout) cut to the captured tokens, batch-first ``(k, l, d_out)``
    (a view; slices, not :func:`~curvwatch.capture.first_tokens`' one strided view, so it also runs under vmap)."""
    g = item.spec.adapter.to_batch_first(item.spec, g)
    k, l = token_slice(g.shape[0], g.shape[1], capture.max_tokens)
    return g if (k, l) == tuple(g.shape[:2]) else g[:k, :l]


def _store(live: list[LiveOutput], cut: list[Tensor | None], buffers: dict[str, list[Any]], samples: int, j: int,
           n: int) -> None:  # fmt: skip
    """Copy sample ``j`` (``n = 0``: ``cut`` ``(k, l, d_out)`` per block) or samples ``j .. j + n - 1`` (``cut``
    ``(n, k, l, d_out)``) of every block into their float32 buffers ``(samples, k, l, d_out)``, in one operator
    (``None`` in ``cut``: the block output does not reach the logits)."""
    targets, sources = [], []
    for item, src in zip(live, cut, strict=True):
        if src is None:
            continue
        held = buffers.get(item.spec.name)
        if held is None:  # the buffer, its samples as views (made once, where one pass at a time needs them), count
            buffer = torch.empty((samples, *src.shape[1 if n else 0 :]), dtype=torch.float32, device=src.device)
            held = buffers[item.spec.name] = [buffer, None, 0]
        if not n and held[1] is None:
            held[1] = held[0].unbind(0)
        targets.append(held[1][j] if not n else held[0] if n == samples else held[0][j : j + n])
        sources.append(src)
        held[2] += max(n, 1)
    if targets:
        with torch.no_grad():  # every block's samples of this pass or batch in one operator (float32, any dtype in)
            torch._foreach_copy_(targets, sources)


def _prepare(capture: Capture, live: list[LiveOutput], loss, kind, factor: float, grad_logits: Tensor | None,
             samples: int, generator):  # fmt: skip
    """``(kept rows of the logits, LogitSampler, draws, scale, note)`` of :func:`sample_outputs` (``draws``: the
    samples at a linear logits module's input, else ``None``; ``scale``: the batch's total loss weight over the kept
    tokens'), or ``None`` when the loss's gradient at the logits is not finite (a diverged step)."""
    z, h = capture.logits, capture.logits_input
    if grad_logits is None:  # at the logits' edge: the logits of a linear module are not held
        (gz,) = torch.autograd.grad(loss, z if z is not None else capture.logits_edge, retain_graph=True)
    else:  # called from the backward with the logits' gradient
        gz = grad_logits
    # diverged: the blocks are flagged non-finite by the engine (amax and amin propagate NaN; no (N, V) mask)
    if not bool(torch.isfinite(torch.stack([gz.amax(), gz.amin()])).all()):
        return None
    B, L = live[0].batch_shape
    k, l = token_slice(B, L, capture.max_tokens)
    rows = _kept_rows(tuple(gz.shape[:-1]), B, L, k)  # the kept sequences' logits (no other row reaches them)
    if z is not None:
        kept, others = z.detach()[rows], z.detach()[_other_rows(rows)]
    else:  # rows recomputed from the linear module's input when read: no (rows, vocabulary) tensor held
        kept = _linear_logits(capture, h.detach()[rows])
        others = _linear_logits(capture, h.detach()[_other_rows(rows)])
    plan = None  # a linear logits module's draws read the kept rows' softmax in the loss weights' pass
    if z is None and LossKind(kind) is not LossKind.MSE:
        weight = capture.logits_module.weight.detach()
        plan = InputDraws(kept.shape[0], kept.shape[1], weight, samples, generator)
    on_chunk = None if plan is None else plan.chunk
    sampler, scale, note = _sampler(kept, others, gz, rows, kind, factor, l / L, z is not None, on_chunk)
    del kept, others, gz  # a logits-sized gradient: not held through the sampled passes
    draws = None
    if z is None:  # a linear logits module: the draws at its input, in one pass over the kept rows' tables (also
        # the norms: a sampler of several chunks of rows knows its unit only then)
        draws = sampler.input_draws(capture.logits_module.weight.detach(), samples, generator, plan=plan)
    if sampler.unit == 0:  # the kept tokens carry no loss weight: a sharpness of 0 would mean "no data"
        raise ValueError(
            f"the kept tokens (the first {k} sequence(s) of {B}, at most max_tokens={capture.max_tokens} "
            "positions) carry no loss weight (ignored or padded sequences, a zero loss weight), so this step "
            "has no real-loss curvature to measure; put scored sequences first in the batch or raise "
            "max_tokens"
        )
    return rows, sampler, draws, scale, note


def _linear_logits(capture: Capture, h: Tensor) -> LinearLogits:
    """The logits of the linear logits module as rows recomputed from its input ``h`` (batch-first 2-D view)."""
    module = capture.logits_module
    return LinearLogits(h.detach().reshape(-1, h.shape[-1]), module.weight, module.bias, capture.logits_dtype)


def _cotangents(capture: Capture, rows: tuple[slice, ...], sampler: LogitSampler, samples: int, generator, draws,
                at_once: int = 1) -> Iterator[tuple[Tensor, Tensor]]:  # fmt: skip
    """``(start, cotangent)`` of each sampled backward pass (``at_once = 1``), or ``(start, cotangents)`` of each batch
    of ``at_once`` passes (``(n, *start.shape)``, ``n`` fewer in the last batch): at the input ``h`` of a linear logits
    module, the ``draws`` carried back through it on the kept rows only (:meth:`LogitSampler.input_draws`: no
    logits-sized tensor, so the extra memory does not grow with the batch); else at the logits, logits-sized. The
    other rows stay zero; one buffer serves every pass or batch."""
    z, h = capture.logits, capture.logits_input
    start = h if z is None else z
    batch = torch.zeros((min(at_once, samples), *start.shape), dtype=start.dtype, device=start.device)
    kept = batch[(slice(None), *rows)].unbind(0)  # views: the kept rows of each sample
    one = batch[0]
    source = iter(draws) if z is None else None
    for j in range(0, samples, at_once):
        n = min(at_once, samples - j)
        for slot in kept[:n]:
            if source is not None:
                slot.copy_(next(source).view(slot.shape))
            else:
                sampler.draw_into(slot, generator)
        yield start, one if at_once == 1 else batch if n == batch.shape[0] else batch[:n]


def _kept_rows(lead: tuple[int, ...], B: int, L: int, k: int) -> tuple[slice, ...]:
    """Index of the logits rows of the kept sequences ``[:k]``, for logits ``(B, L, V)``, ``(L, B, V)`` or ``(B, V)``
    (one row per sequence); every row when the layout is none of these."""
    if lead in ((B, L), (B,)):
        return (slice(0, k),)
    if lead == (L, B):
        return (slice(None), slice(0, k))
    return (slice(None),)


def _other_rows(rows: tuple[slice, ...]) -> tuple[slice, ...]:
    """The index of the logits rows :func:`_kept_rows` leaves out (empty when it keeps every row)."""
    *lead, last = rows
    return (*lead, slice(last.stop, None)) if last.stop is not None else (slice(0, 0),)


def _sampler(
    kept: Tensor | LinearLogits, others: Tensor | LinearLogits, gz: Tensor, rows: tuple[slice, ...], kind,
    factor: float, positions: float, norms: bool = True, on_chunk=None,
):  # fmt: skip
    """``(LogitSampler of the kept rows, scale, note)``; ``scale`` = the batch's total loss weight over that of the
    kept tokens (a cut inside one sequence counts its share ``positions`` of them), ``note`` what
    :func:`~curvwatch.realloss.weights.loss_weights` assumed. ``kept``/``others``: the logits of the kept rows
    ``gz[rows]`` and of the other rows ``gz[_other_rows(rows)]`` (tensors, or rows recomputed on demand);
    ``on_chunk``: handed each chunk of the kept rows' softmax (:func:`~curvwatch.realloss.weights.loss_weights`)."""
    V = gz.shape[-1]
    kept, g_kept = kept.reshape(-1, V), gz[rows].reshape(-1, V)  # views where contiguous
    everything = g_kept.shape[0] * V == gz.numel()
    count = None  # what an assumed mean (label smoothing, squared error) runs over: the whole batch
    if LossKind(kind) is LossKind.MSE:
        count = gz.numel()
    elif LossKind(kind) in SOFT:  # the reduction named by the user: the whole batch's divisor
        count = soft_divisor(LossKind(kind), tuple(gz.shape))
    elif not everything:  # the rows with a gradient, counted in chunks (no (N, V) copies)
        flat, step = gz.reshape(-1, V), _chunk_rows(V)

        def count() -> int:  # only where loss_weights assumes a mean (label smoothing): hard labels need no count
            return sum(int(flat[i : i + step].ne(0).any(-1).sum()) for i in range(0, flat.shape[0], step))

    w, loss_kind, note = loss_weights(kept, g_kept, kind, count=count, on_chunk=on_chunk)  # a chunk of rows at a time
    total = float(w.sum())
    if not everything and note == LSE_TERM_NOTE:  # a z-loss: the other rows' weights from their whole rows
        total += float(loss_weights(others.reshape(-1, V), gz[_other_rows(rows)].reshape(-1, V), kind)[0].sum())
    elif not everything and assumes_mean(note):  # an assumed mean's weights sum to 1
        total = 1.0
    elif not everything and loss_kind in SOFT:  # the named reduction's weights depend on the shape alone
        total = float(loss_weights(gz, gz, loss_kind)[0].sum())
    elif not everything:  # hard labels: add the other rows' weights, a chunk of rows at a time
        total += total_weight(others, gz[_other_rows(rows)])
    kept_weight = float(w.sum()) * positions
    sampler = LogitSampler(kept, w * factor, loss_kind, norms=norms)
    return sampler, (total / kept_weight if kept_weight > 0 else 1.0), note
