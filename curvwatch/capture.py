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

Only the first call of each module made with gradient tracking inside the ``with`` is recorded (later
calls, e.g. a validation forward or activation checkpointing's recomputation, are ignored; calls under
``torch.no_grad()`` cannot produce a gradient and are skipped). Everything is stored detached, on the
model's device, subsampled to at most ``max_tokens`` token positions:

* the first ``k`` whole sequences with ``k * L <= max_tokens``;
* if one sequence is longer than ``max_tokens``, the first ``max_tokens`` positions of the first sequence.
  For causal attention, LayerNorm and FFN a prefix is exact (the outputs of the prefix do not depend on
  later positions); for bidirectional attention it is an approximation (the prefix's queries lose the
  keys after it).

Padded positions count as tokens and are stored as they are; :meth:`CapturedBlock.reference_inputs` zeroes
their rows of ``X`` and ``grad_output`` before a closed form sees them (the closed forms also mask them), so
no statistic, ``term/x_norm`` included, depends on what a padded position holds.

The hooks never raise into the user's forward or backward: an exception inside one (an adapter that cannot
read an unusual module, say) is stored with the block and the phase it happened in, and :meth:`Capture.blocks`
raises it as a :class:`CaptureError`, so the caller decides whether to skip the step or to re-raise.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from curvwatch.adapters import BlockSpec, Masks, UnsupportedBlockError
from curvwatch.closed_form.settings import Lanczos
from curvwatch.kinds import KINDS

__all__ = ["Capture", "CaptureError", "CapturedBlock"]

_DTYPES = (torch.float32, torch.float64)


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


def _keep(t: Tensor, max_tokens: int) -> Tensor:
    """Detached copy of the first tokens of a ``(B, L, ...)`` tensor."""
    k, l = token_slice(t.shape[0], t.shape[1], max_tokens)
    return t.detach()[:k, :l].clone()


