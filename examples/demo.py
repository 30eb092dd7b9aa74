"""End-to-end demo: train a small GPT on n-digit addition with a CurvatureMonitor, then summarise and plot.

Run ``python -m examples.demo`` from the repository root (or ``make demo``; the demo is not part of the installed
package). It takes about two to three minutes on two CPU cores (either ``--arch``), needs no download and no W&B
account (the W&B run is offline unless ``WANDB_API_KEY`` is set), and writes everything under ``--out-dir``::

    <out-dir>/csv/metrics.csv          every logged metric, one row per logging step
    <out-dir>/csv/hparams.yaml
    <out-dir>/wandb/                   the W&B run (offline: upload later with `wandb sync`)
    <out-dir>/plots/block_norms.png    per-block Hessian norms over training (when the monitor ran)
    <out-dir>/plots/norm_stats.png     LayerNorm / RMSNorm statistics over training (when the monitor ran)
    <out-dir>/plots/stability.png      each layer's edge-of-stability ratio over training (real-loss keys on)
    <out-dir>/plots/heatmap.png        the block-norm heatmap of the last full evaluation (as logged to W&B)
    <out-dir>/plots/stability_heatmap.png   the same for the edge-of-stability ratios
    <out-dir>/plots/loss.png           train/val loss and validation accuracy
    <out-dir>/summary.json             the numbers printed at the end (with what the monitor cost)

The plots read every key of every evaluation (a :class:`curvwatch.logbook.Logbook` listener), whatever
``--log-level`` lets reach the CSV and W&B (default ``summary``: the headline keys and the per-layer maxima).

``--arch llama`` trains, on the same task and data, a LLaMA-style model built with litgpt from a config (no
download; needs ``pip install litgpt``): rotary positions, grouped-query attention, RMSNorm before each sub-block
and a SwiGLU MLP. The monitor reads it through its litgpt adapter; the plots and ``summary.json`` name the arch.

``--unstable`` trains the default model healthily for 100 steps (warmup to lr 5e-3; the loss falls to its plateau),
then re-warms the learning rate without clipping (5e-3 -> 0.6 by step 400, the instability suite's recipe) until the
loss blows up, watched by the default warning rules (``warning_rules="suite"``). Measured (360 steps, 2.6 minutes on
two busy CPU cores, 28 s of CPU time): the growth rule fires at step 180 in both attention blocks, attention
saturation at step 200, the training loss blows up at step 309 (22 nats by step 349); the summary's ``timeline:``
line prints the rule, its step and the lead. (``--arch llama`` takes the same schedule; measured on the GPT only.)
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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger, Logger
from torch import Tensor, nn

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
SUMMARY_PREFIX = CURV_PREFIX + "summary/"

# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

#: The architectures ``--arch`` trains, with the name the summary and the plots give them.
ARCHS: dict[str, str] = {"gpt": "GPT", "llama": "LLaMA-style (litgpt)"}


def llama_ffn_width(d_model: int) -> int:
    """Hidden width of the LLaMA-style SwiGLU MLP: ``8/3 d_model`` (LLaMA's ratio) rounded up to a multiple of 8.

    Example:
        >>> llama_ffn_width(64), llama_ffn_width(32)
        (176, 88)
    """
    return 8 * math.ceil(d_model / 3)


def model_config(arch: str, s: Mapping[str, Any]) -> dict[str, Any]:
    """The config of ``arch``'s model for the settings ``s``, as plain data (what checkpoints store).

    * ``gpt``: the fields of :class:`GPTConfig`: learned positions, LayerNorm (``s["norm"]``: pre or post), GELU MLP.
    * ``llama``: keyword arguments of ``litgpt.Config``: rotary positions on whole heads, grouped-query attention
      with ``s["n_query_groups"]`` key/value groups, RMSNorm before each sub-block, a SwiGLU MLP (``LLaMAMLP``) of
      width :func:`llama_ffn_width`, no biases.

    Raises:
        ValueError: If ``arch`` is unknown or the sizes do not fit it.

    Example:
        >>> s = {"n_digits": 2, "n_layer": 1, "n_head": 4, "n_query_groups": 2, "d_model": 32, "norm": "pre"}
        >>> model_config("gpt", s)["d_ff"], model_config("llama", s)["intermediate_size"]
        (128, 88)
    """
    block_size = sequence_length(s["n_digits"])
    if arch == "gpt":
        return asdict(
            GPTConfig(
                vocab_size=VOCAB_SIZE,
                block_size=block_size,
                n_layer=s["n_layer"],
                n_head=s["n_head"],
                d_model=s["d_model"],
                norm=s["norm"],
            )
        )
    if arch == "llama":
        d, n_head, n_groups = s["d_model"], s["n_head"], s["n_query_groups"]
        if d % n_head or (d // n_head) % 2 or n_head % n_groups:
            raise ValueError(
                f"Invalid sizes for --arch llama: d_model={d}, n_head={n_head}, n_query_groups={n_groups}. "
                "n_head must divide d_model into heads of even size (rotary pairs), n_query_groups must divide n_head."
            )
        return {
            "name": "curvwatch-demo-llama",
            "block_size": block_size,
            "vocab_size": VOCAB_SIZE,
            "padded_vocab_size": VOCAB_SIZE,
            "n_layer": s["n_layer"],
            "n_head": n_head,
            "n_query_groups": n_groups,
            "n_embd": d,
            "rotary_percentage": 1.0,
            "parallel_residual": False,
            "bias": False,
            "norm_class_name": "RMSNorm",
            "norm_eps": 1e-5,
            "mlp_class_name": "LLaMAMLP",
            "intermediate_size": llama_ffn_width(d),
        }
    raise ValueError(f"Invalid arch={arch!r}. Must be one of {tuple(ARCHS)}.")


def _import_litgpt() -> tuple[type, type]:
    """litgpt's ``Config`` and ``GPT``. litgpt is optional: only ``--arch llama`` needs it."""
    try:
        from litgpt.config import Config
        from litgpt.model import GPT as LitGPT
    except ImportError as err:
        raise ModuleNotFoundError(
            f"--arch llama builds its model with litgpt, which could not be imported ({err}). "
            "Install it with `pip install litgpt`, or train the default --arch gpt."
        ) from err
    return Config, LitGPT


def build_model(arch: str, config: Mapping[str, Any]) -> nn.Module:
    """``arch``'s model from its :func:`model_config`: curvwatch's :class:`GPT`, or litgpt's ``GPT``.

    Both map token ids ``(B, T)`` to logits ``(B, T, vocab)``. The litgpt model is initialised as ours (normal with
    std 0.02, and ``0.02 / sqrt(2 n_layer)`` on the projections into the residual stream), so that the two archs
    differ by their blocks only.

    Example:
        >>> s = {"n_digits": 2, "n_layer": 1, "n_head": 2, "d_model": 16, "norm": "pre"}
        >>> build_model("gpt", model_config("gpt", s))(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 12])
    """
    if arch == "gpt":
        return GPT(GPTConfig(**config))
    if arch != "llama":
        raise ValueError(f"Invalid arch={arch!r}. Must be one of {tuple(ARCHS)}.")
    Config, LitGPT = _import_litgpt()
    model = LitGPT(Config(**config))
    residual_std = 0.02 / math.sqrt(2 * config["n_layer"])
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = residual_std if name.endswith(("attn.proj", "mlp.proj")) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    return model


def num_parameters(model: nn.Module) -> int:
    """Number of trainable parameters (of either arch)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def describe_model(arch: str, config: Mapping[str, Any], n_params: int) -> str:
    """One line naming the arch and its sizes, as the summary prints it.

    Example:
        >>> s = {"n_digits": 2, "n_layer": 1, "n_head": 4, "n_query_groups": 2, "d_model": 32, "norm": "pre"}
        >>> describe_model("llama", model_config("llama", s), 12_345)
        'LLaMA-style (litgpt) 1 layers, d_model 32, 4 heads in 2 kv groups, rotary, pre-RMSNorm, SwiGLU 88, 12k params'
    """
    c = config
    if arch == "gpt":
        shape = f"d_model {c['d_model']}, {c['n_head']} heads, {c['norm']}-LN"
    else:
        shape = (
            f"d_model {c['n_embd']}, {c['n_head']} heads in {c['n_query_groups']} kv groups, rotary, pre-RMSNorm, "
            f"SwiGLU {c['intermediate_size']}"
        )
    return f"{ARCHS[arch]} {c['n_layer']} layers, {shape}, {n_params / 1e3:.0f}k params"


class GPTLitModule(L.LightningModule):
    """A model of :func:`build_model` (``arch``: curvwatch's GPT or litgpt's LLaMA-style GPT) trained with AdamW
    and a warmup + cosine learning-rate schedule.

    The loss is the cross-entropy over answer tokens (targets equal to ``IGNORE_INDEX`` are skipped).

    Logged metrics:
        ``train/loss``, ``train/lr`` every step; ``val/loss`` and ``val/acc`` (exact-match answer accuracy,
        see :func:`curvwatch.data.answer_accuracy`) per validation run.

    Args:
        config: The model's config as :func:`model_config` returns it (what checkpoints store); for ``arch="gpt"``
            a :class:`GPTConfig` is accepted too.
        lr: Peak learning rate.
        weight_decay: AdamW weight decay on matrices (biases, LayerNorm parameters are not decayed).
        betas: AdamW betas.
        warmup_steps: Linear warmup from ``lr / warmup_steps`` to ``lr``; 0 starts at the peak.
        max_steps: Length of the schedule; the cosine decays to ``min_lr_ratio * lr`` at this step.
        min_lr_ratio: Final learning rate as a fraction of the peak.
        lr_knots: A piecewise-linear schedule instead of warmup + cosine: ``((step, lr), ...)``, steps increasing,
            linear in between, constant after the last knot (``lr`` is then only the optimizer's base value).
        arch: ``"gpt"`` or ``"llama"`` (see :func:`build_model`).

    Example:
        >>> module = GPTLitModule(GPTConfig(vocab_size=12, block_size=8, d_model=16), max_steps=10)
        >>> module(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 12])
    """

    def __init__(
        self,
        config: GPTConfig | Mapping[str, Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.98),
        warmup_steps: int = 100,
        max_steps: int = 1000,
        min_lr_ratio: float = 0.1,
        arch: str = "gpt",
        lr_knots: Sequence[Sequence[float]] | None = None,
    ) -> None:
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"Invalid arch={arch!r}. Must be one of {tuple(ARCHS)}.")
        # hyperparameters must be plain data to be saved
        config = asdict(config) if isinstance(config, GPTConfig) else dict(config)
        betas = tuple(betas)  # type: ignore[assignment]
        if lr <= 0:
            raise ValueError(f"Invalid lr={lr}. Must be > 0.")
        if warmup_steps < 0 or max_steps < 1:
            raise ValueError(
                f"Invalid warmup_steps={warmup_steps}, max_steps={max_steps}. "
                "Need warmup_steps >= 0 and max_steps >= 1."
            )
        if lr_knots is not None:
            lr_knots = [(int(step), float(value)) for step, value in lr_knots]
            steps = [step for step, _ in lr_knots]
            if not lr_knots or steps != sorted(set(steps)) or min(v for _, v in lr_knots) <= 0:
                raise ValueError(
                    f"Invalid lr_knots={lr_knots}. Must be (step, lr) pairs with increasing steps and lr > 0, "
                    "e.g. [(0, 1e-3), (100, 5e-3), (300, 0.1)]."
                )
        self.save_hyperparameters()
        self.model = build_model(arch, config)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)

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
            if hp.lr_knots is not None:
                return piecewise_lr(hp.lr_knots, step) / hp.lr
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, hp.max_steps - hp.warmup_steps))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def piecewise_lr(knots: Sequence[Sequence[float]], step: int) -> float:
    """The learning rate at ``step`` of a schedule given by knots ``((step, lr), ...)``: linear in between, constant
    before the first and after the last (what the instability suite's runs use).

    Example:
        >>> [piecewise_lr([(0, 1.0), (10, 2.0)], s) for s in (0, 5, 10, 20)]
        [1.0, 1.5, 2.0, 2.0]
    """
    if step <= knots[0][0]:
        return float(knots[0][1])
    for (s0, v0), (s1, v1) in zip(knots, knots[1:], strict=False):
        if step <= s1:
            return float(v0 + (v1 - v0) * (step - s0) / (s1 - s0))
    return float(knots[-1][1])


def parse_lr_knots(text: str) -> list[tuple[int, float]]:
    """``"0:1e-3,100:5e-3"`` -> ``[(0, 0.001), (100, 0.005)]`` (the ``--lr-knots`` flag).

    Example:
        >>> parse_lr_knots("0:1e-3, 100:5e-3")
        [(0, 0.001), (100, 0.005)]
    """
    try:
        return [(int(step), float(lr)) for step, lr in (item.split(":") for item in text.split(",") if item.strip())]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"Invalid --lr-knots={text!r} ({err}). Must be comma-separated step:lr pairs, e.g. 0:1e-3,100:5e-3"
        ) from None


@torch.no_grad()
def greedy_answer(model: nn.Module, a: int, b: int, n_digits: int) -> int:
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
    "arch": "gpt",
    "n_digits": 3,
    "n_layer": 2,
    "n_head": 4,
    "n_query_groups": None,  # --arch llama only (see _LLAMA_SHAPE); the GPT gives every head its own keys and values
    "d_model": 64,
    "norm": "pre",
    "batch_size": 64,
    "n_train": 100_000,
    "n_val": 1_000,
    "steps": 2000,
    "lr": 5e-3,
    "warmup_steps": 100,
    "lr_knots": None,  # a piecewise-linear schedule instead of warmup + cosine
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "every_n_steps": 50,
    # the exact quantities (bound terms, LayerNorm statistics, exact norms) in between: no Lanczos, cheap
    "terms_every_n_steps": 10,
    "max_tokens": None,  # the monitor's default
    "val_every": 250,
    "threads": 1,
    "warning_rules": "suite",
    "log_level": "summary",
}
# The unstable recipe: healthy training first (the default model and warmup to lr 5e-3; the loss falls from 2.1 to
# its 1.73-nat plateau by step 70), then from step 100 a learning-rate re-warm without clipping (5e-3 -> 0.6 by step
# 400, the instability suite's recipe) that grows the attention logits until the loss blows up. It runs the default
# warning rules (the growth rules skip the first 100 steps), which fire before the blow-up (the module docstring).
_UNSTABLE: dict[str, Any] = {
    "lr_knots": ((0, 5e-4), (50, 5e-3), (100, 5e-3), (400, 0.6)),
    "grad_clip": 0.0,
    "steps": 360,
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
# --arch llama, under the presets (--unstable keeps its own): a lower peak learning rate. At the GPT's 5e-3 the LLaMA
# model stalls near 0.55 nats (11-16% exact match after 2000 steps, 1e-2 alike); at 2e-3 it reaches 100%.
_LLAMA: dict[str, Any] = {"lr": 2e-3}
# --arch llama, over the presets: litgpt's LLaMA blocks are pre-norm, and 4 heads share 2 key/value groups (also in
# --quick, whose 2 heads would leave nothing to share).
_LLAMA_SHAPE: dict[str, Any] = {"norm": "pre", "n_head": 4, "n_query_groups": 2}


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser (flags left at ``None`` take the preset's value)."""
    p = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Train a small GPT (ours, or a LLaMA-style one built with litgpt) on n-digit addition while "
        "curvwatch logs per-block Hessian norms.",
        epilog="Each option's default is in [brackets]; options left out take the preset's value.",
    )
    preset = p.add_argument_group("presets")
    preset.add_argument(
        "--unstable",
        action="store_true",
        help="healthy training, then from step 100 a learning-rate re-warm to 0.6 without clipping: the default "
        "warning rules fire before the loss blows up",
    )
    preset.add_argument("--quick", action="store_true", help="a tiny run of a few seconds (used by the tests)")
    run = p.add_argument_group("run")
    run.add_argument("--steps", type=int, default=None, help=f"optimizer steps [{_DEFAULTS['steps']}]")
    run.add_argument("--seed", type=int, default=0, help="[0]")
    run.add_argument("--out-dir", type=Path, default=None, help="output folder [./curvwatch_runs/<timestamp>]")
    run.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch; 0 keeps torch's default. One is fastest for this tiny model on a busy "
        f"machine [{_DEFAULTS['threads']}]",
    )
    run.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu, gpu, auto, ... [cpu]")
    run.add_argument(
        "--wandb",
        choices=["offline", "online", "disabled"],
        default=None,
        help="W&B mode [online if WANDB_API_KEY is set, else offline]",
    )
    mon = p.add_argument_group("curvature monitor")
    mon.add_argument("--no-monitor", action="store_true", help="train without the CurvatureMonitor")
    mon.add_argument("--every-n-steps", type=int, default=None, help=f"monitor period [{_DEFAULTS['every_n_steps']}]")
    mon.add_argument(
        "--terms-every-n-steps",
        type=int,
        default=None,
        help="also log the quantities that need no Lanczos (bound terms, LayerNorm statistics, exact norms) "
        f"every N steps; 0 disables [{_DEFAULTS['terms_every_n_steps']}]",
    )
    mon.add_argument("--max-tokens", type=int, default=None, help="tokens per monitored step [the monitor's default]")
    mon.add_argument(
        "--warning-rules",
        choices=["suite", "legacy", "all"],
        default=None,
        help="the monitor's warning rules: suite (its default), legacy (spike and collapse) or all "
        f"[{_DEFAULTS['warning_rules']}]",
    )
    mon.add_argument(
        "--log-level",
        choices=["summary", "blocks", "all"],
        default=None,
        help="which keys reach the CSV and W&B loggers; the plots read every key whatever the level "
        f"[{_DEFAULTS['log_level']}]",
    )
    model = p.add_argument_group("task and model")
    model.add_argument(
        "--arch",
        choices=list(ARCHS),
        default=None,
        help="gpt: curvwatch's GPT (learned positions, LayerNorm, GELU MLP); llama: litgpt's GPT from a LLaMA-style "
        "config (rotary, grouped-query attention, RMSNorm, SwiGLU; needs `pip install litgpt`) "
        f"[{_DEFAULTS['arch']}]",
    )
    model.add_argument("--n-digits", type=int, default=None, help=f"[{_DEFAULTS['n_digits']}]")
    model.add_argument("--n-layer", type=int, default=None, help=f"[{_DEFAULTS['n_layer']}]")
    model.add_argument("--n-head", type=int, default=None, help=f"[{_DEFAULTS['n_head']}]")
    model.add_argument(
        "--n-query-groups",
        type=int,
        default=None,
        help=f"key/value groups of --arch llama; must divide --n-head [{_LLAMA_SHAPE['n_query_groups']}]",
    )
    model.add_argument("--d-model", type=int, default=None, help=f"[{_DEFAULTS['d_model']}]")
    model.add_argument(
        "--norm", choices=["pre", "post"], default=None, help=f"--arch gpt only; llama is pre [{_DEFAULTS['norm']}]"
    )
    opt = p.add_argument_group("optimization")
    opt.add_argument("--batch-size", type=int, default=None, help=f"[{_DEFAULTS['batch_size']}]")
    opt.add_argument(
        "--lr", type=float, default=None, help=f"peak learning rate [{_DEFAULTS['lr']}; llama {_LLAMA['lr']}]"
    )
    opt.add_argument("--warmup-steps", type=int, default=None, help=f"[{_DEFAULTS['warmup_steps']}]")
    opt.add_argument(
        "--lr-knots",
        type=parse_lr_knots,
        default=None,
        help="a piecewise-linear learning rate instead of --lr, --warmup-steps and the cosine: step:lr pairs, "
        "e.g. 0:1e-3,100:5e-3 [warmup + cosine; --unstable: "
        + ",".join(f"{step}:{lr:g}" for step, lr in _UNSTABLE["lr_knots"])
        + "]",
    )
    opt.add_argument("--grad-clip", type=float, default=None, help=f"0 disables [{_DEFAULTS['grad_clip']}]")
    opt.add_argument("--val-every", type=int, default=None, help=f"validate every N steps [{_DEFAULTS['val_every']}]")
    return p


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Merge defaults, presets (``--quick`` sizes, ``--unstable`` optimization, ``--arch llama``) and explicit flags."""
    settings = dict(_DEFAULTS)
    llama = args.arch == "llama"
    if llama and args.norm == "post":
        raise ValueError("Invalid --norm=post for --arch llama: litgpt's LLaMA blocks are pre-norm.")
    if llama:
        settings.update(_LLAMA)
    if args.quick:
        settings.update(_QUICK)
    if args.unstable:
        settings.update(_UNSTABLE)
    if llama:
        settings.update(_LLAMA_SHAPE)
    for key in settings:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    if settings["arch"] != "llama" and settings["n_query_groups"] is not None:
        raise ValueError("--n-query-groups needs --arch llama: the GPT has no grouped-query attention.")
    for key in ("steps", "every_n_steps", "val_every", "batch_size", "n_digits", "max_tokens", "n_query_groups"):
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
    steps: list[int], losses: list[float], window: int = 5, margin: float = 0.5, patience: int = 3
) -> int | None:
    """Onset of a loss divergence: the first step whose loss is not finite, or from which the trailing mean of the
    last ``window`` losses stays more than ``margin`` nats above its running minimum for ``patience`` steps.

    A lasting excursion by half a nat, not one noisy step: a healthy run near zero loss wiggles by a tenth of a nat,
    which the old single-step rule (1.25x the best loss, +0.1 nats) reported as a blow-up; a spike of several nats
    keeps the trailing mean up for ``window`` steps and counts.

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


