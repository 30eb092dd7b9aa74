"""Capturing block inputs and output gradients with hooks that exist only inside a ``with`` block.

:class:`Capture` registers, for each :class:`~curvwatch.adapters.BlockSpec`, three hooks, all removed in
``finally``:

* a forward *pre*-hook (with kwargs) on the adapter's input module, storing ``X`` and a snapshot of the
  weights (pre-hook, so that it runs before any sub-module of a composite input module) and, for a block with
  low-rank adapters (``adapters``), of their factors ``A``, ``B`` from the same read; with ``read_params``
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

**Live outputs for the real loss** (:mod:`curvwatch.realloss`): given the module whose output is the logits, the
capture also keeps the live block outputs and the logits of the recorded calls (:meth:`Capture.live_outputs`,
:attr:`Capture.logits`), from which the real-loss sampler back-propagates sampled logit gradients and stores them
back (:meth:`Capture.store_samples`): each block of a kind that takes them then holds ``"output_samples"``
``(k, B, L, d_out)``, cut to the same tokens as ``X``. The capture ignores the gradients of those passes
(:func:`monitor_passes`).

Padded positions count as tokens and are stored as they are; :func:`curvwatch.engine.kernel.kernel_inputs` zeroes
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
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from curvwatch.adapters import BlockSpec, Masks, UnsupportedBlockError
from curvwatch.adapters.projections import Projection, collecting
from curvwatch.adapters.updates import AdapterSite
from curvwatch.closed_form.inputs import LowRankUpdate
from curvwatch.kinds import KINDS

__all__ = ["Capture", "CaptureError", "CapturedBlock", "LiveOutput", "first_tokens", "monitor_passes", "token_slice"]

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


def token_slice(B: int, L: int, max_tokens: int) -> tuple[int, int]:
    """``(k, l)``: keep sequences ``[:k]`` and positions ``[:l]`` (see the module docstring).

    Example:
        >>> token_slice(4, 5, 12), token_slice(4, 5, 3), token_slice(4, 5, 100)
        ((2, 5), (1, 3), (4, 5))
    """
    if L <= max_tokens:
        return min(B, max_tokens // L), L
    return 1, max_tokens


class LiveOutput(NamedTuple):
    """A block output kept alive in the graph for the sampled backward passes (:meth:`Capture.live_outputs`)."""

    spec: BlockSpec
    output: Tensor  # as the output module returned it (the adapter's layout)
    batch_shape: tuple[int, int]  # (B, L) of the whole batch, before the token cut


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


def first_tokens(t: Tensor, max_tokens: int) -> Tensor:
    """The first tokens (:func:`token_slice`) of a ``(B, L, ...)`` tensor: ``t`` itself when every token is kept, else
    one view (``t[:k, :l]`` took two)."""
    k, l = token_slice(t.shape[0], t.shape[1], max_tokens)
    if (k, l) == tuple(t.shape[:2]):
        return t
    return t.as_strided((k, l, *t.shape[2:]), t.stride(), t.storage_offset())


def _keep(t: Tensor, max_tokens: int) -> Tensor:
    """Detached copy of the first tokens of a ``(B, L, ...)`` tensor."""
    with torch.no_grad():  # (a clone without autograd history)
        return first_tokens(t, max_tokens).clone()


@dataclass
class CapturedBlock:
    """Everything one closed form needs for one sub-block, captured on one step.

    Args:
        spec: The block.
        inputs: Detached tensors: ``"X"`` ``(B, L, d)``, ``"grad_output"`` ``(B, L, d_out)`` and, if the
            batch has padding, ``"key_padding_mask"`` (attention; True = padded) or ``"row_mask"`` (LayerNorm
            and FFN; True = keep), both ``(B, L)`` bool; with sampling, ``"output_samples"`` ``(k, B, L, d_out)``.
        params: Detached weight snapshot and settings read by the adapter at forward time (math convention
            ``(d_in, d_out)``), plus ``causal`` for attention; for a block with low-rank adapters whose kernel takes
            them, ``"adapters"``: ``{name: LowRankUpdate}`` with detached copies of their factors.
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


class _Record:
    """Mutable per-spec state filled by the hooks."""

    def __init__(self) -> None:
        self.X: Tensor | None = None
        self.params: dict[str, Any] | None = None
        self.masks: Masks | None = None
        self.grad: Tensor | None = None
        self.output: Tensor | None = None  # the live block output (sampling only), released after sampling
        # the sampled output gradients of the kept tokens, (k, B, L, d_out) float32 (store_samples)
        self.samples: Tensor | None = None
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


def _factors(sites: Mapping[str, AdapterSite], found: Sequence[Projection]) -> dict[str, LowRankUpdate]:
    """Detached copies of the factors of each adapter site, from the projections of one read (a site the read has no
    update of, disabled or merged since, is left out)."""
    out = {}
    with torch.no_grad():
        for name, site in sites.items():
            u = site.update_of(found)
            if u is not None:
                out[name] = LowRankUpdate(u.A.clone(), u.B.clone(), site.scale, site.writes)
    return out


