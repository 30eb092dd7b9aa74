"""Tests of CurvatureMonitor with a real Trainer on CPU, a tiny GPT and real loggers.

Each test asserts on what reached the logger (metrics.csv, or the calls a WandbLogger received).
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

import curvwatch.engine.core as engine_core
import curvwatch.monitor as monitor_module
from curvwatch import Cadence, CurvatureMonitor, CurvatureNotice, CurvatureWarning, Evaluation, Sharpness
from curvwatch.capture import Capture, CapturedBlock
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import evaluate_block
from curvwatch.rules import RuleSet
from tests.ddp_script import TinyLM, loader
from tests.utils import assert_close_report

PREFIX = "curv/"
MAX_KEY = "curv/summary/max_hessian"
SKIP_KEY = "curv/summary/skipped_evaluations"


def make_trainer(tmp_path, monitor, *, max_steps=5, logger=None, callbacks=(), **kwargs):
    logger = CSVLogger(tmp_path, name="csv", version=0) if logger is None else logger
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=logger,
        callbacks=[monitor, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )


def read_rows(trainer):
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def curv_rows(rows):
    """``{step: {key: float}}`` of the CurvatureMonitor values, one dict per logged step."""
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        values = {k: float(v) for k, v in row.items() if k.startswith(PREFIX) and v != ""}
        if values:
            assert int(row["step"]) not in out, f"step {row['step']} logged twice"
            out[int(row["step"])] = values
    return out


class SpyCapture(Capture):
    """Capture that remembers the blocks it handed out, per instance."""

    instances: list[SpyCapture] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed: list[CapturedBlock] = []
        SpyCapture.instances.append(self)

    def blocks(self):
        self.handed = super().blocks()
        return self.handed


class HookCheck(Callback):
    """Records, after every batch, how many forward hooks are left on the model."""

    def __init__(self):
        self.counts = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counts.append(count_hooks(pl_module))


def count_hooks(module):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


@pytest.fixture
def spy_capture(monkeypatch):
    SpyCapture.instances = []
    monkeypatch.setattr(monitor_module, "Capture", SpyCapture)
    return SpyCapture


def test_logged_at_due_steps_and_equal_to_evaluate(tmp_path, spy_capture):
    monitor = CurvatureMonitor(
        log_level="all", every_n_train_steps=2, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    hooks = HookCheck()
    trainer = make_trainer(tmp_path, monitor, max_steps=5, log_every_n_steps=3, callbacks=[hooks])
    trainer.fit(TinyLM(), loader())
    logged = curv_rows(read_rows(trainer))
    # due steps only, although Lightning itself logs at steps 2 and 5 (log_every_n_steps=3)
    assert sorted(logged) == [0, 2, 4]
    keys = set(logged[0])
    assert all(set(v) == keys for v in logged.values())
    for block in ("layer0/attn", "layer0/ffn", "layer0/ln_1", "layer0/ln_2"):
        assert any(k.startswith(f"{PREFIX}{block}/") for k in keys), block
    for key in (
        "curv/layer0/attn/hessian/QQ/h0",
        "curv/layer0/attn/hessian/VV/h1",
        "curv/layer0/attn/ratio/VV_QQ/h0",
        "curv/layer0/ffn/hessian/W1W1",
        "curv/layer0/ffn/ratio/functional_outer",
        "curv/layer0/ln_2/ln/var_min_over_eps",
        MAX_KEY,
        "curv/summary/heterogeneity/model",
        "curv/summary/heterogeneity/layer0",
        SKIP_KEY,
    ):
        assert key in keys, key
    assert not any("/VQ" in k for k in keys), "off-diagonal pairs are not logged by default"
    assert all(math.isfinite(v) for step in logged.values() for v in step.values())
    # numbers equal evaluate_block recomputed on the captured tensors
    assert len(spy_capture.instances) == 3
    for step, capture in zip((0, 2, 4), spy_capture.instances, strict=True):
        for block in capture.handed if step == 4 else ():  # recompute one step: CPU time is shared
            expected = evaluate_block(
                block,
                lanczos=Lanczos(tol=monitor.tol, max_iter=monitor.max_iter, max_basis=None, warn=False),
                dtype=torch.float32,
            )
            for key in ("hessian/QQ/h0", "hessian/VV/h1", "hessian/W1W1", "ln/var_min", "term/x_norm"):
                if key in expected:
                    actual = logged[step][f"{PREFIX}{block.spec.name}/{key}"]
                    # a Lanczos norm (it has a residual) was warm-started when logged and is cold here: both are
                    # within tol of the norm, so they agree to about tol; the closed forms to round-off
                    rtol = 2 * monitor.tol if f"residual/{key}" in expected else 1e-5
                    assert_close_report(actual, expected[key], rtol=rtol, name=f"step {step} {block.spec.name} {key}")
        norms = {b.spec.name: logged[step].get(f"{PREFIX}{b.spec.name}/hessian/max") for b in capture.handed}
        assert logged[step][MAX_KEY] == pytest.approx(max(v for v in norms.values() if v is not None))
    # hooks exist only inside the due steps' capture
    assert hooks.counts == [0] * 5
    assert count_hooks(trainer.lightning_module) == 0
    # headline summaries are in callback_metrics, for EarlyStopping / ModelCheckpoint
    assert isinstance(trainer.callback_metrics[MAX_KEY], torch.Tensor)
    assert trainer.callback_metrics[MAX_KEY].item() == pytest.approx(logged[4][MAX_KEY], rel=1e-6)
    text = monitor.summary_text()
    assert "3 evaluation(s)" in text and "layer0/" in text and "Heterogeneity" in text


def test_gradient_accumulation_captures_last_micro_batch_and_rescales(tmp_path, spy_capture, monkeypatch):
    seen = []
    original = engine_core.evaluate_block

    def evaluate(self, **kwargs):
        seen.append(self.inputs["grad_output"])
        return original(self, **kwargs)

    monkeypatch.setattr(engine_core, "evaluate_block", evaluate)

    class WhenCaptured(Callback):
        def __init__(self):
            self.batches = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if monitor.monitor._capture_step is not None:
                self.batches.append((batch_idx, trainer.global_step))

    monitor = CurvatureMonitor(
        every_n_train_steps=2, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    when = WhenCaptured()
    trainer = make_trainer(tmp_path, monitor, max_steps=3, accumulate_grad_batches=2, callbacks=[when])
    trainer.fit(TinyLM(), loader())
    assert when.batches == [(1, 0), (5, 2)]  # last micro-batch of the windows of optimizer steps 0 and 2
    assert sorted(curv_rows(read_rows(trainer))) == [0, 2]
    captured = [b.inputs["grad_output"] for c in spy_capture.instances for b in c.handed]
    assert len(seen) == len(captured)
    for scaled, raw in zip(seen, captured, strict=True):
        torch.testing.assert_close(scaled, 2.0 * raw)


def test_hooks_removed_after_exception_in_training(tmp_path):
    class Failing(TinyLM):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.trainer.global_step == 2:
                raise RuntimeError("boom in training_step")
            return loss

    monitor = CurvatureMonitor(
        every_n_train_steps=2, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    model = Failing()
    trainer = make_trainer(tmp_path, monitor, max_steps=5)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer.fit(model, loader())
    assert count_hooks(model) == 0
    assert monitor.monitor._capture_step is None


def test_ln_collapse_warns(tmp_path):
    model = TinyLM(lr=0.0)
    with torch.no_grad():  # LayerNorm inputs ~1e-4 x their usual scale: variance far below eps
        model.model.tok_emb.weight.mul_(1e-4)
        model.model.pos_emb.weight.mul_(1e-4)
    monitor = CurvatureMonitor(
        log_level="all", warning_rules=RuleSet(collapse_patience=1, cooldown_steps=100), every_n_train_steps=2,
        cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16),
    )  # fmt: skip
    trainer = make_trainer(tmp_path, monitor, max_steps=3)
    with pytest.warns(CurvatureWarning) as record, warnings.catch_warnings():
        # LayerNorm inputs at 1e-4 of their scale leave attention's blocks degenerate (Ritz values at round-off that
        # never stand still): a Lanczos norm there may stop unconverged, which the monitor says; not this test's subject
        warnings.filterwarnings("ignore", message=".*Lanczos norms stopped at max_iter", category=CurvatureNotice)
        trainer.fit(model, loader())
    messages = [str(w.message) for w in record if issubclass(w.category, CurvatureWarning)]
    assert len(messages) == 2, messages  # ln_1 and ln_2 at step 0; cooldown silences the repeats at step 2
    assert messages[0].startswith("LayerNorm variance collapse in block 'layer0/ln_1' at step 0")
    assert messages[1].startswith("LayerNorm variance collapse in block 'layer0/ln_2' at step 0")
    assert [(a.kind, a.step) for a in monitor.alerts] == [("ln_collapse", 0)] * 2
    logged = curv_rows(read_rows(trainer))
    assert logged[0]["curv/layer0/ln_1/ln/var_min_over_eps"] < 5.0
    assert logged[2]["curv/summary/warnings"] == 2.0
    assert "ln_collapse in layer0/ln_1" in monitor.summary_text()


def test_healthy_run_does_not_warn(tmp_path):
    monitor = CurvatureMonitor(
        every_n_train_steps=1, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    trainer = make_trainer(tmp_path, monitor, max_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CurvatureWarning)
        trainer.fit(TinyLM(), loader())
    assert not [w for w in caught if issubclass(w.category, CurvatureWarning)]
    assert monitor.alerts == [] and monitor.book.evaluations == 4


def _raise(self, **kwargs):
    raise FloatingPointError("induced evaluation failure")


def test_on_error_warn_skips_and_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_core, "evaluate_block", _raise)
    monitor = CurvatureMonitor(
        every_n_train_steps=2, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    trainer = make_trainer(tmp_path, monitor, max_steps=5)
    with pytest.warns(CurvatureNotice, match=r"skipped the evaluation at step \d: evaluating block 'layer0/attn'"):
        trainer.fit(TinyLM(), loader())
    assert trainer.global_step == 5  # training went on
    logged = curv_rows(read_rows(trainer))
    assert {step: v[SKIP_KEY] for step, v in logged.items()} == {0: 1.0, 2: 2.0, 4: 3.0}
    assert not any(MAX_KEY in v for v in logged.values())
    assert trainer.callback_metrics[SKIP_KEY].item() == 3.0
    assert count_hooks(trainer.lightning_module) == 0
    assert "induced evaluation failure" in monitor.summary_text()


def test_on_error_raise(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_core, "evaluate_block", _raise)
    model = TinyLM()
    monitor = CurvatureMonitor(every_n_train_steps=2, on_error="raise", cadence=Cadence(max_overhead=None))
    trainer = make_trainer(tmp_path, monitor, max_steps=3)
    with pytest.raises(FloatingPointError, match="induced evaluation failure"):
        trainer.fit(model, loader())
    assert count_hooks(model) == 0


def test_resume_restores_state(tmp_path):
    first = CurvatureMonitor(
        every_n_train_steps=2, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    trainer = make_trainer(tmp_path / "a", first, max_steps=3)
    trainer.fit(TinyLM(), loader(n=12))  # 3 batches: the checkpoint is at an epoch end
    ckpt = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = first.state_dict()
    assert saved["last_step"] == 2 and saved["evaluations"] == 2
    assert saved["rules"]["points"]

    class Snapshot(Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = second.state_dict()

    second = CurvatureMonitor(
        every_n_train_steps=2, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    snapshot = Snapshot()
    trainer = make_trainer(tmp_path / "b", second, max_steps=5, callbacks=[snapshot])
    trainer.fit(TinyLM(), loader(n=12), ckpt_path=ckpt)
    # counters, baselines, cooldowns; the overhead budget's training clock runs on from the saved value
    assert snapshot.state["train_seconds"] == pytest.approx(saved["train_seconds"], abs=0.5)
    assert {k: v for k, v in snapshot.state.items() if k != "train_seconds"} == {
        k: v for k, v in saved.items() if k != "train_seconds"
    }
    assert sorted(curv_rows(read_rows(trainer))) == [4]  # step 3 is not due; nothing repeated
    assert second.book.evaluations == 3
    assert curv_rows(read_rows(trainer))[4]["curv/summary/evaluations"] == 3.0


def test_a_reused_monitor_starts_each_fit_afresh_and_resumes_from_a_checkpoint(tmp_path):
    """Issue 26: one instance given to a second Trainer (same model, then a new one) evaluates that fit's steps
    0, 2, 4 with counters of its own and the real-loss stability keys of the new model; given a ckpt_path it
    still resumes the schedule and counters from the checkpoint."""
    monitor = CurvatureMonitor(
        log_level="all",
        every_n_train_steps=2,
        cadence=Cadence(max_overhead=None),
        evaluation=Evaluation(max_tokens=16),
        sharpness=Sharpness(samples=2),
    )
    stability = "curv/layer1/ffn/stability/W1W1"
    model = TinyLM(n_layer=2)
    trainer = make_trainer(tmp_path / "first", monitor, max_steps=3)
    trainer.fit(model, loader(n=12))  # 3 batches: the checkpoint is at an epoch end
    ckpt = tmp_path / "first.ckpt"
    trainer.save_checkpoint(ckpt)
    for name, module in (("same_model", model), ("new_model", TinyLM(n_layer=2))):
        trainer = make_trainer(tmp_path / name, monitor, max_steps=5)
        trainer.fit(module, loader(n=12))
        rows = curv_rows(read_rows(trainer))
        assert sorted(rows) == [0, 2, 4], name
        assert [rows[s]["curv/summary/evaluations"] for s in (0, 2, 4)] == [1.0, 2.0, 3.0], name
        assert all(stability in rows[s] for s in (0, 2, 4)), name  # the maps belong to this fit's model
        assert monitor.book.evaluations == 3 and monitor.schedule.last_step == 4
    trainer = make_trainer(tmp_path / "resumed", monitor, max_steps=5)
    trainer.fit(TinyLM(n_layer=2), loader(n=12), ckpt_path=ckpt)
    rows = curv_rows(read_rows(trainer))
    assert sorted(rows) == [4] and rows[4]["curv/summary/evaluations"] == 3.0  # the checkpoint had 0 and 2


def test_setup_checks(tmp_path):
    class NoBlocks(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

    monitor = CurvatureMonitor()
    trainer = SimpleNamespace(strategy=object())
    with pytest.raises(ValueError, match="find_blocks found no known Transformer layer in NoBlocks"):
        monitor.setup(trainer, NoBlocks(), "fit")
    monitor.setup(trainer, NoBlocks(), "validate")  # other stages: nothing to check

    class DeepSpeedStrategy:  # stands in for lightning's, matched by class name along the MRO
        pass

    class MyDeepSpeed(DeepSpeedStrategy):
        pass

    with pytest.raises(ValueError, match="does not support strategy=MyDeepSpeed.*Use strategy='ddp'"):
        monitor.setup(SimpleNamespace(strategy=MyDeepSpeed()), TinyLM(), "fit")


def test_wandb_offline_logger(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="curvwatch-test")
    calls = []
    original = logger.log_metrics

    def spy(metrics, step=None):
        calls.append((dict(metrics), step))
        return original(metrics, step=step)

    monkeypatch.setattr(logger, "log_metrics", spy)
    monitor = CurvatureMonitor(
        every_n_train_steps=2, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    trainer = make_trainer(tmp_path, monitor, max_steps=5, logger=logger, log_every_n_steps=50)
    try:
        trainer.fit(TinyLM(), loader())
        curv = [(step, m) for m, step in calls if any(k.startswith(PREFIX) for k in m)]
        numbers = [(step, m) for step, m in curv if MAX_KEY in m]
        assert [step for step, _ in numbers] == [0, 2, 4]
        assert all(math.isfinite(m[MAX_KEY]) for _, m in numbers)
        images = [(step, m) for step, m in curv if "curv/summary/heatmap" in m]
        if importlib_util_find("matplotlib"):
            assert [step for step, _ in images] == [0, 2, 4]
            assert isinstance(images[0][1]["curv/summary/heatmap"][0], wandb.Image)
        run = logger.experiment
        assert run.summary.get(MAX_KEY) is not None
    finally:
        wandb.finish()


def importlib_util_find(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _run_ddp(tmp_path, *extra):
    script = Path(__file__).with_name("ddp_script.py")
    import socket

    with socket.socket() as sock:  # a fresh free port per run: back-to-back runs must not race for one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parents[1],
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}; stderr tail:\n{proc.stderr[-4000:]}"
    return json.loads((tmp_path / "result.json").read_text())


def test_ddp_two_cpu_processes(tmp_path):
    result = _run_ddp(tmp_path / "ok")
    assert result["world_size"] == 2
    assert result["steps"] == [0, 2, 4]  # one set of steps, logged once, by rank zero
    assert all(math.isfinite(v) for v in result["values"])
    # a failure on rank 1 alone: both ranks skip, nothing hangs, rank zero logs the counter
    result = _run_ddp(tmp_path / "fail", "--fail-rank", "1")
    assert result["steps"] == []
    assert result["skipped"] == [1.0, 2.0, 3.0]
    # the overhead budget: the ranks agree (one all-reduce per due step); a huge budget keeps every due
    # step, a tiny one only step 0 (the evaluation there costs more than 1e-9 of any training time)
    assert _run_ddp(tmp_path / "loose", "--max-overhead", "1e9")["steps"] == [0, 2, 4]
    assert _run_ddp(tmp_path / "tight", "--max-overhead", "1e-9")["steps"] == [0]


def test_overhead_budget_skips_due_steps_and_logs_the_fraction(tmp_path, caplog):
    logged = {}
    for name, budget in (("loose", 1e9), ("tight", 1e-9)):
        monitor = CurvatureMonitor(
            every_n_train_steps=1,
            log_heatmap=False,
            cadence=Cadence(max_overhead=budget),
            evaluation=Evaluation(max_tokens=16),
        )
        trainer = make_trainer(tmp_path / name, monitor, max_steps=4)
        with caplog.at_level("INFO"):
            trainer.fit(TinyLM(), loader())
        logged[name] = curv_rows(read_rows(trainer))
        assert monitor.schedule.eval_seconds > 0 and monitor.schedule.train_seconds > 0
        skips = [r for r in caplog.records if "CurvatureMonitor: skipping due step" in r.getMessage()]
        assert len(skips) == (1 if name == "tight" else 0)  # said once, with the way out
        caplog.clear()
    assert "(or cadence=curvwatch.Cadence(max_overhead=None)) for a fixed schedule" in skips[0].getMessage()
    assert sorted(logged["loose"]) == [0, 1, 2, 3]
    assert sorted(logged["tight"]) == [0]  # step 0 always; afterwards the budget is spent
    fractions = [row[f"{PREFIX}summary/overhead"] for row in logged["loose"].values()]
    assert all(float(f) > 0 for f in fractions)


def _wandb_alerts_of_a_collapsed_run(tmp_path, monkeypatch, monitor, max_steps: int, match: str) -> list[dict]:
    """Train TinyLM with LayerNorm inputs far below eps (as in test_ln_collapse_warns) under an offline W&B logger;
    the keyword arguments of every ``run.alert`` call."""
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="curvwatch-test")
    sent: list[dict] = []
    try:
        monkeypatch.setattr(type(logger.experiment), "alert", lambda self, **kw: sent.append(kw), raising=False)
        model = TinyLM(lr=0.0)
        with torch.no_grad():
            model.model.tok_emb.weight.mul_(1e-4)
            model.model.pos_emb.weight.mul_(1e-4)
        trainer = make_trainer(tmp_path, monitor, max_steps=max_steps, logger=logger)
        with pytest.warns(CurvatureWarning, match=match):
            trainer.fit(model, loader())
    finally:
        wandb.finish()
    assert all(kw["level"] == wandb.AlertLevel.WARN for kw in sent)
    return sent


def test_collapse_is_sent_as_wandb_alert(tmp_path, monkeypatch):
    monitor = CurvatureMonitor(
        warning_rules=RuleSet(collapse_patience=1), every_n_train_steps=2, cadence=Cadence(max_overhead=None),
        evaluation=Evaluation(max_tokens=16),
    )  # fmt: skip
    sent = _wandb_alerts_of_a_collapsed_run(tmp_path, monkeypatch, monitor, max_steps=1, match="")
    assert len(sent) == 2
    assert "layer0/ln_1" in sent[0]["text"] and "collapse" in sent[0]["title"].lower()


def test_suite_rule_from_the_default_terms_tier_is_sent_as_wandb_alert(tmp_path, monkeypatch):
    """The default rules (``warning_rules="suite"``) fed by default terms-only evaluations (``terms_keys="warnings"``):
    the collapse warning reaches W&B as an alert that says what it saw, since when, how sure and what to try."""
    monitor = CurvatureMonitor(
        every_n_train_steps=100,
        log_heatmap=False,
        cadence=Cadence(max_overhead=None, terms_every_n_train_steps=1),
        evaluation=Evaluation(max_tokens=16),
    )
    assert monitor.terms_keys.value == "warnings" and monitor.warning_rules.value == "suite"
    sent = _wandb_alerts_of_a_collapsed_run(tmp_path, monkeypatch, monitor, max_steps=4, match="variance collapse")
    collapse = [kw for kw in sent if kw["title"] == "curvwatch: ln collapse"]
    assert collapse
    text = collapse[0]["text"]  # fired at step 2: patience of 3 evaluations (steps 0, 1, 2; step 0 is full)
    assert "'layer0/ln_1' at step 2" in text and "since step 0 (3 evaluations)" in text
    assert "Confidence: high" in text and "raise the LayerNorm eps" in text


def test_kinds_hessian_only_logs_the_total_and_the_exact_outer_norms(tmp_path):
    """``kinds=("hessian",)``: no iterative outer/functional norms, the total equals the default run's."""
    logged = {}
    for name, kinds in (("all", ("outer", "functional", "hessian")), ("hessian", ("hessian",))):
        torch.manual_seed(0)
        monitor = CurvatureMonitor(
            log_level="all",
            every_n_train_steps=1,
            cadence=Cadence(max_overhead=None),
            evaluation=Evaluation(max_tokens=16, parts=kinds, tol=0.0),
        )
        trainer = make_trainer(tmp_path / name, monitor, max_steps=2)
        trainer.fit(TinyLM(), loader())
        logged[name] = curv_rows(read_rows(trainer))[1]
    only = logged["hessian"]
    assert f"{PREFIX}layer0/attn/hessian/QQ/h0" in only
    assert f"{PREFIX}layer0/attn/outer/QQ/h0" not in only and f"{PREFIX}layer0/ffn/functional/W1W1" not in only
    assert f"{PREFIX}layer0/attn/outer/VV/h0" in only  # exact, no Lanczos: kept
    for key in (f"{PREFIX}layer0/attn/hessian/QQ/h0", f"{PREFIX}layer0/ffn/hessian/W1W1"):
        assert_close_report(float(only[key]), float(logged["all"][key]), 1e-4, name=key)


