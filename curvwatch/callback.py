"""The Lightning callback: Lightning hooks and orchestration over the schedule, the capture and the engine."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from curvwatch import report, sharding, sinks
from curvwatch.adapters import BlockSpec, find_blocks
from curvwatch.alerts import Alert, AlertMonitor, CurvatureNotice, CurvatureWarning
from curvwatch.capture import Capture, CaptureError
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import BlockError, Engine, Evaluation
from curvwatch.logbook import Logbook, LogError, flatten
from curvwatch.options import OnError, TermsKeys, WarningRules, check_int, check_number, choice, pairs_option
from curvwatch.ranks import Ranks
from curvwatch.rules import RuleSet
from curvwatch.schedule import Schedule
from curvwatch.sharpness import RealLoss

__all__ = ["CurvatureMonitor", "OnError"]

_PARTS = ("outer", "functional", "hessian")


class CurvatureMonitor(Callback):
    r"""Monitor closed-form, per-block Hessian norms of a Transformer during training.

    Every ``every_n_train_steps`` optimizer steps (starting at step 0) the callback records, with hooks that
    exist only for that step, the input ``X`` and the back-propagated output gradient ``grad_output`` of every
    sub-block (attention, LayerNorm, FFN) found by :func:`curvwatch.find_blocks`; before the optimizer step its
    engine (:class:`curvwatch.engine.Engine`) evaluates the closed forms under ``torch.no_grad`` on the model's
    device, the ranks agree (:mod:`curvwatch.ranks`), and the callback summarizes (:mod:`curvwatch.metrics`),
    decides on warnings (:mod:`curvwatch.alerts`) and logs (:mod:`curvwatch.sinks`). At set-up it reports, on rank
    zero and in the W&B run config, a table of what it monitors in each layer and what it does not, with the reason.

    **Steps.** Values captured on optimizer step ``s`` (``trainer.global_step == s`` during that step) are
    logged with ``step=s`` to every logger in ``trainer.loggers``, on rank zero, regardless of
    ``log_every_n_steps``. With ``accumulate_grad_batches=k`` the last micro-batch of the window is captured;
    Lightning divides that loss by ``k``, so ``grad_output`` is multiplied by ``k`` (and divided by the AMP
    loss scale when a ``GradScaler`` is active) to give the curvature of one micro-batch's loss, comparable
    across ``k``.

    **DDP.** Each rank evaluates its own batch; the ranks then agree on a failure flag and reduce every number by
    its row in the key table (:mod:`curvwatch.keys`), so all ranks take the same decisions; rank zero logs and warns.

    **Sharded training.** Under FSDP2 (``ModelParallelStrategy(tensor_parallel_size=1)`` with ``fully_shard`` in
    ``configure_model``) the capture keeps no weights; each block's are gathered as full tensors only while it is
    evaluated, on every rank in the same order, then freed (:mod:`curvwatch.sharding`; ``docs/strategies.md`` says
    which strategies work). Under ``FSDPStrategy`` (FSDP1) the same, through ``summon_full_params`` of the FSDP units
    around one layer at a time. Tensor parallelism and DeepSpeed are refused in ``setup``.

    **Faults.** A block whose closed form raises is left out of that evaluation alone (warned once,
    ``summary/skipped_blocks``); NaN or Inf in a block's captured tensors marks it ``skipped_nonfinite``; any other
    exception skips the evaluation (``on_error``).

    **Logged metrics** (``docs/metrics.md`` has every key with its meaning and cross-rank reduction, from the one
    key table :func:`curvwatch.keys.key_table`; ``{p}`` is ``log_key_prefix``):

    - ``{p}{block}/{key}`` for each block (``layer3/attn``, ``layer3/ln_1``, ``layer3/ffn``...) and each key
      of its closed form: ``hessian/XY[/h{i}]``, ``outer/XY[/h{i}]``, ``functional/XY[/h{i}]`` (spectral norms
      of the block pair ``XY``, per head for attention), ``bound/...``, ``term/...``, ``ln/...``, ``ffn/...``.
    - Per block, derived: ``{p}{block}/hessian/max`` (largest Hessian norm of the block),
      ``{p}{block}/ratio/functional_outer``, ``{p}{block}/ratio/VV_QQ[/h{i}]``, ``{p}{block}/lanczos/rel_residual_max``.
    - ``{p}summary/max_hessian``, ``{p}summary/max_hessian_layer``, ``{p}summary/max_hessian_block``,
      ``{p}summary/heterogeneity/model``, ``{p}summary/heterogeneity/layer{i}``,
      ``{p}summary/vv_qq_ratio/median``, ``{p}summary/functional_outer/max``, ``{p}summary/functional_outer/median``,
      ``{p}summary/ln/inv_var_max``, ``{p}summary/ln/var_min``, ``{p}summary/ln/var_min_over_eps`` (RMSNorm:
      ``{p}summary/rms/inv_ms_max``, ``{p}summary/rms/ms_min``, ``{p}summary/rms/ms_min_over_eps``),
      ``{p}summary/eval_time_s``, ``{p}summary/evaluations``, ``{p}summary/skipped_evaluations``,
      ``{p}summary/skipped_blocks``, ``{p}summary/nonfinite_blocks``, ``{p}summary/warnings``,
      ``{p}summary/overhead_fraction``, ``{p}summary/lanczos/rel_residual_max``, ``{p}summary/lanczos/unconverged``,
      ``{p}summary/lanczos/norms``.
    - With ``terms_every_n_train_steps`` (on by default), terms-only evaluations log the per-block keys they
      compute, the kinds' summaries (``{p}summary/ln/...``), ``{p}summary/terms_eval_time_s`` and the counters (plus
      ``{p}summary/terms_evaluations``, also on full evaluations).
    - With ``sharpness``, per attention/FFN block and diagonal pair ``XX`` (per head): ``ggn/XX`` (largest
      eigenvalue of the Monte-Carlo Gauss-Newton block of the real loss), ``sharpness/XX`` (of it plus the block's
      own functional term), ``precond_ggn/XX`` and ``precond_sharpness/XX`` (Adam: of ``P^-1/2 (.) P^-1/2``),
      ``stability/XX`` (sharpness over the optimizer's stability threshold), ``sharpness/max``, ``stability/max``;
      ``{p}summary/sharpness/max``, ``{p}summary/stability/max`` (headline), ``{p}summary/stability/max_layer``,
      ``{p}summary/stability/max_block`` and the image ``{p}summary/stability_heatmap``; with
      ``verify_every_n_evals``, ``verify/hessian/XX/h0`` and ``verify/ratio/XX/h0`` (true / sharpness).
    - ``{p}{block}/skipped_nonfinite`` (``1``), only on evaluations where the block's captured input or
      output gradient (or its closed-form result) held NaN or Inf: its numbers are left out, never logged
      as if finite. A LayerNorm with a finite input still reports its variance statistics (``ln/var_min``...)
      so a collapse that produced the NaN is still seen.
    - With a ``WandbLogger`` (or ``TensorBoardLogger``) and matplotlib: ``{p}summary/heatmap``, an image of
      ``log10`` block norms, layers x sub-blocks; with a ``WandbLogger``, ``{p}summary/layers``, a table of every
      block's maxima and warning signals per full evaluation.
    - The warning signals, model-wide: ``{p}summary/signals/softmax_jac_min``, ``{p}summary/signals/logit_bound_max``,
      ``{p}summary/signals/outer_vv_max``; per layer (``curv_`` is the prefix without its ``/``):
      ``curv_hessian/layer{i}/{part}`` (the block norm of sub-block ``part``), ``curv_stability/layer{i}``.
    - ``log_level`` decides which of these reach the loggers (the key tables of ``docs/metrics.md`` give each key's).

    The headline summaries are also put in ``trainer.callback_metrics`` (as tensors), so ``EarlyStopping``
    and ``ModelCheckpoint`` can monitor e.g. ``"curv/summary/max_hessian"``.

    Args:
        every_n_train_steps: Evaluate on optimizer steps ``0, n, 2n, ...``. ``None`` (default): every 200 steps
            within the overhead budget (``max_overhead``). A chosen cadence is honoured as it is; when its
            evaluations take over 10% of the training time the monitor says so once, with what each costs. One
            evaluation costs a fixed amount of work (capped by ``max_tokens``), about 15 training steps of the tiny
            demo model (32-40 with the real-loss keys of ``sharpness``, ``docs/sharpness.md``) and fewer on larger
            ones (``docs/performance.md`` section 3).
        max_overhead: Largest fraction of the training wall time the evaluations may take. ``"auto"`` (default):
            0.01 with the default cadence, none with a chosen one; ``None``: a fixed schedule; a number: that
            budget (with any cadence). A due step is evaluated only if the evaluations so far plus this one
            (priced as the last one) stay within this fraction of the time trained so far, so the effective
            period may grow beyond ``every_n_train_steps`` (``curv/summary/overhead_fraction`` logs the fraction
            spent). Step 0 is always evaluated. With DDP the ranks agree through one all-reduce per due step.
        terms_every_n_train_steps: Also evaluate, on optimizer steps ``0, n, 2n, ...`` that are not due for a
            full evaluation, numbers that need no Lanczos over Hessian products (``terms_keys`` says which): by
            default what the warning rules read. ``"auto"`` (default): every 10 steps within a budget of its own,
            4% of the training time (a due terms-only step is skipped while the terms-only seconds so far plus one
            more would exceed it; the full tier's budget then counts full evaluations only); an int: that cadence,
            under ``max_overhead`` like the full tier; ``None``: off. A terms-only evaluation costs a fraction of a
            full one (``docs/performance.md`` section 3). Spike warnings, ``hessian/max``, ratios, norm summaries and
            the heatmap come from full evaluations only; ``patience`` and ``cooldown`` of the collapse warning count
            both kinds. Under the overhead budget a full evaluation it cannot afford falls back to terms only on
            steps due for both.
        terms_keys: What a terms-only evaluation computes. ``"warnings"`` (default): what the warning rules read,
            no more (attention: ``term/x_norm``, ``term/x_norm6``, ``term/wq_norm``, ``term/wk_norm``,
            ``term/softmax_jac_norm`` and the exact ``outer/VV``; LayerNorm/RMSNorm: the row statistics; FFN blocks
            only when a rule reads their ``W2W2``): the same numbers, 3.3-3.9x cheaper than ``"all"`` on the
            instability suite's models, 3.5-3.8x on the demo and a d = 384 GPT (``docs/performance.md``).
            ``"all"``: every bound term and bound (``term/...``, ``bound/...``), the exact norms (``outer/VV``,
            ``hessian/VV``, ``.../W2W2``), the norms of the LayerNorm/RMSNorm blocks, the FFN activity fractions.
        blocks: ``"auto"`` or a list of :class:`~curvwatch.BlockSpec` (see :func:`~curvwatch.find_blocks`).
        max_tokens: Token positions kept per block (first whole sequences; see
            :class:`~curvwatch.capture.Capture`).
        log_key_prefix: Prefix of every logged key.
        tol: Relative residual at which a Lanczos spectral norm counts as converged (default ``1e-2``: the norms of
            the demo and of a 6-layer d = 384 GPT were within 3e-4 and 1.7e-3 of tightly converged values,
            ``docs/performance.md``). A norm that hits ``max_iter`` first is counted in
            ``summary/lanczos/unconverged`` and warned about once.
        max_iter: Most Lanczos steps per norm.
        max_basis: Most Lanczos vectors held per norm (``>= 4``; ``None``: ``max_iter``). A norm that needs more
            steps restarts (thick restart: same accuracy, a few more products), so the memory of its basis is
            bounded whatever ``max_iter``.
        dtype: ``"float32"`` or ``"float64"``, the precision of the closed forms.
        pairs: Block pairs kept: ``"diagonal"`` (``VV``, ``QQ``, ``KK``, ``W1W1``, ``W2W2``, ...), ``"all"`` or a
            list of names such as ``["VV", "QQ", "VQ", "W1W1"]``.
        kinds: Which iterative norms to compute: a subset of ``("outer", "functional", "hessian")`` (default
            all three). ``("hessian",)`` alone made an evaluation 2.2x (demo) to 2.9x (mid-size model) cheaper.
        collapse_ratio: Legacy rules (``warning_rules="legacy"``): LayerNorm collapse warning when ``var_min / eps``
            drops below it (0 disables).
        inv_var_threshold: Also warn when ``ln/inv_var_max = 1/min(var + eps)`` exceeds it (``None``: off).
        spike_factor: Spike warning when a block norm exceeds ``spike_factor`` x its running baseline.
        spike_warmup: Evaluations of a block that only build its baseline.
        patience: Consecutive evaluations a condition must hold before it warns.
        cooldown: Evaluations a fired (kind, block) stays silent.
        warn: Emit :class:`~curvwatch.CurvatureWarning` (and W&B alerts) when a condition fires. The monitor's
            notices about itself (unconverged norms, costs, blocks left out, skipped evaluations) are
            :class:`~curvwatch.CurvatureNotice`, a separate category, whatever ``warn``.
        warning_rules: Which warnings: ``"suite"`` (default: :class:`curvwatch.rules.RuleSet`, designed on the
            instability suite, ``docs/instability.md``: softmax saturation, growth of the attention-logit bound and
            of the exact value curvature, LayerNorm/RMSNorm collapse and its approach; no alarm on any stable control,
            leads of 29-147 steps where a signal allows, with the default terms-only tier), ``"legacy"``
            (the spike and collapse rules configured by ``collapse_ratio`` ... ``cooldown``: they fire on healthy
            runs too), ``"all"``, or a configured ``RuleSet``.
        on_error: ``"warn"``: an exception in an evaluation (capture hooks in forward or backward, summaries,
            loggers) skips it with a warning and training goes on (``{p}summary/skipped_evaluations`` counts them),
            a block whose closed form raises is left out alone; ``"raise"``: re-raise it. Out of memory in a closed
            form first frees the memory, halves the token limit (or, where the Lanczos bases dominate, the Lanczos
            vectors held per norm) for this and later evaluations and retries once, with a warning.
        memory_budget_mb: Most extra memory, in MiB, one block's closed form may take (estimated by
            :meth:`~curvwatch.capture.CapturedBlock.evaluation_bytes`): a block over it holds fewer Lanczos vectors
            per norm, then is evaluated on fewer tokens; one warning each. ``None``: no budget.
        log_heatmap: Log the block-norm heatmap image to W&B/TensorBoard loggers.
        verbose: Print one line per evaluation (rank zero).
        sharpness: The curvature of the real training loss (:mod:`curvwatch.sharpness`): on full evaluations,
            ``sharpness_samples`` extra backward passes from the logits (labels sampled from the model's own
            predictions) give each attention and FFN block its Monte-Carlo Gauss-Newton curvature; the kernels add
            the block's exact own second-order term (``sharpness/...``), and the optimizer's threshold turns it into
            an edge-of-stability ratio (``stability/...``; SGD, Adam, AdamW). ``"auto"`` (default): on when a
            logits module is found (set-up table row ``sharpness``); ``True``: required (error in ``setup``
            otherwise); ``False``: off.
        sharpness_samples: Sampled output gradients per evaluation (each one backward pass from the logits).
        loss: The loss at the logits: ``"auto"`` (softmax cross-entropy, recognised from its gradient; anything
            else is an error naming the options), ``"cross_entropy"`` or ``"mse"`` (mean over every element).
        logits_module: Dotted name of the module whose output the loss reads (``None``: the first of ``lm_head``,
            ``head``, ``classifier``, ``output``, ``score``, ``fc_out``, ``decoder`` found).
        verify_every_n_evals: Every this many full evaluations (``None``, default: never), also compute the true
            block Hessian's largest eigenvalue by Hessian-vector products of the loss (everything downstream
            included; head 0 of attention) and log it with its ratio to the sharpness (``verify/hessian/XX``,
            ``verify/ratio/XX``): how far the closed-form view is from the truth on your model. Costs a backward
            with ``create_graph`` and ~30 double-backward products per pair; needs double backward (no fused
            attention kernels).
        log_level: Which keys reach the loggers. ``"summary"`` (default; 59 for a 12-layer, 12-head GPT):
            the headline summaries, per layer the block norm of each sub-block (``curv_hessian/layer{i}/{part}``)
            and the largest stability ratio (``curv_stability/layer{i}``), the heatmaps and, with a
            ``WandbLogger``, a table of every block per evaluation (``{p}summary/layers``); ``"blocks"``: also every
            per-block key that is not per head nor a bound or term (727); ``"all"``: everything (7,303). Summaries,
            warnings, heatmaps and tables read the whole evaluation at every level (``docs/metrics.md``).

    Raises:
        ValueError: If a kwarg is invalid (in ``__init__``), or in ``setup`` if the model has no block
            curvwatch knows or the strategy shards parameters in a way it does not support (tensor parallel,
            DeepSpeed; the message says why and what to use).

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
        every_n_train_steps: int | None = None,
        max_overhead: float | str | None = "auto",
        terms_every_n_train_steps: int | str | None = "auto",
        terms_keys: str = "warnings",
        blocks: str | Sequence[BlockSpec] = "auto",
        max_tokens: int = 512,
        log_key_prefix: str = "curv/",
        tol: float = 1e-2,
        max_iter: int = 40,
        max_basis: int | None = 16,
        dtype: str = "float32",
        pairs: str | Sequence[str] = "diagonal",
        kinds: Sequence[str] = _PARTS,
        collapse_ratio: float = 5.0,
        inv_var_threshold: float | None = None,
        spike_factor: float = 10.0,
        spike_warmup: int = 3,
        patience: int = 1,
        cooldown: int = 10,
        warn: bool = True,
        warning_rules: str | WarningRules | RuleSet = "suite",
        on_error: str | OnError = "warn",
        memory_budget_mb: float | None = None,
        log_heatmap: bool = True,
        verbose: bool = False,
        sharpness: bool | str = "auto",
        sharpness_samples: int = 16,
        loss: str = "auto",
        logits_module: str | None = None,
        verify_every_n_evals: int | None = None,
        log_level: str = "summary",
    ) -> None:
        self.schedule = Schedule(every_n_train_steps, terms_every_n_train_steps, max_overhead)  # validates them
        check_int("max_tokens", max_tokens, 1)
        check_int("max_iter", max_iter, 1)
        if not (blocks == "auto" or (not isinstance(blocks, str) and isinstance(blocks, Sequence)
                                     and all(isinstance(b, BlockSpec) for b in blocks))):  # fmt: skip
            raise ValueError(f"Invalid blocks={blocks!r}. Must be 'auto' or a list of curvwatch.BlockSpec.")
        if not isinstance(log_key_prefix, str):
            raise ValueError(f"Invalid log_key_prefix={log_key_prefix!r}. Must be a str such as 'curv/'.")
        kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
        if not kinds or any(k not in _PARTS for k in kinds):
            raise ValueError(f"Invalid kinds={kinds!r}. Must be a non-empty subset of {_PARTS}.")
        check_number(
            "memory_budget_mb", memory_budget_mb, low=0, allow_none=True, hint="> 0 (MiB), or None for no budget"
        )
        self._alerts = AlertMonitor(  # validates the alert thresholds
            collapse_ratio=collapse_ratio,
            inv_var_threshold=inv_var_threshold,
            spike_factor=spike_factor,
            spike_warmup=spike_warmup,
            patience=patience,
            cooldown=cooldown,
        )
        if isinstance(warning_rules, RuleSet):
            rules: RuleSet | None = warning_rules
            self.warning_rules = WarningRules.SUITE
        else:
            self.warning_rules = choice("warning_rules", warning_rules, WarningRules)
            rules = RuleSet() if self.warning_rules in (WarningRules.SUITE, WarningRules.ALL) else None
        legacy = self.warning_rules in (WarningRules.LEGACY, WarningRules.ALL)
        self.terms_keys = choice("terms_keys", terms_keys, TermsKeys)
        # a signals evaluation's exact pairs (None: every term and bound); the statistics of the norms always
        self._signal_pairs = (rules.exact_pairs if rules else ()) if self.terms_keys is TermsKeys.WARNINGS else None
        self.on_error = choice("on_error", on_error, OnError)
        self.real_loss = RealLoss(sharpness, sharpness_samples, loss, logits_module)  # validates them
        check_int("verify_every_n_evals", verify_every_n_evals, 1, allow_none=True)
        self.verify_every_n_evals = verify_every_n_evals
        self.engine = Engine(
            lanczos=Lanczos(tol=tol, max_iter=max_iter, max_basis=max_basis),  # validates them
            dtype=dtype,  # validated by the engine
            pairs=pairs_option(pairs),
            kinds=kinds,
            max_tokens=max_tokens,
            memory_budget_mb=memory_budget_mb,
            raise_errors=self.on_error is OnError.RAISE,
            key_prefix=log_key_prefix,
        )
        # the run's record: summaries, warnings, counters (checkpointed); tol was validated by Lanczos above
        self.book = Logbook(log_key_prefix, float(tol), self._alerts if legacy else None, rules,
                            count_terms=self.schedule.terms_every_n_train_steps is not None,
                            log_level=log_level)  # fmt: skip
        self.log_level = self.book.log_level
        self.every_n_train_steps = self.schedule.every_n_train_steps
        self.terms_every_n_train_steps = terms_every_n_train_steps  # as given ("auto", an int or None)
        self.max_overhead = self.schedule.max_overhead
        self.blocks = blocks
        self.max_tokens, self.log_key_prefix, self.tol, self.max_iter = max_tokens, log_key_prefix, float(tol), max_iter
        self.max_basis, self.dtype, self.pairs, self.kinds = max_basis, self.engine.dtype, self.engine.pairs, kinds
        self.warn, self.log_heatmap, self.verbose = bool(warn), bool(log_heatmap), bool(verbose)
        self.memory_budget_mb = self.engine.memory_budget_mb

        self._specs: list[BlockSpec] = []
        self._block_info: dict[str, tuple[str, int | None, float | None]] = {}  # name -> (kind, layer, eps)
        self._coverage: list[dict[str, str]] = []
        self._stack: ExitStack | None = None
        self._capture: Capture | None = None
        self._capture_step: int | None = None
        self._capture_terms_only = False  # the open capture is for a terms-only evaluation
        self._open_error: BaseException | None = None
        self._sample_seconds = 0.0  # the sampled backward passes of the open capture, charged with its evaluation
        self._read_params: sharding.ParamReader | None = None  # sharded training: weights read at evaluation

    # -- Lightning hooks ----------------------------------------------------------------------------

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            every_n_train_steps=self.every_n_train_steps, log_key_prefix=self.log_key_prefix
        )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # a fit starts a fresh record (an instance may be reused); a resumed one loads its checkpoint's after setup
        self.load_state_dict({})
        self._read_params = sharding.param_reader(trainer.strategy, pl_module)  # refuses what is not supported
        try:
            self._specs = find_blocks(pl_module, self.blocks)
        except ValueError as err:
            if self._read_params is None:
                raise
            raise ValueError(
                f"{err}\nUnder {type(trainer.strategy).__name__} the monitor finds the blocks in setup, before "
                "configure_model: build the layers in __init__ (on the meta device under "
                "trainer.init_module(empty_init=True) if they are large) and apply fully_shard in configure_model."
            ) from err
        self._coverage = report.coverage_rows(self._specs, pl_module)
        self._block_info = {s.name: (s.kind, s.layer, _eps(s.module)) for s in self._specs}
        status = self.real_loss.resolve(pl_module, sharded=self._read_params is not None)
        if any(r["status"] != "monitored" and r["layer"] != "-" for r in self._coverage) or self.verbose:
            rank_zero_info("CurvatureMonitor blocks:\n" + report.coverage_text(self._coverage))
        if self.verbose or not status.startswith("on") or self.real_loss.hooks_note:
            rank_zero_info(f"CurvatureMonitor real-loss sharpness: {status}")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.schedule.start()
        if trainer.is_global_zero:
            sinks.define_wandb_metrics(trainer.loggers, self.book.metric_summaries(self._block_info))
            sinks.log_config(trainer.loggers, self._coverage, report.coverage_text(self._coverage))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.schedule.stop()  # the budget's clock stops with training (state_dict is stable afterwards)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._capture_step is not None:  # a capture left open by a step without optimizer step
            self._close()
        step = trainer.global_step
        full_due, terms_due = self.schedule.due(step)
        if trainer.sanity_checking or not (full_due or terms_due):
            return
        if pl_module.automatic_optimization and not self._steps_optimizer(trainer, batch_idx):
            return
        full_ok, terms_ok = self.schedule.affordable(Ranks(trainer.world_size, pl_module.device).max)
        # a due full evaluation the budget cannot afford falls back to terms only where those are due too
        terms_only = not (full_due and full_ok)
        if terms_only and not (terms_due and terms_ok):
            if "budget_info" not in self.engine.warned:
                self.engine.warned.add("budget_info")
                rank_zero_info(self.schedule.budget_note(step, full_due))
            return
        self._capture_step, self._capture_terms_only, self._open_error = step, terms_only, None
        self._stack = ExitStack()
        logits = None if terms_only else self.real_loss.module
        try:
            self._capture = self._stack.enter_context(
                Capture(self._specs, self.engine.token_limit, read_params=self._read_params, logits_module=logits)
            )
        except Exception as err:  # reported in on_before_optimizer_step, after the ranks agree
            self._open_error = err
            self._close()
            self._capture_step = step

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        capture = self._capture
        if capture is None or capture.logits_module is None or self._capture_terms_only:
            return
        start = time.perf_counter()  # charged with the evaluation (summary/eval_time_s, the overhead budget)
        every = self.verify_every_n_evals
        verify = every is not None and self.book.evaluations % every == 0
        factor = self._grad_factor(trainer, pl_module)
        self.real_loss.before_backward(capture, loss, factor, self._capture_step, verify, self.engine.warn_once)
        self._sample_seconds += time.perf_counter() - start

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self._capture_step is None:
            return
        step, capture, open_error, terms_only = (
            self._capture_step, self._capture, self._open_error, self._capture_terms_only
        )  # fmt: skip
        self._close()
        self.schedule.last_step = step
        self._evaluate_and_log(trainer, pl_module, step, capture, open_error, terms_only, optimizer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._close()  # no optimizer step happened (training_step returned None): retry next batch

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()

    def state_dict(self) -> dict[str, Any]:
        state = {**self.schedule.state_dict(), **self.engine.state_dict(), **self.book.state_dict()}
        return {**state, "warned": sorted(self.engine.warned)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.book.load_state_dict(state_dict)
        runs = self.book.evaluations + self.book.terms_evaluations + self.book.skipped  # checkpoints before "runs"
        self.schedule.load_state_dict({"runs": runs, **state_dict})
        self.engine.load_state_dict(state_dict)
        self.engine.warned = set(state_dict.get("warned", []))
        self.engine.warm.clear()  # Lanczos start vectors are not checkpointed: a cold start is only slower

    # -- public helpers -----------------------------------------------------------------------------

    @property
    def alerts(self) -> list[Alert]:
        """The warnings fired so far (most recent last)."""
        return self.book.history

    @property
    def coverage(self) -> list[dict[str, str]]:
        """The set-up table: one row per monitored block and per part left out, with the reason."""
        return [dict(r) for r in self._coverage]

    def summary_text(self, top: int = 5) -> str:
        """A readable multi-line summary of the run so far: most curved blocks, heterogeneity, warnings.

        Args:
            top: How many of the most curved blocks to list.
        """
        book = self.book
        return report.summary_text(
            evaluations=book.evaluations,
            terms_evaluations=book.terms_evaluations if book.count_terms else None,
            skipped=book.skipped,
            last_step=self.schedule.last_step,
            fired=book.fired,
            last_norms=book.last_norms,
            last_summary=book.last_summary,
            peak=book.peak,
            history=book.history,
            errors=book.errors,
            max_iter=self.max_iter,
            tol=self.tol,
            top=top,
        )

    # -- orchestration ------------------------------------------------------------------------------

    def _close(self) -> None:
        """Remove the hooks (idempotent)."""
        stack, self._stack, self._capture, self._capture_step = self._stack, None, None, None
        self._capture_terms_only = False
        if stack is not None:
            stack.close()

    @staticmethod
    def _steps_optimizer(trainer: Trainer, batch_idx: int) -> bool:
        """Whether the optimizer steps after this batch (last micro-batch of an accumulation window)."""
        should_accumulate = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
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

    def _evaluate_and_log(self, trainer, pl_module, step, capture, open_error, terms_only=False, optimizer=None):
        """Evaluate, agree across ranks, then log; the monitor's seconds are charged to the overhead budget."""
        error: BaseException | None = open_error
        flat: dict[tuple[str, str], float] = {}
        evaluation = Evaluation()
        ranks = Ranks(trainer.world_size, pl_module.device)
        start = time.perf_counter()
        blocks, factor = [], 1.0
        if error is None:
            try:
                if capture is None:
                    raise RuntimeError("no capture was open for this step")
                blocks, factor = capture.blocks(), self._grad_factor(trainer, pl_module)
            except Exception as err:
                error = err
        ready = True  # sharded: the engine gathers each block's weights, a collective: it runs on all ranks or none
        if self._read_params is not None:
            ready = not ranks.max(torch.tensor([float(error is not None)], dtype=torch.float64))[0] > 0
        if error is None and ready:
            try:
                rules = self.real_loss.stability_rules(optimizer, blocks, self.engine.warn_once)
                evaluation = self.engine.evaluate(blocks, factor, terms_only, rules, self._signal_pairs)
                self.real_loss.add_verified(evaluation.results)
                flat = flatten(evaluation.results)
            except Exception as err:
                error = err
        elapsed = time.perf_counter() - start + self._sample_seconds
        self._sample_seconds = 0.0
        self.schedule.charge(elapsed, terms_only)
        flat, failed_elsewhere = ranks.sync(flat, error is not None)
        if error is not None or failed_elsewhere:
            self._skip(trainer, step, error)
            return
        rule_states = self.book.rule_states()
        logging_start = time.perf_counter()
        try:  # after the collectives: a failure here is local, the other ranks cannot hang on it
            self._log(trainer, step, flat, evaluation, elapsed, terms_only)
        except Exception as err:
            self.book.load_rule_states(rule_states)
            self._skip(trainer, step, LogError(err))
        finally:  # logging (heatmap, W&B) is part of the monitor's cost too
            self.schedule.charge(time.perf_counter() - logging_start, terms_only, extra=True)

    def _log(self, trainer, step, flat, evaluation: Evaluation, elapsed: float, terms_only: bool = False) -> None:
        """Log one evaluation's (reduced) numbers (:class:`~curvwatch.logbook.Logbook`), count it, then warn."""
        overhead = self.schedule.overhead_fraction
        entry = self.book.record(step, flat, evaluation, self._block_info, elapsed, overhead, terms_only)
        if trainer.is_global_zero:
            sinks.log_entry(trainer.loggers, entry, self._specs, self.log_key_prefix, self.log_heatmap)
        self.book.commit(entry)
        for key, value in self.book.headlines().items():
            trainer.callback_metrics[self.log_key_prefix + key] = torch.tensor(value, dtype=torch.float32)
        if not trainer.is_global_zero:
            return
        warm = {b: r for b, r in entry.results.items() if b not in evaluation.cold}
        notices = report.evaluation_notices(
            step, evaluation.excluded, evaluation.failed, warm, self.tol, self.max_iter, self.log_key_prefix
        )
        note = None if terms_only else self.schedule.cost_note(step)
        for key, message in notices + ([("cadence_cost", note)] if note is not None else []):
            self.engine.warn_once(key, message)
        if self.warn:
            for alert in entry.fired:
                warnings.warn(alert.message, CurvatureWarning, stacklevel=2)
                sinks.wandb_alert(trainer.loggers, "curvwatch: " + alert.kind.replace("_", " "), alert.message)
        if self.verbose:
            line = report.progress_line(step, entry.summary, entry.norms, len(entry.fired), elapsed, terms_only)
            rank_zero_info(line)

    def _skip(self, trainer: Trainer, step: int, error: BaseException | None) -> None:
        """Count a failed evaluation, then warn or raise (all ranks take the same branch)."""
        what = self.book.skip(step, error)
        if self.on_error is OnError.RAISE:
            if isinstance(error, (BlockError, LogError, CaptureError)):
                raise error.error
            if error is not None:
                raise error
            raise RuntimeError(f"CurvatureMonitor: {what} at step {step} (on_error='raise').")
        key = f"{self.log_key_prefix}summary/skipped_evaluations"
        trainer.callback_metrics[key] = torch.tensor(float(self.book.skipped))
        if not trainer.is_global_zero:
            return
        sinks.log_quietly(trainer.loggers, {key: float(self.book.skipped)}, step)
        warnings.warn(
            f"CurvatureMonitor skipped the evaluation at step {step}: {what}. Training continues; "
            f"{key}={self.book.skipped}. Pass on_error='raise' to get the traceback, or blocks=[...] to leave "
            "the failing block out.",
            CurvatureNotice,
            stacklevel=2,
        )


def _eps(module: Any) -> float | None:
    """The module's ``eps`` if it has a numeric one (norms), else ``None``."""
    eps = getattr(module, "eps", None)
    return eps if isinstance(eps, (int, float)) else None
