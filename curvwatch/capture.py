"""Capturing block inputs and output gradients with hooks that exist only inside a ``with`` block.

:class:`Capture` registers, for each :class:`~curvwatch.adapters.BlockSpec`, three hooks, all removed in
``finally``:

* a forward *pre*-hook (with kwargs) on the adapter's input module, storing ``X`` and a snapshot of the
  weights (pre-hook, so that it runs before any sub-module of a composite input module); with ``read_params``
  (sharded training, :mod:`curvwatch.sharding`) no weights are kept: each block reads them as full tensors when
  it is evaluated (:attr:`CapturedBlock.params_fn`);
* a forward pre-hook on the layer's attention module, storing the masks (causal flag and key padding;
  the FFN and LayerNorm blocks use the key padding mask as their ``row_mask``);
* a forward hook on the output module that registers a *tensor* hook on the block output.

Why a tensor hook and not ``register_full_backward_hook``: the full backward hook wraps the module's
inputs and outputs in a ``BackwardHookFunction`` and raises when an output is a view modified in place
later (common in residual code) and fires for every call; a tensor hook belongs to the one output tensor
of the one recorded call, and PyTorch gives a hook registered before an in-place modification the gradient
with respect to the value the module produced. One exception: if the output is a *view* (``nn.Linear`` on
3-D input, Hugging Face ``Conv1D``) and is later modified in place, autograd replaces the view's
``grad_fn`` and the hook never fires; for such outputs the forward hook hands downstream code a copy
(``clone``, only on the captured step) and hooks the untouched original. Neither hook kind needs double
backward, so fused attention (SDPA) is fine.

**torch.compile.** Inside the ``with`` compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``,
restored on exit), so the captured step is the plain model's step, whatever graphs exist: dynamo does not guard
compiled graphs on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``), so a graph compiled on a step
without the hooks (an earlier step, an earlier fit, the LR finder) would run on the captured step without calling
them, and one compiled with them would replay the hooks of an old capture on later steps. The steps between
captures run the compiled graphs untouched; the captured step pays eager speed, and nothing is recompiled.

Only the first call of each module made with gradient tracking inside the ``with`` is recorded (later
calls, e.g. a validation forward or activation checkpointing's recomputation, are ignored; calls under
``torch.no_grad()`` cannot produce a gradient and are skipped). Everything is stored detached, on the
model's device, subsampled to at most ``max_tokens`` token positions:

* the first ``k`` whole sequences with ``k * L <= max_tokens``;
* if one sequence is longer than ``max_tokens``, the first ``max_tokens`` positions of the first sequence.
  For causal attention, LayerNorm and FFN a prefix is exact (the outputs of the prefix do not depend on
  later positions); for bidirectional attention it is an approximation (the prefix's queries lose the
  keys after it).

**Sampled output gradients** (the real loss's Gauss-Newton matrix, :mod:`curvwatch.sharpness`): given the module
whose output is the logits, the capture also keeps the live block outputs and the logits of the recorded calls,
and :meth:`Capture.sample_outputs` (called with the loss before the real backward, while the graph is alive)
back-propagates ``k`` sampled logit gradients to every block output at once (``torch.autograd.grad`` with
``retain_graph``: no parameter gradient is touched, the capture hooks ignore these passes); each block of a kind
that takes them then holds ``"output_samples"`` ``(k, B, L, d_out)``, cut to the same tokens as ``X``.

Padded positions count as tokens and are stored as they are; :meth:`CapturedBlock.reference_inputs` zeroes
their rows of ``X`` and ``grad_output`` before a closed form sees them (the closed forms also mask them), so
no statistic, ``term/x_norm`` included, depends on what a padded position holds.

The hooks never raise into the user's forward or backward: an exception inside one (an adapter that cannot
read an unusual module, say) is stored with the block and the phase it happened in, and :meth:`Capture.blocks`
raises it as a :class:`CaptureError`, so the caller decides whether to skip the step or to re-raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from curvwatch.adapters import BlockSpec, Masks, UnsupportedBlockError
from curvwatch.closed_form.settings import PARTS, Lanczos
from curvwatch.kinds import KINDS
from curvwatch.sharpness import (
    LSE_TERM_NOTE,
    SOFT,
    InputDraws,
    LinearLogits,
    LogitSampler,
    LossKind,
    _chunk_rows,
    loss_weights,
    soft_divisor,
    total_weight,
)

__all__ = ["Capture", "CaptureError", "CapturedBlock"]

_DTYPES = (torch.float32, torch.float64)

# Sampled backward passes in progress in this process, of any Capture (a list: mutable in place). Every Capture's
# gradient hooks ignore a gradient that arrives while it is non-zero, so a second monitor never reads the first one's
# sampled passes. Process-wide, not thread-local: on CUDA the autograd engine runs the hooks in its own threads.
_SAMPLING = [0]


@contextlib.contextmanager
def monitor_passes() -> Iterator[None]:
    """Backward passes of the monitor's own (the in-run check's Hessian-vector products) run inside this: every
    Capture ignores them, as it does the sampled passes (no gradient recorded, no backward pass counted)."""
    _SAMPLING[0] += 1
    try:
        yield
    finally:
        _SAMPLING[0] -= 1


def nonfinite_inputs(
    blocks: Sequence[CapturedBlock], extra: Sequence[Mapping[str, Tensor] | None] | None = None
) -> list[list[str]]:
    """For each block, the names of its captured float tensors holding NaN or Inf (``"X"``, ``"grad_output"``).

    One reduction for all the tensors (``torch._foreach_norm`` with ``ord=inf``: the largest ``|entry|``, which
    propagates NaN and is ``inf`` for ``-inf``; ~4x cheaper than ``isfinite(t).all()``) and **one** host read for all
    the blocks (a device sync); an empty tensor holds nothing non-finite.

    Args:
        blocks: The captured blocks.
        extra: Per block, more tensors to check in the same read (``{name: tensor}`` or None), e.g. the Adam
            preconditioner of its stability rule (``"precondition[W_Q]"``): their names join the block's list.
    """
    held = [{n: t for n, t in b.inputs.items() if t.is_floating_point() and n != "output_samples" and t.numel()}
            for b in blocks]  # fmt: skip
    for mine, more in zip(held, extra or [None] * len(blocks), strict=True):
        mine.update((n, t) for n, t in (more or {}).items() if t.numel())
    names = [list(mine) for mine in held]
    tensors = [t for mine in held for t in mine.values()]
    if not tensors:
        return [[] for _ in blocks]
    # the largest |entry| of every tensor in one operator (one kernel per device and dtype on a GPU)
    peaks = list(torch._foreach_norm(tensors, float("inf")))
    devices = {p.device for p in peaks}
    if len(devices) > 1:  # blocks on several devices (a model split by hand): one read per device
        peaks = [p.to(peaks[0].device) for p in peaks]
    finite = iter(torch.isfinite(torch.stack(peaks)).tolist())  # (stack promotes mixed dtypes)
    return [[n for n in ns if not next(finite)] for ns in names]


def vectors_held(max_iter: int, max_basis: int | None) -> int:
    """Lanczos vectors one norm holds at most: ``max_iter``, or fewer with ``max_basis`` (thick restarts)."""
    return max_iter if max_basis is None else min(max_iter, max_basis)


def token_slice(B: int, L: int, max_tokens: int) -> tuple[int, int]:
    """``(k, l)``: keep sequences ``[:k]`` and positions ``[:l]`` (see the module docstring).

    Example:
        >>> token_slice(4, 5, 12), token_slice(4, 5, 3), token_slice(4, 5, 100)
        ((2, 5), (1, 3), (4, 5))
    """
    if L <= max_tokens:
        return min(B, max_tokens // L), L
    return 1, max_tokens


class CaptureError(RuntimeError):
    """An exception raised inside a capture hook, with the block and the phase it happened in.

    Args:
        block: Block name, e.g. ``"layer0/attn"``.
        phase: ``"forward input hook"``, ``"forward mask hook"``, ``"forward output hook"`` or
            ``"backward hook"``.
        error: The original exception (also the ``__cause__``).
    """

    def __init__(self, block: str, phase: str, error: BaseException) -> None:
        super().__init__(f"capturing block '{block}' failed in the {phase}: {type(error).__name__}: {error}")
        self.block = block
        self.phase = phase
        self.error = error


def _sample_slot(rec: _Record, j: int, samples: int, t: Tensor, max_tokens: int) -> tuple[Tensor, Tensor]:
    """``(destination, source)`` of sample ``j`` of ``samples``: the record's float32 buffer's row ``j`` (the buffer
    made at the first sample, its rows as views once) and the first tokens of the ``(B, L, d_out)`` sampled output
    gradient ``t`` (one view). :meth:`Capture.sample_outputs` copies every block's sample of a pass in one
    ``_foreach_copy_``: the samples are held once, not as clones that :meth:`Capture.blocks` stacked into a second
    copy (at the GPU shape, 512 kept tokens of width 768, 16 samples: 24 MiB per block), in one dispatched operator
    per pass instead of two to four per block."""
    src = _first_tokens(t, max_tokens)
    if rec.samples is None:
        rec.samples = torch.empty((samples, *src.shape), dtype=torch.float32, device=src.device)
        rec.slots = rec.samples.unbind(0)
    return rec.slots[j], src


def _first_tokens(t: Tensor, max_tokens: int) -> Tensor:
    """The first tokens (:func:`token_slice`) of a ``(B, L, ...)`` tensor: ``t`` itself when every token is kept, else
    one view (``t[:k, :l]`` took two)."""
    k, l = token_slice(t.shape[0], t.shape[1], max_tokens)
    if (k, l) == tuple(t.shape[:2]):
        return t
    return t.as_strided((k, l, *t.shape[2:]), t.stride(), t.storage_offset())


def _keep(t: Tensor, max_tokens: int) -> Tensor:
    """Detached copy of the first tokens of a ``(B, L, ...)`` tensor."""
    with torch.no_grad():  # (a clone without autograd history)
        return _first_tokens(t, max_tokens).clone()


@dataclass
class CapturedBlock:
    """Everything one closed form needs for one sub-block, captured on one step.

    Args:
        spec: The block.
        inputs: Detached tensors: ``"X"`` ``(B, L, d)``, ``"grad_output"`` ``(B, L, d_out)`` and, if the
            batch has padding, ``"key_padding_mask"`` (attention; True = padded) or ``"row_mask"`` (LayerNorm
            and FFN; True = keep), both ``(B, L)`` bool; with sampling, ``"output_samples"`` ``(k, B, L, d_out)``.
        params: Detached weight snapshot and settings read by the adapter at forward time (math convention
            ``(d_in, d_out)``), plus ``causal`` for attention.
        reason: Why the block cannot be evaluated (no gradient arrived, unsupported setting, ...), else
            ``None``.
        params_fn: Reads the weights now, as full tensors (sharded training: a collective every rank calls for
            every block in the same order), or ``None`` when ``params`` holds them already. :meth:`with_params`
            calls it.
        sample_scale: With ``"output_samples"``: the batch's total loss weight over that of the kept tokens, by
            which the real-loss keys (``ggn/...``, ``sharpness/...``) of the kept tokens are scaled up to estimate
            the whole batch's (1 when every token is kept).
    """

    spec: BlockSpec
    inputs: dict[str, Tensor] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    params_fn: Callable[[], dict[str, Any]] | None = None
    sample_scale: float = 1.0

    def with_params(self) -> CapturedBlock:
        """The block with its weights in ``params``: ``params_fn()`` (read now) merged under the call's settings.

        Keep the result only while evaluating the block: under sharding it holds the block's full weights.

        Raises:
            UnsupportedBlockError: If the adapter cannot read the block's weights.
        """
        if self.params_fn is None:
            return self
        return dataclasses.replace(self, params={**self.params_fn(), **self.params}, params_fn=None)

    @property
    def tokens(self) -> int:
        """Token positions captured, ``B * L`` (padded ones included); 0 for a block without inputs."""
        X = self.inputs.get("X")
        return 0 if X is None else X.shape[0] * X.shape[1]

    def truncate(self, max_tokens: int) -> CapturedBlock:
        """The same block keeping at most ``max_tokens`` token positions, by the rule of :func:`token_slice`.

        Example:
            >>> block = CapturedBlock(None, inputs={"X": torch.zeros(4, 5, 2), "grad_output": torch.zeros(4, 5, 2)})
            >>> block.truncate(12).tokens, block.truncate(3).tokens, block.truncate(100).tokens
            (10, 3, 20)
        """
        X = self.inputs.get("X")
        if X is None or X.shape[0] * X.shape[1] <= max_tokens:
            return self
        k, l = token_slice(X.shape[0], X.shape[1], max_tokens)
        inputs = {name: _cut(name, t, k, l) for name, t in self.inputs.items()}
        scale = self.sample_scale * X.shape[0] * X.shape[1] / (k * l)  # the tokens dropped now, by their share
        return dataclasses.replace(self, inputs=inputs, sample_scale=scale if "output_samples" in inputs else 1.0)

    def nonfinite(self) -> list[str]:
        """Names of the captured float tensors holding NaN or Inf (``"X"``, ``"grad_output"``), one device sync."""
        return nonfinite_inputs([self])[0]

    def evaluation_bytes(
        self, dtype: torch.dtype = torch.float32, max_iter: int = 20, max_basis: int | None = None
    ) -> int:
        """Rough upper estimate of the extra memory :meth:`evaluate` allocates, in bytes.

        With ``n_W`` the elements of one Lanczos vector of the block (its kind's ``basis_numel``: ``W_Q`` per
        head group for attention, ``W_1`` for an FFN), the element size of ``dtype`` and ``k = min(max_iter,
        max_basis)`` the Lanczos vectors held per norm: the kind's ``work_elements`` (attention ``32 B H L^2 +
        64 B L d``, the per-head ``(B, H, L, L)`` tangents of the Lanczos products; FFN ``32 B L d_ff``; LayerNorm
        ``16 B L d``) plus ``6 k n_W`` (the Lanczos bases: :meth:`basis_bytes`); with ``output_samples`` (the
        real-loss keys) twice the work and three times the bases: the sampled keys' Lanczos members hold bases of
        their own, solved together with the engine's (the attention's ``QQ`` and ``KK`` runs, 12 rows of ``n_W``
        beside its own 6), beside the Gram columns and their products' rows. The factors bound the peaks measured on
        CPU with the default diagonal pairs (docs/metrics.md, "Cost"); ``pairs="all"`` takes more.
        """
        X = self.inputs.get("X")
        if X is None:
            return 0
        B, L, d = X.shape
        itemsize = dtype.itemsize
        n = KINDS[self.spec.kind].work_elements(B, L, d, self.params)
        return self._sampled_factor() * n * itemsize + self.basis_bytes(dtype, vectors_held(max_iter, max_basis))

    def basis_bytes(self, dtype: torch.dtype = torch.float32, vectors: int = 20) -> int:
        """The Lanczos bases' share of :meth:`evaluation_bytes`: ``6 vectors n_W`` elements (0 without Lanczos),
        three times that with ``output_samples`` (the sampled keys' runs, solved together with the engine's).

        It does not depend on the tokens: only ``max_basis`` (thick restarts) bounds it. The engine lets a kernel's
        runs share their stopping tests while their bases stay within it (``Lanczos.solve_bytes``).
        """
        if self.inputs.get("X") is None:
            return 0
        numel = KINDS[self.spec.kind].basis_numel(self.params)
        rows = 18 if self._sampled_factor() > 1 else 6
        return rows * vectors * numel * dtype.itemsize

    def _sampled_factor(self) -> int:
        """2 where the block holds ``output_samples`` (its evaluation computes the real-loss keys too), else 1."""
        return 2 if "output_samples" in self.inputs else 1

    def reference_inputs(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The keyword arguments passed to the closed form (all of them, ``X``/``Y`` and weights included), grouped as
        the kernel takes them (:attr:`~curvwatch.kinds.BlockKind.prepare`); the ground truths of
        :mod:`curvwatch.reference` take the same.

        Args:
            dtype: Cast floating tensors to it (``None``: keep the captured dtype). Masks stay bool.

        Raises:
            RuntimeError: If the block was not captured completely (``reason`` says why).
        """
        if self.reason is not None:
            raise RuntimeError(f"Block {self.spec.name!r} cannot be evaluated: {self.reason}")
        if self.params_fn is not None:
            return self.with_params().reference_inputs(dtype)
        kind = KINDS[self.spec.kind]
        kwargs: dict[str, Any] = {kind.input_name: self.inputs["X"]}
        kwargs.update(self.params)
        kwargs.update({k: v for k, v in self.inputs.items() if k not in ("X", "grad_output")})
        kwargs["grad_output"] = self.inputs.get("grad_output")
        mask = kwargs[kind.mask_name] = self.inputs.get(kind.mask_name)
        if mask is not None:  # padded rows carry no information: no statistic may see their values
            padded = (mask if kind.mask_name == "key_padding_mask" else ~mask)[..., None]
            for name in (kind.input_name, "grad_output", "output_samples"):
                if isinstance(kwargs.get(name), Tensor):
                    kwargs[name] = kwargs[name].masked_fill(padded, 0.0)
        if dtype is not None:
            kwargs = _cast(kwargs, dtype)
        return kind.kernel_kwargs(kwargs)

    def evaluate(
        self,
        *,
        lanczos: Lanczos | None = None,
        dtype: torch.dtype = torch.float64,
        pairs: Sequence[str] | None = None,
        parts: Sequence[str] = PARTS,
        precondition: dict[str, Tensor] | None = None,
        signals: bool = False,
    ):
        """Run the closed form on the captured tensors.

        Args:
            lanczos: Settings of the iterative norms (attention, FFN; ``None``: the closed forms' default), its
                ``warm_start`` kept between evaluations of this block.
            dtype: ``torch.float32`` or ``torch.float64``; inputs and weights are cast to it.
            pairs: block pairs to compute (attention: ``VV, QQ, KK, VQ, VK, QK, QKV``; FFN: ``W1W1, W2W2,
                W1W2``); pairs of the other kind are ignored. ``None``: all of the kernel's pairs.
            parts: Hessian parts of the iterative norms (attention, FFN): a subset of ``("outer", "functional",
                "hessian")``.
            precondition: ``{weight name: P}`` in the kernel's weight layout (Adam's ``sqrt(v_hat) + eps``), for
                the ``precond_sharpness/...`` keys of a block with ``output_samples``; ``None``: none.
            signals: Pass the kind's :attr:`~curvwatch.kinds.BlockKind.signal_kwargs` too: only what the warning
                rules read (and ``pairs``).

        Returns:
            ``dict[str, Tensor]`` of 0-d tensors keyed relative to the block (``"outer/QQ/h0"``, ...).

        Raises:
            ValueError: If ``dtype`` is not float32/float64, or the closed form does not support a setting
                of the block (e.g. its activation).
            RuntimeError: If the block was not captured completely (``reason`` says why).
        """
        if dtype not in _DTYPES:
            raise ValueError(f"Invalid dtype={dtype}. Must be torch.float32 or torch.float64.")
        kind = KINDS[self.spec.kind]
        kwargs = self.reference_inputs(dtype)
        if kind.iterative:
            kwargs.update(lanczos=lanczos, parts=parts)
            if pairs is not None:
                kwargs["pairs"] = [p for p in dict.fromkeys(pairs) if p in kind.pairs]
        if "output_samples" in self.inputs and precondition is not None:
            kwargs["precondition"] = _cast(precondition, dtype)
        if signals and kind.signal_kwargs:
            kwargs.update(kind.signal_kwargs)
        return kind.kernel()(**kwargs)


