"""The Hugging Face ``transformers.Trainer`` shell: a ``TrainerCallback`` over :class:`curvwatch.Monitor`.

:class:`CurvatureCallback` opens the capture in ``on_step_begin`` when the step is due, and evaluates and logs in
``on_pre_optimizer_step`` (after the backward, before the weights change). The real-loss keys are sampled from the
logits' gradient during the Trainer's own backward. Logged to ``log`` (a W&B run, a Lightning/Fabric logger or a
callable ``fn(metrics, step)``), or, when ``log`` is ``None``, to the active W&B run if the Trainer reports to W&B.

With ``gradient_accumulation_steps = k > 1`` the first micro-batch of each step is captured (the callbacks cannot
see which micro-batch is last) and its output gradients multiplied by ``k``: exact when the Trainer divides each
micro-batch's loss by ``k`` (models whose loss does not take ``num_items_in_batch``); otherwise the numbers are the
curvature of that micro-batch's share of the loss. fp16 training's loss scale is not seen by callbacks: use bf16.

Example:
    >>> from transformers import TrainerCallback
    >>> callback = CurvatureCallback(every_n_train_steps=50, sharpness=False)
    >>> isinstance(callback, TrainerCallback), callback.monitor.schedule.every_n_train_steps
    (True, 50)
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from curvwatch.monitor import Monitor

__all__ = ["CurvatureCallback"]


class CurvatureCallback(TrainerCallback):
    """Monitor closed-form per-block Hessian norms of a model trained by ``transformers.Trainer``.

    Args:
        log: Where the numbers go (see :class:`~curvwatch.Monitor`); ``None``: the active W&B run when
            ``report_to`` includes ``"wandb"``, else nowhere but :attr:`Monitor.latest` and the warnings.
        **settings: The settings of :class:`~curvwatch.CurvatureMonitor` (``every_n_train_steps``, ``evaluation``,
            ``sharpness``...), validated here.
    """

    def __init__(self, log: Any = None, **settings: Any) -> None:
        self.monitor = Monitor(None, log=log, **settings)
        self._log_given = log is not None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        monitor = self.monitor
        monitor.reset()  # each train() starts a fresh record (the callback's state is not in HF's checkpoints)
        if monitor.model is not model:
            monitor.attach(model)
        monitor.optimizer = optimizer
        monitor.accumulate_grad_batches = max(1, int(args.gradient_accumulation_steps))
        if not self._log_given and "wandb" in (args.report_to or []):
            import wandb

            monitor.loggers = [] if wandb.run is None else self._wandb_loggers(wandb.run)
        monitor.start()

    def on_step_begin(self, args, state, control, **kwargs):
        self.monitor.open(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.monitor.before_optimizer_step(optimizer)

    def on_step_end(self, args, state, control, **kwargs):
        self.monitor.close()

    def on_train_end(self, args, state, control, **kwargs):
        self.monitor.stop()

    @staticmethod
    def _wandb_loggers(run: Any) -> list[Any]:
        from curvwatch.sinks import as_loggers

        return as_loggers(run)
