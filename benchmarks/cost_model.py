"""Cost model: what one warm monitor evaluation costs on a GPU, estimated from what a CPU run counts.

What a GPU spends on an evaluation is the arithmetic (matmul FLOPs at the card's rate for their dtype), the memory
traffic of the other kernels (bytes at the card's bandwidth), the host's dispatch of every operator (the GPU idles
when the host cannot keep up) and the host syncs (the host waits for the GPU at each). All four are counted on the CPU
(:mod:`benchmarks.cost_count`), at the realistic shape (L 1024, the model's width, vocabulary and precision:
bf16-mixed, AdamW), at 1 and 2 layers and batch 1 and 2.

Extrapolation (:func:`extrapolate`): the training step's and the sampled passes' counts are linear in the layers at a
given batch and linear in the batch at a given depth (a layer's work grows with the batch), so they are read bilinearly
through the 2 x 2 grid counted. The engine evaluates the first sequence's first ``max_tokens`` = 512 positions whatever
the batch: its part is counted at batch 1 (skipped at batch 2) and linear in the layers. The terms-only tier is counted
at the full depth (its blocks meet in gathered calls: not linear in the layers) and read linearly in the batch.

A tier's parts (:data:`PARTS`): ``closed forms`` = the engine of a full evaluation without the real-loss keys
(``sharpness=False``); ``real-loss solves`` = the engine of a full evaluation with them, less that, plus the
real-loss plugin (the sampled keys' solves share the closed forms' Lanczos rounds, so only their marginal cost is
theirs); ``real-loss sampling``; ``terms`` = the engine of a terms-only evaluation; ``capture & logging`` = the rest of
the step less the plain step. The plain training step is a tier of its own.

Pricing (:func:`price`) turns counts into milliseconds with the stated constants of a card (:data:`MACHINES`,
:class:`Constants`) and into training steps of the same model (the plain step priced by the same constants). Between
two host syncs the host runs ahead of the GPU until it must wait: each stretch costs ``max(host, device)``, each sync
its latency on top, each dense ``eigh``/SVD its own. The engine's parts are priced stretch by stretch at each counted
depth; the parts that grow with the batch, and the capture, from their counts at the model's shape
(:func:`price_counts`, :data:`COUNT_PRICED`). The tensor-core efficiency is fitted to the measured GPU figures of
``benchmarks/results/calibration.json`` (:func:`calibrated`); every later GPU run adds points there.

Peak memory (:func:`memory`): the plain step's peak and the monitor's extra, from the bytes alive that the counter
saw.

Run ``make cost-model`` (counts both models, an hour or more on two CPU cores, into the committed JSON and
``docs/cost_model.md``; ``python -m benchmarks.cost_model --partial PATH`` keeps each count as it is made and goes on
from there, from counts of the same commit; ``--arch gpt``; ``--quick``: a tiny shape, one step) or
``python -m benchmarks.cost_model --counts benchmarks/results/cost_model.json`` (re-price the committed counts, e.g.
after a calibration point was added); ``--compare DISPATCH_JSON``: a GPU run of ``bench_dispatch`` beside the
estimate (``gpu_scale.sh``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from benchmarks.cost_count import count_all, count_checks

NAME = "cost_model"


# -- pricing ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Machine:
    """A card's stated rates: dense peaks (no sparsity) from its datasheet, bytes per second of its memory."""

    name: str
    fp32: float  # FLOP/s, CUDA cores
    tf32: float  # FLOP/s, tensor cores
    bf16: float  # FLOP/s, tensor cores
    hbm: float  # bytes/s


#: NVIDIA's datasheets (SXM parts, dense): the two cards share their compute and differ in memory bandwidth.
MACHINES = {
    "H100": Machine("NVIDIA H100 SXM5 80GB", fp32=67e12, tf32=494.7e12, bf16=989.4e12, hbm=3.35e12),
    "H200": Machine("NVIDIA H200 SXM 141GB", fp32=67e12, tf32=494.7e12, bf16=989.4e12, hbm=4.8e12),
}


@dataclasses.dataclass(frozen=True)
class Constants:
    """What the model assumes beyond the datasheet (:func:`calibrated` fits ``tensor_efficiency``).

    Args:
        fp32_efficiency: Fraction of the FP32 peak a float32 matmul reaches without TF32 (torch's default).
        tensor_efficiency: Fraction of the tensor-core peak (bf16, and TF32 where enabled) a matmul reaches.
        hbm_efficiency: Fraction of the memory bandwidth the other kernels reach (they are bound by memory).
        host_op_s: Host seconds per dispatched ATen operator (the Python and C++ around it, the launch), views too.
        sync_s: Seconds per host sync beyond the wait for the queued work (the copy and the stream synchronize).
        factorization_s: Seconds per dense eigen- or singular-value decomposition on the device, whatever its size
            (an H200 profile measured ``eigh`` at about 3.5 ms a call whatever its batch: 791 calls, 2.8 s).
    """

    fp32_efficiency: float = 0.5
    tensor_efficiency: float = 0.5
    hbm_efficiency: float = 0.7
    host_op_s: float = 5e-6
    sync_s: float = 20e-6
    factorization_s: float = 3.5e-3


