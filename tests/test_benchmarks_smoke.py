"""Smoke tests of the HVP, scaling, accuracy and kernel benchmarks: their mains run, write JSON, and agree."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench_accuracy, bench_hvp, bench_kernels, bench_scaling

AGREE = 1e-2  # the benchmark's own agreement threshold


@pytest.fixture(scope="module")
def hvp_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "hvp.json"
    data = bench_hvp.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    return data


def test_hvp_json_fields(hvp_data):
    assert hvp_data["name"] == "bench_hvp"
    assert {"config", "environment", "methods", "published", "results", "sdpa"} <= set(hvp_data)
    assert len(hvp_data["results"]) == len(bench_hvp.QUICK)
    for row in hvp_data["results"]:
        assert row["status"] == "measured", row["status"]
        methods = row["methods"]
        assert {"curvwatch", "hvp_power", "hvp_lanczos"} <= set(methods)
        assert methods["curvwatch"]["ratio"] == pytest.approx(1.0)
        for k, m in methods.items():
            assert m["median_s"] > 0 and math.isfinite(m["ratio"]), k
        keys = {f"hessian/{b}/h{h}" for b in bench_hvp.BLOCKS for h in range(row["H"])}
        assert set(row["norms"]["curvwatch"]) == keys


def test_hvp_norms_agree(hvp_data):
    for row in hvp_data["results"]:
        ref = row["norms"]["curvwatch"]
        assert all(v > 0 for v in ref.values())
        # every method within the benchmark's threshold (seeded, so deterministic)
        for k in ("hvp_lanczos", "curvlinops", "hvp_power"):
            if k not in row["norms"]:
                continue
            worst = max(abs(row["norms"][k][key] - ref[key]) / ref[key] for key in ref)
            assert worst <= AGREE, f"{row['size']}: {k} differs from curvwatch by {worst:.2e} (relative)"


def test_hvp_sdpa_section(hvp_data):
    sdpa = hvp_data["sdpa"]
    assert sdpa["curvwatch"]["ok"] is True
    assert sdpa["curvwatch"]["rel_diff_vs_softmax_hvp"] <= AGREE
    for k in ("forward_over_reverse", "double_backward"):
        # whether the fused kernel supports higher derivatives depends on the backend; record it either way
        assert isinstance(sdpa[k]["ok"], bool)
        if not sdpa[k]["ok"]:
            assert sdpa[k]["exception"]


def test_scaling_quick(tmp_path):
    out = tmp_path / "scaling.json"
    data = bench_scaling.main(["--quick", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["name"] == "bench_scaling"
    measured = [r for r in data["results"] if r["status"] == "measured"]
    assert {r["kind"] for r in measured} == {"attention", "layernorm", "ffn", "layers"}
    for r in measured:
        assert r["eval_s"] > 0 and r["forward_s"] > 0
        assert r["ratio"] == pytest.approx(r["eval_s"] / r["forward_s"])
    for f in data["fits"]:
        if f["points"] >= 2:
            assert math.isfinite(f["eval_exponent"]) and math.isfinite(f["ratio_exponent"])


def test_accuracy_quick(tmp_path):
    out = tmp_path / "accuracy.json"
    data = bench_accuracy.main(["--quick", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    assert [r["model"] for r in data["results"]] == ["demo", "mid"]
    for r in data["results"]:
        assert [(s["tol"], s["max_iter"], s["max_basis"]) for s in r["settings"]] == list(bench_accuracy.SETTINGS)
        peaks = {s["max_basis"]: s["peak_allocated_bytes"] for s in r["settings"] if s["max_iter"] == 40}
        assert peaks[4] < peaks[None]  # fewer vectors held, less memory
        for s in r["settings"]:
            assert s["lanczos_norms"] > 0 and 0 <= s["unconverged"] <= s["lanczos_norms"]
            assert s["median_s"] > 0 and s["reads_high"] == 0  # a Ritz value never exceeds the norm
            # converged norms are within their residual of the float64 reference (up to float32 round-off)
            if s["unconverged"] == 0:
                assert s["true_rel_error_max"] <= max(s["rel_residual_max"], 1e-4)


def test_sampled_setting_table_times_each_setting_and_restores_it():
    """``bench_sharpness --sampled NAME=a,b``: one row per value, with operators and the sampled runs' steps, and the
    module's setting restored afterwards; an unknown setting is refused."""
    from benchmarks import bench_sharpness
    from curvwatch.closed_form.solver import sampled_keys

    before = sampled_keys.GRAM_STEPS
    lines = bench_sharpness.sampled_setting_table("GRAM_STEPS", [0, 12], width=32, B=2, L=16, vocab=64, repeats=1)
    assert sampled_keys.GRAM_STEPS == before
    rows = [line.split(" | ") for line in lines[3:]]
    assert [r[0] for r in rows] == ["| 0", "| 12"]
    ops = [int(r[2]) for r in rows]
    assert all(n > 0 for n in ops) and ops[1] < ops[0]  # the Gram path: fewer operators than every key by Lanczos
    # GRAM_STEPS 0: ggn and sharpness members, 12 rows per pair; the FFN's W1W1 and W2W2 (vectors of one size) in one
    # run merged with its own rows: 24 sampled rows
    assert "(24, " in rows[0][3]
    with pytest.raises(ValueError, match="Unknown sampled setting"):
        bench_sharpness.sampled_setting_table("NOT_A_SETTING", [0, 1], width=32, B=2, L=16, vocab=64)


