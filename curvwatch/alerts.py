"""Curvature warnings: a pure state machine that turns per-evaluation numbers into alerts.

:class:`AlertMonitor` watches two failure modes, one evaluation at a time:

* **LayerNorm variance collapse.** A LayerNorm divides by ``sqrt(var + eps)``; when the smallest row variance
  of its input falls towards ``eps`` its Jacobian and Hessian grow like ``1/sqrt(eps)`` and ``1/eps`` and
  training usually diverges soon after. Condition: ``var_min / eps < collapse_ratio`` or, if
  ``inv_var_threshold`` is set, ``inv_var_max = 1/min(var + eps) > inv_var_threshold``.
* **Curvature spike.** A block's Hessian norm jumps above ``spike_factor`` times its running baseline, an
  exponential moving average of ``log(norm)`` over past evaluations, used after ``spike_warmup``
  evaluations of that block. The baseline absorbs each new value clipped to the threshold, so a lasting
  level shift stops alerting after a few evaluations while a single spike does not poison it.

A condition must hold for ``patience`` consecutive evaluations before it fires; after firing, the same
(kind, block) stays silent for ``cooldown`` evaluations. The state is plain numbers
(:meth:`~AlertMonitor.state_dict`), so it survives a checkpoint.

Example:
    >>> monitor = AlertMonitor(spike_factor=10.0, spike_warmup=2)
    >>> for step, norm in enumerate([1.0, 1.1, 0.9, 50.0]):
    ...     alerts = monitor.update(step, norms={"layer0/attn": norm})
    >>> [(a.kind, a.block, a.value) for a in alerts]
    [('spike', 'layer0/attn', 50.0)]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Alert", "AlertMonitor", "CurvatureNotice", "CurvatureWarning", "LegacyThresholds"]


class CurvatureWarning(UserWarning):
    """Warning category of the instability alerts alone: "your run is going unstable".

    Filter it like any warning, e.g. ``warnings.simplefilter("error", CurvatureWarning)`` to stop a run on
    the first alert; the monitor's notices about itself are :class:`CurvatureNotice`, a sibling class, so such
    a filter never trips on them. W&B alerts are sent for these warnings only.
    """


class CurvatureNotice(UserWarning):
    """Warning category of the monitor's notices about itself: "my numbers are limited here".

    Unconverged Lanczos norms, cost and budget notes, blocks left out or not finite, out-of-memory retries,
    skipped evaluations, set-up notes of the real-loss keys, loggers that refused an image. A sibling of
    :class:`CurvatureWarning`, not a subclass: ``warnings.simplefilter("error", CurvatureWarning)`` does not
    turn a notice into an error. Silence them with ``warnings.filterwarnings("ignore", category=CurvatureNotice)``.

    Example:
        >>> issubclass(CurvatureNotice, CurvatureWarning), issubclass(CurvatureNotice, UserWarning)
        (False, True)
    """


@dataclass(frozen=True)
class Alert:
    """One fired alert.

    Args:
        kind: ``"ln_collapse"`` or ``"spike"``.
        block: Block name, e.g. ``"layer1/ln_2"``.
        step: Optimizer step of the evaluation.
        value: The watched number (``var_min / eps``, ``inv_var_max`` or the block norm).
        threshold: The number it crossed.
        message: Human-readable text naming the block, the value, the threshold and what to do.
    """

    kind: str
    block: str
    step: int
    value: float
    threshold: float
    message: str


_FIX_COLLAPSE = (
    "Lower the learning rate, add or lengthen learning-rate warmup, raise the LayerNorm eps (e.g. 1e-5 -> "
    "1e-3), or move to pre-LN; gradient clipping (Trainer(gradient_clip_val=1.0)) limits the damage."
)
_FIX_SPIKE = (
    "Lower the learning rate or add warmup, enable gradient clipping (Trainer(gradient_clip_val=1.0)), and "
    "check the data of this step; pre-LN and a smaller init of the residual projections also help."
)


def _positive(name: str, value: float, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"Invalid {name}={value!r}. Must be a number > 0.")


def _count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Invalid {name}={value!r}. Must be an int >= {minimum}.")


@dataclass(frozen=True)
class LegacyThresholds:
    """The legacy rules' thresholds, declared once (:class:`AlertMonitor`'s defaults, ``curvwatch.Warnings``).

    Args:
        collapse_ratio: Fire when ``var_min / eps`` of a LayerNorm input drops below it. ``0`` disables it.
        inv_var_threshold: Optionally also fire when ``inv_var_max = 1/min(var + eps)`` exceeds it.
        spike_factor: Fire when a block norm exceeds ``spike_factor`` times its baseline (``> 1``).
        spike_warmup: Evaluations of a block used only to build its baseline (``>= 1``).
        patience: Consecutive evaluations a condition must hold before it fires (``>= 1``).
        cooldown: Evaluations during which a fired (kind, block) stays silent (``>= 0``).
    """

    collapse_ratio: float = 5.0
    inv_var_threshold: float | None = None
    spike_factor: float = 10.0
    spike_warmup: int = 3
    patience: int = 1
    cooldown: int = 10

    def check(self) -> None:
        """Raise a ValueError naming the first invalid threshold."""
        AlertMonitor(**asdict(self))


_LEGACY = LegacyThresholds()


class AlertMonitor:
    """Decides, evaluation by evaluation, when LayerNorm collapse or a curvature spike is worth a warning.

    Args:
        collapse_ratio: Fire when ``var_min / eps`` of a LayerNorm input drops below it. ``0`` disables it.
        inv_var_threshold: Optionally also fire when ``inv_var_max = 1/min(var + eps)`` exceeds it.
        spike_factor: Fire when a block norm exceeds ``spike_factor`` times its baseline (``> 1``).
        spike_warmup: Evaluations of a block used only to build its baseline (``>= 1``).
        spike_decay: Weight of the old baseline in the moving average of ``log(norm)``, in ``[0, 1)``.
        patience: Consecutive evaluations a condition must hold before it fires (``>= 1``).
        cooldown: Evaluations during which a fired (kind, block) stays silent (``>= 0``).
        max_history: How many fired alerts :attr:`history` keeps.

    Raises:
        ValueError: For a value outside the ranges above, naming it.
    """

    def __init__(
        self,
        *,
        collapse_ratio: float = _LEGACY.collapse_ratio,
        inv_var_threshold: float | None = _LEGACY.inv_var_threshold,
        spike_factor: float = _LEGACY.spike_factor,
        spike_warmup: int = _LEGACY.spike_warmup,
        spike_decay: float = 0.8,
        patience: int = _LEGACY.patience,
        cooldown: int = _LEGACY.cooldown,
        max_history: int = 100,
    ) -> None:
        if (
            isinstance(collapse_ratio, bool)
            or not isinstance(collapse_ratio, (int, float))
            or collapse_ratio < 0
        ):
            raise ValueError(
                f"Invalid collapse_ratio={collapse_ratio!r}. Must be a number >= 0 (0 disables)."
            )
        _positive("inv_var_threshold", inv_var_threshold, allow_none=True)
        _positive("spike_factor", spike_factor)
        if spike_factor <= 1:
            raise ValueError(
                f"Invalid spike_factor={spike_factor!r}. Must be > 1 (a factor above the baseline)."
            )
        _count("spike_warmup", spike_warmup, 1)
        if (
            isinstance(spike_decay, bool)
            or not isinstance(spike_decay, (int, float))
            or not 0 <= spike_decay < 1
        ):
            raise ValueError(f"Invalid spike_decay={spike_decay!r}. Must be in [0, 1).")
        _count("patience", patience, 1)
        _count("cooldown", cooldown, 0)
        _count("max_history", max_history, 0)
        self.collapse_ratio = float(collapse_ratio)
        self.inv_var_threshold = None if inv_var_threshold is None else float(inv_var_threshold)
        self.spike_factor = float(spike_factor)
        self.spike_warmup = spike_warmup
        self.spike_decay = float(spike_decay)
        self.patience = patience
        self.cooldown = cooldown
        self.max_history = max_history
        # per block: [log baseline, evaluations seen]
        self._baselines: dict[str, list[float]] = {}
        # per "kind:block": [consecutive evaluations in condition, evaluations left in cooldown]
        self._streaks: dict[str, list[int]] = {}
        self.history: list[Alert] = []
        self.fired = 0

    # -- conditions -------------------------------------------------------------------------------

    def _collapse(self, block: str, stats: Mapping[str, float], step: int) -> Alert | None:
        """The collapse alert ``stats`` would raise, ignoring patience and cooldown."""
        ratio = stats.get("var_min_over_eps")
        if ratio is None and "var_min" in stats and stats.get("eps"):
            ratio = stats["var_min"] / stats["eps"]
        var_min = stats.get("var_min")
        if var_min == 0 and (ratio is None or math.isinf(ratio)):
            ratio = 0.0  # a constant row with eps = 0: 0/0, the LayerNorm output itself is NaN
        eps = stats.get("eps")
        eps_text = f" (eps={eps:.3g})" if eps is not None else ""
        if (
            self.collapse_ratio > 0
            and ratio is not None
            and math.isfinite(ratio)
            and ratio < self.collapse_ratio
        ):
            msg = (
                f"LayerNorm variance collapse in block '{block}' at step {step}: the smallest input row "
                f"variance is {ratio:.3g} x eps{eps_text}, below the threshold "
                f"collapse_ratio={self.collapse_ratio:g} x eps "
                f"for {self.patience} evaluation(s). Its curvature grows like 1/eps. {_FIX_COLLAPSE}"
            )
            return Alert("ln_collapse", block, step, float(ratio), self.collapse_ratio, msg)
        inv_var = stats.get("inv_var_max")
        if self.inv_var_threshold is not None and inv_var is not None and inv_var > self.inv_var_threshold:
            msg = (
                f"LayerNorm variance collapse in block '{block}' at step {step}: inv_var_max = "
                f"1/min(var + eps) is {inv_var:.3g}{eps_text}, above the threshold "
                f"inv_var_threshold={self.inv_var_threshold:g} "
                f"for {self.patience} evaluation(s). {_FIX_COLLAPSE}"
            )
            return Alert("ln_collapse", block, step, float(inv_var), self.inv_var_threshold, msg)
        return None

    def _spike(self, block: str, norm: float, step: int) -> Alert | None:
        """Update the baseline of ``block`` with ``norm``; the spike alert it raises, if any.

        The reference is the larger of the running baseline and the last value that was not a spike: a
        spike is a jump, so the steady growth of early training (curvature rising a few-fold per
        evaluation, "progressive sharpening") does not fire, while a persistent spike keeps comparing
        against the level it jumped from (so ``patience > 1`` works).
        """
        if not (math.isfinite(norm) and norm > 0):
            return None
        log_norm = math.log(norm)
        state = self._baselines.get(block)
        if state is None:
            self._baselines[block] = [log_norm, 1.0, log_norm]
            return None
        log_base, seen = state[0], state[1]
        log_last_ok = state[2] if len(state) > 2 else log_base  # checkpoints written before this field
        log_ref = max(log_base, log_last_ok)
        log_threshold = log_ref + math.log(self.spike_factor)
        alert = None
        spiking = seen >= self.spike_warmup and log_norm > log_threshold
        if spiking:
            ref, threshold = math.exp(log_ref), math.exp(log_threshold)
            msg = (
                f"Curvature spike in block '{block}' at step {step}: Hessian norm {norm:.3g} is "
                f"{norm / ref:.3g} x its reference level {ref:.3g} (running baseline / last normal value), "
                f"above the threshold spike_factor={self.spike_factor:g} x reference = {threshold:.3g} for "
                f"{self.patience} evaluation(s). {_FIX_SPIKE}"
            )
            alert = Alert("spike", block, step, float(norm), threshold, msg)
        clipped = min(log_norm, log_threshold) if seen >= self.spike_warmup else log_norm
        if seen < self.spike_warmup:  # plain running mean while warming up
            new_base = (log_base * seen + clipped) / (seen + 1)
        else:
            new_base = self.spike_decay * log_base + (1 - self.spike_decay) * clipped
        self._baselines[block] = [new_base, seen + 1, log_last_ok if spiking else log_norm]
        return alert

    def _gate(self, key: str, candidate: Alert | None) -> Alert | None:
        """Apply patience and cooldown to one (kind, block)."""
        streak, cooling = self._streaks.get(key, [0, 0])
        streak = streak + 1 if candidate is not None else 0
        fire = candidate is not None and streak >= self.patience and cooling == 0
        cooling = self.cooldown if fire else max(cooling - 1, 0)
        self._streaks[key] = [streak, cooling]
        return candidate if fire else None

    # -- public API -------------------------------------------------------------------------------

    def update(
        self,
        step: int,
        *,
        norms: Mapping[str, float] | None = None,
        layernorms: Mapping[str, Mapping[str, float]] | None = None,
    ) -> list[Alert]:
        """Feed one evaluation; return the alerts that fire now.

        Args:
            step: Optimizer step of the evaluation (used in messages and :attr:`history`).
            norms: ``{block: Hessian norm}`` watched for spikes.
            layernorms: ``{block: stats}`` of LayerNorm blocks, with ``var_min_over_eps`` (or ``var_min`` and
                ``eps``) and optionally ``inv_var_max`` and ``eps``.

        Returns:
            The fired alerts, in the order of the blocks.
        """
        fired: list[Alert] = []
        for block, stats in (layernorms or {}).items():
            alert = self._gate(f"ln_collapse:{block}", self._collapse(block, stats, step))
            if alert is not None:
                fired.append(alert)
        for block, norm in (norms or {}).items():
            alert = self._gate(f"spike:{block}", self._spike(block, float(norm), step))
            if alert is not None:
                fired.append(alert)
        self.fired += len(fired)
        if self.max_history:
            self.history = (self.history + fired)[-self.max_history :]
        return fired

    def baseline(self, block: str) -> float | None:
        """Current spike baseline (a Hessian norm) of ``block``, or ``None`` before its first evaluation."""
        state = self._baselines.get(block)
        return None if state is None else math.exp(state[0])

    def state_dict(self) -> dict[str, Any]:
        """Baselines, streaks, cooldowns and fired alerts as plain Python numbers and strings."""
        return {
            "baselines": {k: list(v) for k, v in self._baselines.items()},
            "streaks": {k: list(v) for k, v in self._streaks.items()},
            "history": [asdict(a) for a in self.history],
            "fired": self.fired,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._baselines = {k: [float(x) for x in v] for k, v in state.get("baselines", {}).items()}
        self._streaks = {k: [int(v[0]), int(v[1])] for k, v in state.get("streaks", {}).items()}
        self.history = [Alert(**a) for a in state.get("history", [])]
        self.fired = int(state.get("fired", len(self.history)))
