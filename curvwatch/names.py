"""The vocabulary of keys: block-pair names, heads, and one row of the key table.

A block pair names two weights of a block by their units (``QQ``: ``W_Q`` with itself, ``W1W2``, ``QKV``); a head
suffix is ``h{i}`` (a query head) or ``g{j}`` (a key/value group). :class:`KeySpec` is one row of the key table
(:mod:`curvwatch.keys`), which the block kinds (:mod:`curvwatch.kinds`) declare for their kernels' keys.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["KeySpec", "is_diagonal_pair", "pair_of"]

_UNIT = re.compile(r"[A-Z][0-9]*")
_PAIR = re.compile(r"^(?:[A-Z][0-9]*){2,}$")
_HEAD = re.compile(r"^[hg](\d+)$")  # a query head h{i} or a key/value group g{j}

_REDUCTIONS = ("mean", "max", "min", "derived")
_PLACEHOLDERS = {
    "{XY}": r"(?:[A-Z][0-9]*){2,}", "{head}": r"[hg]\d+", "{i}": r"\d+", "{part}": r"\w+", "{module}": r"\w+",
}  # fmt: skip


@dataclass(frozen=True)
class KeySpec:
    """One row of the key table.

    Args:
        pattern: Key pattern, relative to the block (per-block keys) or to ``log_key_prefix`` (``summary/...``).
        meaning: What the number is, one line (the docs' "meaning" column).
        reduce: ``"mean"``, ``"max"``, ``"min"`` or ``"derived"`` (see the module docstring).
        logged: False for keys the kernels return that the monitor does not log itself (``residual/...``: one per
            Lanczos norm, logged as the block's ``lanczos/rel_residual_max``).
    """

    pattern: str
    meaning: str
    reduce: str = "mean"
    logged: bool = True

    def __post_init__(self) -> None:
        if self.reduce not in _REDUCTIONS:
            raise ValueError(f"Invalid reduce={self.reduce!r} for key {self.pattern!r}. Must be one of {_REDUCTIONS}.")

    @functools.cached_property
    def regex(self) -> re.Pattern[str]:
        """The compiled pattern (whole key)."""
        text = re.escape(self.pattern).replace(r"\[", "(?:").replace(r"\]", ")?")
        for placeholder, rx in _PLACEHOLDERS.items():
            text = text.replace(re.escape(placeholder), rx)
        return re.compile(f"^{text}$")


def pair_of(key: str) -> str | None:
    """The block pair a key is about (``"QQ"`` in ``"bound/outer/QQ/h1"``), or ``None``.

    Example:
        >>> pair_of("bound/outer/QQ/h1"), pair_of("hessian/W1W2"), pair_of("term/inv_L3")
        ('QQ', 'W1W2', None)
    """
    for part in key.split("/"):
        if _PAIR.match(part):
            return part
    return None


def is_diagonal_pair(pair: str) -> bool:
    """Whether ``pair`` is one parameter with itself: ``QQ``, ``W1W1`` (not ``VQ``, ``QKV``).

    Example:
        >>> [is_diagonal_pair(p) for p in ("QQ", "W1W1", "VQ", "QKV")]
        [True, True, False, False]
    """
    units = _UNIT.findall(pair)
    return len(units) == 2 and units[0] == units[1] and "".join(units) == pair
