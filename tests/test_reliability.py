"""Reliability of CurvatureMonitor: faults, bad numbers, mixed precision, bounded cost, resume, bad configuration.

The promise under test: nothing the monitor does (or fails to do) hurts the user's training. Each test
injects one fault or one bad input into a real ``Trainer`` run of a tiny GPT (width 16, one layer, a few
steps) or into the capture path, and asserts on what reached the logger (``metrics.csv``), the warnings,
the hooks left on the model and the monitor's state. The DDP promise (a failure on one rank skips the
evaluation on every rank, no hang) is tested in ``tests/test_callback.py::test_ddp_two_cpu_processes``.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import re
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import curvwatch.closed_form as closed_form
import curvwatch.engine.core as engine_core
import curvwatch.metrics as metrics_module
import curvwatch.monitor as monitor_module
from benchmarks.common import PeakMemory
from curvwatch import Cadence, CurvatureMonitor, CurvatureNotice, CurvatureWarning, Evaluation
from curvwatch.adapters import Adapter, find_blocks
from curvwatch.capture import Capture, CapturedBlock, CaptureError
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import Evaluation as Result
from curvwatch.engine import evaluate_block, evaluation_bytes
from curvwatch.models.gpt import GPT, GPTConfig
from curvwatch.realloss import sample_outputs
from curvwatch.rules import RuleSet
from tests.ddp_script import SEQ, VOCAB, TinyLM, loader
from tests.utils import assert_close_report

P = "curv/"
MAX_KEY = "curv/summary/max_hessian"
SKIP_KEY = "curv/summary/skipped_evaluations"
NONFINITE_KEY = "curv/summary/nonfinite_blocks"
# Tolerances of this file, in one place.
TOL = {
    # the monitor's logged float vs evaluate_block re-run in float32 on the same captured tensors
    "recompute": 1e-5,
    # bf16-mixed vs 32-true run of the same step: bf16 autocast rounds every matmul input to 8 mantissa bits
    # (relative 2^-8 ~ 4e-3 each); measured differences on this model are ~1e-2 on the headline norms
    "bf16_vs_fp32": 5e-2,
    # fp16-mixed vs 32-true: float16 rounds to 11 mantissa bits (relative 2^-11 ~ 5e-4 each)
    "fp16_vs_fp32": 1e-2,
    # RSS growth allowed over 2000 capture + evaluate rounds after warm-up (allocator noise)
    "rss_mib": 16.0,
}


def monitor_of(**overrides) -> CurvatureMonitor:
    """A monitor evaluating every step, cheaply (few Lanczos steps: the numbers' accuracy is not tested here)."""
    kwargs = {
        "every_n_train_steps": 1,
        "cadence": Cadence(max_overhead=None),
        "evaluation": Evaluation(max_tokens=16, max_iter=4),
        "log_heatmap": False,
        "warning_rules": RuleSet(collapse_patience=1, cooldown_steps=0),  # a collapse warns at every evaluation
        "log_level": "all",  # these tests read per-block and per-head keys from the logger
    }
    kwargs.update(overrides)
    return CurvatureMonitor(**kwargs)


def tiny(**kwargs) -> TinyLM:
    return TinyLM(d_model=16, **kwargs)


def make_trainer(tmp_path, monitor, *, max_steps=2, callbacks=(), version=0, logger=None, accelerator="cpu", **kwargs):
    logger = CSVLogger(tmp_path, name="csv", version=version) if logger is None else logger
    kwargs.setdefault("enable_checkpointing", False)
    return L.Trainer(
        accelerator=accelerator,
        max_steps=max_steps,
        logger=logger,
        callbacks=[monitor, *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **kwargs,
    )


def logged(trainer) -> dict[int, dict[str, float]]:
    """``{step: {key: float}}`` of every ``curv/`` value in metrics.csv; fails if a step is logged twice."""
    return read_csv(os.path.join(trainer.logger.log_dir, "metrics.csv"))


def read_csv(path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if k.startswith(P) and v != ""}
            if values:
                step = int(row["step"])
                assert not set(values) & set(out.get(step, {})), f"step {step} logged twice"
                out.setdefault(step, {}).update(values)
    return out


def count_hooks(module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in module.modules())


# monitor_of cuts Lanczos at 4 steps, so from its second evaluation on the monitor rightly warns that norms
# stopped above tol; that warning is tested in test_callback.py, not here
LANCZOS_CUT = "Lanczos norms stopped at max_iter"


def curv_warnings(record) -> list[str]:
    """The messages of the monitor's warnings and notices, both categories."""
    messages = [str(w.message) for w in record if issubclass(w.category, (CurvatureWarning, CurvatureNotice))]
    return [m for m in messages if LANCZOS_CUT not in m]


def fit(trainer, model, data=None):
    """Fit, recording every CurvatureWarning and CurvatureNotice (pytest turns other warnings into errors)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always", CurvatureWarning)
        warnings.simplefilter("always", CurvatureNotice)
        trainer.fit(model, data if data is not None else loader(n=12))
    return curv_warnings(record)


class SpyCapture(Capture):
    """Capture that keeps the blocks it handed out and can tamper with them (``edit``)."""

    instances: list[SpyCapture] = []
    edit = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handed: list[CapturedBlock] = []
        SpyCapture.instances.append(self)

    def blocks(self):
        self.handed = super().blocks()
        if SpyCapture.edit is not None:
            self.handed = [SpyCapture.edit(b) for b in self.handed]
        return self.handed


@pytest.fixture
def spy(monkeypatch):
    SpyCapture.instances = []
    SpyCapture.edit = None
    monkeypatch.setattr(monitor_module, "Capture", SpyCapture)
    yield SpyCapture
    SpyCapture.edit = None


# -- faults: never kill training ------------------------------------------------------------------


def _adapter_fault(method, *, backward_only=False):
    original = getattr(Adapter, method)

    def failing(self, spec, *args, **kwargs):
        # the backward hook runs with grad mode off; the forward hooks with it on
        if spec.kind == "ffn" and not (backward_only and torch.is_grad_enabled()):
            raise RuntimeError(f"induced fault in {method}")
        return original(self, spec, *args, **kwargs)

    return lambda mp: mp.setattr(Adapter, method, failing)


def _kernel_fault(mp):
    def failing(*args, **kwargs):
        raise FloatingPointError("induced fault in the ffn kernel")

    mp.setattr(closed_form, "ffn", failing)


def _summary_fault(mp):
    def failing(*args, **kwargs):
        raise ZeroDivisionError("induced fault in summarize")

    mp.setattr(metrics_module, "summarize", failing)


# phase -> (injector, warning text naming what failed, exception type seen with on_error="raise")
PHASES = {
    "forward input hook": (
        _adapter_fault("read_input"),
        "capturing block 'layer0/ffn' failed in the forward input hook: RuntimeError: induced fault",
        RuntimeError,
    ),
    "forward output hook": (
        _adapter_fault("read_output"),
        "capturing block 'layer0/ffn' failed in the forward output hook: RuntimeError: induced fault",
        RuntimeError,
    ),
    "backward hook": (
        _adapter_fault("to_batch_first", backward_only=True),
        "capturing block 'layer0/ffn' failed in the backward hook: RuntimeError: induced fault",
        RuntimeError,
    ),
    "summary": (
        _summary_fault,
        "summarizing or logging the numbers raised ZeroDivisionError: induced fault in summarize",
        ZeroDivisionError,
    ),
}


@pytest.mark.parametrize("phase", list(PHASES))
def test_fault_skips_evaluation_and_training_goes_on(tmp_path, monkeypatch, phase):
    inject, expected, _ = PHASES[phase]
    inject(monkeypatch)
    monitor = monitor_of()
    model = tiny()
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    messages = fit(trainer, model)
    assert trainer.global_step == 2  # training went on
    skipped = [m for m in messages if m.startswith("CurvatureMonitor skipped the evaluation")]
    assert len(skipped) == 2 and all(expected in m for m in skipped), messages
    rows = logged(trainer)
    assert {s: v[SKIP_KEY] for s, v in rows.items()} == {0: 1.0, 1: 2.0}
    assert not any(MAX_KEY in v for v in rows.values())
    assert count_hooks(model) == 0 and monitor.monitor._capture_step is None


def test_kernel_fault_leaves_the_block_out_alone(tmp_path, monkeypatch):
    """A block whose closed form raises is left out of the evaluation alone (issue 13): the others are logged, one
    warning names the block and the error, summary/skipped_blocks counts it; with on_error="raise" it raises."""
    _kernel_fault(monkeypatch)
    monitor = monitor_of()
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    messages = fit(trainer, tiny())
    assert trainer.global_step == 2 and len(messages) == 1, messages
    assert messages[0].startswith("CurvatureMonitor leaves block 'layer0/ffn' out of the evaluation at step 0")
    assert "FloatingPointError: induced fault in the ffn kernel" in messages[0]
    rows = logged(trainer)
    assert sorted(rows) == [0, 1] and all(MAX_KEY in v and v[SKIP_KEY] == 0.0 for v in rows.values())
    assert all(v[f"{P}summary/skipped_blocks"] == 1.0 for v in rows.values())
    assert not any(k.startswith(f"{P}layer0/ffn/") for v in rows.values() for k in v)
    assert f"{P}layer0/attn/hessian/QQ/h0" in rows[0]
    raising = monitor_of(on_error="raise")
    with pytest.raises(FloatingPointError, match="induced fault in the ffn kernel"):
        make_trainer(tmp_path / "raise", raising, max_steps=1).fit(tiny(), loader(n=4))


def test_logger_fault_skips_evaluation(tmp_path):
    class BrokenLogger(CSVLogger):
        def log_metrics(self, metrics, step=None):
            if any(k.startswith(P) for k in metrics):
                raise OSError("induced fault in the logger: disk full")
            super().log_metrics(metrics, step)

    monitor = monitor_of()
    model = tiny()
    trainer = make_trainer(tmp_path, monitor, max_steps=2, logger=BrokenLogger(tmp_path, name="csv"))
    messages = fit(trainer, model)
    assert trainer.global_step == 2
    assert [m.split(". Training")[0] for m in messages] == [
        f"CurvatureMonitor skipped the evaluation at step {s}: summarizing or logging the numbers raised "
        "OSError: induced fault in the logger: disk full"
        for s in (0, 1)
    ]
    # a failed log is not an evaluation: counters and alert state are as if it never happened
    assert monitor.book.evaluations == 0 and monitor.book.skipped == 2
    assert monitor.monitor.book.rules.state_dict()["history"] == []
    assert count_hooks(model) == 0


@pytest.mark.parametrize("phase", ["backward hook", "summary"])  # kernel: test_kernel_fault_leaves_the_block_out_alone
def test_on_error_raise_reraises_original(tmp_path, monkeypatch, phase):
    inject, _, error_type = PHASES[phase]
    inject(monkeypatch)
    model = tiny()
    trainer = make_trainer(tmp_path, monitor_of(on_error="raise"), max_steps=2)
    with pytest.raises(error_type, match="induced fault"):
        trainer.fit(model, loader(n=12))
    assert count_hooks(model) == 0


def test_capture_hooks_never_raise_into_forward_or_backward(monkeypatch):
    _adapter_fault("to_batch_first", backward_only=True)(monkeypatch)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, d_model=16, d_ff=32))
    idx = torch.randint(0, VOCAB, (2, SEQ))
    with Capture(find_blocks(model), max_tokens=16) as capture:
        model(idx).square().mean().backward()  # the fault stays inside the hook
    assert count_hooks(model) == 0
    with pytest.raises(CaptureError, match="'layer0/ffn' failed in the backward hook") as info:
        capture.blocks()
    assert isinstance(info.value.error, RuntimeError) and info.value.__cause__ is info.value.error


def test_out_of_memory_frees_halves_tokens_and_retries_once(tmp_path, monkeypatch, spy):
    original = closed_form.multi_head_attention
    calls = []

    def oom_once(X, *args, **kwargs):
        calls.append(X.shape[0] * X.shape[1])
        if len(calls) == 1:
            big = torch.empty(1 << 20)  # noqa: F841  memory the failing call holds
            raise torch.OutOfMemoryError("induced: tried to allocate 1 TiB")
        return original(X, *args, **kwargs)

    monkeypatch.setattr(closed_form, "multi_head_attention", oom_once)
    monitor = monitor_of(evaluation=Evaluation(max_tokens=28, max_iter=4))  # 4 sequences of 7 tokens
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    messages = fit(trainer, tiny())
    assert len(messages) == 1, messages
    assert messages[0].startswith(
        "CurvatureMonitor ran out of memory evaluating block 'layer0/attn' on 28 tokens (induced: tried to "
        "allocate 1 TiB). Freed it and retrying on 14 tokens"
    )
    assert calls == [28, 14, 14]  # retry at step 0 on half; step 1 captured with the halved limit
    assert spy.instances[1].max_tokens == 14 and monitor.state_dict()["token_limit"] == 14
    rows = logged(trainer)
    assert sorted(rows) == [0, 1] and all(math.isfinite(rows[s][MAX_KEY]) for s in (0, 1))
    assert rows[1][SKIP_KEY] == 0.0


def test_out_of_memory_in_lanczos_bases_halves_the_vectors_held_not_the_tokens(tmp_path, monkeypatch, spy):
    """Where the bases dominate a block's estimate (here max_iter=200 vectors of W_Q), fewer tokens would not
    help: the retry holds half as many Lanczos vectors per norm, and later evaluations keep that limit."""
    original = engine_core.evaluate_block
    calls = []

    def oom_once(self, **kwargs):
        if self.spec.name == "layer0/attn":
            calls.append((self.tokens, kwargs["lanczos"].max_basis))
            if len(calls) == 1:
                raise torch.OutOfMemoryError("induced: tried to allocate 1 TiB")
        return original(self, **kwargs)

    monkeypatch.setattr(engine_core, "evaluate_block", oom_once)
    monitor = monitor_of(evaluation=Evaluation(max_tokens=28, max_iter=200, tol=1e-3, max_basis=None))
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    messages = fit(trainer, tiny())
    assert len(messages) == 1, messages
    assert messages[0].startswith("CurvatureMonitor ran out of memory evaluating block 'layer0/attn' on 28 tokens")
    assert "retrying holding at most 100 Lanczos vectors per norm (was 200)" in messages[0]
    assert calls == [(28, None), (28, 100), (28, 100)]  # same tokens; step 1 keeps the limit
    assert monitor.state_dict()["basis_limit"] == 100 and monitor.state_dict()["token_limit"] == 28
    rows = logged(trainer)
    assert sorted(rows) == [0, 1] and rows[1][SKIP_KEY] == 0.0 and all(math.isfinite(rows[s][MAX_KEY]) for s in (0, 1))


def test_out_of_memory_twice_skips(tmp_path, monkeypatch):
    def always_oom(*args, **kwargs):
        raise torch.OutOfMemoryError("induced: out of memory")

    monkeypatch.setattr(closed_form, "multi_head_attention", always_oom)
    monitor = monitor_of(evaluation=Evaluation(max_tokens=28, max_iter=4))
    trainer = make_trainer(tmp_path, monitor, max_steps=1)
    messages = fit(trainer, tiny())
    assert "ran out of memory" in messages[0]
    assert messages[1].startswith("CurvatureMonitor leaves block 'layer0/attn' out of the evaluation at step 0")
    assert "raised OutOfMemoryError: induced: out of memory" in messages[1]
    assert trainer.global_step == 1 and monitor.engine.token_limit == 14
    assert MAX_KEY in logged(trainer)[0]  # the other blocks were logged


# -- bad numbers in, clear numbers out ------------------------------------------------------------


def _poison(name: str, key: str, value: float):
    def edit(block: CapturedBlock) -> CapturedBlock:
        if block.spec.name != name:
            return block
        t = block.inputs[key].clone()
        t[0, 0, 0] = value
        return CapturedBlock(block.spec, {**block.inputs, key: t}, block.params, block.reason)

    return edit


@pytest.mark.parametrize(
    "block, key, value",
    [("layer0/attn", "X", math.inf), ("layer0/ffn", "grad_output", math.nan), ("layer0/ln_2", "X", math.nan)],
)
def test_nonfinite_capture_skips_and_flags_block(tmp_path, spy, block, key, value):
    spy.edit = _poison(block, key, value)
    monitor = monitor_of()
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    messages = fit(trainer, tiny())
    assert len(messages) == 1, messages  # once per block, not per evaluation
    assert messages[0].startswith(f"CurvatureMonitor skips block '{block}': its captured {key} hold NaN or Inf")
    rows = logged(trainer)
    for step in (0, 1):
        assert rows[step][f"{P}{block}/skipped_nonfinite"] == 1.0
        assert rows[step][NONFINITE_KEY] == 1.0 and rows[step][SKIP_KEY] == 0.0
        assert not [k for k in rows[step] if k.startswith(f"{P}{block}/") and not k.endswith("skipped_nonfinite")]
        assert all(math.isfinite(v) for v in rows[step].values()), rows[step]
        others = {k for k in rows[step] if k.startswith(P + "layer0/") and not k.startswith(f"{P}{block}/")}
        assert len(others) > 10  # the other blocks are still evaluated
    assert MAX_KEY in rows[0]


def test_diverged_model_logs_flags_not_nan(tmp_path):
    model = tiny()
    with torch.no_grad():
        model.model.tok_emb.weight[:] = math.nan  # every activation and gradient is NaN
    monitor = monitor_of()
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    messages = fit(trainer, model)
    assert trainer.global_step == 2
    assert sorted(m.split("'")[1] for m in messages) == ["layer0/attn", "layer0/ffn", "layer0/ln_1", "layer0/ln_2"]
    rows = logged(trainer)
    for step in (0, 1):
        assert all(math.isfinite(v) for v in rows[step].values()), rows[step]
        assert rows[step][NONFINITE_KEY] == 4.0 and MAX_KEY not in rows[step]
    assert monitor.book.skipped == 0 and monitor.book.evaluations == 2


def _constant_row_model(eps: float) -> TinyLM:
    """A model whose token 3 reaches ``layer0/ln_1`` as a constant row: variance exactly 0."""
    model = tiny(lr=0.0, ln_eps=eps)
    with torch.no_grad():
        model.model.tok_emb.weight[3] = 0.5
        model.model.pos_emb.weight.zero_()
    return model


@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_zero_variance_layernorm_reports_collapse(tmp_path, eps):
    monitor = monitor_of()
    trainer = make_trainer(tmp_path, monitor, max_steps=1)
    data = loader(n=4)
    data.dataset.tensors[0][0, 2] = 3  # token 3 in the first (captured) sequence
    messages = fit(trainer, _constant_row_model(eps), data)
    collapse = [m for m in messages if m.startswith("LayerNorm variance collapse in block 'layer0/ln_1'")]
    assert len(collapse) == 1, messages
    row = logged(trainer)[0]
    assert row[f"{P}layer0/ln_1/ln/var_min"] == 0.0
    assert not [k for k, v in row.items() if math.isnan(v)]
    if eps:  # finite everywhere; ln_1 is a healthy evaluation
        assert all(math.isfinite(v) for v in row.values()), {k: v for k, v in row.items() if not math.isfinite(v)}
        assert f"{P}layer0/ln_1/skipped_nonfinite" not in row
    else:
        # eps = 0: the LayerNorm's own output is 0/0 = NaN, so every gradient is NaN. ln_1's input is finite:
        # its variance statistics are reported (1/min var = inf is the true value) and it is flagged; the
        # blocks fed by NaN are flagged, nothing else is logged for them.
        assert row[f"{P}layer0/ln_1/ln/inv_var_max"] == math.inf
        assert row[f"{P}layer0/ln_1/skipped_nonfinite"] == 1.0
        assert "is 0 x eps" in collapse[0]


def test_length_one_sequences(tmp_path):
    class LengthOne(TinyLM):
        def training_step(self, batch, batch_idx):
            (idx,) = batch
            return super().training_step((idx[:, :2],), batch_idx)  # model sees L = 1

    monitor = monitor_of()
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    assert fit(trainer, LengthOne(d_model=16)) == []
    row = logged(trainer)[1]
    assert not [k for k, v in row.items() if math.isnan(v)]
    # one key: the softmax is constant, so QQ and KK curvature is exactly 0 and V/Q ratio is +inf
    assert row[f"{P}layer0/attn/hessian/QQ/h0"] == 0.0
    assert row[f"{P}layer0/attn/ratio/VV_QQ/h0"] == math.inf
    assert math.isfinite(row[MAX_KEY]) and row[f"{P}layer0/attn/term/inv_L3"] == 1.0


def _evaluate_all(blocks) -> dict[str, dict[str, float]]:
    return {
        b.spec.name: {
            k: float(v)
            for k, v in evaluate_block(
                b,
                lanczos=Lanczos(tol=1e-6, max_iter=30, max_basis=None, warn=False),
                dtype=torch.float64,
                pairs=("VV", "QQ", "W1W1"),
            ).items()
        }
        for b in blocks
    }


def _pad_invariance(run, keys):
    """``run(pad_value)`` -> ``{block: {key: value}}``; the keys must not depend on the padded values."""
    normal, huge = run(0.0), run(1e3)
    checked = 0
    for block, values in normal.items():
        for key in keys:
            if key in values:
                assert_close_report(huge[block][key], values[key], rtol=1e-6, name=f"{block} {key}")
                checked += 1
    assert checked >= 4


PAD_KEYS = ("ln/var_min", "var_min", "var_mean", "term/x_norm", "term/y_norm", "hessian/QQ/h0", "hessian/VV/h1")


def test_key_padding_mask_excluded_torch_encoder_layer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True  # the last two tokens of sequence 1 are padding

    def run(pad_value):
        with Capture(find_blocks(layer), max_tokens=15) as capture:
            out = layer(x.masked_fill(pad[..., None], 0.0) + pad[..., None] * pad_value, src_key_padding_mask=pad)
            out[~pad].square().sum().backward()  # the loss ignores padded positions
        blocks = capture.blocks()
        assert [b.reason for b in blocks] == [None] * 4
        return _evaluate_all(blocks)

    _pad_invariance(run, PAD_KEYS)


def test_attention_mask_excluded_hugging_face_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=8, n_embd=16, n_layer=1, n_head=2, n_inner=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2Model(config).double()
    ids = torch.randint(1, VOCAB, (2, 6))
    ids[1, 4:] = 0  # token 0 pads the end of sequence 1
    mask = (ids != 0).long()

    def run(pad_value):
        with torch.no_grad():
            model.wte.weight[0] = pad_value
        with Capture(find_blocks(model), max_tokens=12) as capture:
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            hidden[mask.bool()].square().sum().backward()
        blocks = capture.blocks()
        assert [b.reason for b in blocks] == [None] * len(blocks)
        assert all("key_padding_mask" in b.inputs or "row_mask" in b.inputs for b in blocks)
        return _evaluate_all(blocks)

    _pad_invariance(run, PAD_KEYS)


# -- mixed precision ------------------------------------------------------------------------------

HEADLINE = (MAX_KEY, "curv/summary/ln/var_min", f"{P}layer0/attn/hessian/max", f"{P}layer0/ffn/hessian/max")


def _precision_run(tmp_path, precision, spy, init_scale=None):
    """One step at ``precision``: ``(monitor, logged numbers, captured blocks, [(grad factor, loss scale)])``.

    ``"16-mixed"`` runs on CUDA (Lightning's GradScaler); ``"16-mixed-cpu"`` is float16 CPU autocast with a CPU
    ``GradScaler`` (``init_scale``, default 2**16) through Lightning's ``MixedPrecision`` plugin."""
    spy.instances = []
    torch.manual_seed(0)
    monitor = monitor_of()
    factors = []
    grad_factor = CurvatureMonitor._grad_factor

    def record(trainer, pl_module):  # the factor the monitor applied to grad_output, and the scale then
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        factors.append((grad_factor(trainer, pl_module), None if scaler is None else float(scaler.get_scale())))
        return factors[-1][0]

    kwargs = {"precision": precision, "accelerator": "cuda" if precision == "16-mixed" else "cpu"}
    if precision == "16-mixed-cpu":
        from lightning.pytorch.plugins.precision import MixedPrecision

        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16 if init_scale is None else init_scale)
        kwargs = {"accelerator": "cpu", "plugins": [MixedPrecision("16-mixed", "cpu", scaler=scaler)]}
    trainer = make_trainer(tmp_path / f"{precision}-{init_scale}", monitor, max_steps=1, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CurvatureMonitor, "_grad_factor", staticmethod(record))
        fit(trainer, tiny(), loader(n=4))
    return monitor, logged(trainer)[0], spy.instances[0].handed, factors


def _scaled(block: CapturedBlock, factor: float) -> CapturedBlock:
    """``block`` with ``grad_output`` times ``factor``, as the engine applies the monitor's grad factor."""
    inputs = {k: v * factor if k == "grad_output" else v for k, v in block.inputs.items()}
    return dataclasses.replace(block, inputs=inputs)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "16-mixed-cpu"])