class _Record:
    """Mutable per-spec state filled by the hooks."""

    def __init__(self) -> None:
        self.X: Tensor | None = None
        self.params: dict[str, Any] | None = None
        self.masks: Masks | None = None
        self.grad: Tensor | None = None
        self.output: Tensor | None = None  # the live block output (sampling only), released after sampling
        # the sampled output gradients of the kept tokens, (k, B, L, d_out) float32, written one pass at a time
        self.samples: Tensor | None = None
        self.slots: tuple[Tensor, ...] = ()  # its rows, one per sample (views)
        self.n_samples = 0
        self.shape: tuple[int, int] | None = None  # (B, L) of the whole batch, before the token cut
        self.sample_scale = 1.0
        self.output_seen = False
        self.reason: str | None = None
        self.error: tuple[str, BaseException] | None = None  # (phase, exception) of the first hook failure

    def fail(self, phase: str, error: BaseException) -> None:
        if self.error is None:
            self.error = (phase, error)


def _cut(name: str, t: Tensor, k: int, l: int) -> Tensor:
    """A stored input cut to sequences ``[:k]`` and positions ``[:l]`` (memory by sequence only; samples
    ``(n, B, L, ...)`` behind their sample dimension)."""
    if name.startswith("memory"):
        return t[:k]
    return t[:, :k, :l] if name == "output_samples" else t[:k, :l]


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
    :func:`~curvwatch.sharpness.loss_weights` assumed. ``kept``/``others``: the logits of the kept rows ``gz[rows]`` and
    of the other rows ``gz[_other_rows(rows)]`` (tensors, or rows recomputed on demand); ``on_chunk``: handed each chunk
    of the kept rows' softmax (:func:`~curvwatch.sharpness.loss_weights`)."""
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
    elif not everything and note is not None:  # an assumed mean's weights sum to 1
        total = 1.0
    elif not everything and loss_kind in SOFT:  # the named reduction's weights depend on the shape alone
        total = float(loss_weights(gz, gz, loss_kind)[0].sum())
    elif not everything:  # hard labels: add the other rows' weights, a chunk of rows at a time
        total += total_weight(others, gz[_other_rows(rows)])
    kept_weight = float(w.sum()) * positions
    sampler = LogitSampler(kept, w * factor, loss_kind, norms=norms)
    return sampler, (total / kept_weight if kept_weight > 0 else 1.0), note