#: Where each rate of :class:`Machine` and each of :class:`Constants` comes from, with its name in the tables: the docs'
#: constants table is written from these and the values in use (:func:`constants_table`).
SOURCES = {
    "fp32": ("FP32 matmul peak (CUDA cores)", "datasheet, dense"),
    "tf32": ("TF32 tensor-core peak", "datasheet, dense"),
    "bf16": ("bf16 tensor-core peak", "datasheet, dense"),
    "hbm": ("memory bandwidth", "datasheet"),
    "fp32_efficiency": ("FP32 matmul efficiency (float64 at half its rate)", "assumed"),
    "tensor_efficiency": ("tensor-core matmul efficiency (bf16, TF32)", "fitted to the calibration points marked fit"),
    "hbm_efficiency": ("other kernels' share of the bandwidth", "assumed"),
    "host_op_s": ("host time per dispatched operator (views too)", "assumed (eager PyTorch on a server CPU)"),
    "sync_s": ("latency per host sync", "assumed"),
    "factorization_s": (
        "time per dense eigh/SVD, whatever its size",
        "measured: an H200 profile of the monitor at 2a724ff, 791 eigh calls in 2.8 s",
    ),
}


def segment_seconds(
    ops: int, flops: dict[str, float], moved: float, machine: Machine, c: Constants, tf32: bool
) -> tuple[float, float]:
    """``(host, device)`` seconds of a stretch of ``ops`` operators, matmul ``flops`` by dtype and ``moved`` bytes of
    other kernels: the host dispatches every operator, the device runs the matmuls at their dtype's rate and the rest
    at the memory's."""
    rate = {
        "float32": machine.tf32 * c.tensor_efficiency if tf32 else machine.fp32 * c.fp32_efficiency,
        "bfloat16": machine.bf16 * c.tensor_efficiency,
        "float16": machine.bf16 * c.tensor_efficiency,
        "float64": machine.fp32 / 2 * c.fp32_efficiency,  # (the H100/H200 FP64 rate is half the FP32 one)
    }
    device = sum(f / rate[d] for d, f in flops.items()) + moved / (machine.hbm * c.hbm_efficiency)
    return ops * c.host_op_s, device


def price_counts(counts: dict[str, Any], machine: Machine, c: Constants, tf32: bool = False) -> float:
    """Milliseconds of counts without their stretches (a difference of two steps' counts): ``max(host, device)`` of
    the whole, its syncs and factorizations on top; a negative count (fewer than the plain step) counts 0."""
    flops = {d: max(f, 0.0) for d, f in counts["flops"].items()}
    host, device = segment_seconds(max(counts["ops"], 0), flops, max(counts["bytes"], 0), machine, c, tf32)
    return 1e3 * (max(host, device) + max(counts["syncs"], 0) * c.sync_s
                  + max(counts.get("factorizations", 0), 0) * c.factorization_s)  # fmt: skip


def price(tally: dict[str, Any], machine: Machine, c: Constants, tf32: bool = False) -> dict[str, float]:
    """Milliseconds of one part's counts (:meth:`~benchmarks.cost_count.Tally.as_dict`): between two syncs the host
    runs ahead of the device until it waits, so each stretch costs ``max(host, device)``; each sync adds ``sync_s``,
    each dense factorization ``factorization_s``. Also the host's and the device's totals, to say which binds."""
    ms = host_ms = device_ms = 0.0
    for ops, flops, moved in tally["segments"]:
        host, device = segment_seconds(ops, flops, moved, machine, c, tf32)
        ms += max(host, device) * 1e3
        host_ms, device_ms = host_ms + host * 1e3, device_ms + device * 1e3
    ms += tally["syncs"] * c.sync_s * 1e3 + tally.get("factorizations", 0) * c.factorization_s * 1e3
    return {"ms": ms, "host_ms": host_ms, "device_ms": device_ms}


# -- from counted configurations to a model's estimate -------------------------------------------------------------

_ADDITIVE = ("ops", "views", "syncs", "factorizations", "flops", "bytes", "ms")