def test_mixed_precision_computed_in_float32(tmp_path, spy, monkeypatch, precision):
    """The closed forms run in float32 on the captured tensors, with fp16's loss scale undone (the captured
    ``grad_output`` is the scaled one: the expectation applies the factor the monitor used, 1 / the scale), and the
    logged numbers agree with a ``32-true`` run of the same step."""
    if precision == "16-mixed" and not torch.cuda.is_available():
        pytest.skip("precision='16-mixed' needs a CUDA GPU ('16-mixed-cpu' runs float16 CPU autocast here)")
    dtypes = set()
    original = engine_core.evaluate_block

    def evaluate(self, **kwargs):
        out = original(self, **kwargs)
        dtypes.update(v.dtype for v in out.values())
        return out

    monkeypatch.setattr(engine_core, "evaluate_block", evaluate)
    monitor, mixed, blocks, factors = _precision_run(tmp_path, precision, spy)
    ((factor, scale),) = set(factors)  # the same for the sampled backward passes and the evaluation
    if precision == "bf16-mixed":
        assert (factor, scale) == (1.0, None)  # no loss scale
    else:
        assert scale == 2.0**16 and factor == 1.0 / scale, factors
    assert dtypes == {torch.float32}  # the closed forms ran in float32 whatever autocast produced
    assert all(math.isfinite(v) for v in mixed.values())
    for block in blocks:  # the logged numbers are the float32 closed form of the captured tensors, scale undone
        lanczos = Lanczos(tol=monitor.tol, max_iter=monitor.max_iter, max_basis=None, warn=False)
        expected = original(_scaled(block, factor), lanczos=lanczos, dtype=torch.float32)
        for key in ("hessian/QQ/h0", "hessian/VV/h1", "hessian/W1W1", "ln/var_min", "var_min", "term/x_norm"):
            if key in expected:
                name = f"{P}{block.spec.name}/{key if '/' in key else 'ln/' + key}"
                assert_close_report(mixed[name], expected[key], rtol=TOL["recompute"], name=name)
    _, full, _, _ = _precision_run(tmp_path, "32-true", spy)
    for key in HEADLINE:  # and they agree with a float32 run of the same step
        assert_close_report(mixed[key], full[key], rtol=TOL["bf16_vs_fp32"], name=f"{precision} vs 32-true {key}")
    # the real-loss sharpness under autocast: the same sampled labels (same seed) on logits that differ by rounding
    key = "curv/summary/sharpness/max"
    assert_close_report(mixed[key], full[key], rtol=0.25, name=f"{precision} vs 32-true {key}")


