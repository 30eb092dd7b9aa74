"""The monitor's options with a fixed set of values, as string enums, and the one place kwargs are checked.

Users pass plain strings (``on_error="raise"``, ``dtype="float64"``, ``pairs="all"``); :func:`choice` turns them into
the enum or raises a message naming the argument, the value and what is allowed.

Example:
    >>> choice("on_error", "raise", OnError)
    <OnError.RAISE: 'raise'>
    >>> choice("dtype", "float16", Precision)
    Traceback (most recent call last):
    ...
    ValueError: Invalid dtype='float16'. Must be one of ['float32', 'float64'].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum
from typing import Any, TypeVar

from curvwatch.names import pair_of

__all__ = [
    "LogLevel", "OnError", "PairSet", "Precision", "TermsKeys", "WarningRules",
    "check_int", "check_number", "choice", "pairs_option",
]  # fmt: skip

E = TypeVar("E", bound=Enum)


class OnError(str, Enum):
    """What :class:`~curvwatch.CurvatureMonitor` does when an evaluation raises."""

    WARN = "warn"
    RAISE = "raise"


class Precision(str, Enum):
    """The precision of the closed forms."""

    FLOAT32 = "float32"
    FLOAT64 = "float64"


class WarningRules(str, Enum):
    """Which warning rules :class:`~curvwatch.CurvatureMonitor` runs."""

    SUITE = "suite"  # curvwatch.rules.RuleSet, designed on the instability suite
    NONE = "none"


class TermsKeys(str, Enum):
    """What a terms-only evaluation of :class:`~curvwatch.CurvatureMonitor` computes."""

    WARNINGS = "warnings"  # what the warning rules read (the kinds' signal_kwargs): the cheap default
    ALL = "all"  # every bound term, bound and exact norm


class LogLevel(str, Enum):
    """How many keys reach the loggers (:func:`curvwatch.keys.level_of`); summaries, warnings and heatmaps always
    read the whole evaluation."""

    SUMMARY = "summary"  # headline summaries, per layer the maxima per sub-block, heatmaps: a readable dashboard
    BLOCKS = "blocks"  # + every per-block key that is neither per head nor a bound or a term
    ALL = "all"  # + per-head keys, bounds and terms: everything the closed forms return

    def includes(self, other: LogLevel) -> bool:
        """Whether a key of level ``other`` is logged at this level (``summary`` < ``blocks`` < ``all``)."""
        order = list(LogLevel)
        return order.index(other) <= order.index(self)


class PairSet(str, Enum):
    """Named sets of block pairs (or pass a list of pair names)."""

    DIAGONAL = "diagonal"
    ALL = "all"


def choice(name: str, value: Any, enum: type[E]) -> E:
    """``enum(value)``, or a ValueError naming ``name``, ``value`` and the allowed strings."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"Invalid {name}={value!r}. Must be one of {[e.value for e in enum]}.") from None


def check_int(name: str, value: Any, minimum: int, *, allow_none: bool = False, hint: str = "") -> None:
    """Raise unless ``value`` is an int ``>= minimum`` (or None with ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Invalid {name}={value!r}. Must be an int >= {minimum}{hint}.")


def check_number(
    name: str,
    value: Any,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = True,
    allow_none: bool = False,
    hint: str = "",
) -> None:
    """Raise unless ``value`` is a number in ``(low, high)`` (``[low, high)`` without ``low_open``)."""
    if value is None and allow_none:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    ok = ok and (value > low if low_open else value >= low) and value < high
    if not ok:
        raise ValueError(f"Invalid {name}={value!r}. Must be a number {hint}.")


def pairs_option(pairs: Any) -> str | tuple[str, ...]:
    """``"diagonal"``, ``"all"`` or a tuple of pair names; raises with the allowed forms otherwise."""
    if isinstance(pairs, str):
        try:
            return PairSet(pairs).value
        except ValueError:
            raise ValueError(
                f"Invalid pairs={pairs!r}. Must be 'diagonal', 'all' or a list of pair names like ['VV', 'QQ']."
            ) from None
    if not isinstance(pairs, Sequence) or not pairs or not all(isinstance(p, str) and pair_of(p) == p for p in pairs):
        raise ValueError(
            f"Invalid pairs={pairs!r}. Must be 'diagonal', 'all' or a non-empty list of pair names like "
            "['VV', 'QQ', 'VQ', 'W1W1']."
        )
    return tuple(pairs)
