"""Offline scoring of recorded runs: loss onset, signals, rule replays, lead times and false alarms."""

from __future__ import annotations

import math
from collections.abc import Sequence

ONSET_WINDOW = 10  # steps of the trailing mean of the loss
ONSET_MARGIN = 0.5  # nats above the running minimum of that mean
ONSET_PATIENCE = 20  # steps the mean must stay there


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