def test_fp16_loss_scale_is_undone(tmp_path, spy):
    """float16 CPU autocast with a GradScaler at two loss scales (2**16, 2**8): the captured output gradients
    differ by the ratio of the scales (2**8, to fp16 rounding: the smaller scale leaves more of them subnormal),
    the logged numbers do not, and they agree with a 32-true run of the same step (to fp16 autocast's rounding,
    TOL['fp16_vs_fp32']). Without the factor they would differ by 2**8 and 2**16."""
    runs = {s: _precision_run(tmp_path, "16-mixed-cpu", spy, init_scale=s) for s in (2.0**16, 2.0**8)}
    _, full, blocks32, _ = _precision_run(tmp_path, "32-true", spy)
    (_, high, blocks_high, f_high), (_, low, blocks_low, f_low) = runs[2.0**16], runs[2.0**8]
    assert {f for f, _ in f_high} == {2.0**-16} and {f for f, _ in f_low} == {2.0**-8}
    for a, b, c in zip(blocks_high, blocks_low, blocks32, strict=True):
        high_grad, low_grad = a.inputs["grad_output"].double(), b.inputs["grad_output"].double()
        assert_close_report(high_grad, low_grad * 2.0**8, rtol=1e-4, name=f"{a.spec.name} grad_output ratio")
        f32_grad = c.inputs["grad_output"].double()  # the scaled gradient, unscaled: the float32 run's
        assert_close_report(high_grad * 2.0**-16, f32_grad, rtol=TOL["fp16_vs_fp32"], name=a.spec.name)
    assert high.keys() == low.keys() == full.keys()
    for key in (*HEADLINE, "curv/layer0/attn/hessian/QQ/h0", "curv/layer0/ffn/hessian/W1W1"):
        assert_close_report(high[key], low[key], rtol=TOL["fp16_vs_fp32"], name=f"scale 2**16 vs 2**8 {key}")
        assert_close_report(high[key], full[key], rtol=TOL["fp16_vs_fp32"], name=f"16-mixed vs 32-true {key}")


