"""Writes ``tests/data/rules_traces.json``: small excerpts of suite runs that ``tests/test_rules.py`` replays.

``python -m benchmarks.instability.fixtures [--out DIR]`` reads the suite's traces (default
``benchmarks/results/instability/runs``) and keeps, for a few held-out runs, only what :class:`curvwatch.rules.RuleSet`
reads (the attention terms and exact norms, the FFN's ``W2W2``, the LayerNorm ratios), at a terms-only cadence
of 5 steps and 4 significant digits. Each excerpt records its onset and the kind of the first alarm the rules
raised when it was written (``None`` for a control), which the test then requires.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.instability.analysis import onset_step, thinned

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests" / "data" / "rules_traces.json"
RUNS = (
    "attn_logit__unstable__s2",
    "attn_logit__control__s2",
    "rewarm__unstable__s2",
    "rewarm__control__s2",
    "ln_collapse__unstable__s2",
    "ln_collapse__control__s2",
)
CADENCE = 5
_READ = re.compile(
    r"/term/x_norm$|/term/w[qk]_norm/h\d+$|/outer/VV/h\d+$|/term/softmax_jac_norm/h\d+$|/hessian/W2W2$"
    r"|/ln/var_min_over_eps$"
)


def excerpt(trace: dict, name: str) -> dict:
    """One run's rows at the fixture cadence, columns restricted to what the rules read."""
    from curvwatch.rules import RuleSet

    rows = thinned(trace, CADENCE, full_every=10**9)
    keys = sorted({k for row in rows for k in row["metrics"] if _READ.search(k) and not k.startswith("summary/")})
    values = [[_sig(row["metrics"].get(k)) for k in keys] for row in rows]
    rules = RuleSet()
    first = None
    for row, vals in zip(rows, values, strict=True):
        fired = rules.update(row["step"], {k: v for k, v in zip(keys, vals, strict=True) if v is not None}, False)
        if fired and first is None:
            first = fired[0].kind
    return {
        "name": name,
        "onset": onset_step(trace["series"]["loss"]),
        "expect": first,
        "steps": [row["step"] for row in rows],
        "keys": keys,
        "values": values,
    }


def _sig(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")


def main(argv: list[str] | None = None) -> Path:
    from benchmarks.instability.suite import DEFAULT_OUT

    p = argparse.ArgumentParser(prog="python -m benchmarks.instability.fixtures", description=__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder of the suite")
    args = p.parse_args(argv)
    runs = [excerpt(json.loads((args.out / "runs" / f"{n}.json").read_text()), n) for n in RUNS]
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    TARGET.write_text(
        json.dumps({"source": "python -m benchmarks.instability.fixtures", "cadence": CADENCE, "runs": runs},
                   separators=(",", ":")) + "\n"
    )  # fmt: skip
    print(f"wrote {TARGET} ({TARGET.stat().st_size / 1024:.0f} KiB)")
    return TARGET


if __name__ == "__main__":
    main()