def plot_block_norms(
    series: dict[str, tuple[list[int], list[float]]], path: Path, title: str = "closed-form Hessian block norms"
) -> bool:
    """One panel per block, one line per ``curv/.../hessian/...`` column, log scale. False if none.

    These are the blocks with Hessian norms: attention (``QQ``, ``KK``, ``VV`` per query head ``h*``, or per key/value
    group ``g*`` under grouped-query attention) and FFN (``W1W1``, ``W2W2``; the gated FFN adds ``W3W3``).
    """
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
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


# plot_norm_stats: one panel per statistic, one line per normalisation block; each kind logs it under its own key.
_NORM_STATS: dict[str, tuple[str, ...]] = {
    "smallest variance (LayerNorm) or mean square (RMSNorm) / eps": ("ln/var_min_over_eps", "rms/ms_min_over_eps"),
    "spectral norm of the normalisation's Hessian": ("ln/hessian_norm", "rms/hessian_norm"),
}


def norm_stat_columns(series: Mapping[str, object]) -> dict[str, list[tuple[str, str]]]:
    """The panels of :func:`plot_norm_stats` that have data: ``{title: [(column, block), ...]}``.

    Example:
        >>> norm_stat_columns({"curv/layer0/ln_1/rms/hessian_norm": None, "curv/summary/ln/var_min_over_eps": None})
        {"spectral norm of the normalisation's Hessian": [('curv/layer0/ln_1/rms/hessian_norm', 'layer0/ln_1')]}
    """
    panels: dict[str, list[tuple[str, str]]] = {}
    for panel, suffixes in _NORM_STATS.items():
        lines = [
            (key, key[len(CURV_PREFIX) :].rsplit("/", 2)[0])
            for key in sorted(series)
            if key.startswith(CURV_PREFIX)
            and not key.startswith(SUMMARY_PREFIX)  # the model-wide extremes, not a block
            and key.endswith(tuple("/" + s for s in suffixes))
        ]
        if lines:
            panels[panel] = lines
    return panels


