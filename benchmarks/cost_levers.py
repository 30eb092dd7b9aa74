"""Levers on the cost model: what a change to the monitor would save, priced by the cost model's own arithmetic.

Each lever transforms the counts of ``benchmarks/results/cost_model.json`` as the change would (fewer FLOPs, operators,
bytes or ``eigh`` calls in a part), and :func:`benchmarks.cost_model.estimate` prices the result with the same fitted
constants; nothing is measured. A lever is a what-if on the counts, not a change made: its figure says what the model
reads if the monitor did that, everything else equal.

Run ``python -m benchmarks.cost_levers`` (the committed counts; ``--counts PATH`` another ``cost_model.json``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks import cost_model as cm

#: The counter's parts that run the evaluation's Lanczos solves and closed forms, and the tiers that hold them.
ENGINE_TIERS = ("full", "full_nrl", "terms")


def tallies(counts: dict[str, Any], tiers, part: str) -> Iterator[dict[str, Any]]:
    """Every counted step's tally of ``part`` in ``tiers`` of one model's counts (``{tier: {key: cell}}``)."""
    for tier in tiers:
        for cell in counts[tier].values():
            for step in cell["steps"]:
                if part in step["parts"]:
                    yield step["parts"][part]


def scale(tally: dict[str, Any], flops: float = 1.0, ops: float = 1.0, moved: float = 1.0) -> None:
    """Scale a tally's matmul FLOPs (every dtype), operators and bytes moved, stretch by stretch and in its totals."""
    for seg in tally["segments"]:
        seg[0], seg[1], seg[2] = seg[0] * ops, {d: f * flops for d, f in seg[1].items()}, seg[2] * moved
    tally["ops"] *= ops
    tally["flops"] = {d: f * flops for d, f in tally["flops"].items()}
    tally["bytes"] *= moved


def _rows(shape: str) -> int:
    """Rows of the matrices of a ``factorization_shapes`` key, ``"float32 (84, 64, 64)"`` -> 64."""
    return int(re.findall(r"\d+", shape)[-1])


Transform = Callable[[dict[str, Any]], None]


def engine(flops: float = 1.0, ops: float = 1.0, moved: float = 1.0) -> Transform:
    """The evaluation's solves and closed forms (every tier's engine part) scaled."""

    def apply(counts: dict[str, Any]) -> None:
        for tally in tallies(counts, ENGINE_TIERS, "engine"):
            scale(tally, flops, ops, moved)

    return apply


def sampling(factor: float) -> Transform:
    """The sampled backward passes scaled: FLOPs, operators and bytes (``samples`` passes, each a backward)."""

    def apply(counts: dict[str, Any]) -> None:
        for tally in tallies(counts, ("full",), "sampling"):
            scale(tally, factor, factor, factor)

    return apply


def eigh_on_host(max_rows: int) -> Transform:
    """The dense ``eigh`` calls of matrices of at most ``max_rows`` rows made on the host: no device factorization,
    each still a sync (its copy to the host)."""

    def apply(counts: dict[str, Any]) -> None:
        for tally in tallies(counts, ENGINE_TIERS, "engine"):
            shapes = tally.get("factorization_shapes", {})
            tally["factorizations"] -= sum(n for s, n in shapes.items() if _rows(s) <= max_rows)

    return apply


def eigh_gathered() -> Transform:
    """One ``eigh`` call per matrix size and dtype per evaluation (the layers' calls gathered into one, as the
    terms-only tier gathers its blocks'): a counted step's calls become one per shape, their syncs with them."""

    def apply(counts: dict[str, Any]) -> None:
        for tally in tallies(counts, ENGINE_TIERS, "engine"):
            shapes = tally.get("factorization_shapes", {})
            sizes = {re.sub(r"\(\d+, ", "(", s) for s in shapes}  # the batch dimension dropped
            fewer = tally["factorizations"] - len(sizes)
            tally["factorizations"] -= fewer
            tally["syncs"] -= fewer

    return apply


def both(*transforms: Transform) -> Transform:
    def apply(counts: dict[str, Any]) -> None:
        for t in transforms:
            t(counts)

    return apply


@dataclasses.dataclass(frozen=True)
class Lever:
    """A what-if: ``transform`` applied to the counts, priced with ``constants`` (changes to the fitted ones), the
    sampled passes read at batch ``sampling_batch`` (``None``: the model's), and the priced milliseconds of the full
    evaluation's ``parts`` scaled (``{"real-loss solves": 0.5}``: a part the counts do not hold apart)."""

    name: str
    transform: Transform | None = None
    constants: dict[str, float] = dataclasses.field(default_factory=dict)
    sampling_batch: int | None = None
    parts: dict[str, float] = dataclasses.field(default_factory=dict)


