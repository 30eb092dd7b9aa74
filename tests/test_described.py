"""LayerDescription: a layer written by hand, described in a few lines; the errors name what is missing.

The numbers of a described layer are checked end to end against torch.func in ``tests/test_end_to_end.py``
(case ``hand-written``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvwatch import LayerDescription, describe_layer, find_blocks
from curvwatch.adapters import ADAPTERS
from tests import zoo


@pytest.fixture
def hand():
    model = zoo.hand_written().model
    yield model
    ADAPTERS.pop(zoo.HandLayer, None)


def _describe(**changes):
    base = dict(q="attn.wq", k="attn.wk", v="attn.wv", o="attn.wo", n_heads=4, n_kv_heads=2, norms=("norm1",),
                gate="mlp.gate", up="mlp.up", down="mlp.down", activation="silu")  # fmt: skip
    describe_layer(zoo.HandLayer, LayerDescription(**{**base, **changes}))


def test_described_layer_blocks_and_coverage(hand):
    assert [(s.name, s.kind) for s in find_blocks(hand)][:4] == [
        ("layer0/attn", "attention"), ("layer0/norm1", "rmsnorm"), ("layer0/norm2", "rmsnorm"),
        ("layer0/ffn", "gated_ffn"),
    ]  # fmt: skip
    _describe()  # norm2 left out: named as not monitored
    spec = find_blocks(hand)[0]
    assert spec.adapter.unmonitored(hand.layers[0]) == [("norm2", "RMSNorm has parameters that no block spec reads")]


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(q="attn.query"), r"HandLayer has no module 'attn.query'.*its modules are \['norm1'"),
        (dict(o="attn"), "HandLayer.attn is a HandAttention; the LayerDescription needs an nn.Linear"),
        (dict(n_heads=3), "which n_heads=3 and n_kv_heads=2 do not divide"),
    ],
)
def test_described_layer_errors_name_what_is_missing(hand, changes, match):
    _describe(**changes)
    with pytest.raises(ValueError, match=match):
        find_blocks(hand)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_heads=0), r"Invalid n_heads=0"),
        (dict(up="mlp.up"), "name both MLP projections"),
        (dict(gate="mlp.gate"), "a gated MLP also needs up= and down="),
        (dict(up="mlp.up", down="mlp.down", activation="silu"), "Invalid activation='silu' for a FFN"),
    ],
)
def test_layer_description_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerDescription(q="q", k="k", v="v", o="o", **{"n_heads": 2, **kwargs})
    with pytest.raises(TypeError, match="Must be a curvwatch.adapters.LayerDescription"):
        describe_layer(nn.Module, {"q": "q"})


def test_described_layer_trains_with_the_monitor(hand, tmp_path):
    """A real Trainer step logs every block of the described layer, sharpness included."""
    import lightning as L

    from curvwatch import CurvatureMonitor
    from tests.test_real_loss import curv_rows, make_trainer, read_rows

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = hand.float()

        def training_step(self, batch, batch_idx):
            (idx,) = batch
            z = self.model(idx)
            return torch.nn.functional.cross_entropy(z.reshape(-1, z.shape[-1]), idx.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, zoo.VOCAB, (8, 6))
    trainer = make_trainer(tmp_path, CurvatureMonitor(every_n_train_steps=1, sharpness_samples=2), max_steps=2)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4))
    row = curv_rows(read_rows(trainer))[1]
    for key in ("layer1/attn/hessian/QQ/h3", "layer1/attn/hessian/KK/g1", "layer0/norm2/rms/ms_min",
                "layer0/ffn/hessian/W3W3", "layer0/ffn/stability/W1W1", "layer1/attn/sharpness/QQ/h0"):  # fmt: skip
        assert f"curv/{key}" in row, key
