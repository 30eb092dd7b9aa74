"""When to evaluate: the due steps of the two tiers and the overhead budget's clock, Trainer-free.

A step is *due* for a full evaluation on the multiples of ``every_n_train_steps`` (step 0 included) and for a
terms-only one on the multiples of ``terms_every_n_train_steps``. With ``max_overhead`` a due step is *affordable*
when the seconds spent evaluating so far plus one more evaluation (priced as the last one of its tier) stay within
``max_overhead`` times the training seconds so far (wall time since :meth:`Schedule.start` minus the evaluations,
carried across resumes); a due full evaluation the budget cannot afford falls back to terms only where those are
due too.

The budget governs the default schedule only (``max_overhead="auto"``, the default). A cadence the user chose
(``every_n_train_steps=...``) is honoured as it is unless ``max_overhead`` is given as a number;
:meth:`Schedule.cost_note` then says what it costs when it is expensive. ``max_overhead=None`` asks for a fixed
schedule explicitly: no budget and no note.

The terms-only tier feeds the warning rules. By default (``terms_every_n_train_steps="auto"``) it is due every
:data:`DEFAULT_TERMS_EVERY` steps and has a budget of its own: a due terms-only step is affordable when the
terms-only seconds so far plus one more stay within :data:`DEFAULT_TERMS_OVERHEAD` of the training seconds; the
full tier's budget then counts the full evaluations' seconds only, so the default costs at most the sum of the two
budgets. A terms cadence the user chose (an int) shares ``max_overhead`` with the full tier, as before.

The default schedule also keeps a floor under the full tier (:data:`DEFAULT_MAX_GAP`): where no full evaluation
would otherwise come within that many steps of the last one, a step of the terms grid (every
``terms_every_n_train_steps``; without a terms tier, the full grid) is due for a full evaluation, affordable while the
whole monitor, both tiers, stays within :data:`DEFAULT_TOTAL_OVERHEAD` of the training seconds. The run's first full
evaluation (step 0, made whatever it costs) is not counted there: it would hold the floor back for the whole first
stretch of a run (a full evaluation of 10 training steps at step 0 alone is 5% of the first 200). So a model whose
full evaluation costs 2-10 training steps, more than the 1% budget allows every 200 steps, still gets one every 500
steps within 5% (:func:`simulate`).

Example:
    >>> schedule = Schedule(every_n_train_steps=20)
    >>> schedule.due(0), schedule.due(5), schedule.due(10), schedule.due(20)  # (full, terms only)
    ((True, True), (False, False), (False, True), (True, True))
    >>> schedule.max_overhead is None, schedule.note_cost  # a chosen cadence: no budget, its cost reported
    (True, True)
    >>> Schedule().every_n_train_steps, Schedule().max_overhead  # the default: every 200 steps within 1%
    (200, 0.01)
    >>> Schedule().terms_every_n_train_steps, Schedule().terms_overhead  # terms only: every 10 steps within 4%
    (10, 0.04)
    >>> Schedule().max_gap, Schedule().total_overhead  # and a full evaluation every 500 steps within 5% in all
    (500, 0.05)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_MAX_GAP",
    "DEFAULT_OVERHEAD",
    "DEFAULT_TERMS_EVERY",
    "DEFAULT_TERMS_OVERHEAD",
    "DEFAULT_TOTAL_OVERHEAD",
    "EXPENSIVE",
    "Schedule",
    "simulate",
]

#: The default cadence and its budget.
DEFAULT_EVERY = 200
DEFAULT_OVERHEAD = 0.01
#: The default terms-only cadence and its own budget (``terms_every_n_train_steps="auto"``): the warning rules'
#: leads on the instability suite hold at every 10 steps (docs/instability.md). The budget binds only where a
#: terms-only evaluation costs more than 0.4 training steps (the suite's d = 64 models on a 2-core CPU, where it costs
#: about half a training step); on larger models every 10 steps costs less than it.
DEFAULT_TERMS_EVERY = 10
DEFAULT_TERMS_OVERHEAD = 0.04
#: The default schedule's floor under the full tier: a full evaluation at least every DEFAULT_MAX_GAP steps while the
#: whole monitor (both tiers, the run's first full evaluation aside) stays within DEFAULT_TOTAL_OVERHEAD of the
#: training time, the sum of the two budgets above: on a 2,000-step run of a model whose full evaluation costs 10
#: training steps and a terms-only one 0.25, the 1% budget alone allows one full evaluation per ~1,000 steps.
DEFAULT_MAX_GAP = 500
DEFAULT_TOTAL_OVERHEAD = 0.05
#: A chosen cadence whose evaluations take more than this fraction of the training time is reported once, after
#: at least MEASURED_STEPS steps (the first steps' times include start-up).
EXPENSIVE = 0.1
MEASURED_STEPS = 10


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Invalid {name}={value!r}. Must be an int >= {minimum}.")


class Schedule:
    """Due steps and the overhead clock.

    Args:
        every_n_train_steps: Full evaluations on steps ``0, n, 2n, ...``; ``None``: every
            :data:`DEFAULT_EVERY` steps within the :data:`DEFAULT_OVERHEAD` budget.
        terms_every_n_train_steps: Terms-only evaluations on steps ``0, n, 2n, ...`` not due for a full one;
            ``"auto"`` (default): every :data:`DEFAULT_TERMS_EVERY` steps within a budget of their own,
            :data:`DEFAULT_TERMS_OVERHEAD`; ``None``: none.
        max_overhead: Largest fraction of the training time the evaluations may take; ``"auto"`` (default): the
            default budget with the default cadence, none with a chosen one (whose cost is then reported when it
            is expensive); ``None``: a fixed schedule, no budget. The default (the default cadence and ``"auto"``)
            also keeps the full tier's floor: :attr:`max_gap`, :attr:`total_overhead` (module docstring).

    Raises:
        ValueError: If an argument is invalid.
    """

    def __init__(
        self,
        every_n_train_steps: int | None = None,
        terms_every_n_train_steps: int | str | None = "auto",
        max_overhead: float | str | None = "auto",
    ) -> None:
        if every_n_train_steps is not None:
            _check_int("every_n_train_steps", every_n_train_steps, 1)
        terms_auto = terms_every_n_train_steps == "auto"
        if terms_auto:
            terms_every_n_train_steps = DEFAULT_TERMS_EVERY
        elif terms_every_n_train_steps is not None:
            if isinstance(terms_every_n_train_steps, str):
                raise ValueError(
                    f"Invalid terms_every_n_train_steps={terms_every_n_train_steps!r}. Must be an int >= 1, 'auto' "
                    f"(the default: every {DEFAULT_TERMS_EVERY} steps within {DEFAULT_TERMS_OVERHEAD:.0%} of the "
                    "training time) or None (no terms-only evaluations)."
                )
            _check_int("terms_every_n_train_steps", terms_every_n_train_steps, 1)
        if (
            max_overhead is not None
            and max_overhead != "auto"
            and (isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float)) or not 0 < max_overhead)
        ):
            raise ValueError(
                f"Invalid max_overhead={max_overhead!r}. Must be a fraction > 0 (e.g. 0.01 for 1%), None for a fixed "
                "schedule, or 'auto' (the default: 1% with the default cadence, none with a chosen one)."
            )
        self.chosen = every_n_train_steps is not None  # the user chose the cadence
        self.every_n_train_steps = DEFAULT_EVERY if every_n_train_steps is None else every_n_train_steps
        self.terms_every_n_train_steps: int | None = terms_every_n_train_steps
        self.terms_overhead = DEFAULT_TERMS_OVERHEAD if terms_auto else None  # the terms tier's own budget
        auto = isinstance(max_overhead, str)
        if auto:
            self.max_overhead: float | None = None if self.chosen else DEFAULT_OVERHEAD
        else:
            self.max_overhead = None if max_overhead is None else float(max_overhead)
        self.note_cost = auto and self.chosen  # report once what a chosen cadence costs when it is expensive
        # the floor under the default schedule's full tier (None: no floor)
        default = auto and not self.chosen
        self.max_gap: int | None = DEFAULT_MAX_GAP if default else None
        self.total_overhead: float | None = DEFAULT_TOTAL_OVERHEAD if default else None
        self.last_step = -1  # the last step evaluated
        self.last_full_step = -1  # the last step of a full evaluation
        self.full_runs = 0  # full evaluations so far
        self.first_seconds = 0.0  # the run's first full evaluation's seconds (not counted by the floor)
        self.eval_seconds = 0.0  # seconds spent evaluating and logging, over the run and across resumes
        self.train_seconds = 0.0  # wall time minus eval_seconds, over the run and across resumes
        self.last_eval_seconds = 0.0  # cost of the last full evaluation, the next one's price
        self.last_terms_seconds = 0.0  # the same for the last terms-only evaluation
        self.terms_seconds = 0.0  # the part of eval_seconds spent on terms-only evaluations
        self.runs = 0  # evaluations and skips so far, of both tiers
        # (wall time at start, eval_seconds then, train_seconds then) of this fit; None outside training
        self._clock: tuple[float, float, float] | None = None

    # -- the clock ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the training clock (``on_train_start``)."""
        self._clock = (time.perf_counter(), self.eval_seconds, self.train_seconds)

    def stop(self) -> None:
        """Stop it (``on_train_end``): the state is stable afterwards."""
        self.update()
        self._clock = None

    def update(self) -> None:
        """Training seconds = wall time since :meth:`start` minus the evaluations in it (plus earlier runs)."""
        if self._clock is None:
            return
        start, eval_before, train_before = self._clock
        self.train_seconds = train_before + (time.perf_counter() - start) - (self.eval_seconds - eval_before)

    def charge(self, seconds: float, terms_only: bool, extra: bool = False) -> None:
        """Count ``seconds`` of monitor work on one evaluation (``extra``: more of the same evaluation)."""
        self.eval_seconds += seconds
        if terms_only:
            self.terms_seconds += seconds
            self.last_terms_seconds = seconds + (self.last_terms_seconds if extra else 0.0)
        else:
            self.last_eval_seconds = seconds + (self.last_eval_seconds if extra else 0.0)
            self.full_runs += 0 if extra else 1
            if self.full_runs == 1:
                self.first_seconds += seconds
        if not extra:
            self.runs += 1

    def evaluated(self, step: int, terms_only: bool) -> None:
        """Record that ``step`` was evaluated (``terms_only``: by the terms tier): no step is due twice, and the
        floor counts its gap from the last full evaluation."""
        self.last_step = step
        if not terms_only:
            self.last_full_step = step

    @property
    def overhead(self) -> float:
        """The monitor's seconds per training second so far: its evaluations and logging over the training wall time
        without them (0.01: 1% of the training time; above 1: the monitor took longer than the training)."""
        self.update()
        return self.eval_seconds / max(self.train_seconds, 1e-9)

    # -- decisions ------------------------------------------------------------------------------------

    def due(self, step: int) -> tuple[bool, bool]:
        """``(full due, terms-only due)`` at ``step``, before the budget; neither for a step already evaluated."""
        if step <= self.last_step:
            return False, False
        full = step % self.every_n_train_steps == 0 or self.gap_due(step)
        terms = self.terms_every_n_train_steps is not None and step % self.terms_every_n_train_steps == 0
        return full, terms

    def gap_due(self, step: int) -> bool:
        """Whether the floor makes ``step`` due for a full evaluation: a step of the terms grid (without a terms tier,
        the full grid) after which the next one would leave more than :attr:`max_gap` steps since the last full
        evaluation."""
        if self.max_gap is None or self.last_full_step < 0:
            return False
        grid = self.terms_every_n_train_steps or self.every_n_train_steps
        return step % grid == 0 and step - self.last_full_step + grid > self.max_gap

    def affordable(
        self, agree: Callable[[torch.Tensor], torch.Tensor] | None = None, step: int | None = None
    ) -> tuple[bool, bool]:
        """Whether one more (full, terms-only) evaluation keeps within ``max_overhead``.

        Args:
            agree: Reduces a float64 tensor by max across ranks (so every rank takes the same decision), or
                ``None`` on one process.
            step: The step about to be evaluated: a full evaluation the floor makes due there (:meth:`gap_due`) is
                also affordable within :attr:`total_overhead` of the whole monitor.
        """
        self.update()
        if (self.max_overhead is None and self.terms_overhead is None) or self.runs == 0:
            return True, True
        # evaluations so far plus the one about to run (priced as the last one of its kind) must fit the budget
        (full_spent, full_budget), (terms_spent, terms_budget) = self._tiers()
        total_spent = self.eval_seconds - self.first_seconds + self.last_eval_seconds  # (the floor's: both tiers)
        spent = torch.tensor(
            [full_spent + self.last_eval_seconds, terms_spent + self.last_terms_seconds, -self.train_seconds,
             total_spent],
            dtype=torch.float64,
        )  # fmt: skip
        if agree is not None:
            spent = agree(spent).cpu()  # the slowest rank's evaluations, the least training
        train = float(-spent[2])
        full = full_budget is None or float(spent[0]) <= full_budget * train
        if not full and step is not None and self.total_overhead is not None and self.gap_due(step):
            full = float(spent[3]) <= self.total_overhead * train
        terms = terms_budget is None or float(spent[1]) <= terms_budget * train
        return full, terms

    def decide(self, step: int, agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> str | None:
        """The evaluation to make at ``step``: ``"full"``, ``"terms"`` or ``None`` (not due, or over budget). A due full
        evaluation the budget cannot afford falls back to terms only where those are due too. A step due for neither
        asks no budget (so the ranks run no collective on it).

        Args:
            step: The optimizer step about to run.
            agree: As in :meth:`affordable`.
        """
        full_due, terms_due = self.due(step)
        if not (full_due or terms_due):
            return None
        full_ok, terms_ok = self.affordable(agree, step=step)
        if full_due and full_ok:
            return "full"
        return "terms" if terms_due and terms_ok else None

    def _tiers(self) -> tuple[tuple[float, float | None], tuple[float, float | None]]:
        """``((seconds, budget) of the full tier, (seconds, budget) of the terms tier)``: with the terms tier's own
        budget each tier counts its own seconds, else both share ``max_overhead`` and every second."""
        if self.terms_overhead is None:
            return (self.eval_seconds, self.max_overhead), (self.eval_seconds, self.max_overhead)
        return (self.eval_seconds - self.terms_seconds, self.max_overhead), (self.terms_seconds, self.terms_overhead)

    def budget_note(self, step: int, full_due: bool) -> str:
        """The one-time line when a due step is skipped by a budget (``full_due``: a full evaluation was due)."""
        full, terms = self._tiers()
        # a step the floor alone made due for a full evaluation is a terms-only step that its budget skipped too
        full_due = full_due and (step % self.every_n_train_steps == 0 or self.terms_every_n_train_steps is None)
        if full_due or self.terms_overhead is None:
            (spent, budget), name = full, "max_overhead"
            fix = "pass every_n_train_steps=... (or cadence=curvwatch.Cadence(max_overhead=None)) for a fixed schedule"
        else:
            (spent, budget), name = terms, "the terms-only budget"
            fix = "pass cadence=curvwatch.Cadence(terms_every_n_train_steps=...) for a fixed terms-only cadence"
        return (
            f"CurvatureMonitor: skipping due step {step} and later ones while the evaluations so far ({spent:.3g} s) "
            f"plus one more exceed {name}={budget:g} of the training time ({self.train_seconds:.3g} s); {fix}."
        )

    def cost_note(self, step: int) -> str | None:
        """A note on what a chosen cadence costs, when its evaluations take over :data:`EXPENSIVE` of training.

        Priced from the last full evaluation and the training seconds per step so far. ``None`` before one full
        interval and :data:`MEASURED_STEPS` steps were trained, when the cadence was not chosen with
        ``max_overhead="auto"``, or when it is cheap.
        """
        if not self.note_cost or step < max(self.every_n_train_steps, MEASURED_STEPS):
            return None
        self.update()
        per_step = self.train_seconds / max(step, 1)
        fraction = self.last_eval_seconds / max(per_step * self.every_n_train_steps, 1e-12)
        if fraction <= EXPENSIVE:
            return None
        return (
            f"CurvatureMonitor: every_n_train_steps={self.every_n_train_steps} is expensive here: one evaluation takes "
            f"{self.last_eval_seconds:.3g} s, about {self.last_eval_seconds / max(per_step, 1e-12):.1f} training steps "
            f"({per_step:.3g} s each), so the monitor adds about {100 * fraction:.0f}% to the training time. The "
            "cadence is honoured as chosen; pass cadence=curvwatch.Cadence(max_overhead=0.01) to cap the cost at 1% "
            "(due steps are then skipped while over budget), a larger every_n_train_steps, or "
            "Cadence(terms_every_n_train_steps=...) for the cheap tier."
        )

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        self.update()
        return {
            "eval_seconds": self.eval_seconds,
            "train_seconds": self.train_seconds,
            "last_eval_seconds": self.last_eval_seconds,
            "last_terms_seconds": self.last_terms_seconds,
            "terms_seconds": self.terms_seconds,
            "last_step": self.last_step,
            "runs": self.runs,
            "last_full_step": self.last_full_step,
            "full_runs": self.full_runs,
            "first_seconds": self.first_seconds,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state.get("last_step", -1))
        self.eval_seconds = float(state.get("eval_seconds", 0.0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.last_eval_seconds = float(state.get("last_eval_seconds", 0.0))
        self.last_terms_seconds = float(state.get("last_terms_seconds", 0.0))
        self.terms_seconds = float(state.get("terms_seconds", 0.0))
        self.runs = int(state.get("runs", 0))
        # (checkpoints before the floor: its gap counted from the last step evaluated, the first evaluation not known)
        self.last_full_step = int(state.get("last_full_step", self.last_step))
        self.full_runs = int(state.get("full_runs", 1 if self.runs else 0))
        self.first_seconds = float(state.get("first_seconds", 0.0))


def simulate(
    steps: int,
    step_seconds: float,
    full_seconds: float,
    terms_seconds: float,
    *,
    first_seconds: float | None = None,
    schedule: Schedule | None = None,
) -> dict[str, Any]:
    """What a schedule decides on a run of ``steps`` optimizer steps whose evaluations cost these seconds: the same
    decisions (:meth:`Schedule.decide`) and charges as a monitored run, on a clock that advances ``step_seconds`` per
    step (no training, no evaluation). Costs in training steps: ``step_seconds=1``.

    Args:
        steps: Optimizer steps of the run (``0 .. steps - 1``).
        step_seconds: One training step without the monitor.
        full_seconds, terms_seconds: One full / terms-only evaluation, logging included.
        first_seconds: The run's first full evaluation (step 0's is cold: its Lanczos has no warm start); default
            ``full_seconds``.
        schedule: Default: ``Schedule()``, the monitor's defaults.

    Returns:
        ``{"full": [steps], "terms": [steps], "max_full_gap": int, "max_gap": int, "overhead": float}``: the steps of
        each tier, the longest stretch without a full evaluation (to the run's end included) and without any, and
        the monitor's seconds over the training seconds.

    Example:
        >>> r = simulate(2000, 1.0, 10.0, 0.25)  # a full evaluation of 10 training steps, a terms-only one of 0.25
        >>> r["full"], r["max_gap"], round(r["overhead"], 4)
        ([0, 500, 1000, 1500], 10, 0.0445)
    """
    s = Schedule() if schedule is None else schedule
    evaluated: dict[str, list[int]] = {"full": [], "terms": []}
    for step in range(steps):
        tier = s.decide(step)
        if tier is not None:
            first = tier == "full" and not evaluated["full"] and first_seconds is not None
            s.charge(first_seconds if first else full_seconds if tier == "full" else terms_seconds, tier == "terms")
            s.evaluated(step, tier == "terms")
            evaluated[tier].append(step)
        s.train_seconds += step_seconds

    def longest(at: list[int]) -> int:
        ends = [0, *at, steps] if not at or at[0] != 0 else [*at, steps]
        return max(b - a for a, b in zip(ends[:-1], ends[1:], strict=True))

    return {
        **evaluated,
        "max_full_gap": longest(evaluated["full"]),
        "max_gap": longest(sorted(evaluated["full"] + evaluated["terms"])),
        "overhead": s.eval_seconds / max(s.train_seconds, 1e-12),
    }