LEVERS = (
    Lever("as counted"),
    Lever("every eigh free (their whole share)", constants={"factorization_s": 0.0}),
    Lever("eigh gathered: one call per size per evaluation", eigh_gathered()),
    Lever("eigh of matrices <= 16 rows on the host", eigh_on_host(16)),
    Lever("eigh of matrices <= 64 rows on the host", eigh_on_host(64)),
    Lever("evaluation's matmul FLOPs halved", engine(flops=0.5)),
    Lever("evaluation's bytes moved halved (fused elementwise kernels)", engine(moved=0.5)),
    Lever("evaluation's operators halved", engine(ops=0.5)),
    Lever("evaluation's FLOPs, bytes and operators halved (half the Lanczos steps)", engine(0.5, 0.5, 0.5)),
    Lever("samples 16 -> 8 (sampled passes halved)", sampling(0.5)),
    # the sampled operators' products are sums over their sampled columns: their solves priced in proportion (an upper
    # bound on the operators, which partly serve all columns at once)
    Lever("samples 16 -> 64 (sampled passes and real-loss solves x4)", sampling(4.0), parts={"real-loss solves": 4.0}),
    Lever("sampled passes through the evaluated sequence only (batch 1)", sampling_batch=1),
    Lever("real-loss solves at a tenth", parts={"real-loss solves": 0.1}),
)
#: What the levers above that the monitor can take without losing a key leave to cut from the evaluation's own work
#: (:func:`needed`): the ``eigh`` calls gathered per size, the sampled passes through the evaluated sequence only.
STRUCTURAL = Lever("eigh gathered, sampled passes at batch 1", eigh_gathered(), sampling_batch=1)


def price(counts_by_arch: dict[str, Any], lever: Lever, c: cm.Constants, n: int = 12, batch: int = 8):
    """``{arch: estimate}`` of the counts under ``lever``."""
    counts_by_arch = copy.deepcopy(counts_by_arch)
    c = dataclasses.replace(c, **lever.constants)
    out = {}
    for arch, counts in counts_by_arch.items():
        if lever.transform is not None:
            lever.transform(counts)
        est = cm.estimate(counts, n, batch, c)
        ms = {part: row["ms"] for part, row in est["full"].items() if part != "total"}
        if lever.sampling_batch is not None:
            ms["real-loss sampling"] = cm.estimate(counts, n, lever.sampling_batch, c)["full"]["real-loss sampling"][
                "ms"
            ]
        for part, factor in lever.parts.items():
            ms[part] = {m: {mode: v * factor for mode, v in modes.items()} for m, modes in ms[part].items()}
        total, step = est["full"]["total"], est["step"]["total"]["ms"]
        for m, modes in total["ms"].items():
            for mode in modes:
                modes[mode] = sum(part[m][mode] for part in ms.values())
                total["steps"][m][mode] = modes[mode] / step[m][mode]
        out[arch] = est
    return out


def needed(
    counts_by_arch: dict[str, Any],
    c: cm.Constants,
    base: Lever,
    tier: str,
    target: float,
    machine: str = "H200",
    mode: str = "fp32",
) -> dict[str, float | None]:
    """Per model, the factor ``f`` on the evaluation's FLOPs, bytes and operators (:func:`engine`, on top of ``base``)
    at which ``tier`` comes to ``target`` training steps on ``machine`` in ``mode``: ``1`` if ``base`` alone reaches it,
    ``None`` if no factor does (the rest, the sampled passes, ``eigh`` calls and syncs, is over the target)."""

    def steps(arch: str, f: float) -> float:
        transform = both(base.transform or (lambda counts: None), engine(f, f, f))
        lever = dataclasses.replace(base, transform=transform)
        one = price({arch: counts_by_arch[arch]}, lever, c)[arch]
        return one[tier]["total"]["steps"][machine][mode]

    out: dict[str, float | None] = {}
    for arch in counts_by_arch:
        if steps(arch, 1.0) <= target:
            out[arch] = 1.0
        elif steps(arch, 0.0) > target:
            out[arch] = None
        else:
            lo, hi = 0.0, 1.0
            for _ in range(20):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if steps(arch, mid) <= target else (lo, mid)
            out[arch] = lo  # the most work left that meets the target
    return out