class LanczosSpy(Callback):
    """Counts the Lanczos runs of the closed forms per optimizer step (wraps ``solver.lanczos.solve``, which every run
    goes through: ``lanczos_max_abs`` and the kernels' runs in ``solver.plan``)."""

    def __init__(self, monkeypatch):
        from curvwatch.closed_form.solver import lanczos as _lanczos
        from curvwatch.closed_form.solver import plan as _plan

        self.runs: dict[int, int] = {}
        self.step = -1
        original = _lanczos.solve

        def spy(runs):
            self.runs[self.step] = self.runs.get(self.step, 0) + len(runs)
            return original(runs)

        monkeypatch.setattr(_lanczos, "solve", spy)
        monkeypatch.setattr(_plan, "solve", spy)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step


def _needs_lanczos(key: str) -> bool:
    """Whether a logged key is an iterative norm or derived from block norms (absent on terms-only steps)."""
    iterative = any(f"/{p}" in key for p in ("QQ", "KK", "W1W1")) and "/bound/" not in key
    derived = key.endswith("/hessian/max") or "/ratio/" in key or "heterogeneity" in key
    return iterative or derived or key in (MAX_KEY, f"{PREFIX}summary/eval_time_s")


def test_terms_only_evaluations_between_full_ones(tmp_path, spy_capture, monkeypatch):
    """``terms_every_n_train_steps``: no Lanczos on those steps, exact numbers equal to ``evaluate``, and
    nothing derived from block norms (which a maximum over the exact pairs alone would fake)."""
    monitor = CurvatureMonitor(
        log_level="all",
        every_n_train_steps=3,
        log_heatmap=False,
        cadence=Cadence(max_overhead=None, terms_every_n_train_steps=1),
        evaluation=Evaluation(terms_keys="all", max_tokens=16),
    )
    lanczos = LanczosSpy(monkeypatch)
    trainer = make_trainer(tmp_path, monitor, max_steps=5, callbacks=[lanczos])
    trainer.fit(TinyLM(), loader())
    logged = curv_rows(read_rows(trainer))
    assert sorted(logged) == [0, 1, 2, 3, 4]
    full, terms = (0, 3), (1, 2, 4)
    assert sorted(lanczos.runs) == list(full) and all(n > 0 for n in lanczos.runs.values())
    for step in full:
        row = logged[step]
        for key in ("layer0/attn/hessian/QQ/h0", "layer0/ffn/hessian/W1W1", "layer0/attn/hessian/max"):
            assert f"{PREFIX}{key}" in row, (step, key)
        assert MAX_KEY in row and f"{PREFIX}summary/eval_time_s" in row
    for step in terms:
        row = logged[step]
        for key in (
            "layer0/attn/term/x_norm6",
            "layer0/attn/bound/QQ/h0",
            "layer0/attn/outer/VV/h0",
            "layer0/attn/hessian/VV/h1",
            "layer0/ffn/hessian/W2W2",
            "layer0/ln_1/ln/var_min_over_eps",
            "summary/ln/var_min_over_eps",
            "summary/terms_eval_time_s",
            "summary/terms_evaluations",
        ):
            assert f"{PREFIX}{key}" in row, (step, key)
        assert not [k for k in row if _needs_lanczos(k)], step
    assert logged[4][f"{PREFIX}summary/terms_evaluations"] == 3.0
    assert logged[4][f"{PREFIX}summary/evaluations"] == 2.0
    # the exact numbers of a terms-only step equal evaluate_block on the captured tensors
    capture = spy_capture.instances[4]  # one capture per step: 0, 1, 2, 3, 4
    for block in capture.handed:
        expected = evaluate_block(block, dtype=torch.float32, pairs=("VV", "W2W2"))
        for key in ("hessian/VV/h1", "hessian/W2W2", "ln/var_min", "term/x_norm6", "bound/QQ/h0"):
            if key in expected:
                actual = logged[4][f"{PREFIX}{block.spec.name}/{key}"]
                assert_close_report(actual, expected[key], rtol=1e-5, name=f"{block.spec.name} {key}")
    # the headline norm summaries stay those of the last full evaluation
    assert trainer.callback_metrics[MAX_KEY].item() == pytest.approx(logged[3][MAX_KEY], rel=1e-6)
    assert monitor.state_dict()["terms_evaluations"] == 3
    assert "2 evaluation(s), 3 terms-only" in monitor.summary_text()


