"""The CUDA path: closed forms and the callback on a GPU. Skipped without one (CI has none).

What runs here when a GPU is lent (``bash benchmarks/gpu_check.sh``): every closed form on CUDA agrees with
the same call on CPU and returns CUDA tensors (no CPU fallback); the Lanczos loop synchronises with the host
only at its stopping tests; a Lightning run of a model on the GPU logs finite numbers computed on the GPU.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

import curvwatch.engine.core as engine_core
from curvwatch import Cadence, CurvatureMonitor
from curvwatch.capture import CapturedBlock
from curvwatch.closed_form import (
    AttentionStructure,
    AttentionWeights,
    FFNWeights,
    OutputLoss,
    ffn,
    layernorm,
    multi_head_attention,
)
from curvwatch.closed_form.settings import Lanczos
from curvwatch.closed_form.solver.choices import GPU
from curvwatch.closed_form.solver.lanczos import lanczos_max_abs, start_vectors
from tests.ddp_script import TinyLM, loader
from tests.utils import assert_close_report

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DT = torch.float64
# Lanczos to tol 1e-8 in float64: both devices' Ritz values are within ~1e-8 of the eigenvalue (and closer:
# the eigenvalue error is about residual^2 / gap); the exact forms differ by round-off only.
RTOL = 1e-6


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, L, d, H = 2, 12, 16, 4
    X = torch.randn(B, L, d, generator=g, dtype=DT)
    Ws = [torch.randn(d, d, generator=g, dtype=DT) / math.sqrt(d) for _ in range(4)]
    W1 = torch.randn(d, 4 * d, generator=g, dtype=DT) / math.sqrt(d)
    W2 = torch.randn(4 * d, d, generator=g, dtype=DT) / math.sqrt(4 * d)
    G = torch.randn(B, L, d, generator=g, dtype=DT) / (B * L)
    return X, Ws, W1, W2, G, H


def _each_closed_form(device: torch.device) -> dict[str, torch.Tensor]:
    X, Ws, W1, W2, G, H = (t.to(device) if isinstance(t, torch.Tensor) else t for t in _inputs())
    Ws = [W.to(device) for W in Ws]
    out = {}
    att = multi_head_attention(
        X,
        AttentionWeights(*Ws, n_heads=H),
        loss=OutputLoss(grad_output=G),
        structure=AttentionStructure(causal=True),
        lanczos=Lanczos(tol=1e-8, max_iter=200, max_basis=None, warn=False),
    )
    out.update({f"attn/{k}": v for k, v in att.items() if not k.startswith("residual/")})
    mlp = ffn(
        X,
        FFNWeights(W1, W2),
        activation="gelu",
        loss=OutputLoss(grad_output=G),
        lanczos=Lanczos(tol=1e-8, max_iter=300, max_basis=None, warn=False),
    )
    out.update({f"ffn/{k}": v for k, v in mlp.items() if not k.startswith("residual/")})
    ln = layernorm(X, grad_output=G, weight=torch.linspace(0.5, 1.5, X.shape[-1], dtype=DT, device=device))
    out.update({f"ln/{k}": v for k, v in ln.items()})
    return out


def test_closed_forms_on_cuda_agree_with_cpu_and_stay_on_the_gpu():
    cuda = _each_closed_form(torch.device("cuda"))
    cpu = _each_closed_form(torch.device("cpu"))
    assert cuda.keys() == cpu.keys()
    assert all(v.device.type == "cuda" for v in cuda.values()), "a result came back on the CPU"
    for key, value in cpu.items():
        assert_close_report(cuda[key].cpu(), value, RTOL, name=key, atol=1e-12)


def test_lanczos_on_cuda_syncs_only_at_its_stopping_tests():
    """Every ``check_every`` steps (the GPU's choice, :mod:`~curvwatch.closed_form.solver.choices`) one read of
    alpha/beta; the products and the re-orthogonalisation never
    synchronise (``torch.cuda.set_sync_debug_mode`` warns at every synchronising call)."""
    g = torch.Generator().manual_seed(1)
    n = 400
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=DT))
    lam = torch.stack([torch.linspace(-1.0, 2.0, n, dtype=DT), torch.linspace(-3.0, 1.0, n, dtype=DT)])
    S = torch.stack([(Q * row) @ Q.T for row in lam]).float().cuda()  # (2, n, n)
    products = []

    def mv(v, live):
        products.append(int(live.sum()))  # a host tensor: no sync
        return (S @ v.unsqueeze(-1)).squeeze(-1)

    mv(torch.zeros(2, n, device="cuda"), torch.ones(2, dtype=torch.bool))  # warm-up (cuBLAS init)
    products.clear()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            start = start_vectors((2,), n, torch.float32, torch.device("cuda"))
            val, _ = lanczos_max_abs(mv, start, tol=1e-3, max_iter=100, pass_live=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in record if "synchroniz" in str(w.message).lower()]
    tests = -(-len(products) // GPU.check_every)
    # one per stopping test, plus the both_ends mask read once at the start
    assert len(syncs) <= tests + 1, [str(w.message) for w in syncs]
    assert_close_report(val.cpu(), lam.abs().amax(-1).float(), 2e-3)


def test_monitor_on_a_cuda_model_evaluates_on_the_gpu(tmp_path, monkeypatch):
    seen: set[str] = set()
    original = engine_core.evaluate_block

    def evaluate(self, **kwargs):
        out = original(self, **kwargs)
        seen.update(v.device.type for v in out.values())
        return out

    monkeypatch.setattr(engine_core, "evaluate_block", evaluate)
    torch.manual_seed(0)
    monitor = CurvatureMonitor(every_n_train_steps=1, log_heatmap=False, cadence=Cadence(max_overhead=None))
    trainer = L.Trainer(
        accelerator="cuda", devices=1, max_steps=3, logger=CSVLogger(tmp_path, name="csv", version=0),
        callbacks=[monitor], enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        log_every_n_steps=1,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # data-loader hints; CurvatureWarnings are not what is tested here
        trainer.fit(TinyLM(n_layer=2, d_model=16), loader(n=12))
    assert seen == {"cuda"}
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("curv/summary/evaluations")]
    assert len(rows) == 3
    values = [float(v) for r in rows for k, v in r.items() if k.startswith("curv/") and v != ""]
    assert values and all(math.isfinite(v) for v in values)
    assert float(rows[-1]["curv/summary/lanczos/unconverged"]) == 0.0


def test_blocks_evaluated_together_on_cuda_equal_one_at_a_time_and_run_on_the_callers_stream():
    """The Lockstep threads of the engine (issue 23) evaluate on the caller's device and stream: the numbers equal the
    blocks evaluated one at a time (tolerance 0: the same products), also when the caller runs on a side stream."""
    from curvwatch.engine import Engine
    from tests.test_engine import _captured

    blocks = _on_cuda(_captured(n_layer=2))
    alone = Engine(lockstep=False).evaluate(blocks)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        together = Engine().evaluate(blocks)
    torch.cuda.synchronize()
    assert list(together.results) == list(alone.results) and not together.failed
    for name, res in alone.results.items():
        for key, value in res.items():
            got = torch.as_tensor(together.results[name][key])
            assert got.device.type == torch.as_tensor(value).device.type
            assert torch.equal(got.cpu(), torch.as_tensor(value).cpu()), (name, key)


def _on_cuda(blocks: list[CapturedBlock]) -> list[CapturedBlock]:
    """The captured blocks with their tensors on the GPU."""
    return [
        dataclasses.replace(b, inputs={k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in b.inputs.items()},
                            params={k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in b.params.items()})
        if b.reason is None else b
        for b in blocks
    ]  # fmt: skip


def test_gathered_terms_only_evaluation_on_cuda_equals_the_cpu_one(monkeypatch):
    """A terms-only (signals) evaluation whose blocks meet in gathered calls (issue 23: one attention forward, one
    Gram call and one ``outer/VV`` Lanczos run for both layers, forced here at d = 8) runs on the caller's GPU and
    stream and gives the CPU's numbers (float64, Lanczos to 1e-10: within RTOL)."""
    from curvwatch.closed_form.attention import AttentionOperator
    from curvwatch.engine import Engine
    from curvwatch.rules import RuleSet
    from tests.test_engine import _captured

    monkeypatch.setattr(AttentionOperator, "vv_exact", staticmethod(lambda d, max_iter: False))
    blocks = _captured(n_layer=2)
    kwargs = {"terms_only": True, "signal_pairs": RuleSet().exact_pairs}
    tight = Lanczos(tol=1e-10, max_iter=None, max_basis=None, warn=False)
    cpu = Engine(lanczos=tight, dtype="float64").evaluate(blocks, **kwargs)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        gpu = Engine(lanczos=tight, dtype="float64").evaluate(_on_cuda(blocks), **kwargs)
    torch.cuda.synchronize()
    assert list(gpu.results) == list(cpu.results) and not gpu.failed
    assert any("outer/VV/h0" in k for res in cpu.results.values() for k in res)
    for name, res in cpu.results.items():
        for key, value in res.items():
            if key.startswith("residual/"):
                continue
            got = torch.as_tensor(gpu.results[name][key])
            assert got.device.type == ("cuda" if isinstance(value, torch.Tensor) else "cpu"), (name, key)
            assert_close_report(got.cpu(), torch.as_tensor(value), RTOL, name=f"{name}/{key}")