# -- bounded cost ---------------------------------------------------------------------------------


def _captured_gpt(B=4, L=SEQ, d=16):
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=L, n_layer=1, n_head=2, d_model=d, d_ff=2 * d))
    with Capture(find_blocks(model), max_tokens=B * L) as capture:
        model(torch.randint(0, VOCAB, (B, L))).square().mean().backward()
    return model, capture.blocks()


@pytest.mark.parametrize("B, L, d", [(4, 8, 16), (1, 4, 32), (2, 32, 16)])
def test_evaluation_bytes_bounds_measured_peak(B, L, d):
    _, blocks = _captured_gpt(B, L, d)
    for block in blocks:
        with PeakMemory() as peak:
            evaluate_block(
                block,
                lanczos=Lanczos(tol=1e-3, max_iter=20, max_basis=None, warn=False),
                dtype=torch.float32,
                pairs=("VV", "QQ", "KK", "W1W1", "W2W2"),
            )
        estimate = evaluation_bytes(block, torch.float32, max_iter=20)
        assert 0 < peak.peak <= estimate, f"{block.spec.name}: measured {peak.peak} B > estimate {estimate} B"


@pytest.mark.parametrize(
    "arch, B, L, d", [("gpt", 4, 8, 16), ("gpt", 8, 16, 32), ("gpt", 1, 64, 64), ("llama", 4, 8, 32)]
)
def test_evaluation_bytes_bounds_measured_peak_with_the_real_loss_keys(arch, B, L, d):
    """With ``output_samples`` (the monitor's default evaluation: 16 sampled passes, AdamW rules, so three estimates x
    two preconditionings per key) the estimate doubles, and bounds the measured peak of each block's whole evaluation
    (the sampled keys' Lanczos bases, Gram columns and products on top of the engine's own). Without the doubling the
    peaks were up to 1.95x the estimate at these shapes (the FFN at B 8, L 16, d 32; the attention 1.77x at B 4, L 8,
    d 16; a Hugging Face GPT-2's FFN 1.73x at d 64, B 8, L 64). ``"llama"``: a Hugging Face LLaMA (grouped-query
    attention, gated FFN, RMSNorm; its attention 1.84x, its gated FFN 1.80x without the doubling)."""
    import torch.nn.functional as F

    from curvwatch.engine import MONITOR_LANCZOS, Engine
    from curvwatch.realloss.logits import find_logits_module
    from curvwatch.realloss.plugin import RealLoss

    torch.manual_seed(0)
    if arch == "gpt":
        model = GPT(GPTConfig(vocab_size=50, block_size=L, n_layer=1, n_head=2, d_model=d, d_ff=2 * d))
        logits = model
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=50, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=L)  # fmt: skip
        model = LlamaForCausalLM(config)
        logits = lambda idx: model(input_ids=idx).logits  # noqa: E731
    idx = torch.randint(0, 50, (B, L + 1), generator=torch.Generator().manual_seed(1))
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of():
        return F.cross_entropy(logits(idx[:, :-1]).reshape(-1, 50), idx[:, 1:].reshape(-1))

    loss_of().backward()
    adam.step()  # (second moments: the preconditioned keys too)
    model.zero_grad()
    with Capture(find_blocks(model), max_tokens=512, logits_module=find_logits_module(model)[1]) as capture:
        loss = loss_of()
        sample_outputs(capture, loss, 16, generator=torch.Generator().manual_seed(2))
        loss.backward()
    blocks = capture.blocks()
    sampled = [b for b in blocks if "output_samples" in b.inputs]
    assert {b.spec.kind for b in sampled} == {"attention", "ffn" if arch == "gpt" else "gated_ffn"}
    precondition = RealLoss().preconditioners(adam, sampled)
    for block in blocks:
        with PeakMemory() as peak:
            evaluation = Engine().evaluate([block], precondition=precondition)
        if block in sampled:
            assert any(k.startswith("precond_sharpness/") for k in evaluation.results[block.spec.name])
        estimate = evaluation_bytes(block, torch.float32, MONITOR_LANCZOS.max_iter, MONITOR_LANCZOS.max_basis)
        assert 0 < peak.peak <= estimate, f"{block.spec.name}: measured {peak.peak} B > estimate {estimate} B"


def test_memory_budget_shrinks_tokens_and_warns_once(tmp_path, spy, monkeypatch):
    evaluated = []
    original = engine_core.evaluate_block

    def evaluate(self, **kwargs):
        basis = kwargs["lanczos"].max_basis if "lanczos" in kwargs else None
        evaluated.append((self.spec.name, self.tokens, evaluation_bytes(self, torch.float32, 20, basis), basis))
        return original(self, **kwargs)

    monkeypatch.setattr(engine_core, "evaluate_block", evaluate)
    # estimates at 28 tokens (max_iter=20), with the real-loss keys (the default: twice the work and three times the
    # bases of those without): attention 0.97 MiB (bases 0.703 MiB: its own run's and its QQ and KK runs, held at
    # once), FFN 0.46 MiB (bases 0.352 MiB), LayerNorm 0.03
    budget_mb = 0.2
    monitor = CurvatureMonitor(
        every_n_train_steps=1,
        log_heatmap=False,
        cadence=Cadence(max_overhead=None),
        evaluation=Evaluation(max_tokens=28, memory_budget_mb=budget_mb, max_iter=20, max_basis=None),
    )
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    messages = fit(trainer, tiny())
    # the attention bases (over half the budget) hold fewer vectors first, then its tokens shrink; one warning each
    assert len(messages) == 2, messages
    assert messages[0].startswith("CurvatureMonitor holds at most 4 Lanczos vectors per norm of block 'layer0/attn'")
    assert "to stay within memory_budget_mb=0.2" in messages[1], messages
    assert all(nbytes <= budget_mb * 2**20 for _, _, nbytes, _ in evaluated), evaluated
    attn = [(tokens, basis) for name, tokens, _, basis in evaluated if name == "layer0/attn"]
    assert attn and all(t < 28 and b == 4 for t, b in attn)  # shrunk
    # the FFN (d_ff = d: bases half the attention's) holds 5 vectors (18 KiB each), which brings it to 0.19 MiB at
    # its 28 tokens (no second warning of either kind); LayerNorm untouched
    assert [(t, b) for n, t, _, b in evaluated if n == "layer0/ffn"] == [(28, 5), (28, 5)]
    assert [(t, b) for n, t, _, b in evaluated if n == "layer0/ln_1"] == [(28, None), (28, None)]
    assert all(math.isfinite(logged(trainer)[s][MAX_KEY]) for s in (0, 1))


