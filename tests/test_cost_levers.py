"""benchmarks/cost_levers.py: the what-ifs change the counts as they say, and are priced by the cost model's arithmetic
(host-bound synthetic counts, so that every millisecond below is computed by hand)."""

from __future__ import annotations

import pytest

from benchmarks import cost_levers as cl
from benchmarks import cost_model as cm

# 5 us of host time per operator, 20 us per sync: host-bound counts price to operators x 5 us + syncs x 20 us
CONSTANTS = cm.Constants(host_op_s=5e-6, sync_s=20e-6)


def _tally(ops: int, syncs: int = 1, **extra):
    return {"segments": [[ops, {}, 0]], "ops": ops, "views": 0, "syncs": syncs, "flops": {}, "bytes": 0,
            "entry_live": 0, "working": 0, **extra}  # fmt: skip


def _counts():
    """One model: the closed forms 2,000 operators, the full engine 3,000, the plugin 10, the sampled passes 500, the
    capture 20 operators over the plain step's 400; a sync in each; the same in every counted shape."""

    def cell(**parts):
        return {"steps": [{"parts": {name: _tally(ops) for name, ops in parts.items()}, "peak_bytes": 0}]}

    grid = lambda **parts: {k: cell(**parts) for k in ("n1_b1", "n2_b1", "n1_b2", "n2_b2")}  # noqa: E731
    return {
        "off": grid(step=400),
        "full": grid(step=420, engine=3000, sampling=500, plugin=10),
        "full_nrl": grid(step=420, engine=2000, plugin=0),
        "terms": {k: cell(step=420, engine=100, plugin=0) for k in ("n12_b1", "n12_b2")},
    }


def test_eigh_levers_change_the_calls_and_their_syncs():
    shapes = {"float32 (3, 512, 512)": 2, "float32 (84, 64, 64)": 2, "float64 (8, 8, 8)": 2}
    counts = {t: {"n1_b1": {"steps": [{"parts": {"engine": _tally(10, syncs=9, factorizations=6,
                                                                 factorization_shapes=shapes)}}]}}
              for t in cl.ENGINE_TIERS}  # fmt: skip
    cl.eigh_on_host(16)(counts)  # the two (8, 8) calls: no device eigh, still a sync each
    tally = counts["full"]["n1_b1"]["steps"][0]["parts"]["engine"]
    assert tally["factorizations"] == 4 and tally["syncs"] == 9
    for t in cl.ENGINE_TIERS:
        counts[t]["n1_b1"]["steps"][0]["parts"]["engine"].update(factorizations=6, syncs=9)
    cl.eigh_gathered()(counts)  # one call per size: 3 calls, 3 syncs fewer
    assert tally["factorizations"] == 3 and tally["syncs"] == 6


def test_a_part_scaled_and_the_work_left_for_a_goal():
    """As counted: closed forms 10.02 ms, real-loss solves 15.02 - 10.02 + 0.07 = 5.07 ms, sampled passes 2.52 ms,
    capture 0.1 ms: 17.71 ms, over a 2.02 ms step. The solves at a tenth: 13.147 ms. With the engine's work times f
    the full evaluation is 15 f + 2.71 ms, so 4 steps (8.08 ms) leave f = 5.37 / 15."""
    counts = {"gpt": _counts()}
    as_counted = cl.price(counts, cl.LEVERS[0], CONSTANTS)["gpt"]["full"]["total"]
    assert as_counted["ms"]["H200"]["fp32"] == pytest.approx(17.71)
    lever = cl.Lever("solves at a tenth", parts={"real-loss solves": 0.1})
    full = cl.price(counts, lever, CONSTANTS)["gpt"]["full"]["total"]
    assert full["ms"]["H100"]["tf32"] == pytest.approx(13.147)
    assert full["steps"]["H100"]["tf32"] == pytest.approx(13.147 / 2.02)
    assert cl.needed(counts, CONSTANTS, cl.LEVERS[0], "full", 4.0)["gpt"] == pytest.approx(5.37 / 15, abs=1e-5)
    assert cl.needed(counts, CONSTANTS, cl.LEVERS[0], "full", 1.0)["gpt"] is None  # 2.71 ms do not scale
    assert cl.needed(counts, CONSTANTS, cl.LEVERS[0], "full", 20.0)["gpt"] == 1.0
    # the engine's work halved: 7.5 + 2.71 ms
    halved = cl.price(counts, cl.Lever("half", cl.engine(0.5, 0.5, 0.5)), CONSTANTS)["gpt"]["full"]["total"]
    assert halved["ms"]["H200"]["fp32"] == pytest.approx(10.21)
