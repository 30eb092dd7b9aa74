"""One suite run: train a small byte-level LM with the monitor attached and return its traces as plain data.

A run records, for every optimizer step ``s`` (the forward and backward that precede the update of step ``s``):
the cross-entropy ``loss``, the gradient norm before clipping ``grad_norm``, the largest attention logit
``max_attn_logit`` (:class:`~benchmarks.instability.models.MaxLogitProbe`), the mean log-partition function of
the output ``lse`` and the largest output logit ``max_out_logit`` (output-logit divergence), the learning rate,
the step's wall time, and every number the :class:`~curvwatch.CurvatureMonitor` logged at that step (terms-only
evaluations every ``terms_every`` steps, full ones every ``full_every`` steps, ``max_overhead=None``), kept by
:class:`MemoryLogger`. The monitor runs with ``warn=False``; the alerts its rules
(:class:`~curvwatch.rules.RuleSet`) fired are recorded too (``live_alerts``), as a check of the offline replay.

A run stops ``stop_after`` steps after its loss onset (:func:`benchmarks.instability.analysis.onset_step`) or
after its first non-finite loss: nothing after the onset enters the scores.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from benchmarks.instability.analysis import onset_step
from benchmarks.instability.corpus import VOCAB_SIZE, WindowBatches, load_corpus
from benchmarks.instability.models import MaxLogitProbe, ModelSpec, build_model
from benchmarks.loggers import MemoryLogger
from curvwatch import Cadence, CurvatureMonitor, Evaluation, Warnings

PREFIX = "curv/"
# keys the traces leave out: one per norm and per head of every bound family, never read by a rule or a plot
_DROPPED = ("bound/outer/", "bound/functional/", "residual/", "lanczos/")


@dataclass(frozen=True)
class RunConfig:
    """Everything one run depends on.

    Args:
        model: The architecture and its sizes.
        steps: Optimizer steps (the run may stop earlier, after its onset).
        batch_size: Sequences per step.
        lr: Learning-rate knots ``((step, lr), ...)``: linear in between, constant after the last one.
        weight_decay: AdamW decay of the weight matrices.
        emb_weight_decay: Decay of the token and position embeddings (``None``: ``weight_decay``).
        emb_lr_mult: Learning-rate multiplier of the embeddings.
        betas: AdamW betas.
        z_loss: Coefficient of the z-loss ``mean(logsumexp(logits)^2)`` added to the cross-entropy (0: off).
        grad_clip: Gradient-norm clipping (0: off).
        seed: Seeds the weights and the batch order.
        full_every: Monitor cadence of full evaluations.
        terms_every: Monitor cadence of terms-only evaluations.
        terms_keys: What they compute (``CurvatureMonitor(terms_keys=...)``): the suite records ``"all"`` (its
            signal table reads terms no rule reads); the rules' own keys are the same numbers either way.
        max_tokens: Token positions the monitor keeps per block.
        stop_after: Steps recorded after the onset (or the first non-finite loss) before stopping.
    """

    model: ModelSpec = field(default_factory=ModelSpec)
    steps: int = 300
    batch_size: int = 16
    lr: tuple[tuple[int, float], ...] = ((0, 1e-3),)
    weight_decay: float = 0.1
    emb_weight_decay: float | None = None
    emb_lr_mult: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    z_loss: float = 0.0
    grad_clip: float = 0.0
    seed: int = 0
    full_every: int = 10
    terms_every: int | None = 1
    terms_keys: str = "all"
    max_tokens: int = 512
    stop_after: int = 25

    def lr_at(self, step: int) -> float:
        """The learning rate of ``step`` (piecewise linear through the knots)."""
        knots = self.lr
        if step <= knots[0][0]:
            return knots[0][1]
        for (s0, v0), (s1, v1) in zip(knots, knots[1:], strict=False):
            if step <= s1:
                return v0 + (v1 - v0) * (step - s0) / (s1 - s0)
        return knots[-1][1]


class SuiteLM(L.LightningModule):
    """The Lightning side of a run: cross-entropy (+ z-loss), AdamW with decay groups, per-step records."""

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = build_model(cfg.model)
        self.probe = MaxLogitProbe(self.model, cfg.model.arch)
        self.records: list[dict[str, float]] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)  # (B, L, V)
        ce = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))
        lse = logits.detach().logsumexp(-1)  # (B, L)
        loss = ce
        if self.cfg.z_loss:
            loss = ce + self.cfg.z_loss * logits.logsumexp(-1).pow(2).mean()
        self.records.append(
            {
                "step": self.global_step,
                "loss": float(ce.detach()),
                "lse": float(lse.mean()),
                "max_out_logit": float(logits.detach().abs().amax()),
                "max_attn_logit": self.probe.pop(),
                "lr": self.cfg.lr_at(self.global_step),
            }
        )
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self.records[-1]["grad_norm"] = float(norm)

    def configure_optimizers(self) -> dict[str, Any]:
        cfg = self.cfg
        groups: dict[str, list[torch.nn.Parameter]] = {"emb": [], "decay": [], "none": []}
        for name, p in self.model.named_parameters():
            if name.endswith(("_emb.weight", ".wte.weight")):  # token (and position) embeddings; litgpt: wte
                groups["emb"].append(p)
            else:
                groups["decay" if p.dim() >= 2 else "none"].append(p)
        emb_wd = cfg.weight_decay if cfg.emb_weight_decay is None else cfg.emb_weight_decay
        settings = {  # group -> (weight decay, learning-rate multiplier)
            "emb": (emb_wd, cfg.emb_lr_mult),
            "decay": (cfg.weight_decay, 1.0),
            "none": (0.0, 1.0),
        }
        names = [g for g in settings if groups[g]]
        optimizer = torch.optim.AdamW(
            [{"params": groups[g], "weight_decay": settings[g][0]} for g in names],
            lr=1.0,  # the schedule below returns the learning rate itself
            betas=cfg.betas,
        )
        factors = [lambda step, m=settings[g][1]: m * cfg.lr_at(step) for g in names]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class _StepClock(Callback):
    """Wall time of every training step (batch start to batch end, the monitor's work included)."""

    def __init__(self, module: SuiteLM, stop_after: int) -> None:
        self.module, self.stop_after = module, stop_after
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        records = self.module.records
        records[-1]["step_time_s"] = time.perf_counter() - self._t0
        losses = [r["loss"] for r in records]
        first_bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        onset = onset_step(losses)
        end = min(x for x in (first_bad, onset, math.inf) if x is not None)
        if len(losses) - 1 >= end + self.stop_after:
            trainer.should_stop = True


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def run(cfg: RunConfig, monitor: bool = True, callbacks: Sequence[Callback] = ()) -> dict[str, Any]:
    """Train one run and return its traces (JSON-ready: non-finite numbers are ``None``).

    Args:
        cfg: The run.
        monitor: Whether the :class:`~curvwatch.CurvatureMonitor` is attached (``False``: the same training
            without it, ``monitor`` and ``live_alerts`` empty; training does not depend on it).
        callbacks: Extra Lightning callbacks (recorders of other signals), run after the monitor's.

    Returns:
        ``{"config", "corpus", "steps", "series": {name: [per step]}, "monitor": [{"step", "full", "metrics"}],
        "live_alerts": [...], "wall_s"}``; ``monitor`` metrics have the ``curv/`` prefix removed.
    """
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    corpus = load_corpus()
    data = WindowBatches(corpus, cfg.steps, cfg.batch_size, cfg.model.seq_len, cfg.seed)
    module = SuiteLM(cfg)
    logger = MemoryLogger()
    curvature = CurvatureMonitor(
        log_level="all",  # the suite records every key (its replays and plots read them)
        every_n_train_steps=cfg.full_every,
        cadence=Cadence(max_overhead=None, terms_every_n_train_steps=cfg.terms_every),
        evaluation=Evaluation(terms_keys=cfg.terms_keys, max_tokens=cfg.max_tokens),
        log_key_prefix=PREFIX,
        # the rules run live, silently (their replay on the trace is checked against them)
        warning_rules=Warnings(rules="suite", warn=False),
        log_heatmap=False,
    )
    pl_log = logging.getLogger("lightning.pytorch")
    level = pl_log.level
    pl_log.setLevel(logging.ERROR)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's data-loader hints; the monitor's skipped NaN blocks
            trainer = L.Trainer(
                max_steps=cfg.steps,
                accelerator="cpu",
                devices=1,
                logger=[logger],
                callbacks=[*([curvature] if monitor else []), *callbacks, _StepClock(module, cfg.stop_after)],
                gradient_clip_val=cfg.grad_clip or None,
                log_every_n_steps=1,
                enable_checkpointing=False,
                enable_model_summary=False,
                enable_progress_bar=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
            )
            trainer.fit(module, DataLoader(data, batch_size=None, shuffle=False))
    finally:
        pl_log.setLevel(level)
        module.probe.remove()
    wall = time.perf_counter() - start

    records = module.records
    names = [k for k in records[0] if k != "step"]
    series = {name: [_finite(r.get(name, math.nan)) for r in records] for name in names}
    evaluations: dict[int, dict[str, float]] = {}
    for step, metrics in logger.calls:
        if not any(k.startswith(PREFIX) for k in metrics):
            continue
        kept = {
            k[len(PREFIX) :]: v
            for k, v in metrics.items()
            if k.startswith(PREFIX) and not any(d in k for d in _DROPPED)
        }
        evaluations.setdefault(step, {}).update(kept)
    monitor_rows = [
        {
            "step": step,
            "full": "summary/eval_time_s" in m,
            "metrics": {k: _finite(v) for k, v in sorted(m.items())},
        }
        for step, m in sorted(evaluations.items())
    ]
    return {
        "config": _plain(asdict(cfg)),
        "corpus": corpus.describe(),
        "steps": [int(r["step"]) for r in records],
        "series": series,
        "monitor": monitor_rows,
        "live_alerts": [
            {"kind": a.kind, "block": a.block, "step": a.step, "value": _finite(a.value)}
            for a in (curvature.alerts if monitor else [])
        ],
        "wall_s": wall,
    }


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj
