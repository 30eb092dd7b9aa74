"""Offline scoring of recorded runs: loss onset, signals, rule replays, lead times and false alarms.

Everything here reads the traces :func:`benchmarks.instability.train.run` returns and nothing else, so a rule
can be re-scored on stored results without training again.

* :func:`onset_step`: the objective start of an instability (loss rising and staying up, or non-finite).
* :data:`SIGNALS`: per-step series, the baselines (gradient norm, max attention logit, output logits) and the
  monitor's numbers reduced over blocks and heads (max of growth signals, min of saturation signals).
* :func:`detector_alarms`: one generic detector applied to every signal alike: the trailing median of
  ``log10(signal)`` over ``SMOOTH`` steps rises more than ``theta`` decades above its running minimum
  (``"level"``) or above its own value ``HORIZON`` steps earlier (``"trend"``), from step ``BURN_IN`` on (as the
  new rules' ``warmup_steps``). ``theta`` is fitted on the
  training seeds' controls (the smallest value that stays silent on all of them, plus a margin) and scored on
  every run, the held-out seeds reported apart.
* :func:`replay_ruleset` (:class:`curvwatch.rules.RuleSet`): alarm steps on a trace, optionally thinned to
  a cheaper terms-only cadence.
* :func:`score`: lead time before onset of the first alarm (negative: late; ``None``: none by the end of the
  trace), false alarms per 1000 steps.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ONSET_WINDOW = 10  # steps of the trailing mean of the loss
ONSET_MARGIN = 0.5  # nats above the running minimum of that mean
ONSET_PATIENCE = 20  # steps the mean must stay there

SMOOTH = 10  # steps of the trailing median of a signal's log
HORIZON = 50  # steps back for the trend detector
BURN_IN = 100  # steps before a detector may fire: early training moves every signal by decades
THETA_MARGIN = 0.05  # decades added to the largest excursion seen on the training controls


def onset_step(
    losses: Sequence[float | None],
    window: int = ONSET_WINDOW,
    margin: float = ONSET_MARGIN,
    patience: int = ONSET_PATIENCE,
) -> int | None:
    """First step of the instability, or ``None``.

    The onset is the first step ``t`` from which the trailing ``window``-step mean of the loss stays more than
    ``margin`` nats above its running minimum for ``patience`` consecutive steps, or the first step whose loss
    is not finite, whichever comes first.

    Example:
        >>> onset_step([3.0] * 30 + [4.0] * 40)
        35
        >>> onset_step([3.0] * 30) is None, onset_step([3.0, float("nan")])
        (True, 1)
    """
    bad = next((i for i, v in enumerate(losses) if v is None or not math.isfinite(v)), None)
    stop = len(losses) if bad is None else bad
    run = 0
    best = math.inf
    total = 0.0
    for t in range(stop):
        total += losses[t]
        if t >= window:
            total -= losses[t - window]
        if t < window - 1:
            continue
        mean = total / window
        best = min(best, mean)
        run = run + 1 if mean > best + margin else 0
        if run >= patience:
            start = t - patience + 1
            return start if bad is None else min(start, bad)
    return bad


# --------------------------------------------------------------------------------------------------
# Signals
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Signal:
    """One per-step series read from a trace.

    Args:
        name: Short name used in the results.
        direction: ``"up"`` when growth is the warning sign, ``"down"`` when decline is.
        tier: ``"baseline"`` (not from the monitor), ``"terms"`` (every terms-only evaluation) or ``"full"``
            (only on full evaluations, which need Lanczos).
        description: What it is, for the docs.
        read: ``trace -> {step: value}``.
    """

    name: str
    direction: str
    tier: str
    description: str
    read: Callable[[Mapping[str, Any]], dict[int, float]]


def _series(name: str) -> Callable[[Mapping[str, Any]], dict[int, float]]:
    def read(trace: Mapping[str, Any]) -> dict[int, float]:
        values = trace["series"][name]
        return {s: v for s, v in zip(trace["steps"], values, strict=True) if v is not None}

    return read


def _reduce(pattern: str, how: Callable[[Iterable[float]], float]) -> Callable[[Mapping[str, Any]], dict[int, float]]:
    regex = re.compile(pattern)

    def read(trace: Mapping[str, Any]) -> dict[int, float]:
        out = {}
        for row in trace["monitor"]:
            values = [v for k, v in row["metrics"].items() if v is not None and regex.search(k)]
            if values:
                out[row["step"]] = how(values)
        return out

    return read


def _logit_bound(trace: Mapping[str, Any]) -> dict[int, float]:
    """``max over heads of ||X||_2^2 ||W_Q^h||_2 ||W_K^h||_2 / sqrt(d_K)``: an upper bound on every attention logit."""
    model = trace["config"]["model"]
    d_K = model["d_model"] // model["n_head"]
    out = {}
    for row in trace["monitor"]:
        m = row["metrics"]
        best = None
        for key, x_norm in m.items():
            if not key.endswith("/attn/term/x_norm") or x_norm is None:
                continue
            block = key[: -len("/term/x_norm")]
            for h in range(model["n_head"]):
                wq, wk = m.get(f"{block}/term/wq_norm/h{h}"), m.get(f"{block}/term/wk_norm/h{h}")
                if wq is not None and wk is not None:
                    value = x_norm**2 * wq * wk / math.sqrt(d_K)
                    best = value if best is None else max(best, value)
        if best is not None:
            out[row["step"]] = best
    return out


SIGNALS: dict[str, Signal] = {
    s.name: s
    for s in [
        Signal("grad_norm", "up", "baseline", "gradient norm before clipping", _series("grad_norm")),
        Signal(
            "max_attn_logit",
            "up",
            "baseline",
            "max |q.k|/sqrt(d_K) over heads and allowed pairs",
            _series("max_attn_logit"),
        ),
        Signal("max_out_logit", "up", "baseline", "max |output logit|", _series("max_out_logit")),
        Signal(
            "x_norm6", "up", "terms", "max over attention blocks of ||X||_2^6", _reduce(r"/attn/term/x_norm6$", max)
        ),
        Signal("logit_bound", "up", "terms", "max over heads of ||X||^2 ||W_Q^h|| ||W_K^h|| / sqrt(d_K)", _logit_bound),
        Signal(
            "outer_VV", "up", "terms", "max over heads of ||H_o(VV)|| (exact)", _reduce(r"/attn/outer/VV/h\d+$", max)
        ),
        Signal(
            "hessian_W2W2", "up", "terms", "max over FFNs of ||H(W2W2)|| (exact)", _reduce(r"/ffn/hessian/W2W2$", max)
        ),
        Signal(
            "softmax_jac_min",
            "down",
            "terms",
            "min over heads of the measured softmax-Jacobian norm",
            _reduce(r"/attn/term/softmax_jac_norm/h\d+$", min),
        ),
        Signal(
            "entropy_min",
            "down",
            "terms",
            "min over heads of the attention entropy / log L",
            _reduce(r"/attn/term/attn_entropy_norm/h\d+$", min),
        ),
        Signal(
            "ln_var_ratio",
            "down",
            "terms",
            "min over LayerNorms of var_min / eps",
            _reduce(r"^summary/ln/var_min_over_eps$", min),
        ),
        Signal(
            "ln_jacobian",
            "up",
            "terms",
            "max over LayerNorms of the input-Jacobian norm",
            _reduce(r"/ln/jacobian_norm$", max),
        ),
        Signal(
            "max_hessian", "up", "full", "largest block Hessian norm (Lanczos)", _reduce(r"^summary/max_hessian$", max)
        ),
        Signal(
            "hessian_QQ", "up", "full", "max over heads of ||H(QQ)|| (Lanczos)", _reduce(r"/attn/hessian/QQ/h\d+$", max)
        ),
    ]
}


# --------------------------------------------------------------------------------------------------
# Generic detector
# --------------------------------------------------------------------------------------------------


def excursions(values: Mapping[int, float], direction: str, kind: str) -> dict[int, float]:
    """``{step: decades}``: how far the smoothed ``log10`` signal has moved in the bad direction.

    ``kind="level"``: above its running minimum since ``BURN_IN``; ``kind="trend"``: above its own smoothed
    value ``HORIZON`` steps earlier, that value itself at or after ``BURN_IN``. Earlier steps are left out.
    """
    sign = 1.0 if direction == "up" else -1.0
    steps = sorted(values)
    logs = [sign * math.log10(max(abs(values[s]), 1e-30)) for s in steps]
    smooth: dict[int, float] = {}
    lo = 0
    for i, s in enumerate(steps):
        while steps[lo] <= s - SMOOTH:
            lo += 1
        smooth[s] = statistics.median(logs[lo : i + 1])
    out: dict[int, float] = {}
    low = math.inf
    j = 0
    for s in steps:
        if s < BURN_IN:
            continue
        if kind == "level":
            low = min(low, smooth[s])
            out[s] = smooth[s] - low
        else:
            while j + 1 < len(steps) and steps[j + 1] <= s - HORIZON:
                j += 1
            if BURN_IN <= steps[j] <= s - HORIZON:
                out[s] = smooth[s] - smooth[steps[j]]
    return out


def detector_alarms(excursion: Mapping[int, float], theta: float) -> list[int]:
    """Steps where the excursion crosses ``theta`` upwards (one alarm per crossing)."""
    alarms, above = [], False
    for s in sorted(excursion):
        now = excursion[s] > theta
        if now and not above:
            alarms.append(s)
        above = now
    return alarms


# --------------------------------------------------------------------------------------------------
# Rule replays
# --------------------------------------------------------------------------------------------------


def thinned(trace: Mapping[str, Any], terms_every: int = 1, full_every: int | None = None) -> list[dict[str, Any]]:
    """The monitor rows a cheaper schedule would have produced: full rows every ``full_every`` steps (``None``:
    as recorded), terms-only rows every ``terms_every`` steps; a full row dropped by ``full_every`` becomes a
    terms-only row (its exact quantities are those a terms-only evaluation logs) when due for terms."""
    rows = []
    for row in trace["monitor"]:
        step, full = row["step"], row["full"]
        if full and full_every is not None and step % full_every != 0:
            full = False
        if not full and step % terms_every != 0:
            continue
        metrics = row["metrics"] if full or not row["full"] else _terms_part(row["metrics"])
        rows.append({"step": step, "full": full, "metrics": metrics})
    return rows


_FULL_ONLY = re.compile(r"/(hessian|outer|functional)/(QQ|KK|W1W1|max)|/ratio/|^summary/(?!ln/)")


def _terms_part(metrics: Mapping[str, float | None]) -> dict[str, float | None]:
    return {k: v for k, v in metrics.items() if not _FULL_ONLY.search(k)}


def replay_ruleset(rows: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[tuple[int, str, str]]:
    """``[(step, kind, block)]`` that :class:`curvwatch.rules.RuleSet` (defaults unless ``kwargs``) fires."""
    from curvwatch.rules import RuleSet

    rules = RuleSet(**kwargs)
    fired = []
    for row in rows:
        metrics = {k: v for k, v in row["metrics"].items() if v is not None}
        for alert in rules.update(row["step"], metrics, full=row["full"]):
            fired.append((alert.step, alert.kind, alert.block))
    return fired


# --------------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------------


def score(alarm_steps: Sequence[int], onset: int | None, n_steps: int) -> dict[str, Any]:
    """Lead time and alarm rate of one run.

    Returns:
        ``{"first_alarm", "lead", "alarms", "per_1000"}``: ``lead = onset - first_alarm`` (negative: the first
        alarm came after the onset; ``None`` without onset or without alarm); on a run with an onset the rate
        counts the alarms before it only.
    """
    steps = sorted(alarm_steps)
    first = steps[0] if steps else None
    horizon = n_steps if onset is None else onset
    before = [s for s in steps if s < horizon]
    return {
        "first_alarm": first,
        "lead": None if onset is None or first is None else onset - first,
        "alarms": len(before),
        "per_1000": 1000.0 * len(before) / max(horizon, 1),
    }


def fit_theta(excursion_lists: Iterable[Mapping[int, float]]) -> float:
    """The smallest threshold silent on every given (control) run, plus :data:`THETA_MARGIN`."""
    worst = max((max(e.values(), default=0.0) for e in excursion_lists), default=0.0)
    return max(worst, 0.0) + THETA_MARGIN


def median_or_none(values: Iterable[float | None]) -> float | None:
    """Median of the numbers that are not ``None``."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None
