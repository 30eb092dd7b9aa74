"""Logger sinks: where the monitor's numbers, images, tables, alerts and set-up table go (CSV, TensorBoard, W&B).

Every function takes Lightning loggers (``trainer.loggers``) and never raises for a logger's extras: a W&B run
that does not support alerts or metric definitions, or a missing matplotlib, loses the extra, not the numbers.
The scalars go to every logger through ``log_metrics``; the heatmap image to W&B (``log_image``) and TensorBoard
(``add_figure``); the per-block table of a full evaluation to W&B (``log_table``); alerts to W&B (``run.alert``,
written to offline runs too and sent when they sync); the table of monitored blocks to the W&B run config
(``curvwatch/blocks``) and as text to TensorBoard.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from curvwatch.adapters import BlockSpec
from curvwatch.alerts import CurvatureNotice

__all__ = [
    "as_loggers",
    "define_wandb_metrics",
    "heatmap_figure",
    "log_config",
    "log_entry",
    "log_heatmap",
    "log_metrics",
    "log_quietly",
    "log_table",
    "wandb_alert",
]


def _wandb(loggers: Sequence[Any]) -> list[Any]:
    try:
        from lightning.pytorch.loggers import WandbLogger
    except ImportError:  # pragma: no cover
        return []
    return [logger for logger in loggers if isinstance(logger, WandbLogger)]


def _tensorboard(loggers: Sequence[Any]) -> list[Any]:
    from lightning.fabric.loggers import TensorBoardLogger  # Lightning's TensorBoardLogger subclasses Fabric's

    return [logger for logger in loggers if isinstance(logger, TensorBoardLogger)]


class CallableLogger:
    """A logger over a callable ``fn(metrics: dict, step: int)`` (numbers only: no images, alerts or config)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.fn(dict(metrics), step)


def as_loggers(log: Any) -> list[Any]:
    """The loggers ``log`` names: ``None``, a W&B run, a Lightning/Fabric logger (``log_metrics``), a callable
    ``fn(metrics, step)``, or a list of these (``fabric.loggers``).

    Raises:
        ValueError: If ``log`` is none of these.
    """
    if log is None:
        return []
    if isinstance(log, (list, tuple)):
        return [logger for item in log for logger in as_loggers(item)]
    if hasattr(log, "log_metrics"):
        return [log]
    if type(log).__module__.startswith("wandb") and hasattr(log, "log"):  # a W&B run: its Lightning logger
        from lightning.pytorch.loggers import WandbLogger

        return [WandbLogger(experiment=log)]
    if callable(log):
        return [CallableLogger(log)]
    raise ValueError(
        f"Invalid log={log!r}. Must be a W&B run (wandb.init()), a Lightning/Fabric logger (log_metrics), a "
        "callable fn(metrics: dict, step: int), a list of these, or None."
    )


def log_metrics(loggers: Sequence[Any], metrics: Mapping[str, float], step: int) -> None:
    """``log_metrics(metrics, step=step)`` on every logger (errors propagate: the caller decides)."""
    for logger in loggers:
        logger.log_metrics(dict(metrics), step=step)


def log_quietly(loggers: Sequence[Any], metrics: Mapping[str, float], step: int) -> None:
    """``log_metrics`` on every logger, ignoring the loggers' errors (for a counter logged after a failure)."""
    for logger in loggers:
        try:
            logger.log_metrics(dict(metrics), step=step)
        except Exception:  # the logger itself may be what failed; the caller's warning still says so
            pass


def log_entry(loggers: Sequence[Any], entry: Any, specs: Sequence[BlockSpec], prefix: str, heatmaps: bool) -> None:
    """One evaluation (:class:`curvwatch.logbook.Entry`): the keys of its log level, its per-block table (W&B) and,
    with ``heatmaps``, its two heatmap images.

    The images are ``{prefix}summary/heatmap`` (``log10`` block norms, full evaluations) and
    ``{prefix}summary/stability_heatmap`` (edge-of-stability ratios, when the real-loss keys are on); the table
    ``{prefix}summary/layers``.
    """
    log_metrics(loggers, entry.logged, entry.step)
    if entry.table:
        log_table(loggers, f"{prefix}summary/layers", entry.table, entry.step)
    if heatmaps and entry.norms:
        log_heatmap(loggers, f"{prefix}summary/heatmap", specs, entry.norms, entry.step)
    if heatmaps and entry.ratios:
        label = ("log10 sharpness / threshold", "Edge-of-stability ratios")
        log_heatmap(loggers, f"{prefix}summary/stability_heatmap", specs, entry.ratios, entry.step, label)