def test_default_terms_only_evaluations_compute_what_the_rules_read(tmp_path, spy_capture):
    """``terms_keys="warnings"`` (default): a terms-only step logs the keys the warning rules read, the same numbers
    as ``terms_keys="all"`` computes (``evaluate_block``), no bound and no FFN block; the rules see them."""
    monitor = CurvatureMonitor(
        log_level="all",
        every_n_train_steps=3,
        log_heatmap=False,
        cadence=Cadence(max_overhead=None, terms_every_n_train_steps=1),
        evaluation=Evaluation(max_tokens=16),
    )
    trainer = make_trainer(tmp_path, monitor, max_steps=5)
    trainer.fit(TinyLM(), loader())
    logged = curv_rows(read_rows(trainer))
    row = logged[4]
    blocks = {k[len(PREFIX) :].split("/", 2)[1] for k in row if k.startswith(f"{PREFIX}layer0/")}
    assert blocks == {"attn", "ln_1", "ln_2"}, blocks  # the FFN has nothing the default rules read
    attn = sorted(k[len(PREFIX) + len("layer0/attn/") :] for k in row if k.startswith(f"{PREFIX}layer0/attn/"))
    heads = [f"h{h}" for h in range(2)]
    expected_keys = sorted(
        ["term/x_norm", "term/x_norm6"]
        + [f"{part}/VV/{h}" for part in ("outer", "functional", "hessian") for h in heads]
        + [f"term/{t}/{h}" for t in ("softmax_jac_norm", "wq_norm", "wk_norm") for h in heads]
    )
    assert attn == expected_keys
    ln = sorted(k.rsplit("/", 1)[1] for k in row if k.startswith(f"{PREFIX}layer0/ln_1/"))
    assert ln == sorted(["var_min", "var_mean", "inv_std_max", "inv_var_max", "var_min_over_eps", "collapsed_fraction"])
    assert f"{PREFIX}summary/ln/var_min_over_eps" in row and f"{PREFIX}summary/terms_eval_time_s" in row
    capture = spy_capture.instances[4]
    for block in capture.handed:
        everything = evaluate_block(block, dtype=torch.float32, pairs=("VV",))
        for key, value in row.items():
            if key.startswith(f"{PREFIX}{block.spec.name}/"):
                rel = key[len(f"{PREFIX}{block.spec.name}/") :]
                rel = rel if rel in everything else rel.split("/", 1)[1]  # ln/var_min -> the kernel's var_min
                assert_close_report(value, everything[rel], rtol=1e-6, name=f"{block.spec.name} {rel}")
    assert CurvatureMonitor(evaluation=Evaluation(terms_keys="all")).terms_keys.value == "all"
    with pytest.raises(ValueError, match=r"Invalid curvwatch.Evaluation\(terms_keys='bounds'\): Must be one of"):
        CurvatureMonitor(evaluation=Evaluation(terms_keys="bounds"))