def _snapshot(params: dict[str, Any]) -> dict[str, Any]:
    """Detached copies of the tensors in ``params`` (nested dicts too: a QK-norm's weights)."""
    with torch.no_grad():  # a clone without autograd history: one operator (a detach and a clone were two)
        return {
            k: v.clone() if isinstance(v, Tensor) else _snapshot(v) if isinstance(v, dict) else v
            for k, v in params.items()
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
        logits_module: The module whose output is the logits (:func:`curvwatch.realloss.logits.find_logits_module`):
            its output and the block outputs are kept for the real-loss sampler
            (:func:`curvwatch.realloss.sampling.sample_outputs`). ``None``: no sampling.
        adapters: ``{block: {name: site}}``, the low-rank adapters of the blocks whose kernels take them
            (:func:`~curvwatch.adapters.updates.block_adapters`): their factors are snapshot with the weights (not
            under ``read_params``). ``None``: none.

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
        adapters: Mapping[str, Mapping[str, AdapterSite]] | None = None,
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
        self.adapters = dict(adapters or {})
        self._records = [_Record() for _ in specs]
        self._handles: list[Any] = []
        self._stance: Any = None  # the compiler stance set while the capture is open
        #: The logits of the first forward with gradient tracking (a module other than a plain linear one), else None.
        self.logits: Tensor | None = None
        #: A linear logits module's input, instead of the logits: its rows are recomputed when read.
        self.logits_input: Tensor | None = None
        #: The logits' place in the graph (``torch.autograd.graph.GradientEdge``) when only their input is kept.
        self.logits_edge: Any = None
        #: The logits' dtype when only their input is kept (autocast: the module ran in a lower precision).
        self.logits_dtype: torch.dtype | None = None
        self._sampled = False  # the real-loss sampler ran on this capture (mark_sampled)
        #: Backward passes through the logits while the capture was open, the sampled ones not counted (more than one:
        #: micro-batches under manual optimization; the first one is the one captured and sampled).
        self.backwards = 0
        #: Called with the logits' gradient during the backward when the sampler was not called before
        #: it (a loop that does not hand the loss over): it samples there, while the graph below the logits lives.
        self.on_logits_grad: Callable[[Tensor], None] | None = None

    @property
    def sampled(self) -> bool:
        """Whether the real-loss sampler ran on this capture (once per step: later calls keep its samples)."""
        return self._sampled

    # -- what the real-loss sampler reads and stores (curvwatch.realloss.sampling) --------------------

    def mark_sampled(self) -> None:
        """Record that the sampler ran: later forwards keep no logits, later backwards do not call
        :attr:`on_logits_grad`."""
        self._sampled = True

    def live_outputs(self) -> list[LiveOutput]:
        """The live outputs (graph tensors, kept while a logits module is given) of the blocks of kinds that take
        sampled output gradients, captured without error so far, in spec order."""
        return [
            LiveOutput(spec, rec.output, rec.shape)
            for spec, rec in zip(self.specs, self._records, strict=True)
            if rec.output is not None and rec.error is None and rec.reason is None
        ]

    def sampleable(self) -> list[BlockSpec]:
        """The blocks of kinds that take sampled output gradients and are not left out so far."""
        records = zip(self.specs, self._records, strict=True)
        return [spec for spec, rec in records if KINDS[spec.kind].sampled and rec.reason is None]

    def store_samples(self, spec: BlockSpec, samples: Tensor, scale: float) -> None:
        """Keep ``samples`` ``(k, B, L, d_out)`` (float32, cut to the captured tokens) as the block's
        ``"output_samples"``, with the batch's total loss weight over the kept tokens' (``sample_scale``)."""
        rec = self._records[self.specs.index(spec)]
        rec.samples, rec.sample_scale = samples, float(scale)

    # -- context manager --------------------------------------------------------------------------

    def __enter__(self) -> Capture:
        if self._handles:
            raise RuntimeError("This Capture is already active; use a new Capture per step.")
        self._records = [_Record() for _ in self.specs]
        self.logits = self.logits_input = self.logits_edge = None
        self._stance = torch.compiler.set_stance("force_eager")  # see the module docstring; restored in __exit__
        self._sampled, self.backwards = False, 0
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
        self.release()

    def release(self) -> None:
        """Drop the references to live graph tensors (block outputs, logits and their module's input)."""
        self.logits = self.logits_input = self.logits_edge = None
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
            sites = self.adapters.get(spec.name)
            if self.read_params is None and sites:  # the adapters' factors from the read of the weights
                with collecting() as found:
                    read = spec.adapter.read_params(spec)
                rec.params = {**_snapshot(read), "adapters": _factors(sites, found)}
            elif self.read_params is None:  # sharded: the weights are read at evaluation, one block at a time
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
        return self.logits is not None or self.logits_input is not None

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
            self.logits_input, self.logits_edge = h, get_gradient_edge(out)
            self.logits_dtype = out.dtype
        else:  # any other module: keep the logits themselves (a logits-sized tensor)
            self.logits = out

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
        if rec.samples is not None:
            inputs["output_samples"] = rec.samples  # (k, B, L, d_out), float32
            scale = rec.sample_scale
        params = {**(rec.params or {}), **call_params}
        return CapturedBlock(spec, inputs=inputs, params=params, params_fn=params_fn, sample_scale=scale)