def test_memory_budget_bounds_the_lanczos_bases_of_a_wide_ffn(tmp_path, spy, monkeypatch):
    """An FFN's bases (``d d_ff`` numbers per vector) do not shrink with the tokens: the budget limits the vectors
    held per norm instead, and the norms stay as accurate (thick restarts) as without the budget."""
    evaluated = []
    original = engine_core.evaluate_block

    def evaluate(self, **kwargs):
        evaluated.append((self.spec.name, self.tokens, kwargs["lanczos"].max_basis if "lanczos" in kwargs else None))
        return original(self, **kwargs)

    monkeypatch.setattr(engine_core, "evaluate_block", evaluate)
    kwargs = dict(every_n_train_steps=1, cadence=Cadence(max_overhead=None), log_heatmap=False, log_level="all")
    # d = 16, d_ff = 64 (TinyLM's d_ff=16 widened): one FFN vector is 1024 numbers, 72 KiB in the estimate (24 KiB
    # times three: the real-loss keys' runs hold bases of their own, solved together with the engine's)
    runs = {}
    for budget in (None, 0.6):
        torch.manual_seed(0)
        evaluated.clear()
        evaluation = Evaluation(max_tokens=14, tol=1e-4, max_iter=200, max_basis=None, memory_budget_mb=budget)
        monitor = CurvatureMonitor(**kwargs, evaluation=evaluation)
        trainer = make_trainer(tmp_path / str(budget), monitor, max_steps=1)
        model = tiny()
        model.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, d_model=16, d_ff=64))
        messages = fit(trainer, model)
        runs[budget] = (logged(trainer)[0], list(evaluated), messages)
    free, limited = runs[None], runs[0.6]
    assert free[2] == [] and all(b is None for *_, b in free[1])
    ffn = [(t, b) for n, t, b in limited[1] if n == "layer0/ffn"]
    assert ffn == [(14, 4)], ffn  # 0.3 MiB for the bases: 4 vectors of 72 KiB; the tokens untouched
    # one warning for all blocks (the attention's, first evaluated: 200 vectors of 36 KiB, its own, QQ and KK bases
    # held at once, are over 0.3 MiB too)
    assert len(limited[2]) == 1 and "holds at most 8 Lanczos vectors per norm of block 'layer0/attn'" in limited[2][0]
    keys = ("ffn/hessian/W1W1", "ffn/outer/W1W1", "ffn/functional/W1W1", "attn/hessian/QQ/h0", "attn/hessian/KK/h1")
    for key in keys:
        name = f"{P}layer0/{key}"
        assert_close_report(limited[0][name], free[0][name], rtol=1e-3, name=name)  # both to tol 1e-4


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_no_growth_over_2000_evaluations(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention (~16 ms a round)
    try:
        _leak_loop()
    finally:
        torch.set_num_threads(threads)


def _leak_loop():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=4, n_layer=1, n_head=2, d_model=16, d_ff=32))
    specs = find_blocks(model)
    idx = torch.randint(0, VOCAB, (1, 4))
    rss = []
    for i in range(2000):
        with Capture(specs, max_tokens=8) as capture:
            model(idx).square().mean().backward()
        for block in capture.blocks():  # VV is closed form: the loop stays fast, the path is the same
            evaluate_block(
                block,
                lanczos=Lanczos(tol=1e-3, max_iter=4, max_basis=None, warn=False),
                dtype=torch.float32,
                pairs=("VV", "W2W2"),
            )
        model.zero_grad(set_to_none=True)
        if i in (199, 1999):
            rss.append(_rss_mib())
        assert count_hooks(model) == 0 and not capture._handles
    assert all(t.grad is None or not t.grad._backward_hooks for t in model.parameters())
    assert rss[1] - rss[0] < TOL["rss_mib"], f"RSS grew {rss[1] - rss[0]:.1f} MiB over 1800 evaluations"


