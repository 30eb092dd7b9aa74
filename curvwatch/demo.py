"""End-to-end demo: train a small GPT on n-digit addition with a CurvatureMonitor, then summarise and plot.

Run ``python -m curvwatch.demo`` (or ``curvwatch-demo``). It takes about two to three minutes on two CPU
cores, needs no download and no W&B account (the W&B run is offline unless ``WANDB_API_KEY`` is set), and
writes everything under ``--out-dir``::

    <out-dir>/csv/metrics.csv          every logged metric, one row per logging step
    <out-dir>/csv/hparams.yaml
    <out-dir>/wandb/                   the W&B run (offline: upload later with `wandb sync`)
    <out-dir>/plots/block_norms.png    per-block Hessian norms over training (when the monitor ran)
    <out-dir>/plots/loss.png           train/val loss and validation accuracy
    <out-dir>/summary.json             the numbers printed at the end

``--unstable`` trains a post-LN model at a high learning rate without warmup or clipping, a recipe that
makes the loss spike and the model collapse within the run, so the curvature can be watched as it happens.
``--quick`` is a seconds-long smoke run used by the tests.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import Tensor

from curvwatch.data import (
    IGNORE_INDEX,
    VOCAB_SIZE,
    AdditionDataModule,
    answer_accuracy,
    decode,
    encode,
    parse_sample,
    prompt_length,
    sequence_length,
)
from curvwatch.models.gpt import GPT, GPTConfig

# Only columns whose name starts with this prefix and contains HESSIAN_MARKER are drawn as block norms.
CURV_PREFIX = "curv/"
HESSIAN_MARKER = "/hessian/"


class GPTLitModule(L.LightningModule):
    """A :class:`~curvwatch.models.gpt.GPT` trained with AdamW and a warmup + cosine learning-rate schedule.

    The loss is the cross-entropy over answer tokens (targets equal to ``IGNORE_INDEX`` are skipped).

    Logged metrics:
        ``train/loss``, ``train/lr`` every step; ``val/loss`` and ``val/acc`` (exact-match answer accuracy,
        see :func:`curvwatch.data.answer_accuracy`) per validation run.

    Args:
        config: The model's :class:`GPTConfig` or its ``asdict`` form (what checkpoints store).
        lr: Peak learning rate.
        weight_decay: AdamW weight decay on matrices (biases, LayerNorm parameters are not decayed).
        betas: AdamW betas.
        warmup_steps: Linear warmup from ``lr / warmup_steps`` to ``lr``; 0 starts at the peak.
        max_steps: Length of the schedule; the cosine decays to ``min_lr_ratio * lr`` at this step.
        min_lr_ratio: Final learning rate as a fraction of the peak.

    Example:
        >>> module = GPTLitModule(GPTConfig(vocab_size=12, block_size=8, d_model=16), max_steps=10)
        >>> module(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 12])
    """

    def __init__(
        self,
        config: GPTConfig | dict[str, Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.98),
        warmup_steps: int = 100,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if isinstance(config, GPTConfig):
            config = asdict(config)  # hyperparameters must be plain data to be saved
        betas = tuple(betas)  # type: ignore[assignment]
        if lr <= 0:
            raise ValueError(f"Invalid lr={lr}. Must be > 0.")
        if warmup_steps < 0 or max_steps < 1:
            raise ValueError(
                f"Invalid warmup_steps={warmup_steps}, max_steps={max_steps}. "
                "Need warmup_steps >= 0 and max_steps >= 1."
            )
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(**config))

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        input_ids, targets = batch
        loss = self._loss(self(input_ids), targets)
        self.log("train/loss", loss, prog_bar=True, batch_size=input_ids.shape[0])
        self.log("train/lr", self.optimizers().param_groups[0]["lr"], batch_size=input_ids.shape[0])
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        input_ids, targets = batch
        logits = self(input_ids)
        B = input_ids.shape[0]
        self.log("val/loss", self._loss(logits, targets), prog_bar=True, batch_size=B)
        self.log("val/acc", answer_accuracy(logits, targets), prog_bar=True, batch_size=B)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=hp.betas,
        )

        def lr_factor(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@torch.no_grad()
def greedy_answer(model: GPT, a: int, b: int, n_digits: int) -> int:
    """Let ``model`` write the sum of ``a + b`` token by token (greedy) and read it back as an integer.

    Example:
        >>> model = GPT(GPTConfig(vocab_size=12, block_size=8, d_model=16))
        >>> isinstance(greedy_answer(model, 12, 34, 2), int)
        True
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([encode(f"{a:0{n_digits}d}+{b:0{n_digits}d}=")], device=device)  # (1, 2n + 2)
    for _ in range(n_digits + 1):
        next_id = model(idx)[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
        idx = torch.cat([idx, next_id], dim=1)
    model.train(was_training)
    text = decode(idx[0])
    answer = text[prompt_length(n_digits) :]
    if not answer.isdigit():  # the model wrote '+' or '='
        return -1
    return parse_sample(text)[2]


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------

# Settings of each preset; command-line flags given explicitly override them.
_DEFAULTS: dict[str, Any] = {
    "n_digits": 3,
    "n_layer": 2,
    "n_head": 4,
    "d_model": 64,
    "norm": "pre",
    "batch_size": 64,
    "n_train": 100_000,
    "n_val": 1_000,
    "steps": 2000,
    "lr": 5e-3,
    "warmup_steps": 100,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "every_n_steps": 50,
    # the exact quantities (bound terms, LayerNorm statistics, exact norms) in between: no Lanczos, cheap
    "terms_every_n_steps": 10,
    "spike_warmup": 3,
    "max_tokens": None,  # the monitor's default
    "val_every": 250,
    "threads": 1,
}
# The unstable recipe blows up within the first few steps, so it is watched at every step, and the spike
# detector takes its baseline from the first evaluation alone (spike_warmup=1).
_UNSTABLE: dict[str, Any] = {
    "norm": "post",
    "lr": 5e-2,
    "warmup_steps": 0,
    "grad_clip": 0.0,
    "steps": 300,
    "every_n_steps": 1,
    "spike_warmup": 1,
}
_QUICK: dict[str, Any] = {
    "n_digits": 2,
    "n_head": 2,
    "d_model": 32,
    "batch_size": 32,
    "n_train": 1_024,
    "n_val": 128,
    "steps": 30,
    "warmup_steps": 5,
    "every_n_steps": 10,
    "terms_every_n_steps": 5,
    "max_tokens": 64,
    "val_every": 15,
}


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser (flags left at ``None`` take the preset's value)."""
    p = argparse.ArgumentParser(
        prog="python -m curvwatch.demo",
        description="Train a small GPT on n-digit addition while curvwatch logs per-block Hessian norms.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    preset = p.add_argument_group("presets")
    preset.add_argument(
        "--unstable",
        action="store_true",
        help=f"post-LN, lr {_UNSTABLE['lr']}, no warmup, no clipping: the loss blows up during the run",
    )
    preset.add_argument(
        "--quick", action="store_true", help="a tiny run of a few seconds (used by the tests)"
    )
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=None, help=f"optimizer steps [{_DEFAULTS['steps']}]")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--out-dir", type=Path, default=None, help="output folder [./curvwatch_runs/<timestamp>]"
    )
    run.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch; 0 keeps torch's default. One is fastest for this tiny model on a busy "
        f"machine [{_DEFAULTS['threads']}]",
    )
    run.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu, gpu, auto, ...")
    run.add_argument(
        "--wandb",
        choices=["offline", "online", "disabled"],
        default=None,
        help="W&B mode [online if WANDB_API_KEY is set, else offline]",
    )
    mon = p.add_argument_group("curvature monitor")
    mon.add_argument("--no-monitor", action="store_true", help="train without the CurvatureMonitor")
    mon.add_argument(
        "--every-n-steps", type=int, default=None, help=f"monitor period [{_DEFAULTS['every_n_steps']}]"
    )
    mon.add_argument(
        "--terms-every-n-steps",
        type=int,
        default=None,
        help="also log the quantities that need no Lanczos (bound terms, LayerNorm statistics, exact norms) "
        f"every N steps; 0 disables [{_DEFAULTS['terms_every_n_steps']}]",
    )
    mon.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per monitored step [the monitor's default]"
    )
    model = p.add_argument_group("task and model")
    model.add_argument("--n-digits", type=int, default=None, help=f"[{_DEFAULTS['n_digits']}]")
    model.add_argument("--n-layer", type=int, default=None, help=f"[{_DEFAULTS['n_layer']}]")
    model.add_argument("--n-head", type=int, default=None, help=f"[{_DEFAULTS['n_head']}]")
    model.add_argument("--d-model", type=int, default=None, help=f"[{_DEFAULTS['d_model']}]")
    model.add_argument("--norm", choices=["pre", "post"], default=None, help=f"[{_DEFAULTS['norm']}]")
    opt = p.add_argument_group("optimization")
    opt.add_argument("--batch-size", type=int, default=None, help=f"[{_DEFAULTS['batch_size']}]")
    opt.add_argument("--lr", type=float, default=None, help=f"peak learning rate [{_DEFAULTS['lr']}]")
    opt.add_argument("--warmup-steps", type=int, default=None, help=f"[{_DEFAULTS['warmup_steps']}]")
    opt.add_argument("--grad-clip", type=float, default=None, help=f"0 disables [{_DEFAULTS['grad_clip']}]")
    opt.add_argument(
        "--val-every", type=int, default=None, help=f"validate every N steps [{_DEFAULTS['val_every']}]"
    )
    return p


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Merge defaults, presets (``--quick`` sizes, ``--unstable`` optimization) and explicit flags."""
    settings = dict(_DEFAULTS)
    if args.quick:
        settings.update(_QUICK)
    if args.unstable:
        settings.update(_UNSTABLE)
    for key in settings:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    for key in ("steps", "every_n_steps", "val_every", "batch_size", "n_digits", "max_tokens"):
        if settings[key] is not None and settings[key] < 1:
            raise ValueError(f"Invalid --{key.replace('_', '-')}={settings[key]}. Must be >= 1.")
    if settings["terms_every_n_steps"] < 0:
        raise ValueError(f"Invalid --terms-every-n-steps={settings['terms_every_n_steps']}. Must be >= 0 (0: off).")
    if settings["threads"] < 0:
        raise ValueError(f"Invalid --threads={settings['threads']}. Must be >= 0 (0 keeps torch's default).")
    settings["val_every"] = min(settings["val_every"], settings["steps"])
    return settings


def _wandb_mode(requested: str | None) -> str:
    if requested is not None:
        return requested
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------


def loss_blowup_step(
    steps: list[int], losses: list[float], window: int = 20, margin: float = 0.5, patience: int = 20
) -> int | None:
    """Onset of a loss divergence: the first step whose loss is not finite, or from which the trailing mean of the
    last ``window`` losses stays more than ``margin`` nats above its running minimum for ``patience`` steps.

    The rule of the instability suite (issue 14): a lasting excursion, not one noisy step (a healthy run near zero
    loss wiggles by a tenth of a nat, which the old single-step rule reported as a blow-up).

    Example:
        >>> loss_blowup_step(list(range(60)), [2.0] * 30 + [3.0] * 30, window=5, patience=5)
        32
        >>> loss_blowup_step(list(range(60)), [0.01, 0.2] * 30) is None
        True
        >>> loss_blowup_step([0, 1, 2], [2.0, float("nan"), 2.0])
        1
    """
    pairs = sorted(zip(steps, losses, strict=True))
    best, streak_start, streak = math.inf, None, 0
    for i, (step, loss) in enumerate(pairs):
        if not math.isfinite(loss):
            return step
        recent = [v for _, v in pairs[max(0, i - window + 1) : i + 1]]
        mean = sum(recent) / len(recent)
        if mean > best + margin:
            streak_start = step if streak == 0 else streak_start
            streak += 1
            if streak >= patience:
                return streak_start
        else:
            streak = 0
        best = min(best, mean)
    return None


def read_metrics(path: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Read a CSVLogger ``metrics.csv`` into ``{column: (steps, values)}``, skipping empty cells."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step", "")
            if step == "":
                continue
            for key, value in row.items():
                if key is None or key in ("step", "epoch") or value in ("", None) or isinstance(value, list):
                    continue
                try:
                    number = float(value)
                except ValueError:
                    continue
                steps, values = series.setdefault(key, ([], []))
                steps.append(int(float(step)))
                values.append(number)
    return series


def _positive(steps: list[int], values: list[float]) -> tuple[list[int], list[float]]:
    kept = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v) and v > 0]
    return [s for s, _ in kept], [v for _, v in kept]


def plot_block_norms(series: dict[str, tuple[list[int], list[float]]], path: Path) -> bool:
    """One panel per block, one line per ``curv/.../hessian/...`` column, log scale. False if none."""
    from matplotlib.figure import Figure

    panels: dict[str, list[str]] = defaultdict(list)
    for key in sorted(series):
        if key.startswith(CURV_PREFIX) and HESSIAN_MARKER in key:
            block = key[len(CURV_PREFIX) :].split(HESSIAN_MARKER)[0]
            panels[block].append(key)
    if not panels:
        return False
    n_cols = min(3, len(panels))
    n_rows = math.ceil(len(panels) / n_cols)
    fig = Figure(figsize=(5.5 * n_cols, 3.8 * n_rows))
    axes = fig.subplots(n_rows, n_cols, squeeze=False).reshape(-1)
    for ax, (block, keys) in zip(axes, panels.items(), strict=False):
        any_positive = False
        for key in keys:
            steps, values = _positive(*series[key])
            any_positive |= bool(values)
            label = key[len(CURV_PREFIX) + len(block) + 1 :]
            ax.plot(steps, values, marker=".", markersize=3, linewidth=1, label=label)
        if any_positive:
            ax.set_yscale("log")
        ax.set_title(block)
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6 if len(keys) > 8 else 8, ncol=1 + len(keys) // 12)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle("closed-form Hessian block norms")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def plot_loss(series: dict[str, tuple[list[int], list[float]]], path: Path) -> bool:
    """Train/val loss (log scale) and validation accuracy. False if no loss was logged."""
    from matplotlib.figure import Figure

    losses = {k: _positive(*series[k]) for k in ("train/loss", "val/loss") if k in series}
    if not any(values for _, values in losses.values()):
        return False
    fig = Figure(figsize=(10, 3.8))
    ax_loss, ax_acc = fig.subplots(1, 2)
    for key, (steps, values) in losses.items():
        ax_loss.plot(steps, values, label=key, marker="." if key.startswith("val") else None)
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_title("cross-entropy on answer tokens")
    ax_loss.legend()
    ax_loss.grid(True, which="both", alpha=0.3)
    if "val/acc" in series:
        ax_acc.plot(*series["val/acc"], marker=".", color="C2")
    ax_acc.set_ylim(-0.02, 1.02)
    ax_acc.set_xlabel("step")
    ax_acc.set_title("val exact-match accuracy")
    ax_acc.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


@dataclass
class DemoResult:
    """What a demo run produced."""

    out_dir: Path
    metrics_csv: Path
    train_seconds: float
    final_val_loss: float
    final_val_acc: float
    steps: int
    monitor_attached: bool
    monitor_summary: str | None = None
    plots: list[Path] = field(default_factory=list)
    wandb_dir: Path | None = None
    first_warning_step: int | None = None
    loss_blowup_step: int | None = None


def run(argv: list[str] | None = None) -> DemoResult:
    """Parse ``argv``, train, summarise and plot; see the module docstring. Returns what was produced."""
    args = build_parser().parse_args(None if argv is None else [str(a) for a in argv])
    s = resolve_settings(args)
    out_dir = args.out_dir or Path("curvwatch_runs") / datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    wandb_mode = _wandb_mode(args.wandb)
    os.environ["WANDB_MODE"] = wandb_mode

    threads = torch.get_num_threads()
    if s["threads"]:
        torch.set_num_threads(s["threads"])
    try:
        return _run(args, s, out_dir, wandb_mode)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, s: dict[str, Any], out_dir: Path, wandb_mode: str) -> DemoResult:
    L.seed_everything(args.seed, workers=True, verbose=False)
    data = AdditionDataModule(
        n_digits=s["n_digits"],
        n_train=s["n_train"],
        n_val=s["n_val"],
        batch_size=s["batch_size"],
        seed=args.seed,
    )
    config = GPTConfig(
        vocab_size=VOCAB_SIZE,
        block_size=sequence_length(s["n_digits"]),
        n_layer=s["n_layer"],
        n_head=s["n_head"],
        d_model=s["d_model"],
        norm=s["norm"],
    )
    module = GPTLitModule(
        config,
        lr=s["lr"],
        weight_decay=s["weight_decay"],
        warmup_steps=s["warmup_steps"],
        max_steps=s["steps"],
    )

    loggers: list[Logger] = [CSVLogger(save_dir=out_dir, name="csv", version="")]
    wandb_logger = None
    if wandb_mode != "disabled":
        try:
            from lightning.pytorch.loggers import WandbLogger

            wandb_logger = WandbLogger(
                project="curvwatch-demo",
                name=out_dir.name,
                save_dir=str(out_dir),
                config={**s, "seed": args.seed, "unstable": args.unstable, "quick": args.quick},
            )
            loggers.append(wandb_logger)
        except ModuleNotFoundError as err:  # wandb is an optional extra
            print(
                f"[curvwatch demo] W&B logging skipped ({err}); install with `pip install curvwatch[wandb]`."
            )

    callbacks: list[L.Callback] = []
    monitor = None
    if not args.no_monitor:
        try:
            from curvwatch import CurvatureMonitor
        except ImportError as err:
            print(f"[curvwatch demo] CurvatureMonitor unavailable ({err}); training without it.")
        else:
            kwargs = {} if s["max_tokens"] is None else {"max_tokens": s["max_tokens"]}
            monitor = CurvatureMonitor(
                every_n_train_steps=s["every_n_steps"],
                terms_every_n_train_steps=s["terms_every_n_steps"] or None,
                max_overhead=None,  # a fixed schedule: the demo favours dense plots over a 1% budget
                spike_warmup=s["spike_warmup"],
                **kwargs,
            )
            callbacks.append(monitor)

    trainer = L.Trainer(
        max_steps=s["steps"],
        accelerator=args.accelerator,
        devices=1,
        logger=loggers,
        callbacks=callbacks,
        val_check_interval=s["val_every"],
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=min(10, s["every_n_steps"]),
        gradient_clip_val=s["grad_clip"] or None,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=sys.stdout.isatty(),
        deterministic=True,
        default_root_dir=out_dir,
    )

    desc = (
        f"{s['n_digits']}-digit addition | GPT {s['n_layer']} layers, d_model {s['d_model']}, "
        f"{s['n_head']} heads, "
        f"{s['norm']}-LN, {module.model.num_parameters() / 1e3:.0f}k params | {s['steps']} steps, "
        f"batch {s['batch_size']}, lr {s['lr']:g}, warmup {s['warmup_steps']}"
    )
    print(f"[curvwatch demo] {desc}")
    print(f"[curvwatch demo] outputs -> {out_dir}")
    wandb_dir = None
    try:
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        train_seconds = time.perf_counter() - start
        final = trainer.validate(module, datamodule=data, verbose=False)[0]
    finally:
        if wandb_logger is not None:
            wandb_dir = Path(wandb_logger.experiment.dir).parent
            import wandb

            wandb.finish()

    metrics_csv = Path(loggers[0].experiment.metrics_file_path)
    result = DemoResult(
        out_dir=out_dir,
        metrics_csv=metrics_csv,
        train_seconds=train_seconds,
        final_val_loss=float(final["val/loss"]),
        final_val_acc=float(final["val/acc"]),
        steps=trainer.global_step,
        monitor_attached=monitor is not None,
        wandb_dir=wandb_dir,
    )
    if monitor is not None and callable(getattr(monitor, "summary_text", None)):
        result.monitor_summary = monitor.summary_text()
    if monitor is not None and getattr(monitor, "alerts", None):
        result.first_warning_step = min(a.step for a in monitor.alerts)

    loss_series = read_metrics(metrics_csv).get("train/loss")
    if loss_series is not None:
        result.loss_blowup_step = loss_blowup_step(*loss_series)
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("[curvwatch demo] plots skipped: matplotlib is not installed (`pip install curvwatch[plots]`).")
    else:
        series = read_metrics(metrics_csv)
        for name, plot in (("block_norms.png", plot_block_norms), ("loss.png", plot_loss)):
            if plot(series, out_dir / "plots" / name):
                result.plots.append(out_dir / "plots" / name)

    _print_summary(result, module.model, data, s["n_digits"], desc)
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}
    summary["plots"] = [str(p) for p in result.plots]
    summary["settings"] = {**s, "seed": args.seed, "unstable": args.unstable, "quick": args.quick}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return result


def _print_summary(
    result: DemoResult, model: GPT, data: AdditionDataModule, n_digits: int, desc: str
) -> None:
    lines = ["", "=" * 78, "curvwatch demo summary", "=" * 78, f"run:        {desc}"]
    lines.append(
        f"training:   {result.steps} steps in {result.train_seconds:.1f} s "
        f"({result.steps / max(result.train_seconds, 1e-9):.1f} steps/s)"
    )
    lines.append(
        f"final val:  loss {result.final_val_loss:.4f}, "
        f"exact-match accuracy {100 * result.final_val_acc:.1f}%"
    )
    assert data.val_set is not None  # set up by trainer.fit
    operands = data.val_set.dataset.operands  # type: ignore[attr-defined]
    for i in list(data.val_set.indices)[:3]:
        a, b = (int(v) for v in operands[i])
        guess = greedy_answer(model, a, b, n_digits)
        mark = "ok" if guess == a + b else "WRONG"
        lines.append(f"example:    {a} + {b} = {a + b}; model says {guess} [{mark}]")
    if not result.monitor_attached:
        lines.append("curvature:  monitor not attached")
    elif result.monitor_summary:
        lines.append("curvature:")
        lines.extend("  " + line for line in result.monitor_summary.rstrip().splitlines())
    if result.monitor_attached:
        warn = "none" if result.first_warning_step is None else f"step {result.first_warning_step}"
        blow = "none" if result.loss_blowup_step is None else f"step {result.loss_blowup_step}"
        line = (
            f"timeline:   first curvature warning: {warn}; "
            f"training loss blow-up (trailing mean > 0.5 nats above its best for 20 steps): {blow}"
        )
        if result.first_warning_step is not None and result.loss_blowup_step is not None:
            lead = result.loss_blowup_step - result.first_warning_step
            line += f" ({lead} step(s) {'of warning' if lead > 0 else 'late'})"
        lines.append(line)
    lines.append("outputs:")
    lines.append(f"  metrics   {result.metrics_csv}")
    if result.plots:
        lines.extend(f"  plot      {p}" for p in result.plots)
    else:
        lines.append("  plots     none (no curvature columns, or matplotlib missing)")
    if result.wandb_dir is not None:
        lines.append(f"  wandb     {result.wandb_dir}")
        if os.environ.get("WANDB_MODE") == "offline":
            lines.append(f"            upload with: wandb sync {result.wandb_dir}")
    lines.append(f"  summary   {result.out_dir / 'summary.json'}")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``curvwatch-demo``); ``argv`` defaults to ``sys.argv[1:]``. Returns 0."""
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
