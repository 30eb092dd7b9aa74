"""The Hugging Face ``transformers.Trainer`` shell: a ``TrainerCallback`` over :class:`curvwatch.Monitor`.

:class:`CurvatureCallback` captures the last micro-batch of each due optimizer step and evaluates and logs in
``on_pre_optimizer_step`` (after the backward, before the weights change). The real-loss keys are sampled from the
logits' gradient during the Trainer's own backward. Logged to ``log`` (a W&B run, a Lightning/Fabric logger or a
callable ``fn(metrics, step)``), or, when ``log`` is ``None``, to the active W&B run if the Trainer reports to W&B.

The captured output gradients are scaled back to those of the micro-batch's own mean loss, as the Lightning shell
does:

- **Gradient accumulation** (``gradient_accumulation_steps = k``): the last micro-batch is the one captured (a
  forward pre-hook on the model opens the capture when accelerate's ``GradientState.sync_gradients`` says the
  optimizer steps after it). When the Trainer passes ``num_items_in_batch`` to the model (models whose loss takes
  it, Llama among them) the micro-batch's loss is a sum over its tokens divided by the tokens of the whole
  accumulated batch: the factor is ``num_items_in_batch / (its tokens)``, counted as the Trainer counts them
  (``labels[..., 1:] != -100`` for causal LMs); otherwise the Trainer divided the loss by the number of
  micro-batches, the factor. A custom ``compute_loss_func`` or ``compute_loss`` override, or label smoothing,
  normalises the loss in ways a callback cannot see: the factor then assumes the model's own loss.
- **fp16 loss scale**: the ``GradScaler`` accelerate creates for fp16 on a GPU is read from the optimizer
  (``AcceleratedOptimizer.scaler``, the same object as ``trainer.accelerator.scaler``) and divided out. fp16 on CPU
  has no scaler (accelerate scales nothing there); DeepSpeed scales the loss inside its engine, which a callback
  cannot read: the callback warns once and the numbers are the scaled ones.

The monitor's state (schedule and overhead clock, logbook and rule states, lowered engine limits) is saved in the
Trainer's checkpoints, in ``trainer_state.json``'s ``stateful_callbacks`` (the callback is an ``ExportableState``),
and restored by ``trainer.train(resume_from_checkpoint=...)``. Leave ``restore_callback_states_from_checkpoint`` at
its default ``False``: with ``True`` transformers rebuilds the callback from its arguments, which cannot hold
``log=`` or the settings (the callback warns then).

Example:
    >>> from transformers import TrainerCallback
    >>> callback = CurvatureCallback(every_n_train_steps=50, sharpness=False)
    >>> isinstance(callback, TrainerCallback), callback.monitor.schedule.every_n_train_steps
    (True, 50)
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from curvwatch.config import check_names
from curvwatch.monitor import Monitor

__all__ = ["CurvatureCallback"]

_IGNORE = -100  # the label the Trainer and the models' losses leave out


class CurvatureCallback(TrainerCallback, ExportableState):
    """Monitor closed-form per-block Hessian norms of a model trained by ``transformers.Trainer``.

    Args:
        log: Where the numbers go (see :class:`~curvwatch.Monitor`); ``None``: the active W&B run when
            ``report_to`` includes ``"wandb"``, else nowhere but :attr:`Monitor.latest` and the warnings.
        **settings: The settings of :class:`~curvwatch.CurvatureMonitor` (``every_n_train_steps``, ``evaluation``,
            ``sharpness``...), validated here.
    """

    def __init__(self, log: Any = None, **settings: Any) -> None:
        check_names(settings, type(self).__name__)
        self.monitor = Monitor(None, log=log, **settings)
        self.monitor.notices.owner = type(self).__name__
        self.monitor.no_loggers_hint = (
            "no log= was given and TrainingArguments.report_to has no 'wandb' (or W&B has no run); set "
            "report_to='wandb', or pass log= (a W&B run, a logger or a callable fn(metrics, step))"
        )
        self.monitor.grad_factor = self._grad_factor
        self._log_given = log is not None
        self._hook: Any = None
        self._pending: int | None = None  # the step whose last micro-batch is still to come
        self._micro_batches = 0  # forwards of the model since the step began
        self._batch: dict[str, Any] = {}  # the loss kwargs of the captured micro-batch
        self._shifts_labels = False
        self._loss_multiplier = 1.0  # the Trainer multiplies the loss by this (average_tokens_across_devices)
        self._scaler_unseen = False

    # -- checkpoints (ExportableState) ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The monitor's :meth:`~curvwatch.Monitor.state_dict` (plain numbers, strings) for ``trainer_state.json``."""
        return {"args": {}, "attributes": {"monitor_state": self.monitor.state_dict()}}

    # -- the Trainer's events -------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        monitor = self.monitor
        monitor.reset()  # each train() starts a fresh record; a resumed one loads its checkpoint's next
        if "monitor_state" in vars(self):  # transformers rebuilt this callback from the checkpoint's JSON
            monitor.notices.once(
                "hf_rebuilt",
                "CurvatureCallback was rebuilt by transformers from the checkpoint "
                "(restore_callback_states_from_checkpoint=True) with default settings and no log=. Leave that "
                "argument False (the default): CurvatureCallback restores the monitor's state itself.",
            )
            monitor.load_state_dict(vars(self).pop("monitor_state"))
        elif state.global_step > 0:  # resumed from a checkpoint: trainer_state.json holds our state
            saved = (state.stateful_callbacks or {}).get(type(self).__name__)
            if isinstance(saved, list):  # several CurvatureCallbacks: transformers keeps a list
                saved = saved[0] if saved else None
            if isinstance(saved, dict) and "monitor_state" in saved.get("attributes", {}):
                monitor.load_state_dict(saved["attributes"]["monitor_state"])
        if monitor.model is not model:
            monitor.attach(model)
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        monitor.optimizer = optimizer
        self._shifts_labels = _loss_shifts_labels(model)
        # average_tokens_across_devices: num_items_in_batch counts every rank's tokens, the loss is x world size
        self._loss_multiplier = float(args.world_size) if args.average_tokens_across_devices else 1.0
        self._scaler_unseen = (
            bool(args.fp16)
            and getattr(optimizer, "scaler", None) is None
            and (bool(args.deepspeed) or monitor.device.type != "cpu")
        )
        if self._scaler_unseen:
            monitor.notices.once(
                "hf_fp16_scale",
                "CurvatureCallback: fp16 training scales the loss, and this Trainer's loss scale is not visible to "
                "callbacks (no GradScaler on the optimizer: DeepSpeed?). The logged curvature is multiplied by the "
                "unknown scale. Train in bf16 (bf16=True) for numbers you can read.",
            )
        if not self._log_given and "wandb" in (args.report_to or []):
            import wandb

            monitor.loggers = [] if wandb.run is None else self._wandb_loggers(wandb.run)
        monitor.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self.monitor.close()
        self._pending, self._micro_batches, self._batch = state.global_step, 0, {}

    def _before_forward(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        """Count the micro-batches; open the capture on the last one of a step (the optimizer steps after it)."""
        if self._pending is None:
            return  # a forward outside training steps (evaluation)
        self._micro_batches += 1
        if not _sync_gradients():
            return
        step, self._pending = self._pending, None
        self._batch = {k: kwargs.get(k) for k in ("labels", "shift_labels", "num_items_in_batch")}
        self.monitor.open(step)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._pending is not None:  # no forward said it was the last micro-batch
            self._pending = None
            self.monitor.notices.once(
                "hf_last_micro_batch",
                "CurvatureCallback could not tell the last micro-batch of the step (accelerate's "
                "GradientState.sync_gradients was never True during a forward): no evaluation this step. Is the "
                "model's forward called by the Trainer's training_step?",
            )
        self.monitor.before_optimizer_step(optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        self.monitor.close()
        self._pending, self._batch = None, {}

    def on_train_end(self, args, state, control, **kwargs):
        self.monitor.stop()
        self._pending = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- the factor undoing the Trainer's loss scaling --------------------------------------------------------

    def _grad_factor(self) -> float:
        """Undo the Trainer's normalisation of the captured micro-batch's loss and the fp16 loss scale."""
        factor = self._accumulation_factor()
        scaler = getattr(self.monitor.optimizer, "scaler", None)
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            factor /= float(scaler.get_scale())
        return factor

    def _accumulation_factor(self) -> float:
        batch = self._batch
        total = batch.get("num_items_in_batch")
        if total is None:  # the Trainer divided the loss by the number of micro-batches
            return float(max(1, self._micro_batches))
        labels = batch.get("shift_labels")
        if labels is None and batch.get("labels") is not None:
            labels = batch["labels"][..., 1:] if self._shifts_labels else batch["labels"]
        if labels is None:
            self.monitor.notices.once(
                "hf_items",
                "CurvatureCallback: the model got num_items_in_batch but no labels (label smoothing or a "
                "compute_loss_func computes the loss outside the model): the curvature logged is that of the "
                "micro-batch's share of the accumulated loss (about 1/gradient_accumulation_steps of its own).",
            )
            return 1.0
        tokens = int(labels.ne(_IGNORE).sum())
        return float(total) / (self._loss_multiplier * max(tokens, 1))

    @staticmethod
    def _wandb_loggers(run: Any) -> list[Any]:
        from curvwatch.sinks import as_loggers

        return as_loggers(run)


def _sync_gradients() -> bool:
    """Whether the optimizer steps after the current micro-batch (the Trainer sets it before each forward)."""
    from accelerate.state import GradientState

    return bool(GradientState().sync_gradients)


def _loss_shifts_labels(model: Any) -> bool:
    """Whether the model's loss shifts the labels (causal LMs), the Trainer's own test for its token count."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "config", None)
    is_causal = LOSS_MAPPING.get(getattr(inner, "loss_type", None)) is ForCausalLMLoss
    return is_causal and not getattr(config, "is_encoder_decoder", False)