def table(counts_by_arch: dict[str, Any], c: cm.Constants, levers=LEVERS) -> str:
    """Per model, per lever: the full evaluation (with and without the real-loss keys) and the terms-only one, in ms
    and training steps (FP32, H100 / H200; TF32 on the H200)."""
    priced = [(lever, price(counts_by_arch, lever, c)) for lever in levers]
    lines = []
    for arch in counts_by_arch:
        lines += [
            "",
            f"### {cm.MODELS.get(arch, arch)}",
            "",
            "| lever | full, ms FP32 H100 / H200 | full, steps FP32 H100 / H200 | full, steps TF32 H200 | "
            "`sharpness=False`, steps FP32 H100 / H200 | terms-only, steps FP32 H100 / H200 |",
            "|---|---|---|---|---|---|",
        ]
        for lever, out in priced:
            full, nrl, terms = (out[arch][t]["total"] for t in ("full", "full_nrl", "terms"))
            lines.append(
                f"| {lever.name} | {full['ms']['H100']['fp32']:,.0f} / {full['ms']['H200']['fp32']:,.0f} | "
                f"{full['steps']['H100']['fp32']:.1f} / {full['steps']['H200']['fp32']:.1f} | "
                f"{full['steps']['H200']['tf32']:.1f} | "
                f"{nrl['steps']['H100']['fp32']:.1f} / {nrl['steps']['H200']['fp32']:.1f} | "
                f"{terms['steps']['H100']['fp32']:.2f} / {terms['steps']['H200']['fp32']:.2f} |"
            )
    return "\n".join(lines)


def floors(counts_by_arch: dict[str, Any], c: cm.Constants, machine: str = "H200", mode: str = "fp32") -> str:
    """Per model, tier and part: its milliseconds and what each resource alone would take (the host's operators, the
    matmuls, the other kernels' bytes, the syncs, the ``eigh`` calls), on ``machine`` in ``mode``."""
    card = cm.MACHINES[machine]
    lines = []
    for arch, counts in counts_by_arch.items():
        est = cm.estimate(counts, 12, 8, c)
        lines += [
            "",
            f"### {cm.MODELS.get(arch, arch)}: {machine}, {mode.upper()}",
            "",
            "| tier | part | ms | host: operators | matmuls | other kernels: bytes | syncs | eigh | steps |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for tier, rows in est.items():
            for part, r in rows.items():
                if tier == "step" and part == "total":
                    continue
                flops = {d: max(f, 0.0) for d, f in r["flops"].items()}
                host = max(r["ops"], 0) * c.host_op_s
                matmul = cm.segment_seconds(0, flops, 0, card, c, mode == "tf32")[1]
                memory = cm.segment_seconds(0, {}, max(r["bytes"], 0), card, c, False)[1]
                lines.append(
                    f"| {cm.TIER_NAMES[tier]} | {part} | {r['ms'][machine][mode]:,.1f} | {1e3 * host:,.1f} ms "
                    f"({r['ops']:,.0f}) | {1e3 * matmul:,.1f} ms | {1e3 * memory:,.1f} ms ({r['bytes'] / 1e9:,.0f} GB) "
                    f"| {1e3 * r['syncs'] * c.sync_s:.1f} ms | "
                    f"{1e3 * r.get('factorizations', 0) * c.factorization_s:,.1f} ms "
                    f"({r.get('factorizations', 0):,.0f}) | {r['steps'][machine][mode]:.2f} |"
                )
    return "\n".join(lines)


def needed_table(counts_by_arch: dict[str, Any], c: cm.Constants) -> str:
    """:func:`needed` for the goals: a full evaluation within 10 training steps at FP32, a terms-only one within 0.25,
    on an H100 and an H200, as counted and with :data:`STRUCTURAL`'s levers taken."""
    lines = ["| goal | levers taken | " + " | ".join(f"{a} H100 / H200" for a in counts_by_arch) + " |",
             "|---|---|" + "---|" * len(counts_by_arch)]  # fmt: skip

    def fmt(f: float | None) -> str:
        return "out of reach" if f is None else f"{f:.0%}"

    for tier, target in (("full", 10.0), ("full_nrl", 10.0), ("terms", 0.25)):
        for base in (LEVERS[0], STRUCTURAL):
            by = {m: needed(counts_by_arch, c, base, tier, target, m) for m in ("H100", "H200")}
            cells = [f"{fmt(by['H100'][a])} / {fmt(by['H200'][a])}" for a in counts_by_arch]
            lines.append(
                f"| {cm.TIER_NAMES[tier]} <= {target:g} steps FP32 | {base.name} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    import argparse
    import json
    from pathlib import Path

    from benchmarks.common import RESULTS_DIR

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default=str(RESULTS_DIR / f"{cm.NAME}.json"), help="a cost_model.json")
    args = p.parse_args(argv)
    result = json.loads(Path(args.counts).read_text())
    c = cm.Constants(**result["constants"])
    text = (
        f"Counts of {args.counts} (commit {result['commit']}), priced at 12 layers, B 8 x L 1024.\n\n## Floors\n"
        + floors(result["counts"], c)
        + "\n\n## Levers\n"
        + table(result["counts"], c)
        + "\n\n## The evaluation's work left, as a fraction of the counted (FLOPs, bytes and operators alike)\n\n"
        + needed_table(result["counts"], c)
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