def _is_linear_of(module: torch.nn.Linear, h: Tensor, z: Tensor) -> bool:
    """Whether the logits ``z`` are ``module``'s linear map of ``h`` (checked on the first row, which every cut keeps,
    to 1%: a subclass or another forward hook that changes them, e.g. a scaling, keeps the logits themselves)."""
    if h.shape[:-1] != z.shape[:-1] or h.shape[-1] != module.in_features or z.shape[-1] != module.out_features:
        return False
    if h.numel() == 0 or z.numel() == 0:
        return False
    first = (0,) * (z.dim() - 1)  # the first row, without reshaping (a copy of non-contiguous logits)
    h_row, z_row = h.detach()[first][None], z.detach()[first][None]
    with torch.autocast(h.device.type, enabled=False):
        bias = None if module.bias is None else module.bias.detach().float()
        again = torch.nn.functional.linear(h_row.float(), module.weight.detach().float(), bias)
    return bool((again - z_row.float()).norm() <= 1e-2 * z_row.float().norm() + 1e-30)


def _snapshot(params: dict[str, Any]) -> dict[str, Any]:
    """Detached copies of the tensors in ``params`` (nested dicts too: a QK-norm's weights)."""
    with torch.no_grad():  # a clone without autograd history: one operator (a detach and a clone were two)
        return {
            k: v.clone() if isinstance(v, Tensor) else _snapshot(v) if isinstance(v, dict) else v
            for k, v in params.items()
        }


