"""The monitor's real-loss plug: the logits module, the sampling, the optimizer rules and the keys' finish.

:class:`RealLoss` is all a monitor needs for the real-loss keys. It plugs in at two points of an evaluation:

1. **during the backward** of a captured step, :meth:`RealLoss.sample` draws the sampled output gradients from the
   loss (or from its gradient at the logits) and stores them in the capture (:mod:`curvwatch.realloss.sampling`),
   with the in-run check's true block sharpness when it is due (:mod:`curvwatch.realloss.verify`);
2. **around the engine's evaluation**, :meth:`RealLoss.preconditioners` hands the engine the Adam preconditioners of
   the blocks' optimizer (the kernels' ``precond_sharpness/...``), and :meth:`RealLoss.finish` turns the kernels' keys
   into the logged ones: scaled from the kept tokens to the whole batch, the stability ratios of the optimizer's
   thresholds (:mod:`curvwatch.realloss.stability`) and the in-run check's keys.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from curvwatch.adapters.updates import block_adapters
from curvwatch.alerts import Notices
from curvwatch.capture import Capture, CapturedBlock, monitor_passes
from curvwatch.closed_form.adapted import ADAPTER_PREFIX
from curvwatch.closed_form.solver.debiasing import SPREAD_LIMIT
from curvwatch.engine import Evaluation
from curvwatch.kinds import KINDS
from curvwatch.realloss.logits import backward_hooks_note, find_logits_module
from curvwatch.realloss.sampling import sample_outputs
from curvwatch.realloss.stability import (
    NO_STATE_YET,
    StabilityRule,
    adam_steps,
    param_index_map,
    stability_keys,
    stability_rule,
)
from curvwatch.realloss.verify import VERIFIED, true_sharpness
from curvwatch.realloss.weights import HIDDEN_SMOOTHING_NOTE, LossKind

__all__ = ["SAMPLED_PREFIXES", "RealLoss", "unresolved_keys"]

#: The kernels' real-loss keys, estimated on the evaluated tokens: :meth:`RealLoss.finish` scales them to the batch.
SAMPLED_PREFIXES = ("ggn/", "sharpness/", "precond_ggn/", "precond_sharpness/")


def unresolved_keys(flat: Mapping[tuple[str, str], float], limit: float = SPREAD_LIMIT) -> list[str]:
    """``"block pair[/head]"`` of every sharpness the kernels withheld as unresolved: a logged ``sharpness_spread``
    above ``limit`` whose ``sharpness`` key has no value (the estimate's uncertainty is larger than the value).

    Example:
        >>> unresolved_keys({("layer0/ffn", "sharpness_spread/W2W2"): 3.1, ("layer0/ffn", "sharpness/W1W1"): 0.2,
        ...                  ("layer0/ffn", "sharpness_spread/W1W1"): 0.05}, limit=0.5)
        ['layer0/ffn W2W2']
    """
    out = []
    for (block, key), value in flat.items():
        if key.startswith("sharpness_spread/") and value > limit:
            name = key[len("sharpness_spread/") :]
            if (block, f"sharpness/{name}") not in flat:
                out.append(f"{block} {name}")
    return out


class RealLoss:
    """What a monitor needs for the real-loss keys: the logits module, the sampling, the optimizer rules, the finish.

    Trainer-free: :class:`~curvwatch.Monitor` resolves it when it attaches to a model (:meth:`resolve`), samples during
    the backward of a captured step (:meth:`sample`), asks for the preconditioners before evaluating
    (:meth:`preconditioners`) and finishes the evaluation's keys (:meth:`finish`).

    Args:
        enabled: ``True`` (an error in :meth:`resolve` if it cannot work, and in :meth:`not_sampled`), ``False``, or
            ``"auto"`` (on when a
            logits module is found and the strategy can run the sampled passes: not FSDP1; the set-up table says
            which).
        samples: Sampled output gradients per evaluation (one backward pass from the logits each).
        loss: ``"auto"``, ``"cross_entropy"``, ``"mse"`` or a soft-target reduction
            (:func:`~curvwatch.realloss.weights.loss_weights`).
        logits_module: Dotted name of the module whose output is the logits, or ``None``
            (:data:`~curvwatch.realloss.logits.LOGITS_NAMES`).
        seed: Seed of the sampled labels (the evaluation at step ``s`` uses ``seed + s``).
        notices: Where the one-time notices go (the monitor's; default: a notices record of its own).
        memory_mb: Most memory one batched sampled backward pass may take, in MiB (default
            :data:`~curvwatch.realloss.sampling.BATCH_MEMORY_MB`; :func:`~curvwatch.realloss.sampling.passes_at_once`).

    Raises:
        ValueError: If an argument is invalid.
    """

    def __init__(
        self,
        enabled: bool | str = "auto",
        samples: int = 16,
        loss: str | LossKind = "auto",
        logits_module: str | None = None,
        seed: int = 0,
        notices: Notices | None = None,
        memory_mb: float | None = None,
    ) -> None:
        if enabled not in (True, False, "auto"):
            raise ValueError(f"Invalid sharpness={enabled!r}. Must be True, False or 'auto'.")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 2:
            raise ValueError(
                f"Invalid samples={samples!r}. Must be an int >= 2 (default 16): the uncertainty of the estimate "
                "(sharpness_spread) compares two halves of the samples."
            )
        try:
            self.loss = LossKind(loss)
        except ValueError:
            raise ValueError(f"Invalid loss={loss!r}. Must be one of {[k.value for k in LossKind]}.") from None
        if logits_module is not None and not isinstance(logits_module, str):
            raise ValueError(f"Invalid logits_module={logits_module!r}. Must be a module name such as 'lm_head'.")
        self.enabled, self.samples, self.logits_name, self.seed = enabled, samples, logits_module, int(seed)
        self.notices = Notices() if notices is None else notices
        self.module: nn.Module | None = None  # set by resolve when on
        self.logits_path = ""  # its dotted name
        self.hooks_note: str | None = None  # set by resolve: backward hooks the sampled passes run through
        self.memory_mb = memory_mb
        self.unbatched: str | None = None  # why a batched sampled pass failed: the passes run one at a time since
        self.status = "off"
        self._maps: dict[str, dict[str, tuple[list[Tensor], Tensor]] | str] = {}
        self._refused: dict[str, dict[str, str]] = {}  # block -> its adapters without a ratio, and why
        self._rules: dict[str, StabilityRule] = {}  # the open evaluation's (preconditioners -> finish)
        self.verified: dict[str, dict[str, float]] = {}  # the last sample's true block sharpness (verify)

    # -- set-up ---------------------------------------------------------------------------------------

    def resolve(self, model: nn.Module, unsupported: str | None = None) -> str:
        """Find the logits module; returns the status line of the set-up table (``"on: ..."`` / ``"off: ..."``).

        Args:
            model: The model.
            unsupported: Why the training's set-up cannot run the sampled backward passes (FSDP1:
                :func:`curvwatch.sharding.real_loss_support`), else ``None`` (single device, DDP, FSDP2).

        Raises:
            ValueError: With ``enabled=True``, if it cannot work (no logits module, ``unsupported``).
        """
        self.module = None
        self.hooks_note = None  # a previous fit's model may have had hooks
        self._maps = {}  # maps of weights to parameters, by block name: a new model (or fit) has its own
        self._refused = {}
        if self.enabled is False:
            self.status = "off (sharpness=False)"
            return self.status
        if unsupported:
            if self.enabled is True:
                raise ValueError(f"sharpness=True is not supported under {unsupported}. Pass sharpness=False.")
            self.status = f"off: {unsupported}"
            return self.status
        try:
            name, self.module = find_logits_module(model, self.logits_name)
            self.logits_path = name
        except ValueError as err:
            if self.enabled is True or self.logits_name is not None:
                raise
            self.status = f"off: {err}"
            return self.status
        self.status = (
            f"on: logits from '{name}', {self.samples} samples, loss {self.loss.value}; stability/... and "
            "stability/max under Adam/AdamW from the optimizer's first step on (none at step 0: no second moments yet)"
        )
        self.hooks_note = backward_hooks_note(model)
        if self.hooks_note:
            self.status += f"; {self.hooks_note}"
        return self.status

    # -- point 1: during the backward ----------------------------------------------------------------

    def sample(
        self,
        capture: Capture,
        loss: Tensor | None,
        factor: float,
        step: int,
        *,
        verify: bool = False,
        grad_logits: Tensor | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        """Sampled output gradients into ``capture`` (:func:`~curvwatch.realloss.sampling.sample_outputs`), from the
        ``loss`` before its backward or from ``grad_logits``, its gradient at the logits, during it; with ``verify``
        also the true block sharpness (:func:`~curvwatch.realloss.verify.true_sharpness`, kept for :meth:`finish`).
        What it cannot do is said once as a notice, never raised.

        The labels are drawn from a generator seeded with ``seed + step``: every rank, and every strategy (DDP,
        FSDP2), draws the same random numbers at a step. ``agree`` (several ranks): see
        :func:`~curvwatch.realloss.sampling.sample_outputs`. The passes run batched off a CPU
        (:func:`~curvwatch.realloss.sampling.passes_at_once`) unless the model has backward hooks of its own or a
        batched pass once failed (said once; the same numbers either way).
        """
        self.verified = {}
        fallback = (loss if grad_logits is None else grad_logits).device
        z_device = next((p.device for p in self.module.parameters()), fallback) if self.module else fallback
        generator = torch.Generator(device=z_device).manual_seed(self.seed + int(step))
        try:
            sampled = sample_outputs(
                capture, loss, self.samples, kind=self.loss, factor=factor, generator=generator,
                grad_logits=grad_logits, agree=agree, memory_mb=self.memory_mb,
                batched=None if self.hooks_note is None and self.unbatched is None else False,
            )  # fmt: skip
        except Exception as err:
            capture.release()
            self.notices.once(
                "sharpness_failed",
                f"CurvatureMonitor leaves the real-loss keys (sharpness/..., stability/...) out at step {step}: "
                f"sampling the output gradients raised {type(err).__name__}: {err}",
            )
            return
        if sampled.unbatched is not None:  # the same numbers, one pass at a time from now on
            self.unbatched = sampled.unbatched
            self.notices.info(
                "sharpness_unbatched",
                "CurvatureMonitor runs the sampled backward passes of the real-loss keys one at a time: a batched "
                f"pass raised {sampled.unbatched}",
            )
        if sampled.note:  # once per kind of note (the first words tell them apart)
            key = f"sharpness_note:{sampled.note[:24]}"
            text = f"CurvatureMonitor (real-loss sharpness): {sampled.note}."
            if sampled.note.startswith(HIDDEN_SMOOTHING_NOTE[:24]):  # expected near initialisation: said, not warned
                self.notices.info(key, text)
            else:
                self.notices.once(key, text)
        if sampled.unsampled:
            self.notices.once(
                "sharpness_unsampled",
                f"CurvatureMonitor has no real-loss keys for {', '.join(sampled.unsampled)}: their outputs were not "
                "in the forward graph when the loss was ready (reentrant activation checkpointing runs the forward "
                "under no_grad: use torch.utils.checkpoint(..., use_reentrant=False)), or do not reach the logits.",
            )
        if verify and sampled.blocks and loss is not None:
            self._verify(capture, loss, factor, sampled.unsampled)

    def not_sampled(self, capture: Capture, step: int) -> None:
        """Say why a full evaluation has no real-loss keys when no sampling happened during its step (the logits
        module gave no logits, or no gradient reached them); with ``enabled=True`` (required), raise instead.

        Raises:
            ValueError: With ``enabled=True``.
        """
        why = (
            "produced no output with gradient tracking on this step"
            if capture.logits is None and capture.logits_input is None
            else "received no gradient in the backward of this step"
        )
        message = (
            f"CurvatureMonitor has no real-loss keys (sharpness/..., stability/...) at step {step}: the logits module "
            f"'{self.logits_path}' {why}. Pass sharpness=curvwatch.Sharpness(logits_module='<name>') for the module "
            "whose output the loss reads, or sharpness=False."
        )
        if self.enabled is True:
            raise ValueError(self.notices.named("sharpness=True: " + message))
        self.notices.once("sharpness_not_sampled", message)

    def _verify(self, capture: Capture, loss: Tensor, factor: float, unsampled: list[str]) -> None:
        """The in-run check's true block sharpness of the sampled blocks, kept for :meth:`finish`."""
        maps = {}
        for spec in capture.specs:
            found = self.map_of(spec) if spec.name not in unsampled else "-"
            if spec.kind in VERIFIED and not isinstance(found, str):
                maps[spec.name] = (spec, found)
        try:
            with monitor_passes():  # no capture reads them (gradients, backward passes)
                self.verified = true_sharpness(loss, maps, factor)
        except RuntimeError as err:
            self.notices.once(
                "verify_failed",
                "CurvatureMonitor cannot check the sharpness against the true block Hessian (verify_every_n_evals): "
                f"its Hessian-vector products need double backward, which this model's graph lacks ({err}). Use an "
                "attention without fused kernels for the check (e.g. attn_implementation='eager').",
            )

    # -- point 2: around the evaluation --------------------------------------------------------------

    def preconditioners(self, optimizer: Any, blocks: Iterable[CapturedBlock]) -> dict[str, dict[str, Tensor]]:
        """``{block: {weight: P}}``: the Adam preconditioners of the captured blocks with samples, for the engine's
        ``precondition`` (none for SGD; an adapter's, ``"lora/<name>"``, where the block captured it). The optimizer's
        rule of each block is kept for :meth:`finish`; the reasons for none are said once (Adam before its first step
        is expected and not said)."""
        self._rules = {}
        sampled = [b for b in blocks if "output_samples" in b.inputs]
        if optimizer is None or not sampled:
            return {}
        self._rules, why = self.rules(optimizer, [b.spec for b in sampled])
        for name, reason in why.items():
            if reason != NO_STATE_YET:
                self.notices.once(
                    f"stability:{reason}",
                    f"CurvatureMonitor logs no stability/... ratio for '{name}' (nor for other blocks with the same "
                    f"reason): {reason}.",
                )
        captured = {b.spec.name: b.params.get("adapters") or {} for b in sampled}
        out = {}
        for name, rule in self._rules.items():
            held = captured.get(name, {})
            pre = {w: P for w, P in (rule.precondition or {}).items()
                   if not w.startswith(ADAPTER_PREFIX) or w[len(ADAPTER_PREFIX) :] in held}  # fmt: skip
            if pre:
                out[name] = pre
        return out

    def finish(self, evaluation: Evaluation) -> None:
        """The evaluation's real-loss keys as logged, in place: the kernels' keys of the evaluated tokens scaled to
        the whole batch (``Evaluation.sample_scales``), the stability ratios of the rules :meth:`preconditioners`
        found, and the in-run check's ``verify/...`` keys of the last :meth:`sample`."""
        rules, self._rules = self._rules, {}
        for block, scale in evaluation.sample_scales.items():
            result = evaluation.results.get(block)
            if result is None:
                continue
            if scale != 1.0:  # the kept tokens' real-loss curvature, scaled to the whole batch's
                for key, value in result.items():
                    if key.startswith(SAMPLED_PREFIXES):
                        result[key] = value * scale
            rule = rules.get(block)
            if rule is not None:
                result.update(stability_keys(result, rule))
        self._add_verified(evaluation.results)

    def _add_verified(self, results: dict[str, dict[str, Any]]) -> None:
        """``verify/hessian/XX[/h0]`` and ``verify/ratio/XX[/h0]`` (true / sharpness) of the last :meth:`sample`
        into an evaluation's results (then forgotten)."""
        verified, self.verified = self.verified, {}
        for block, found in verified.items():
            result = results.get(block)
            for key, value in found.items() if result else ():
                pair = key.rsplit("/", 1)[-1]
                suffix = next((s for s in ("/h0", "/g0", "") if f"sharpness/{pair}{s}" in result), None)
                if suffix is not None:
                    sharp = float(result[f"sharpness/{pair}{suffix}"])
                    result[f"{key}{suffix}"] = value
                    if sharp != 0 and not math.isnan(sharp):  # (NaN: an unresolved sharpness, no value)
                        result[f"verify/ratio/{pair}{suffix}"] = value / sharp

    def note_unresolved(self, flat: Mapping[tuple[str, str], float]) -> None:
        """Name once the sharpness keys an evaluation withheld as unresolved (:func:`unresolved_keys`), with the fix."""
        found = unresolved_keys(flat)
        if not found:
            return
        more = f" and {len(found) - 4} more" if len(found) > 4 else ""
        self.notices.once(
            "sharpness_unresolved",
            f"CurvatureMonitor gives no sharpness/... (nor its stability/... ratio) for {', '.join(found[:4])}{more}: "
            f"the estimate's uncertainty (sharpness_spread, still logged) is above {SPREAD_LIMIT:.0%} of it: the "
            "value is not known to within its own size. The Monte-Carlo Gauss-Newton estimate has (samples x kept "
            f"sequences) independent columns, too few for blocks this large; more samples "
            f"(Sharpness(samples={4 * self.samples}): 4x the sampling's cost) or more kept sequences (max_tokens=, "
            "shorter sequences) narrow it; with one long kept sequence an FFN's W2 may stay unresolved even so. "
            "Said once; the set can change from one evaluation to the next.",
        )

    # -- the optimizer's rules -----------------------------------------------------------------------

    def map_of(self, spec: Any) -> dict[str, tuple[list[Tensor], Tensor]] | str:
        """:func:`~curvwatch.realloss.stability.param_index_map` of ``spec`` with its low-rank adapters
        (:func:`~curvwatch.adapters.updates.block_adapters`), computed once; the reason as a string when it cannot be
        mapped (DoRA, an adapter computing with its weights)."""
        if spec.name not in self._maps:
            try:
                weights = KINDS[spec.kind].adapted
                sites, self._refused[spec.name] = block_adapters(spec, weights) if weights else ({}, {})
                self._maps[spec.name] = param_index_map(spec, adapters=sites)
            except Exception as err:  # an adapter computing with its weights: no ratio, named
                self._maps[spec.name] = str(err)
        return self._maps[spec.name]

    def rules(self, optimizer: Any, specs: Iterable[Any]) -> tuple[dict[str, StabilityRule], dict[str, str]]:
        """``({block: rule}, {block: why none})`` for the blocks of kinds with sampled keys.

        The maps from weights to parameters (:func:`~curvwatch.realloss.stability.param_index_map`) are computed once
        per block. A block with low-rank adapters gets the rule of their parameters (the optimizer steps them, not the
        block's weights): ``stability/lora/<name>`` only; an adapter its kernel does not take (on ``W_O``) is named
        with its reason (``{block}/lora/<name>``).
        """
        rules, why = {}, {}
        found_of = {spec.name: self.map_of(spec) for spec in specs if KINDS[spec.kind].sampled}
        # Adam's step counts of every block's weights in one host read (per optimizer)
        lists = [ps for found in found_of.values() if not isinstance(found, str) for ps, _ in found.values()]
        opts = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        steps: dict[int, float] = {}
        for opt in opts:
            if isinstance(getattr(opt, "optimizer", opt), (torch.optim.Adam, torch.optim.AdamW)):
                steps.update(adam_steps(opt, lists))  # (a parameter has state in one optimizer only)
        for name, found in found_of.items():
            if isinstance(found, str):
                why[name] = found
                continue
            why.update((f"{name}/{ADAPTER_PREFIX}{a}", reason) for a, reason in self._refused.get(name, {}).items())
            lora = {w: entry for w, entry in found.items() if w.startswith(ADAPTER_PREFIX)}
            rule, reason = stability_rule(optimizer, lora or found, steps=steps if steps else None)
            if rule is None:
                why[name] = reason
            else:
                rules[name] = dataclasses.replace(rule, adapters=True) if lora else rule
        return rules, why
