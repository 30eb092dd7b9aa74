"""What the edge-of-stability ratio does on the instability suite's runs (seed 0, unstable run and its control).

Each run is the suite's (:func:`benchmarks.instability.train.run`: AdamW, full evaluations every 10 steps, which
now include the real-loss keys); this script reads ``summary/stability/max`` (the largest block ratio
``lambda_max(P^-1 H) / (38 / lr)``) from the traces and reports, per run: the loss onset of the divergence
(the suite's :func:`~benchmarks.instability.analysis.onset_step`), the first evaluation with a ratio >= 1 and its
lead over the onset, the median ratio over the first half of the run and the largest one before the onset; plus
a plot per mechanism (ratio and loss against the step) into ``docs/sharpness/``.

Run: ``python -m benchmarks.bench_stability [--only NAME ...] [--reuse]`` (about 15-25 minutes on one core).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from benchmarks.common import RESULTS_DIR
from benchmarks.instability.analysis import onset_step
from benchmarks.instability.cases import mechanisms
from benchmarks.instability.train import run

OUT = RESULTS_DIR / "stability"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "sharpness"
KEY = "summary/stability/max"


def _series(trace: dict) -> tuple[list[int], list[float]]:
    rows = [(r["step"], r["metrics"].get(KEY)) for r in trace["monitor"] if r["full"]]
    return [s for s, v in rows if v is not None], [v for s, v in rows if v is not None]


def summarize(trace: dict) -> dict:
    losses = trace["series"]["loss"]
    onset = onset_step(losses)
    first_bad = next((i for i, v in enumerate(losses) if v is None or not math.isfinite(v)), None)
    end = min(x for x in (onset, first_bad, math.inf) if x is not None)
    steps, ratios = _series(trace)
    before = [v for s, v in zip(steps, ratios, strict=True) if s < end]
    cross = next((s for s, v in zip(steps, ratios, strict=True) if v >= 1.0), None)
    half = [v for s, v in zip(steps, ratios, strict=True) if s < len(losses) / 2]
    return {
        "onset": None if end == math.inf else int(end),
        "first_ratio_ge_1": cross,
        "lead": None if cross is None or end == math.inf else int(end - cross),
        "median_first_half": statistics.median(half) if half else None,
        "max_before_onset": max(before) if before else None,
        "evaluations": len(steps),
    }


def plot(name: str, traces: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    loss_ax = ax.twinx()
    for (variant, trace), color in zip(traces.items(), ("C3", "C0", "C2"), strict=False):
        steps, ratios = _series(trace)
        ax.semilogy(steps, ratios, color=color, label=f"{variant}: stability/max")
        losses = trace["series"]["loss"]
        loss_ax.plot(range(len(losses)), [v if v is not None else math.nan for v in losses], color=color, alpha=0.3,
                     lw=0.8)  # fmt: skip
        onset = summarize(trace)["onset"]
        if onset is not None:
            ax.axvline(onset, color=color, ls=":", lw=1)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("max block λ(P⁻¹H) / (38/lr)")
    loss_ax.set_ylabel("loss (faint)")
    ax.set_title(f"{name}: edge-of-stability ratio (dotted: loss onset)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    DOCS.mkdir(parents=True, exist_ok=True)
    fig.savefig(DOCS / f"{name}.png", dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--reuse", action="store_true", help="reuse traces already in benchmarks/results/stability")
    args = parser.parse_args(argv)
    lines = ["| mechanism | run | loss onset | first ratio ≥ 1 | lead (steps) | median ratio, 1st half "
             "| max before onset |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for mech in mechanisms(False):
        if args.only and mech.name not in args.only:
            continue
        traces = {}
        for variant in mech.variants:
            path = OUT / f"{mech.name}__{variant.name}__s0.json"
            if args.reuse and path.exists():
                trace = json.loads(path.read_text())
            else:
                trace = run(replace(variant.config, seed=0))
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(trace, default=lambda o: None))
            traces[variant.name] = trace
            s = summarize(trace)

            def fmt(v, spec=".3g"):
                return "-" if v is None else format(v, spec)

            lines.append(
                f"| {mech.name} | {variant.name} | {fmt(s['onset'], 'd')} | {fmt(s['first_ratio_ge_1'], 'd')} | "
                f"{fmt(s['lead'], 'd')} | {fmt(s['median_first_half'])} | {fmt(s['max_before_onset'])} |"
            )
            print(lines[-1], flush=True)
        plot(mech.name, traces)
    text = "\n".join(lines)
    print(text)
    (OUT / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