def test_terms_only_steps_warn_on_layernorm_collapse(tmp_path):
    model = TinyLM(lr=0.0)
    with torch.no_grad():  # LayerNorm inputs far below eps, as in test_ln_collapse_warns
        model.model.tok_emb.weight.mul_(1e-4)
        model.model.pos_emb.weight.mul_(1e-4)
    monitor = CurvatureMonitor(
        warning_rules=RuleSet(collapse_patience=1, cooldown_steps=0), every_n_train_steps=100,
        cadence=Cadence(max_overhead=None, terms_every_n_train_steps=1), evaluation=Evaluation(max_tokens=16),
    )  # fmt: skip
    trainer = make_trainer(tmp_path, monitor, max_steps=3)
    with pytest.warns(CurvatureWarning):
        trainer.fit(model, loader())
    assert [(a.kind, a.step) for a in monitor.alerts] == [("ln_collapse", s) for s in (0, 0, 1, 1, 2, 2)]
    assert monitor.book.evaluations == 1 and monitor.book.terms_evaluations == 2


def test_budget_falls_back_to_terms_only(tmp_path, monkeypatch):
    """A due full evaluation the budget cannot afford becomes terms-only where those are due too."""
    monitor = CurvatureMonitor(
        every_n_train_steps=1,
        log_heatmap=False,
        cadence=Cadence(max_overhead=0.01, terms_every_n_train_steps=2),
        evaluation=Evaluation(max_tokens=16),
    )
    monkeypatch.setattr(
        monitor.schedule, "affordable", lambda agree=None, step=None: (monitor.book.evaluations == 0, True)
    )
    trainer = make_trainer(tmp_path, monitor, max_steps=5)
    trainer.fit(TinyLM(), loader())
    logged = curv_rows(read_rows(trainer))
    assert sorted(logged) == [0, 2, 4]  # step 0 full; odd steps: full unaffordable, terms not due
    assert MAX_KEY in logged[0] and MAX_KEY not in logged[2] and MAX_KEY not in logged[4]
    assert monitor.book.evaluations == 1 and monitor.book.terms_evaluations == 2


