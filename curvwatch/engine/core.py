"""The evaluation engine: captured blocks in, named numbers out, with the monitor's budgets and fault policy.

:class:`Engine` needs no ``Trainer``: give it the :class:`~curvwatch.capture.CapturedBlock` list of one step and
it returns an :class:`Evaluation` (``{block: {key: 0-d tensor}}``, keys prefixed by each block's kind). It owns

* the Lanczos settings and one :class:`~curvwatch.closed_form.WarmStart` per block (each norm starts from the last
  evaluation's Ritz vectors; not checkpointed: a cold start is only slower);
* the memory policy: the token limit (``max_tokens``, halved after an out-of-memory error), the Lanczos vectors
  held per norm (``max_basis``, halved after an out-of-memory error the bases dominate) and the optional
  per-block memory budget;
* the fault policy: a block whose captured tensors hold NaN or Inf is not evaluated (its result is the flag
  ``skipped_nonfinite``); a block whose closed form raises is left out alone (``Evaluation.failed``), the other
  blocks are kept; out of memory frees, shrinks what dominates and retries once;
* the order of sharded training (:mod:`curvwatch.sharding`): each block's weights are read as full tensors (a
  collective) at the start of its turn, on every rank and whatever happens there, and freed before the next
  block's; an error that ends the evaluation on this rank is raised once every block has been read.

Example:
    >>> from curvwatch.adapters import find_blocks
    >>> from curvwatch.capture import Capture
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    >>> with Capture(find_blocks(layer), max_tokens=16) as capture:
    ...     layer(torch.randn(2, 4, 8)).square().sum().backward()
    >>> evaluation = Engine().evaluate(capture.blocks())
    >>> sorted(evaluation.results), "ln/var_min" in evaluation.results["layer0/ln_1"]
    (['layer0/attn', 'layer0/ffn', 'layer0/ln_1', 'layer0/ln_2'], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import traceback
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from curvwatch.adapters import UnsupportedBlockError
from curvwatch.alerts import Notices
from curvwatch.capture import CapturedBlock, nonfinite_inputs
from curvwatch.closed_form.settings import PARTS, Lanczos, WarmStart, inputs_checked
from curvwatch.closed_form.solver import plan
from curvwatch.closed_form.solver.choices import for_device
from curvwatch.closed_form.solver.lockstep import Lockstep
from curvwatch.engine.kernel import evaluate_block
from curvwatch.engine.memory import basis_bytes, evaluation_bytes, vectors_held
from curvwatch.kinds import KINDS
from curvwatch.metrics import select_pairs
from curvwatch.options import Precision, choice

__all__ = ["MONITOR_LANCZOS", "NONFINITE", "BlockError", "Engine", "Evaluation", "signal_plan"]

#: The monitor's Lanczos settings (:class:`curvwatch.Evaluation`'s defaults); ``python -m benchmarks.bench_accuracy``
#: measures their true errors on the demo's model and a 6-layer d = 384 GPT against tightly converged norms.
MONITOR_LANCZOS = Lanczos(tol=1e-2, max_iter=60, max_basis=16, warn=False)

#: Blocks evaluated together (their Lanczos stopping tests sharing one host read, see ``Engine._windows``) hold at
#: most this many times the memory of the largest block's evaluation.
LOCKSTEP_MEMORY = 2.0
#: At most this many blocks evaluated together (a terms-only evaluation's, whose memory is small): one thread each.
LOCKSTEP_BLOCKS = 64

#: Relative key that flags a block whose captured tensors or closed-form numbers were not finite.
NONFINITE = "skipped_nonfinite"


def _named_preconditioner(precondition: Mapping[str, Tensor] | None) -> dict[str, Tensor] | None:
    """A block's preconditioner ``{W: P}`` as ``{"precondition[W]": P}`` for the engine's NaN/Inf read, or None.

    ``P`` (Adam's ``sqrt(v_hat) + eps``) is positive wherever it is finite, so the one finiteness read replaces the
    kernels' own check of it."""
    if not precondition:
        return None
    return {f"precondition[{w}]": P for w, P in precondition.items()}


_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class Evaluation:
    """What one :meth:`Engine.evaluate` call produced.

    Args:
        results: ``{block: {key: 0-d tensor or float}}``, keys relative to the block and prefixed by its kind
            (``"ln/var_min"``); a block with non-finite captured tensors has ``{"skipped_nonfinite": 1.0}``
            (plus the input-only statistics of kinds that have them).
        excluded: ``{block: reason}`` for blocks the capture could not record (frozen, unused, unsupported).
        failed: ``{block: exception}`` for blocks whose closed form raised; left out alone.
        nonfinite: Blocks whose captured ``X`` or ``grad_output`` held NaN or Inf.
        cold: Blocks whose Lanczos runs started without warm-start vectors (first evaluation, resume).
        sample_scales: ``{block: scale}`` of the blocks evaluated with ``output_samples``: the batch's total loss
            weight over that of the tokens evaluated (:attr:`CapturedBlock.sample_scale
            <curvwatch.capture.CapturedBlock.sample_scale>` after the engine's token cuts), by which the real-loss keys
            of the evaluated tokens scale to the whole batch's.
    """

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    failed: dict[str, BaseException] = field(default_factory=dict)
    nonfinite: list[str] = field(default_factory=list)
    cold: set[str] = field(default_factory=set)
    sample_scales: dict[str, float] = field(default_factory=dict)


class BlockError(Exception):
    """An evaluation error and the block it happened in (raised by :meth:`Engine.evaluate` with ``raise_errors``)."""

    def __init__(self, block: str, error: BaseException) -> None:
        super().__init__(f"{block}: {type(error).__name__}: {error}")
        self.block = block
        self.error = error


class Engine:
    """Evaluate captured blocks into named numbers (see the module docstring).

    Args:
        lanczos: Settings of the iterative norms (default :data:`MONITOR_LANCZOS`: tol 1e-2, at most 60 steps and
            16 vectors per norm; its ``warm_start`` and ``warn`` are the engine's own: one warm start per block, and
            convergence is reported through the results' ``residual/...`` keys, not warnings).
        dtype: ``"float32"`` or ``"float64"``, the precision of the closed forms.
        pairs: ``"diagonal"``, ``"all"`` or pair names; the engine keeps exactly the keys of these pairs.
        parts: The Hessian parts whose norms to compute: a subset of ``("outer", "functional", "hessian")``.
        max_tokens: Most token positions per block.
        memory_budget_mb: Most extra memory one block's closed form may take, or ``None``.
        raise_errors: Re-raise a block's closed-form error (as :class:`BlockError`) instead of leaving the block
            out.
        key_prefix: The logged keys' prefix, for messages.
        lockstep: Evaluate consecutive blocks together, their Lanczos stopping tests sharing one host read (a sync
            on a GPU), within :data:`LOCKSTEP_MEMORY` times the largest block's memory; ``False``: one block at a
            time (the same numbers where every run starts with the others; a run that joins later has its stopping
            tests on other steps, so it may stop a few products apart, within its tolerance). ``None`` (default): the
            device's choice (:mod:`~curvwatch.closed_form.solver.choices`: together off the host, where a read is a
            sync; one at a time on the CPU, where the threads' hand-overs cost and a read does not).
        notices: Where the one-time notices go (a monitor's; default: a record of the engine's own).

    Raises:
        ValueError: If an argument is invalid.
    """

    def __init__(
        self,
        *,
        lanczos: Lanczos | None = None,
        dtype: str = "float32",
        pairs: str | Sequence[str] = "diagonal",
        parts: Sequence[str] = PARTS,
        max_tokens: int = 512,
        memory_budget_mb: float | None = None,
        raise_errors: bool = False,
        key_prefix: str = "",
        lockstep: bool | None = None,
        notices: Notices | None = None,
    ) -> None:
        self.lanczos = (MONITOR_LANCZOS if lanczos is None else lanczos).replace(warm_start=None, warn=False)
        self.dtype = choice("dtype", dtype, Precision).value  # the one check of the option set (options.py)
        self.pairs = pairs if isinstance(pairs, str) else tuple(pairs)
        # what the kernels compute (select_pairs then keeps exactly the requested keys)
        if self.pairs == "all":
            self._kernel_pairs: tuple[str, ...] | None = None
        elif self.pairs == "diagonal":
            # each once: kinds share pair names (W1W1 is the FFN's and the gated FFN's); a pair asked for twice
            # would run its Lanczos twice, the second time warm-started from the first
            self._kernel_pairs = tuple(dict.fromkeys(p for kind in KINDS.values() for p in kind.diagonal_pairs))
        else:
            self._kernel_pairs = self.pairs
        self.parts = tuple(parts)
        self.max_tokens = max_tokens
        self.memory_budget_mb = None if memory_budget_mb is None else float(memory_budget_mb)
        self.raise_errors = raise_errors
        self.key_prefix = key_prefix
        self.lockstep = lockstep
        self.token_limit = max_tokens  # halved after an out-of-memory error
        self.basis_limit: int | None = self.lanczos.max_basis  # halved after an out-of-memory error the bases dominate
        self.warm: dict[str, WarmStart] = {}
        # evaluations so far: each draws its Lanczos start vectors' random part with its own seed (Lanczos.seed)
        self.draws = 0
        self._seed = self.lanczos.seed  # the seed of the evaluation under way
        self.notices = Notices() if notices is None else notices

    # -- state ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The limits lowered by out-of-memory errors and the count of evaluations, which seeds the start vectors (the
        warm starts themselves are not kept: a cold start costs a few more products, is as accurate, and draws a start
        of its own rather than the run's first again)."""
        return {"token_limit": self.token_limit, "basis_limit": self.basis_limit, "lanczos_draws": self.draws}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the limits, never above this engine's own ``max_tokens`` / ``max_basis``."""
        self.token_limit = min(int(state.get("token_limit", self.max_tokens)), self.max_tokens)
        # the smaller of the saved limit and this run's max_basis; None: no limit
        limits = [
            int(b) for b in (state.get("basis_limit", self.lanczos.max_basis), self.lanczos.max_basis) if b is not None
        ]
        self.basis_limit = max(4, min(limits)) if limits else None
        self.draws = int(state.get("lanczos_draws", 0))

    # -- evaluation -----------------------------------------------------------------------------------

    def evaluate(
        self,
        captured: Sequence[CapturedBlock],
        grad_factor: float = 1.0,
        terms_only: bool = False,
        precondition: Mapping[str, Mapping[str, Tensor]] | None = None,
        signal_pairs: Collection[str] | None = None,
    ) -> Evaluation:
        """Closed forms of every capturable block, under ``torch.no_grad``.

        Args:
            captured: The blocks of one step (``Capture.blocks()``).
            grad_factor: Multiplies every ``grad_output`` (undoes gradient accumulation and AMP loss scaling).
            terms_only: Ask the kernels for the exact pairs alone: no Lanczos over Hessian products.
            precondition: ``{block: {weight name: P}}``, the preconditioner of the optimizer updating the block in
                the kernel's weight layout (Adam's ``sqrt(v_hat) + eps``): a block with sampled output gradients then
                also gets its preconditioned sharpness (``precond_sharpness/...``).
            signal_pairs: With ``terms_only``, a *signals* evaluation: each block computes only what the warning
                rules read (its kind's ``signal_kwargs``) and those of its exact pairs named here
                (:attr:`curvwatch.rules.RuleSet.exact_pairs`); a block with neither is left out of it (no keys,
                not counted as excluded). ``None``: every term and bound.

        Raises:
            RuntimeError: If no block could be captured (the message lists why, block by block).
            BlockError: With ``raise_errors``, the first block whose closed form raised; without, the first one
                when every block raised. Raised after every block's weights were read (``params_fn``), so that
                under sharding this rank joins the same collectives as the others.
        """
        out = Evaluation()
        dtype = _DTYPES[self.dtype]
        self._seed = self.lanczos.seed + self.draws
        self.draws += 1
        signals = terms_only and signal_pairs is not None
        # a signals evaluation: each block's exact pairs; blocks with nothing to compute are left out
        plans = {b.spec.name: signal_plan(b.spec.kind, signal_pairs) for b in captured} if signals else {}
        if signals:
            captured = [b for b in captured if plans[b.spec.name] is not None]
        pending: Exception | None = None  # this rank's first error that ends the evaluation, raised after the loop
        # NaN/Inf in the captured tensors of every block and in the Adam preconditioners of their stability rules, in
        # one host read (the kernels then skip their own checks)
        precondition = precondition or {}
        preconditioners = [_named_preconditioner(precondition.get(b.spec.name)) for b in captured]
        bad = nonfinite_inputs(captured, preconditioners)
        bad_inputs = dict(zip((b.spec.name for b in captured), bad, strict=True))
        with torch.no_grad(), inputs_checked():
            for window in self._windows(captured, dtype, terms_only):
                # Under sharding reading the weights is a collective: every rank reads every block, in order,
                # before any local decision about it (left out, NaN, failed), so no rank waits on another.
                blocks: list[tuple[CapturedBlock, Exception | None]] = []
                for captured_block in window:
                    try:
                        blocks.append((captured_block.with_params(), None))
                    except Exception as err:
                        blocks.append((captured_block, err))
                calls = []
                if pending is None:
                    calls = [
                        functools.partial(
                            self._evaluate_block, block, read_error, dtype, grad_factor, terms_only, Evaluation(),
                            precondition.get(block.spec.name), plans.get(block.spec.name),
                            bad_inputs[block.spec.name],
                        )
                        for block, read_error in blocks
                    ]  # fmt: skip
                    for part, error in _run_together(calls, _device(blocks[0][0])):
                        if part is not None:
                            _merge(out, part)
                        if pending is None and error is not None:
                            pending = error
                # the errors kept must not hold the blocks' weights through their frames' locals
                _clear_block_frames(blocks, out, pending)
                del blocks, calls  # the blocks' full weights (sharding) go before the next ones are read
        if pending is not None:
            raise pending
        if not out.results and out.failed:  # every block that could be evaluated raised: say why, first block
            name, error = next(iter(out.failed.items()))
            raise BlockError(name, error) from error
        if not out.results and not (signals and not captured):  # (a signals evaluation may have nothing to do)
            reasons = "; ".join(f"{n}: {r}" for n, r in out.excluded.items())
            raise RuntimeError(f"no block could be evaluated ({reasons})")
        return out

    def _windows(self, captured: Sequence[CapturedBlock], dtype: torch.dtype, terms_only: bool):
        """The blocks in consecutive groups evaluated together
        (:class:`~curvwatch.closed_form.solver.lockstep.Lockstep`: their Lanczos stopping tests share one host read).

        A group holds at most :data:`LOCKSTEP_MEMORY` times the memory the largest block's evaluation alone takes
        (:func:`~curvwatch.engine.memory.evaluation_bytes`; with ``memory_budget_mb``, at most the budget): evaluated
        one after the other the blocks' temporaries come and go, together they add up. A terms-only evaluation holds
        no large products, so its blocks form groups of :data:`LOCKSTEP_BLOCKS` (one parked thread each). Sharded blocks
        (weights read as full tensors when evaluated) and ``lockstep=False`` (the CPU's choice with ``None``): one
        block at a time.
        """
        lockstep = self.lockstep
        if lockstep is None:
            lockstep = bool(captured) and for_device(_device(captured[0])).lockstep
        if not lockstep or any(b.params_fn is not None for b in captured):
            return [[b] for b in captured]
        if terms_only:  # (at most LOCKSTEP_BLOCKS at a time: one parked thread each)
            return [list(captured[i : i + LOCKSTEP_BLOCKS]) for i in range(0, len(captured), LOCKSTEP_BLOCKS)]
        sizes = [evaluation_bytes(b.truncate(self.token_limit), dtype, self.lanczos.max_iter, self.basis_limit)
                 if b.reason is None else 0 for b in captured]  # fmt: skip
        limit = LOCKSTEP_MEMORY * max(sizes, default=0)
        if self.memory_budget_mb is not None:
            limit = min(limit, self.memory_budget_mb * 2**20)
        windows: list[list[CapturedBlock]] = []
        total = 0
        for block, size in zip(captured, sizes, strict=True):
            if windows and total + size <= limit:
                windows[-1].append(block)
                total += size
            else:
                windows.append([block])
                total = size
        return windows

    def _evaluate_block(
        self,
        block: CapturedBlock,
        read_error: Exception | None,
        dtype: torch.dtype,
        grad_factor: float,
        terms_only: bool,
        out: Evaluation,
        precondition: Mapping[str, Tensor] | None,
        signals: tuple[str, ...] | None,
        bad: list[str],
    ) -> Evaluation:
        """Evaluate one block into ``out`` and return it: left out, non-finite, failed or its numbers (``signals``:
        the exact pairs of a signals evaluation; ``bad``: its captured tensors holding NaN or Inf, as
        :func:`~curvwatch.capture.nonfinite_inputs` found them for every block at once)."""
        name = block.spec.name
        if block.reason is None and isinstance(read_error, UnsupportedBlockError):
            block = dataclasses.replace(block, reason=str(read_error))
        if block.reason is not None:
            out.excluded[name] = block.reason
            return out
        if read_error is not None:  # reading the weights failed: the block is left out alone, as a closed form
            if self.raise_errors:
                raise BlockError(name, read_error) from read_error
            out.failed[name] = read_error
            return out
        kind = KINDS[block.spec.kind]
        if bad:
            out.nonfinite.append(name)
            self.notices.once(
                f"nonfinite:{name}",
                f"CurvatureMonitor skips block '{name}': its captured {' and '.join(bad)} hold NaN or Inf "
                f"(diverged training, or an overflow under mixed precision). Its numbers are left out and "
                f"{self.key_prefix}{name}/{NONFINITE}=1 marks every such evaluation. Check the loss for NaN; "
                "lower the learning rate or enable gradient clipping.",
            )
            if not kind.input_only_keys or "X" in bad:
                out.results[name] = {NONFINITE: 1.0}
                return out
            # statistics of X alone (LayerNorm variances): a collapse that caused the NaN is still seen
            block = dataclasses.replace(block, inputs={k: v for k, v in block.inputs.items() if k != "grad_output"})
        elif grad_factor != 1.0:
            block = dataclasses.replace(
                block,
                inputs={k: v * grad_factor if k == "grad_output" else v for k, v in block.inputs.items()},
            )
        block, max_basis = self._fit_budget(block, dtype)
        try:
            result = self._evaluate_one(block, dtype, terms_only, max_basis, out, precondition, signals)
        except Exception as err:
            if self.raise_errors:
                raise BlockError(name, err) from err
            out.failed[name] = err
            return out
        result = {k: v for k, v in result.items() if not k.startswith("dense/")}
        if "output_samples" in block.inputs:
            out.sample_scales[name] = block.sample_scale
        out.results[name] = select_pairs(kind.qualify(result), self.pairs)
        if bad:
            out.results[name][NONFINITE] = 1.0
        return out

    def _fit_budget(self, block: CapturedBlock, dtype: torch.dtype) -> tuple[CapturedBlock, int | None]:
        """``(block on at most token_limit tokens, max_basis)``, both smaller where the block's estimate exceeds
        the memory budget.

        The Lanczos bases go first: their size does not depend on the tokens (``d d_ff`` numbers per vector for an
        FFN), and holding fewer vectors costs products, not accuracy (thick restarts). They get at most half the
        budget; the tokens are then halved until the whole estimate fits.
        """
        block = block.truncate(self.token_limit)
        max_basis = self.basis_limit
        if self.memory_budget_mb is None:
            return block, max_basis
        max_iter = self.lanczos.max_iter
        budget = self.memory_budget_mb * 2**20
        held = vectors_held(max_iter, max_basis)
        per_vector = basis_bytes(block, dtype, 1)
        if per_vector and held * per_vector > budget / 2:
            fit = max(4, int(budget / 2 // per_vector))
            if fit < held:
                max_basis = fit
                self.notices.once(
                    "memory_budget_basis",
                    f"CurvatureMonitor holds at most {fit} Lanczos vectors per norm of block '{block.spec.name}' "
                    f"(instead of {held}) to stay within memory_budget_mb={self.memory_budget_mb:g}: its bases "
                    f"would take {held * per_vector / 2**20:.3g} MiB. The norms keep their accuracy (thick "
                    "restarts) and cost more products. Raise memory_budget_mb to silence this; other blocks are "
                    "limited the same way without further warnings.",
                )
        tokens = block.tokens
        while tokens > 1 and evaluation_bytes(block.truncate(tokens), dtype, max_iter, max_basis) > budget:
            tokens //= 2
        if tokens < block.tokens:
            self.notices.once(
                "memory_budget",
                f"CurvatureMonitor evaluates block '{block.spec.name}' on {tokens} of {block.tokens} captured "
                f"tokens to stay within memory_budget_mb={self.memory_budget_mb:g} (estimated "
                f"{evaluation_bytes(block, dtype, max_iter, max_basis) / 2**20:.3g} MiB for all of them). "
                "Raise memory_budget_mb or lower max_tokens to silence this; blocks over budget are shrunk the "
                "same way without further warnings.",
            )
            block = block.truncate(tokens)
        return block, max_basis

    def _evaluate_one(
        self,
        block: CapturedBlock,
        dtype: torch.dtype,
        terms_only: bool,
        max_basis: int | None,
        out: Evaluation,
        precondition: Mapping[str, Tensor] | None = None,
        signals: tuple[str, ...] | None = None,
    ) -> dict[str, Tensor]:
        """The closed form of one block; on out-of-memory: free, halve what dominates the block's memory
        estimate (the Lanczos vectors held per norm, or the tokens), retry once."""
        kind = KINDS[block.spec.kind]
        warm = self.warm.setdefault(block.spec.name, WarmStart())
        if kind.iterative and not len(warm):
            out.cold.add(block.spec.name)
        solve = _solve_bytes(block, dtype, vectors_held(self.lanczos.max_iter, max_basis))
        lanczos = self.lanczos.replace(max_basis=max_basis, warm_start=warm, solve_bytes=solve, seed=self._seed)
        kwargs = dict(
            lanczos=lanczos,
            dtype=dtype,
            pairs=(kind.exact_pairs if signals is None else signals) if terms_only else self._kernel_pairs,
            parts=self.parts,
            precondition=precondition,
            signals=signals is not None,
        )
        try:
            return evaluate_block(block, **kwargs)
        except torch.OutOfMemoryError as err:
            message = str(err).split("\n", 1)[0]
        # outside the except clause: the traceback (and the tensors its frames hold) is gone
        _free_memory(block.inputs["X"].device)
        max_iter = self.lanczos.max_iter
        held = vectors_held(max_iter, max_basis)
        bases = 0 if terms_only else basis_bytes(block, dtype, held)
        what = f"on {block.tokens} tokens"
        if held > 4 and bases >= evaluation_bytes(block, dtype, max_iter, max_basis) - bases:
            # the Lanczos bases dominate (wide FFNs): hold fewer vectors, same accuracy, more products
            self.basis_limit = max(4, held // 2)
            kwargs["lanczos"] = lanczos.replace(max_basis=self.basis_limit)
            retry = f"holding at most {self.basis_limit} Lanczos vectors per norm (was {held})"
        else:
            self.token_limit = max(1, min(self.token_limit, block.tokens) // 2)
            block = block.truncate(self.token_limit)
            retry = f"on {self.token_limit} tokens"
        # the retry holds one run's basis at a time (a kernel's runs in solves of their own: more host reads, the
        # same numbers); later evaluations share solves again, within the estimate at the lower limits
        kwargs["lanczos"] = kwargs["lanczos"].replace(solve_bytes=0)
        self.notices.say(
            f"CurvatureMonitor ran out of memory evaluating block '{block.spec.name}' {what} ({message}). Freed "
            f"it and retrying {retry}; later evaluations keep this lower limit. Pass a smaller max_tokens or a "
            "memory_budget_mb to avoid the retry.",
            stacklevel=4,
        )
        return evaluate_block(block, **kwargs)


def _solve_bytes(block: CapturedBlock, dtype: torch.dtype, vectors: int | None) -> int | None:
    """The block kernel's ``Lanczos.solve_bytes``: its runs share their stopping tests' host reads while their bases
    stay within what the block's memory estimate counts for them (:func:`~curvwatch.engine.memory.basis_bytes` at
    ``vectors`` held per norm), at least ``plan.SOLVE_BYTES``; ``None`` (that default) where the vectors are
    unbounded."""
    return None if vectors is None else max(plan.SOLVE_BYTES, basis_bytes(block, dtype, vectors))


def _run_together(calls: list, device: torch.device) -> list[tuple[Any, Exception | None]]:
    """``[(result, exception or None)]`` of ``calls`` (block evaluations): one alone is called here, several run in a
    :class:`~curvwatch.closed_form.solver.lockstep.Lockstep` (on ``device`` and, on CUDA, the caller's stream).

    ``calls`` is emptied: a kept error's traceback reaches this frame (the evaluation's caller), which must not hold
    the blocks' weights then (sharded training frees each block's before the next one's are read).
    """
    if len(calls) == 1:
        call = calls.pop()
        try:
            return [(call(), None)]
        except Exception as err:
            return [(None, err)]
        finally:
            del call
    fns = list(calls)
    calls.clear()
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    modes = _get_current_dispatch_mode_stack()  # the caller's (a FLOP or operator counter): per thread too

    def setup() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())  # grad mode is per thread
        for mode in modes:
            stack.enter_context(mode)
        if stream is not None:
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    results = Lockstep(setup).run(fns)
    fns.clear()
    for _, error in results:  # not an Exception (KeyboardInterrupt, SystemExit): not the block's, the caller's
        if error is not None and not isinstance(error, Exception):
            raise error
    return results  # type: ignore[return-value]


def _device(block: CapturedBlock) -> torch.device:
    """The device of ``block``'s captured input (CPU when it has none)."""
    X = block.inputs.get("X")
    return X.device if isinstance(X, Tensor) else torch.device("cpu")


def _clear_block_frames(blocks: Sequence[tuple[CapturedBlock, Exception | None]], out: Evaluation,
                        pending: Exception | None) -> None:  # fmt: skip
    """:func:`_clear_frames` of the errors of ``blocks`` (``(block, read error)``) and of ``pending`` (a function: no
    loop variable outlives it holding a block's weights)."""
    for block, read_error in blocks:
        _clear_frames(read_error, out.failed.get(block.spec.name), pending)


def _merge(out: Evaluation, part: Evaluation) -> None:
    """Add one block's :class:`Evaluation` to ``out`` (in block order, as a one-at-a-time evaluation fills it)."""
    out.results.update(part.results)
    out.excluded.update(part.excluded)
    out.failed.update(part.failed)
    out.nonfinite.extend(part.nonfinite)
    out.cold.update(part.cold)
    out.sample_scales.update(part.sample_scales)


def signal_plan(kind_name: str, signal_pairs: Collection[str]) -> tuple[str, ...] | None:
    """The exact pairs a block of kind ``kind_name`` computes in a signals evaluation, or ``None`` when it has nothing
    to compute there (no signal keys, none of its exact pairs read by the rules): such a block is neither evaluated
    nor captured (:meth:`curvwatch.monitor.Monitor.open`)."""
    kind = KINDS[kind_name]
    pairs = tuple(p for p in kind.exact_pairs if p in signal_pairs)
    return pairs if pairs or kind.signal_kwargs is not None else None


def _clear_frames(*errors: BaseException | None) -> None:
    """Drop the local variables of the finished frames in the tracebacks of ``errors`` and of their causes.

    The tracebacks (file, line, function) stay printable; the tensors the frames held (a block's gathered
    weights, its kwargs) are freed.
    """
    for error in errors:
        seen: set[int] = set()
        while error is not None and id(error) not in seen:
            seen.add(id(error))
            traceback.clear_frames(error.__traceback__)
            error = error.__cause__ or error.__context__


def _free_memory(device: torch.device) -> None:
    """Return cached accelerator memory after an out-of-memory error (a no-op on CPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