def plot_norm_stats(
    series: dict[str, tuple[list[int], list[float]]], path: Path, title: str = "normalisation statistics"
) -> bool:
    """The statistics of the LayerNorm and RMSNorm blocks (:data:`_NORM_STATS`), log scale. False if none."""
    from matplotlib.figure import Figure

    panels = norm_stat_columns(series)
    if not panels:
        return False
    fig = Figure(figsize=(5.5 * len(panels), 3.8))
    for ax, (panel, lines) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels.items(), strict=True):
        for key, block in lines:
            ax.plot(*_positive(*series[key]), marker=".", markersize=3, linewidth=1, label=block)
        ax.set_yscale("log")
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def plot_stability(
    series: dict[str, tuple[list[int], list[float]]], path: Path, title: str = "edge of stability"
) -> bool:
    """The largest edge-of-stability ratio of each layer (``curv_stability/layer{i}``) over training, log scale, with
    the edge (1) dashed. False if the real-loss keys were off (no ratio logged)."""
    from matplotlib.figure import Figure

    lines = sorted((k for k in series if k.startswith("curv_stability/layer")), key=lambda k: int(k.rsplit("layer")[1]))
    if not lines:
        return False
    fig = Figure(figsize=(7, 3.8))
    ax = fig.subplots()
    for key in lines:
        ax.plot(*_positive(*series[key]), marker=".", markersize=3, linewidth=1, label=key.split("/", 1)[1])
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="edge (1)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("sharpness / stability threshold")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def save_heatmaps(entry: Any, folder: Path) -> list[Path]:
    """The two heatmap images the monitor logs to W&B (:func:`curvwatch.sinks.heatmap_figure`), of the last full
    evaluation ``entry`` (:class:`curvwatch.logbook.Entry`), as ``heatmap.png`` and ``stability_heatmap.png``."""
    from types import SimpleNamespace

    from curvwatch.sinks import heatmap_figure

    specs = [SimpleNamespace(name=row["block"], layer=row["layer"]) for row in entry.table if row["layer"] is not None]
    saved = []
    for name, values, label in (
        ("heatmap.png", entry.norms, ("log10 ||H||", "Block Hessian norms")),
        ("stability_heatmap.png", entry.ratios, ("log10 sharpness / threshold", "Edge-of-stability ratios")),
    ):
        if values:
            folder.mkdir(parents=True, exist_ok=True)
            heatmap_figure(specs, values, entry.step, label).savefig(folder / name, dpi=90)
            saved.append(folder / name)
    return saved


