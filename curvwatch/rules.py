"""Early-warning rules for training instabilities: a pure state machine over one evaluation's numbers.

:class:`RuleSet` reads the un-prefixed keys the monitor logs for one evaluation (``"layer0/attn/outer/VV/h0"``,
``"layer1/ln_2/ln/var_min_over_eps"``, ...) and decides which warnings to raise. It was designed on the
instability suite (``python -m benchmarks.instability``, results in ``docs/instability.md``): every default
sits above the worst value any stable run of the two training seeds reached (``python -m
benchmarks.instability.calibrate``) and was then checked on a held-out seed.

Every rule reads only numbers that a **terms-only** evaluation logs (``terms_every_n_train_steps``), so none needs
a Lanczos iteration; full evaluations feed them alike. Windows and patience are counted in steps, so the rules
work at any terms-only cadence; the suite's leads of 30 steps and more hold up to one evaluation every 10 steps.
The rules:

* ``"attn_saturation"``: in some head of an attention block every query attends (almost) one-hot: the
  measured softmax-Jacobian norm ``max_i lambda_max(diag a_i - a_i a_i^T)`` (``term/softmax_jac_norm``), as a
  geometric mean over ``saturation_steps``, falls below ``saturation_level``. Healthy heads stay near ``1/2``.
  The attention logits of a high-learning-rate run grow until the softmax saturates (Wortsman et al. 2023);
  in the suite this came 50-100 steps before the loss diverged.
* ``"growth"``: a smooth, exact per-block quantity rises by more than its threshold, in decades, within
  ``window_steps`` (from ``warmup_steps`` on: early training grows everything): the attention-logit bound
  ``||X||_2^2 max_h ||W_Q^h||_2 ||W_K^h||_2`` (``logit_growth``), the exact value curvature
  ``max_h ||H_o(VV)||`` (``outer_vv_growth``) and, off by default (too noisy where it is small), the FFN's exact
  ``||H(W2W2)||`` (``w2w2_growth``). The rise compares medians of a few evaluations now and ``window_steps``
  earlier and must hold for ``patience_steps``, so a single outlier cannot trigger it. Per-head ``QQ``/``KK``
  Hessian norms are not watched: they swing 10-100x between steps in healthy runs (saturated heads), so no
  rule fires on them.
* ``"ln_collapse"``: a LayerNorm input's smallest row variance falls below ``collapse_ratio x eps`` for
  ``collapse_patience`` consecutive evaluations (``ln/var_min_over_eps``).
* ``"ln_variance_drop"``: the same ratio falls by more than ``variance_drop_decades`` within ``window_steps``
  while below ``variance_drop_ceiling``: the collapse on its way, before it arrives.

Each alert says what it saw, since when, how sure it is and what to try. After a rule fires for a block it stays
silent there for ``cooldown_steps`` steps. The state is plain numbers (:meth:`RuleSet.state_dict`), so it survives
a checkpoint.

Example:
    >>> rules = RuleSet()
    >>> fired = []
    >>> for step in range(300):
    ...     vv = 1e3 * 10 ** (max(0, step - 200) / 20)   # flat, then a decade every 20 steps
    ...     fired += rules.update(step, {"layer0/attn/outer/VV/h0": vv}, full=False)
    >>> [(a.kind, a.block, a.step) for a in fired]
    [('growth', 'layer0/attn', 237)]
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from curvwatch.alerts import Alert, CurvatureWarning

__all__ = ["Alert", "CurvatureWarning", "RuleSet"]

# the first segment of every per-block key (curvwatch.keys) but "ffn" (also the usual name of an FFN block: in
# "layer0/ffn/ffn/dead_fraction" the first "/ffn/" is the block's), and those the rules read
CATEGORIES = (
    "bound", "functional", "ggn", "hessian", "lanczos", "ln", "outer", "precond_ggn", "precond_sharpness",
    "ratio", "residual", "rms", "sharpness", "sharpness_spread", "skipped_nonfinite", "stability", "term", "verify",
)  # fmt: skip
_CATEGORY = re.compile("/(" + "|".join(sorted(CATEGORIES, key=len, reverse=True)) + ")(?:/|$)")
_READ = ("term", "outer", "hessian", "ln", "rms")
_SATURATION_FLOOR = -6.0  # log10: one evaluation counts at most as a softmax-Jacobian norm of 1e-6
# watched growth quantities: name -> what it is (for messages)
_GROWTH = {
    "logit": "attention-logit bound ||X||^2 max_h ||W_Q^h|| ||W_K^h||",
    "outer_VV": "exact value curvature max_h ||H_o(VV)||",
    "W2W2": "exact FFN curvature ||H(W2W2)||",
}
_FIX_GROWTH = {
    "logit": "Lower the learning rate, add QK-norm (LayerNorm on queries and keys) or clip the attention logits; "
    "gradient clipping (Trainer(gradient_clip_val=1.0)) limits the damage.",
    "outer_VV": "Lower the learning rate or lengthen warmup, enable gradient clipping "
    "(Trainer(gradient_clip_val=1.0)); with output logits growing too, add z-loss (1e-4 * logsumexp^2).",
    "W2W2": "Lower the learning rate or lengthen warmup, enable gradient clipping "
    "(Trainer(gradient_clip_val=1.0)); a LayerNorm before the head and z-loss keep output logits bounded.",
}
_FIX_COLLAPSE = (
    "Lower the weight decay of the embeddings (or of the layer feeding this LayerNorm), raise the LayerNorm eps "
    "(e.g. 1e-5 -> 1e-3), or lower the learning rate; gradient clipping (Trainer(gradient_clip_val=1.0)) limits "
    "the damage."
)


def _number(name: str, value: Any, minimum: float, *, strict: bool = False, allow_zero: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if ok and allow_zero and value == 0:
        return 0.0
    if not ok or (value <= minimum if strict else value < minimum):
        rel = ">" if strict else ">="
        extra = " (0 disables)" if allow_zero else ""
        raise ValueError(f"Invalid {name}={value!r}. Must be a number {rel} {minimum:g}{extra}.")
    return float(value)


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Invalid {name}={value!r}. Must be an int >= {minimum}.")
    return value


def block_quantities(metrics: Mapping[str, float]) -> dict[tuple[str, str], float]:
    """The watched per-block quantities of one evaluation: ``{(block, quantity): value}``.

    Quantities: ``"logit"`` (``||X||_2^2 max_h ||W_Q^h||_2 ||W_K^h||_2``), ``"outer_VV"`` (``max_h ||H_o(VV)||``),
    ``"saturation"`` (``min_h`` softmax-Jacobian norm) of attention blocks, ``"W2W2"`` of FFN blocks,
    ``"ln_ratio"`` (``var_min / eps``) of LayerNorm blocks. Non-finite and non-positive values are left out (a
    ratio or a Jacobian norm of 0 is kept: a constant row, a one-hot head).

    Example:
        >>> block_quantities({"layer0/attn/term/x_norm": 2.0, "layer0/attn/term/wq_norm/h0": 3.0,
        ...                   "layer0/attn/term/wk_norm/h0": 0.5, "layer0/ln_1/ln/var_min_over_eps": 40.0})
        {('layer0/attn', 'logit'): 6.0, ('layer0/ln_1', 'ln_ratio'): 40.0}
    """
    per_block: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if key.startswith("summary/"):
            continue
        # the block is everything before the key's first category: "layer0/attn/bound/outer/VV/h0" is a bound
        # of block "layer0/attn", not the outer norm of a block "layer0/attn/bound"
        match = _CATEGORY.search(key)
        if match is not None and match.group(1) in _READ:
            block, rest = key[: match.start()], key[match.end() :]
            per_block.setdefault(block, {})[match.group(1) + "/" + rest] = value
    out: dict[tuple[str, str], float] = {}
    for block, m in per_block.items():
        x_norm = m.get("term/x_norm")
        heads = [k.rsplit("/", 1)[1] for k in m if k.startswith("term/wq_norm/")]
        groups = [k.rsplit("/", 1)[1] for k in m if k.startswith("term/wk_norm/g")]
        if groups and heads:  # grouped-query attention: query head h{i} reads key/value group g{i // (H / H_kv)}
            per = max(1, len(heads) // len(groups))
            products = [m[f"term/wq_norm/h{i}"] * m[f"term/wk_norm/g{i // per}"] for i in range(len(heads))
                        if f"term/wq_norm/h{i}" in m and f"term/wk_norm/g{i // per}" in m]  # fmt: skip
        else:
            products = [m[f"term/wq_norm/{h}"] * m[f"term/wk_norm/{h}"] for h in heads if f"term/wk_norm/{h}" in m]
        if x_norm is not None and products:
            out[(block, "logit")] = x_norm**2 * max(products)
        vv = [v for k, v in m.items() if k.startswith("outer/VV")]
        if vv:
            out[(block, "outer_VV")] = max(vv)
        jac = [(v, k.rsplit("/", 1)[1]) for k, v in m.items() if k.startswith("term/softmax_jac_norm/")]
        if jac:
            out[(block, "saturation")] = min(jac)[0]
        if "hessian/W2W2" in m:
            out[(block, "W2W2")] = m["hessian/W2W2"]
        for stat in ("ln/var", "rms/ms"):  # RMSNorm divides by sqrt(ms + eps): its mean square plays the variance
            if f"{stat}_min_over_eps" in m:
                ratio = m[f"{stat}_min_over_eps"]
                if m.get(f"{stat}_min") == 0 and not math.isfinite(ratio):
                    ratio = 0.0  # a constant row under eps = 0: 0 / 0, and the norm's own output is NaN
                out[(block, "ln_ratio")] = ratio
                break
    return {
        k: float(v)
        for k, v in out.items()
        if math.isfinite(v) and (v > 0 or (k[1] in ("ln_ratio", "saturation") and v == 0))
    }


def _argmin_head(metrics: Mapping[str, float], block: str) -> str:
    """The head of ``block`` with the smallest softmax-Jacobian norm (``"h0"``...)."""
    prefix = f"{block}/term/softmax_jac_norm/"
    heads = {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)}
    return min(heads, key=heads.__getitem__) if heads else ""


class RuleSet:
    r"""Decides, evaluation by evaluation, when a run is heading for an instability.

    Args:
        saturation_level: ``attn_saturation`` fires when, in some head of an attention block, every query's
            softmax Jacobian ``lambda_max(diag a_i - a_i a_i^T)`` is below this (``term/softmax_jac_norm``, geometric
            mean over ``saturation_steps``, each evaluation floored at 1e-6): all queries attend one-hot (0 disables).
            Healthy heads sit near ``1/2`` (a query splitting between two keys) and uniform ones near ``1/L``.
        saturation_steps: Steps of that geometric mean: the last ``max(3, saturation_steps / cadence)``
            evaluations (``>= 1``).
        logit_growth: Decades the attention-logit bound of a block may rise within ``window_steps`` (0 disables).
        outer_vv_growth: Decades ``max_h ||H_o(VV)||`` of an attention block may rise (0 disables).
        w2w2_growth: Decades ``||H(W2W2)||`` of an FFN block may rise (0 disables).
        window_steps: Steps over which a rise or fall is measured (``>= 1``).
        warmup_steps: Growth rules compare only evaluations from this step on: early training grows every
            curvature by decades (``>= 0``).
        smooth_steps: Steps whose evaluations' median stands for "now" and for "``window_steps`` ago": the
            median of the last ``max(3, smooth_steps / cadence)`` evaluations (``>= 1``), so one outlier cannot
            trigger a rule at any cadence.
        patience_steps: Steps a growth, saturation or variance-drop condition must hold: at least
            ``max(2, patience_steps / cadence)`` consecutive evaluations (``>= 1``).
        collapse_ratio: ``ln_collapse`` fires below ``var_min / eps = collapse_ratio`` (0 disables).
        collapse_patience: Consecutive evaluations below it (``>= 1``).
        variance_drop_decades: ``ln_variance_drop`` fires when ``var_min / eps`` fell by more than this within
            ``window_steps`` (0 disables) ...
        variance_drop_ceiling: ... and is now below this ratio (``> 0``).
        cooldown_steps: Steps a fired (rule, block) stays silent (``>= 0``).
        max_history: Fired alerts kept in :attr:`history` (``>= 0``).

    Raises:
        ValueError: For a value outside the ranges above, naming it.
    """

    def __init__(
        self,
        *,
        saturation_level: float = 1e-2,
        saturation_steps: int = 10,
        logit_growth: float = 1.1,
        outer_vv_growth: float = 1.5,
        w2w2_growth: float = 0.0,
        window_steps: int = 50,
        warmup_steps: int = 100,
        smooth_steps: int = 5,
        patience_steps: int = 5,
        collapse_ratio: float = 5.0,
        collapse_patience: int = 3,
        variance_drop_decades: float = 0.5,
        variance_drop_ceiling: float = 20.0,
        cooldown_steps: int = 100,
        max_history: int = 100,
    ) -> None:
        self.saturation_level = _number("saturation_level", saturation_level, 0)
        if self.saturation_level >= 0.5:
            raise ValueError(
                f"Invalid saturation_level={saturation_level!r}. Must be in [0, 0.5): the softmax-Jacobian norm "
                "never exceeds 1/2 (0 disables)."
            )
        self.saturation_steps = _count("saturation_steps", saturation_steps, 1)
        self.thresholds = {
            "logit": _number("logit_growth", logit_growth, 0, strict=True, allow_zero=True),
            "outer_VV": _number("outer_vv_growth", outer_vv_growth, 0, strict=True, allow_zero=True),
            "W2W2": _number("w2w2_growth", w2w2_growth, 0, strict=True, allow_zero=True),
        }
        self.window_steps = _count("window_steps", window_steps, 1)
        self.warmup_steps = _count("warmup_steps", warmup_steps, 0)
        self.smooth_steps = _count("smooth_steps", smooth_steps, 1)
        self.patience_steps = _count("patience_steps", patience_steps, 1)
        self.collapse_ratio = _number("collapse_ratio", collapse_ratio, 0)
        self.collapse_patience = _count("collapse_patience", collapse_patience, 1)
        self.variance_drop_decades = _number(
            "variance_drop_decades", variance_drop_decades, 0, strict=True, allow_zero=True
        )
        self.variance_drop_ceiling = _number("variance_drop_ceiling", variance_drop_ceiling, 0, strict=True)
        self.cooldown_steps = _count("cooldown_steps", cooldown_steps, 0)
        self.max_history = _count("max_history", max_history, 0)
        # "block|quantity" -> [[step, log10 value], ...], oldest first
        self._points: dict[str, list[list[float]]] = {}
        # "rule|block|quantity" -> [consecutive evaluations in condition, first step of the streak]
        self._streaks: dict[str, list[int]] = {}
        # "rule|block" -> first step at which it may fire again
        self._silent_until: dict[str, int] = {}
        self.history: list[Alert] = []
        self.fired = 0

    @property
    def exact_pairs(self) -> tuple[str, ...]:
        """The exact block pairs an enabled rule reads (``"VV"`` for ``outer_vv_growth``, ``"W2W2"`` for
        ``w2w2_growth``): what a signals evaluation computes besides the bound terms and statistics.

        Example:
            >>> RuleSet().exact_pairs, RuleSet(outer_vv_growth=0, w2w2_growth=1.0).exact_pairs
            (('VV',), ('W2W2',))
        """
        return tuple(pair for pair, q in (("VV", "outer_VV"), ("W2W2", "W2W2")) if self.thresholds[q] > 0)

    # -- windows -----------------------------------------------------------------------------------

    def _add(self, key: str, step: int, log_value: float) -> list[list[float]]:
        points = self._points.setdefault(key, [])
        if points and step <= points[-1][0]:  # a repeated or older step (a resumed run): start over from here
            points[:] = [p for p in points if p[0] < step]
        points.append([step, log_value])
        # the past median needs the last n points at least window_steps back; older ones are never read
        old = sum(1 for p in points if p[0] <= step - self.window_steps)
        del points[: max(0, old - self._n_smooth(points))]
        return points

    @staticmethod
    def _cadence(points: list[list[float]]) -> float:
        """Median steps between the last evaluations of one quantity (1 before there are two)."""
        tail = points[-11:]
        gaps = [b[0] - a[0] for a, b in zip(tail, tail[1:], strict=False)]
        return max(1.0, statistics.median(gaps)) if gaps else 1.0

    def _n_smooth(self, points: list[list[float]]) -> int:
        return max(3, round(self.smooth_steps / self._cadence(points)))

    def _n_patience(self, points: list[list[float]]) -> int:
        return max(2, math.ceil(self.patience_steps / self._cadence(points)))

    def _change(self, points: list[list[float]], step: int, since: int = 0) -> tuple[float, int] | None:
        """``(median(recent) - median(those ending window_steps ago), step of that past median)`` in decades,
        from points at or after step ``since``; ``None`` while either median lacks points."""
        n = self._n_smooth(points)
        recent = points[-n:]
        past = [p for p in points if since <= p[0] <= step - self.window_steps][-n:]
        if len(recent) < n or len(past) < n:
            return None
        now = statistics.median(p[1] for p in recent)
        then = statistics.median(p[1] for p in past)
        return now - then, int(past[-1][0])

    def _recent(self, points: list[list[float]]) -> float | None:
        """Median of the recent points (``None`` before there are enough)."""
        n = self._n_smooth(points)
        if len(points) < n:
            return None
        return statistics.median(p[1] for p in points[-n:])

    # -- conditions --------------------------------------------------------------------------------

    def _streak(self, key: str, holds: bool, step: int) -> tuple[int, int]:
        count, since = self._streaks.get(key, [0, step])
        count, since = (count + 1, since if count else step) if holds else (0, step)
        self._streaks[key] = [count, since]
        return count, since

    def _silent(self, rule: str, block: str, step: int) -> bool:
        return step < self._silent_until.get(f"{rule}|{block}", -1)

    def _growth(self, block: str, quantity: str, value: float, step: int) -> Alert | None:
        threshold = self.thresholds[quantity]
        points = self._add(f"{block}|{quantity}", step, math.log10(value))
        if threshold == 0:
            return None
        change = self._change(points, step, since=self.warmup_steps)
        holds = change is not None and change[0] > threshold
        count, since = self._streak(f"growth|{block}|{quantity}", holds, step)
        if not holds or count < self._n_patience(points) or self._silent("growth", block, step):
            return None
        rise, then = change
        sure = "high" if rise > 1.5 * threshold else "medium"
        msg = (
            f"Instability risk in block '{block}' at step {step}: the {_GROWTH[quantity]} rose "
            f"{10**rise:.3g}x (10^{rise:.2f}) between step {then} and now ({10 ** points[-1][1]:.3g} now; medians "
            f"of {self._n_smooth(points)} evaluations), above the threshold of 10^{threshold:g} per "
            f"{self.window_steps} steps, continuously since step {since} ({count} evaluations). Confidence: {sure} "
            f"(no stable run of the instability suite rose this fast, docs/instability.md). {_FIX_GROWTH[quantity]}"
        )
        return Alert("growth", block, step, float(10**rise), float(10**threshold), msg)

    def _saturation(self, block: str, value: float, step: int, head: str = "") -> Alert | None:
        points = self._add(f"{block}|saturation", step, math.log10(max(value, 1e-300)))
        if self.saturation_level == 0:
            return None
        n = max(self._n_smooth(points), round(self.saturation_steps / self._cadence(points)))
        # the geometric mean, each evaluation floored at _SATURATION_FLOOR: a head flickers between one-hot and
        # soft batches, so depth and frequency both count, but one one-hot evaluation among soft ones cannot fire
        level = None
        if len(points) >= n:
            level = sum(max(p[1], _SATURATION_FLOOR) for p in points[-n:]) / n
        holds = level is not None and level < math.log10(self.saturation_level)
        count, since = self._streak(f"attn_saturation|{block}|saturation", holds, step)
        if not holds or count < self._n_patience(points) or self._silent("attn_saturation", block, step):
            return None
        sure = "high" if level < math.log10(self.saturation_level) - 2 else "medium"
        msg = (
            f"Attention saturation in block '{block}' at step {step}: in head {head or '?'} every query attends "
            f"(almost) one-hot; its softmax-Jacobian norm max_i lambda_max(diag a_i - a_i a_i^T) is "
            f"{10**level if level > -300 else 0:.2g} "
            f"(geometric mean of the last {n} evaluations; healthy heads: about 0.5), below "
            f"saturation_level={self.saturation_level:g}, since step {since} ({count} evaluations). Attention "
            f"logits are growing without bound; in the instability suite this preceded every divergence of a "
            f"high-learning-rate run by 50-100 steps. Confidence: {sure}. {_FIX_GROWTH['logit']}"
        )
        return Alert("attn_saturation", block, step, float(10**level), self.saturation_level, msg)

    def _layernorm(self, block: str, ratio: float, step: int) -> list[Alert]:
        fired: list[Alert] = []
        points = self._add(f"{block}|ln_ratio", step, math.log10(max(ratio, 1e-300)))
        below = self.collapse_ratio > 0 and ratio < self.collapse_ratio
        count, since = self._streak(f"ln_collapse|{block}|ln_ratio", below, step)
        if below and count >= self.collapse_patience and not self._silent("ln_collapse", block, step):
            msg = (
                f"LayerNorm variance collapse in block '{block}' at step {step}: the smallest input row variance "
                f"is {ratio:.3g} x eps, below collapse_ratio={self.collapse_ratio:g} x eps since step {since} "
                f"({count} evaluations). Confidence: high (a direct measurement; the LayerNorm's Jacobian grows "
                f"like 1/sqrt(var + eps) and its gradients with it). {_FIX_COLLAPSE}"
            )
            fired.append(Alert("ln_collapse", block, step, float(ratio), self.collapse_ratio, msg))
        if self.variance_drop_decades == 0:
            return fired
        change = self._change(points, step)
        dropping = change is not None and -change[0] > self.variance_drop_decades and ratio < self.variance_drop_ceiling
        count, since = self._streak(f"ln_variance_drop|{block}|ln_ratio", dropping, step)
        silent = self._silent("ln_variance_drop", block, step) or self._silent("ln_collapse", block, step)
        if dropping and count >= self._n_patience(points) and not silent and not fired:
            drop, then = -change[0], change[1]
            msg = (
                f"LayerNorm variance falling in block '{block}' at step {step}: var_min / eps fell "
                f"{10**drop:.3g}x since step {then} to {ratio:.3g} (threshold: 10^{self.variance_drop_decades:g} "
                f"per {self.window_steps} steps below {self.variance_drop_ceiling:g} x eps), continuously since "
                f"step {since}; at this pace it reaches collapse_ratio={self.collapse_ratio:g} soon. Confidence: "
                f"medium (a trend, not yet a collapse). {_FIX_COLLAPSE}"
            )
            fired.append(Alert("ln_variance_drop", block, step, float(ratio), self.variance_drop_ceiling, msg))
        return fired

    # -- public API --------------------------------------------------------------------------------

    def update(self, step: int, metrics: Mapping[str, float], full: bool) -> list[Alert]:
        """Feed one evaluation; return the alerts that fire now.

        Args:
            step: Optimizer step of the evaluation.
            metrics: The un-prefixed keys the monitor logged for it (``"layer0/attn/term/x_norm"``, ...).
            full: Whether it was a full evaluation (``False``: terms-only). The rules read only keys both kinds
                log, so both count alike.

        Returns:
            The fired alerts, blocks in the order of ``metrics``.
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"Invalid step={step!r}. Must be an int (the optimizer step).")
        fired: list[Alert] = []
        for (block, quantity), value in block_quantities(metrics).items():
            if quantity == "ln_ratio":
                new = self._layernorm(block, value, step)
            elif quantity == "saturation":
                new = [a for a in (self._saturation(block, value, step, _argmin_head(metrics, block)),) if a]
            else:
                new = [a for a in (self._growth(block, quantity, value, step),) if a is not None]
            for alert in new:
                self._silent_until[f"{alert.kind}|{block}"] = step + self.cooldown_steps + 1
            fired.extend(new)
        self.fired += len(fired)
        if self.max_history:
            self.history = (self.history + fired)[-self.max_history :]
        return fired

    def state_dict(self) -> dict[str, Any]:
        """Windows, streaks, cooldowns and fired alerts as plain Python numbers and strings."""
        return {
            "points": {k: [list(p) for p in v] for k, v in self._points.items()},
            "streaks": {k: list(v) for k, v in self._streaks.items()},
            "silent_until": dict(self._silent_until),
            "history": [asdict(a) for a in self.history],
            "fired": self.fired,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self._points = {k: [[float(s), float(v)] for s, v in pts] for k, pts in state.get("points", {}).items()}
        self._streaks = {k: [int(v[0]), int(v[1])] for k, v in state.get("streaks", {}).items()}
        self._silent_until = {k: int(v) for k, v in state.get("silent_until", {}).items()}
        self.history = [Alert(**a) for a in state.get("history", [])]
        self.fired = int(state.get("fired", len(self.history)))