def log_table(loggers: Sequence[Any], key: str, rows: Sequence[Mapping[str, Any]], step: int) -> None:
    """``rows`` (dicts with the same keys) as one ``wandb.Table`` per W&B logger (``WandbLogger.log_table``).

    Numbers are rounded to 4 significant digits, missing ones left empty.
    """
    targets = _wandb(loggers)
    if not targets or not rows:
        return
    columns = list(rows[0])
    data = [[_cell(row.get(c)) for c in columns] for row in rows]
    for logger in targets:
        try:
            logger.log_table(key=key, columns=columns, data=data, step=step)
        except Exception as err:
            warnings.warn(f"CurvatureMonitor could not log the table {key} to W&B: {err}", CurvatureNotice, 2)


def _cell(value: Any) -> Any:
    """A table cell: floats to 4 significant digits (non-finite ones as text), the rest as it is."""
    if isinstance(value, float):
        return float(f"{value:.4g}") if math.isfinite(value) else str(value)
    return value


def define_wandb_metrics(loggers: Sequence[Any], summaries: Mapping[str, str]) -> None:
    """``define_metric(key, summary=...)`` on each W&B run, so run tables show the max (min) of headline keys."""
    for logger in _wandb(loggers):
        experiment = logger.experiment
        if not hasattr(experiment, "define_metric"):
            continue
        for key, summary in summaries.items():
            try:
                experiment.define_metric(key, step_metric="trainer/global_step", summary=summary)
            except Exception:  # old wandb, disabled run: summaries are a convenience
                break


def wandb_alert(loggers: Sequence[Any], title: str, text: str) -> None:
    """Send ``text`` as a W&B alert (warning level) on each W&B run that supports alerts."""
    for logger in _wandb(loggers):
        try:
            import wandb

            logger.experiment.alert(title=title, text=text, level=wandb.AlertLevel.WARN)
        except Exception:  # disabled runs and old wandb versions may not support alerts
            pass


def log_config(loggers: Sequence[Any], table: Sequence[Mapping[str, str]], text: str) -> None:
    """Put the set-up table (one row per monitored or unmonitored part) in the W&B config and TensorBoard text."""
    for logger in _wandb(loggers):
        try:
            logger.experiment.config.update({"curvwatch/blocks": [dict(r) for r in table]}, allow_val_change=True)
        except Exception:  # a disabled run has no config
            pass
    for logger in _tensorboard(loggers):
        try:
            logger.experiment.add_text("curvwatch/blocks", "    " + text.replace("\n", "\n    "))
        except Exception:
            pass


def log_heatmap(
    loggers: Sequence[Any],
    key: str,
    specs: Sequence[BlockSpec],
    norms: Mapping[str, float],
    step: int,
    label: tuple[str, str] = ("log10 ||H||", "Block Hessian norms"),
) -> None:
    """A heatmap image of per-block values (``label``: colour bar, title) to W&B and TensorBoard loggers."""
    targets, boards = _wandb(loggers), _tensorboard(loggers)
    if not targets and not boards:
        return
    try:
        figure = heatmap_figure(specs, norms, step, label)
    except ImportError:  # matplotlib missing: no image
        return
    for logger in targets:
        try:
            logger.log_image(key=key, images=[figure], step=step)
        except Exception as err:
            warnings.warn(f"CurvatureMonitor could not log the heatmap to W&B: {err}", CurvatureNotice, 2)
    for logger in boards:
        try:
            logger.experiment.add_figure(key, figure, global_step=step, close=False)
        except Exception as err:
            warnings.warn(f"CurvatureMonitor could not log the heatmap to TensorBoard: {err}", CurvatureNotice, 2)


def heatmap_figure(
    specs: Sequence[BlockSpec],
    norms: Mapping[str, float],
    step: int,
    label: tuple[str, str] = ("log10 ||H||", "Block Hessian norms"),
) -> Any:
    """A matplotlib figure of ``log10`` per-block values, layers (rows) x sub-blocks (columns)."""
    from matplotlib.figure import Figure

    layers = sorted({s.layer for s in specs if s.name in norms})
    parts: list[str] = []
    for s in specs:
        part = s.name.split("/", 1)[-1]
        if s.name in norms and part not in parts:
            parts.append(part)
    grid = torch.full((len(layers), len(parts)), math.nan)
    for s in specs:
        value = norms.get(s.name)
        if value is not None and value > 0:
            grid[layers.index(s.layer), parts.index(s.name.split("/", 1)[-1])] = math.log10(value)
    figure = Figure(figsize=(1.5 + 1.2 * len(parts), 1.0 + 0.45 * len(layers)))
    ax = figure.add_subplot()
    image = ax.imshow(grid.numpy(), aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(parts)), parts)
    ax.set_yticks(range(len(layers)), [f"layer{i}" for i in layers])
    for i, row in enumerate(grid.tolist()):
        for j, value in enumerate(row):
            if math.isfinite(value):
                ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="w", fontsize=8)
    figure.colorbar(image, ax=ax, label=label[0])
    ax.set_title(f"{label[1]}, step {step}")
    figure.tight_layout()
    return figure
