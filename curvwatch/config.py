"""The monitor's settings: a few top-level kwargs and four groups, each validated where it is built.

:class:`~curvwatch.CurvatureMonitor`, :class:`~curvwatch.Monitor` and the Hugging Face callback take the same
settings: ``every_n_train_steps``, ``blocks``, ``log_key_prefix``, ``sharpness``, ``warning_rules``, ``on_error``,
``log_heatmap``, ``verbose``, ``log_level``, plus the groups

* :class:`Cadence`: when to evaluate and how much of the training time it may take;
* :class:`Evaluation`: what an evaluation computes and with which accuracy and memory;
* :class:`Warnings`: which warning rules run;
* :class:`Sharpness`: the real-loss curvature (sampled backward passes from the logits).

A group checks its values when it is constructed, so a mistake is reported where it is written, naming the group;
an unknown keyword gets a "did you mean". :func:`resolve` checks the top-level kwargs and assembles
:class:`Settings`.

Example:
    >>> settings = resolve(evaluation=Evaluation(max_tokens=256), sharpness=False)
    >>> settings.evaluation.max_tokens, settings.sharpness.enabled
    (256, False)
    >>> Evaluation(pairs=["XX"])
    Traceback (most recent call last):
    ...
    ValueError: Invalid curvwatch.Evaluation(pairs=['XX']): unknown pair name 'XX'. Known pair names: ...
    >>> Evaluation(max_token=64)
    Traceback (most recent call last):
    ...
    TypeError: curvwatch.Evaluation() got an unexpected keyword argument 'max_token'. Did you mean 'max_tokens'? ...
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from curvwatch.adapters import BlockSpec
from curvwatch.closed_form.settings import PARTS, Lanczos
from curvwatch.kinds import KINDS
from curvwatch.options import (
    LogLevel,
    OnError,
    Precision,
    TermsKeys,
    WarningRules,
    check_int,
    check_number,
    choice,
    pairs_option,
)
from curvwatch.realloss.weights import LossKind
from curvwatch.rules import RuleSet
from curvwatch.schedule import Schedule

__all__ = ["Cadence", "Evaluation", "Settings", "Sharpness", "Warnings", "known_pairs", "resolve"]


def _group(cls: type) -> type:
    """A settings group: a frozen dataclass whose ``check()`` runs at construction, its errors naming the group, and
    whose unknown keywords get a "did you mean"."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = [f.name for f in dataclasses.fields(cls)]
        for name in kwargs:
            if name not in fields:
                close = difflib.get_close_matches(name, fields, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise TypeError(
                    f"curvwatch.{cls.__name__}() got an unexpected keyword argument {name!r}.{hint} "
                    f"Its fields are {fields}."
                )
        init(self, *args, **kwargs)
        try:
            self.check()
        except ValueError as err:
            found = re.match(r"Invalid (\w+=.*?)[.:] (.*)", str(err), re.S)
            text = f"({found[1]}): {found[2]}" if found else f": {err}"
            raise ValueError(f"Invalid curvwatch.{cls.__name__}{text}") from None

    cls.__init__ = __init__
    return cls


@_group
@dataclass(frozen=True)
class Cadence:
    """When the monitor evaluates and how much of the training time it may take.

    Args:
        every_n_train_steps: Evaluate on optimizer steps ``0, n, 2n, ...``. ``None`` (default): every 200 steps within
            the overhead budget (``max_overhead``), and at least every 500 steps while the whole monitor stays within 5%
            of the training time (the floor of :mod:`curvwatch.schedule`). A chosen cadence is honoured as it is; when
            its evaluations take over 10% of the training time the monitor says so once, with what each costs. One
            evaluation costs a fixed amount of work (capped by ``max_tokens``): many training steps of a tiny model,
            most of them for the real-loss keys of ``sharpness``, and fewer on larger models (``docs/cadence.md``,
            "What one evaluation costs").
        terms_every_n_train_steps: Also evaluate, on optimizer steps ``0, n, 2n, ...`` that are not due for a full
            evaluation, numbers that need no Lanczos over Hessian products (``terms_keys`` says which): by default what
            the warning rules read. ``"auto"`` (default): every 10 steps within a budget of its own, 4% of the training
            time (a due terms-only step is skipped while the terms-only seconds so far plus one more would exceed it;
            the full tier's budget then counts full evaluations only); an int: that cadence, under ``max_overhead`` like
            the full tier; ``None``: off. A terms-only evaluation costs a fraction of a full one (``docs/cadence.md``).
            The warning rules read both kinds; ``hessian/max``, ratios, norm summaries and the heatmap come from full
            evaluations only.
            Under the overhead budget a full evaluation it cannot afford falls back to terms only on steps due for both.
        max_overhead: Largest fraction of the training wall time the evaluations may take. ``"auto"`` (default): 0.01
            with the default cadence, none with a chosen one; ``None``: a fixed schedule; a number: that budget (with
            any cadence). A due step is evaluated only if the evaluations so far plus this one (priced as the last one)
            stay within this fraction of the time trained so far, so the effective period may grow beyond
            ``every_n_train_steps`` (``curv/summary/overhead`` logs the monitor's seconds per training second). Step 0
            is always evaluated. With DDP the ranks agree through one all-reduce per due step.
    """

    every_n_train_steps: int | None = None
    terms_every_n_train_steps: int | str | None = "auto"
    max_overhead: float | str | None = "auto"

    def check(self) -> None:
        Schedule(self.every_n_train_steps, self.terms_every_n_train_steps, self.max_overhead)


@_group
@dataclass(frozen=True)
class Evaluation:
    """What one evaluation computes, how accurately, and within which memory.

    Args:
        tol: Relative residual at which a Lanczos spectral norm counts as converged (default ``1e-2``; some eigenvalue
            then lies within ``tol`` of the norm, and ``python -m benchmarks.bench_accuracy`` measures the true errors
            against tightly converged norms). A norm that hits ``max_iter`` first is counted in
            ``summary/lanczos/unconverged`` and warned about once.
        max_iter: Most Lanczos steps per norm.
        max_basis: Most Lanczos vectors held per norm (``>= 4``; ``None``: ``max_iter``). A norm that needs more steps
            restarts (thick restart: same accuracy, a few more products), so the memory of its basis is bounded whatever
            ``max_iter``.
        dtype: ``"float32"`` or ``"float64"``, the precision of the closed forms.
        pairs: Block pairs kept: ``"diagonal"`` (``VV``, ``QQ``, ``KK``, ``W1W1``, ``W2W2``, ...), ``"all"`` or a list
            of names such as ``["VV", "QQ", "VQ", "W1W1"]``.
        parts: Which Hessian parts' norms to compute: a subset of ``("outer", "functional", "hessian")`` (default all
            three). ``("hessian",)`` alone makes an evaluation 2-3x cheaper.
        max_tokens: Token positions kept per block (first whole sequences; see :class:`~curvwatch.capture.Capture`).
        memory_budget_mb: Most extra memory, in MiB, one block's closed form may take (estimated by
            :func:`~curvwatch.engine.memory.evaluation_bytes`): a block over it holds fewer Lanczos vectors per
            norm, then is evaluated on fewer tokens; one warning each. ``None``: no budget. It also bounds one batched
            sampled backward pass of the real-loss keys (:func:`~curvwatch.realloss.sampling.passes_at_once`; ``None``
            there: :data:`~curvwatch.realloss.sampling.BATCH_MEMORY_MB`).
        terms_keys: What a terms-only evaluation computes. ``"warnings"`` (default): what the warning rules read, no
            more (attention: ``term/x_norm``, ``term/x_norm6``, ``term/wq_norm``, ``term/wk_norm``,
            ``term/softmax_jac_norm`` and the exact ``outer/VV``; LayerNorm/RMSNorm: the row statistics; FFN blocks only
            when a rule reads their ``W2W2``): the same numbers, about 3x cheaper than ``"all"`` (measured in
            ``docs/cadence.md`` and ``docs/instability.md``). ``"all"``: every bound
            term and bound (``term/...``, ``bound/...``), the exact norms (``outer/VV``, ``hessian/VV``, ``.../W2W2``),
            the norms of the LayerNorm/RMSNorm blocks, the FFN activity fractions.
    """

    tol: float = 1e-2
    max_iter: int = 60
    max_basis: int | None = 16
    dtype: str = "float32"
    pairs: str | Sequence[str] = "diagonal"
    parts: Sequence[str] = PARTS
    max_tokens: int = 512
    memory_budget_mb: float | None = None
    terms_keys: str = "warnings"

    def check(self) -> None:
        Lanczos(tol=self.tol, max_iter=self.max_iter, max_basis=self.max_basis)
        choice("dtype", self.dtype, Precision)
        _check_pairs(self.pairs)
        parts = (self.parts,) if isinstance(self.parts, str) else tuple(self.parts)
        if not parts or any(p not in PARTS for p in parts):
            raise ValueError(
                f"Invalid parts={self.parts!r}. Must be a non-empty subset of {PARTS}, e.g. parts=('hessian',)."
            )
        check_int("max_tokens", self.max_tokens, 1)
        check_number(
            "memory_budget_mb", self.memory_budget_mb, low=0, allow_none=True,
            hint="> 0 (MiB), or None for no budget",
        )  # fmt: skip
        choice("terms_keys", self.terms_keys, TermsKeys)


@_group
@dataclass(frozen=True)
class Warnings:
    """Which warnings the monitor gives.

    Args:
        rules: ``"suite"`` (default: the rules of :class:`curvwatch.rules.RuleSet`, designed on the instability
            suite), ``"none"``, or a configured :class:`~curvwatch.rules.RuleSet`.
        warn: Emit :class:`~curvwatch.CurvatureWarning` (and W&B alerts) when a rule fires. The monitor's notices
            about itself (unconverged norms, costs, blocks left out, skipped evaluations) are
            :class:`~curvwatch.CurvatureNotice`, a separate category, whatever ``warn``.
    """

    rules: str | RuleSet = "suite"
    warn: bool = True

    def check(self) -> None:
        if not isinstance(self.rules, RuleSet):
            choice("rules", self.rules, WarningRules)

    def rule_set(self) -> RuleSet | None:
        """The rules to run (a fresh :class:`~curvwatch.rules.RuleSet` for ``"suite"``), or ``None``."""
        if isinstance(self.rules, RuleSet):
            return self.rules
        return RuleSet() if WarningRules(self.rules) is WarningRules.SUITE else None


@_group
@dataclass(frozen=True)
class Sharpness:
    """The curvature of the real training loss (:mod:`curvwatch.realloss`).

    Args:
        enabled: The curvature of the real training loss (:mod:`curvwatch.realloss`): on full evaluations,
            ``samples`` extra backward passes from the logits (labels sampled from the model's own
            predictions) give each attention and FFN block its Monte-Carlo Gauss-Newton curvature; the kernels add the
            block's exact own second-order term (``sharpness/...``), and the optimizer's threshold turns it into an
            edge-of-stability ratio (``stability/...``; SGD, Adam, AdamW). ``"auto"`` (default): on when a logits module
            is found (set-up table row ``sharpness``); ``True``: required (an error at set-up where it cannot work: no
            logits module found, FSDP1; and at the first full evaluation whose logits module gave no logits or no
            gradient); ``False``: off.
        samples: Sampled output gradients per evaluation (each one backward pass from the logits), at least 2: the
            uncertainty of the estimate (``sharpness_spread``) compares two halves of them, and a key whose spread
            exceeds its value is withheld. The estimate's relative noise falls like ``1/sqrt(samples)``.
        loss: The loss at the logits: ``"auto"`` (softmax cross-entropy, recognised from its gradient; anything else is
            an error naming the options), ``"cross_entropy"``, ``"mse"`` (mean over every element), or soft targets
            (distillation KL, mixup) with their reduction: ``"soft_batchmean"`` (divided by the logits' first
            dimension: ``kl_div(..., reduction="batchmean")``), ``"soft_mean"`` (by the logits' rows) or ``"soft_sum"``.
        logits_module: Dotted name of the module whose output the loss reads (``None``: the first of ``lm_head``,
            ``head``, ``classifier``, ``output``, ``score``, ``fc_out``, ``decoder`` found).
        verify_every_n_evals: Every this many full evaluations (``None``, default: never), also compute the true block
            Hessian's largest eigenvalue by Hessian-vector products of the loss (everything downstream included; head 0
            of attention) and log it with its ratio to the sharpness (``verify/hessian/XX``, ``verify/ratio/XX``): how
            far the closed-form view is from the truth on your model. Costs a backward with ``create_graph`` and ~30
            double-backward products per pair; needs double backward (no fused attention kernels).
    """

    enabled: bool | str = "auto"
    samples: int = 16
    loss: str = "auto"
    logits_module: str | None = None
    verify_every_n_evals: int | None = None

    def check(self) -> None:
        if self.enabled not in (True, False, "auto"):
            raise ValueError(f"Invalid enabled={self.enabled!r}. Must be True, False or 'auto'.")
        check_int("samples", self.samples, 2, hint=": the uncertainty (sharpness_spread) compares two halves")
        choice("loss", self.loss, LossKind)
        if self.logits_module is not None and not isinstance(self.logits_module, str):
            raise ValueError(
                f"Invalid logits_module={self.logits_module!r}. Must be a module name such as 'lm_head', or None."
            )
        check_int("verify_every_n_evals", self.verify_every_n_evals, 1, allow_none=True)


@dataclass(frozen=True)
class Settings:
    """Every setting of a monitor, validated (:func:`resolve`)."""

    every_n_train_steps: int | None
    blocks: Any
    log_key_prefix: str
    cadence: Cadence
    evaluation: Evaluation
    warnings: Warnings
    sharpness: Sharpness
    on_error: OnError
    log_heatmap: bool
    verbose: bool
    log_level: LogLevel
    rules: RuleSet | None  # the warning rules run (None: none)
    terms_keys: TermsKeys
    pairs: str | tuple[str, ...]
    parts: tuple[str, ...]


def known_pairs() -> tuple[str, ...]:
    """Every block pair name some block kind computes (``VV``, ``QQ``, ``VQ``, ``W1W1``...)."""
    return tuple(dict.fromkeys(p for kind in KINDS.values() for p in kind.pairs))


def _check_pairs(pairs: Any) -> str | tuple[str, ...]:
    checked = pairs_option(pairs)
    if isinstance(checked, str):
        return checked
    known = known_pairs()
    for name in checked:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" Did you mean {close}?" if close else ""
            raise ValueError(
                f"Invalid pairs={list(checked)!r}: unknown pair name {name!r}. Known pair names: {list(known)}.{hint} "
                "Or pass 'diagonal' (the default) or 'all'."
            )
    return checked


def _as_group(name: str, value: Any, cls: type) -> Any:
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ValueError(
            f"Invalid {name}={value!r}. Must be a curvwatch.{cls.__name__}(...) or None (the defaults), e.g. "
            f"{name}=curvwatch.{cls.__name__}({dataclasses.fields(cls)[0].name}=...)."
        )
    return value


#: The top-level kwargs (the signature of :func:`resolve`).
TOP_LEVEL = (
    "every_n_train_steps", "blocks", "log_key_prefix", "sharpness", "warning_rules", "cadence", "evaluation",
    "on_error", "log_heatmap", "verbose", "log_level",
)  # fmt: skip


def check_names(names: Sequence[str], owner: str) -> None:
    """Raise a ``TypeError`` with a "did you mean" for any of ``names`` that is not a top-level setting.

    Args:
        names: The keyword arguments given.
        owner: The class they were given to, for the message (``"CurvatureMonitor"``).
    """
    for name in names:
        if name not in TOP_LEVEL:
            fields = {f.name: g for g in (Cadence, Evaluation, Warnings, Sharpness) for f in dataclasses.fields(g)}
            close = difflib.get_close_matches(name, [*TOP_LEVEL, *fields], n=1)
            hint = ""
            if close and close[0] in TOP_LEVEL:
                hint = f" Did you mean {close[0]!r}?"
            elif close:
                group = fields[close[0]].__name__
                hint = f" Did you mean curvwatch.{group}({close[0]}=...)? Pass it as {group.lower()}=..."
                if group == "Warnings":
                    hint = f" Did you mean warning_rules=curvwatch.Warnings({close[0]}=...)?"
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {name!r}.{hint} Its settings are {list(TOP_LEVEL)}; the "
                "rest go in curvwatch.Cadence, Evaluation, Warnings and Sharpness."
            )


