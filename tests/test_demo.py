"""Tests of curvwatch.demo: the quick run end to end with real loggers, and its pieces."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from curvwatch.demo import GPTLitModule, build_parser, main, plot_block_norms, read_metrics, resolve_settings
from curvwatch.models import GPTConfig


@pytest.mark.slow
@pytest.mark.timeout(60)  # about 10 s alone; the margin is for a shared, busy CPU
def test_quick_run_writes_metrics(tmp_path, capsys):
    assert main(["--quick", "--wandb", "disabled", "--out-dir", tmp_path]) == 0
    metrics = tmp_path / "csv" / "metrics.csv"
    assert metrics.is_file()
    with open(metrics, newline="") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    assert {"train/loss", "val/loss", "val/acc", "step"} <= columns
    losses = [float(r["train/loss"]) for r in rows if r["train/loss"]]
    assert losses and all(math.isfinite(v) for v in losses)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 30 and 0.0 <= summary["final_val_acc"] <= 1.0
    assert (tmp_path / "plots" / "loss.png").is_file()
    if any(c.startswith("curv/") and "/hessian/" in c for c in columns):
        assert (tmp_path / "plots" / "block_norms.png").is_file()
    out = capsys.readouterr().out
    assert "curvwatch demo summary" in out and "exact-match accuracy" in out
    assert str(metrics) in out


def test_presets_and_overrides():
    parse = build_parser().parse_args
    default = resolve_settings(parse([]))
    assert default["norm"] == "pre" and default["warmup_steps"] > 0 and default["grad_clip"] > 0
    unstable = resolve_settings(parse(["--unstable"]))
    assert unstable["norm"] == "post" and unstable["lr"] >= 3e-2
    assert unstable["warmup_steps"] == 0 and unstable["grad_clip"] == 0
    quick = resolve_settings(parse(["--quick", "--steps", "7", "--every-n-steps", "3"]))
    assert quick["steps"] == 7 and quick["every_n_steps"] == 3 and quick["val_every"] == 7
    with pytest.raises(ValueError, match="Invalid --every-n-steps=0"):
        resolve_settings(parse(["--every-n-steps", "0"]))
    assert default["terms_every_n_steps"] == 10 and resolve_settings(parse(["--terms-every-n-steps", "0"]))[
        "terms_every_n_steps"
    ] == 0
    with pytest.raises(ValueError, match="Invalid --terms-every-n-steps=-1"):
        resolve_settings(parse(["--terms-every-n-steps", "-1"]))


def test_lr_schedule_warmup_then_cosine():
    module = GPTLitModule(
        GPTConfig(vocab_size=12, block_size=8, d_model=16), lr=1.0, warmup_steps=10, max_steps=110
    )
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    factor = scheduler.lr_lambdas[0]
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0) and factor(110) == pytest.approx(0.1)
    assert factor(60) == pytest.approx(0.55)


def test_block_norm_plot_reads_curv_columns(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.csv"
    keys = ["curv/layer0/attn/hessian/QQ/h0", "curv/layer0/ffn/hessian/W1W1", "curv/layer0/ln_1/ln/var_min"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epoch", "step", "train/loss", *keys])
        for step in range(3):
            writer.writerow([0, step, 1.0 / (step + 1), 2.0**step, "", 0.5])
            writer.writerow([0, step, "", "", 3.0 * (step + 1), ""])
    series = read_metrics(path)
    assert series[keys[0]] == ([0, 1, 2], [1.0, 2.0, 4.0])
    assert series[keys[1]][1] == [3.0, 6.0, 9.0]
    assert plot_block_norms(series, tmp_path / "plots" / "block_norms.png")
    assert (tmp_path / "plots" / "block_norms.png").stat().st_size > 0
    del series[keys[0]], series[keys[1]]
    assert not plot_block_norms(series, tmp_path / "none.png")  # no hessian columns: skipped
    assert not (tmp_path / "none.png").exists()


def test_training_step_loss_ignores_prompt():
    module = GPTLitModule(GPTConfig(vocab_size=12, block_size=5, d_model=16), max_steps=10)
    logits = torch.randn(2, 5, 12)
    targets = torch.full((2, 5), -100)
    targets[:, -2:] = 3
    expected = torch.nn.functional.cross_entropy(logits[:, -2:].reshape(-1, 12), targets[:, -2:].reshape(-1))
    torch.testing.assert_close(module._loss(logits, targets), expected)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore::curvwatch.alerts.CurvatureWarning")
def test_unstable_preset_warns_before_the_loss_blows_up(tmp_path):
    from curvwatch.demo import run

    result = run(["--unstable", "--steps", "12", "--wandb", "disabled", "--out-dir", str(tmp_path)])
    assert result.first_warning_step is not None and result.loss_blowup_step is not None
    assert result.first_warning_step < result.loss_blowup_step


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stable_recipe_fires_no_warning(tmp_path):
    """The stable default (pre-LN, warmup, clipping) over its first 400 steps: no CurvatureWarning at all."""
    from curvwatch.demo import run

    result = run(["--steps", "400", "--every-n-steps", "25", "--wandb", "disabled", "--out-dir", str(tmp_path)])
    assert result.first_warning_step is None  # pytest turns any CurvatureWarning into an error as well
    assert result.loss_blowup_step is None