def test_default_terms_tier_every_10_steps_within_its_own_budget(tmp_path, monkeypatch):
    """The default feeds the warning rules: terms-only evaluations every 10 steps, within 4% of training."""
    monitor = CurvatureMonitor(log_heatmap=False, evaluation=Evaluation(max_tokens=16))
    assert (monitor.schedule.terms_every_n_train_steps, monitor.schedule.terms_overhead) == (10, 0.04)
    trainer = make_trainer(tmp_path, monitor, max_steps=31)
    trainer.fit(TinyLM(), loader(n=64))
    logged = curv_rows(read_rows(trainer))
    assert set(logged) <= {0, 10, 20, 30} and 0 in logged and MAX_KEY in logged[0]
    assert all(MAX_KEY not in logged[s] for s in logged if s)  # the full tier's next due step is 200
    s = monitor.schedule  # the budget held at every decision: spent before the last one fitted 4% of training
    assert s.terms_seconds - s.last_terms_seconds <= 0.04 * s.train_seconds
    # the same run with the budget out of the way: every 10th step is a terms-only evaluation
    free = CurvatureMonitor(log_level="all", log_heatmap=False, evaluation=Evaluation(max_tokens=16))
    monkeypatch.setattr(free.schedule, "affordable", lambda agree=None, step=None: (True, True))
    trainer = make_trainer(tmp_path / "free", free, max_steps=31)
    trainer.fit(TinyLM(), loader(n=64))
    logged = curv_rows(read_rows(trainer))
    assert sorted(logged) == [0, 10, 20, 30] and free.book.terms_evaluations == 3
    assert "curv/summary/terms_evaluations" in logged[30] and "curv/layer0/attn/term/x_norm" in logged[10]