class FullRecord:
    """Every key of every evaluation (a :class:`curvwatch.logbook.Logbook` listener): the plots' input, whatever
    ``log_level`` lets reach the CSV.

    Example:
        >>> from types import SimpleNamespace
        >>> record = FullRecord()
        >>> record.add(SimpleNamespace(step=0, values={"curv/a": 1.0}, terms_only=False))
        >>> record.series
        {'curv/a': ([0], [1.0])}
    """

    def __init__(self) -> None:
        self.series: dict[str, tuple[list[int], list[float]]] = {}
        self.last_full: Any = None  # the last full evaluation's Entry (the heatmaps)

    def add(self, entry: Any) -> None:
        for key, value in entry.values.items():
            steps, values = self.series.setdefault(key, ([], []))
            steps.append(entry.step)
            values.append(value)
        if not entry.terms_only:
            self.last_full = entry


class ProgressLines:
    """One line per full evaluation on ``stream`` (a :class:`curvwatch.logbook.Logbook` listener): what a run whose
    output is not a terminal prints in place of the progress bar.

    ``loss`` is called for the training loss of the step (``None``: not known yet); the other numbers are the entry's
    ``summary/...`` keys.

    Example:
        >>> import io
        >>> from types import SimpleNamespace
        >>> out = io.StringIO()
        >>> lines = ProgressLines(steps=2000, loss=lambda: 1.93, stream=out)
        >>> summary = {f"summary/{k}": v for k, v in
        ...            {"max_hessian": 312.0, "stability/max": 0.41, "warnings": 0.0, "eval_time_s": 1.9}.items()}
        >>> lines(SimpleNamespace(step=50, terms_only=False, summary=summary))
        >>> lines(SimpleNamespace(step=60, terms_only=True, summary={}))  # terms-only: no line
        >>> print(out.getvalue().rstrip())
        [curvwatch demo] step   50/2000  loss 1.930  max_hessian 312  stability/max 0.41  warnings 0  eval 1.9 s
    """

    def __init__(self, steps: int, loss: Any, stream: Any = None) -> None:
        self.steps, self.loss, self.stream = steps, loss, stream

    def __call__(self, entry: Any) -> None:
        if entry.terms_only:
            return
        s, loss = entry.summary, self.loss()
        parts = [f"step {entry.step:>{len(str(self.steps))}}/{self.steps}"]
        parts.append("loss -" if loss is None else f"loss {loss:.3f}")
        for key in ("max_hessian", "stability/max"):
            if f"summary/{key}" in s:
                parts.append(f"{key} {s[f'summary/{key}']:.3g}")
        parts.append(f"warnings {int(s.get('summary/warnings', 0))}")
        timing = f"  eval {s['summary/eval_time_s']:.1f} s" if "summary/eval_time_s" in s else ""
        print("[curvwatch demo] " + "  ".join(parts) + timing, file=self.stream or sys.stdout, flush=True)


