"""CurvatureMonitor on models trained the ways users train them: activation checkpointing, torch.compile,
manual optimization.

Each test trains the same tiny GPT for 3 steps with and without the feature (same seed, data and weights)
and compares every logged ``curv/`` number: the capture hooks must see the same block inputs and output
gradients, so the numbers must agree (to round-off, or to the Lanczos tolerance where a compiler
reassociates float sums).
"""

from __future__ import annotations

import csv
import os
import shutil
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch.utils.checkpoint import checkpoint

from curvwatch import CurvatureMonitor
from tests.ddp_script import VOCAB, TinyLM, loader

STEPS = 3
TOL = 1e-6  # Lanczos tolerance of these runs: norms agree to ~TOL when the inputs differ by round-off


class _Model(TinyLM):
    """TinyLM whose blocks run under activation checkpointing, or whose GPT is compiled."""

    def __init__(self, checkpointing: str | None = None, backend: str | None = None) -> None:
        super().__init__(n_layer=2, d_model=16)
        self.checkpointing = checkpointing
        if backend is not None:
            self.model = torch.compile(self.model, backend=backend)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.checkpointing is None:
            return self.model(idx)
        gpt = self.model
        x = gpt.drop(gpt.tok_emb(idx) + gpt.pos_emb(torch.arange(idx.shape[1], device=idx.device)))
        for block in gpt.blocks:
            x = checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return gpt.head(gpt.ln_f(x))


def _logged(tmp_path, model: TinyLM, caught: list[str] | None = None) -> list[dict[str, float]]:
    """Every step's ``curv/`` numbers (times, overhead and Lanczos residuals left out: they are not the maths);
    the texts of the warnings raised during training are appended to ``caught``."""
    torch.manual_seed(0)
    monitor = CurvatureMonitor(
        log_level="all", every_n_train_steps=1, max_overhead=None, log_heatmap=False, tol=TOL, max_iter=200
    )
    trainer = L.Trainer(
        accelerator="cpu", max_steps=STEPS, logger=CSVLogger(tmp_path, name="csv", version=0), callbacks=[monitor],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=1,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")  # data-loader hints; torch.compile notes: recorded, not shown
        trainer.fit(model, loader(n=12))
    if caught is not None:
        caught.extend(str(w.message) for w in raised)
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("curv/summary/evaluations")]
    skip = ("time", "overhead", "residual")
    return [
        {k: float(v) for k, v in r.items() if k.startswith("curv/") and v != "" and not any(s in k for s in skip)}
        for r in rows
    ]


def _assert_same(got: list[dict[str, float]], expected: list[dict[str, float]], rtol: float) -> None:
    assert len(got) == len(expected) == STEPS
    for step, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g.keys() == e.keys(), f"step {step}: keys differ: {sorted(g.keys() ^ e.keys())[:5]}"
        assert float(g["curv/summary/skipped_evaluations"]) == 0.0
        assert "curv/layer1/attn/hessian/QQ/h0" in e and "curv/layer1/ffn/hessian/W1W1" in e  # every block evaluated
        bad = {k: (g[k], e[k]) for k in e if abs(g[k] - e[k]) > rtol * abs(e[k]) + 1e-30}
        assert not bad, f"step {step}: {len(bad)} of {len(e)} numbers differ, e.g. {list(bad.items())[:3]}"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    torch.manual_seed(0)
    return _logged(tmp_path_factory.mktemp("plain"), _Model())


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_same_numbers(tmp_path, plain, mode):
    """With checkpointing the block runs twice (forward, then recomputed in backward; the reentrant variant's
    first run is under no_grad): the hooks record one call and its gradient, the same as without."""
    torch.manual_seed(0)
    got = _logged(tmp_path, _Model(checkpointing=mode))
    if mode == "reentrant":  # the real-loss keys need the block outputs in the forward graph: named, not logged
        real = ("/ggn/", "sharpness", "stability", "precond", "lanczos/norms")  # (which counts them)
        plain = [{k: v for k, v in e.items() if not any(r in k for r in real)} for e in plain]
        got = [{k: v for k, v in e.items() if "lanczos/norms" not in k} for e in got]
    _assert_same(got, plain, rtol=0.0)


def test_torch_compile_gives_the_same_numbers(tmp_path, plain):
    """Dynamo traces the model with the capture hooks in place (backend aot_eager: the graph capture and
    AOTAutograd that inductor also uses, without code generation)."""
    torch.manual_seed(0)
    _assert_same(_logged(tmp_path, _Model(backend="aot_eager")), plain, rtol=0.0)


class _Manual(TinyLM):
    """The same model with ``automatic_optimization = False``: zero_grad, manual_backward, step by hand."""

    def __init__(self) -> None:
        super().__init__(n_layer=2, d_model=16)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        loss = F.cross_entropy(self(idx[:, :-1]).reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_gives_the_same_numbers(tmp_path, plain):
    """The evaluation runs in on_before_optimizer_step, which Lightning also calls for opt.step() by hand."""
    torch.manual_seed(0)
    _assert_same(_logged(tmp_path, _Manual()), plain, rtol=0.0)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
def test_torch_compile_inductor_gives_the_same_numbers_to_round_off(tmp_path, plain):
    """Inductor generates fused kernels (~25 s to compile here) that sum in another order: agreement to 1e-4
    (the Lanczos norms run to tol 1e-6 on inputs that differ by float32 round-off)."""
    torch.manual_seed(0)
    # inductor may donate its backward buffers (no retain_graph), depending on how it partitions the graph: the
    # real-loss keys are then left out, with a warning naming torch._functorch.config.donated_buffer, and the rest is
    # compared; where it keeps them, every key is compared
    caught: list[str] = []
    logged = _logged(tmp_path, _Model(backend="inductor"), caught)
    real = ("/ggn/", "sharpness", "stability", "precond", "lanczos/norms")
    has_real = [any(r in k for k in e for r in real[:-1]) for e in logged]
    left_out = [w for w in caught if "leaves the real-loss keys" in w]
    if not any(has_real):
        assert left_out and "donated_buffer" in left_out[0], caught
        expected = [{k: v for k, v in e.items() if not any(r in k for r in real)} for e in plain]
        got = [{k: v for k, v in e.items() if "lanczos/norms" not in k} for e in logged]
        _assert_same(got, expected, rtol=1e-4)
    else:
        assert all(has_real) and not left_out, left_out
        _assert_same(logged, plain, rtol=1e-4)
