"""The monitor's settings: the groups, the flat kwargs of earlier versions, and every validation message."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from curvwatch import (
    Cadence,
    CurvatureMonitor,
    Evaluation,
    LegacyThresholds,
    Monitor,
    Sharpness,
    Warnings,
    find_blocks,
)
from curvwatch.alerts import AlertMonitor
from curvwatch.config import FLAT_KWARGS, known_pairs, resolve
from tests.ddp_script import TinyLM


def test_groups_and_flat_kwargs_give_the_same_monitor():
    grouped = CurvatureMonitor(
        cadence=Cadence(max_overhead=0.05, terms_every_n_train_steps=None),
        evaluation=Evaluation(max_tokens=7, tol=1e-3, pairs=["VV", "QQ"], kinds=("hessian",), dtype="float64"),
        warning_rules=Warnings(rules="legacy", warn=False, legacy=LegacyThresholds(spike_factor=4.0, cooldown=2)),
        sharpness=Sharpness(samples=3, logits_module="model.head"),
    )
    with pytest.warns(DeprecationWarning, match=r"evaluation=curvwatch\.Evaluation\(max_tokens=\.\.\.\)"):
        flat = CurvatureMonitor(
            max_overhead=0.05, terms_every_n_train_steps=None, max_tokens=7, tol=1e-3, pairs=["VV", "QQ"],
            kinds=("hessian",), dtype="float64", warning_rules="legacy", warn=False, spike_factor=4.0, cooldown=2,
            sharpness_samples=3, logits_module="model.head",
        )  # fmt: skip
    for monitor in (grouped, flat):
        core = monitor.monitor
        assert core.engine.max_tokens == 7 and core.engine.lanczos.tol == 1e-3 and core.engine.dtype == "float64"
        assert core.engine.pairs == ("VV", "QQ") and core.engine.kinds == ("hessian",)
        assert core.schedule.max_overhead == 0.05 and core.schedule.terms_every_n_train_steps is None
        assert core.book.rules is None and core.book.alerts_monitor.spike_factor == 4.0
        assert core.book.alerts_monitor.cooldown == 2 and not core.settings.warnings.warn
        assert core.real_loss.samples == 3 and core.real_loss.logits_name == "model.head"
    assert grouped.monitor.settings == flat.monitor.settings


def test_at_most_eleven_top_level_kwargs_and_every_flat_kwarg_has_a_group():
    import inspect

    params = [p for p in inspect.signature(CurvatureMonitor).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert len(params) <= 11  # the ten of issue 25 item 3 and log_level (item 2)
    for name, (group, key) in FLAT_KWARGS.items():  # every flat kwarg lands where the table says
        value = {"dtype": "float64", "pairs": ["VV"], "kinds": ("hessian",), "terms_keys": "all", "loss": "mse",
                 "logits_module": "x", "warn": False, "inv_var_threshold": 3.0, "max_basis": 8,
                 "terms_every_n_train_steps": 3, "max_overhead": 0.5, "memory_budget_mb": 5.0,
                 "tol": 0.5, "collapse_ratio": 2.0, "spike_factor": 3.0}.get(name, 2)  # fmt: skip
        with pytest.warns(DeprecationWarning):
            settings = resolve(**{name: value})
        holder = settings.warnings.legacy if group == "legacy" else getattr(settings, group)
        got = getattr(holder, key)
        assert got == value or tuple(got) == tuple(value), name


def test_the_legacy_thresholds_are_declared_once():
    defaults = LegacyThresholds()
    alerts = AlertMonitor()
    for name, value in vars(defaults).items():
        assert getattr(alerts, name) == value
    assert Warnings().legacy == defaults


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # unknown pair names were accepted silently (no Hessian key logged at all)
        (
            dict(evaluation=Evaluation(pairs=["XX"])),
            "Invalid pairs=['XX']: unknown pair name 'XX'. Known pair names: ['",
        ),
        (dict(evaluation=Evaluation(pairs=["VV", "W1W4"])), "unknown pair name 'W1W4'. Known pair names:"),
        (dict(evaluation=Evaluation(pairs=["W1W4"])), "Did you mean ["),
        (dict(evaluation=Evaluation(pairs="some")), "Invalid pairs='some'. Must be 'diagonal', 'all'"),
        (dict(evaluation=Evaluation(kinds=["gn"])), "Invalid kinds=('gn',). Must be a non-empty subset of ('outer',"),
        (dict(evaluation=Evaluation(kinds=())), "Invalid kinds=(). Must be a non-empty subset"),
        (
            dict(evaluation=Evaluation(terms_keys="some")),
            "Invalid terms_keys='some'. Must be one of ['warnings', 'all']",
        ),
        (
            dict(evaluation=Evaluation(dtype="float16")),
            "Invalid dtype='float16'. Must be one of ['float32', 'float64']",
        ),
        (dict(evaluation=Evaluation(max_tokens=0)), "Invalid max_tokens=0. Must be an int >= 1."),
        (dict(evaluation=Evaluation(memory_budget_mb=-1)), "Invalid memory_budget_mb=-1. Must be a number > 0 (MiB)"),
        (dict(cadence=Cadence(max_overhead=0)), "Invalid max_overhead=0. Must be a fraction > 0"),
        (dict(cadence=Cadence(terms_every_n_train_steps="often")), "Invalid terms_every_n_train_steps='often'."),
        (dict(cadence=3), "Invalid cadence=3. Must be a curvwatch.Cadence(...) or None"),
        (dict(evaluation={"tol": 1}), "Invalid evaluation={'tol': 1}. Must be a curvwatch.Evaluation(...)"),
        (dict(sharpness="yes"), "Invalid sharpness='yes'. Must be True, False, 'auto' or a curvwatch.Sharpness(...)."),
        (dict(sharpness=Sharpness(samples=0)), "Invalid sharpness_samples=0. Must be an int >= 1"),
        (dict(sharpness=Sharpness(loss="hinge")), "Invalid loss='hinge'. Must be one of"),
        (dict(sharpness=Sharpness(verify_every_n_evals=0)), "Invalid verify_every_n_evals=0. Must be an int >= 1."),
        (dict(warning_rules=3), "Invalid warning_rules=3. Must be 'suite', 'legacy', 'all', a curvwatch.rules.RuleSet"),
        (dict(warning_rules="loud"), "Invalid warning_rules='loud'. Must be one of ['suite', 'legacy', 'all']."),
        (
            dict(warning_rules=Warnings(legacy=LegacyThresholds(spike_factor=0.5))),
            "Invalid spike_factor=0.5. Must be > 1",
        ),
        (dict(warning_rules=Warnings(legacy={"cooldown": 1})), "Invalid legacy={'cooldown': 1}. Must be a curvwatch."),
        (dict(on_error="ignore"), "Invalid on_error='ignore'. Must be one of ['warn', 'raise']."),
        (dict(blocks="all"), "Invalid blocks='all'. Must be 'auto' or a list of curvwatch.BlockSpec. See"),
        (dict(log_key_prefix=3), "Invalid log_key_prefix=3. Must be a str"),
        (dict(every_n_train_steps=0), "Invalid every_n_train_steps=0. Must be an int >= 1."),
        (dict(every_n_train_steps=5, cadence=Cadence(every_n_train_steps=5)), "Pass every_n_train_steps once"),
        (dict(max_tokens=3, evaluation=Evaluation()), "Pass ['max_tokens'] inside evaluation=curvwatch.Evaluation"),
        (dict(maxtokens=3), "Unknown kwarg maxtokens=3. Did you mean ['max_tokens']?"),
        (dict(sharpnes=False), "Unknown kwarg sharpnes=False. Did you mean ['sharpness'"),
    ],
)
def test_every_kwarg_is_validated_in_init_with_the_fix(kwargs, message):
    with pytest.warns(DeprecationWarning) if "max_tokens" in kwargs else _nothing():
        with pytest.raises(ValueError, match=re.escape(message)):
            CurvatureMonitor(**kwargs)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


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