def test_callback_state_bounded_over_many_evaluations():
    monitor = CurvatureMonitor(
        warning_rules=RuleSet(collapse_patience=1, cooldown_steps=0), every_n_train_steps=1,
        cadence=Cadence(max_overhead=None),
    )  # fmt: skip
    core = monitor.monitor  # the Trainer-free monitor the callback drives
    core.attach(GPT(GPTConfig(vocab_size=VOCAB, block_size=4, n_layer=1, d_model=16, n_head=2)))
    flat = {("layer0/attn", "hessian/VV/h0"): 1.0, ("layer0/ln_1", "ln/var_min_over_eps"): 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CurvatureWarning)
        warnings.simplefilter("ignore", CurvatureNotice)
        for step in range(2000):  # every evaluation fires a collapse alert; every other one also a skip
            flat[("layer0/attn", "hessian/VV/h0")] = 100.0 ** (step % 2)
            core._log(step, flat, Result(excluded={"layer0/ffn": "induced: left out"}), 0.0)
            core._skip(step, RuntimeError("induced"))
    state = monitor.state_dict()
    assert monitor.book.evaluations == 2000 and monitor.book.skipped == 2000
    assert monitor.book.fired >= 2000
    assert len(state["errors"]) == 20 and len(state["rules"]["history"]) == 100 and len(state["warned"]) == 1


# -- resume ---------------------------------------------------------------------------------------


