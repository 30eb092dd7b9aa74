"""The Lightning callback: capture on due optimizer steps, evaluate the closed forms, warn, log."""

from __future__ import annotations

import dataclasses
import gc
import math
import time
import warnings
import zlib
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from enum import Enum
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from curvwatch import metrics as M
from curvwatch.adapters import BlockSpec, find_blocks
from curvwatch.alerts import Alert, AlertMonitor, CurvatureWarning
from curvwatch.capture import Capture, CapturedBlock, CaptureError, vectors_held
from curvwatch.closed_form.settings import Lanczos, WarmStart

__all__ = ["CurvatureMonitor", "OnError"]


class OnError(str, Enum):
    """What :class:`CurvatureMonitor` does when an evaluation raises."""

    WARN = "warn"
    RAISE = "raise"


_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_UNSUPPORTED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAFSDPStrategy")
# Headline summaries: put in ``trainer.callback_metrics`` and given a W&B run summary.
_HEADLINES = {
    "summary/max_hessian": "max",
    "summary/heterogeneity/model": "max",
    "summary/vv_qq_ratio/median": "max",
    "summary/functional_outer/max": "max",
    "summary/ln/var_min_over_eps": "min",
    "summary/skipped_evaluations": "max",
}
# Bare keys of the LayerNorm and FFN closed forms get their block kind as quantity prefix (design.md).
_KIND_PREFIX = {"layernorm": "ln", "ffn": "ffn", "attention": "attn"}
# Relative key that flags a block whose captured tensors or closed-form numbers were not finite.
_NONFINITE = "skipped_nonfinite"
# The pairs whose norms are exact without Lanczos over Hessian products (outer/VV in closed form,
# functional/VV = 0; W2W2 exact): a terms-only evaluation asks the kernels for these alone. (For d > 256 the
# VV Gram's top eigenvalue is itself found by a small Lanczos on d-vectors, see AttentionOperator.vv_exact.)
_EXACT_PAIRS = ("VV", "W2W2")