@dataclass
class CapturedBlock:
    """Everything one closed form needs for one sub-block, captured on one step.

    Args:
        spec: The block.
        inputs: Detached tensors: ``"X"`` ``(B, L, d)``, ``"grad_output"`` ``(B, L, d_out)`` and, if the
            batch has padding, ``"key_padding_mask"`` (attention; True = padded) or ``"row_mask"`` (LayerNorm
            and FFN; True = keep), both ``(B, L)`` bool.
        params: Detached weight snapshot and settings read by the adapter at forward time (math convention
            ``(d_in, d_out)``), plus ``causal`` for attention.
        reason: Why the block cannot be evaluated (no gradient arrived, unsupported setting, ...), else
            ``None``.
        params_fn: Reads the weights now, as full tensors (sharded training: a collective every rank calls for
            every block in the same order), or ``None`` when ``params`` holds them already. :meth:`with_params`
            calls it.
    """

    spec: BlockSpec
    inputs: dict[str, Tensor] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    reason: str | None = None
    params_fn: Callable[[], dict[str, Any]] | None = None

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
        inputs = {name: t[:k] if name.startswith("memory") else t[:k, :l] for name, t in self.inputs.items()}
        return dataclasses.replace(self, inputs=inputs)

    def nonfinite(self) -> list[str]:
        """Names of the captured float tensors holding NaN or Inf (``"X"``, ``"grad_output"``), one device sync."""
        names = [n for n, t in self.inputs.items() if t.is_floating_point()]
        if not names:
            return []
        finite = torch.stack([torch.isfinite(self.inputs[n]).all() for n in names]).tolist()
        return [n for n, ok in zip(names, finite, strict=True) if not ok]

    def evaluation_bytes(
        self, dtype: torch.dtype = torch.float32, max_iter: int = 20, max_basis: int | None = None
    ) -> int:
        """Rough upper estimate of the extra memory :meth:`evaluate` allocates, in bytes.

        With ``n_W`` the elements of one Lanczos vector of the block (its kind's ``basis_numel``: ``W_Q`` per
        head group for attention, ``W_1`` for an FFN), the element size of ``dtype`` and ``k = min(max_iter,
        max_basis)`` the Lanczos vectors held per norm: the kind's ``work_elements`` (attention ``16 B H L^2 +
        64 B L d``, the per-head ``(B, H, L, L)`` tangents of the Lanczos products; FFN ``32 B L d_ff``; LayerNorm
        ``16 B L d``) plus ``6 k n_W`` (the Lanczos bases: :meth:`basis_bytes`). The factors bound the peaks
        measured on CPU with the default diagonal pairs (docs/metrics.md, "Cost"); ``pairs="all"`` takes more.
        """
        X = self.inputs.get("X")
        if X is None:
            return 0
        B, L, d = X.shape
        itemsize = torch.empty((), dtype=dtype).element_size()
        n = KINDS[self.spec.kind].work_elements(B, L, d, self.params)
        return n * itemsize + self.basis_bytes(dtype, vectors_held(max_iter, max_basis))

    def basis_bytes(self, dtype: torch.dtype = torch.float32, vectors: int = 20) -> int:
        """The Lanczos bases' share of :meth:`evaluation_bytes`: ``6 vectors n_W`` elements (0 without Lanczos).

        It does not depend on the tokens: only ``max_basis`` (thick restarts) bounds it.
        """
        if self.inputs.get("X") is None:
            return 0
        numel = KINDS[self.spec.kind].basis_numel(self.params)
        return 6 * vectors * numel * torch.empty((), dtype=dtype).element_size()

    def reference_inputs(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The keyword arguments passed to the closed form (all of them, ``X``/``Y`` and weights included).

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
            for name in (kind.input_name, "grad_output"):
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
        kinds: Sequence[str] = ("outer", "functional", "hessian"),
    ):
        """Run the closed form on the captured tensors.

        Args:
            lanczos: Settings of the iterative norms (attention, FFN; ``None``: the closed forms' default), its
                ``warm_start`` kept between evaluations of this block.
            dtype: ``torch.float32`` or ``torch.float64``; inputs and weights are cast to it.
            pairs: block pairs to compute (attention: ``VV, QQ, KK, VQ, VK, QK, QKV``; FFN: ``W1W1, W2W2,
                W1W2``); pairs of the other kind are ignored. ``None``: all of the kernel's pairs.
            kinds: iterative norms to compute (attention, FFN): a subset of ``("outer", "functional",
                "hessian")``.

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
            kwargs.update(lanczos=lanczos, kinds=kinds)
            if pairs is not None:
                kwargs["pairs"] = [p for p in dict.fromkeys(pairs) if p in kind.pairs]
        return kind.kernel()(**kwargs)


class _Record:
    """Mutable per-spec state filled by the hooks."""

    def __init__(self) -> None:
        self.X: Tensor | None = None
        self.params: dict[str, Any] | None = None
        self.masks: Masks | None = None
        self.grad: Tensor | None = None
        self.output_seen = False
        self.reason: str | None = None
        self.error: tuple[str, BaseException] | None = None  # (phase, exception) of the first hook failure

    def fail(self, phase: str, error: BaseException) -> None:
        if self.error is None:
            self.error = (phase, error)


def _snapshot(params: dict[str, Any]) -> dict[str, Any]:
    """Detached copies of the tensors in ``params`` (nested dicts too: a QK-norm's weights)."""
    return {
        k: v.detach().clone() if isinstance(v, Tensor) else _snapshot(v) if isinstance(v, dict) else v
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
        self._records = [_Record() for _ in specs]
        self._handles: list[Any] = []

    # -- context manager --------------------------------------------------------------------------

    def __enter__(self) -> Capture:
        if self._handles:
            raise RuntimeError("This Capture is already active; use a new Capture per step.")
        self._records = [_Record() for _ in self.specs]
        try:
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

    def _remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    # -- hooks ------------------------------------------------------------------------------------

    # Each hook catches everything it raises (recorded, re-raised by ``blocks``): the user's step never sees it.

    def _on_input(self, spec: BlockSpec, rec: _Record, module, args, kwargs) -> None:
        if rec.X is not None or rec.reason or rec.error or not torch.is_grad_enabled():
            return
        try:
            rec.X = _keep(spec.adapter.read_input(spec, args, kwargs), self.max_tokens)
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
        if not out._is_view():
            return None
        # A hook on a view is lost if the view is later modified in place (autograd regenerates the view's
        # grad_fn), so downstream code gets a copy and the hooked original stays untouched.
        copy = out.clone()
        if isinstance(output, Tensor):
            return copy
        return type(output)(copy if item is out else item for item in output)

    def _on_grad(self, spec: BlockSpec, rec: _Record, grad: Tensor) -> None:
        if rec.grad is not None or rec.error:
            return
        try:
            rec.grad = _keep(spec.adapter.to_batch_first(spec, grad), self.max_tokens)
        except Exception as err:
            rec.fail("backward hook", err)

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
        return CapturedBlock(spec, inputs=inputs, params={**(rec.params or {}), **call_params}, params_fn=params_fn)