def test_a_signals_evaluation_captures_only_the_blocks_it_evaluates(tmp_path, monkeypatch):
    """With ``terms_keys="warnings"`` (default) a terms-only evaluation hooks and copies only the blocks that have
    something to compute (attention, LayerNorms; an FFN only where a rule reads its ``W2W2``): an FFN's input, output
    gradient and weights are not copied for nothing. The keys are those of capturing every block."""
    from curvwatch.rules import RuleSet

    captured: list[list[str]] = []

    class Recording(Capture):
        def __init__(self, specs, *args, **kwargs):
            captured.append([s.name for s in specs])
            super().__init__(specs, *args, **kwargs)

    monkeypatch.setattr(monitor_module, "Capture", Recording)
    rows = {}
    for w2w2 in (0.0, 1.0):
        captured.clear()
        monitor = CurvatureMonitor(
            every_n_train_steps=100,
            warning_rules=RuleSet(w2w2_growth=w2w2),
            log_heatmap=False,
            log_level="all",
            cadence=Cadence(terms_every_n_train_steps=2, max_overhead=None),
            evaluation=Evaluation(max_tokens=16),
        )
        trainer = make_trainer(tmp_path / str(w2w2), monitor, max_steps=3)
        torch.manual_seed(0)
        trainer.fit(TinyLM(), loader())
        full, terms = captured  # step 0 full, step 2 terms-only
        assert any("ffn" in n for n in full)
        assert any("attn" in n for n in terms) and any("ln" in n for n in terms)
        assert any("ffn" in n for n in terms) == (w2w2 > 0)
        rows[w2w2] = curv_rows(read_rows(trainer))[2]
    # the blocks both evaluations share log the same keys and numbers
    shared = {k: v for k, v in rows[1.0].items() if "ffn" not in k and "summary" not in k}
    assert shared and all(rows[0.0][k] == v for k, v in shared.items())


