"""``bench_convergence --quick``: a short recorded training run (the demo's GPT on 3-digit addition, 7 evaluations),
replayed through the monitor's default engine warm, resumed and cold: every norm reported converged is within 1% of
a tight solve of the same captured blocks. With the residual test alone, this run has a norm 33% low at step 40
(``layer1/attn/functional/KK/h0``, cold) and one 4.7% low after a resume (``layer0/attn/outer/QQ/h3``, step 20)."""

from __future__ import annotations

import json

from benchmarks import bench_convergence


def test_quick_recorded_run_reports_no_converged_norm_more_than_1_percent_off(tmp_path):
    out = tmp_path / "convergence.json"
    result = bench_convergence.main(["--quick", "--states-dir", str(tmp_path), "--out", str(out)])
    summary = result["codes"]["this tree"]["summary"]
    assert json.loads(out.read_text())["codes"]["this tree"]["summary"] == json.loads(json.dumps(summary))
    assert set(summary) == {"run", "resumed", "cold"}
    for setup, s in summary.items():
        assert s["norms"] >= 300, (setup, s["norms"])  # 7 evaluations x 54 Lanczos norms
        assert s["max_reference_spread"] < 1e-3, setup  # the two tight solves agree: the reference is sound
        assert s["wrong"] == 0, (setup, s["wrong_norms"])
