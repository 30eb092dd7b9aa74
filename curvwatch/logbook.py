"""The monitor's record of a run, without Lightning: what an evaluation's numbers become, and what a checkpoint keeps.

:class:`Logbook` turns one evaluation's reduced numbers (``{(block, key): float}``, the same on every rank) into an
:class:`Entry`: the prefixed keys, the per-block summaries (:func:`curvwatch.metrics.derive`), the warnings the rule
sets fired, the norms and ratios of the heatmaps, the per-block table. ``log_level`` decides which keys reach the
loggers (:attr:`Entry.logged`); everything else reads all of them (:attr:`Entry.values`). Nothing is counted until
:meth:`Logbook.commit`, so a logger that fails half-way leaves the counters as they were, and
:meth:`Logbook.load_rule_states` rewinds the rule sets. The logbook also keeps the counters, last values, peak and
errors that :meth:`Logbook.state_dict` saves and :func:`curvwatch.report.summary_text` prints. The Lightning
callback only hands entries to the sinks.

Example:
    >>> from curvwatch.engine import Evaluation
    >>> book = Logbook(key_prefix="curv/", tol=1e-2)
    >>> flat = {("layer0/ln_1", "ln/var_min"): 0.5, ("layer0/ln_1", "ln/inv_var_max"): 2.0}
    >>> entry = book.record(0, flat, Evaluation(), {"layer0/ln_1": ("layernorm", 0, 1e-5)}, 0.1, 0.0, False)
    >>> entry.values["curv/layer0/ln_1/ln/var_min"], book.evaluations
    (0.5, 0)
    >>> "curv/layer0/ln_1/ln/var_min" in entry.logged  # log_level="summary": not to the loggers
    False
    >>> book.commit(entry); book.evaluations
    1
    >>> book.skip(5, RuntimeError("boom")), book.skipped
    ('RuntimeError: boom', 1)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from curvwatch import keys as K
from curvwatch import metrics as M
from curvwatch.alerts import Alert
from curvwatch.engine import NONFINITE, BlockError, Evaluation
from curvwatch.kinds import KINDS
from curvwatch.options import LogLevel, choice
from curvwatch.rules import RuleSet, block_quantities

__all__ = ["HEADLINES", "TABLE_COLUMNS", "Entry", "LogError", "Logbook", "flatten"]

# Headline summaries: put in ``trainer.callback_metrics`` and given a W&B run summary (how it is reduced over steps).
HEADLINES = {
    "summary/max_hessian": "max",
    "summary/heterogeneity/model": "max",
    "summary/vv_qq_ratio/median": "max",
    "summary/functional_outer/max": "max",
    "summary/stability/max": "max",
    "summary/ln/var_min_over_eps": "min",
    "summary/skipped_evaluations": "max",
}

# The per-block table of a full evaluation (``summary/layers``): column -> the per-block key or watched quantity.
TABLE_COLUMNS = {
    "hessian_max": "hessian/max",
    "stability_max": "stability/max",
    "sharpness_max": "sharpness/max",
    "functional_outer": "ratio/functional_outer",
    "softmax_jac_min": "saturation",
    "logit_bound": "logit",
    "outer_vv": "outer_VV",
    "norm_ratio": "ln_ratio",
    "lanczos_residual": "lanczos/rel_residual_max",
}


class LogError(Exception):
    """An error after the numbers were computed: in the summaries, the alerts or a logger."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error


@dataclass
class Entry:
    """One evaluation, ready for the loggers (made by :meth:`Logbook.record`, counted by :meth:`Logbook.commit`).

    Args:
        step: Optimizer step of the evaluation.
        terms_only: Whether it was a terms-only evaluation.
        logged: Prefixed key -> value, what reaches the loggers at ``step`` (the keys of the log level).
        values: Prefixed key -> value, every key of the evaluation, whatever the log level.
        results: ``{block: {key: value}}``, the evaluation's own numbers (non-finite flags left out).
        summary: The ``summary/...`` keys (unprefixed).
        norms: Block -> largest Hessian norm (full evaluations; the block-norm heatmap).
        ratios: Block -> largest edge-of-stability ratio (the stability heatmap).
        fired: Warnings the rule sets fired on it.
        table: One row per block of a full evaluation (``block``, ``layer``, ``kind`` and :data:`TABLE_COLUMNS`,
            ``None`` where a block has no such number); empty for a terms-only one.
    """

    step: int
    terms_only: bool
    logged: dict[str, float]
    values: dict[str, float]
    results: dict[str, dict[str, float]]
    summary: dict[str, float]
    norms: dict[str, float]
    ratios: dict[str, float]
    fired: list[Alert]
    table: list[dict[str, Any]]