def test_default_floor_makes_a_terms_step_a_full_evaluation_after_the_gap(tmp_path):
    """The default schedule's floor through the callback: a terms-grid step ``max_gap`` steps after the last full
    evaluation is a full one (here a gap of 20 and no limit on the total, so that a tiny model's costs do not decide;
    ``tests/test_schedule.py`` holds the budgets)."""
    monitor = CurvatureMonitor(log_heatmap=False, evaluation=Evaluation(max_tokens=16))
    s = monitor.schedule
    s.max_gap, s.total_overhead, s.terms_overhead = 20, 1e9, 1e9
    trainer = make_trainer(tmp_path, monitor, max_steps=31)
    trainer.fit(TinyLM(), loader(n=64))
    logged = curv_rows(read_rows(trainer))
    assert sorted(logged) == [0, 10, 20, 30]
    assert [k for k in sorted(logged) if MAX_KEY in logged[k]] == [0, 20]  # full at 0 and at the gap; 10, 30 terms
    assert (s.last_full_step, s.last_step, s.full_runs) == (20, 30, 2)
    assert monitor.book.evaluations == 2 and monitor.book.terms_evaluations == 2


def test_unconverged_lanczos_norms_are_reported_and_warned_once(tmp_path):
    """max_iter=2 cannot reach tol=1e-2: the run logs how many norms stopped early and each block's worst
    relative residual, keeps the per-norm residual keys out of the logs, and warns once, at the first
    warm-started evaluation (step 1; a cold start may need more steps once). At the defaults the same model
    converges: no warning, 0 unconverged."""
    monitor = CurvatureMonitor(
        log_level="all",
        every_n_train_steps=1,
        cadence=Cadence(max_overhead=None),
        evaluation=Evaluation(max_tokens=16, max_iter=2),
    )
    trainer = make_trainer(tmp_path, monitor, max_steps=3)
    with pytest.warns(CurvatureNotice, match=r"Lanczos norms stopped at max_iter=2 before reaching tol=0.01") as rec:
        trainer.fit(TinyLM(), loader())
    stopped = [str(w.message) for w in rec if "Lanczos norms stopped" in str(w.message)]
    assert len(stopped) == 1 and "at step 1," in stopped[0]  # once per run, not per evaluation; not the cold one
    logged = curv_rows(read_rows(trainer))
    assert sorted(logged) == [0, 1, 2]
    for step in logged.values():
        assert 0 < step["curv/summary/lanczos/unconverged"] <= step["curv/summary/lanczos/norms"]
        assert step["curv/summary/lanczos/rel_residual_max"] > 1e-2
        per_block = [v for k, v in step.items() if k.endswith("/lanczos/rel_residual_max") and "summary" not in k]
        assert len(per_block) == 2  # attention and FFN; LayerNorm norms are exact
        assert max(per_block) == step["curv/summary/lanczos/rel_residual_max"]
        assert not any("/residual/" in k for k in step)
    assert "norms stopped at max_iter=2 above tol=0.01" in monitor.summary_text()

    monitor = CurvatureMonitor(
        log_level="all", every_n_train_steps=1, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16)
    )
    trainer = make_trainer(tmp_path / "defaults", monitor, max_steps=2)
    trainer.fit(TinyLM(), loader())  # pytest turns any warning into an error
    for step in curv_rows(read_rows(trainer)).values():
        assert step["curv/summary/lanczos/unconverged"] == 0
        assert step["curv/summary/lanczos/rel_residual_max"] <= 1e-2
    assert "Lanczos" not in monitor.summary_text()