def test_cost_share_table_counts_the_real_loss_part_at_a_given_sample_count():
    """``bench_sharpness --cost [--samples K ...] [--device D]`` (its GPU run is a step of ``gpu_scale.sh``): the
    table names its sample count, and the real-loss part costs operators, more with more samples (on CPU here)."""
    from benchmarks import bench_sharpness

    parts = []
    for k in (4, 8):
        lines = bench_sharpness.cost_share(width=32, B=2, L=16, vocab=64, repeats=1, samples=k)
        assert f"{k} samples" in lines[0] and "CPU time of one thread" in lines[0]
        row = next(line for line in lines if line.startswith("| real-loss part"))
        parts.append(int(row.split("**")[3].split(" ")[0]))
        sampling = next(line for line in lines if line.startswith("| of which the sampling"))
        assert int(sampling.rsplit("|", 2)[1]) > 0
    assert 0 < parts[0] < parts[1], parts


def test_warm_store_table_measures_the_store():
    """``bench_sharpness --warm-store``: the store's MiB (the sampled keys start at their top Gauss-Newton direction
    and keep nothing, the engine's keys do); ``--train`` takes AdamW steps between captures."""
    from benchmarks import bench_sharpness

    lines = bench_sharpness.warm_store(width=32, B=2, L=16, vocab=64)
    ((engine, sampled),) = [map(float, line.strip("| ").split(" | ")[:2]) for line in lines[3:]]
    assert engine > 0 and sampled == 0
    lines = bench_sharpness.sampled_setting_table("MEMBER_TOL", [1.0, 0.2], width=32, B=2, L=16, vocab=64,
                                                  repeats=1, train=2)  # fmt: skip
    assert "2 AdamW steps before each capture" in lines[0] and len(lines) == 5


def test_bench_cadence_table(tmp_path):
    """The cadence table: the monitor's schedule on a clock of given costs, with and without the floor."""
    from benchmarks import bench_cadence

    out = tmp_path / "cadence.json"
    rows = bench_cadence.main(["--costs", "10/0.25", "600/18", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["rows"] == rows and written["environment"]["command"].startswith("python")
    by = {(r["costs"], r["schedule"]): r for r in rows}
    assert by[("10/0.25", "floor")]["full_steps"] == [0, 500, 1000, 1500]
    assert by[("10/0.25", "1% only")]["full_steps"] == [0]
    assert by[("600/18", "floor")]["full_steps"] == [0] and by[("600/18", "floor")]["max_gap"] > 10


def test_bench_kernels_times_two_trees_side_by_side(tmp_path):
    """``bench_kernels --old PATH``: each tree's call timed in its own worker (here the old tree is this one), best of
    the repeats, and both trees' values within the call's tolerance of the tight solve."""
    out = tmp_path / "k.json"
    res = bench_kernels.main(["--old", str(bench_kernels.ROOT), "--cases", "tiny", "--repeats", "2", "--out", str(out)])
    row = res["cases"]["tiny"]
    for tree in ("old", "this"):
        assert len(row[tree]["ms"]) == 2 and row[tree]["best_ms"] == min(row[tree]["ms"]) > 0, row
        assert row[tree]["max_rel_diff"] <= 1e-3, row
    assert json.loads(out.read_text())["cases"]["tiny"]["this"]["best_ms"] == row["this"]["best_ms"]
