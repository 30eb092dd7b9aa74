"""The Trainer-free monitor: schedule, capture, engine, logbook, rules, real-loss sampling and logging of one run.

:class:`Monitor` owns everything :class:`~curvwatch.CurvatureMonitor` (Lightning) and
:class:`~curvwatch.hf_trainer.CurvatureCallback` (Hugging Face) do; they are thin shells that call it from their
hooks, as Lightning's ``ThroughputMonitor`` is a shell over Fabric's ``Throughput``. A plain PyTorch or Fabric loop
drives it with two added lines::

    monitor = Monitor(model, optimizer=optimizer, log=wandb.run)  # or fabric.loggers, or a callable(dict, step)
    for step, batch in enumerate(loader):
        with monitor.step(step):  # hooks exist only on due steps; evaluates and logs on exit
            loss = model(batch)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()

With gradient accumulation pass ``accumulating=True`` on every micro-batch but the last of each optimizer step
(the last one is captured) and ``accumulate_grad_batches=k`` to the constructor when the loss back-propagated is
divided by ``k``; with a ``torch.amp.GradScaler`` pass it as ``grad_scaler``: the captured output gradients are
multiplied by ``k / scale``, the curvature of one micro-batch's loss. The real-loss keys (``sharpness``) sample from
the logits' gradient during the backward itself (or from :meth:`Monitor.before_backward`, which also enables
``verify_every_n_evals``).

Example:
    >>> from curvwatch.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, d_model=16, n_head=2))
    >>> logged = {}
    >>> monitor = Monitor(model, log=lambda metrics, step: logged.update(metrics), every_n_train_steps=1,
    ...                   sharpness=False, warning_rules=Warnings(warn=False))
    >>> idx = torch.randint(0, 11, (2, 8))
    >>> with monitor.step(0):
    ...     model(idx).logsumexp(-1).mean().backward()
    >>> "curv/summary/max_hessian" in logged, monitor.book.evaluations
    (True, 1)
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from curvwatch import report, sharding, sinks
from curvwatch.adapters import BlockSpec, find_blocks
from curvwatch.adapters.projections import UnsupportedWrapperError
from curvwatch.adapters.updates import AdapterSite, block_adapters
from curvwatch.alerts import Alert, CurvatureWarning, Notices
from curvwatch.capture import Capture, CaptureError
from curvwatch.closed_form.settings import Lanczos
from curvwatch.config import Cadence, Evaluation, Sharpness, Warnings, check_names, resolve
from curvwatch.engine import BlockError, Engine, signal_plan
from curvwatch.engine import Evaluation as Result
from curvwatch.kinds import KINDS
from curvwatch.logbook import Logbook, LogError, drop_no_data, flatten
from curvwatch.options import OnError, TermsKeys
from curvwatch.ranks import Ranks
from curvwatch.realloss import RealLoss
from curvwatch.schedule import Schedule

__all__ = ["Cadence", "Evaluation", "Monitor", "Sharpness", "Warnings"]


class Monitor:
    """Closed-form per-block Hessian monitoring of one training run, driven by any training loop.

    Args:
        model: The model (``None``: call :meth:`attach` later, as the Lightning shell does in ``setup``).
        optimizer: The optimizer, for the edge-of-stability ratios (``stability/...``), or a list of them (each
            block's ratio from the one holding its weights); ``None``: no ratios.
        log: Where the numbers go: a W&B run, a Lightning/Fabric logger (anything with ``log_metrics``), a
            callable ``fn(metrics: dict, step: int)``, a list of these, or ``None``.
        accumulate_grad_batches: The loss back-propagated is divided by this (gradient accumulation).
        grad_scaler: The ``torch.amp.GradScaler`` scaling the loss, if any.
        **settings: The monitor's settings (:func:`curvwatch.config.resolve`): ``every_n_train_steps``, ``blocks``,
            ``log_key_prefix``, ``sharpness``, ``warning_rules``, ``cadence``, ``evaluation``, ``on_error``,
            ``log_heatmap``, ``verbose``, ``log_level``; see :class:`~curvwatch.CurvatureMonitor` for each.

    Raises:
        ValueError: If a setting is invalid, or the model has no block curvwatch knows.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: Any = None,
        log: Any = None,
        *,
        accumulate_grad_batches: int = 1,
        grad_scaler: Any = None,
        **settings: Any,
    ) -> None:
        check_names(settings, type(self).__name__)
        s = self.settings = resolve(**settings)
        self.schedule = Schedule(s.cadence.every_n_train_steps, s.cadence.terms_every_n_train_steps,
                                 s.cadence.max_overhead)  # fmt: skip
        x, r = s.evaluation, s.sharpness
        #: The one-time notices given (checkpointed): every part of the monitor says its notices through it.
        self.notices = Notices(owner=type(self).__name__)
        self.notices.print = rank_zero_info
        self.real_loss = RealLoss(r.enabled, r.samples, r.loss, r.logits_module, notices=self.notices,
                                  memory_mb=x.memory_budget_mb)  # fmt: skip
        self.engine = Engine(
            lanczos=Lanczos(tol=x.tol, max_iter=x.max_iter, max_basis=x.max_basis),
            dtype=x.dtype,
            pairs=s.pairs,
            parts=s.parts,
            max_tokens=x.max_tokens,
            memory_budget_mb=x.memory_budget_mb,
            raise_errors=s.on_error is OnError.RAISE,
            key_prefix=s.log_key_prefix,
            notices=self.notices,
        )
        self.book = Logbook(s.log_key_prefix, float(x.tol), s.rules,
                            count_terms=self.schedule.terms_every_n_train_steps is not None,
                            log_level=s.log_level)  # fmt: skip
        self.log_level = self.book.log_level
        # a signals evaluation's exact pairs (None: every term and bound); the statistics of the norms always
        rules = s.rules
        self._signal_pairs = (rules.exact_pairs if rules else ()) if s.terms_keys is TermsKeys.WARNINGS else None
        if (
            isinstance(accumulate_grad_batches, bool)
            or not isinstance(accumulate_grad_batches, int)
            or (accumulate_grad_batches < 1)
        ):
            raise ValueError(
                f"Invalid accumulate_grad_batches={accumulate_grad_batches!r}. Must be an int >= 1: the number the "
                "back-propagated loss is divided by (1 without gradient accumulation)."
            )
        self.optimizer, self.loggers = optimizer, sinks.as_loggers(log)
        #: What to tell a user whose monitor has no logger (a shell says it in its own terms).
        self.no_loggers_hint = (
            "log=None; pass log=wandb.run (after wandb.init()), a Lightning or Fabric logger, or a callable "
            "fn(metrics, step)"
        )
        self.accumulate_grad_batches, self.grad_scaler = accumulate_grad_batches, grad_scaler
        #: the factor undoing the loss scaling of the captured step (a shell may replace it)
        self.grad_factor: Callable[[], float] = self._default_grad_factor
        self.world_size: int | None = None  # None: torch.distributed's
        self.is_global_zero: bool | None = None  # None: torch.distributed's rank 0
        #: the headline summaries and counters last logged (unprefixed keys)
        self.latest: dict[str, float] = {}

        self.model: nn.Module | None = None
        self._specs: list[BlockSpec] = []
        self._adapters: dict[str, dict[str, AdapterSite]] = {}  # block -> its low-rank adapters its kernel takes
        self._terms_specs: list[BlockSpec] = []  # the blocks a terms-only evaluation captures (setup)
        self._block_info: dict[str, tuple[str, int | None, float | None]] = {}  # name -> (kind, layer, eps)
        self._coverage: list[dict[str, str]] = []
        self._rows: dict[str, dict[str, str]] = {}  # block -> its row of the set-up table
        self._read_params: Callable[[BlockSpec], dict[str, Any]] | None = None
        self._started = False
        self._stack: ExitStack | None = None
        self._capture: Capture | None = None
        self._capture_step: int | None = None  # the step of the open capture (capturing)
        self._capture_terms_only = False  # the open capture is for a terms-only evaluation
        self._open_error: BaseException | None = None
        self._sample_seconds = 0.0  # the sampled backward passes of the open capture, charged with its evaluation
        if model is not None:
            self.attach(model)

    # -- settings, read back ---------------------------------------------------------------------------

    @property
    def log_key_prefix(self) -> str:
        return self.settings.log_key_prefix

    @property
    def tol(self) -> float:
        return float(self.settings.evaluation.tol)

    @property
    def max_iter(self) -> int:
        return self.settings.evaluation.max_iter

    @property
    def capturing(self) -> bool:
        """Whether a capture is open (a due step's hooks are in place until its optimizer step)."""
        return self._capture_step is not None

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters (CPU before :meth:`attach` or for a model without parameters)."""
        param = next(self.model.parameters(), None) if self.model is not None else None
        return torch.device("cpu") if param is None else param.device

    # -- set-up -----------------------------------------------------------------------------------------

    def attach(
        self,
        model: nn.Module,
        *,
        specs: Sequence[BlockSpec] | None = None,
        read_params: Callable[[BlockSpec], dict[str, Any]] | None = None,
    ) -> None:
        """Find the blocks of ``model`` and the logits module; say on rank zero what is and is not monitored.

        Args:
            model: The model.
            specs: The blocks (default: :func:`~curvwatch.find_blocks` with the ``blocks`` setting).
            read_params: Sharded training: reads one block's full weights (:mod:`curvwatch.sharding`).

        Raises:
            ValueError: If the model has no known block, or ``sharpness=True`` cannot work on it.
        """
        self.model, self._read_params = model, read_params
        found = list(find_blocks(model, self.settings.blocks) if specs is None else specs)
        # what each block's weights are made of (adapters) and the blocks whose wrappers are not understood; sharded
        # weights are read at evaluation only (a read is a collective there)
        notes = report.weight_notes(found) if read_params is None else {}
        self._coverage = report.coverage_rows(found, model, notes)
        self._specs = [s for s in found if not notes.get(s.name, "").startswith("not monitored")]
        self._adapters = _adapter_sites([s for s in self._specs if s.name in notes])
        self._rows = {s.name: _row_of(self._coverage, s) for s in self._specs}
        self._block_info = {s.name: (s.kind, s.layer, _eps(s.module)) for s in self._specs}
        # a signals evaluation (terms_keys="warnings") captures only the blocks with something to compute
        self._terms_specs = (
            self._specs
            if self._signal_pairs is None
            else [spec for spec in self._specs if signal_plan(spec.kind, self._signal_pairs) is not None]
        )
        status = self.real_loss.resolve(model, sharding.real_loss_support(read_params))
        self._coverage.append(report.sharpness_row(status))
        verbose = self.settings.verbose
        if any(r["status"] != "monitored" and r["layer"] != "-" for r in self._coverage) or verbose:
            rank_zero_info(f"{self.notices.owner} blocks:\n" + report.coverage_text(self._coverage))
        if verbose or not status.startswith("on") or self.real_loss.hooks_note:
            rank_zero_info(f"{self.notices.owner} real-loss sharpness: {status}")

    def start(self) -> None:
        """Start the overhead clock; define the headline metrics and put the block table in the loggers."""
        self._started = True
        self.schedule.start()
        if self._is_zero() and not self.loggers:
            self.notices.once(
                "no_loggers",
                f"CurvatureMonitor has nowhere to write its numbers: {self.no_loggers_hint}. They are computed and "
                "kept in .latest (the headline keys) and summary_text() only.",
            )
        if self._is_zero():
            sinks.define_wandb_metrics(self.loggers, self.book.metric_summaries(self._block_info))
            sinks.log_config(self.loggers, self._coverage, report.coverage_text(self._coverage))

    def stop(self) -> None:
        """Stop the overhead clock (training ended) and remove any hook left."""
        self.close()
        self.schedule.stop()
        self._started = False

    # -- a training step ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, step: int, *, accumulating: bool = False) -> Iterator[Monitor]:
        """Wrap the forward and backward of optimizer step ``step``: capture when due, evaluate and log on exit.

        Args:
            step: The optimizer step (``0, 1, 2, ...``; the same on every micro-batch of one step).
            accumulating: ``True`` on micro-batches whose backward is not followed by the optimizer step.
        """
        if self.model is None:
            raise RuntimeError("Monitor.step needs a model: pass it to Monitor(model, ...) or call attach(model).")
        if not self._started:
            self.start()
        if not accumulating:
            self.open(step)
        try:
            yield self
        except BaseException:
            self.close()
            raise
        if not accumulating:
            self.before_optimizer_step(self.optimizer)

    def open(self, step: int) -> bool:
        """Open the capture if ``step`` is due and affordable (returns whether it did); closes one left open."""
        if self._capture_step is not None:  # a capture left open by a step without optimizer step
            self.close()
        full_due, terms_due = self.schedule.due(step)
        if not (full_due or terms_due):
            return False
        # a due full evaluation the budget cannot afford falls back to terms only where those are due too
        tier = self.schedule.decide(step, self._ranks().max)
        if tier is None:
            if self.notices.mark("budget_info"):
                rank_zero_info(self.schedule.budget_note(step, full_due))
            return False
        terms_only = tier == "terms"
        self._capture_step, self._capture_terms_only, self._open_error = step, terms_only, None
        self._stack = ExitStack()
        logits = None if terms_only else self.real_loss.module
        try:
            specs = self._terms_specs if terms_only else self._specs
            capture = Capture(specs, self.engine.token_limit, read_params=self._read_params, logits_module=logits,
                              adapters=None if logits is None else self._adapters)  # fmt: skip
            if logits is not None:
                capture.on_logits_grad = self._sample_from_grad
            self._capture = self._stack.enter_context(capture)
        except Exception as err:  # reported in before_optimizer_step, after the ranks agree
            self._open_error = err
            self.close()
            self._capture_step = step
        return True

    def before_backward(self, loss: Tensor) -> None:
        """Sample the real-loss output gradients from ``loss``, the tensor about to be back-propagated (optional:
        without it they are sampled during the backward; needed for ``verify_every_n_evals``)."""
        capture = self._capture
        if capture is None or capture.logits_module is None or self._capture_terms_only or capture.sampled:
            return  # sampled: a later backward of the step (micro-batches): the first one's samples are kept
        every = self.settings.sharpness.verify_every_n_evals
        verify = every is not None and self.book.evaluations % every == 0
        if verify and self._read_params is not None:
            self.notices.once(
                "verify_sharded",
                "CurvatureMonitor: verify_every_n_evals is not supported under sharded training (its Hessian-vector "
                "products differentiate the loss by the parameters, which are sharded there): no verify/... keys. "
                "Check on one device or under DDP.",
            )
            verify = False
        self._sample(loss, None, verify)

    def _sample_from_grad(self, grad_logits: Tensor) -> None:
        """The capture's hook on the logits' gradient: sample during the backward itself."""
        if self._capture is not None and not self._capture_terms_only:
            if self.settings.sharpness.verify_every_n_evals is not None:
                self.notices.once(
                    "verify_needs_loss",
                    "CurvatureMonitor: verify_every_n_evals needs the loss before its backward; call "
                    "monitor.before_backward(loss) before loss.backward() (Lightning with manual optimization: "
                    "self.manual_backward(loss) instead of loss.backward()) to get the verify/... keys.",
                )
            self._sample(None, grad_logits, False)

    def _sample(self, loss: Tensor | None, grad_logits: Tensor | None, verify: bool) -> None:
        start = time.perf_counter()  # charged with the evaluation (summary/eval_time_s, the overhead budget)
        ranks = self._ranks()
        self.real_loss.sample(
            self._capture, loss, self.grad_factor(), self._capture_step, verify=verify, grad_logits=grad_logits,
            agree=self._agree if ranks.active else None,
        )  # fmt: skip
        self._sample_seconds += time.perf_counter() - start

    def _agree(self, ready: bool) -> bool:
        """Whether every rank is ``ready`` (one all-reduce): the sampled passes run on all ranks or none, so the
        ranks log the same keys and, under FSDP2, join the same all-gathers."""
        return not bool(self._ranks().max(torch.tensor([0.0 if ready else 1.0], dtype=torch.float64))[0] > 0)

    def before_optimizer_step(self, optimizer: Any = None) -> None:
        """Close the capture, then evaluate, agree across ranks and log (call after the backward of a due step)."""
        if self._capture_step is None:
            return
        step, capture, open_error, terms_only = (
            self._capture_step, self._capture, self._open_error, self._capture_terms_only
        )  # fmt: skip
        self.close()
        self.schedule.evaluated(step, terms_only)
        # more backward passes than the accumulation the factor undoes (a Hugging Face Trainer captures the first of
        # its gradient_accumulation_steps and scales it): micro-batches the monitor cannot scale for
        if capture is not None and capture.backwards > max(1, self.accumulate_grad_batches):
            self.notices.once(
                "backward_passes",
                f"CurvatureMonitor: step {step} ran {capture.backwards} backward passes before its optimizer step "
                "(micro-batches under manual optimization?). The monitor reads the first one: every key of the "
                "evaluation is that of its loss as back-propagated, not of their sum; with k micro-batches whose "
                "losses are divided by k, the values and the stability ratios read about 1/k of the step's "
                "curvature (automatic optimization's accumulate_grad_batches is scaled back, manual micro-batches "
                "cannot be).",
            )
        if capture is not None and capture.logits_module is not None and not terms_only and not capture.sampled:
            self.real_loss.not_sampled(capture, step)  # raises with sharpness=True
        self._evaluate_and_log(step, capture, open_error, terms_only, optimizer or self.optimizer)

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        stack, self._stack, self._capture, self._capture_step = self._stack, None, None, None
        self._capture_terms_only = False
        if stack is not None:
            stack.close()

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The schedule's clock, the engine's lowered limits and count of evaluations (the seed of its Lanczos start
        vectors), the logbook and the one-time notices given."""
        state = {**self.schedule.state_dict(), **self.engine.state_dict(), **self.book.state_dict()}
        return {**state, **self.notices.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.book.load_state_dict(state_dict)
        runs = self.book.evaluations + self.book.terms_evaluations + self.book.skipped  # checkpoints before "runs"
        self.schedule.load_state_dict({"runs": runs, **state_dict})
        self.engine.load_state_dict(state_dict)
        self.notices.load_state_dict(state_dict)
        # Lanczos warm starts are not checkpointed: a cold start costs a few more products and is as accurate (the
        # stopping test waits until the Ritz values stand still); it draws a start of its own (the count of evaluations)
        self.engine.warm.clear()

    def reset(self) -> None:
        """Start a fresh record: schedule and overhead clock, counters, rule states, lowered engine limits, one-time
        warnings, Lanczos warm starts (a shell calls it when a new run begins with a reused instance; a resumed run
        loads its checkpoint's state afterwards)."""
        self.close()
        self.load_state_dict({})

    # -- reading the run --------------------------------------------------------------------------------

    @property
    def alerts(self) -> list[Alert]:
        """The warnings fired so far (most recent last)."""
        return self.book.history

    @property
    def coverage(self) -> list[dict[str, str]]:
        """The set-up table, one row per monitored block and per part left out, with the reason."""
        return [dict(r) for r in self._coverage]

    def summary_text(self, top: int = 5) -> str:
        """A readable multi-line summary of the run so far: most curved blocks, heterogeneity, warnings.

        Args:
            top: How many of the most curved blocks to list.
        """
        book = self.book
        text = report.summary_text(
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
        return self.notices.named(text)

    # -- orchestration ----------------------------------------------------------------------------------

    def _default_grad_factor(self) -> float:
        """Undo the ``1/accumulate_grad_batches`` loss scaling and the AMP loss scale."""
        factor = float(self.accumulate_grad_batches)
        scaler = self.grad_scaler
        if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
            factor /= float(scaler.get_scale())
        return factor

    def _ranks(self) -> Ranks:
        world = self.world_size
        if world is None:
            dist = torch.distributed
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return Ranks(world, self.device)

    def _is_zero(self) -> bool:
        if self.is_global_zero is not None:
            return self.is_global_zero
        dist = torch.distributed
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def _evaluate_and_log(self, step, capture, open_error, terms_only=False, optimizer=None) -> None:
        """Evaluate, agree across ranks, then log; the monitor's seconds are charged to the overhead budget."""
        error: BaseException | None = open_error
        flat: dict[tuple[str, str], float] = {}
        evaluation = Result()
        ranks = self._ranks()
        start = time.perf_counter()
        blocks, factor = [], 1.0
        if error is None:
            try:
                if capture is None:
                    raise RuntimeError("no capture was open for this step")
                blocks, factor = capture.blocks(), self.grad_factor()
            except Exception as err:
                error = err
        ready = True  # sharded: the engine gathers each block's weights, a collective: it runs on all ranks or none
        if self._read_params is not None:
            ready = not ranks.max(torch.tensor([float(error is not None)], dtype=torch.float64))[0] > 0
        if error is None and ready:
            try:
                precondition = self.real_loss.preconditioners(optimizer, blocks)
                evaluation = self.engine.evaluate(blocks, factor, terms_only, precondition, self._signal_pairs)
                self.real_loss.finish(evaluation)
                flat = flatten(evaluation.results, keep_no_data=True)  # the same keys on every rank
            except Exception as err:
                error = err
        elapsed = time.perf_counter() - start + self._sample_seconds
        self._sample_seconds = 0.0
        self.schedule.charge(elapsed, terms_only)
        flat, failed_elsewhere = ranks.sync(flat, error is not None)
        if error is not None or failed_elsewhere:
            self._skip(step, error)
            return
        flat = drop_no_data(flat)
        rule_states = self.book.rule_states()
        logging_start = time.perf_counter()
        try:  # after the collectives: a failure here is local, the other ranks cannot hang on it
            self.real_loss.note_unresolved(flat)
            self._log(step, flat, evaluation, elapsed, terms_only)
        except Exception as err:
            self.book.load_rule_states(rule_states)
            self._skip(step, LogError(err))
        finally:  # logging (heatmap, W&B) is part of the monitor's cost too
            self.schedule.charge(time.perf_counter() - logging_start, terms_only, extra=True)

    def _log(self, step: int, flat, evaluation: Result, elapsed: float, terms_only: bool = False) -> None:
        """Log one evaluation's (reduced) numbers (:class:`~curvwatch.logbook.Logbook`), count it, then warn."""
        s = self.settings
        overhead = self.schedule.overhead
        entry = self.book.record(step, flat, evaluation, self._block_info, elapsed, overhead, terms_only)
        zero = self._is_zero()
        if zero:
            sinks.log_entry(self.loggers, entry, self._specs, s.log_key_prefix, s.log_heatmap)
        self.book.commit(entry)
        self.latest.update(self.book.headlines())
        if not zero:
            return
        warm = {b: r for b, r in entry.results.items() if b not in evaluation.cold}
        notices = report.evaluation_notices(
            step, evaluation.excluded, evaluation.failed, warm, self.tol, self.max_iter, s.log_key_prefix
        )
        self._note_left_out(step, evaluation)
        note = None if terms_only else self.schedule.cost_note(step)
        for key, message in notices + ([("cadence_cost", note)] if note is not None else []):
            self.notices.once(key, message)
        if s.warnings.warn:
            for alert in entry.fired:
                warnings.warn(alert.message, CurvatureWarning, stacklevel=2)
                sinks.wandb_alert(self.loggers, "curvwatch: " + alert.kind.replace("_", " "), alert.message)
        if s.verbose:
            line = report.progress_line(step, entry.summary, entry.norms, len(entry.fired), elapsed, terms_only)
            rank_zero_info(self.notices.named(line))

    def _note_left_out(self, step: int, evaluation: Result) -> None:
        """Say in the set-up table (:attr:`coverage`) which blocks an evaluation left out, the first time, and put
        the table in the loggers again."""
        reasons = {**evaluation.excluded, **{n: f"{type(e).__name__}: {e}" for n, e in evaluation.failed.items()}}
        changed = False
        for name, reason in reasons.items():
            row = self._rows.get(name)
            if row is not None and "left out" not in row["status"]:
                row["status"] = f"{row['status']}; left out at step {step}: {reason}"
                changed = True
        if changed and self._started:
            sinks.log_config(self.loggers, self._coverage, report.coverage_text(self._coverage))

    def _skip(self, step: int, error: BaseException | None) -> None:
        """Count a failed evaluation, then warn or raise (all ranks take the same branch)."""
        what = self.book.skip(step, error)
        if self.settings.on_error is OnError.RAISE:
            if isinstance(error, (BlockError, LogError, CaptureError)):
                raise error.error
            if error is not None:
                raise error
            raise RuntimeError(f"{self.notices.owner}: {what} at step {step} (on_error='raise').")
        key = f"{self.log_key_prefix}summary/skipped_evaluations"
        self.latest["summary/skipped_evaluations"] = float(self.book.skipped)
        if not self._is_zero():
            return
        sinks.log_quietly(self.loggers, {key: float(self.book.skipped)}, step)
        self.notices.say(
            f"CurvatureMonitor skipped the evaluation at step {step}: {what}. Training continues; "
            f"{key}={self.book.skipped}. Pass on_error='raise' to get the traceback, or blocks=[...] to leave "
            "the failing block out.",
            stacklevel=3,
        )


def _adapter_sites(specs: Sequence[BlockSpec]) -> dict[str, dict[str, AdapterSite]]:
    """``{block: {name: site}}``: the low-rank adapters of ``specs`` (blocks whose weights hold adapters) that their
    kernels take (:func:`~curvwatch.adapters.updates.block_adapters`), found once; what is left out gets its reason from
    the real loss's rules (:meth:`curvwatch.realloss.RealLoss.rules`)."""
    out = {}
    for spec in specs:
        weights = KINDS[spec.kind].adapted
        if not weights:
            continue
        try:
            sites, _ = block_adapters(spec, weights)
        except UnsupportedWrapperError:  # DoRA: not a weight plus low-rank updates
            continue
        if sites:
            out[spec.name] = sites
    return out


def _row_of(rows: list[dict[str, str]], spec: BlockSpec) -> dict[str, str]:
    """The set-up table's row of ``spec`` (the first with its layer, part and kind)."""
    part = report.part_name(spec)
    return next(r for r in rows if (r["layer"], r["part"], r["kind"]) == (str(spec.layer), part, spec.kind))


def _eps(module: Any) -> float | None:
    """The module's ``eps`` if it has a numeric one (norms), else ``None``."""
    eps = getattr(module, "eps", None)
    return eps if isinstance(eps, (int, float)) else None
