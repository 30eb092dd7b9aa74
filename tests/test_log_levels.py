"""``log_level``: what reaches a real logger at each level on a 12-layer, 12-head model, and what keeps working.

The count is of distinct keys over a full evaluation (step 0) and a terms-only one (step 1), the images and the W&B
table included (they reach W&B as keys of their own). The warnings, summaries, heatmaps and tables read the whole
evaluation at every level.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from benchmarks.loggers import MemoryLogger
from curvwatch import Cadence, CurvatureMonitor, CurvatureWarning, Evaluation, Sharpness
from curvwatch.keys import SUMMARY_LEVEL, block_level, summary_level
from curvwatch.models.gpt import GPT, GPTConfig
from tests.ddp_script import TinyLM, loader

N_LAYER = N_HEAD = 12
VOCAB, SEQ = 11, 8


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these runs are many small kernels, which two threads on a shared machine slow 3x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Wide(L.LightningModule):
    """A 12-layer GPT with 12 heads of width 2 (d 24), SGD on random tokens (its stability threshold needs no
    optimizer state, so step 0 has it): the key count of a 12 x 12 model."""

    def __init__(self) -> None:
        super().__init__()
        config = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=N_LAYER, n_head=N_HEAD, d_model=24, d_ff=48)
        self.model = GPT(config)

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        logits = self.model(idx[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(tmp_path, monitor, model, loggers, max_steps):
    trainer = L.Trainer(
        accelerator="cpu", max_steps=max_steps, logger=loggers, callbacks=[monitor], default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, log_every_n_steps=50,
    )  # fmt: skip
    trainer.fit(model, loader(n=16, batch_size=4) if isinstance(model, TinyLM) else _tokens())
    return trainer


def _tokens():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (16, SEQ), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _wide_run(tmp_path, level, loggers, **kwargs):
    """Step 0 full, step 1 terms-only; exact pairs only (VV, W2W2: no Lanczos, seconds), 2 real-loss samples."""
    torch.manual_seed(0)
    monitor = CurvatureMonitor(
        every_n_train_steps=2,
        log_level=level,
        **kwargs,
        cadence=Cadence(terms_every_n_train_steps=1, max_overhead=None),
        evaluation=Evaluation(pairs=["VV", "W2W2"], max_tokens=14),
        sharpness=Sharpness(samples=2),
    )
    _fit(tmp_path, monitor, Wide(), loggers, max_steps=2)
    return monitor


@pytest.mark.parametrize("level, expected", [("blocks", 591), ("all", 3279)])
def test_key_count_per_level_on_a_12_layer_12_head_model(tmp_path, level, expected):
    """``"blocks"`` adds the per-block keys that are neither per head nor bounds/terms, ``"all"`` everything; each
    logged key is of its level or below (the default level's count, with the W&B media: the next test)."""
    logger = MemoryLogger()
    _wide_run(tmp_path, level, [logger], log_heatmap=False)
    keys = logger.keys()
    assert len(keys) == expected, f"{level}: {len(keys)} keys"
    block_keys = [k.split("/", 3)[3] for k in keys if k.startswith("curv/layer")]
    levels = {block_level(k) for k in block_keys}
    assert levels == ({"blocks"} if level == "blocks" else {"blocks", "all"})
    if level == "blocks":
        assert any(k.endswith("/ln_1/ln/var_min_over_eps") for k in keys)
        assert not any(k.endswith("/h0") or "/term/" in k or "/bound/" in k for k in keys)
    else:
        assert any(k.endswith("/attn/hessian/VV/h11") for k in keys) and any("/term/" in k for k in keys)


def test_default_level_is_at_most_60_keys_with_the_wandb_media(tmp_path, monkeypatch):
    """The default (``"summary"``) on a 12 x 12 model, to an offline W&B run: the headline summaries, per layer the
    block norm of each sub-block and the largest stability ratio, two heatmaps and the table, <= 60 keys in all;
    the per-layer keys sit in sections of their own (the prefix before the first ``/``)."""
    wandb = pytest.importorskip("wandb")
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    memory = MemoryLogger()
    run = WandbLogger(save_dir=str(tmp_path), offline=True, project="curvwatch-test")
    media: dict[str, list] = {}
    original_image, original_table = run.log_image, run.log_table

    def log_image(key, images, step=None, **kw):
        media.setdefault(key, []).append(step)
        return original_image(key=key, images=images, step=step, **kw)

    def log_table(key, columns=None, data=None, dataframe=None, step=None):
        media.setdefault(key, []).append((step, columns, data))
        return original_table(key=key, columns=columns, data=data, step=step)

    monkeypatch.setattr(run, "log_image", log_image)
    monkeypatch.setattr(run, "log_table", log_table)
    try:
        monitor = _wide_run(tmp_path, "summary", [memory, run])
    finally:
        wandb.finish()
    assert monitor.log_level.value == "summary" and CurvatureMonitor().log_level.value == "summary"
    keys = memory.keys()
    sections: dict[str, int] = {}
    for key in keys | set(media):
        sections[key.split("/")[0]] = sections.get(key.split("/")[0], 0) + 1
    assert sections == {"curv": 19 + 3, "curv_hessian": 2 * N_LAYER, "curv_stability": N_LAYER}, sections
    assert len(keys) + len(media) == 58 <= 60  # 59 with the default pairs (summary/lanczos/unconverged)
    assert set(media) == {"curv/summary/heatmap", "curv/summary/stability_heatmap", "curv/summary/layers"}
    assert {k[len("curv/") :] for k in keys if k.startswith("curv/")} <= SUMMARY_LEVEL
    assert all(summary_level(k[len("curv/") :]) == "summary" for k in keys if k.startswith("curv/"))
    # the per-layer keys are the per-block maxima the full evaluation computed
    (step, columns, rows), *later = media["curv/summary/layers"]
    assert step == 0 and not later  # full evaluations only (step 1 was terms-only)
    table = {row[columns.index("block")]: dict(zip(columns, row, strict=True)) for row in rows}
    assert len(table) == 4 * N_LAYER
    logged = memory.by_step()[0]
    for i in range(N_LAYER):
        for part in ("attn", "ffn"):
            value = logged[f"curv_hessian/layer{i}/{part}"]
            assert math.isclose(value, table[f"layer{i}/{part}"]["hessian_max"], rel_tol=1e-3)
        stab = max(table[f"layer{i}/{p}"]["stability_max"] for p in ("attn", "ffn"))
        assert math.isclose(logged[f"curv_stability/layer{i}"], stab, rel_tol=1e-3)
        assert table[f"layer{i}/ln_1"]["norm_ratio"] > 0 and table[f"layer{i}/attn"]["softmax_jac_min"] > 0
    # the headline and the signals on the terms-only step too
    assert "curv/summary/signals/softmax_jac_min" in memory.by_step()[1]
    assert "curv/summary/ln/var_min_over_eps" in memory.by_step()[1]


def test_warnings_fire_at_the_default_level_from_keys_it_does_not_log(tmp_path):
    """LayerNorm inputs far below eps: the suite's collapse rule reads the per-block ``ln/var_min_over_eps``, which
    the default level does not log; the warning fires and the model-wide minimum is logged."""
    model = TinyLM(lr=0.0)
    with torch.no_grad():
        model.model.tok_emb.weight.mul_(1e-4)
        model.model.pos_emb.weight.mul_(1e-4)
    logger = MemoryLogger()
    monitor = CurvatureMonitor(
        every_n_train_steps=100,
        cadence=Cadence(max_overhead=None, terms_every_n_train_steps=1),
        evaluation=Evaluation(max_tokens=16),
    )
    with pytest.warns(CurvatureWarning, match="variance collapse"):
        _fit(tmp_path, monitor, model, [logger], max_steps=4)
    keys = logger.keys()
    assert not any("/ln_1/" in k for k in keys)
    assert logger.by_step()[3]["curv/summary/ln/var_min_over_eps"] < 1
    assert logger.by_step()[3]["curv/summary/warnings"] >= 1
    assert monitor.alerts and monitor.alerts[0].block == "layer0/ln_1"


def test_listeners_get_every_key_whatever_the_level(tmp_path):
    """A listener (the demo's plots) gets each evaluation's every key; the logger only those of the level."""
    seen = []
    logger = MemoryLogger()
    monitor = CurvatureMonitor(
        every_n_train_steps=1,
        log_heatmap=False,
        cadence=Cadence(max_overhead=None),
        evaluation=Evaluation(max_tokens=16),
    )
    monitor.book.listeners.append(seen.append)
    _fit(tmp_path, monitor, TinyLM(), [logger], max_steps=2)
    assert [e.step for e in seen] == [0, 1]
    assert "curv/layer0/attn/hessian/QQ/h0" in seen[0].values and "curv/layer0/attn/hessian/QQ/h0" not in logger.keys()
    assert set(seen[0].logged) <= set(seen[0].values) and set(seen[0].logged) == set(logger.by_step()[0]) & set(
        seen[0].logged
    )


def test_invalid_log_level_names_the_choices():
    with pytest.raises(ValueError, match=r"Invalid log_level='heads'. Must be one of \['summary', 'blocks', 'all'\]"):
        CurvatureMonitor(log_level="heads")


def test_a_logger_that_refuses_the_table_gets_a_notice_not_a_crash():
    """A W&B logger whose ``log_table`` raises: the table is skipped with a :class:`CurvatureNotice` (a notice about
    the monitor itself, not an instability warning), and training goes on."""
    import warnings as _warnings

    from lightning.pytorch.loggers import WandbLogger

    from curvwatch import CurvatureNotice
    from curvwatch.sinks import log_table

    class Refusing(WandbLogger):
        def __init__(self) -> None:  # no W&B run: only log_table is called
            pass

        def log_table(self, **kwargs):
            raise RuntimeError("table refused")

    with _warnings.catch_warnings(record=True) as record:
        _warnings.simplefilter("always")
        log_table([Refusing()], "curv/summary/layers", [{"block": "layer0/attn", "hessian": 1.0}], step=0)
    assert [w.category for w in record] == [CurvatureNotice], [str(w.message) for w in record]
    assert "table refused" in str(record[0].message)
