"""Tests of examples.demo: the quick run end to end with real loggers, and its pieces."""

from __future__ import annotations

import csv
import json
import math
import sys

import pytest
import torch

from curvwatch.models import GPTConfig
from examples.demo import (
    GPTLitModule,
    build_model,
    build_parser,
    coverage_lines,
    main,
    model_config,
    norm_stat_columns,
    plot_block_norms,
    plot_norm_stats,
    read_metrics,
    resolve_settings,
)


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
    assert summary["arch"] == "gpt" and summary["model"].startswith("GPT 2 layers")
    assert {(r["part"], r["kind"]) for r in summary["coverage"] if r["layer"] != "-"} == {
        ("attn", "attention"),
        ("ln_1", "layernorm"),
        ("ln_2", "layernorm"),
        ("ffn", "ffn"),
    }
    assert (tmp_path / "plots" / "loss.png").is_file()
    # log_level="summary" (the default): the CSV gets the per-layer maxima, not the per-head keys; the plots read
    # every key of every evaluation all the same
    assert "curv_hessian/layer1/attn" in columns and not any("/h0" in c or "/term/" in c for c in columns)
    for plot in ("block_norms.png", "norm_stats.png", "stability.png", "heatmap.png", "stability_heatmap.png"):
        assert (tmp_path / "plots" / plot).is_file(), plot
    assert summary["monitor_seconds"] > 0 and summary["overhead"] > 0
    out = capsys.readouterr().out
    assert "curvwatch demo summary" in out and "exact-match accuracy" in out
    assert str(metrics) in out
    # one cost figure, on one base: the monitor's seconds as a fraction of the training's (summary/overhead)
    percent = f"{100 * summary['overhead']:.0f}% of the training time"
    assert f" s = {percent} (" in out and f"): {summary['evaluations'][0]} full evaluations" in out
    assert " x the training time" not in out and "s run (" not in out
    # stdout is not a terminal here: no progress bar, one line per full evaluation instead
    progress = [line for line in out.splitlines() if line.startswith("[curvwatch demo] step ")]
    assert len(progress) == summary["evaluations"][0] == 3  # steps 0, 10 and 20 of the 30
    assert all("/30  loss " in line and "max_hessian " in line and "warnings 0" in line for line in progress)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_quick_run_on_a_terminal_prints_no_evaluation_lines(tmp_path, capsys, monkeypatch):
    """On a terminal the progress bar shows the run; the per-evaluation lines are for output that is not one."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert main(["--quick", "--wandb", "disabled", "--out-dir", tmp_path]) == 0
    out = capsys.readouterr().out
    assert "curvwatch demo summary" in out
    assert not [line for line in out.splitlines() if line.startswith("[curvwatch demo] step ")]


def _finite_values(rows: list[dict[str, str]], key: str) -> list[float]:
    values = [float(r[key]) for r in rows if r.get(key)]
    assert values, f"{key} was never logged"
    assert all(math.isfinite(v) for v in values), f"{key} is not finite: {values}"
    return values


@pytest.mark.slow
@pytest.mark.timeout(60)  # about 10 s of training plus imports alone
def test_quick_llama_run_monitors_every_block(tmp_path, capsys):
    """litgpt's LLaMA-style GPT on the same task: rotary GQA attention, RMSNorm and SwiGLU are all monitored."""
    pytest.importorskip("litgpt")
    # --log-level all: this test reads the per-head keys from the CSV
    assert main(["--quick", "--arch", "llama", "--log-level", "all", "--wandb", "disabled", "--out-dir", tmp_path]) == 0
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    columns = set(rows[0])
    _finite_values(rows, "train/loss")
    # queries per head, keys and values per key/value group (4 heads in 2 groups): no per-head KK/VV keys
    for key in ("QQ/h0", "QQ/h3", "KK/g0", "KK/g1", "VV/g0", "VV/g1"):
        _finite_values(rows, f"curv/layer0/attn/hessian/{key}")
    assert "curv/layer0/attn/hessian/KK/h0" not in columns
    assert "curv/layer0/attn/hessian/KK/g2" not in columns
    ms_min = _finite_values(rows, "curv/layer0/ln_1/rms/ms_min")
    assert all(v > 0 for v in ms_min)
    _finite_values(rows, "curv/layer1/ln_2/rms/ms_min_over_eps")
    for key in ("W1W1", "W2W2", "W3W3"):
        _finite_values(rows, f"curv/layer0/ffn/hessian/{key}")
    assert not any(c.startswith("curv/layer0/ln_1/ln/") for c in columns)  # RMSNorm, not LayerNorm

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["arch"] == "llama" and summary["settings"]["arch"] == "llama"
    assert summary["model_config"]["n_query_groups"] == 2 and summary["model_config"]["mlp_class_name"] == "LLaMAMLP"
    assert summary["steps"] == 30 and math.isfinite(summary["final_val_loss"])
    monitored = {(r["layer"], r["part"], r["kind"]) for r in summary["coverage"] if r["status"] == "monitored"}
    assert monitored == {
        (str(i), part, kind)
        for i in range(2)
        for part, kind in (("attn", "attention"), ("ln_1", "rmsnorm"), ("ln_2", "rmsnorm"), ("ffn", "gated_ffn"))
    }
    assert all(r["status"] == "monitored" for r in summary["coverage"] if r["layer"] != "-")
    left_out = [r["layer"] for r in summary["coverage"] if r["status"] != "monitored" and r["part"] != "sharpness"]
    assert left_out == ["-"]  # embeddings, head
    for name in ("block_norms.png", "norm_stats.png", "loss.png"):
        assert (tmp_path / "plots" / name).is_file()
    out = capsys.readouterr().out
    assert "LLaMA-style (litgpt) 2 layers" in out and "4 heads in 2 kv groups" in out
    assert "layers 0-1: attn (attention), ln_1 (rmsnorm), ln_2 (rmsnorm), ffn (gated_ffn)" in out