def test_notices_and_instability_warnings_have_separate_categories(tmp_path):
    """Issue 26: an unconverged-Lanczos notice is a CurvatureNotice, a LayerNorm collapse a CurvatureWarning; a
    filter that turns CurvatureWarning into errors does not trip on the notice (the categories are siblings)."""
    torch.manual_seed(0)
    model = TinyLM()
    with torch.no_grad():  # LayerNorm inputs ~1e-4 x their usual scale: variance far below eps
        model.model.tok_emb.weight.mul_(1e-4)
        model.model.pos_emb.weight.mul_(1e-4)
    monitor = CurvatureMonitor(
        warning_rules=RuleSet(collapse_patience=1), every_n_train_steps=1, cadence=Cadence(max_overhead=None),
        evaluation=Evaluation(max_tokens=16, max_iter=2),
    )  # fmt: skip
    trainer = make_trainer(tmp_path / "both", monitor, max_steps=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", CurvatureWarning)
        warnings.simplefilter("always", CurvatureNotice)
        trainer.fit(model, loader())
    by_category = {c: [str(w.message) for w in record if w.category is c] for c in (CurvatureWarning, CurvatureNotice)}
    assert [m.split(" in block")[0] for m in by_category[CurvatureWarning]] == ["LayerNorm variance collapse"] * 2
    assert len(by_category[CurvatureNotice]) == 1
    assert "Lanczos norms stopped at max_iter=2" in by_category[CurvatureNotice][0]
    assert not issubclass(CurvatureNotice, CurvatureWarning) and not issubclass(CurvatureWarning, CurvatureNotice)

    monitor = CurvatureMonitor(
        every_n_train_steps=1, cadence=Cadence(max_overhead=None), evaluation=Evaluation(max_tokens=16, max_iter=2)
    )
    trainer = make_trainer(tmp_path / "notice", monitor, max_steps=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("error", CurvatureWarning)  # a pager on instabilities: a notice must not page
        warnings.simplefilter("always", CurvatureNotice)
        trainer.fit(TinyLM(), loader())
    assert [w.category for w in record if "Lanczos" in str(w.message)] == [CurvatureNotice]
    assert sorted(curv_rows(read_rows(trainer))) == [0, 1, 2] and not monitor.alerts


def test_a_chosen_cadence_is_honoured_and_its_cost_said_once(tmp_path):
    """Issue 12's defect: every_n_train_steps=2 on a 12-step run evaluated only step 0 (the default 1% budget
    skipped the rest). A chosen cadence is now kept as it is; its cost is said once, with the ways to cap it."""
    monitor = CurvatureMonitor(every_n_train_steps=2, log_heatmap=False, evaluation=Evaluation(max_tokens=16))
    assert monitor.max_overhead is None and CurvatureMonitor().max_overhead == 0.01
    trainer = make_trainer(tmp_path, monitor, max_steps=12)
    with pytest.warns(CurvatureNotice, match=r"every_n_train_steps=2 is expensive here.*max_overhead=0.01") as seen:
        trainer.fit(TinyLM(), loader(n=48))
    assert sum("is expensive here" in str(w.message) for w in seen) == 1
    assert sorted(curv_rows(read_rows(trainer))) == [0, 2, 4, 6, 8, 10]
    # with the budget asked for explicitly it governs any cadence; max_overhead=None: fixed, and no note
    assert CurvatureMonitor(every_n_train_steps=2, cadence=Cadence(max_overhead=0.05)).schedule.max_overhead == 0.05
    assert not CurvatureMonitor(every_n_train_steps=2, cadence=Cadence(max_overhead=None)).schedule.note_cost


def test_suite_rules_are_the_default_and_warn_on_a_collapse(tmp_path):
    """The default warning rules (curvwatch.rules.RuleSet, designed on the instability suite) read the logged
    numbers: a LayerNorm input far below eps warns after collapse_patience=3 evaluations, once per block; the rules'
    state is checkpointed."""
    model = TinyLM(lr=0.0)
    with torch.no_grad():
        model.model.tok_emb.weight.mul_(1e-4)
        model.model.pos_emb.weight.mul_(1e-4)
    monitor = CurvatureMonitor(
        every_n_train_steps=1,
        log_heatmap=False,
        cadence=Cadence(max_overhead=None),
        evaluation=Evaluation(max_tokens=16),
    )
    assert monitor.warning_rules == "suite"
    trainer = make_trainer(tmp_path, monitor, max_steps=4)
    with pytest.warns(CurvatureWarning) as record:
        trainer.fit(model, loader())
    messages = [str(w.message) for w in record if issubclass(w.category, CurvatureWarning)]
    assert len(messages) == 2 and "variance collapse in block 'layer0/ln_1' at step 2" in messages[0], messages
    assert "since step 0 (3 evaluations)" in messages[0] and "Lower the weight decay" in messages[0]
    assert [(a.kind, a.step) for a in monitor.alerts] == [("ln_collapse", 2)] * 2
    assert curv_rows(read_rows(trainer))[3]["curv/summary/warnings"] == 2.0
    state = monitor.state_dict()
    again = CurvatureMonitor(every_n_train_steps=1, cadence=Cadence(max_overhead=None))
    again.load_state_dict(state)
    assert [a.block for a in again.alerts] == [a.block for a in monitor.alerts]
    with pytest.raises(ValueError, match="Invalid warning_rules='some'. Must be 'suite', 'none'"):
        CurvatureMonitor(warning_rules="some")
