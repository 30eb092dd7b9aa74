"""The Lightning callback: a thin shell of Lightning hooks over :class:`curvwatch.Monitor`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from curvwatch import sharding
from curvwatch.adapters import BlockSpec, find_blocks
from curvwatch.alerts import Alert
from curvwatch.config import Cadence, Evaluation, Sharpness, Warnings
from curvwatch.monitor import Monitor
from curvwatch.options import OnError, WarningRules
from curvwatch.rules import RuleSet

__all__ = ["CurvatureMonitor", "OnError"]


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
    which strategies work); the real-loss keys' sampled backward passes run through FSDP2's hooks as any backward,
    on every rank or none. Under ``FSDPStrategy`` (FSDP1) the same, through ``summon_full_params`` of the FSDP units
    around one layer at a time, without the real-loss keys. Tensor parallelism and DeepSpeed are refused in
    ``setup``.

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
      ``{p}summary/overhead``, ``{p}summary/lanczos/rel_residual_max``, ``{p}summary/lanczos/unconverged``,
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
        every_n_train_steps: Full evaluations on optimizer steps ``0, n, 2n, ...``; ``None`` (default): every 200 steps
            within a budget of 1% of the training time (:class:`~curvwatch.Cadence` for the budget and the terms-only
            tier).
        blocks: ``"auto"`` or a list of :class:`~curvwatch.BlockSpec` (see :func:`~curvwatch.find_blocks`).
        log_key_prefix: Prefix of every logged key.
        sharpness: ``"auto"`` (default), ``True``, ``False`` or a :class:`~curvwatch.Sharpness` with the samples, loss,
            logits module and the in-run check. The curvature of the real training loss (:mod:`curvwatch.realloss`): on
            full evaluations, ``Sharpness.samples`` extra backward passes from the logits (labels sampled from the
            model's own predictions) give each attention and FFN block its Monte-Carlo Gauss-Newton curvature; the
            kernels add the block's exact own second-order term (``sharpness/...``), and the optimizer's threshold turns
            it into an edge-of-stability ratio (``stability/...``; SGD, Adam, AdamW). ``"auto"`` (default): on when a
            logits module is found (set-up table row ``sharpness``); ``True``: required (an error at set-up where it
            cannot work: no logits module found, FSDP1; and at the first full evaluation whose logits module gave no
            logits or no gradient); ``False``: off.
        warning_rules: Which warnings: ``"suite"`` (default: :class:`curvwatch.rules.RuleSet`, designed on the
            instability suite, ``docs/instability.md``: softmax saturation, growth of the attention-logit bound and of
            the exact value curvature, LayerNorm/RMSNorm collapse and its approach; no alarm on any stable control,
            leads of 29-147 steps where a signal allows, with the default terms-only tier), ``"none"``, or a
            configured ``RuleSet``. A :class:`~curvwatch.Warnings` also sets ``warn``.
        cadence: A :class:`~curvwatch.Cadence`: the terms-only tier (``terms_every_n_train_steps``) and the overhead
            budget (``max_overhead``).
        evaluation: A :class:`~curvwatch.Evaluation`: Lanczos ``tol``, ``max_iter``, ``max_basis``; ``dtype``,
            ``pairs``, ``parts``, ``max_tokens``, ``memory_budget_mb``, ``terms_keys``.
        on_error: ``"warn"``: an exception in an evaluation (capture hooks in forward or backward, summaries, loggers)
            skips it with a warning and training goes on (``{p}summary/skipped_evaluations`` counts them), a block whose
            closed form raises is left out alone; ``"raise"``: re-raise it. Out of memory in a closed form first frees
            the memory, halves the token limit (or, where the Lanczos bases dominate, the Lanczos vectors held per norm)
            for this and later evaluations and retries once, with a warning.
        log_heatmap: Log the block-norm heatmap image to W&B/TensorBoard loggers.
        verbose: Print one line per evaluation (rank zero).
        log_level: Which keys reach the loggers. ``"summary"`` (default; 59 for a 12-layer, 12-head GPT):
            the headline summaries, per layer the block norm of each sub-block (``curv_hessian/layer{i}/{part}``)
            and the largest stability ratio (``curv_stability/layer{i}``), the heatmaps and, with a
            ``WandbLogger``, a table of every block per evaluation (``{p}summary/layers``); ``"blocks"``: also every
            per-block key that is not per head nor a bound or term (727); ``"all"``: everything (7,303). Summaries,
            warnings, heatmaps and tables read the whole evaluation at every level (``docs/metrics.md``).

    Raises:
        ValueError: If a kwarg is invalid (in ``__init__``, naming the fix), or in ``setup`` if the model has no block
            curvwatch knows or the strategy shards parameters in a way it does not support (tensor parallel,
            DeepSpeed; the message says why and what to use).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from curvwatch import Evaluation
        >>> monitor = CurvatureMonitor(every_n_train_steps=100, evaluation=Evaluation(max_tokens=256))
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
        blocks: str | Sequence[BlockSpec] = "auto",
        log_key_prefix: str = "curv/",
        sharpness: bool | str | Sharpness = "auto",
        warning_rules: str | RuleSet | Warnings = "suite",
        cadence: Cadence | None = None,
        evaluation: Evaluation | None = None,
        on_error: str | OnError = "warn",
        log_heatmap: bool = True,
        verbose: bool = False,
        log_level: str = "summary",
    ) -> None:
        self.monitor = Monitor(
            every_n_train_steps=every_n_train_steps, blocks=blocks, log_key_prefix=log_key_prefix,
            sharpness=sharpness, warning_rules=warning_rules, cadence=cadence, evaluation=evaluation,
            on_error=on_error, log_heatmap=log_heatmap, verbose=verbose, log_level=log_level,
        )  # fmt: skip
        self.monitor.notices.owner = type(self).__name__
        self.monitor.no_loggers_hint = "the Trainer has no logger; give it one, e.g. Trainer(logger=WandbLogger())"
        s = self.monitor.settings
        self.every_n_train_steps = self.monitor.schedule.every_n_train_steps
        self.max_overhead = self.monitor.schedule.max_overhead
        self.log_key_prefix, self.blocks = s.log_key_prefix, s.blocks
        self.on_error, self.terms_keys = s.on_error, s.terms_keys
        rules = s.warnings.rules
        self.warning_rules = WarningRules.SUITE if isinstance(rules, RuleSet) else WarningRules(rules)
        # the parts of the monitor tests and tools read through the callback
        self.engine, self.book, self.schedule, self.real_loss = (
            self.monitor.engine, self.monitor.book, self.monitor.schedule, self.monitor.real_loss
        )  # fmt: skip
        self.tol, self.max_iter = self.monitor.tol, self.monitor.max_iter
        self.log_level = self.monitor.book.log_level

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
        self.monitor.reset()
        read_params = sharding.param_reader(trainer.strategy, pl_module)  # refuses what is not supported
        try:
            specs = find_blocks(pl_module, self.blocks)
        except ValueError as err:
            if read_params is None:
                raise
            raise ValueError(
                f"{err}\nUnder {type(trainer.strategy).__name__} the monitor finds the blocks in setup, before "
                "configure_model: build the layers in __init__ (on the meta device under "
                "trainer.init_module(empty_init=True) if they are large) and apply fully_shard in configure_model."
            ) from err
        self.monitor.attach(pl_module, specs=specs, read_params=read_params)
        self.monitor.grad_factor = lambda: self._grad_factor(trainer, pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        monitor = self.monitor
        monitor.loggers, monitor.world_size = trainer.loggers, trainer.world_size
        monitor.is_global_zero = trainer.is_global_zero
        monitor.start()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.monitor.schedule.stop()  # the budget's clock stops with training (state_dict is stable afterwards)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.monitor.capturing:  # a capture left open by a step without optimizer step
            self.monitor.close()
        full_due, terms_due = self.monitor.schedule.due(trainer.global_step)
        if trainer.sanity_checking or not (full_due or terms_due):
            return
        if pl_module.automatic_optimization and not self._steps_optimizer(trainer, batch_idx):
            return
        self.monitor.open(trainer.global_step)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None:
        self.monitor.before_backward(loss)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not self.monitor.capturing:
            return
        # every optimizer (manual optimization may have several): each block's weights are found in theirs
        self.monitor.before_optimizer_step(trainer.optimizers if len(trainer.optimizers) > 1 else optimizer)
        for key, value in self.monitor.latest.items():
            trainer.callback_metrics[self.log_key_prefix + key] = torch.tensor(value, dtype=torch.float32)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.monitor.close()  # no optimizer step happened (training_step returned None): retry next batch

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.monitor.close()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.monitor.close()

    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state_dict)

    # -- what the monitor knows ---------------------------------------------------------------------

    @property
    def alerts(self) -> list[Alert]:
        """The warnings fired so far (most recent last)."""
        return self.monitor.alerts

    @property
    def coverage(self) -> list[dict[str, str]]:
        """The set-up table, one row per monitored block and per part left out, with the reason."""
        return self.monitor.coverage

    def summary_text(self, top: int = 5) -> str:
        """A readable multi-line summary of the run so far: most curved blocks, heterogeneity, warnings.

        Args:
            top: How many of the most curved blocks to list.
        """
        return self.monitor.summary_text(top)

    # -- Lightning specifics ------------------------------------------------------------------------

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
