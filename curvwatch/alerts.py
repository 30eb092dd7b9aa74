"""What the monitor tells its user: the two warning categories, a fired alert, and one-time notices.

* :class:`CurvatureWarning`: "your run is going unstable", raised for the warning rules' alerts
  (:class:`~curvwatch.rules.RuleSet`), each an :class:`Alert`;
* :class:`CurvatureNotice`: "my numbers are limited here", the monitor's notices about itself, each said once
  (:class:`Notices`).

Example:
    >>> import warnings
    >>> notices = Notices()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     notices.once("budget", "CurvatureMonitor skips step 3.")
    ...     notices.once("budget", "CurvatureMonitor skips step 4.")
    >>> [str(w.message) for w in caught], "budget" in notices
    (['CurvatureMonitor skips step 3.'], True)
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Alert", "CurvatureNotice", "CurvatureWarning", "Notices"]


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
        kind: The rule that fired: ``"attn_saturation"``, ``"growth"``, ``"ln_collapse"`` or ``"ln_variance_drop"``
            (:class:`~curvwatch.rules.RuleSet`).
        block: Block name, e.g. ``"layer1/ln_2"``.
        step: Optimizer step of the evaluation.
        value: The watched number (e.g. ``var_min / eps``, a softmax-Jacobian norm, a rise in decades).
        threshold: The number it crossed.
        message: Human-readable text naming the block, the value, the threshold and what to do.
    """

    kind: str
    block: str
    step: int
    value: float
    threshold: float
    message: str


class Notices:
    """The monitor's notices (:class:`CurvatureNotice`), most of them said once per run: each key is said once, on the
    rank where it comes up; the keys said are kept in checkpoints (:meth:`state_dict`), so a resumed run does not
    repeat them.

    Args:
        owner: The name of the class the user built (``"Monitor"``, ``"CurvatureMonitor"``, ``"CurvatureCallback"``):
            the messages, written about ``CurvatureMonitor``, name it instead.
    """

    def __init__(self, owner: str = "CurvatureMonitor") -> None:
        self.said: set[str] = set()
        self.owner = owner
        #: Where :meth:`info` lines go (a monitor prints them on rank zero).
        self.print: Callable[[str], None] = logging.getLogger("curvwatch").info

    def __contains__(self, key: str) -> bool:
        return key in self.said

    def named(self, message: str) -> str:
        """``message`` naming :attr:`owner` where it names ``CurvatureMonitor``."""
        return message if self.owner == "CurvatureMonitor" else message.replace("CurvatureMonitor", self.owner)

    def once(self, key: str, message: str, stacklevel: int = 3) -> None:
        """Warn ``message`` as a :class:`CurvatureNotice` the first time ``key`` comes up."""
        if key not in self.said:
            self.said.add(key)
            warnings.warn(self.named(message), CurvatureNotice, stacklevel=stacklevel)

    def info(self, key: str, message: str) -> None:
        """Print ``message`` (:attr:`print`) the first time ``key`` comes up: what a user should know about the numbers
        of a healthy run, which is not worth a warning."""
        if key not in self.said:
            self.said.add(key)
            self.print(self.named(message))

    def say(self, message: str, stacklevel: int = 3) -> None:
        """Warn ``message`` as a :class:`CurvatureNotice`, every time."""
        warnings.warn(self.named(message), CurvatureNotice, stacklevel=stacklevel)

    def mark(self, key: str) -> bool:
        """Record ``key`` as said without warning; returns whether it was new (for notices given another way)."""
        new = key not in self.said
        self.said.add(key)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"warned": sorted(self.said)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.said = set(state.get("warned", []))
