"""Text reports: the coverage table of monitored and unmonitored parts, and the run summary."""

from __future__ import annotations

import torch

from curvwatch.adapters import find_blocks
from curvwatch.adapters.builtin import TorchTransformerLayerAdapter
from curvwatch.alerts import Alert
from curvwatch.report import coverage_rows, coverage_text, summary_text


class _WithRouter(TorchTransformerLayerAdapter):
    def unmonitored(self, layer):
        return [("router", "mixture-of-experts routing is not modelled")]


def test_coverage_names_the_parts_left_out_once_per_layer():
    layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16) for _ in range(2))
    specs = find_blocks(layers)
    adapter = _WithRouter()
    for s in specs:
        s.adapter = adapter
    rows = coverage_rows(specs)
    left_out = [(r["layer"], r["part"], r["status"]) for r in rows if r["status"] != "monitored"]
    assert left_out == [("0", "router", "not monitored: mixture-of-experts routing is not modelled"),
                        ("1", "router", "not monitored: mixture-of-experts routing is not modelled")]  # fmt: skip
    text = coverage_text(rows)
    assert text.splitlines()[0].split() == ["layer", "part", "kind", "status"] and "router" in text


def test_summary_text_lists_peaks_warnings_and_skips():
    alert = Alert("spike", "layer0/attn", 3, 5.0, 2.0, "msg")
    text = summary_text(evaluations=2, terms_evaluations=4, skipped=1, last_step=3, fired=1,
                        last_norms={"layer0/attn": 5.0, "layer0/ffn": 1.0},
                        last_summary={"summary/heterogeneity/model": 0.7, "summary/lanczos/unconverged": 1.0,
                                      "summary/lanczos/norms": 9.0, "summary/lanczos/rel_residual_max": 0.05},
                        peak={"value": 5.0, "block": "layer0/attn", "step": 3}, history=[alert],
                        errors=["step 1: induced"], max_iter=40, tol=1e-2)  # fmt: skip
    assert "2 evaluation(s), 4 terms-only (last at step 3), 1 skipped, 1 warning(s)" in text
    assert text.index("layer0/attn") < text.index("layer0/ffn")
    assert "1 of 9 norms stopped at max_iter=40" in text and "step 3: spike in layer0/attn" in text
    assert "step 1: induced" in text


def test_coverage_names_the_modules_outside_the_layers():
    from curvwatch.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8, d_ff=16))
    rows = coverage_rows(find_blocks(model), model)
    assert [r for r in rows if r["status"] != "monitored"] == [
        {"layer": "-", "part": "tok_emb, pos_emb, ln_f, head", "kind": "-",
         "status": "not monitored: outside the Transformer layers (embeddings, final norm, output head): not modelled"}
    ]  # fmt: skip
    assert sum(r["status"] == "monitored" for r in rows) == 8
