"""The cost model (benchmarks/cost_model.py, benchmarks/cost_count.py): its pricing arithmetic by hand, the
extrapolation and the parts, the calibration, its counting on a tiny model, and gpu_scale.sh's comparison on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import bench_dispatch, cost_count
from benchmarks import cost_model as cm
from benchmarks.bench_dispatch import count_host_reads

# a card with round rates, so that the milliseconds below can be computed by hand
CARD = cm.Machine("test card", fp32=10e12, tf32=100e12, bf16=200e12, hbm=1e12)
CONSTANTS = cm.Constants(fp32_efficiency=0.5, tensor_efficiency=0.5, hbm_efficiency=0.7, host_op_s=5e-6, sync_s=20e-6)


def _tally(segments, syncs):
    """A part's counts as the counter writes them: its totals are its stretches' sums."""
    flops = {}
    for _, fl, _ in segments:
        for d, f in fl.items():
            flops[d] = flops.get(d, 0) + f
    return {"segments": segments, "syncs": syncs, "ops": sum(s[0] for s in segments), "views": 0, "flops": flops,
            "bytes": sum(s[2] for s in segments), "entry_live": 2**30, "working": 2**20}  # fmt: skip


def test_price_by_hand():
    # stretch 1: 1,000 operators (5 ms of host), 1 TFLOP float32: 200 ms at 5 TFLOP/s (FP32), 20 ms at 50 (TF32);
    # stretch 2: 100 operators (0.5 ms), 2 TFLOP bf16 at 100 TFLOP/s = 20 ms plus 7 GB at 0.7 TB/s = 10 ms;
    # one sync, 0.02 ms
    tally = _tally([[1000, {"float32": 1e12}, 0], [100, {"bfloat16": 2e12}, 7e9]], syncs=1)
    fp32 = cm.price(tally, CARD, CONSTANTS)
    assert fp32["ms"] == pytest.approx(200 + 30 + 0.02)
    assert fp32["host_ms"] == pytest.approx(5.5) and fp32["device_ms"] == pytest.approx(230)
    assert cm.price(tally, CARD, CONSTANTS, tf32=True)["ms"] == pytest.approx(20 + 30 + 0.02)
    # a stretch of many small operators is bound by the host: 10,000 operators, 50 ms, for 1 GFLOP
    host_bound = _tally([[10_000, {"float32": 1e9}, 0]], syncs=0)
    assert cm.price(host_bound, CARD, CONSTANTS)["ms"] == pytest.approx(50)
    # counts without stretches (a difference of two steps): one max(host, device) of the whole; negatives count 0
    diff = {"ops": 1100, "flops": {"float32": 1e12, "bfloat16": -1e9}, "bytes": -5, "syncs": 1, "factorizations": 0}
    assert cm.price_counts(diff, CARD, CONSTANTS) == pytest.approx(200 + 0.02)
    # two eigh calls: 3.5 ms each (and a sync each, counted among the syncs)
    eigh = {**_tally([[10, {}, 0], [10, {}, 0], [10, {}, 0]], syncs=2), "factorizations": 2}
    assert cm.price(eigh, CARD, cm.Constants())["ms"] == pytest.approx(30 * 5e-3 + 2 * 0.02 + 2 * 3.5)


def test_extrapolate_in_layers_and_batch():
    cells = {"n1_b1": {"ops": 100.0, "flops": {"bfloat16": 10.0}}, "n2_b1": {"ops": 130.0, "flops": {"bfloat16": 14.0}},
             "n1_b2": {"ops": 101.0, "flops": {"bfloat16": 19.0}},
             "n2_b2": {"ops": 140.0, "flops": {"bfloat16": 27.0}}}  # fmt: skip
    # bilinear: c11 + 11 (c21 - c11) + 7 (c12 - c11) + 77 (c22 - c21 - c12 + c11)
    assert cm.extrapolate(cells, 12, 8) == {"ops": 100 + 330 + 7 + 77 * 9, "flops": {"bfloat16": 10 + 44 + 63 + 77 * 4}}
    # counted at batch 1 only (the engine's part): linear in the layers, the same at any batch
    assert cm.extrapolate({k: cells[k] for k in ("n1_b1", "n2_b1")}, 12, 8)["ops"] == 430
    deep = {"n12_b1": {"ops": 50.0}, "n12_b2": {"ops": 60.0}}
    assert cm.extrapolate(deep, 12, 8) == {"ops": 120.0}
    with pytest.raises(ValueError, match="count the tier at 6 layers"):
        cm.extrapolate(deep, 6, 8)


def _counts(engine_full=3000, engine_nrl=2000, sampling=500, plugin=10, step=400, capture=20):
    """Synthetic counts of one model: every cell the same (no growth in layers or batch), host-bound tallies."""

    def cell(**parts):
        tallies = {name: _tally([[ops, {}, 0]], syncs=1) for name, ops in parts.items()}
        return {"steps": [{"parts": tallies, "peak_bytes": 2**31}]}

    grid = lambda **parts: {k: cell(**parts) for k in ("n1_b1", "n2_b1", "n1_b2", "n2_b2")}  # noqa: E731
    return {
        "off": grid(step=step),
        "full": grid(step=step + capture, engine=engine_full, sampling=sampling, plugin=plugin),
        "full_nrl": grid(step=step + capture, engine=engine_nrl, plugin=0),
        "terms": {k: cell(step=step + capture, engine=100, plugin=0) for k in ("n12_b1", "n12_b2")},
    }


def test_estimate_attributes_the_parts():
    est = cm.estimate(_counts(), 12, 8, CONSTANTS)
    full = est["full"]
    assert full["closed forms"]["ops"] == 2000
    assert full["real-loss solves"]["ops"] == 3000 - 2000 + 10  # the engine's marginal cost, and the plugin
    assert full["real-loss sampling"]["ops"] == 500
    assert full["capture & logging"]["ops"] == 20 and full["capture & logging"]["syncs"] == 0
    assert full["total"]["ops"] == 2000 + 1010 + 500 + 20
    assert est["terms"]["total"]["ops"] == 120
    # host-bound: each part's milliseconds are its operators' 5 us plus 20 us per sync; steps are over the plain step's
    step_ms = 400 * 5e-3 + 0.02
    assert est["step"]["total"]["ms"]["H200"]["fp32"] == pytest.approx(step_ms)
    total_ms = est["full"]["total"]["ms"]["H100"]["tf32"]
    assert total_ms == pytest.approx(3530 * 5e-3 + 3 * 0.02)
    assert est["full"]["total"]["steps"]["H100"]["tf32"] == pytest.approx(total_ms / step_ms)


def test_calibration_fits_the_tensor_efficiency_to_a_measured_step():
    """A compute-bound step: 1 PFLOP of bf16 in one stretch. Measured at 2.5 s on the H200 (989.4 TFLOP/s): the fitted
    efficiency is 1e15 / (2.5 s * 989.4e12) = 40.4%, and a check point is priced beside its measurement."""
    counts = _counts()
    for cell in counts["off"].values():
        cell["steps"][0]["parts"]["step"] = _tally([[400, {"bfloat16": 1e15}, 0]], syncs=0)
    point = {"arch": "gpt", "n_layer": 12, "batch": 8, "seq": 1024, "tier": "step", "machine_kind": "H200"}
    points = [{**point, "what": "step", "use": "fit", "ms": 2500.0},
              {**point, "what": "the same, checked", "use": "check", "ms": 2000.0},
              {**point, "what": "another design", "use": "none", "ms": 1.0}]  # fmt: skip
    c, fits = cm.calibrated({"gpt": counts}, points)
    assert c.tensor_efficiency == pytest.approx(1e15 / (2.5 * 989.4e12), rel=1e-3)
    assert [f["point"] for f in fits] == ["step", "the same, checked"]
    assert fits[0]["ratio"] == pytest.approx(1.0, abs=2e-3) and fits[1]["ratio"] == pytest.approx(1.25, abs=3e-3)


def test_part_counter_counts_flops_by_dtype_syncs_and_stretches():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    counter = cost_count.PartCounter()
    counter.hold([a, b])  # made before the counter: alive throughout
    with counter, count_host_reads(counter):
        (a @ b).sum().item()  # one stretch ends at the sync
        with counter.part("inner"):
            (a.bfloat16() @ b.bfloat16()).tolist()  # a host read: a sync of the inner part
    step, inner = counter.parts["step"], counter.parts["inner"]
    assert step.flops == {"float32": 2 * 8 * 16 * 4} and inner.flops == {"bfloat16": 2 * 8 * 16 * 4}
    assert step.syncs == 1 and inner.syncs == 1
    assert sorted(step.segments) == [0] and sorted(inner.segments) == [1]
    assert step.bytes > 0  # the sum reads the product
    assert inner.entry_live == (8 * 16 + 16 * 4) * 4 and inner.working >= 8 * 4 * 2  # its bf16 product was alive


def test_part_counter_bytes_moved_read_the_inputs_and_write_the_outputs():
    x, y, out = torch.zeros(1000), torch.ones(1000), torch.empty(1000)
    counter = cost_count.PartCounter()
    with counter:
        torch.div(x, y, out=out)  # reads x and y, writes out
        x.add_(y)  # reads x and y, writes x
        x.copy_(y)  # reads y, writes x
        x.sum()  # reads x, writes a scalar
        torch.linalg.eigh(torch.eye(3, dtype=torch.float64))  # a dense factorization: a sync too
    step = counter.parts["step"]
    assert step.name_bytes["aten.div.out"] == step.name_bytes["aten.add_.Tensor"] == 3 * 4000
    assert step.name_bytes["aten.copy_.default"] == 2 * 4000 and step.name_bytes["aten.sum.default"] == 4004
    assert step.factorizations == 1 and step.syncs == 1 and step.factorization_shapes == {"float64 (3, 3)": 1}


def test_counting_a_tiny_model():
    """One warm step of each tier of a tiny GPT under bf16-mixed: the parts where they belong, the training step's
    optimizer reads no device value (AdamW's step counters stay on the host on a GPU), and the package's classes come
    back unwrapped."""
    from curvwatch.engine import Engine
    from curvwatch.realloss import RealLoss

    before = (Engine.evaluate, RealLoss.sample)
    shape = {"n_layer": 1, "batch": 1, "seq": 16, "d_model": 32, "vocab": 64, "steps": (1,)}
    off = cost_count.count_config("gpt", "off", **shape)[0]
    full = cost_count.count_config("gpt", "full", **shape)[0]
    assert set(off["parts"]) == {"step"} and off["parts"]["step"]["syncs"] == 0
    parts = full["parts"]
    assert {"step", "engine", "sampling", "plugin"} <= set(parts)
    assert parts["engine"]["flops"].get("float32", 0) > 0  # the closed forms run in float32
    assert parts["sampling"]["flops"].get("bfloat16", 0) > 0  # the sampled passes run in the step's autocast
    assert parts["engine"]["ops"] > parts["sampling"]["ops"] > 0 and parts["engine"]["syncs"] >= 1
    assert full["peak_bytes"] > off["peak_bytes"] > 0
    # batch 2 without the engine (it evaluates the same tokens whatever the batch): its part empty, the sampling there
    skipped = cost_count.count_config("gpt", "full", **{**shape, "batch": 2}, engine=False)[0]["parts"]
    assert skipped["engine"]["ops"] == 0 and skipped["sampling"]["ops"] == parts["sampling"]["ops"]
    assert (Engine.evaluate, RealLoss.sample) == before


def test_sampled_passes_counted_as_batched_at_the_target_shape():
    """A small counted shape batches as many sampled passes as the target shape's memory budget would: one sample's
    bytes (its cotangent, its gradients at every block output, 12 x the largest output) grow with the layers and the
    batch."""
    from curvwatch.capture import LiveOutput
    from curvwatch.realloss import sampling

    own = sampling.passes_at_once
    live = [LiveOutput(None, torch.zeros(2, 4, 8), (2, 4))] * 2  # 1 layer's two block outputs at batch 2, 256 B each
    start = torch.zeros(2, 4, 8)
    # one sample: 256 + 2 x 256 + 12 x 256 = 3,840 B counted; at 4 layers x batch 8: 4 x (256 + 8 x 256 + 12 x 256)
    budget_mb = 16 * 3840 / 2**20  # 16 passes fit at the counted shape; 61,440 // 21,504 = 2 at the target
    chosen: list[int] = []
    with cost_count.passes_as_at(1, 2, (4, 8), chosen):
        assert sampling.passes_at_once(live, start, 16, batched=True, memory_mb=budget_mb) == 2
        assert sampling.passes_at_once(live, start, 16, batched=False) == 1
    with cost_count.passes_as_at(1, 2, (1, 2), chosen):
        assert sampling.passes_at_once(live, start, 16, batched=True, memory_mb=budget_mb) == 16
    assert chosen == [2, 1, 16] and sampling.passes_at_once is own


def test_gpu_scale_comparison_runs_on_cpu(tmp_path):
    """``gpu_scale.sh``'s two steps per model on CPU: ``bench_dispatch``'s timing path (``--time``, the tiers the GPU
    script times) and ``cost_model --compare`` of its JSON: a measured and an estimated figure per row, and the run's
    calibration points written."""
    import json


    measured = tmp_path / "dispatch.json"
    argv = ["--time", "--n-layer", "1", "--d-model", "64", "--seq", "16", "--batch", "1", "--vocab", "64", "--repeats",
            "1", "--full-repeats", "1", "--precision", "32-true", "--tiers", "full,full_nrl,terms",
            "--out", str(measured)]  # fmt: skip
    bench_dispatch.main(argv)
    counts = tmp_path / "cost_model.json"
    grid = _counts()
    grid["terms"] = grid["full_nrl"]
    counts.write_text(json.dumps({"counts": {"gpt": grid}}))
    out = tmp_path / "compare.json"
    result = cm.main(["--compare", str(measured), "--counts", str(counts), "--out", str(out)])
    rows = {r["row"] for r in result["rows"]}
    assert "plain training step, ms" in rows and "full, `sharpness=False`, training steps" in rows
    assert all(r["estimated"] > 0 for r in result["rows"])
    assert [p["use"] for p in result["points"]][:2] == ["fit", "check"]
    assert json.loads(out.read_text())["points"] == result["points"]


def test_parts_that_grow_with_the_batch_are_priced_at_the_models_shape():
    """The sampled passes: host-bound at batch 1 (1,000 operators, 5 ms; 1 TFLOP of bf16, 2 ms on an H200 at 50%), bound
    by the device at 12 layers and batch 8 (their FLOPs grow with n B: 96 TFLOP, 194 ms): priced once from the counts
    read there, not as a line through the small shapes' prices. The engine's part is priced stretch by stretch and read
    linearly in the layers: 1 TFLOP of float32 a layer, 12 TFLOP at 12 layers, on an H100 at 50% of 67 TFLOP/s (FP32)
    and of 494.7 TFLOP/s (TF32)."""
    counts = _counts()
    for key, cell in counts["full"].items():
        n, b = cm._layers_batch(key)
        parts = cell["steps"][0]["parts"]
        parts["sampling"] = _tally([[1000, {"bfloat16": 1e12 * n * b}, 0]], syncs=1)
        parts["engine"] = _tally([[10, {"float32": 1e12 * n}, 0]], syncs=0)
    est = cm.estimate(counts, 12, 8, CONSTANTS)["full"]
    sampling = est["real-loss sampling"]
    assert sampling["flops"] == {"bfloat16": 96e12} and sampling["ops"] == 1000
    assert sampling["ms"]["H200"]["fp32"] == pytest.approx(96e12 / (0.5 * 989.4e12) * 1e3 + 0.02)
    assert sampling["ms"]["H200"]["fp32"] == pytest.approx(194.08, abs=0.01)
    # the engine's part less the closed forms' (2,000 host-bound operators and a sync at every depth: 10.02 ms), plus
    # the plugin's (10 operators and a sync: 0.07 ms)
    solves = est["real-loss solves"]["ms"]["H100"]
    assert solves["fp32"] == pytest.approx(12e12 / (0.5 * 67e12) * 1e3 - 10.02 + 0.07)
    assert solves["tf32"] == pytest.approx(12e12 / (0.5 * 494.7e12) * 1e3 - 10.02 + 0.07)
    assert solves["fp32"] == pytest.approx(348.26, abs=0.01) and solves["tf32"] == pytest.approx(38.56, abs=0.01)


def test_memory_by_hand(monkeypatch):
    """A model of 1 M parameters a layer (16 MB a layer of weights, gradients and AdamW moments), whose plain step peaks
    at 100 MB n B, whose capture holds 10 MB a layer through the backward, whose engine works in 50 MB above that, and
    whose sampled passes peak 200 MB above the plain step: at 12 layers and batch 8 the sampled passes set the peak,
    9,800 MB, 200 MB (2.1%) over the plain step's 9,600 MB."""
    monkeypatch.setattr(cm, "param_count", lambda arch, n, *args: 1_000_000 * n)
    counts = _counts()
    for cells in counts.values():
        for key, cell in cells.items():
            n, b = cm._layers_batch(key)
            step = cell["steps"][0]
            step["peak_bytes"] = 100e6 * n * b
            if "engine" in step["parts"]:
                step["parts"]["engine"].update(entry_live=16e6 * n + 10e6 * n, working=50e6)
            if "sampling" in step["parts"]:
                step["parts"]["sampling"].update(entry_live=100e6 * n * b, working=200e6)
    mem = cm.memory(counts, "gpt", 12, 8)
    assert mem["plain_peak"] == pytest.approx(9600e6) and mem["static"] == 16 * 12_000_000
    full = mem["tiers"]["full"]
    assert full["held"] == pytest.approx(120e6) and full["working"] == 50e6
    assert full["candidates"] == pytest.approx({"backward": 9720e6, "evaluation": 192e6 + 120e6 + 50e6,
                                                "sampling": 9800e6})  # fmt: skip
    assert full["peak"] == pytest.approx(9800e6) and full["extra_fraction"] == pytest.approx(200 / 9600)
    # without the sampled passes the captured tensors held through the backward set it: 120 MB over
    assert mem["tiers"]["full_nrl"]["extra"] == pytest.approx(120e6)


def test_constants_are_stated_once_with_their_source():
    """Every rate of a card and every constant has a name and a source (:data:`SOURCES`), and the docs' table shows the
    values the pricing uses."""
    fields = {f.name for f in dataclasses.fields(cm.Machine)} - {"name"} | {
        f.name for f in dataclasses.fields(cm.Constants)
    }
    assert set(cm.SOURCES) == fields
    result = {"machines": {k: dataclasses.asdict(m) for k, m in cm.MACHINES.items()},
              "constants": dataclasses.asdict(cm.Constants()), "calibration": []}  # fmt: skip
    text = cm.constants_table(result)
    assert "| FP32 matmul peak (CUDA cores) | 67 TFLOP/s | 67 TFLOP/s | datasheet, dense |" in text
    assert "| memory bandwidth | 3.35 TB/s | 4.8 TB/s | datasheet |" in text
    assert "| host time per dispatched operator (views too) | 5 us | 5 us |" in text
    assert "| time per dense eigh/SVD, whatever its size | 3.5 ms | 3.5 ms |" in text
    assert "assumed: no calibration point to fit" in text  # no fit point: the tensor-core efficiency is assumed


def test_gpu_choices_are_made_while_counting():
    """The count runs the GPU's code paths (the solver's GPU choices, the sampled passes batched), and leaves the
    CPU's as they were."""
    from curvwatch.closed_form.solver.choices import CPU, GPU, for_device
    from curvwatch.realloss import sampling

    assert for_device("cpu") == CPU and not sampling.BATCH_ON_CPU
    with bench_dispatch.gpu_choices():
        assert for_device("cpu") == GPU and sampling.BATCH_ON_CPU
    assert for_device("cpu") == CPU and not sampling.BATCH_ON_CPU


def test_a_stopped_count_goes_on_from_the_same_commit_only(monkeypatch):
    counted = []
    monkeypatch.setattr(cost_count, "source_commit", lambda: "abc")
    monkeypatch.setattr(
        cost_count, "count_config", lambda arch, tier, n, b, *a, **k: counted.append((tier, n, b)) or []
    )
    kept = {"steps": [], "engine": True, "commit": "abc"}
    old = {"steps": [], "engine": True, "commit": "old"}
    counts = {"gpt": {"off": {"n1_b1": kept, "n2_b1": old}}}
    cost_count.count_all(["gpt"], grid=((1, 1), (2, 1)), tiers=("off",), counts=counts)
    assert counted == [("off", 2, 1)] and counts["gpt"]["off"]["n1_b1"] is kept
    assert counts["gpt"]["off"]["n2_b1"]["commit"] == "abc"


def test_the_quick_count_writes_the_tables(tmp_path):
    """``make cost-model ARGS=--quick``'s pipeline on a tiny shape: count every tier, price, and write the tables into a
    page between its markers, with the commit counted and the constants' table."""
    doc = tmp_path / "page.md"
    doc.write_text(f"# Page\n\n{cm.DOCS_BEGIN}\nold\n{cm.DOCS_END}\n\nafter\n")
    result = cm.main(["--quick", "--arch", "gpt", "--out", str(tmp_path / "q.json"), "--docs", str(doc)])
    est = result["estimates"]["gpt"]
    assert set(est) == {"full", "full_nrl", "terms", "step"}
    assert est["full"]["total"]["ops"] > est["full_nrl"]["total"]["ops"] > est["terms"]["total"]["ops"] > 0
    assert all(v > 0 for modes in est["full"]["total"]["ms"].values() for v in modes.values())
    text = doc.read_text()
    assert "old" not in text and text.endswith("after\n") and "| FP32 matmul peak (CUDA cores) |" in text
    assert result["commit"] == cost_count.source_commit() and "### GPT-2-small" in text
