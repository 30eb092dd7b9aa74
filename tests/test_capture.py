"""Capture: hook lifetime, first-call recording, subsampling, missing gradients, in-place outputs."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from curvwatch.adapters import ADAPTERS, adapter_for, find_blocks, register_adapter
from curvwatch.capture import Capture, CapturedBlock, token_slice
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import evaluate_block, kernel_inputs
from tests.utils import TOL, assert_close_report

B, L, D, H = 4, 5, 8, 2

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def _hooks(model: nn.Module) -> int:
    return sum(len(getattr(m, name)) for m in model.modules() for name in _HOOK_DICTS)


def _layer(**kw) -> nn.TransformerEncoderLayer:
    return nn.TransformerEncoderLayer(D, H, dim_feedforward=16, dropout=0.0, batch_first=True, **kw).double()


def _x(*shape) -> torch.Tensor:
    return torch.randn(*(shape or (B, L, D)), dtype=torch.float64)


def test_hooks_exist_only_inside_with():
    layer = _layer()
    specs = find_blocks(layer)
    assert _hooks(layer) == 0
    with Capture(specs, max_tokens=100) as capture:
        assert _hooks(layer) > 0
        layer(_x()).sum().backward()
    assert _hooks(layer) == 0
    assert all(b.reason is None for b in capture.blocks())


def test_tensor_hooks_removed_after_exit():
    layer = _layer()
    capture = Capture(find_blocks(layer), max_tokens=100)
    with capture:
        out = layer(_x())
    out.sum().backward()
    blocks = capture.blocks()
    assert all(b.reason is not None and "no gradient arrived" in b.reason for b in blocks)
    with pytest.raises(RuntimeError, match="no gradient arrived"):
        evaluate_block(
            blocks[0], lanczos=Lanczos(tol=1e-6, max_iter=10, max_basis=None, warn=False), dtype=torch.float64
        )


@pytest.mark.parametrize("where", ["before_backward", "after_backward"])
def test_hooks_removed_on_exception(where):
    layer = _layer()
    with pytest.raises(KeyError, match="boom"):
        with Capture(find_blocks(layer), max_tokens=100):
            out = layer(_x())
            if where == "after_backward":
                out.sum().backward()
            raise KeyError("boom")
    assert _hooks(layer) == 0


def test_subsampling_whole_sequences_then_prefix():
    assert token_slice(4, 5, 12) == (2, 5)
    assert token_slice(4, 5, 20) == (4, 5)
    assert token_slice(4, 5, 4) == (1, 4)
    assert token_slice(4, 5, 1) == (1, 1)
    layer = _layer()
    X = _x()
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, 4:] = True
    kpm[3, 2:] = True
    for max_tokens, (k, l) in ((12, (2, 5)), (3, (1, 3)), (100, (4, 5))):
        with Capture(find_blocks(layer), max_tokens=max_tokens) as capture:
            out = layer(X, src_key_padding_mask=kpm)
            out.retain_grad()
            (out * X).sum().backward()  # gradient at the layer output = X
        attn, ln_1, _, ffn = capture.blocks()
        assert attn.inputs["X"].shape == (k, l, D) and attn.inputs["grad_output"].shape == (k, l, D)
        assert torch.equal(attn.inputs["X"], X[:k, :l])
        expected_kpm = kpm[:k, :l]
        if expected_kpm.any():
            assert torch.equal(attn.inputs["key_padding_mask"], expected_kpm)
            assert torch.equal(ffn.inputs["row_mask"], ~expected_kpm)
        else:
            assert "key_padding_mask" not in attn.inputs and "row_mask" not in ffn.inputs
        assert ln_1.inputs["grad_output"].shape == (k, l, D)
        assert torch.equal(capture.blocks()[2].inputs["grad_output"], out.grad[:k, :l])  # ln_2 is the last op


def test_records_only_first_call_with_grad():
    layer = _layer()
    X0, X1, X2 = _x(), _x(), _x()
    captured = {}
    layer.self_attn.register_forward_hook(lambda m, a, o: captured.setdefault(len(captured), o[0]))
    with Capture(find_blocks(layer), max_tokens=100) as capture:
        with torch.no_grad():
            layer(X0)  # cannot produce a gradient: ignored
        out1 = layer(X1)
        layer(X2).sum().backward()  # a later call (e.g. validation): ignored
        captured[1].retain_grad()
        out1.square().sum().backward()
    attn = capture.blocks()[0]
    assert torch.equal(attn.inputs["X"], X1)
    assert torch.equal(attn.inputs["grad_output"], captured[1].grad)


def test_reasons_for_missing_data():
    layer = _layer()
    with Capture(find_blocks(layer), max_tokens=100) as capture:
        pass
    assert all("no forward call" in b.reason for b in capture.blocks())

    layer.requires_grad_(False)
    with Capture(find_blocks(layer), max_tokens=100) as capture:
        layer(_x())
    assert all("does not require grad" in b.reason for b in capture.blocks())


def test_invalid_arguments():
    specs = find_blocks(_layer())
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens"):
            Capture(specs, max_tokens=bad)
    with pytest.raises(ValueError, match="specs"):
        Capture([], max_tokens=10)


class _InPlaceLayer(nn.TransformerEncoderLayer):
    """FFN output scaled in place after ``linear2``, as residual code often does."""

    def _ff_block(self, x):
        y = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return y.mul_(2.0)


class _OutOfPlaceLayer(nn.TransformerEncoderLayer):
    def _ff_block(self, x):
        y = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return y * 2.0


def test_gradient_is_wrt_module_output_even_if_modified_in_place(monkeypatch):
    monkeypatch.setattr("curvwatch.adapters.ADAPTERS", dict(ADAPTERS))
    register_adapter(_InPlaceLayer, adapter_for(nn.TransformerEncoderLayer))
    kw = dict(dim_feedforward=16, dropout=0.0, batch_first=True)
    inplace = _InPlaceLayer(D, H, **kw).double()
    twin = _OutOfPlaceLayer(D, H, **kw).double()
    twin.load_state_dict(inplace.state_dict())
    X = _x()
    with Capture(find_blocks(inplace), max_tokens=100) as capture:
        inplace(X).square().sum().backward()
    seen = []

    def keep(module, args, output):
        output.retain_grad()
        seen.append(output)

    twin.linear2.register_forward_hook(keep)
    twin(X).square().sum().backward()
    ffn = capture.blocks()[-1]
    assert ffn.spec.name == "layer0/ffn"
    assert_close_report(ffn.inputs["grad_output"], seen[0].grad, TOL["float64"], "in-place grad_output")


def _gpt(norm="pre", activation="gelu", dtype=torch.float64):
    gpt = pytest.importorskip("curvwatch.models.gpt")
    cfg = gpt.GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=H, d_model=4, d_ff=8, norm=norm)
    cfg.activation = activation
    return gpt.GPT(cfg).to(dtype)


def _captured_gpt(max_tokens=8, **kw) -> list[CapturedBlock]:
    model = _gpt(**kw)
    idx = torch.randint(0, 11, (3, 4))
    with Capture(find_blocks(model), max_tokens=max_tokens) as capture:
        model(idx).logsumexp(-1).sum().backward()
    return capture.blocks()


def _closed_form(name):
    try:
        cf = importlib.import_module("curvwatch.closed_form")
        ref = importlib.import_module("curvwatch.reference")
    except ImportError as err:
        pytest.skip(f"curvwatch.closed_form/reference not importable yet: {err}")
    ref_name = {"multi_head_attention": "multi_head_attention_blocks", "ffn": "ffn_blocks"}.get(name)
    if not hasattr(cf, name) or (ref_name and not hasattr(ref, ref_name)):
        pytest.skip(f"curvwatch.closed_form.{name} or its reference is not available yet")
    return cf, ref


def test_evaluate_attention_matches_reference():
    _, ref = _closed_form("multi_head_attention")
    attn = _captured_gpt()[0]
    assert attn.spec.kind == "attention" and attn.inputs["X"].shape == (2, 4, 4)
    out = evaluate_block(
        attn, lanczos=Lanczos(tol=1e-12, max_iter=200, max_basis=None, warn=False), dtype=torch.float64
    )
    expected = ref.dense_to_norms(ref.multi_head_attention_blocks(**kernel_inputs(attn, torch.float64)))
    common = sorted(set(out) & set(expected))
    assert len(common) >= 3 * 6 * H, sorted(out)
    for key in common:
        assert_close_report(out[key], expected[key], TOL["lanczos"], key)


def test_evaluate_casts_float32_capture():
    _closed_form("multi_head_attention")
    attn = _captured_gpt(dtype=torch.float32)[0]
    assert attn.inputs["X"].dtype == torch.float32
    out64 = evaluate_block(attn, lanczos=Lanczos(tol=1e-2, max_iter=3, max_basis=None, warn=False), dtype=torch.float64)
    out32 = evaluate_block(attn, lanczos=Lanczos(tol=1e-2, max_iter=3, max_basis=None, warn=False), dtype=torch.float32)
    assert all(v.dtype == torch.float64 for v in out64.values())
    assert all(v.dtype == torch.float32 for v in out32.values())
    with pytest.raises(ValueError, match="dtype"):
        evaluate_block(attn, lanczos=Lanczos(tol=1e-6, max_iter=10, max_basis=None, warn=False), dtype=torch.float16)


def test_evaluate_ffn_matches_reference_with_padding():
    _, ref = _closed_form("ffn")
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0, batch_first=True).double()
    kpm = torch.tensor([[False, False, False, True], [False, False, False, False]])
    with Capture(find_blocks(layer), max_tokens=8) as capture:
        layer(_x(2, 4, 4), src_key_padding_mask=kpm).square().sum().backward()
    ffn = capture.blocks()[-1]
    assert ffn.spec.kind == "ffn" and ffn.params["residual"] is False
    assert torch.equal(ffn.inputs["row_mask"], ~kpm)
    out = evaluate_block(ffn, lanczos=Lanczos(tol=1e-12, max_iter=200, max_basis=None, warn=False), dtype=torch.float64)
    expected = ref.dense_to_norms(ref.ffn_blocks(**kernel_inputs(ffn, torch.float64)))
    common = sorted(set(out) & set(expected))
    assert len(common) >= 3, sorted(out)
    for key in common:
        assert_close_report(out[key], expected[key], TOL["lanczos"], key)


def test_evaluate_layernorm_runs():
    _closed_form("layernorm")
    ln = _captured_gpt()[1]
    assert ln.spec.kind == "layernorm"
    out = evaluate_block(ln, lanczos=Lanczos(tol=1e-6, max_iter=50, max_basis=None, warn=False), dtype=torch.float64)
    assert out and all(v.ndim == 0 and torch.isfinite(v) for v in out.values())


def test_gpt2_ffn_gelu_tanh_evaluates_or_is_refused_by_name():
    tf = pytest.importorskip("transformers")
    cf, _ = _closed_form("ffn")
    cfg = tf.GPT2Config(
        n_layer=1, n_embd=4, n_head=2, vocab_size=11, n_positions=8, bos_token_id=None, eos_token_id=None
    )
    model = tf.GPT2Model(cfg).double()
    with Capture(find_blocks(model), max_tokens=8) as capture:
        model(input_ids=torch.randint(0, 11, (2, 4)), use_cache=False).last_hidden_state.sum().backward()
    ffn = capture.blocks()[-1]
    assert ffn.params["activation"] == "gelu_tanh"
    if "gelu_tanh" in getattr(importlib.import_module("curvwatch.closed_form.ffn"), "ACTIVATIONS", ()):
        out = evaluate_block(
            ffn, lanczos=Lanczos(tol=1e-3, max_iter=5, max_basis=None, warn=False), dtype=torch.float64
        )
        assert out and all(torch.isfinite(v).all() for v in out.values())
    else:
        with pytest.raises(ValueError, match="gelu_tanh"):
            evaluate_block(ffn, lanczos=Lanczos(tol=1e-3, max_iter=5, max_basis=None, warn=False), dtype=torch.float64)


def test_nonfinite_names_the_tensors_with_nan_or_inf():
    """One reduction per tensor: NaN and -inf are both found, masks and empty tensors are not flagged."""
    X = torch.randn(2, 3, 4)
    bad_x, bad_g = X.clone(), X.clone()
    bad_x[1, 2, 3] = float("nan")
    bad_g[0, 0, 0] = float("-inf")
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert CapturedBlock(None, inputs={"X": X, "grad_output": X, "row_mask": mask}).nonfinite() == []
    assert CapturedBlock(None, inputs={"X": bad_x, "grad_output": bad_g}).nonfinite() == ["X", "grad_output"]
    assert CapturedBlock(None, inputs={"X": X, "grad_output": bad_g.bfloat16()}).nonfinite() == ["grad_output"]
    assert CapturedBlock(None, inputs={"X": torch.empty(0, 3, 4), "grad_output": X}).nonfinite() == []
