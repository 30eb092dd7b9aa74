"""A Lightning logger that keeps what it is given, for the benchmarks and the tests.

Its own module, not ``benchmarks.common``: importing Lightning costs seconds, and the memory benchmarks start a fresh
process per point that imports ``benchmarks.common``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only


class MemoryLogger(Logger):
    """A Lightning logger that keeps every ``log_metrics`` call in memory: ``calls = [(step, {key: value})]``.

    Example:
        >>> logger = MemoryLogger()
        >>> logger.log_metrics({"curv/a": 1.0}, step=3)
        >>> logger.log_metrics({"curv/b": 2.0, "loss": 0.5}, step=3)
        >>> logger.calls[0], logger.by_step(), sorted(logger.keys())
        ((3, {'curv/a': 1.0}), {3: {'curv/a': 1.0, 'curv/b': 2.0, 'loss': 0.5}}, ['curv/a', 'curv/b'])
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.calls.append((-1 if step is None else int(step), {k: float(v) for k, v in metrics.items()}))

    def by_step(self) -> dict[int, dict[str, float]]:
        """``{step: {key: value}}``, the calls of one step merged."""
        out: dict[int, dict[str, float]] = {}
        for step, metrics in self.calls:
            out.setdefault(step, {}).update(metrics)
        return out

    def keys(self, prefix: str = "curv") -> set[str]:
        """Every key logged that starts with ``prefix`` (the monitor's: ``curv/``, ``curv_hessian/``, ...)."""
        return {k for _, metrics in self.calls for k in metrics if k.startswith(prefix)}