def _lin(terms: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """``sum(coef * tree)`` of nested dicts of numbers (a key missing from a tree counts 0)."""
    out: dict[str, Any] = {}
    keys = dict.fromkeys(k for _, tree in terms for k in tree)
    for k in keys:
        subs = [(coef, tree.get(k, 0)) for coef, tree in terms]
        if any(isinstance(v, dict) for _, v in subs):
            out[k] = _lin([(coef, v if isinstance(v, dict) else {}) for coef, v in subs])
        else:
            out[k] = sum(coef * v for coef, v in subs)
    return out


def priced_cell(cell: dict[str, Any], c: Constants, machines=MACHINES) -> dict[str, dict[str, Any]]:
    """One counted configuration's parts, averaged over its counted steps: the counts of :data:`_ADDITIVE` and
    ``ms`` = ``{machine: {"fp32": ms, "tf32": ms}}`` (each step priced on its own, then averaged)."""
    steps = cell["steps"]
    parts = dict.fromkeys(p for step in steps for p in step["parts"])
    out = {}
    for part in parts:
        per_step = []
        for step in steps:
            tally = step["parts"].get(part)
            if tally is None:
                continue
            row = {k: tally.get(k, 0) for k in _ADDITIVE if k != "ms"}
            row["ms"] = {
                m: {mode: price(tally, machine, c, tf32=mode == "tf32")["ms"] for mode in ("fp32", "tf32")}
                for m, machine in machines.items()
            }
            per_step.append(row)
        out[part] = _lin([(1 / len(steps), row) for row in per_step])
    return out


def _layers_batch(key: str) -> tuple[int, int]:
    """``(n_layer, batch)`` of a cell's key ``"n{n}_b{B}"``."""
    n, b = key[1:].split("_b")
    return int(n), int(b)


def _weights(counted: list[int], x: int, what: str) -> dict[int, float]:
    """Weights of the values counted at ``counted`` (one or two points) for the straight line through them at ``x``."""
    if len(counted) == 1:
        return {counted[0]: 1.0}
    if len(counted) != 2:
        raise ValueError(f"Counted at {what} {counted}: one or two values expected.")
    a, b = counted
    return {a: (b - x) / (b - a), b: (x - a) / (b - a)}


def extrapolate(cells: dict[str, dict[str, Any]], n: int, batch: int) -> dict[str, Any]:
    """The counts at ``n`` layers and batch ``batch`` from the cells counted (keys ``"n{n}_b{B}"``): bilinear in the
    layers and the batch through a 2 x 2 grid (a layer's work grows with the batch), linear through two points where
    only one of them varies; a part counted at one batch only (the engine's, whatever the batch) is constant in the
    batch; one counted at one depth only (the terms-only tier) is read at that depth."""
    points = {_layers_batch(k): v for k, v in cells.items()}
    depths, batches = sorted({p[0] for p in points}), sorted({p[1] for p in points})
    if len(depths) == 1 and depths[0] != n:
        raise ValueError(f"Counted at depth {depths[0]}, asked for n_layer={n}: count the tier at {n} layers.")
    wn, wb = _weights(depths, n, "depths"), _weights(batches, batch, "batches")
    return _lin([(wn[p[0]] * wb[p[1]], v) for p, v in points.items()])


#: A tier's parts: ``{part: [(coefficient, tier counted, counter part), ...]}`` (see the module docstring).
PARTS = {
    "full": {
        "closed forms": [(1, "full_nrl", "engine")],
        "real-loss sampling": [(1, "full", "sampling")],
        "real-loss solves": [(1, "full", "engine"), (-1, "full_nrl", "engine"), (1, "full", "plugin")],
        "capture & logging": [(1, "full", "step"), (-1, "off", "step")],
    },
    "full_nrl": {
        "closed forms": [(1, "full_nrl", "engine")],
        "capture & logging": [(1, "full_nrl", "step"), (1, "full_nrl", "plugin"), (-1, "off", "step")],
    },
    "terms": {
        "terms": [(1, "terms", "engine")],
        "capture & logging": [(1, "terms", "step"), (1, "terms", "plugin"), (-1, "off", "step")],
    },
    "step": {"training step": [(1, "off", "step")]},
}
#: The parts that grow with the batch; the others are read at batch 1: the monitor captures, evaluates and logs the
#: first sequence's first ``max_tokens`` positions whatever the batch (at batch 2 the engine is skipped, and with it
#: what the logging and the real-loss plugin do with its numbers).
BATCH_PARTS = {"real-loss sampling", "training step"}
#: Parts priced from their counts at the model's shape (:func:`price_counts`), not extrapolated from the counted
#: shapes' prices: those that grow with the batch (host-bound at batch 1, bound by the device at batch 8, so a price is
#: not linear in the batch where the counts are) and a difference of two training steps' counts (whose stretches
#: between syncs are the training step's, not the monitor's). The engine's parts are priced stretch by stretch at
#: batch 1, where each layer adds stretches like the last.
COUNT_PRICED = {"capture & logging", "real-loss sampling", "training step"}
TIER_NAMES = {
    "full": "full (defaults, real-loss keys on)",
    "full_nrl": "full, `sharpness=False`",
    "terms": "terms-only (`warnings`)",
    "step": "plain training step",
}


def estimate(counts: dict[str, Any], n: int, batch: int, c: Constants) -> dict[str, Any]:
    """One model's tiers at ``n`` layers and batch ``batch``: ``{tier: {part: row}}`` with a ``"total"`` row per
    tier; each row's counts (:data:`_ADDITIVE`), its ``ms`` per machine and mode, and ``steps``: its ms over the plain
    training step's, priced alike."""
    tiers: dict[int, dict[str, Any]] = {batch: {}, 1: {}}
    for t, cells in counts.items():
        priced = {k: priced_cell(v, c) for k, v in cells.items()}
        parts = dict.fromkeys(p for cell in priced.values() for p in cell)
        for b in tiers:
            tiers[b][t] = {part: extrapolate({k: v.get(part, {}) for k, v in priced.items()}, n, b) for part in parts}
    out: dict[str, Any] = {}
    for tier, parts in PARTS.items():
        rows = {
            name: _lin([(coef, tiers[batch if name in BATCH_PARTS else 1][t].get(p, {})) for coef, t, p in terms])
            for name, terms in parts.items()
        }
        for name in COUNT_PRICED & set(rows):
            row = rows[name]
            row["ms"] = {m: {mode: price_counts(row, machine, c, mode == "tf32") for mode in ("fp32", "tf32")}
                         for m, machine in MACHINES.items()}  # fmt: skip
        rows["total"] = _lin([(1, row) for row in rows.values()])
        out[tier] = rows
    step_ms = out["step"]["total"]["ms"]
    for rows in out.values():
        for row in rows.values():
            row["steps"] = {
                m: {mode: ms / step_ms[m][mode] for mode, ms in modes.items()} for m, modes in row["ms"].items()
            }
    return out


# -- calibration ----------------------------------------------------------------------------------------------------

CALIBRATION = Path(__file__).resolve().parent / "results" / "calibration.json"


def step_ms(counts: dict[str, Any], n: int, batch: int, machine: str, c: Constants) -> float:
    """The plain training step of a model's counts priced on ``machine`` (its matmuls are bf16: the mode of float32
    ones does not matter)."""
    cells = {k: priced_cell(v, c, {machine: MACHINES[machine]})["step"] for k, v in counts["off"].items()}
    return price_counts(extrapolate(cells, n, batch), MACHINES[machine], c)


def priced_point(point: dict[str, Any], counts: dict[str, Any], c: Constants) -> float:
    """This model's figure for a calibration point: its tier's milliseconds (``"ms"``, FP32 matmuls unless the
    point says ``"tf32": true``) or peak GiB (``"gib"``) at its machine and shape."""
    arch, n, batch, tier = point["arch"], point["n_layer"], point["batch"], point.get("tier", "step")
    if "gib" in point:
        mem = memory(counts[arch], arch, n, batch)
        return (mem["plain_peak"] if tier == "step" else mem["tiers"][tier]["peak"]) / GIB
    mode = "tf32" if point.get("tf32") else "fp32"
    if tier == "step":
        return step_ms(counts[arch], n, batch, point["machine_kind"], c)
    return estimate(counts[arch], n, batch, c)[tier]["total"]["ms"][point["machine_kind"]][mode]


def calibrated(counts_by_arch: dict[str, Any], points: list[dict[str, Any]], base: Constants = Constants()):
    """``(constants, fits)``: ``base`` with ``tensor_efficiency`` chosen so that the priced plain steps match the
    calibration points marked ``"use": "fit"`` (least squares in log time; one point: exactly), and per point the
    model's figure beside the measured one (``"check"`` points too; ``"none"``: recorded, not priced)."""
    usable = [p for p in points if p["use"] != "none" and p["arch"] in counts_by_arch]
    fit = [p for p in usable if p["use"] == "fit"]
    if any("ms" not in p for p in fit):
        raise ValueError("A calibration point marked 'fit' has no 'ms': only times fit the tensor-core efficiency.")

    def error(eff: float) -> float:
        c = dataclasses.replace(base, tensor_efficiency=eff)
        return sum(math.log(priced_point(p, counts_by_arch, c) / p["ms"]) ** 2 for p in fit)

    c = base
    if fit:
        lo, hi = math.log(0.02), math.log(1.0)  # golden-section search on the log of the efficiency
        g = (math.sqrt(5) - 1) / 2
        for _ in range(40):
            a, b = hi - g * (hi - lo), lo + g * (hi - lo)
            lo, hi = (lo, b) if error(math.exp(a)) < error(math.exp(b)) else (a, hi)
        c = dataclasses.replace(base, tensor_efficiency=round(math.exp((lo + hi) / 2), 4))
    fits = []
    for p in usable:
        value = p.get("ms", p.get("gib"))
        priced = priced_point(p, counts_by_arch, c)
        fits.append(
            {
                "point": p["what"],
                "use": p["use"],
                "unit": "ms" if "ms" in p else "GiB",
                "measured": value,
                "estimated": round(priced, 3),
                "ratio": round(priced / value, 3),
            }
        )
    return c, fits


# -- peak memory ----------------------------------------------------------------------------------------------------


def param_count(arch: str, n_layer: int, d_model: int = 768, vocab: int = 50304, seq: int = 1024) -> int:
    """Parameters of the model :func:`benchmarks.bench_dispatch.build_model` builds (LLaMA: vocabulary 32000)."""
    from benchmarks import bench_dispatch

    with torch.device("meta"):
        model = bench_dispatch.build_model(arch, n_layer, 32000 if arch == "llama" else vocab, seq, d_model)
    return sum(p.numel() for p in model.parameters())


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def memory(
    counts: dict[str, Any], arch: str, n: int, batch: int, d_model: int = 768, vocab: int = 50304, seq: int = 1024
) -> dict[str, Any]:
    """Peak memory of the plain training step and of the step with each tier's evaluation, in bytes.

    The plain step's peak (the counter's, on the CPU: every tensor alive, parameters and optimizer state included) is
    affine in the layers and the batch and extrapolated so. A monitored step peaks at the largest of: the plain peak
    plus what the monitor holds through the backward (``held``: the captured tensors and sampled columns, read as the
    bytes alive when the engine starts less the parameters, gradients and AdamW moments, ``static`` = 16 bytes per
    parameter); the sampled passes (the bytes alive when they start plus their own most, full tier); the evaluation
    (``static + held`` plus the engine's most bytes above that, ``working``: its Lanczos bases and products, the
    largest over the counted configurations: a window of about one layer's blocks, whatever the depth)."""

    def layers(key: str) -> int:
        return _layers_batch(key)[0]

    def per_cell(tier: str, fn) -> dict[str, dict[str, float]]:
        return {k: {"v": _mean([fn(s) for s in cell["steps"]])} for k, cell in counts[tier].items()}

    sizes = {
        m: 16 * param_count(arch, m, d_model, vocab, seq) for m in {layers(k) for t in counts.values() for k in t} | {n}
    }
    plains = per_cell("off", lambda s: s["peak_bytes"])

    def model(tier: str, n: int, batch: int) -> dict[str, Any]:
        plain = extrapolate(plains, n, batch)["v"]
        held = {
            k: {"v": v["v"] - sizes[layers(k)]}
            for k, v in per_cell(tier, lambda s: s["parts"]["engine"]["entry_live"]).items()
        }
        H = extrapolate(held, n, batch)["v"]
        working = max(s["parts"]["engine"]["working"] for cell in counts[tier].values() for s in cell["steps"])
        candidates = {"backward": plain + H, "evaluation": sizes.setdefault(n, 16 * param_count(arch, n, d_model,
                      vocab, seq)) + H + working}  # fmt: skip
        if tier == "full":
            sampled = per_cell(tier, lambda s: s["parts"]["sampling"]["entry_live"] + s["parts"]["sampling"]["working"])
            candidates["sampling"] = extrapolate(sampled, n, batch)["v"]
        peak = max(candidates.values())
        return {"plain": plain, "held": H, "working": working, "candidates": candidates, "peak": peak,
                "extra": peak - plain, "extra_fraction": (peak - plain) / plain}  # fmt: skip

    out: dict[str, Any] = {"plain_peak": extrapolate(plains, n, batch)["v"], "static": sizes[n], "tiers": {}}
    for tier in ("full", "full_nrl", "terms"):
        out["tiers"][tier] = model(tier, n, batch)
        # the model at the counted configurations beside the peak the counter saw there
        out["tiers"][tier]["check"] = {
            k: {"model": model(tier, *_layers_batch(k))["peak"],
                "counted": _mean([s["peak_bytes"] for s in cell["steps"]])}
            for k, cell in counts[tier].items() if _layers_batch(k)[1] == 1
        }  # fmt: skip
    return out


def engine_estimate(arch: str, d_model: int = 768, vocab: int = 50304, seq: int = 1024):
    """The engine's own estimate of an evaluation's extra memory (:func:`curvwatch.engine.evaluation_bytes`, the
    monitor's Lanczos settings) for one layer's blocks captured at the shape (the monitor's ``max_tokens``), with their
    sampled columns (its default ``samples``), and the most a window of blocks evaluated together may hold by the
    engine's rule (``LOCKSTEP_MEMORY`` times the largest block's): ``{"blocks": {name: bytes}, "window_bound":
    bytes}``."""
    import torch.nn.functional as F

    from benchmarks import bench_dispatch
    from curvwatch import Evaluation, Sharpness
    from curvwatch.adapters import find_blocks
    from curvwatch.capture import Capture
    from curvwatch.engine import MONITOR_LANCZOS, evaluation_bytes
    from curvwatch.engine.core import LOCKSTEP_MEMORY
    from curvwatch.realloss import sample_outputs
    from curvwatch.realloss.logits import find_logits_module

    vocab = 32000 if arch == "llama" else vocab
    torch.manual_seed(0)
    model = bench_dispatch.build_model(arch, 1, vocab, seq, d_model)
    idx = torch.randint(0, vocab, (1, seq + 1))
    max_tokens, samples = Evaluation().max_tokens, Sharpness().samples
    with Capture(find_blocks(model), max_tokens, logits_module=find_logits_module(model)[1]) as capture:
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
        sample_outputs(capture, loss, samples, generator=torch.Generator().manual_seed(0))
        loss.backward()
    lanczos = MONITOR_LANCZOS
    sizes = {b.spec.name: evaluation_bytes(b, torch.float32, lanczos.max_iter, lanczos.max_basis)
             for b in capture.blocks()}  # fmt: skip
    return {"blocks": sizes, "window_bound": LOCKSTEP_MEMORY * max(sizes.values())}


def top_ops(counts: dict[str, Any], k: int = 8, key: str = "n2_b1") -> str:
    """Per model, tier and counter part, the ``k`` operators dispatched most and those that moved the most bytes at
    one counted configuration (first counted step): where a part's operators and memory traffic go."""
    lines = []
    for arch, tiers in counts.items():
        for tier, cells in tiers.items():
            cell = cells.get(key) or next(iter(cells.values()))
            for part, tally in cell["steps"][0]["parts"].items():
                names, moved = tally.get("names", {}), tally.get("name_bytes", {})
                if not names:
                    continue
                by_count = ", ".join(f"{n.removeprefix('aten.')} {v:,}" for n, v in list(names.items())[:k])
                by_bytes = ", ".join(f"{n.removeprefix('aten.')} {v / 1e9:,.2f} GB" for n, v in list(moved.items())[:k])
                lines.append(f"* {arch} {tier} {part} ({tally['ops']:,} operators): {by_count}; bytes: {by_bytes}")
                shapes = tally.get("factorization_shapes")
                if shapes:
                    lines.append("  factorizations: " + ", ".join(f"{s} x{v}" for s, v in shapes.items()))
    return "\n".join(lines)


def linearity(counts: dict[str, Any], checks: dict[str, Any], c: Constants) -> list[dict[str, Any]]:
    """The extrapolation checked: cells counted outside the grid (``checks``: ``{arch: {tier: {key: cell}}}``, e.g. 3
    layers and batch 3) beside what :func:`extrapolate` reads there from the grid, per part: operators, syncs, matmul
    FLOPs, bytes moved and H200 FP32 milliseconds."""
    rows = []
    for arch, tiers in checks.items():
        for tier, cells in tiers.items():
            grid = {k: priced_cell(v, c) for k, v in counts[arch][tier].items()}
            for key, cell in cells.items():
                n, batch = _layers_batch(key)
                counted = priced_cell(cell, c)
                for part, got in counted.items():
                    if not cell.get("engine", True) and part != "sampling":
                        continue  # without the engine, only the sampled passes are what a monitored step runs
                    use = {k: v.get(part, {}) for k, v in grid.items() if part != "engine" or _layers_batch(k)[1] == 1}
                    want = extrapolate(use, n, batch)
                    if part in ("sampling", "step"):  # priced from their counts, as the estimate prices them
                        for row in (want, got):
                            row["ms"] = {"H200": {"fp32": price_counts(row, MACHINES["H200"], c)}}
                    for q, read in (("ops", lambda r: r["ops"]), ("syncs", lambda r: r["syncs"]),
                                    ("GFLOP", lambda r: sum(r["flops"].values()) / 1e9),
                                    ("GB moved", lambda r: r["bytes"] / 1e9),
                                    ("ms H200 FP32", lambda r: r["ms"]["H200"]["fp32"])):  # fmt: skip
                        rows.append({"arch": arch, "tier": tier, "at": key, "part": part, "quantity": q,
                                     "extrapolated": read(want), "counted": read(got)})  # fmt: skip
    return rows


def linearity_table(rows: list[dict[str, Any]]) -> str:
    """:func:`linearity`'s rows as one line per model, tier, shape and part: extrapolated / counted."""
    quantities = list(dict.fromkeys(r["quantity"] for r in rows))
    lines = [
        "| model | tier | at | part | " + " | ".join(quantities) + " |",
        "|---|---|---|---|" + "---|" * len(quantities),
    ]
    groups: dict[tuple, dict[str, str]] = {}

    def num(x: float) -> str:
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    for r in rows:
        cell = f"{num(r['extrapolated'])} / {num(r['counted'])}"
        groups.setdefault((r["arch"], r["tier"], r["at"], r["part"]), {})[r["quantity"]] = cell
    for (arch, tier, at, part), cells in groups.items():
        lines.append(f"| {arch} | {tier} | {at} | {part} | " + " | ".join(cells.get(q, "") for q in quantities) + " |")
    return "\n".join(lines)


# -- tables and the command -----------------------------------------------------------------------------------------

MODELS = {
    "gpt": "GPT-2-small (curvwatch GPT: d 768, 12 heads, vocabulary 50,304)",
    "llama": "LLaMA-125M (HF LlamaForCausalLM: d 768, 12 / 4 heads, ff 2048, vocabulary 32,000)",
}
GIB = 2**30


def _pair(values: dict[str, dict[str, float]], mode: str, fmt: str) -> str:
    return " / ".join(format(values[m][mode], fmt) for m in MACHINES)


def table(est: dict[str, Any]) -> str:
    """The markdown table of one model's :func:`estimate`."""
    machines = " / ".join(MACHINES)
    head = [
        "tier",
        "part",
        "GFLOP bf16",
        "GFLOP fp32",
        "operators",
        "syncs (eigh)",
        f"ms FP32 {machines}",
        f"ms TF32 {machines}",
        f"steps FP32 {machines}",
        f"steps TF32 {machines}",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for tier, rows in est.items():
        for part, row in rows.items():
            if tier == "step" and part == "total":
                continue
            name = f"**{part}**" if part == "total" else part
            flops = row["flops"]
            cells = [
                TIER_NAMES[tier],
                name,
                f"{flops.get('bfloat16', 0) / 1e9:,.0f}",
                f"{flops.get('float32', 0) / 1e9:,.0f}",
                f"{row['ops']:,.0f}",
                f"{row['syncs']:,.1f}" + (f" ({row['factorizations']:,.1f})" if row.get("factorizations") else ""),
                _pair(row["ms"], "fp32", ",.1f"),
                _pair(row["ms"], "tf32", ",.1f"),
                _pair(row["steps"], "fp32", ".2f"),
                _pair(row["steps"], "tf32", ".2f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(mem: dict[str, Any]) -> str:
    """The markdown table of one model's :func:`memory` (and the engine's own bound, where estimated)."""
    bound = mem.get("engine_estimate", {}).get("window_bound")
    lines = [
        "| tier | held through the backward (captured, samples) | evaluation's working set | peak | extra over the "
        "plain step's peak | goal <= 15% |",
        "|---|---|---|---|---|---|",
        f"| plain training step | | | {mem['plain_peak'] / GIB:.3g} GiB | | |",
    ]
    for tier, m in mem["tiers"].items():
        met = "met" if m["extra_fraction"] <= 0.15 else "NOT met"
        working = f"{m['working'] / GIB:.3g} GiB" + (
            f" (engine's bound {bound / GIB:.3g})" if bound and tier == "full" else ""
        )
        lines.append(
            f"| {TIER_NAMES[tier]} | {m['held'] / GIB:.3g} GiB | {working} | {m['peak'] / GIB:.3g} GiB | "
            f"{m['extra'] / GIB:.3g} GiB ({100 * m['extra_fraction']:.1f}%) | {met} |"
        )
    return "\n".join(lines)


def _cpu_name() -> str | None:
    """The CPU's model name (Linux), else ``None``."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)


def _cells(tiers: dict[str, Any]) -> list[dict[str, Any]]:
    """Every counted configuration of one model's counts (``{tier: {key: cell}}``)."""
    return [cell for cells in tiers.values() for cell in cells.values()]


def _git(*args: str) -> str:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()


def load_points(path: Path = CALIBRATION) -> list[dict[str, Any]]:
    import json

    return json.loads(path.read_text())["points"] if path.exists() else []


def build(
    counts: dict[str, Any],
    n: int,
    batch: int,
    points: list[dict[str, Any]],
    d_model: int = 768,
    vocab: int = 50304,
    seq: int = 1024,
) -> dict[str, Any]:
    """Calibrate (on the points of the counted width, GPT-2-small's, and depth), then every model's estimate and
    memory at ``n`` layers and batch ``batch``."""
    c, fits = calibrated(counts, [p for p in points if d_model == 768 and (p["n_layer"], p["seq"]) == (n, seq)])
    return {
        "constants": dataclasses.asdict(c),
        "machines": {k: dataclasses.asdict(m) for k, m in MACHINES.items()},
        "calibration": fits,
        "estimates": {arch: estimate(counts[arch], n, batch, c) for arch in counts},
        "memory": {arch: memory(counts[arch], arch, n, batch, d_model, vocab, seq) for arch in counts},
    }


def constants_table(result: dict[str, Any]) -> str:
    """The markdown table of the constants a :func:`build` result priced with: each card's rates, the
    :class:`Constants`, and where each comes from (:data:`SOURCES`)."""
    machines, c = result["machines"], result["constants"]
    fitted = any(f["use"] == "fit" for f in result["calibration"])
    units = {"fp32": 1e12, "tf32": 1e12, "bf16": 1e12, "hbm": 1e12}
    unit_names = {"fp32": "TFLOP/s", "tf32": "TFLOP/s", "bf16": "TFLOP/s", "hbm": "TB/s"}

    def value(key: str, v: float) -> str:
        if key in units:
            return f"{v / units[key]:g} {unit_names[key]}"
        if key.endswith("_efficiency"):
            return f"{v:.1%}" if key == "tensor_efficiency" else f"{v:.0%}"
        return f"{v * 1e6:g} us" if v < 1e-3 else f"{v * 1e3:g} ms"

    lines = ["| constant | " + " | ".join(m["name"] for m in machines.values()) + " | source |",
             "|---|" + "---|" * len(machines) + "---|"]  # fmt: skip
    for key, (name, source) in SOURCES.items():
        if key == "tensor_efficiency" and not fitted:
            source = "assumed: no calibration point to fit"
        values = (
            [value(key, m[key]) for m in machines.values()] if key in units else [value(key, c[key])] * len(machines)
        )
        lines.append(f"| {name} | " + " | ".join(values) + f" | {source} |")
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    """The markdown of a :func:`build` result."""
    from curvwatch import Sharpness

    shape = result["estimate_shape"]
    out = [
        "Constants (the FP32 columns: float32 matmuls on the CUDA cores, torch's default; TF32: on the tensor cores):",
        "",
        constants_table(result),
        "",
        f"Steps: training steps of the same model ({shape['n_layer']} layers, B {shape['batch']} x L {shape['seq']}, "
        f"{shape['precision']}, AdamW) priced alike.",
        "",
    ]
    for fit in result["calibration"]:
        out.append(
            f"* calibration ({fit['use']}): {fit['point']}: measured {fit['measured']} {fit['unit']}, estimated "
            f"{fit['estimated']:.3g} {fit['unit']} ({fit['ratio']:.2f}x)"
        )
    for arch, est in result["estimates"].items():
        out += ["", f"### {MODELS.get(arch, arch)}", "", table(est), "", memory_table(result["memory"][arch])]
        at_once = sorted({s.get("passes_at_once") for cell in result["counts"].get(arch, {}).get("full", {}).values()
                          for s in cell["steps"]} - {None})  # fmt: skip
        if at_once:
            out += ["", f"Sampled passes at once (as at this shape, within the memory budget): "
                        f"{', '.join(map(str, at_once))} of {Sharpness().samples}."]  # fmt: skip
    return "\n".join(out)


def compare(args) -> dict[str, Any]:
    """A GPU run of ``bench_dispatch --device cuda`` (``args.compare``) beside this model's estimate of the same rows
    (the counts of ``args.counts``, else the committed ``benchmarks/results/cost_model.json``), and the run's figures
    as calibration points to add to ``benchmarks/results/calibration.json``."""
    import json

    from benchmarks.common import RESULTS_DIR, write_json

    measured = json.loads(Path(args.compare).read_text())
    a = measured["args"]
    arch, n, batch = a["arch"], a["n_layer"], a["batch"]
    counts = json.loads(Path(args.counts or RESULTS_DIR / f"{NAME}.json").read_text())["counts"]
    c, _ = calibrated(counts, load_points())
    device = measured.get("device_name", "")
    machine = next((m for m in MACHINES if m in device), None)
    if machine is None:
        machine = "H200"
        print(f"{device or 'The device'} is none of the cards priced ({', '.join(MACHINES)}): priced as an H200.")
    est = estimate(counts[arch], n, batch, c)
    mem = memory(counts[arch], arch, n, batch)
    plain = measured["plain_ms"]
    rows = [("plain training step, ms", plain, est["step"]["total"]["ms"][machine]["fp32"])]
    for tier in ("full", "full_nrl", "terms"):
        if tier in measured:
            rows.append(
                (
                    f"{TIER_NAMES[tier]}, ms",
                    measured[tier]["median_ms"] - plain,
                    est[tier]["total"]["ms"][machine]["fp32"],
                )
            )
            rows.append(
                (
                    f"{TIER_NAMES[tier]}, training steps",
                    measured[tier]["steps"],
                    est[tier]["total"]["steps"][machine]["fp32"],
                )
            )

    def peak(name: str) -> float:  # the timed (warm) steps' peak: a terms-only run's step 0 is a full evaluation
        return measured[name].get("warm_peak_gib", measured[name]["peak_gib"])

    rows.append(("plain step's peak memory, GiB", peak("off"), mem["plain_peak"] / GIB))
    for tier in ("full", "full_nrl", "terms"):
        if tier in measured:
            rows.append((f"{TIER_NAMES[tier]}: peak memory, GiB", peak(tier), mem["tiers"][tier]["peak"] / GIB))
    lines = [
        f"{MODELS.get(arch, arch)}, {n} layers, B {batch}, L {a['seq']}, {a['precision']}: "
        f"measured on {device or '?'}, estimated for {machine} (FP32 matmuls, torch's default)",
        "",
        "| row | measured | estimated | estimated / measured |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {m:,.3g} | {e:,.3g} | {e / m:.2f} |" if m else f"| {name} | {m} | {e:,.3g} | |"
        for name, m, e in rows
    ]
    print("\n".join(lines))
    commit = _git("rev-parse", "--short", "HEAD")
    point = {
        "machine": device,
        "machine_kind": machine,
        "command": f"python -m benchmarks.bench_dispatch --device cuda --arch {arch} --tiers {a['tiers']}",
        "commit": commit,
        "date": measured.get("date"),
        "arch": arch,
        "seq": a["seq"],
        "precision": a["precision"],
        "n_layer": n,
        "batch": batch,
    }
    points = [{**point, "what": f"{arch} plain training step", "use": "fit", "ms": plain, "tier": "step"}]
    points += [
        {
            **point,
            "what": f"{arch} {tier} evaluation",
            "use": "check",
            "ms": measured[tier]["median_ms"] - plain,
            "tier": tier,
        }
        for tier in ("full", "full_nrl", "terms")
        if tier in measured
    ]
    points += [
        {**point, "what": f"{arch} {tier} peak memory", "use": "check", "gib": peak(name), "tier": tier}
        for tier, name in (("step", "off"), ("full", "full"), ("full_nrl", "full_nrl"), ("terms", "terms"))
        if name in measured
    ]
    result = {"rows": [{"row": r, "measured": m, "estimated": e} for r, m, e in rows], "points": points}
    write_json(f"{NAME}_compare_{arch}", result, args.out)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import argparse
    import json
    import sys

    from benchmarks.common import RESULTS_DIR, environment

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", nargs="+", choices=("gpt", "llama"), default=["gpt", "llama"])
    p.add_argument(
        "--n-layer", type=int, default=12, help="the estimate's depth (the terms-only tier is counted there)"
    )
    p.add_argument("--batch", type=int, default=8, help="the estimate's batch")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304, help="the GPT's (the LLaMA's is 32000)")
    p.add_argument("--counts", default=None, help="price the counts of this cost_model.json instead of counting")
    p.add_argument("--partial", default=None, help="counting: keep what this file holds, write each count into it")
    p.add_argument(
        "--quick", action="store_true", help="a tiny shape (d 64, L 64, vocabulary 512, 2 layers), one step counted"
    )
    p.add_argument("--compare", default=None, help="a bench_dispatch --device cuda JSON: measured beside estimated")
    p.add_argument("--docs", default=None, help="write the tables into this Markdown file between its markers")
    p.add_argument("--top", type=int, default=0, help="print the N operators each part dispatches most")
    p.add_argument(
        "--checks",
        default=None,
        help="count the shapes outside the grid (cost_count.CHECKS) into this file, or read them there, and set them "
        "beside the extrapolation",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.n_layer, args.batch, args.seq, args.d_model, args.vocab = 2, 2, 64, 64, 512
    if args.compare:
        return compare(args)
    shape = {
        "n_layer": args.n_layer,
        "batch": args.batch,
        "seq": args.seq,
        "d_model": args.d_model,
        "vocab": args.vocab,
        "precision": "bf16-mixed",
    }
    if args.counts:
        source = json.loads(Path(args.counts).read_text())
        counts, counted = source["counts"], {k: source[k] for k in ("machine", "command", "commit", "date", "shape")}
        bounds = {arch: m.get("engine_estimate") for arch, m in source.get("memory", {}).items()}
    else:
        partial = Path(args.partial) if args.partial else None
        counts = json.loads(partial.read_text()) if partial and partial.exists() else {}
        steps = (1,) if args.quick else (1, 2)  # quick: one warm step per configuration
        counts = count_all(
            args.arch, args.seq, args.n_layer, d_model=args.d_model, vocab=args.vocab, steps=steps, path=partial,
            counts=counts, batch=args.batch,
        )  # fmt: skip
        env = environment(torch.device("cpu"))
        bounds = {arch: engine_estimate(arch, args.d_model, args.vocab, args.seq) for arch in counts}
        counted = {
            "machine": f"{_cpu_name() or env['processor']}, {env['cpu_count']} CPUs, torch {env['torch']}",
            "command": "python -m benchmarks.cost_model " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": ", ".join(sorted({cell.get("commit", "?") for t in counts.values() for cell in _cells(t)})),
            "date": env["timestamp_utc"],
            "shape": shape,
        }
    result = {
        "name": NAME,
        **counted,
        "estimate_shape": shape,
        **build(counts, args.n_layer, args.batch, load_points(), args.d_model, args.vocab, args.seq),
        "counts": counts,
    }
    for arch, bound in bounds.items():
        if bound is not None and arch in result["memory"]:
            result["memory"][arch]["engine_estimate"] = bound
    if args.checks:
        path = Path(args.checks)
        checks = count_checks(path, json.loads(path.read_text()) if path.exists() else {}, args.seq)
        result["linearity"] = linearity(counts, checks, Constants(**result["constants"]))
        result["checks"] = checks
    elif args.counts and "checks" in source:
        result["checks"] = source["checks"]
        result["linearity"] = linearity(counts, source["checks"], Constants(**result["constants"]))
    text = report(result)
    if result.get("linearity"):
        text += (
            "\n\nThe extrapolation checked at shapes outside the grid (extrapolated / counted):\n\n"
            + linearity_table(result["linearity"])
        )
    print(text)
    if args.top:
        print("\n" + top_ops(counts, args.top))
    # one line: the counts are data for this module (tens of thousands of numbers), the tables are in the docs
    path = Path(args.out) if args.out else RESULTS_DIR / f"{NAME}.json"
    path.write_text(json.dumps(result, separators=(",", ":"), allow_nan=False) + "\n")
    if args.docs:
        write_docs(Path(args.docs), result, text)
    return result


DOCS_BEGIN, DOCS_END = "<!-- cost_model:begin -->", "<!-- cost_model:end -->"


def write_docs(path: Path, result: dict[str, Any], text: str) -> None:
    """Replace what ``path`` holds between :data:`DOCS_BEGIN` and :data:`DOCS_END` with the tables and where their
    counts come from."""
    doc = path.read_text()
    head, rest = doc.split(DOCS_BEGIN)
    _, tail = rest.split(DOCS_END)
    shape = result["estimate_shape"]
    source = (
        f"Counted on {result['machine']} at {result['commit']} ({result['date']}): `{result['command']}`; estimated at "
        f"{shape['n_layer']} layers, B {shape['batch']} x L {shape['seq']}, {shape['precision']}; priced by "
        "`python -m benchmarks.cost_model --counts benchmarks/results/cost_model.json --docs docs/cost_model.md`."
    )
    path.write_text(f"{head}{DOCS_BEGIN}\n{source}\n\n{text}\n{DOCS_END}{tail}")


if __name__ == "__main__":
    main()
