"""LayerDescription: a layer written by hand, described in a few lines; the errors name what is missing.

The numbers of a described layer are checked end to end against torch.func in ``tests/test_end_to_end.py``
(cases ``hand-written``: separate q/k/v, and ``fused-qkv``: one fused projection described with ``qkv=``)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvwatch import LayerDescription, Sharpness, describe_layer, find_blocks
from curvwatch.adapters import ADAPTERS
from curvwatch.realloss.stability import param_index_map
from tests import zoo
from tests.utils import TOL, rel_err


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


def _trained_row(model: nn.Module, tmp_path) -> dict:
    """The monitor's logged keys at step 1 of a real Trainer run (AdamW, cross-entropy on random tokens)."""
    import lightning as L

    from curvwatch import CurvatureMonitor
    from tests.test_real_loss import curv_rows, make_trainer, read_rows

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            (idx,) = batch
            z = self.model(idx)
            return F.cross_entropy(z.reshape(-1, z.shape[-1]), idx.reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    ids = torch.randint(0, zoo.VOCAB, (8, 6))
    monitor = CurvatureMonitor(log_level="all", every_n_train_steps=1, sharpness=Sharpness(samples=2))
    trainer = make_trainer(tmp_path, monitor, max_steps=2)
    trainer.fit(Module(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4))
    return curv_rows(read_rows(trainer))[1]


def test_described_layer_trains_with_the_monitor(hand, tmp_path):
    """A real Trainer step logs every block of the described layer, sharpness included."""
    row = _trained_row(hand.float(), tmp_path)
    for key in ("layer1/attn/hessian/QQ/h3", "layer1/attn/hessian/KK/g1", "layer0/norm2/rms/ms_min",
                "layer0/ffn/hessian/W3W3", "layer0/ffn/stability/W1W1", "layer1/attn/sharpness/QQ/h0"):  # fmt: skip
        assert f"curv/{key}" in row, key


# -- a fused qkv projection (tests/zoo.py FusedBlock: nanoGPT-style c_attn, GQA 4/2, d_K = 4) ------------------------


@pytest.fixture
def fused():
    yield lambda layout="concat": zoo.fused_qkv(layout=layout).model
    ADAPTERS.pop(zoo.FusedBlock, None)


def test_fused_qkv_blocks_and_coverage(fused):
    model = fused()
    specs = find_blocks(model)
    assert [(s.name, s.kind) for s in specs][:4] == [
        ("layer0/attn", "attention"), ("layer0/ln_1", "layernorm"), ("layer0/ln_2", "layernorm"), ("layer0/ffn", "ffn"),
    ]  # fmt: skip
    assert specs[0].module is model.h[0].attn  # the nearest module holding qkv and o: its forward gets X
    assert specs[0].adapter.unmonitored(model.h[0]) == []
    ADAPTERS.pop(zoo.FusedBlock)  # (H + 2 H_kv) d_K != 3 d: not nanoGPT's structure, known through qkv= only
    with pytest.raises(ValueError, match="found no known Transformer layer"):
        find_blocks(model)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(n_kv_heads=4), r"qkv='attn.c_attn' has 32 outputs, but n_heads=4 and n_kv_heads=4 .* = 48 .*Fix: "),
        (dict(n_kv_heads=1), r"has 32 outputs, but n_heads=4 and n_kv_heads=1 .* = 24"),
        (dict(n_heads=8, n_kv_heads=2), r"has 32 outputs, but n_heads=8 and n_kv_heads=2 .*16/8 .* = 24"),
        (dict(n_kv_heads=3), r"n_heads=4 and n_kv_heads=3 .*\(and n_kv_heads dividing n_heads\)"),
        (dict(qkv="attn"), r"FusedBlock.attn is a FusedAttention; the LayerDescription needs an nn.Linear"),
        (dict(o="attn.c_out"), r"FusedBlock has no module 'attn.c_out'"),
    ],
)
def test_fused_qkv_errors_say_how_to_fix(fused, changes, match):
    model = fused()
    describe_layer(zoo.FusedBlock, zoo.fused_qkv_description(**changes))
    with pytest.raises(ValueError, match=match):
        find_blocks(model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(qkv="attn.c_attn", q="attn.q"), r"Invalid qkv='attn.c_attn' together with q='attn.q', k=None, v=None: "
         "name either the fused projection \\(qkv=\\) or the three projections"),
        (dict(qkv="attn.c_attn", k="attn.k", v="attn.v"), "together with q=None, k='attn.k', v='attn.v'"),
        (dict(), r"Invalid q=None, k=None, v=None: name all three projections q=, k=, v=, or one fused qkv="),
        (dict(q="attn.q", k="attn.k"), r"Invalid q='attn.q', k='attn.k', v=None"),
        (dict(qkv="attn.c_attn", qkv_layout="interleaved"),
         r"Invalid qkv_layout='interleaved'. Must be one of \['concat', 'per_head'\]"),
        (dict(q="q", k="k", v="v", qkv_layout="per_head"), r"Invalid qkv_layout='per_head' without qkv="),
    ],
)  # fmt: skip
def test_layer_description_validates_qkv(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LayerDescription(o="attn.o", n_heads=4, **kwargs)
    with pytest.raises(TypeError, match="'o'"):  # the output projection is always needed
        LayerDescription(qkv="attn.c_attn", n_heads=4)


def _attention_from_params(X: Tensor, p: dict) -> Tensor:
    """The attention output from the adapter's weights (math convention, query head h reads kv head h // G)."""
    B, L, _ = X.shape
    H = p["n_heads"]
    H_kv = p["n_kv_heads"] or H
    d_K = p["W_Q"].shape[1] // H
    q = (X @ p["W_Q"] + p["b_Q"]).view(B, L, H, d_K).transpose(1, 2)  # (B, H, L, d_K)
    k, v = ((X @ p[W] + p[b]).view(B, L, H_kv, d_K).transpose(1, 2) for W, b in (("W_K", "b_K"), ("W_V", "b_V")))
    k, v = k.repeat_interleave(H // H_kv, dim=1), v.repeat_interleave(H // H_kv, dim=1)  # (B, H, L, d_K)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, d_K)
    return y.transpose(1, 2).reshape(B, L, -1) @ p["W_O"] + p["b_O"]


@pytest.mark.parametrize(
    "layout, described",
    [("concat", "concat"), ("per_head", "per_head"), ("concat", "per_head"), ("per_head", "concat")],
)
def test_fused_qkv_layouts_read_the_modules_own_split(fused, layout, described):
    """The weights read under qkv_layout recompute the module's forward exactly, and only under its own layout."""
    model = fused(layout)
    describe_layer(zoo.FusedBlock, zoo.fused_qkv_description(qkv_layout=described))
    spec = find_blocks(model)[0]
    X = torch.randn(zoo.B, zoo.L, 16, dtype=torch.float64)
    with torch.no_grad():
        err = rel_err(_attention_from_params(X, spec.adapter.read_params(spec)), spec.module(X))
    if layout == described:
        assert err <= TOL["float64"], f"{layout} read as {described}: relative error {err:.1e}"
    else:  # same widths, other columns: a wrong layout is not silently close
        assert err > 1e-2, f"{layout} read as {described} reproduced the forward ({err:.1e}): the check cannot fail"


@pytest.mark.parametrize("layout", ["concat", "per_head"])
def test_fused_qkv_param_index_map(fused, layout):
    """The optimizer-state map of the fused block: cat(parameters)[index] is the weight read, from c_attn's rows."""
    model = fused(layout)
    spec = find_blocks(model)[0]
    read, found = spec.adapter.read_params(spec), param_index_map(spec)
    assert sorted(found) == ["W_K", "W_Q", "W_V"]
    c_attn = model.h[0].attn.c_attn
    for weight, (params, index) in found.items():
        assert len(params) == 1 and params[0] is c_attn.weight, weight
        torch.testing.assert_close(c_attn.weight.detach().reshape(-1)[index], read[weight], rtol=0, atol=0)
    if layout == "concat":  # W_K = c_attn.weight[H d_K : (H + H_kv) d_K].T
        rows = torch.arange(c_attn.weight.numel()).view_as(c_attn.weight)
        assert torch.equal(found["W_K"][1], rows[16:24].T) and torch.equal(found["W_V"][1], rows[24:32].T)


def test_fused_qkv_trains_with_the_monitor(fused, tmp_path):
    """A real Trainer step with AdamW logs the fused block's sharpness and its Adam stability ratios."""
    row = _trained_row(fused().float(), tmp_path)
    keys = ("hessian/QQ/h3", "hessian/KK/g1", "sharpness/QQ/h0", "stability/QQ/h0", "stability/KK/g1")
    for key in (f"layer{i}/attn/{k}" for i in (0, 1) for k in (*keys, "stability/VV/g0")):
        assert f"curv/{key}" in row, (key, sorted(k for k in row if "/attn/stability" in k))


def test_fused_qkv_wrong_layout_fails_end_to_end(tmp_path):
    """The end-to-end comparison of case fused-qkv fails when the description's layout is not the module's."""
    from tests.test_end_to_end import CASES, _check_block, record, train_one_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices (see test_end_to_end.one_thread)
    try:
        case = CASES["fused-qkv"]()  # concat c_attn
        describe_layer(zoo.FusedBlock, zoo.fused_qkv_description(qkv_layout="per_head"))
        initial = copy.deepcopy(case.model)
        logged, _ = train_one_step(case, tmp_path)
        ref = case.refs(initial)[0]
        assert ref.block == "layer0/attn"
        recs = record(initial, [ref], case.loss, case.batch)
        with pytest.raises(AssertionError, match="relative error"):
            _check_block(logged, ref, recs[ref.block], TOL["end_to_end"])
    finally:
        torch.set_num_threads(threads)
        ADAPTERS.pop(zoo.FusedBlock, None)