def _qualify(kind: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """``"var_min" -> "ln/var_min"``: give keys without a quantity prefix the block kind's prefix."""
    prefix = _KIND_PREFIX.get(kind, kind)
    return {(k if "/" in k else f"{prefix}/{k}"): v for k, v in result.items()}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Invalid {name}={value!r}. Must be an int >= {minimum}.")


class CurvatureMonitor(Callback):
    r"""Monitor closed-form, per-block Hessian norms of a Transformer during training.

    Every ``every_n_train_steps`` optimizer steps (starting at step 0) the callback records, with hooks that
    exist only for that step, the input ``X`` and the back-propagated output gradient ``grad_output`` of every
    sub-block (attention, LayerNorm, FFN) found by :func:`curvwatch.find_blocks`; before the optimizer step it
    evaluates the closed forms (:meth:`CapturedBlock.evaluate`) under ``torch.no_grad`` on the model's device,
    aggregates them (:mod:`curvwatch.metrics`), decides on warnings (:mod:`curvwatch.alerts`) and logs.

    **Steps.** Values captured on optimizer step ``s`` (``trainer.global_step == s`` during that step) are
    logged with ``step=s`` to every logger in ``trainer.loggers``, on rank zero, regardless of
    ``log_every_n_steps``. With ``accumulate_grad_batches=k`` the last micro-batch of the window is captured;
    Lightning divides that loss by ``k``, so ``grad_output`` is multiplied by ``k`` (and divided by the AMP
    loss scale when a ``GradScaler`` is active) to give the curvature of one micro-batch's loss, comparable
    across ``k``.

    **DDP.** Each rank evaluates its own batch. Before anything is logged the ranks agree: a failure flag
    is all-reduced (a failure on any rank skips the evaluation on all ranks, so none hangs), then every
    number is all-reduced: the mean over ranks for norms, ratios and terms, the max (min) for keys that
    are maxima (minima) such as ``ln/inv_var_max`` (``ln/var_min_over_eps``). Summaries and warnings are
    computed from the reduced numbers on every rank, so all ranks take the same decisions; rank zero logs
    and warns.

    **Logged metrics** (``docs/metrics.md`` has every key; ``{p}`` is ``log_key_prefix``):

    - ``{p}{block}/{key}`` for each block (``layer3/attn``, ``layer3/ln_1``, ``layer3/ffn``...) and each key
      of its closed form: ``hessian/XY[/h{i}]``, ``outer/XY[/h{i}]``, ``functional/XY[/h{i}]`` (spectral norms
      of the block pair ``XY``, per head for attention), ``bound/...``, ``term/...``, ``ln/...``, ``ffn/...``.
    - Per block, derived: ``{p}{block}/hessian/max`` (largest Hessian norm of the block),
      ``{p}{block}/ratio/functional_outer``, ``{p}{block}/ratio/VV_QQ[/h{i}]``.
    - ``{p}summary/max_hessian``, ``{p}summary/max_hessian_layer``, ``{p}summary/max_hessian_block``,
      ``{p}summary/heterogeneity/model``, ``{p}summary/heterogeneity/layer{i}``,
      ``{p}summary/vv_qq_ratio/median``, ``{p}summary/functional_outer/max``, ``/median``,
      ``{p}summary/ln/inv_var_max``, ``{p}summary/ln/var_min``, ``{p}summary/ln/var_min_over_eps``,
      ``{p}summary/eval_time_s``, ``{p}summary/evaluations``, ``{p}summary/skipped_evaluations``,
      ``{p}summary/nonfinite_blocks``, ``{p}summary/warnings``, ``{p}summary/overhead_fraction``.
    - With ``terms_every_n_train_steps``, terms-only evaluations log the per-block keys they compute, the
      ``{p}summary/ln/...`` summaries, ``{p}summary/terms_eval_time_s`` and the counters (plus
      ``{p}summary/terms_evaluations``, also on full evaluations).
    - ``{p}{block}/skipped_nonfinite`` (``1``), only on evaluations where the block's captured input or
      output gradient (or its closed-form result) held NaN or Inf: its numbers are left out, never logged
      as if finite. A LayerNorm with a finite input still reports its variance statistics (``ln/var_min``...)
      so a collapse that produced the NaN is still seen.
    - With a ``WandbLogger`` (or ``TensorBoardLogger``) and matplotlib: ``{p}summary/heatmap``, an image of
      ``log10`` block norms, layers x sub-blocks.

    The headline summaries are also put in ``trainer.callback_metrics`` (as tensors), so ``EarlyStopping``
    and ``ModelCheckpoint`` can monitor e.g. ``"curv/summary/max_hessian"``.

    Args:
        every_n_train_steps: Evaluate on optimizer steps ``0, n, 2n, ...`` (those the overhead budget
            allows). One evaluation costs a fixed amount of work (capped by ``max_tokens``), about 10
            training steps of the tiny demo model and fewer on larger ones (``docs/performance.md``
            section 3); lower it, with ``max_overhead=None``, to watch fast events (the demo's
            ``--unstable`` preset evaluates every step).
        max_overhead: Largest fraction of the training wall time the evaluations may take (default 0.01:
            1%), or None for a fixed schedule. A due step is evaluated only if the evaluations so far plus
            this one (priced as the last one) stay within this fraction of the time trained so far, so on a
            model whose evaluation is expensive relative to its training step the effective period grows
            beyond ``every_n_train_steps`` (``curv/summary/overhead_fraction`` logs the fraction spent).
            Step 0 is always evaluated: a run shorter than ``evaluation time / max_overhead`` spends more.
            With DDP the ranks agree through one all-reduce per due step.
        terms_every_n_train_steps: Also evaluate, on optimizer steps ``0, n, 2n, ...`` that are not due for a
            full evaluation, everything that needs no Lanczos over Hessian products: the bound terms and bounds
            (``term/...``, ``bound/...``), the exact norms (``outer/VV``, ``hessian/VV``, ``.../W2W2``), the
            LayerNorm statistics, norms and collapse warnings, the FFN activity fractions (``None``, the
            default: off). Such a terms-only evaluation costs a fraction of a full one (``docs/performance.md``
            section 3), so ``terms_every_n_train_steps=1`` watches LayerNorm collapse and ``||X||_2^6`` on every
            step. Spike warnings, ``hessian/max``, ratios, norm summaries and the heatmap come from full
            evaluations only; ``patience`` and ``cooldown`` of the collapse warning count both kinds. Under
            the overhead budget a full evaluation it cannot afford falls back to terms only on steps due for
            both.
        blocks: ``"auto"`` or a list of :class:`~curvwatch.BlockSpec` (see :func:`~curvwatch.find_blocks`).
        max_tokens: Token positions kept per block (first whole sequences; see
            :class:`~curvwatch.capture.Capture`).
        log_key_prefix: Prefix of every logged key.
        tol: Relative residual at which a Lanczos spectral norm counts as converged: some eigenvalue then lies
            within ``tol`` of it (relative). The actual error is usually far smaller: at the default ``1e-2``
            the norms of the demo and of a 6-layer d = 384 GPT were within 3e-4 and 1.7e-3 of tightly
            converged values (``docs/performance.md``). A norm that hits ``max_iter`` first is counted in
            ``summary/lanczos/unconverged`` and warned about once.
        max_iter: Most Lanczos steps per norm.
        max_basis: Most Lanczos vectors held per norm (``>= 4``; ``None``: ``max_iter``). A norm that needs more
            steps restarts (thick restart: same accuracy, a few more products), so the memory of its basis is
            bounded whatever ``max_iter``: for an FFN each vector is ``d d_ff`` numbers per kind. At the default
            16 the norms of a 6-layer d = 384 GPT matched unrestarted ones to 1e-6 in the same time, with 40%
            less peak memory (``docs/performance.md``).
        dtype: ``"float32"`` or ``"float64"``, the precision of the closed forms.
        pairs: Block pairs kept: ``"diagonal"`` (``VV``, ``QQ``, ``KK``, ``W1W1``, ``W2W2``), ``"all"`` or a
            list of names such as ``["VV", "QQ", "VQ", "W1W1"]``.
        kinds: Which iterative norms to compute: a subset of ``("outer", "functional", "hessian")`` (default
            all three: the Gauss-Newton / functional split). Each kind is one more Lanczos vector per
            product; ``("hessian",)`` alone made an evaluation 2.2x (demo model) to 2.9x (mid-size model)
            cheaper (``docs/performance.md`` section 3; exact norms such as ``outer/VV`` are logged either way).
        collapse_ratio: LayerNorm collapse warning when ``var_min / eps`` drops below it (0 disables).
        inv_var_threshold: Also warn when ``ln/inv_var_max = 1/min(var + eps)`` exceeds it (``None``: off).
        spike_factor: Spike warning when a block norm exceeds ``spike_factor`` x its running baseline.
        spike_warmup: Evaluations of a block that only build its baseline.
        patience: Consecutive evaluations a condition must hold before it warns.
        cooldown: Evaluations a fired (kind, block) stays silent.
        warn: Emit :class:`~curvwatch.CurvatureWarning` (and W&B alerts) when a condition fires.
        on_error: ``"warn"``: an exception anywhere in an evaluation (capture hooks in forward or backward,
            closed forms, summaries, loggers) skips it with a warning and training goes on
            (``{p}summary/skipped_evaluations`` counts them); ``"raise"``: re-raise it. Out of memory
            (``torch.OutOfMemoryError``) in a closed form first frees the memory, halves the token limit (or,
            where the Lanczos bases dominate the block's memory, the Lanczos vectors held per norm) for this
            and later evaluations and retries once, with a warning.
        memory_budget_mb: Most extra memory, in MiB, one block's closed form may take (estimated by
            :meth:`~curvwatch.capture.CapturedBlock.evaluation_bytes`). A block over it holds fewer Lanczos
            vectors per norm (thick restarts: same accuracy, more products; the bases get at most half the
            budget), then is evaluated on fewer tokens; one warning each. ``None``: only ``max_tokens`` and
            ``max_iter`` bound it.
        log_heatmap: Log the block-norm heatmap image to W&B/TensorBoard loggers.
        verbose: Print one line per evaluation (rank zero).

    Raises:
        ValueError: If a kwarg is invalid (in ``__init__``), or in ``setup`` if the model has no block
            curvwatch knows or the strategy shards parameters (FSDP, DeepSpeed, model parallel).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> monitor = CurvatureMonitor(every_n_train_steps=100, max_tokens=256)
        >>> trainer = Trainer(callbacks=[monitor], logger=False, enable_progress_bar=False,
        ...                   enable_model_summary=False, enable_checkpointing=False)
        >>> CurvatureMonitor(every_n_train_steps=0)
        Traceback (most recent call last):
        ...
        ValueError: Invalid every_n_train_steps=0. Must be an int >= 1.
    """

    def __init__(
        self,
        every_n_train_steps: int = 200,
        max_overhead: float | None = 0.01,
        terms_every_n_train_steps: int | None = None,
        blocks: str | Sequence[BlockSpec] = "auto",
        max_tokens: int = 512,
        log_key_prefix: str = "curv/",
        tol: float = 1e-2,
        max_iter: int = 40,
        max_basis: int | None = 16,
        dtype: str = "float32",
        pairs: str | Sequence[str] = "diagonal",
        kinds: Sequence[str] = ("outer", "functional", "hessian"),
        collapse_ratio: float = 5.0,
        inv_var_threshold: float | None = None,
        spike_factor: float = 10.0,
        spike_warmup: int = 3,
        patience: int = 1,
        cooldown: int = 10,
        warn: bool = True,
        on_error: str | OnError = "warn",
        memory_budget_mb: float | None = None,
        log_heatmap: bool = True,
        verbose: bool = False,
    ) -> None:
        _check_int("every_n_train_steps", every_n_train_steps, 1)
        if terms_every_n_train_steps is not None:
            _check_int("terms_every_n_train_steps", terms_every_n_train_steps, 1)
        _check_int("max_tokens", max_tokens, 1)
        _check_int("max_iter", max_iter, 1)
        if max_basis is not None and (isinstance(max_basis, bool) or not isinstance(max_basis, int) or max_basis < 4):
            raise ValueError(
                f"Invalid max_basis={max_basis!r}. Must be an int >= 4 (Lanczos vectors held per norm), or None "
                "to hold up to max_iter."
            )
        if isinstance(blocks, str):
            if blocks != "auto":
                raise ValueError(
                    f"Invalid blocks={blocks!r}. Must be 'auto' or a list of curvwatch.BlockSpec."
                )
        elif not isinstance(blocks, Sequence) or not all(isinstance(b, BlockSpec) for b in blocks):
            raise ValueError(f"Invalid blocks={blocks!r}. Must be 'auto' or a list of curvwatch.BlockSpec.")
        if not isinstance(log_key_prefix, str):
            raise ValueError(f"Invalid log_key_prefix={log_key_prefix!r}. Must be a str such as 'curv/'.")
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
            raise ValueError(f"Invalid tol={tol!r}. Must be a number in [0, 1), e.g. 1e-2.")
        if dtype not in _DTYPES:
            raise ValueError(f"Invalid dtype={dtype!r}. Must be one of {tuple(_DTYPES)}.")
        if isinstance(pairs, str):
            if pairs not in ("diagonal", "all"):
                raise ValueError(
                    f"Invalid pairs={pairs!r}. Must be 'diagonal', 'all' or a list of pair names like "
                    "['VV', 'QQ']."
                )
        elif not pairs or not all(isinstance(p, str) and M.pair_of(p) == p for p in pairs):
            raise ValueError(
                f"Invalid pairs={pairs!r}. Must be 'diagonal', 'all' or a non-empty list of pair names like "
                "['VV', 'QQ', 'VQ', 'W1W1']."
            )
        if max_overhead is not None and (
            isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float)) or not 0 < max_overhead
        ):
            raise ValueError(
                f"Invalid max_overhead={max_overhead!r}. Must be a fraction > 0 (e.g. 0.01 for 1%), or None "
                "for a fixed schedule."
            )
        kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        if not kinds or any(k not in ("outer", "functional", "hessian") for k in kinds):
            raise ValueError(
                f"Invalid kinds={kinds!r}. Must be a non-empty subset of ('outer', 'functional', 'hessian')."
            )
        try:
            on_error = OnError(on_error)
        except ValueError:
            raise ValueError(
                f"Invalid on_error={on_error!r}. Must be one of {[e.value for e in OnError]}."
            ) from None
        if memory_budget_mb is not None and (
            isinstance(memory_budget_mb, bool)
            or not isinstance(memory_budget_mb, (int, float))
            or not 0 < memory_budget_mb < math.inf
        ):
            raise ValueError(
                f"Invalid memory_budget_mb={memory_budget_mb!r}. Must be a number > 0 (MiB), or None for "
                "no budget."
            )
        self._alerts = AlertMonitor(  # validates the alert thresholds
            collapse_ratio=collapse_ratio,
            inv_var_threshold=inv_var_threshold,
            spike_factor=spike_factor,
            spike_warmup=spike_warmup,
            patience=patience,
            cooldown=cooldown,
        )
        self.every_n_train_steps = every_n_train_steps
        self.max_overhead = None if max_overhead is None else float(max_overhead)
        self.terms_every_n_train_steps = terms_every_n_train_steps
        self.blocks = blocks
        self.max_tokens = max_tokens
        self.log_key_prefix = log_key_prefix
        self.tol = float(tol)
        self.max_iter = max_iter
        self.max_basis = max_basis
        self.dtype = dtype
        self.pairs = pairs if isinstance(pairs, str) else tuple(pairs)
        self.kinds = kinds
        # what the kernels compute (select_pairs below then keeps exactly the requested keys)
        if self.pairs == "all":
            self._kernel_pairs: tuple[str, ...] | None = None
        elif self.pairs == "diagonal":
            self._kernel_pairs = ("VV", "QQ", "KK", "W1W1", "W2W2")
        else:
            self._kernel_pairs = self.pairs
        self.warn = bool(warn)
        self.on_error = on_error
        self.memory_budget_mb = None if memory_budget_mb is None else float(memory_budget_mb)
        self.log_heatmap = bool(log_heatmap)
        self.verbose = bool(verbose)

        self._specs: list[BlockSpec] = []
        self._stack: ExitStack | None = None
        self._capture: Capture | None = None
        self._capture_step: int | None = None
        self._capture_terms_only = False  # the open capture is for a terms-only evaluation
        self._open_error: BaseException | None = None
        self._excluded: dict[str, str] = {}  # block -> why it cannot be evaluated
        # state saved in checkpoints
        self._warned: set[str] = set()  # one-time warnings given: excluded blocks, non-finite, budget
        self._token_limit = max_tokens  # halved after an out-of-memory error
        # most Lanczos vectors held per norm (None: max_iter); halved after an out-of-memory error that the
        # bases, not the tokens, dominate
        self._basis_limit: int | None = max_basis
        self._warm_start: dict[str, WarmStart] = {}
        self._cold: set[str] = set()  # blocks whose Lanczos runs of this evaluation started without warm vectors
        self._last_step = -1
        self._evaluations = 0
        self._terms_evaluations = 0
        self._skipped = 0
        self._last_norms: dict[str, float] = {}
        self._last_summary: dict[str, float] = {}
        self._peak: dict[str, Any] = {}
        self._errors: list[str] = []
        # overhead budget: seconds spent evaluating and seconds of training (wall time minus evaluations),
        # accumulated over the run and across resumes; _clock is this fit's (start time, eval seconds then)
        self._eval_seconds = 0.0
        self._train_seconds = 0.0
        self._last_eval_seconds = 0.0  # cost of the last evaluation (capture excluded), the next one's price
        self._last_terms_seconds = 0.0  # the same for the last terms-only evaluation
        self._clock: tuple[float, float] | None = None

    # -- Lightning hooks ----------------------------------------------------------------------------

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_train_steps=self.every_n_train_steps, log_key_prefix=self.log_key_prefix
        )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        names = {cls.__name__ for cls in type(trainer.strategy).__mro__}
        unsupported = names.intersection(_UNSUPPORTED_STRATEGIES)
        if unsupported:
            raise ValueError(
                f"CurvatureMonitor does not support strategy={type(trainer.strategy).__name__}: it shards "
                "parameters, so no rank holds a block's full weights. Use strategy='ddp' (or a single "
                "device), or remove the CurvatureMonitor callback."
            )
        self._specs = find_blocks(pl_module, self.blocks)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._clock = (time.perf_counter(), self._eval_seconds, self._train_seconds)
        if trainer.is_global_zero:
            for logger in self._wandb_loggers(trainer):
                self._define_wandb_metrics(logger)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._update_clock()
        self._clock = None  # the budget's clock stops with training (state_dict is stable afterwards)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._capture_step is not None:  # a capture left open by a step without optimizer step
            self._close()
        step = trainer.global_step
        full_due = step % self.every_n_train_steps == 0
        terms_due = self.terms_every_n_train_steps is not None and step % self.terms_every_n_train_steps == 0
        if trainer.sanity_checking or not (full_due or terms_due) or step <= self._last_step:
            return
        if pl_module.automatic_optimization and not self._steps_optimizer(trainer, batch_idx):
            return
        full_ok, terms_ok = self._within_budget(trainer, pl_module)
        # a due full evaluation the budget cannot afford falls back to terms only where those are due too
        terms_only = not (full_due and full_ok)
        if terms_only and not (terms_due and terms_ok):
            if "budget_info" not in self._warned:
                self._warned.add("budget_info")
                rank_zero_info(
                    f"CurvatureMonitor: skipping due step {step} and later ones while the evaluations so far "
                    f"({self._eval_seconds:.3g} s) plus one more exceed max_overhead={self.max_overhead:g} of the "
                    f"training time ({self._train_seconds:.3g} s); pass max_overhead=None for a fixed schedule."
                )
            return
        self._capture_step = step
        self._capture_terms_only = terms_only
        self._open_error = None
        self._stack = ExitStack()
        try:
            self._capture = self._stack.enter_context(Capture(self._specs, max_tokens=self._token_limit))
        except Exception as err:  # reported in on_before_optimizer_step, after the ranks agree
            self._open_error = err
            self._close()
            self._capture_step = step

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._capture_step is None:
            return
        step, capture, open_error = self._capture_step, self._capture, self._open_error
        terms_only = self._capture_terms_only
        self._close()
        self._last_step = step
        self._evaluate_and_log(trainer, pl_module, step, capture, open_error, terms_only=terms_only)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # No optimizer step happened (training_step returned None): nothing to evaluate, retry next batch.
        self._close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()

    def _within_budget(self, trainer: Trainer, pl_module: LightningModule) -> tuple[bool, bool]:
        """Whether one more (full, terms-only) evaluation keeps within ``max_overhead`` (ranks agree)."""
        self._update_clock()
        if self.max_overhead is None or self._evaluations + self._terms_evaluations + self._skipped == 0:
            return True, True
        # evaluations so far plus the one about to run (priced as the last one of its kind) must fit the budget
        spent = torch.tensor(
            [
                self._eval_seconds + self._last_eval_seconds,
                self._eval_seconds + self._last_terms_seconds,
                -self._train_seconds,
            ],
            dtype=torch.float64,
        )
        dist = torch.distributed
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            spent = spent.to(pl_module.device)
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)  # the slowest rank's evaluations, the least training
        full, terms = (spent[:2] <= self.max_overhead * -spent[2]).tolist()
        return full, terms

    def _update_clock(self) -> None:
        """Training seconds = wall time since ``on_train_start`` minus the evaluations in it (plus earlier runs)."""
        if self._clock is None:
            return
        start, eval_before, train_before = self._clock
        self._train_seconds = train_before + (time.perf_counter() - start) - (self._eval_seconds - eval_before)

    def state_dict(self) -> dict[str, Any]:
        self._update_clock()
        return {
            "eval_seconds": self._eval_seconds,
            "train_seconds": self._train_seconds,
            "last_eval_seconds": self._last_eval_seconds,
            "last_terms_seconds": self._last_terms_seconds,
            "last_step": self._last_step,
            "evaluations": self._evaluations,
            "terms_evaluations": self._terms_evaluations,
            "skipped": self._skipped,
            "alerts": self._alerts.state_dict(),
            "last_norms": dict(self._last_norms),
            "last_summary": dict(self._last_summary),
            "peak": dict(self._peak),
            "errors": list(self._errors),
            "warned": sorted(self._warned),
            "token_limit": self._token_limit,
            "basis_limit": self._basis_limit,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_step = int(state_dict.get("last_step", -1))
        self._evaluations = int(state_dict.get("evaluations", 0))
        self._terms_evaluations = int(state_dict.get("terms_evaluations", 0))
        self._skipped = int(state_dict.get("skipped", 0))
        self._alerts.load_state_dict(state_dict.get("alerts", {}))
        self._last_norms = dict(state_dict.get("last_norms", {}))
        self._last_summary = dict(state_dict.get("last_summary", {}))
        self._peak = dict(state_dict.get("peak", {}))
        self._errors = list(state_dict.get("errors", []))
        self._warned = set(state_dict.get("warned", []))
        self._token_limit = min(int(state_dict.get("token_limit", self.max_tokens)), self.max_tokens)
        # the smaller of the saved limit (lowered by out-of-memory errors) and this run's max_basis; None: no limit
        limits = [int(b) for b in (state_dict.get("basis_limit", self.max_basis), self.max_basis) if b is not None]
        self._basis_limit = max(4, min(limits)) if limits else None
        self._eval_seconds = float(state_dict.get("eval_seconds", 0.0))
        self._train_seconds = float(state_dict.get("train_seconds", 0.0))
        self._last_eval_seconds = float(state_dict.get("last_eval_seconds", 0.0))
        self._last_terms_seconds = float(state_dict.get("last_terms_seconds", 0.0))

    # -- public helpers -----------------------------------------------------------------------------

    @property
    def alerts(self) -> list[Alert]:
        """The warnings fired so far (most recent last)."""
        return list(self._alerts.history)

    def summary_text(self, top: int = 5) -> str:
        """A readable multi-line summary of the run so far: most curved blocks, heterogeneity, warnings.

        Args:
            top: How many of the most curved blocks to list.
        """
        last = "never" if self._last_step < 0 else f"last at step {self._last_step}"
        terms = f", {self._terms_evaluations} terms-only" if self.terms_every_n_train_steps is not None else ""
        lines = [
            f"CurvatureMonitor: {self._evaluations} evaluation(s){terms} ({last}), {self._skipped} skipped, "
            f"{self._alerts.fired} warning(s)"
        ]
        if self._last_norms:
            lines.append("Most curved blocks at the last evaluation (largest Hessian spectral norm):")
            ranked = sorted(self._last_norms.items(), key=lambda kv: -kv[1])[:top]
            width = max(len(name) for name, _ in ranked)
            lines += [f"  {name:<{width}}  {norm:.3e}" for name, norm in ranked]
        s = self._last_summary
        if "summary/heterogeneity/model" in s:
            per_layer = ", ".join(
                f"{k.rsplit('/', 1)[-1]} {v:.2f}"
                for k, v in s.items()
                if k.startswith("summary/heterogeneity/layer")
            )
            lines.append(
                f"Heterogeneity (log10 max/min of block norms): model {s['summary/heterogeneity/model']:.2f}"
                + (f"; {per_layer}" if per_layer else "")
            )
        extras = [
            (label, s[key])
            for label, key in (
                ("V/Q ratio median", "summary/vv_qq_ratio/median"),
                ("functional/outer max", "summary/functional_outer/max"),
                ("LayerNorm var_min/eps min", "summary/ln/var_min_over_eps"),
            )
            if key in s
        ]
        if extras:
            lines.append("   ".join(f"{label}: {value:.3g}" for label, value in extras))
        if s.get("summary/lanczos/unconverged", 0) > 0:
            lines.append(
                f"Lanczos: {s['summary/lanczos/unconverged']:.0f} of {s['summary/lanczos/norms']:.0f} norms stopped "
                f"at max_iter={self.max_iter} above tol={self.tol:g} (worst relative residual "
                f"{s['summary/lanczos/rel_residual_max']:.2g})"
            )
        if self._peak:
            lines.append(
                f"Peak so far: {self._peak['value']:.3e} in {self._peak['block']} "
                f"at step {self._peak['step']}"
            )
        history = self._alerts.history
        if history:
            lines.append("Warnings fired:")
            lines += [
                f"  step {a.step}: {a.kind} in {a.block} ({a.value:.3g}, threshold {a.threshold:.3g})"
                for a in history[-10:]
            ]
        if self._errors:
            lines.append("Skipped evaluations:")
            lines += [f"  {e}" for e in self._errors[-5:]]
        return "\n".join(lines)

    # -- internals ----------------------------------------------------------------------------------

    def _close(self) -> None:
        """Remove the hooks (idempotent)."""
        stack, self._stack, self._capture, self._capture_step = self._stack, None, None, None
        self._capture_terms_only = False
        if stack is not None:
            stack.close()

    @staticmethod
    def _steps_optimizer(trainer: Trainer, batch_idx: int) -> bool:
        """Whether the optimizer steps after this batch (last micro-batch of an accumulation window)."""
        loop = trainer.fit_loop.epoch_loop
        should_accumulate = getattr(loop, "_should_accumulate", None)
        if should_accumulate is not None:
            return not should_accumulate()
        k = trainer.accumulate_grad_batches
        return (batch_idx + 1) % k == 0 or batch_idx + 1 == trainer.num_training_batches

    @staticmethod
    def _grad_factor(trainer: Trainer, pl_module: LightningModule) -> float:
        """Undo Lightning's ``1/accumulate_grad_batches`` loss scaling and the AMP loss scale."""
        factor = float(trainer.accumulate_grad_batches) if pl_module.automatic_optimization else 1.0
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            factor /= float(scaler.get_scale())
        return factor

    def _warn_once(self, key: str, message: str) -> None:
        """Warn the first time ``key`` comes up in this run (on the rank where it happens); kept in checkpoints."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, CurvatureWarning, stacklevel=3)

    def _fit_budget(self, block: CapturedBlock, dtype: torch.dtype) -> tuple[CapturedBlock, int | None]:
        """``(block on at most self._token_limit tokens, max_basis)``, both smaller where the block's estimate
        exceeds the memory budget.

        The Lanczos bases go first: their size does not depend on the tokens (``d d_ff`` numbers per vector for
        an FFN), and holding fewer vectors costs products, not accuracy (thick restarts). They get at most half
        the budget; the tokens are then halved until the whole estimate fits.
        """
        block = block.truncate(self._token_limit)
        max_basis = self._basis_limit
        if self.memory_budget_mb is None:
            return block, max_basis
        budget = self.memory_budget_mb * 2**20
        held = vectors_held(self.max_iter, max_basis)
        per_vector = block.basis_bytes(dtype, 1)
        if per_vector and held * per_vector > budget / 2:
            fit = max(4, int(budget / 2 // per_vector))
            if fit < held:
                max_basis = fit
                self._warn_once(
                    "memory_budget_basis",
                    f"CurvatureMonitor holds at most {fit} Lanczos vectors per norm of block '{block.spec.name}' "
                    f"(instead of {held}) to stay within memory_budget_mb={self.memory_budget_mb:g}: its bases "
                    f"would take {held * per_vector / 2**20:.3g} MiB. The norms keep their accuracy (thick "
                    "restarts) and cost more products. Raise memory_budget_mb to silence this; other blocks are "
                    "limited the same way without further warnings.",
                )
        tokens = block.tokens
        while tokens > 1 and block.truncate(tokens).evaluation_bytes(dtype, self.max_iter, max_basis) > budget:
            tokens //= 2
        if tokens < block.tokens:
            self._warn_once(
                "memory_budget",
                f"CurvatureMonitor evaluates block '{block.spec.name}' on {tokens} of {block.tokens} captured "
                f"tokens to stay within memory_budget_mb={self.memory_budget_mb:g} (estimated "
                f"{block.evaluation_bytes(dtype, self.max_iter, max_basis) / 2**20:.3g} MiB for all of them). "
                "Raise memory_budget_mb or lower max_tokens to silence this; blocks over budget are shrunk the "
                "same way without further warnings.",
            )
            block = block.truncate(tokens)
        return block, max_basis

    def _evaluate_one(
        self, block: CapturedBlock, dtype: torch.dtype, terms_only: bool, max_basis: int | None = None
    ) -> dict[str, Tensor]:
        """The closed form of one block; on out-of-memory: free, halve what dominates the block's memory
        estimate (the Lanczos vectors held per norm, or the tokens), retry once.

        ``terms_only`` asks the kernels for the exact pairs alone: no Lanczos over Hessian products.
        ``max_basis``: most Lanczos vectors held per norm (``None``: ``max_iter``).
        """
        # Lanczos start vectors carried from the last evaluation of this block (weights move little between
        # evaluations, so the norms converge in a few steps); not checkpointed, a fresh start is only slower.
        warm = self._warm_start.setdefault(block.spec.name, WarmStart())
        if not len(warm):
            self._cold.add(block.spec.name)
        lanczos = Lanczos(self.tol, self.max_iter, max_basis, warm_start=warm, warn=False)
        kwargs = dict(
            lanczos=lanczos,
            dtype=dtype,
            pairs=_EXACT_PAIRS if terms_only else self._kernel_pairs,
            kinds=self.kinds,
        )
        try:
            return block.evaluate(**kwargs)
        except torch.OutOfMemoryError as err:
            message = str(err).split("\n", 1)[0]
        # outside the except clause: the traceback (and the tensors its frames hold) is gone
        _free_memory(block.inputs["X"].device)
        held = vectors_held(self.max_iter, max_basis)
        bases = 0 if terms_only else block.basis_bytes(dtype, held)
        what = f"on {block.tokens} tokens"
        if held > 4 and bases >= block.evaluation_bytes(dtype, self.max_iter, max_basis) - bases:
            # the Lanczos bases dominate (wide FFNs): hold fewer vectors, same accuracy, more products
            self._basis_limit = max(4, held // 2)
            kwargs["lanczos"] = lanczos.replace(max_basis=self._basis_limit)
            retry = f"holding at most {self._basis_limit} Lanczos vectors per norm (was {held})"
        else:
            self._token_limit = max(1, min(self._token_limit, block.tokens) // 2)
            block = block.truncate(self._token_limit)
            retry = f"on {self._token_limit} tokens"
        warnings.warn(
            f"CurvatureMonitor ran out of memory evaluating block '{block.spec.name}' {what} ({message}). Freed "
            f"it and retrying {retry}; later evaluations keep this lower limit. Pass a smaller max_tokens or a "
            "memory_budget_mb to avoid the retry.",
            CurvatureWarning,
            stacklevel=3,
        )
        return block.evaluate(**kwargs)

    def _evaluate_blocks(
        self, captured: list[CapturedBlock], factor: float, terms_only: bool = False
    ) -> tuple[dict, list[str]]:
        """Closed forms of every capturable block: ``({block: {key: 0-d tensor}}, excluded names)``.

        A block whose captured tensors hold NaN or Inf is not evaluated; its result is the flag
        ``{"skipped_nonfinite": 1.0}`` (plus the input-only statistics of a LayerNorm whose input is finite).
        """
        results: dict[str, dict[str, Tensor | float]] = {}
        excluded = []
        dtype = _DTYPES[self.dtype]
        self._cold = set()
        with torch.no_grad():
            for block in captured:
                name = block.spec.name
                if block.reason is not None:
                    excluded.append(name)
                    self._excluded[name] = block.reason
                    continue
                bad = block.nonfinite()
                if bad:
                    self._warn_once(
                        f"nonfinite:{name}",
                        f"CurvatureMonitor skips block '{name}': its captured {' and '.join(bad)} hold NaN or "
                        f"Inf (diverged training, or an overflow under mixed precision). Its numbers are left "
                        f"out and {self.log_key_prefix}{name}/{_NONFINITE}=1 marks every such evaluation. "
                        "Check the loss for NaN; lower the learning rate or enable gradient clipping.",
                    )
                    if block.spec.kind != "layernorm" or "X" in bad:
                        results[name] = {_NONFINITE: 1.0}
                        continue
                    # the variance statistics need only X: a collapse that caused the NaN is still reported
                    block = dataclasses.replace(
                        block, inputs={k: v for k, v in block.inputs.items() if k != "grad_output"}
                    )
                elif factor != 1.0:
                    block = dataclasses.replace(
                        block,
                        inputs={k: v * factor if k == "grad_output" else v for k, v in block.inputs.items()},
                    )
                block, max_basis = self._fit_budget(block, dtype)
                try:
                    out = self._evaluate_one(block, dtype, terms_only, max_basis)
                except Exception as err:
                    raise _BlockError(name, err) from err
                out = {k: v for k, v in out.items() if not k.startswith("dense/")}
                results[name] = M.select_pairs(_qualify(block.spec.kind, out), self.pairs)
                if bad:
                    results[name][_NONFINITE] = 1.0
        if not results:
            reasons = "; ".join(f"{n}: {self._excluded[n]}" for n in excluded)
            raise RuntimeError(f"no block could be evaluated ({reasons})")
        return results, excluded

    def _evaluate_and_log(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        step: int,
        capture: Capture | None,
        open_error: BaseException | None,
        terms_only: bool = False,
    ) -> None:
        error: BaseException | None = open_error
        flat: dict[tuple[str, str], float] = {}
        excluded: list[str] = []
        start = time.perf_counter()
        if error is None:
            try:
                if capture is None:
                    raise RuntimeError("no capture was open for this step")
                results, excluded = self._evaluate_blocks(
                    capture.blocks(), self._grad_factor(trainer, pl_module), terms_only
                )
                flat = _drop_nan_blocks(_to_floats(results))
            except Exception as err:
                error = err
        elapsed = time.perf_counter() - start
        self._eval_seconds += elapsed
        if terms_only:
            self._last_terms_seconds = elapsed
        else:
            self._last_eval_seconds = elapsed
        flat, failed_elsewhere = _sync(trainer, pl_module.device, flat, error is not None)
        if error is not None or failed_elsewhere:
            self._skip(trainer, step, error)
            return
        alerts_before = self._alerts.state_dict()
        logging_start = time.perf_counter()
        try:  # after the collectives: a failure here is local, the other ranks cannot hang on it
            self._log(trainer, step, flat, excluded, elapsed, terms_only)
        except Exception as err:
            self._alerts.load_state_dict(alerts_before)
            self._skip(trainer, step, _LogError(err))
        finally:  # logging (heatmap, W&B) is part of the monitor's cost too
            logging_seconds = time.perf_counter() - logging_start
            self._eval_seconds += logging_seconds
            if terms_only:
                self._last_terms_seconds += logging_seconds
            else:
                self._last_eval_seconds += logging_seconds

    def _log(
        self,
        trainer: Trainer,
        step: int,
        flat: dict[tuple[str, str], float],
        excluded: list[str],
        elapsed: float,
        terms_only: bool = False,
    ) -> None:
        """Summaries, warnings and logging of one evaluation's (reduced) numbers; state changes last.

        A terms-only evaluation has no Lanczos norms, so nothing derived from a block's norms is computed
        from it (``hessian/max``, ratios, norm summaries, spike warnings, heatmap): a maximum over its exact
        pairs alone would read as the block's norm. Its LayerNorm statistics feed the collapse warnings.
        """
        results: dict[str, dict[str, float]] = {}
        nonfinite: list[str] = []
        for (block, key), value in flat.items():
            if key == _NONFINITE:
                nonfinite.append(block)
            else:
                results.setdefault(block, {})[key] = value
        layers = {spec.name: spec.layer for spec in self._specs}
        p = self.log_key_prefix
        logged: dict[str, float] = {f"{p}{block}/{_NONFINITE}": 1.0 for block in nonfinite}
        for block, result in results.items():
            for key, value in {**result, **({} if terms_only else M.block_derived(result))}.items():
                if not key.startswith("residual/"):  # one per norm: logged as the block's lanczos/rel_residual_max
                    logged[f"{p}{block}/{key}"] = value
        summary = M.summarize(results, layers)
        if terms_only:
            summary = {k: v for k, v in summary.items() if k.startswith("summary/ln/")}
        accuracy = M.lanczos_accuracy(results, self.tol)
        summary.update(accuracy)
        if "summary/max_hessian_block" in summary:  # index into the spec list, not into the evaluated blocks
            name = list(results)[int(summary["summary/max_hessian_block"])]
            summary["summary/max_hessian_block"] = float([s.name for s in self._specs].index(name))
        var_ratio = [r["ln/var_min_over_eps"] for r in results.values() if "ln/var_min_over_eps" in r]
        if var_ratio:
            summary["summary/ln/var_min_over_eps"] = min(var_ratio)

        norms = {} if terms_only else {b: v for b, v in M.block_norms(results).items() if b not in nonfinite}
        layernorms = {
            b: {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("ln/")}
            for b, r in results.items()
            if any(k.startswith("ln/") for k in r)
        }
        eps = {s.name: getattr(s.module, "eps", None) for s in self._specs}
        for b in layernorms:
            if isinstance(eps.get(b), (int, float)):
                layernorms[b]["eps"] = float(eps[b])
        fired = self._alerts.update(step, norms=norms, layernorms=layernorms)

        evaluations = self._evaluations + (0 if terms_only else 1)
        terms_evaluations = self._terms_evaluations + (1 if terms_only else 0)
        summary["summary/terms_eval_time_s" if terms_only else "summary/eval_time_s"] = elapsed
        self._update_clock()
        summary["summary/overhead_fraction"] = self._eval_seconds / max(self._train_seconds, 1e-9)
        summary["summary/evaluations"] = float(evaluations)
        if self.terms_every_n_train_steps is not None:
            summary["summary/terms_evaluations"] = float(terms_evaluations)
        summary["summary/skipped_evaluations"] = float(self._skipped)
        summary["summary/nonfinite_blocks"] = float(len(nonfinite))
        summary["summary/warnings"] = float(self._alerts.fired)
        logged.update({f"{p}{k}": v for k, v in summary.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=step)
            if self.log_heatmap and norms:
                self._log_heatmap(trainer, norms, step)

        # logged: commit the state
        self._evaluations, self._terms_evaluations = evaluations, terms_evaluations
        if terms_only:  # the last full evaluation's norms and norm summaries stay current
            self._last_summary = {**self._last_summary, **summary}
        else:
            self._last_norms = norms
            self._last_summary = summary
        if norms:
            top = max(norms, key=norms.__getitem__)
            if not self._peak or norms[top] > self._peak["value"]:
                self._peak = {"value": norms[top], "block": top, "step": step}
        self._publish_callback_metrics(trainer)
        if not trainer.is_global_zero:
            return
        for name in excluded:
            self._warn_once(name, f"CurvatureMonitor leaves block '{name}' out: {self._excluded[name]}.")
        # a cold start (first evaluation of a block, or after a resume) may need more than max_iter steps once;
        # the warning is about norms that stay unconverged although Lanczos started from the last Ritz vectors
        warm = {b: r for b, r in results.items() if b not in self._cold}
        warm_accuracy = M.lanczos_accuracy(warm, self.tol)
        if warm_accuracy.get("summary/lanczos/unconverged", 0) > 0:
            self._warn_unconverged(step, warm, warm_accuracy)
        if self.warn:
            for alert in fired:
                warnings.warn(alert.message, CurvatureWarning, stacklevel=2)
                self._wandb_alert(trainer, "curvwatch: " + alert.kind.replace("_", " "), alert.message)
        if self.verbose and terms_only:
            rank_zero_info(
                f"[CurvatureMonitor] step {step}: terms only, LayerNorm var_min/eps "
                f"{summary.get('summary/ln/var_min_over_eps', math.nan):.3g}, {len(fired)} warning(s), "
                f"{elapsed:.3f} s"
            )
        elif self.verbose:
            where = f" in {self._peak_block(norms)}" if norms else ""
            rank_zero_info(
                f"[CurvatureMonitor] step {step}: max ||H|| "
                f"{summary.get('summary/max_hessian', math.nan):.3e}"
                f"{where}, heterogeneity {summary.get('summary/heterogeneity/model', math.nan):.2f} decades, "
                f"{len(fired)} warning(s), {elapsed:.2f} s"
            )

    def _warn_unconverged(
        self, step: int, results: Mapping[str, Mapping[str, float]], accuracy: Mapping[str, float]
    ) -> None:
        """Warn (once per run) that some warm-started Lanczos norms stopped at ``max_iter`` above ``tol``."""
        worst = {b: max(M.residuals(r).values(), default=0.0) for b, r in results.items()}
        block = max(worst, key=worst.__getitem__)
        p = self.log_key_prefix
        self._warn_once(
            "lanczos_unconverged",
            f"CurvatureMonitor: at step {step}, {accuracy['summary/lanczos/unconverged']:.0f} of "
            f"{accuracy['summary/lanczos/norms']:.0f} warm-started Lanczos norms stopped at "
            f"max_iter={self.max_iter} before reaching tol={self.tol:g} (worst relative residual "
            f"{worst[block]:.2g}, in '{block}'); such a norm may read low by up to about that fraction (usually "
            f"far less). {p}summary/lanczos/unconverged and {p}<block>/lanczos/rel_residual_max track it. Raise "
            f"max_iter for tighter norms (each step costs about one more product), or raise tol to accept them.",
        )

    @staticmethod
    def _peak_block(norms: Mapping[str, float]) -> str:
        return max(norms, key=norms.__getitem__)

    def _skip(self, trainer: Trainer, step: int, error: BaseException | None) -> None:
        """Count a failed evaluation, then warn or raise (all ranks take the same branch)."""
        self._skipped += 1
        if error is None:
            what = "an evaluation failed on another rank"
        elif isinstance(error, _BlockError):
            what = f"evaluating block '{error.block}' raised {type(error.error).__name__}: {error.error}"
        elif isinstance(error, _LogError):
            what = f"summarizing or logging the numbers raised {type(error.error).__name__}: {error.error}"
        else:
            what = f"{type(error).__name__}: {error}"
        self._errors = (self._errors + [f"step {step}: {what}"])[-20:]
        if self.on_error is OnError.RAISE:
            if isinstance(error, (_BlockError, _LogError, CaptureError)):
                raise error.error
            if error is not None:
                raise error
            raise RuntimeError(f"CurvatureMonitor: {what} at step {step} (on_error='raise').")
        key = f"{self.log_key_prefix}summary/skipped_evaluations"
        trainer.callback_metrics[key] = torch.tensor(float(self._skipped))
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            try:
                logger.log_metrics({key: float(self._skipped)}, step=step)
            except Exception:  # the logger itself may be what failed; the warning below still says so
                pass
        warnings.warn(
            f"CurvatureMonitor skipped the evaluation at step {step}: {what}. Training continues; "
            f"{key}={self._skipped}. Pass on_error='raise' to get the traceback, or blocks=[...] to leave "
            "the failing block out.",
            CurvatureWarning,
            stacklevel=2,
        )

    def _publish_callback_metrics(self, trainer: Trainer) -> None:
        for key in _HEADLINES:
            if key in self._last_summary:
                value = self._last_summary[key]
                trainer.callback_metrics[self.log_key_prefix + key] = torch.tensor(value, dtype=torch.float32)

    # -- logger extras --------------------------------------------------------------------------------

    @staticmethod
    def _wandb_loggers(trainer: Trainer) -> list[Any]:
        try:
            from lightning.pytorch.loggers import WandbLogger
        except ImportError:  # pragma: no cover
            return []
        return [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]

    def _define_wandb_metrics(self, logger: Any) -> None:
        experiment = logger.experiment
        if not hasattr(experiment, "define_metric"):
            return
        keys = dict(_HEADLINES)
        keys.update({f"{spec.name}/hessian/max": "max" for spec in self._specs if spec.kind != "layernorm"})
        for key, summary in keys.items():
            try:
                experiment.define_metric(
                    self.log_key_prefix + key, step_metric="trainer/global_step", summary=summary
                )
            except Exception:  # old wandb, disabled run: summaries are a convenience
                return

    def _wandb_alert(self, trainer: Trainer, title: str, text: str) -> None:
        for logger in self._wandb_loggers(trainer):
            try:
                import wandb

                logger.experiment.alert(title=title, text=text, level=wandb.AlertLevel.WARN)
            except Exception:  # offline runs and old wandb versions may not support alerts
                pass

    def _log_heatmap(self, trainer: Trainer, norms: Mapping[str, float], step: int) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        targets = self._wandb_loggers(trainer)
        boards = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        if not targets and not boards:
            return
        try:
            figure = _heatmap_figure(self._specs, norms, step)
        except ImportError:  # matplotlib missing: no image
            return
        key = f"{self.log_key_prefix}summary/heatmap"
        for logger in targets:
            try:
                logger.log_image(key=key, images=[figure], step=step)
            except Exception as err:
                warnings.warn(
                    f"CurvatureMonitor could not log the heatmap to W&B: {err}", CurvatureWarning, 2
                )
        for logger in boards:
            try:
                logger.experiment.add_figure(key, figure, global_step=step, close=False)
            except Exception as err:
                warnings.warn(
                    f"CurvatureMonitor could not log the heatmap to TensorBoard: {err}", CurvatureWarning, 2
                )


def _free_memory(device: torch.device) -> None:
    """Return cached accelerator memory after an out-of-memory error (a no-op on CPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _drop_nan_blocks(flat: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """Replace the numbers of every block with a NaN among them by its ``skipped_nonfinite`` flag.

    ``+-inf`` is kept: it is what the closed form says (``ln/inv_var_max`` with ``eps=0`` and a constant row).
    """
    bad = {block for (block, _), value in flat.items() if math.isnan(value)}
    out = {(b, k): v for (b, k), v in flat.items() if b not in bad}
    out.update({(b, _NONFINITE): 1.0 for b in bad})
    return out


class _LogError(Exception):
    """An error after the numbers were computed: in the summaries, the alerts or a logger."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


class _BlockError(Exception):
    """An evaluation error and the block it happened in."""

    def __init__(self, block: str, error: BaseException) -> None:
        super().__init__(f"{block}: {type(error).__name__}: {error}")
        self.block = block
        self.error = error


def _to_floats(results: Mapping[str, Mapping[str, Tensor | float]]) -> dict[tuple[str, str], float]:
    """Flatten ``{block: {key: 0-d tensor}}`` to ``{(block, key): float}`` with one device sync."""
    keys = [(block, key) for block, result in results.items() for key in result]
    if not keys:
        return {}
    values = [torch.as_tensor(results[b][k]).detach().reshape(()).to("cpu", torch.float64) for b, k in keys]
    return dict(zip(keys, torch.stack(values).tolist(), strict=True))


def _sync(
    trainer: Trainer, device: torch.device, flat: dict[tuple[str, str], float], failed: bool
) -> tuple[dict[tuple[str, str], float], bool]:
    """All-reduce the failure flag and the numbers across ranks: ``(reduced numbers, any rank failed)``.

    Every rank calls this at the same step, failed or not, so the collectives always match. The key sets
    are compared through their count and a checksum; a mismatch counts as a failure.
    """
    dist = torch.distributed
    if trainer.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return flat, False
    keys = sorted(flat) if not failed else []
    checksum = float(zlib.crc32("\n".join(f"{b}/{k}" for b, k in keys).encode()))
    flags = torch.tensor(
        [float(failed), len(keys), -len(keys), checksum, -checksum], dtype=torch.float64, device=device
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    agreed = flags[1] == -flags[2] and flags[3] == -flags[4]
    if flags[0] > 0 or not agreed:
        return {}, True
    ops = [M.reduce_op(k) for _, k in keys]
    values = torch.tensor([flat[k] for k in keys], dtype=torch.float64, device=device)
    mean = torch.where(torch.tensor([op == "mean" for op in ops], device=device), values, 0.0)
    dist.all_reduce(mean, op=dist.ReduceOp.SUM)
    sign = torch.tensor([-1.0 if op == "min" else 1.0 for op in ops], dtype=torch.float64, device=device)
    extreme = values * sign
    dist.all_reduce(extreme, op=dist.ReduceOp.MAX)
    out = torch.where(
        torch.tensor([op == "mean" for op in ops], device=device), mean / trainer.world_size, extreme * sign
    )
    return dict(zip(keys, out.tolist(), strict=True)), False


def _heatmap_figure(specs: Sequence[BlockSpec], norms: Mapping[str, float], step: int) -> Any:
    """A matplotlib figure of ``log10`` block norms, layers (rows) x sub-blocks (columns)."""
    from matplotlib.figure import Figure

    layers = sorted({s.layer for s in specs if s.name in norms})
    parts: list[str] = []
    for s in specs:
        part = s.name.split("/", 1)[-1]
        if s.name in norms and part not in parts:
            parts.append(part)
    grid = torch.full((len(layers), len(parts)), math.nan)
    for s in specs:
        value = norms.get(s.name)
        if value is not None and value > 0:
            grid[layers.index(s.layer), parts.index(s.name.split("/", 1)[-1])] = math.log10(value)
    figure = Figure(figsize=(1.5 + 1.2 * len(parts), 1.0 + 0.45 * len(layers)))
    ax = figure.add_subplot()
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(parts)), parts)
    ax.set_yticks(range(len(layers)), [f"layer{i}" for i in layers])
    for i, row in enumerate(grid.tolist()):
        for j, value in enumerate(row):
            if math.isfinite(value):
                ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="w", fontsize=8)
    figure.colorbar(image, ax=ax, label="log10 ||H||")
    ax.set_title(f"Block Hessian norms, step {step}")
    figure.tight_layout()
    return figure
