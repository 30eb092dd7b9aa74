"""What the edge-of-stability ratio does on the instability suite's runs (seed 0, unstable run and its control).

Each run is the suite's (:func:`benchmarks.instability.train.run`: AdamW, full evaluations every 10 steps, which
now include the real-loss keys); this script reads ``summary/stability/max`` (the largest block ratio
``lambda_max(P^-1 H) / (38 / lr)``) from the traces and reports, per run: the loss onset of the divergence
(the suite's :func:`~benchmarks.instability.analysis.onset_step`), the first evaluation with a ratio >= 1 and its
lead over the onset, the median ratio over the first half of the run and the largest one before the onset; plus
a plot per mechanism (ratio and loss against the step) into ``docs/sharpness/``.

``--readings`` (with ``--reuse``: no training) reads the same logged keys differently, per run: the share of
evaluations before the onset with a ratio >= 1 and the longest run of them, the lower edge of the ratio (per key
``stability/XX * (1 - sharpness_spread/XX)``, the largest over the keys; the spread is that of the unpreconditioned
``sharpness/XX``, the only one logged) and its first crossing, and the largest ratio over the ``WINDOW`` steps
before the onset against the control's over the same steps.

Run: ``python -m benchmarks.bench_stability [--only NAME ...] [--reuse] [--readings]`` (about 15-25 minutes on one
core; seconds with ``--reuse``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path

from benchmarks.common import RESULTS_DIR
from benchmarks.instability.analysis import onset_step
from benchmarks.instability.cases import mechanisms
from benchmarks.instability.train import run

OUT = RESULTS_DIR / "stability"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "sharpness"
KEY = "summary/stability/max"
WINDOW = 50  # steps before the onset for ``--readings``


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


def fmt(v, spec=".3g"):
    return "-" if v is None else format(v, spec)


def _end(trace: dict) -> float:
    onset = summarize(trace)["onset"]
    return math.inf if onset is None else onset


def _lower_edge(metrics: dict) -> float | None:
    """The largest ``stability/XX * (1 - sharpness_spread/XX)`` over the block keys (``None``: no key)."""
    edges = [
        v * max(0.0, 1.0 - spread)
        for k, v in metrics.items()
        if "/stability/" in k and not k.startswith("summary/") and not k.endswith("/max") and v is not None
        and (spread := metrics.get(k.replace("/stability/", "/sharpness_spread/"))) is not None
    ]  # fmt: skip
    return max(edges) if edges else None


def _top_key(metrics: dict) -> str | None:
    """The block key of the largest ratio (``None``: no key)."""
    keys = [k for k, v in metrics.items() if "/stability/" in k and not k.startswith("summary/")
            and not k.endswith("/max") and v is not None]  # fmt: skip
    return max(keys, key=metrics.__getitem__) if keys else None


def _block_key(key: str) -> str:
    """``layer0/attn/stability/QQ/h1`` -> ``attn QQ``."""
    parts = key.split("/")
    return f"{parts[1]} {parts[3]}"


def readings(trace: dict, window: tuple[float, float] | None) -> dict:
    """Other readings of the logged keys before the onset (the whole run without one); ``window``: the steps of
    the largest ratio in ``window_max`` (default: the ``WINDOW`` steps before this run's onset)."""
    end = _end(trace)
    steps, ratios = _series(trace)
    kept = [(s, v) for s, v in zip(steps, ratios, strict=True) if s < end]
    streak = longest = 0
    for _, v in kept:
        streak = streak + 1 if v >= 1.0 else 0
        longest = max(longest, streak)
    edges = [(r["step"], e) for r in trace["monitor"] if r["full"] and r["step"] < end
             and (e := _lower_edge(r["metrics"])) is not None]  # fmt: skip
    cross = next((s for s, e in edges if e >= 1.0), None)
    tops = [(_block_key(k), r["metrics"].get(k.replace("/stability/", "/sharpness_spread/")))
            for r in trace["monitor"] if r["full"] and r["step"] < end
            and (k := _top_key(r["metrics"])) is not None]  # fmt: skip
    pairs = Counter(k for k, _ in tops)
    spreads = [v for _, v in tops if v is not None]
    if window is None and end != math.inf:
        window = (end - WINDOW, end)
    in_window = [v for s, v in kept if window is not None and window[0] <= s < window[1]]
    return {
        "share_ge_1": sum(v >= 1.0 for _, v in kept) / len(kept) if kept else None,
        "evaluations": len(kept),
        "longest_ge_1": longest * trace["config"]["full_every"] if kept else None,  # in steps
        "edge_max": max((e for _, e in edges), default=None),
        "edge_first_ge_1": cross,
        "edge_lead": None if cross is None or end == math.inf else int(end - cross),
        "window_max": max(in_window) if in_window else None,
        "top_pairs": ", ".join(f"{k} {n}" for k, n in pairs.most_common(2)),
        "top_spread": statistics.median(spreads) if spreads else None,
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
    parser.add_argument("--readings", action="store_true", help="also the other readings (see the docstring)")
    args = parser.parse_args(argv)
    other = ["| mechanism | run | evaluations before onset | share with ratio ≥ 1 | longest run ≥ 1 (steps) "
             "| lower edge: max | lower edge: first ≥ 1 (lead) | max ratio, the unstable run's last "
             f"{WINDOW} steps before onset | pair of the largest ratio (evaluations) | its median spread |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
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
            lines.append(
                f"| {mech.name} | {variant.name} | {fmt(s['onset'], 'd')} | {fmt(s['first_ratio_ge_1'], 'd')} | "
                f"{fmt(s['lead'], 'd')} | {fmt(s['median_first_half'])} | {fmt(s['max_before_onset'])} |"
            )
            print(lines[-1], flush=True)
        plot(mech.name, traces)
        unstable = next((t for v, t in traces.items() if v == "unstable"), None)
        end = _end(unstable) if unstable is not None else math.inf
        for variant, trace in traces.items():
            r = readings(trace, None if end == math.inf else (end - WINDOW, end))
            lead = "" if r["edge_lead"] is None else f" ({r['edge_lead']})"
            other.append(
                f"| {mech.name} | {variant} | {r['evaluations']} | {fmt(r['share_ge_1'], '.0%')} | "
                f"{fmt(r['longest_ge_1'], 'd')} | {fmt(r['edge_max'])} | {fmt(r['edge_first_ge_1'], 'd')}{lead} | "
                f"{fmt(r['window_max'])} | {r['top_pairs'] or '-'} | {fmt(r['top_spread'], '.2f')} |"
            )
    text = "\n".join(lines + (["", *other] if args.readings else []))
    print(text)
    (OUT / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