def plot_loss(series: dict[str, tuple[list[int], list[float]]], path: Path, title: str | None = None) -> bool:
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
    if title:
        fig.suptitle(title)
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
    first_warning: str = ""  # its rule and block ("growth in layer0/attn")
    loss_blowup_step: int | None = None
    arch: str = "gpt"
    model: str = ""  # describe_model's line
    n_parameters: int = 0
    warnings: int = 0  # CurvatureWarnings fired
    monitor_seconds: float = 0.0  # spent evaluating and logging (both tiers), the monitor's cost
    monitor_terms_seconds: float = 0.0  # the part of it spent on terms-only evaluations
    overhead: float = 0.0  # monitor_seconds / (training wall time - monitor_seconds)
    evaluations: tuple[int, int] = (0, 0)  # full and terms-only evaluations
    # the monitor's set-up table: a row per monitored block and per part left out ({"layer", "part", "kind", "status"})
    coverage: list[dict[str, str]] = field(default_factory=list)


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
    arch = s["arch"]
    config = model_config(arch, s)
    module = GPTLitModule(
        config,
        lr=s["lr"],
        weight_decay=s["weight_decay"],
        warmup_steps=s["warmup_steps"],
        max_steps=s["steps"],
        arch=arch,
        lr_knots=s["lr_knots"],
    )
    n_params = num_parameters(module.model)
    model_desc = describe_model(arch, config, n_params)

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
            print(f"[curvwatch demo] W&B logging skipped ({err}); install with `pip install curvwatch[wandb]`.")

    callbacks: list[L.Callback] = []
    monitor = None
    record = FullRecord()
    if not args.no_monitor:
        try:
            from curvwatch import Cadence, CurvatureMonitor, Evaluation
        except ImportError as err:
            print(f"[curvwatch demo] CurvatureMonitor unavailable ({err}); training without it.")
        else:
            tokens = {} if s["max_tokens"] is None else {"max_tokens": s["max_tokens"]}
            monitor = CurvatureMonitor(
                every_n_train_steps=s["every_n_steps"],
                # a fixed schedule: the demo favours dense plots over a 1% budget
                cadence=Cadence(terms_every_n_train_steps=s["terms_every_n_steps"] or None, max_overhead=None),
                # the demo shows every bound term on its terms-only steps, not only the rules' keys
                evaluation=Evaluation(terms_keys="all", **tokens),
                warning_rules=s["warning_rules"],
                log_level=s["log_level"],
            )
            monitor.book.listeners.append(record.add)  # the plots read every key, whatever reaches the loggers
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

    if monitor is not None and not sys.stdout.isatty():  # no progress bar: a line per full evaluation instead

        def train_loss() -> float | None:
            value = trainer.callback_metrics.get("train/loss")
            return None if value is None else float(value)

        monitor.book.listeners.append(ProgressLines(s["steps"], train_loss))

    desc = f"{s['n_digits']}-digit addition | {model_desc} | {s['steps']} steps, batch {s['batch_size']}, " + (
        f"lr {s['lr']:g}, warmup {s['warmup_steps']}"
        if s["lr_knots"] is None
        else "lr " + " -> ".join(f"{lr:g} (step {step})" for step, lr in s["lr_knots"])
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
        arch=arch,
        model=model_desc,
        n_parameters=n_params,
    )
    if monitor is not None and callable(getattr(monitor, "summary_text", None)):
        result.monitor_summary = monitor.summary_text()
    if monitor is not None and getattr(monitor, "alerts", None):
        first = min(monitor.alerts, key=lambda a: a.step)
        result.first_warning_step = first.step
        result.first_warning = f"{first.kind} in {first.block}"
        result.warnings = len(monitor.alerts)
    if monitor is not None:
        result.coverage = monitor.coverage
        schedule = monitor.schedule
        result.monitor_seconds = schedule.eval_seconds
        result.monitor_terms_seconds = schedule.terms_seconds
        result.overhead = schedule.overhead
        result.evaluations = (monitor.book.evaluations, monitor.book.terms_evaluations)

    loss_series = read_metrics(metrics_csv).get("train/loss")
    if loss_series is not None:
        result.loss_blowup_step = loss_blowup_step(*loss_series)
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("[curvwatch demo] plots skipped: matplotlib is not installed (`pip install curvwatch[plots]`).")
    else:
        series = {**read_metrics(metrics_csv), **record.series}  # every key of every evaluation, at any log level
        label = f"{ARCHS[arch]}, {s['n_digits']}-digit addition"
        for name, plot, title in (
            ("block_norms.png", plot_block_norms, f"closed-form Hessian block norms: {label}"),
            ("norm_stats.png", plot_norm_stats, f"normalisation statistics: {label}"),
            ("stability.png", plot_stability, f"edge of stability per layer: {label}"),
            ("loss.png", plot_loss, f"training: {label}"),
        ):
            if plot(series, out_dir / "plots" / name, title):
                result.plots.append(out_dir / "plots" / name)
        if record.last_full is not None:
            result.plots += save_heatmaps(record.last_full, out_dir / "plots")

    _print_summary(result, module.model, data, s["n_digits"], desc)
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(result).items()}
    summary["plots"] = [str(p) for p in result.plots]
    summary["model_config"] = config
    summary["settings"] = {**s, "seed": args.seed, "unstable": args.unstable, "quick": args.quick}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return result


