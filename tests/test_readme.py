"""The README's Python snippets run as written: each is extracted from README.md and executed, on CPU, in a fresh
namespace and a temporary working directory.

The Lightning snippet trains "your" ``model`` on "your" ``datamodule``; :func:`_preamble` defines the two (a small
GPT on 2-digit addition) and is the only code the README does not show. The other snippets build their own model.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def _snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def _preamble() -> dict:
    """``model`` and ``datamodule`` for the Lightning snippet: a LightningModule around curvwatch's GPT on 2-digit
    addition, and its data."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from curvwatch.data import IGNORE_INDEX, VOCAB_SIZE, AdditionDataModule, sequence_length
    from curvwatch.models import GPT, GPTConfig

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=sequence_length(2), n_layer=2, n_head=2,
                                     d_model=32))  # fmt: skip

        def training_step(self, batch, batch_idx):
            input_ids, targets = batch
            logits = self.gpt(input_ids)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

        def validation_step(self, batch, batch_idx):
            self.log("val/loss", self.training_step(batch, batch_idx))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return {"model": Module(), "datamodule": AdditionDataModule(n_digits=2, n_train=512, n_val=64, batch_size=16)}


def test_the_readme_has_the_three_usage_snippets():
    snippets = _snippets()
    assert len(snippets) == 3
    assert "CurvatureMonitor()" in snippets[0] and "Monitor(model" in snippets[1]
    assert "curvwatch.hf_trainer.CurvatureCallback(" in snippets[2]
    assert len(README.read_text().splitlines()) <= 150


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", [0, 1, 2], ids=["lightning", "plain-loop", "hf-trainer"])
def test_readme_snippet_runs_as_written(index, tmp_path, monkeypatch):
    if index == 2:
        pytest.importorskip("transformers")
        pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    code = _snippets()[index]
    namespace = {"__name__": "__readme__", **(_preamble() if index == 0 else {})}
    exec(compile(code, f"README.md snippet {index + 1}", "exec"), namespace)
    if index == 0:
        assert namespace["trainer"].global_step == 100
    if index == 1:
        assert namespace["logged"][0]["curv/summary/max_hessian"] > 0
    if index == 2:
        assert namespace["trainer"].state.global_step == 5
        assert namespace["logged"][0]["curv/summary/max_hessian"] > 0