def test_llama_settings():
    parse = build_parser().parse_args
    llama = resolve_settings(parse(["--arch", "llama"]))
    gpt = resolve_settings(parse([]))
    assert llama["arch"] == "llama" and gpt["arch"] == "gpt" and gpt["n_query_groups"] is None
    assert (llama["n_head"], llama["n_query_groups"], llama["norm"]) == (4, 2, "pre")
    assert llama["lr"] < gpt["lr"]  # at the GPT's peak learning rate the LLaMA model stalls
    assert {k: v for k, v in llama.items() if k not in ("arch", "n_query_groups", "lr")} == {
        k: v for k, v in gpt.items() if k not in ("arch", "n_query_groups", "lr")
    }  # the same task, data, schedule and monitor settings
    quick = resolve_settings(parse(["--quick", "--arch", "llama"]))
    assert (quick["n_head"], quick["n_query_groups"], quick["d_model"], quick["lr"]) == (4, 2, 32, llama["lr"])
    unstable = resolve_settings(parse(["--unstable", "--arch", "llama"]))
    assert unstable["norm"] == "pre" and unstable["lr_knots"] == resolve_settings(parse(["--unstable"]))["lr_knots"]
    assert resolve_settings(parse(["--arch", "llama", "--lr", "1e-3"]))["lr"] == 1e-3
    assert resolve_settings(parse(["--arch", "llama", "--n-query-groups", "4"]))["n_query_groups"] == 4
    with pytest.raises(ValueError, match="--norm=post for --arch llama"):
        resolve_settings(parse(["--arch", "llama", "--norm", "post"]))
    with pytest.raises(ValueError, match="--n-query-groups needs --arch llama"):
        resolve_settings(parse(["--n-query-groups", "2"]))
    with pytest.raises(ValueError, match="Invalid --n-query-groups=0"):
        resolve_settings(parse(["--arch", "llama", "--n-query-groups", "0"]))
    with pytest.raises(ValueError, match="n_query_groups must divide n_head"):
        model_config("llama", resolve_settings(parse(["--arch", "llama", "--n-query-groups", "3"])))
    with pytest.raises(ValueError, match="Invalid arch"):
        model_config("bert", gpt)