def _cast(kwargs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Floating tensors in ``kwargs`` (nested dicts too) cast to ``dtype``; masks and settings unchanged."""
    return {
        k: v.to(dtype)
        if isinstance(v, Tensor) and v.is_floating_point()
        else _cast(v, dtype)
        if isinstance(v, dict)
        else v
        for k, v in kwargs.items()
    }


class Capture:
    """Context manager that records block inputs and output gradients of one forward/backward.

    Args:
        specs: Blocks to capture, from :func:`~curvwatch.adapters.find_blocks`.
        max_tokens: Keep at most this many token positions per block (see the module docstring).
        seed: Reserved for random subsampling; the current rule (first sequences) is deterministic.
        read_params: Sharded training: reads one block's weights as full tensors
            (:func:`curvwatch.sharding.full_params`, ...); the capture then keeps no weights and each
            :class:`CapturedBlock` reads its own through ``params_fn`` when evaluated. ``None`` (default): a
            snapshot of each block's weights is taken in the forward pass.
        logits_module: The module whose output is the logits (:func:`curvwatch.sharpness.find_logits_module`):
            its output and the block outputs are kept for :meth:`sample_outputs`. ``None``: no sampling.

    Raises:
        ValueError: If ``max_tokens < 1`` or ``specs`` is empty.

    Example:
        >>> from curvwatch.adapters import find_blocks
        >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        >>> with Capture(find_blocks(layer), max_tokens=10) as capture:
        ...     layer(torch.randn(3, 4, 8)).square().sum().backward()
        >>> [(b.spec.name, tuple(b.inputs["X"].shape)) for b in capture.blocks()][:2]
        [('layer0/attn', (2, 4, 8)), ('layer0/ln_1', (2, 4, 8))]
    """

    def __init__(
        self,
        specs: list[BlockSpec],
        max_tokens: int,
        seed: int = 0,
        read_params: Callable[[BlockSpec], dict[str, Any]] | None = None,
        logits_module: torch.nn.Module | None = None,
    ) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"Invalid max_tokens={max_tokens!r}. Must be an int >= 1.")
        specs = list(specs)
        if not specs:
            raise ValueError("Invalid specs=[]. Pass the non-empty list returned by find_blocks.")
        self.specs = specs
        self.max_tokens = max_tokens
        self.seed = seed
        self.read_params = read_params
        self.logits_module = logits_module
        self._records = [_Record() for _ in specs]
        self._handles: list[Any] = []
        self._stance: Any = None  # the compiler stance set while the capture is open
        self._logits: Tensor | None = None
        # a linear logits module's input and the logits' gradient edge, instead of the logits (sampling only)
        self._logits_input: Tensor | None = None
        self._logits_edge: Any = None
        self._logits_dtype: torch.dtype | None = None
        self.sample_note: str | None = None  # what sample_outputs had to assume about the loss
        self.unsampled: list[str] = []  # blocks of sampled kinds sample_outputs could not reach
        self._sampled = False  # sample_outputs ran on this capture
        self._n_sampled = 0  # the blocks it sampled
        #: Backward passes through the logits while the capture was open, the sampled ones not counted (more than one:
        #: micro-batches under manual optimization; the first one is the one captured and sampled).
        self.backwards = 0
        #: Called with the logits' gradient during the backward when :meth:`sample_outputs` was not called before
        #: it (a loop that does not hand the loss over): it samples there, while the graph below the logits lives.
        self.on_logits_grad: Callable[[Tensor], None] | None = None

    @property
    def sampled(self) -> bool:
        """Whether :meth:`sample_outputs` ran on this capture (once per step: later calls keep its samples)."""
        return self._sampled

    # -- context manager --------------------------------------------------------------------------

    def __enter__(self) -> Capture:
        if self._handles:
            raise RuntimeError("This Capture is already active; use a new Capture per step.")
        self._records = [_Record() for _ in self.specs]
        self._logits = self._logits_input = self._logits_edge = None
        self._stance = torch.compiler.set_stance("force_eager")  # see the module docstring; restored in __exit__
        self._sampled, self._n_sampled, self.backwards = False, 0, 0
        try:
            if self.logits_module is not None:
                self._handles.append(self.logits_module.register_forward_hook(self._on_logits))
            for spec, rec in zip(self.specs, self._records, strict=True):
                input_module, output_module, mask_module = spec.adapter.capture_modules(spec)
                self._handles.append(
                    input_module.register_forward_pre_hook(
                        functools.partial(self._on_input, spec, rec), with_kwargs=True
                    )
                )
                self._handles.append(
                    mask_module.register_forward_pre_hook(functools.partial(self._on_mask, spec, rec), with_kwargs=True)
                )
                self._handles.append(output_module.register_forward_hook(functools.partial(self._on_output, spec, rec)))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()
        self._release()

    def _release(self) -> None:
        """Drop the references to live graph tensors (block outputs, logits and their module's input)."""
        self._logits = self._logits_input = self._logits_edge = None
        for rec in self._records:
            rec.output = None

    def _remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        stance, self._stance = self._stance, None
        if stance is not None:
            stance.__exit__(None, None, None)

    # -- hooks ------------------------------------------------------------------------------------

    # Each hook catches everything it raises (recorded, re-raised by ``blocks``): the user's step never sees it.

    def _on_input(self, spec: BlockSpec, rec: _Record, module, args, kwargs) -> None:
        if rec.X is not None or rec.reason or rec.error or not torch.is_grad_enabled():
            return
        try:
            X = spec.adapter.read_input(spec, args, kwargs)
            rec.shape = (X.shape[0], X.shape[1])
            rec.X = _keep(X, self.max_tokens)
            if self.read_params is None:  # sharded: the weights are read at evaluation, one block at a time
                rec.params = _snapshot(spec.adapter.read_params(spec))
        except UnsupportedBlockError as err:
            rec.reason = str(err)
        except Exception as err:
            rec.fail("forward input hook", err)

    def _on_mask(self, spec: BlockSpec, rec: _Record, module, args, kwargs) -> None:
        if rec.masks is not None or rec.reason or rec.error or not torch.is_grad_enabled():
            return
        try:
            self._read_masks(spec, rec, args, kwargs)
        except UnsupportedBlockError as err:
            rec.reason = str(err)
        except Exception as err:
            rec.fail("forward mask hook", err)

    def _read_masks(self, spec: BlockSpec, rec: _Record, args, kwargs) -> None:
        masks = spec.adapter.read_masks(spec, args, kwargs)
        kpm = masks.key_padding_mask
        if kpm is not None:
            k, l = token_slice(kpm.shape[0], kpm.shape[1], self.max_tokens)
            kpm = kpm.detach()[:k, :l].to(torch.bool).clone()
            kpm = kpm if kpm.any() else None
        rec.masks = dataclasses.replace(masks, key_padding_mask=kpm)  # rotary tables, memory: cut by the kind

    def _on_output(self, spec: BlockSpec, rec: _Record, module, args, output) -> Any:
        if rec.X is None or rec.output_seen or rec.error or not torch.is_grad_enabled():
            return None
        rec.output_seen = True
        try:
            return self._hook_output(spec, rec, module, output)
        except Exception as err:
            rec.fail("forward output hook", err)
            return None

    def _hook_output(self, spec: BlockSpec, rec: _Record, module, output) -> Any:
        out = spec.adapter.read_output(spec, output)
        if not out.requires_grad:
            rec.reason = (
                f"the output of {type(module).__name__} does not require grad (frozen block, no trainable "
                "parameter upstream?), so no gradient can reach it"
            )
            return None
        self._handles.append(out.register_hook(functools.partial(self._on_grad, spec, rec)))
        if self.logits_module is not None and KINDS[spec.kind].sampled:
            rec.output = out
        if not out._is_view():
            return None
        # A hook on a view is lost if the view is later modified in place (autograd regenerates the view's
        # grad_fn), so downstream code gets a copy and the hooked original stays untouched.
        copy = out.clone()
        if isinstance(output, Tensor):
            return copy
        return type(output)(copy if item is out else item for item in output)

    def _has_logits(self) -> bool:
        return self._logits is not None or self._logits_input is not None

    def _on_logits(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        out = output if isinstance(output, Tensor) else getattr(output, "logits", None)
        if not (isinstance(out, Tensor) and out.requires_grad):
            return
        # every forward's logits count their backward pass; only the first is kept (a later micro-batch's are not
        # sampled: its block inputs and gradients are not the captured ones)
        self._handles.append(out.register_hook(self._on_logits_grad))
        if self._has_logits() or self._sampled:
            return
        # (not under sharding: the module's weight is a shard outside its forward, so the draws at its input, made
        # after the forward, could not use it; the logits themselves are kept there)
        linear_ok = isinstance(module, torch.nn.Linear) and len(args) == 1 and self.read_params is None
        h = args[0] if linear_ok else None
        try:
            linear = isinstance(h, Tensor) and h.requires_grad and _is_linear_of(module, h, out)
        except Exception:  # never into the user's forward: the logits path below works for any module
            linear = False
        if linear:  # keep its input (saved by the module anyway) and the logits' place in the graph only
            self._logits_input, self._logits_edge = h, get_gradient_edge(out)
            self._logits_dtype = out.dtype
        else:  # any other module: keep the logits themselves (a logits-sized tensor)
            self._logits = out

    def _on_logits_grad(self, grad: Tensor) -> None:
        if _SAMPLING[0]:
            return  # one of the sampled backward passes (or the gradient read before the backward)
        self.backwards += 1
        if self._sampled or not self._has_logits() or self.on_logits_grad is None:
            return  # sampled already (before the backward, or in an earlier backward of this step)
        self.on_logits_grad(grad)

    def _on_grad(self, spec: BlockSpec, rec: _Record, grad: Tensor) -> None:
        if rec.grad is not None or rec.error or _SAMPLING[0]:
            return
        try:
            rec.grad = _keep(spec.adapter.to_batch_first(spec, grad), self.max_tokens)
        except Exception as err:
            rec.fail("backward hook", err)

    # -- sampled output gradients --------------------------------------------------------------------

    def sample_outputs(
        self,
        loss: Tensor | None,
        samples: int,
        *,
        kind: str | LossKind = "auto",
        factor: float = 1.0,
        generator: torch.Generator | None = None,
        grad_logits: Tensor | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> int:
        """Back-propagate ``samples`` sampled logit gradients to every kept block output (see the module docstring).

        Call it with the loss after the forward and before its backward (Lightning's ``on_before_backward``).

        Args:
            loss: The loss tensor about to be back-propagated (its gradient at the logits gives the loss weights,
                :func:`curvwatch.sharpness.loss_weights`).
            samples: ``k``, the samples per block (one backward pass from the logits each).
            kind: The loss at the logits: ``"auto"``, ``"cross_entropy"``, ``"mse"``, or soft targets with their
                reduction, ``"soft_mean"``, ``"soft_batchmean"``, ``"soft_sum"``
                (:func:`~curvwatch.sharpness.loss_weights`).
            factor: Multiplies the loss weights (undoes Lightning's accumulation and AMP factors of ``loss``).
            generator: Random source for the sampled labels.
            grad_logits: The loss's gradient at the logits, when called from the backward (:attr:`on_logits_grad`)
                instead of before it; ``loss`` is then not used.
            agree: Several ranks: called once on every rank, whatever happens locally, just before the sampled
                passes, with whether this rank can run them; returns whether every rank can. Under FSDP2 each pass
                all-gathers the weights of the layers it runs through (a collective), so either every rank runs
                the ``samples`` passes or none does (the others then raise a ``RuntimeError`` saying so).

        Returns:
            The blocks that received samples.

        Raises:
            RuntimeError: If no logits were recorded (the logits module was not called with gradient tracking), or
                (with ``agree``) another rank cannot sample.
            ValueError: If the loss at the logits is not of ``kind`` (:func:`~curvwatch.sharpness.loss_weights`).
        """
        if self._sampled:  # a later backward of the same step (micro-batches): the first one's samples are kept
            self._release()
            return self._n_sampled
        z, h = self._logits, self._logits_input
        live = [
            (spec, rec)
            for spec, rec in zip(self.specs, self._records, strict=True)
            if rec.output is not None and rec.error is None and rec.reason is None
        ]
        diverged = counted = False
        self._sampled = True
        try:
            ready: tuple[tuple[slice, ...], LogitSampler, Any] | None = None
            error: Exception | None = None
            try:
                if z is None and h is None:
                    raise RuntimeError(
                        f"the logits module {type(self.logits_module).__name__} produced no output with gradient "
                        "tracking on this step; pass sharpness=curvwatch.Sharpness(logits_module='<name>') for the "
                        "module whose output the loss reads"
                    )
                _SAMPLING[0] += 1
                counted = True
                if live:
                    ready = self._prepare_sampling(z, h, live, loss, kind, factor, grad_logits, samples, generator)
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
                return 0
            rows, sampler, draws = ready
            outputs = [rec.output for _, rec in live]
            unit = max(sampler.unit, 1e-30)  # unit-sized cotangents: no underflow in low precision
            for j, (start, cotangent) in enumerate(self._cotangents(z, rows, sampler, samples, generator, draws)):
                grads = torch.autograd.grad(
                    start, outputs, grad_outputs=cotangent, retain_graph=True, allow_unused=True
                )
                slots = [
                    (rec, *_sample_slot(rec, j, samples, spec.adapter.to_batch_first(spec, s), self.max_tokens))
                    for (spec, rec), s in zip(live, grads, strict=True)
                    if s is not None  # None: the block output does not reach the logits
                ]
                if slots:
                    with torch.no_grad():  # every block's sample of this pass in one operator (float32, any dtype in)
                        torch._foreach_copy_([d for _, d, _ in slots], [t for _, _, t in slots])
                    for rec, _, _ in slots:
                        rec.n_samples += 1
            for _, rec in live:
                if rec.n_samples == samples:
                    rec.samples.mul_(unit)  # the draws were unit-sized (no underflow in low precision)
        finally:
            sampled = {id(rec) for _, rec in live if rec.n_samples == samples}
            self.unsampled = (
                []
                if diverged
                else [
                    spec.name
                    for spec, rec in zip(self.specs, self._records, strict=True)
                    if KINDS[spec.kind].sampled and rec.reason is None and id(rec) not in sampled
                ]
            )
            if counted:
                _SAMPLING[0] -= 1
            self._release()
            self._n_sampled = len(sampled)
        return len(sampled)

    def _prepare_sampling(self, z: Tensor | None, h: Tensor | None, live, loss, kind, factor: float,
                          grad_logits: Tensor | None, samples: int, generator):  # fmt: skip
        """``(kept rows of the logits, LogitSampler, draws)`` of :meth:`sample_outputs` (the blocks' ``sample_scale``
        set; ``draws``: the samples at a linear logits module's input, else ``None``), or ``None`` when the loss's
        gradient at the logits is not finite (a diverged step)."""
        if grad_logits is None:  # at the logits' edge: the logits of a linear module are not held
            (gz,) = torch.autograd.grad(loss, z if z is not None else self._logits_edge, retain_graph=True)
        else:  # called from the backward with the logits' gradient (on_logits_grad)
            gz = grad_logits
        # diverged: the blocks are flagged non-finite by the engine (amax and amin propagate NaN; no (N, V) mask)
        if not bool(torch.isfinite(torch.stack([gz.amax(), gz.amin()])).all()):
            return None
        B, L = live[0][1].shape
        k, l = token_slice(B, L, self.max_tokens)
        rows = _kept_rows(tuple(gz.shape[:-1]), B, L, k)  # the kept sequences' logits (no other row reaches them)
        if z is not None:
            kept, others = z.detach()[rows], z.detach()[_other_rows(rows)]
        else:  # rows recomputed from the linear module's input when read: no (rows, vocabulary) tensor held
            kept = self._linear_logits(h.detach()[rows])
            others = self._linear_logits(h.detach()[_other_rows(rows)])
        plan = None  # a linear logits module's draws read the kept rows' softmax in the loss weights' pass
        if z is None and LossKind(kind) is not LossKind.MSE:
            weight = self.logits_module.weight.detach()
            plan = InputDraws(kept.shape[0], kept.shape[1], weight, samples, generator)
        on_chunk = None if plan is None else plan.chunk
        sampler, scale, self.sample_note = _sampler(
            kept, others, gz, rows, kind, factor, l / L, z is not None, on_chunk
        )
        del kept, others, gz  # a logits-sized gradient: not held through the sampled passes
        draws = None
        if z is None:  # a linear logits module: the draws at its input, in one pass over the kept rows' tables (also
            # the norms: a sampler of several chunks of rows knows its unit only then)
            draws = sampler.input_draws(self.logits_module.weight.detach(), samples, generator, plan=plan)
        if sampler.unit == 0:  # the kept tokens carry no loss weight: a sharpness of 0 would mean "no data"
            raise ValueError(
                f"the kept tokens (the first {k} sequence(s) of {B}, at most max_tokens={self.max_tokens} "
                "positions) carry no loss weight (ignored or padded sequences, a zero loss weight), so this step "
                "has no real-loss curvature to measure; put scored sequences first in the batch or raise "
                "max_tokens"
            )
        for _, rec in live:
            rec.sample_scale = scale
        return rows, sampler, draws

    def _linear_logits(self, h: Tensor) -> LinearLogits:
        """The logits of the linear logits module as rows recomputed from its input ``h`` (batch-first 2-D view)."""
        module = self.logits_module
        return LinearLogits(h.detach().reshape(-1, h.shape[-1]), module.weight, module.bias, self._logits_dtype)

    def _cotangents(self, z: Tensor | None, rows: tuple[slice, ...], sampler: LogitSampler, samples: int, generator,
                    draws):  # fmt: skip
        """``(start, cotangent)`` of each sampled backward pass: at the input ``h`` of a linear logits module, the
        ``draws`` carried back through it on the kept rows only (:meth:`LogitSampler.input_draws`: no logits-sized
        tensor, so the extra memory does not grow with the batch); else at the logits, a logits-sized cotangent."""
        h = self._logits_input
        if z is None:
            cotangent = torch.zeros_like(h)
            kept = cotangent[rows]  # a view: the other rows stay zero
            for draw in draws:
                kept.copy_(draw.view(kept.shape))
                yield h, cotangent
            return
        cotangent = torch.zeros_like(z)
        for _ in range(samples):
            sampler.draw_into(cotangent[rows], generator)
            yield z, cotangent

    # -- results ----------------------------------------------------------------------------------

    def blocks(self) -> list[CapturedBlock]:
        """One :class:`CapturedBlock` per spec, in spec order; call after ``backward()``.

        A block that cannot be evaluated is included with ``reason`` set, e.g. when no forward with
        gradient tracking reached it or no gradient arrived at its output.

        Raises:
            CaptureError: If a hook raised (the first such exception, naming the block and the phase).
        """
        for spec, rec in zip(self.specs, self._records, strict=True):
            if rec.error is not None:
                phase, error = rec.error
                raise CaptureError(spec.name, phase, error) from error
        return [self._block(spec, rec) for spec, rec in zip(self.specs, self._records, strict=True)]

    def _block(self, spec: BlockSpec, rec: _Record) -> CapturedBlock:
        input_module, output_module, mask_module = spec.adapter.capture_modules(spec)
        reason = rec.reason
        if reason is None and rec.X is None:
            reason = (
                f"no forward call of {type(input_module).__name__} with gradient tracking happened inside "
                "the `with` (forward under torch.no_grad(), or the block is unused)"
            )
        elif reason is None and rec.masks is None:
            reason = f"the attention module {type(mask_module).__name__} was not called with gradient tracking"
        elif reason is None and rec.grad is None:
            reason = (
                f"no gradient arrived at the output of {type(output_module).__name__}: backward() was not "
                "run inside the `with`, or the block output does not influence the loss"
            )
        params_fn = None if self.read_params is None else functools.partial(self.read_params, spec)
        if reason is not None:  # a block left out still reads its weights under sharding: every rank gathers all
            return CapturedBlock(spec, reason=reason, params_fn=params_fn)
        X, G, kpm = rec.X, rec.grad, rec.masks.key_padding_mask
        if G.shape[:2] != X.shape[:2] or (kpm is not None and kpm.shape != X.shape[:2]):
            shapes = f"X {tuple(X.shape)}, grad_output {tuple(G.shape)}"
            shapes += f", key padding mask {tuple(kpm.shape)}" if kpm is not None else ""
            return CapturedBlock(
                spec, reason=f"captured shapes disagree ({shapes}), e.g. a chunked forward", params_fn=params_fn
            )
        call_inputs, call_params = KINDS[spec.kind].from_call(rec.masks, kpm, tuple(X.shape[:2]))
        inputs = {"X": X, "grad_output": G, **call_inputs}
        scale = 1.0
        if rec.n_samples and rec.n_samples == len(rec.samples):
            inputs["output_samples"] = rec.samples  # (k, B, L, d_out), float32
            scale = rec.sample_scale
        params = {**(rec.params or {}), **call_params}
        return CapturedBlock(spec, inputs=inputs, params=params, params_fn=params_fn, sample_scale=scale)