# lr=0 and collapsed LayerNorms: the monitor's schedule and alerts do not depend on which batches are replayed
@pytest.mark.filterwarnings("ignore:.*resuming from a checkpoint that ended before the epoch ended.*")
def test_resume_mid_epoch_same_schedule_and_warning_state(tmp_path):
    def run(name, max_steps, ckpt_path=None, callbacks=()):
        monitor = monitor_of(warning_rules=RuleSet(collapse_patience=1, cooldown_steps=2))
        model = tiny(lr=0.0)
        with torch.no_grad():  # LayerNorm inputs far below eps: a collapse alert every evaluation
            model.model.tok_emb.weight.mul_(1e-4)
            model.model.pos_emb.weight.mul_(1e-4)
        trainer = make_trainer(
            tmp_path / name, monitor, max_steps=max_steps, callbacks=callbacks, enable_checkpointing=bool(callbacks)
        )
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always", CurvatureWarning)
            warnings.simplefilter("always", CurvatureNotice)
            trainer.fit(model, loader(n=32), ckpt_path=ckpt_path)  # 8 batches: checkpoints are mid-epoch
        fired = [(m.split("'")[1], int(m.split("at step ")[1].split(":")[0])) for m in curv_warnings(record)]
        return monitor, logged(trainer), fired

    _, whole, fired_whole = run("whole", 6)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first, rows_a, fired_a = run("a", 2, callbacks=[ckpt])
    (path,) = (tmp_path / "ckpt").iterdir()
    assert "step=2" in path.name
    same = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)  # as when saved
    second, rows_b, fired_b = run("b", 6, ckpt_path=str(path), callbacks=[same])
    assert sorted(rows_a) == [0, 1] and sorted(rows_b) == [2, 3, 4, 5]  # no step twice, none missing
    assert sorted(rows_a) + sorted(rows_b) == sorted(whole)
    for rows in (rows_a, rows_b):
        for step, values in rows.items():
            assert values["curv/summary/evaluations"] == whole[step]["curv/summary/evaluations"] == step + 1
            assert values["curv/summary/warnings"] == whole[step]["curv/summary/warnings"]
    # cooldown carried across the checkpoint: alerts at steps 0 and 3, as in the uninterrupted run
    assert fired_a + fired_b == fired_whole
    assert sorted({s for _, s in fired_whole}) == [0, 3]


def test_one_time_warnings_and_token_limit_survive_checkpoint():
    first = CurvatureMonitor(evaluation=Evaluation(max_tokens=64))
    first.monitor.notices.said = {"nonfinite:layer0/attn", "memory_budget"}
    first.engine.token_limit = 16
    first.engine.basis_limit = 10
    second = CurvatureMonitor(evaluation=Evaluation(max_tokens=64))
    second.load_state_dict(first.state_dict())
    assert second.monitor.notices.said == first.monitor.notices.said
    assert second.engine.token_limit == 16 and second.engine.basis_limit == 10
    older = {k: v for k, v in first.state_dict().items() if k != "basis_limit"}  # before basis_limit existed
    second.load_state_dict(older)
    assert second.engine.basis_limit == 16  # this run's max_basis
    unlimited = CurvatureMonitor(evaluation=Evaluation(max_basis=None))
    unlimited.load_state_dict(older)
    assert unlimited.engine.basis_limit is None
    unlimited.load_state_dict(first.state_dict())  # a limit learned from an out-of-memory error stays
    assert unlimited.engine.basis_limit == 10
    third = CurvatureMonitor(evaluation=Evaluation(max_tokens=8))  # a smaller max_tokens on resume wins
    third.load_state_dict(first.state_dict())
    assert third.engine.token_limit == 8


# -- bad configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Evaluation(memory_budget_mb=0),
         "Invalid curvwatch.Evaluation(memory_budget_mb=0): Must be a number > 0 (MiB)"),
        (lambda: Evaluation(memory_budget_mb="1GB"),
         "Invalid curvwatch.Evaluation(memory_budget_mb='1GB'): Must be a number > 0"),
        (lambda: Evaluation(memory_budget_mb=math.inf),
         "Invalid curvwatch.Evaluation(memory_budget_mb=inf): Must be a number > 0"),
        (lambda: CurvatureMonitor(every_n_train_steps=True), "Invalid every_n_train_steps=True. Must be an int >= 1."),
        (lambda: Evaluation(max_tokens=16.0), "Invalid curvwatch.Evaluation(max_tokens=16.0): Must be an int >= 1."),
        (lambda: Evaluation(tol=-1e-3), "Invalid curvwatch.Evaluation(tol=-0.001): Must be a number in [0, 1)"),
        (lambda: Evaluation(dtype=torch.float32),
         "Invalid curvwatch.Evaluation(dtype=torch.float32): Must be one of ['float32', 'float64']."),
        (lambda: CurvatureMonitor(blocks=[1, 2]),
         "Invalid blocks=[1, 2]. Must be 'auto' or a list of curvwatch.BlockSpec."),
        (lambda: RuleSet(collapse_ratio=-1), "Invalid collapse_ratio=-1. Must be a number >= 0"),
    ],
)  # fmt: skip
def test_invalid_settings_fail_at_construction(build, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build()


def test_model_without_blocks_fails_in_setup_of_a_real_fit(tmp_path):
    class NoBlocks(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(SEQ, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0].float()).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = NoBlocks()
    trainer = make_trainer(tmp_path, CurvatureMonitor(), max_steps=1)
    with pytest.raises(ValueError, match="find_blocks found no known Transformer layer in NoBlocks"):
        trainer.fit(model, loader(n=4))
    assert trainer.global_step == 0 and count_hooks(model) == 0


@pytest.mark.parametrize("name", ["DeepSpeedStrategy", "ModelParallelStrategy"])  # FSDPStrategy: test_sharded.py
def test_sharding_strategies_refused_in_setup(name):
    import lightning.pytorch.strategies as strategies

    cls = getattr(strategies, name)
    strategy = cls.__new__(cls)  # the real class; no process group or DeepSpeed install needed for the check
    with pytest.raises(ValueError, match=f"does not support strategy={name}: it shards parameters.*strategy='ddp'"):
        CurvatureMonitor().setup(SimpleNamespace(strategy=strategy), tiny(), "fit")