def _layer_span(layers: Sequence[int]) -> str:
    """``"layer 0"``, ``"layers 0-3"`` or ``"layers 0, 2"``."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}-{layers[-1]}"
    return "layers " + ", ".join(map(str, layers))


def coverage_lines(rows: Sequence[Mapping[str, str]]) -> list[str]:
    """The monitor's set-up table (:attr:`CurvatureMonitor.coverage`) in a few lines: layers whose monitored blocks
    are alike share a line, and each part left out follows with its reason.

    Example:
        >>> rows = [{"layer": str(i), "part": "attn", "kind": "attention", "status": "monitored"} for i in range(3)]
        >>> rows.append({"layer": "2", "part": "mlp", "kind": "-", "status": "not monitored: experts"})
        >>> for line in coverage_lines(rows):
        ...     print(line)
        3 monitored
          layers 0-2: attn (attention)
          layer 2 mlp: not monitored: experts
    """
    by_layer: dict[int, list[str]] = defaultdict(list)
    left_out = []
    for r in rows:
        if r["status"] == "monitored":
            by_layer[int(r["layer"])].append(f"{r['part']} ({r['kind']})")
        else:
            left_out.append(f"layer {r['layer']} {r['part']}: {r['status']}")
    alike: dict[str, list[int]] = defaultdict(list)
    for layer in sorted(by_layer):
        alike[", ".join(by_layer[layer])].append(layer)
    n_monitored = sum(len(parts) for parts in by_layer.values())
    lines = [f"{n_monitored} monitored"]
    lines += [f"  {_layer_span(layers)}: {parts}" for parts, layers in alike.items()]
    return lines + [f"  {line}" for line in left_out]


def cost_line(result: DemoResult) -> str:
    """What the monitor cost, as one figure: its seconds as a fraction of the training's own seconds (the training
    wall time less the monitor's), as ``summary/overhead`` counts it.

    Example:
        >>> r = DemoResult(Path("."), Path("m.csv"), 30.0, 0.1, 1.0, 100, True, monitor_seconds=10.0,
        ...                monitor_terms_seconds=4.0, overhead=0.5, evaluations=(3, 7))
        >>> print(cost_line(r))
        monitor:    10.0 s = 50% of the training time (20.0 s): 3 full evaluations 6.0 s, 7 terms-only 4.0 s
                    (the demo's fixed, dense schedule; CurvatureMonitor() at its defaults keeps to 1% + 4%)
    """
    fraction = result.overhead
    training = result.monitor_seconds / fraction if fraction > 0 else result.train_seconds - result.monitor_seconds
    full, terms = result.evaluations
    return (
        f"monitor:    {result.monitor_seconds:.1f} s = {100 * fraction:.0f}% of the training time "
        f"({training:.1f} s): {full} full evaluations {result.monitor_seconds - result.monitor_terms_seconds:.1f} s, "
        f"{terms} terms-only {result.monitor_terms_seconds:.1f} s\n"
        "            (the demo's fixed, dense schedule; CurvatureMonitor() at its defaults keeps to 1% + 4%)"
    )


def _print_summary(result: DemoResult, model: nn.Module, data: AdditionDataModule, n_digits: int, desc: str) -> None:
    lines = ["", "=" * 78, "curvwatch demo summary", "=" * 78, f"run:        {desc}"]
    lines.append(
        f"training:   {result.steps} steps in {result.train_seconds:.1f} s "
        f"({result.steps / max(result.train_seconds, 1e-9):.1f} steps/s)"
    )
    lines.append(
        f"final val:  loss {result.final_val_loss:.4f}, exact-match accuracy {100 * result.final_val_acc:.1f}%"
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
    else:
        blocks = coverage_lines(result.coverage)
        lines.append(f"blocks:     {blocks[0]}")
        lines.extend(blocks[1:])
    if result.monitor_summary:
        lines.append("curvature:")
        lines.extend("  " + line for line in result.monitor_summary.rstrip().splitlines())
    if result.monitor_attached:
        lines.append(cost_line(result))
        warn = "none" if result.first_warning_step is None else f"step {result.first_warning_step}"
        if result.first_warning:
            warn += f" ({result.first_warning})"
        blow = "none" if result.loss_blowup_step is None else f"step {result.loss_blowup_step}"
        line = (
            f"timeline:   first curvature warning: {warn}; "
            f"training loss blow-up (5-step mean > 0.5 nats above its best for 3 steps): {blow}"
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
    """Command-line entry point (``python -m examples.demo``, ``make demo``).

    ``argv`` defaults to ``sys.argv[1:]``. Returns 0.
    """
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
