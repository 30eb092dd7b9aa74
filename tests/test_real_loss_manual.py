"""Real-loss keys under Lightning's manual optimization (``automatic_optimization = False``): the backward called as
``loss.backward()``, several micro-batches before one optimizer step, several optimizers. Tiny 2-layer GPT, two
full evaluations (steps 0 and 2), 4 samples: seconds each."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from curvwatch import CurvatureMonitor, CurvatureNotice, Sharpness
from tests.ddp_script import VOCAB, TinyLM, loader
from tests.test_callback import curv_rows, make_trainer, read_rows

REAL = ("/sharpness/", "/ggn/", "/stability/", "precond_")


class _Manual(TinyLM):
    """Manual optimization: ``backward`` ``"manual"`` (``self.manual_backward``) or ``"plain"`` (``loss.backward()``);
    ``micro`` micro-batches per optimizer step (losses divided by it); ``two``: the FFN parameters in a second
    optimizer (same learning rate), each optimizer stepped by hand."""

    def __init__(self, backward: str = "manual", micro: int = 1, two: bool = False) -> None:
        super().__init__(n_layer=2)
        self.automatic_optimization = False
        self.backward_kind, self.micro, self.two = backward, micro, two

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for part in idx.chunk(self.micro):
            logits = self(part[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), part[:, 1:].reshape(-1)) / self.micro
            if self.backward_kind == "plain":
                loss.backward()
            else:
                self.manual_backward(loss)
        for opt in opts:
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        if not self.two:
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        ffn = [p for n, p in self.named_parameters() if ".mlp." in n]
        assert ffn, [n for n, _ in self.named_parameters()]
        rest = [p for n, p in self.named_parameters() if ".mlp." not in n]
        return [torch.optim.SGD(rest, lr=self.lr), torch.optim.SGD(ffn, lr=self.lr)]


def _run(tmp_path, make, **monitor_kwargs) -> tuple[dict[int, dict[str, float]], list[str]]:
    """``({step: real-loss keys}, [notices])`` of a 3-step fit of ``make()`` (built after seeding: the same initial
    weights in every run) with evaluations at steps 0 and 2."""
    torch.manual_seed(0)
    module = make()
    monitor_kwargs.setdefault("sharpness", Sharpness(samples=4))
    monitor = CurvatureMonitor(log_level="all", every_n_train_steps=2, **monitor_kwargs)
    trainer = make_trainer(tmp_path, monitor, max_steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CurvatureNotice)
        trainer.fit(module, loader())
    rows = curv_rows(read_rows(trainer))
    real = {step: {k: v for k, v in row.items() if any(r in k for r in REAL)} for step, row in rows.items()}
    return real, [str(w.message) for w in caught if issubclass(w.category, CurvatureNotice)]


def test_loss_backward_instead_of_manual_backward_gives_the_same_keys(tmp_path):
    """``loss.backward()`` skips Lightning's on_before_backward: the samples are drawn from the logits' gradient during
    the backward itself, the same as with manual_backward (same seed); verify_every_n_evals, which needs the loss
    before its backward, says so once naming manual_backward."""
    manual, notices = _run(tmp_path / "manual", lambda: _Manual("manual"))
    assert not notices, notices
    plain, notices = _run(tmp_path / "plain", lambda: _Manual("plain"))
    assert not notices, notices
    assert sorted(plain) == [0, 2] and "curv/layer1/ffn/stability/W2W2" in plain[2]
    assert plain == manual
    verify = Sharpness(samples=4, verify_every_n_evals=1)
    _, notices = _run(tmp_path / "verify", lambda: _Manual("plain"), sharpness=verify)
    assert [n for n in notices if "verify_every_n_evals needs the loss" in n and "self.manual_backward(loss)" in n]


def test_micro_batches_keep_the_first_ones_samples_without_a_false_warning(tmp_path):
    """Two manual_backward calls per optimizer step: the second no longer reads as "no real-loss keys" (it found the
    block outputs released by the first); the first micro-batch's samples are kept, and one notice says that the keys
    are the first backward's loss as back-propagated."""
    one, _ = _run(tmp_path / "one", lambda: _Manual("manual"))
    for backward in ("manual", "plain"):
        real, notices = _run(tmp_path / backward, lambda b=backward: _Manual(b, micro=2))
        assert not [n for n in notices if "no real-loss keys" in n], notices
        assert [n for n in notices if "ran 2 backward passes" in n and "about 1/k" in n], notices
        assert sorted(real) == [0, 2] and set(real[2]) == set(one[2])
        assert all(v > 0 for k, v in real[2].items() if "/sharpness/" in k)


def test_two_optimizers_give_every_block_its_ratio(tmp_path):
    """The FFN weights in a second optimizer: its ratios are found there (they were dropped as "not in the
    optimizer's parameter groups"); at step 0 the same numbers as with one optimizer of the same learning rate."""
    one, _ = _run(tmp_path / "one", lambda: _Manual("manual"))
    two, notices = _run(tmp_path / "two", lambda: _Manual("manual", two=True))
    assert not [n for n in notices if "stability" in n], notices
    assert sorted(two) == [0, 2]  # Lightning counts every optimizer's step: global step 2 is the second batch here
    assert all("curv/layer1/ffn/stability/W2W2" in two[s] and "curv/layer0/attn/stability/QQ/h0" in two[s] for s in two)
    assert two[0] == one[0]