def test_llama_module_rebuilds_from_its_hparams():
    pytest.importorskip("litgpt")
    from litgpt.model import GPT as LitGPT

    config = model_config("llama", resolve_settings(build_parser().parse_args(["--quick", "--arch", "llama"])))
    module = GPTLitModule(config, arch="llama", max_steps=10)
    assert isinstance(module.model, LitGPT)
    assert module.model.config.n_query_groups == 2 and module.model.config.rope_n_elem == 8
    idx = torch.zeros(2, config["block_size"], dtype=torch.long)
    assert module(idx).shape == (2, config["block_size"], config["vocab_size"])
    # what a checkpoint stores is enough to rebuild it
    assert module.hparams["arch"] == "llama" and isinstance(module.hparams["config"], dict)
    rebuilt = GPTLitModule(**module.hparams)
    rebuilt.load_state_dict(module.state_dict())
    torch.testing.assert_close(rebuilt(idx), module(idx))
    with pytest.raises(ValueError, match="Invalid arch"):
        GPTLitModule(config, arch="mamba")


def test_llama_without_litgpt_says_how_to_install(monkeypatch):
    for name in ("litgpt", "litgpt.config", "litgpt.model"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import litgpt...` fail
    config = model_config("llama", resolve_settings(build_parser().parse_args(["--arch", "llama"])))
    with pytest.raises(ModuleNotFoundError, match="pip install litgpt"):
        build_model("llama", config)


def test_coverage_lines_group_alike_layers():
    rows = [
        {"layer": str(i), "part": part, "kind": kind, "status": "monitored"}
        for i in range(3)
        for part, kind in (("attn", "attention"), ("ffn", "gated_ffn"))
    ]
    rows.append({"layer": "1", "part": "mlp", "kind": "-", "status": "not monitored: experts"})
    assert coverage_lines(rows) == [
        "6 monitored",
        "  layers 0-2: attn (attention), ffn (gated_ffn)",
        "  layer 1 mlp: not monitored: experts",
    ]
    assert coverage_lines([]) == ["0 monitored"]


def test_presets_and_overrides():
    parse = build_parser().parse_args
    default = resolve_settings(parse([]))
    assert default["norm"] == "pre" and default["warmup_steps"] > 0 and default["grad_clip"] > 0
    unstable = resolve_settings(parse(["--unstable"]))
    knots = unstable["lr_knots"]  # the default model, a healthy start, then a re-warm past the rules' warm-up
    assert unstable["norm"] == "pre" and unstable["grad_clip"] == 0 and unstable["warning_rules"] == "suite"
    assert knots[0][1] < knots[1][1] == knots[2][1] == default["lr"] and knots[2][0] >= 100 and knots[-1][1] > 0.1
    assert resolve_settings(parse(["--lr-knots", "0:1e-3,50:2e-3"]))["lr_knots"] == [(0, 1e-3), (50, 2e-3)]
    with pytest.raises(SystemExit):
        parse(["--lr-knots", "0:1e-3,fast"])
    quick = resolve_settings(parse(["--quick", "--steps", "7", "--every-n-steps", "3"]))
    assert quick["steps"] == 7 and quick["every_n_steps"] == 3 and quick["val_every"] == 7
    with pytest.raises(ValueError, match="Invalid --every-n-steps=0"):
        resolve_settings(parse(["--every-n-steps", "0"]))
    assert (
        default["terms_every_n_steps"] == 10
        and resolve_settings(parse(["--terms-every-n-steps", "0"]))["terms_every_n_steps"] == 0
    )
    with pytest.raises(ValueError, match="Invalid --terms-every-n-steps=-1"):
        resolve_settings(parse(["--terms-every-n-steps", "-1"]))


def test_help_prints_one_default_per_option():
    """Every option that takes a value says its default once, in [brackets]; flags say none."""
    parser = build_parser()
    text = parser.format_help()
    assert "(default:" not in text
    for action in parser._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        assert action.help and action.help.count("[") == 1 and action.help.rstrip().endswith("]"), action.dest


def test_lr_schedule_warmup_then_cosine():
    module = GPTLitModule(GPTConfig(vocab_size=12, block_size=8, d_model=16), lr=1.0, warmup_steps=10, max_steps=110)
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    factor = scheduler.lr_lambdas[0]
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(1.0) and factor(110) == pytest.approx(0.1)
    assert factor(60) == pytest.approx(0.55)


def test_lr_knots_schedule_and_its_validation():
    config = GPTConfig(vocab_size=12, block_size=8, d_model=16)
    module = GPTLitModule(config, lr=0.5, lr_knots=[(0, 0.1), (10, 0.2), (20, 0.5)])
    factor = module.configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0]
    assert [0.5 * factor(s) for s in (0, 5, 10, 15, 20, 99)] == pytest.approx([0.1, 0.15, 0.2, 0.35, 0.5, 0.5])
    with pytest.raises(ValueError, match=r"Invalid lr_knots=\[\(10, 0.1\), \(5, 0.2\)\]. Must be \(step, lr\) pairs"):
        GPTLitModule(config, lr_knots=[(10, 0.1), (5, 0.2)])


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


def test_norm_stats_plot_picks_each_kinds_keys(tmp_path):
    pytest.importorskip("matplotlib")
    series = {
        "curv/layer0/ln_1/ln/var_min_over_eps": ([0, 1], [50.0, 60.0]),
        "curv/layer0/ln_1/rms/ms_min_over_eps": ([0, 1], [40.0, 45.0]),
        "curv/layer1/ln_2/rms/hessian_norm": ([0, 1], [3.0, 2.0]),
        "curv/summary/ln/var_min_over_eps": ([0, 1], [50.0, 60.0]),  # a model-wide extreme: not a block's line
    }
    assert norm_stat_columns(series) == {
        "smallest variance (LayerNorm) or mean square (RMSNorm) / eps": [
            ("curv/layer0/ln_1/ln/var_min_over_eps", "layer0/ln_1"),
            ("curv/layer0/ln_1/rms/ms_min_over_eps", "layer0/ln_1"),
        ],
        "spectral norm of the normalisation's Hessian": [("curv/layer1/ln_2/rms/hessian_norm", "layer1/ln_2")],
    }
    assert plot_norm_stats(series, tmp_path / "norm_stats.png", "normalisation statistics: test")
    assert (tmp_path / "norm_stats.png").stat().st_size > 0
    assert not plot_norm_stats({"curv/summary/ln/var_min_over_eps": ([0], [1.0])}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_training_step_loss_ignores_prompt():
    module = GPTLitModule(GPTConfig(vocab_size=12, block_size=5, d_model=16), max_steps=10)
    logits = torch.randn(2, 5, 12)
    targets = torch.full((2, 5), -100)
    targets[:, -2:] = 3
    expected = torch.nn.functional.cross_entropy(logits[:, -2:].reshape(-1, 12), targets[:, -2:].reshape(-1))
    torch.testing.assert_close(module._loss(logits, targets), expected)


@pytest.mark.slow
@pytest.mark.timeout(300)  # about 20 s on two busy CPU cores
@pytest.mark.filterwarnings("ignore::curvwatch.alerts.CurvatureWarning")
@pytest.mark.filterwarnings("ignore::curvwatch.alerts.CurvatureNotice")
def test_unstable_preset_warns_before_the_loss_blows_up(tmp_path):
    """--unstable's schedule (a healthy start, then the re-warm) on the --quick model, full evaluations only at step 0
    (the rules read what the terms-only ones log): a default rule (warning_rules="suite", not the legacy spike) fires
    after the growth rules' 100-step warm-up and well before the loss blows up. Measured: growth in layer0/attn at
    step 165, blow-up at step 319. The full-size preset (python -m examples.demo --unstable, 360 steps, about two
    minutes): growth at 180, blow-up at 309 (README)."""
    from examples.demo import run

    result = run(["--unstable", "--quick", "--every-n-steps", "1000", "--wandb", "disabled", "--out-dir", tmp_path])
    assert result.first_warning_step is not None and result.loss_blowup_step is not None
    assert result.first_warning.split()[0] in ("growth", "attn_saturation", "ln_collapse", "ln_variance_drop")
    assert 100 < result.first_warning_step < result.loss_blowup_step - 50  # the healthy start, then a lead
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss") and int(r["step"]) < 100]
    assert losses[-1] < losses[0] - 0.3  # healthy first: the loss falls before the re-warm


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stable_recipe_fires_no_warning(tmp_path):
    """The stable default (pre-LN, warmup, clipping) over its first 400 steps: no CurvatureWarning at all."""
    from examples.demo import run

    result = run(["--steps", "400", "--every-n-steps", "25", "--wandb", "disabled", "--out-dir", str(tmp_path)])
    assert result.first_warning_step is None  # pytest turns any CurvatureWarning into an error as well
    assert result.loss_blowup_step is None