def resolve(
    every_n_train_steps: int | None = None,
    blocks: Any = "auto",
    log_key_prefix: str = "curv/",
    sharpness: bool | str | Sharpness = "auto",
    warning_rules: str | RuleSet | Warnings = "suite",
    cadence: Cadence | None = None,
    evaluation: Evaluation | None = None,
    on_error: str | OnError = "warn",
    log_heatmap: bool = True,
    verbose: bool = False,
    log_level: str | LogLevel = "summary",
) -> Settings:
    """Validate the monitor's kwargs (see the module docstring) into :class:`Settings`.

    Raises:
        ValueError: For an invalid kwarg, naming it, the value, what is allowed and the fix.
    """
    cadence = _as_group("cadence", cadence, Cadence)
    evaluation = _as_group("evaluation", evaluation, Evaluation)
    if isinstance(warning_rules, Warnings):
        warns = warning_rules
    elif isinstance(warning_rules, (str, RuleSet)):
        try:
            warns = Warnings(rules=warning_rules)
        except ValueError:
            raise ValueError(
                f"Invalid warning_rules={warning_rules!r}. Must be 'suite', 'none', a curvwatch.rules.RuleSet or a "
                "curvwatch.Warnings(...)."
            ) from None
    else:
        raise ValueError(
            f"Invalid warning_rules={warning_rules!r}. Must be 'suite', 'none', a curvwatch.rules.RuleSet or a "
            "curvwatch.Warnings(...)."
        )
    if isinstance(sharpness, Sharpness):
        sharp = sharpness
    elif sharpness in (True, False, "auto"):
        sharp = Sharpness(enabled=sharpness)
    else:
        raise ValueError(f"Invalid sharpness={sharpness!r}. Must be True, False, 'auto' or a curvwatch.Sharpness(...).")
    if every_n_train_steps is not None:
        if cadence.every_n_train_steps is not None:
            raise ValueError(
                "Pass every_n_train_steps once: as a kwarg or in cadence=curvwatch.Cadence(...), not both."
            )
        check_int("every_n_train_steps", every_n_train_steps, 1)
        cadence = dataclasses.replace(cadence, every_n_train_steps=every_n_train_steps)
    if not (blocks == "auto" or (not isinstance(blocks, str) and isinstance(blocks, Sequence)
                                 and all(isinstance(b, BlockSpec) for b in blocks))):  # fmt: skip
        raise ValueError(
            f"Invalid blocks={blocks!r}. Must be 'auto' or a list of curvwatch.BlockSpec. See curvwatch.find_blocks "
            "and, for a layer curvwatch does not know, curvwatch.describe_layer."
        )
    if not isinstance(log_key_prefix, str):
        raise ValueError(f"Invalid log_key_prefix={log_key_prefix!r}. Must be a str such as 'curv/'.")
    parts = (evaluation.parts,) if isinstance(evaluation.parts, str) else tuple(evaluation.parts)
    return Settings(
        every_n_train_steps=cadence.every_n_train_steps,
        blocks=blocks,
        log_key_prefix=log_key_prefix,
        cadence=cadence,
        evaluation=evaluation,
        warnings=warns,
        sharpness=sharp,
        on_error=choice("on_error", on_error, OnError),
        log_heatmap=bool(log_heatmap),
        verbose=bool(verbose),
        log_level=choice("log_level", log_level, LogLevel),
        rules=warns.rule_set(),
        terms_keys=TermsKeys(evaluation.terms_keys),
        pairs=_check_pairs(evaluation.pairs),
        parts=parts,
    )
