"""The monitor's settings: the groups, where each is validated, and every validation message."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from curvwatch import Cadence, CurvatureMonitor, Evaluation, Monitor, Sharpness, Warnings, find_blocks
from curvwatch.config import known_pairs, resolve
from tests.ddp_script import TinyLM


def test_the_groups_set_the_monitor():
    monitor = CurvatureMonitor(
        cadence=Cadence(max_overhead=0.05, terms_every_n_train_steps=None),
        evaluation=Evaluation(max_tokens=7, tol=1e-3, pairs=["VV", "QQ"], parts=("hessian",), dtype="float64"),
        warning_rules=Warnings(rules="none", warn=False),
        sharpness=Sharpness(samples=3, logits_module="model.head"),
    )
    core = monitor.monitor
    assert core.engine.max_tokens == 7 and core.engine.lanczos.tol == 1e-3 and core.engine.dtype == "float64"
    assert core.engine.pairs == ("VV", "QQ") and core.engine.parts == ("hessian",)
    assert core.schedule.max_overhead == 0.05 and core.schedule.terms_every_n_train_steps is None
    assert core.book.rules is None and not core.settings.warnings.warn
    assert core.real_loss.samples == 3 and core.real_loss.logits_name == "model.head"
    assert resolve(warning_rules="suite").rules is not None


def test_the_callback_takes_its_own_settings_only():
    import inspect

    params = [p for p in inspect.signature(CurvatureMonitor).parameters.values()]
    assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params) and len(params) <= 11
    for monitor_only in ("optimizer", "log", "accumulate_grad_batches", "grad_scaler"):
        with pytest.raises(TypeError, match=monitor_only):
            CurvatureMonitor(**{monitor_only: 1})


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        # each group reports a bad value where it is built, naming the group
        (lambda: Evaluation(pairs=["XX"]), ValueError,
         "Invalid curvwatch.Evaluation(pairs=['XX']): unknown pair name 'XX'. Known pair names: ['"),
        (lambda: Evaluation(pairs=["VV", "W1W4"]), ValueError, "unknown pair name 'W1W4'. Known pair names:"),
        (lambda: Evaluation(pairs=["W1W4"]), ValueError, "Did you mean ["),
        (lambda: Evaluation(pairs="some"), ValueError,
         "Invalid curvwatch.Evaluation(pairs='some'): Must be 'diagonal', 'all'"),
        (lambda: Evaluation(parts=["gn"]), ValueError,
         "Invalid curvwatch.Evaluation(parts=['gn']): Must be a non-empty subset of ('outer',"),
        (lambda: Evaluation(parts=()), ValueError,
         "Invalid curvwatch.Evaluation(parts=()): Must be a non-empty subset"),
        (lambda: Evaluation(terms_keys="some"), ValueError,
         "Invalid curvwatch.Evaluation(terms_keys='some'): Must be one of ['warnings', 'all']"),
        (lambda: Evaluation(dtype="float16"), ValueError,
         "Invalid curvwatch.Evaluation(dtype='float16'): Must be one of ['float32', 'float64']"),
        (lambda: Evaluation(max_tokens=-1), ValueError,
         "Invalid curvwatch.Evaluation(max_tokens=-1): Must be an int >= 1."),
        (lambda: Evaluation(max_iter=0), ValueError, "Invalid curvwatch.Evaluation(max_iter=0): Must be an int >= 1"),
        (lambda: Evaluation(tol=2), ValueError, "Invalid curvwatch.Evaluation(tol=2): Must be a number in [0, 1)"),
        (lambda: Evaluation(memory_budget_mb=-1), ValueError,
         "Invalid curvwatch.Evaluation(memory_budget_mb=-1): Must be a number > 0 (MiB)"),
        (lambda: Cadence(max_overhead=0), ValueError,
         "Invalid curvwatch.Cadence(max_overhead=0): Must be a fraction > 0"),
        (lambda: Cadence(terms_every_n_train_steps=0), ValueError,
         "Invalid curvwatch.Cadence(terms_every_n_train_steps=0): Must be an int >= 1"),
        (lambda: Cadence(terms_every_n_train_steps="often"), ValueError,
         "Invalid curvwatch.Cadence(terms_every_n_train_steps='often')"),
        (lambda: Cadence(every_n_train_steps=0), ValueError,
         "Invalid curvwatch.Cadence(every_n_train_steps=0): Must be an int >= 1."),
        (lambda: Sharpness(samples=1), ValueError,
         "Invalid curvwatch.Sharpness(samples=1): Must be an int >= 2: the uncertainty (sharpness_spread) compares"),
        (lambda: Sharpness(loss="hinge"), ValueError, "Invalid curvwatch.Sharpness(loss='hinge'): Must be one of"),
        (lambda: Sharpness(enabled="yes"), ValueError, "Invalid curvwatch.Sharpness(enabled='yes'): Must be True,"),
        (lambda: Sharpness(verify_every_n_evals=0), ValueError,
         "Invalid curvwatch.Sharpness(verify_every_n_evals=0): Must be an int >= 1."),
        (lambda: Warnings(rules="loud"), ValueError,
         "Invalid curvwatch.Warnings(rules='loud'): Must be one of ['suite', 'none']."),
        # an unknown keyword of a group: a "did you mean"
        (lambda: Evaluation(max_token=64), TypeError,
         "curvwatch.Evaluation() got an unexpected keyword argument 'max_token'. Did you mean 'max_tokens'?"),
        (lambda: Cadence(every_n_steps=5), TypeError, "Did you mean 'every_n_train_steps'?"),
        (lambda: Sharpness(sample=4), TypeError, "Did you mean 'samples'?"),
        # the top-level kwargs
        (lambda: CurvatureMonitor(cadence=3), ValueError,
         "Invalid cadence=3. Must be a curvwatch.Cadence(...) or None"),
        (lambda: CurvatureMonitor(evaluation={"tol": 1}), ValueError,
         "Invalid evaluation={'tol': 1}. Must be a curvwatch.Evaluation(...)"),
        (lambda: CurvatureMonitor(sharpness="yes"), ValueError,
         "Invalid sharpness='yes'. Must be True, False, 'auto' or a curvwatch.Sharpness(...)."),
        (lambda: CurvatureMonitor(warning_rules=3), ValueError,
         "Invalid warning_rules=3. Must be 'suite', 'none', a curvwatch.rules.RuleSet"),
        (lambda: CurvatureMonitor(warning_rules="loud"), ValueError,
         "Invalid warning_rules='loud'. Must be 'suite', 'none', a curvwatch.rules.RuleSet"),
        (lambda: CurvatureMonitor(on_error="ignore"), ValueError,
         "Invalid on_error='ignore'. Must be one of ['warn', 'raise']."),
        (lambda: CurvatureMonitor(blocks="all"), ValueError,
         "Invalid blocks='all'. Must be 'auto' or a list of curvwatch.BlockSpec. See"),
        (lambda: CurvatureMonitor(log_key_prefix=3), ValueError, "Invalid log_key_prefix=3. Must be a str"),
        (lambda: CurvatureMonitor(every_n_train_steps=0), ValueError,
         "Invalid every_n_train_steps=0. Must be an int >= 1."),
        (lambda: CurvatureMonitor(every_n_train_steps=5, cadence=Cadence(every_n_train_steps=5)), ValueError,
         "Pass every_n_train_steps once"),
        (lambda: Monitor(max_tokens=3), TypeError,
         "Monitor() got an unexpected keyword argument 'max_tokens'. Did you mean curvwatch.Evaluation(max_tokens="),
        (lambda: Monitor(sharpnes=False), TypeError, "Did you mean 'sharpness'?"),
        (lambda: Monitor(warn=False), TypeError, "Did you mean warning_rules=curvwatch.Warnings(warn=...)?"),
    ],
)  # fmt: skip
def test_every_setting_is_validated_where_it_is_written_with_the_fix(build, error, message):
    with pytest.raises(error, match=re.escape(message)):
        build()


def test_known_pairs_cover_every_kind():
    pairs = known_pairs()
    assert {"VV", "QQ", "KK", "VQ", "W1W1", "W2W2"} <= set(pairs) and "XX" not in pairs


def test_no_known_layer_error_is_short_and_points_at_describe_layer():
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Mixer() for _ in range(12))
            self.out = nn.Linear(8, 3)

    with pytest.raises(ValueError) as info:
        find_blocks(Net())
    message = str(info.value)
    assert message.startswith("find_blocks found no known Transformer layer in Net (its most repeated module with "
                              "submodules: Mixer).")  # fmt: skip
    assert "curvwatch.describe_layer(Mixer, curvwatch.LayerDescription(" in message
    assert len(message) < 600 and message.count("\n") <= 3 and "layers.11" not in message


def test_missing_logits_module_lists_candidates():
    torch.manual_seed(0)
    with pytest.raises(ValueError) as info:
        Monitor(TinyLM(), sharpness=Sharpness(logits_module="nonexistent"))
    assert "Invalid logits_module='nonexistent': the model has no such module" in str(info.value)
    assert "Modules whose output looks like logits: ['model.head'," in str(info.value)

    class NoHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
            self.vocab_proj = nn.Linear(8, 500)

    with pytest.raises(ValueError, match=re.escape("Modules whose output looks like logits: ['vocab_proj',")):
        Monitor(NoHead(), sharpness=True)