class Logbook:
    """Summaries, warnings and the run's counters, fed one evaluation at a time (no Trainer needed).

    Args:
        key_prefix: Prefix of every logged key (``"curv/"``).
        tol: Lanczos tolerance the residual summaries compare against.
        rules: The suite's rules (:class:`curvwatch.rules.RuleSet`), or ``None`` for none.
        count_terms: Log ``summary/terms_evaluations`` (a terms-only cadence is set).
        log_level: Which keys reach the loggers: ``"summary"`` (default), ``"blocks"`` or ``"all"``
            (:class:`curvwatch.options.LogLevel`, :mod:`curvwatch.keys`).
        listeners: Called with every committed :class:`Entry` (e.g. the demo's plots, which read every key).
    """

    def __init__(
        self,
        key_prefix: str = "",
        tol: float = 1e-2,
        rules: RuleSet | None = None,
        count_terms: bool = False,
        log_level: str | LogLevel = LogLevel.SUMMARY,
        listeners: list[Any] | None = None,
    ) -> None:
        self.key_prefix, self.tol, self.rules = key_prefix, tol, rules
        self.count_terms = count_terms
        self.log_level = choice("log_level", log_level, LogLevel)
        self.listeners: list[Any] = list(listeners or [])
        self.evaluations = self.terms_evaluations = self.skipped = 0
        self.last_norms: dict[str, float] = {}
        self.last_summary: dict[str, float] = {}
        self.peak: dict[str, Any] = {}
        self.errors: list[str] = []

    @property
    def history(self) -> list[Alert]:
        """Every warning fired so far, oldest first."""
        return list(self.rules.history) if self.rules else []

    @property
    def fired(self) -> int:
        """How many warnings fired so far."""
        return self.rules.fired if self.rules else 0

    def record(
        self,
        step: int,
        flat: Mapping[tuple[str, str], float],
        evaluation: Evaluation,
        blocks: Mapping[str, tuple[str, int | None, float | None]],
        elapsed: float,
        overhead: float,
        terms_only: bool,
    ) -> Entry:
        """Summaries, warnings and keys of one evaluation; the rule sets advance, the counters do not (:meth:`commit`).

        Args:
            step: Optimizer step.
            flat: ``{(block, key): value}`` reduced over ranks (:func:`flatten`, then ``Ranks.sync``).
            evaluation: What the engine returned (its ``failed`` blocks are counted).
            blocks: Block name -> ``(kind, layer, eps)``: the block's kind, layer index and norm ``eps`` (or ``None``).
            elapsed: Seconds the evaluation took.
            overhead: Fraction of the training time the monitor has spent.
            terms_only: A terms-only evaluation.
        """
        results: dict[str, dict[str, float]] = {}
        nonfinite = [block for (block, key) in flat if key == NONFINITE]
        for (block, key), value in flat.items():
            if key != NONFINITE:
                results.setdefault(block, {})[key] = value
        layers = {name: layer for name, (_, layer, _) in blocks.items()}
        per_block, summary, norms = M.derive(results, layers, terms_only=terms_only, tol=self.tol, skip_norms=nonfinite)
        p = self.key_prefix
        logged = {f"{p}{block}/{NONFINITE}": 1.0 for block in nonfinite}
        logged.update({f"{p}{block}/{k}": v for block, keys in per_block.items() for k, v in keys.items()})
        fired: list[Alert] = []
        unprefixed = {f"{block}/{k}": v for block, ks in per_block.items() for k, v in ks.items()}
        if self.rules is not None:  # what the rules read
            fired += self.rules.update(step, unprefixed, full=not terms_only)
        quantities = block_quantities(unprefixed)
        summary.update(M.signal_summaries(quantities))

        summary["summary/terms_eval_time_s" if terms_only else "summary/eval_time_s"] = elapsed
        summary["summary/overhead"] = overhead
        summary["summary/evaluations"] = float(self.evaluations + (0 if terms_only else 1))
        if self.count_terms:
            summary["summary/terms_evaluations"] = float(self.terms_evaluations + (1 if terms_only else 0))
        summary["summary/skipped_evaluations"] = float(self.skipped)
        if evaluation.failed:
            summary["summary/skipped_blocks"] = float(len(evaluation.failed))
        summary["summary/nonfinite_blocks"] = float(len(nonfinite))
        summary["summary/warnings"] = float(self.fired)
        logged.update({f"{p}{k}": v for k, v in summary.items()})
        layer_keys = {K.layer_key(p, k): v for k, v in M.layer_maxima(per_block, layers).items()}
        logged.update(layer_keys)
        level = self.log_level
        keep = set(layer_keys) | {f"{p}{k}" for k in summary if level.includes(LogLevel(K.summary_level(k)))}
        keep |= {f"{p}{block}/{k}" for block, ks in per_block.items() for k in ks
                 if level.includes(LogLevel(K.block_level(k)))}  # fmt: skip
        if level.includes(LogLevel.BLOCKS):
            keep |= {f"{p}{block}/{NONFINITE}" for block in nonfinite}
        shown = {k: v for k, v in logged.items() if k in keep}
        ratios = {b: keys["stability/max"] for b, keys in per_block.items() if "stability/max" in keys}
        table = [] if terms_only else _table(per_block, quantities, blocks)
        return Entry(step, terms_only, shown, logged, results, summary, norms, ratios, fired, table)

    def commit(self, entry: Entry) -> None:
        """Count a logged entry: counters, last values (a terms-only one keeps the last full norms) and the peak;
        then hand it to the listeners."""
        if entry.terms_only:
            self.terms_evaluations += 1
            self.last_summary = {**self.last_summary, **entry.summary}
        else:
            self.evaluations += 1
            self.last_norms, self.last_summary = entry.norms, entry.summary
        if entry.norms:
            top = max(entry.norms, key=entry.norms.__getitem__)
            if not self.peak or entry.norms[top] > self.peak["value"]:
                self.peak = {"value": entry.norms[top], "block": top, "step": entry.step}
        for listener in self.listeners:
            listener(entry)

    def metric_summaries(self, blocks: Mapping[str, tuple[str, int | None, float | None]]) -> dict[str, str]:
        """How run tables summarize the headline keys over steps (``"max"``/``"min"``), prefixed: the headline
        summaries and the per-layer block norms (W&B ``define_metric``).

        Args:
            blocks: Block name -> ``(kind, layer, eps)``, as :meth:`record` takes it.
        """
        p = self.key_prefix
        out = {p + k: v for k, v in HEADLINES.items()}
        for name, (kind, layer, _) in blocks.items():
            if KINDS[kind].has_norms and layer is not None:
                per_block = {name: {"hessian/max": 1.0}}
                out.update({K.layer_key(p, k): "max" for k in M.layer_maxima(per_block, {name: layer})})
                if self.log_level is not LogLevel.SUMMARY:
                    out[f"{p}{name}/hessian/max"] = "max"
        return out

    def rule_states(self) -> dict[str, Any] | None:
        """The rules' state, to rewind them (:meth:`load_rule_states`) when an entry could not be logged."""
        return self.rules and self.rules.state_dict()

    def load_rule_states(self, states: dict[str, Any] | None) -> None:
        """Rewind the rules to :meth:`rule_states`."""
        if self.rules is not None:
            self.rules.load_state_dict(states)

    def headlines(self) -> dict[str, float]:
        """The headline summaries of the last evaluations (unprefixed keys)."""
        return {key: self.last_summary[key] for key in HEADLINES if key in self.last_summary}

    def skip(self, step: int, error: BaseException | None) -> str:
        """Count a skipped evaluation and keep its error (the last 20); returns what went wrong, in words.

        ``error`` is ``None`` when the evaluation failed on another rank.
        """
        self.skipped += 1
        if error is None:
            what = "an evaluation failed on another rank"
        elif isinstance(error, BlockError):
            what = f"evaluating block '{error.block}' raised {type(error.error).__name__}: {error.error}"
        elif isinstance(error, LogError):
            what = f"summarizing or logging the numbers raised {type(error.error).__name__}: {error.error}"
        else:
            what = f"{type(error).__name__}: {error}"
        self.errors = (self.errors + [f"step {step}: {what}"])[-20:]
        return what

    def state_dict(self) -> dict[str, Any]:
        """Counters, last values, peak, errors and the rule sets' states (the callback's checkpoint keys)."""
        return {
            "evaluations": self.evaluations,
            "terms_evaluations": self.terms_evaluations,
            "skipped": self.skipped,
            "rules": None if self.rules is None else self.rules.state_dict(),
            "last_norms": dict(self.last_norms),
            "last_summary": dict(self.last_summary),
            "peak": dict(self.peak),
            "errors": list(self.errors),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (missing keys take their defaults: older checkpoints; ``{}`` resets)."""
        self.evaluations = int(state.get("evaluations", 0))
        self.terms_evaluations = int(state.get("terms_evaluations", 0))
        self.skipped = int(state.get("skipped", 0))
        if self.rules is not None:
            self.rules.load_state_dict(state.get("rules") or {})
        self.last_norms = dict(state.get("last_norms", {}))
        self.last_summary = dict(state.get("last_summary", {}))
        self.peak = dict(state.get("peak", {}))
        self.errors = list(state.get("errors", []))


def _table(
    per_block: Mapping[str, Mapping[str, float]],
    quantities: Mapping[tuple[str, str], float],
    blocks: Mapping[str, tuple[str, int | None, float | None]],
) -> list[dict[str, Any]]:
    """The per-block table of a full evaluation (:attr:`Entry.table`)."""
    rows = []
    for block, keys in per_block.items():
        kind, layer, _ = blocks.get(block, ("-", None, None))
        row: dict[str, Any] = {"block": block, "layer": layer, "kind": kind}
        for column, source in TABLE_COLUMNS.items():
            row[column] = keys.get(source, quantities.get((block, source)))
        rows.append(row)
    return rows


#: Keys whose NaN is "no value" in :func:`flatten`, not a NaN block: a ``sharpness_spread`` of a sharpness of 0 (0/0),
#: and the debiased real-loss keys too uncertain to report (``closed_form.solver.debiasing.SPREAD_LIMIT``; their
#: ratios). The engine checked their inputs for NaN/Inf before (one read of every block), so a NaN here is the
#: kernel's mark.
NO_DATA_KEYS = ("sharpness_spread/", "sharpness/", "precond_sharpness/", "ggn/", "precond_ggn/", "stability/")


def flatten(
    results: Mapping[str, Mapping[str, Tensor | float]], keep_no_data: bool = False
) -> dict[tuple[str, str], float]:
    """``{block: {key: 0-d tensor}}`` as ``{(block, key): float}`` (one device sync); NaN blocks become flags.

    Every block with a NaN among its numbers is replaced by its ``skipped_nonfinite`` flag; ``+-inf`` is kept: it
    is what the closed form says (``ln/inv_var_max`` with ``eps=0`` and a constant row). A NaN under a key of
    :data:`NO_DATA_KEYS` means "no value" (the engine's kernels mark it so instead of a host read each): that key is
    dropped, the block kept; with ``keep_no_data`` it stays, NaN, for :meth:`curvwatch.ranks.Ranks.sync` (every
    rank then reduces the same keys, a rank without a value leaving it out), and :func:`drop_no_data` drops it after.

    Example:
        >>> flatten({"a": {"x": torch.tensor(1.0)}, "b": {"x": float("nan"), "y": 2.0}})
        {('a', 'x'): 1.0, ('b', 'skipped_nonfinite'): 1.0}
        >>> flatten({"a": {"sharpness/QQ": 0.0, "sharpness_spread/QQ": float("nan")}})
        {('a', 'sharpness/QQ'): 0.0}
    """
    keys = [(block, key) for block, result in results.items() for key in result]
    if not keys:
        return {}
    raw = [results[b][k] for b, k in keys]
    values = [math.nan] * len(raw)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}  # one stack and one transfer per device and dtype
    for i, v in enumerate(raw):
        if isinstance(v, Tensor):
            groups.setdefault((v.device, v.dtype), []).append(i)
        else:
            values[i] = float(v)
    for idx in groups.values():
        # (0-d values without autograd history, the engine's, go in as they are: a detach and a view per key were
        # two dispatched operators each, hundreds per layer)
        parts = [raw[i] if raw[i].dim() == 0 and not raw[i].requires_grad else raw[i].detach().reshape(()) for i in idx]
        stacked = torch.stack(parts).to("cpu", torch.float64).tolist()
        for i, v in zip(idx, stacked, strict=True):
            values[i] = v
    no_data = {bk for bk, v in zip(keys, values, strict=True) if _no_data(bk[1], v)}
    flat = {bk: v for bk, v in zip(keys, values, strict=True) if bk not in no_data}
    bad = {block for (block, _), value in flat.items() if math.isnan(value)}
    out = {(b, k): v for (b, k), v in flat.items() if b not in bad}
    out.update({(b, NONFINITE): 1.0 for b in bad})
    if keep_no_data:
        out.update({(b, k): math.nan for b, k in no_data if b not in bad})
    return out


def drop_no_data(flat: Mapping[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """``flat`` without its "no value" entries (NaN under :data:`NO_DATA_KEYS`, kept by ``flatten(keep_no_data=True)``
    for the ranks' reduction).

    Example:
        >>> drop_no_data({("a", "sharpness/QQ"): float("nan"), ("a", "hessian/QQ"): 1.0})
        {('a', 'hessian/QQ'): 1.0}
    """
    return {bk: v for bk, v in flat.items() if not _no_data(bk[1], v)}


def _no_data(key: str, value: float) -> bool:
    """Whether ``value`` of ``key`` is "no value": a NaN under :data:`NO_DATA_KEYS`."""
    return math.isnan(value) and key.startswith(NO_DATA_KEYS)
