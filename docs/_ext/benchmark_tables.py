"""Tables of the benchmark result files (``benchmarks/results/*.json``) for the docs' ``benchmark`` directive.

Each renderer reads one result file and returns its tables and one provenance line: the machine, the command, the
commit and the date of the measurement, from the file's ``environment``. A figure on a page is therefore always the
one in the file; re-running the benchmark re-measures it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

Table = tuple[list[str], list[list[str]]]


@dataclass
class Rendered:
    tables: list[Table]
    provenance: str


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def provenance(env: dict[str, Any]) -> str:
    """One line: where, with what, at which commit and when the numbers were measured."""
    machine = env.get("cpu_model") or env.get("processor") or "unknown CPU"
    if env.get("cuda_device"):
        machine = f"{env['cuda_device']} (host: {machine})"
    cpus = f", {env['cpu_count']} CPU cores" if env.get("cpu_count") else ""
    threads = f", {env['torch_threads']} torch thread(s)" if env.get("torch_threads") else ""
    load = env.get("load_average")
    busy = f", load average {load[0]:g} at the start (other jobs shared the machine)" if load and load[0] > 1 else ""
    commit = env.get("commit") or "unknown"
    when = (env.get("timestamp_utc") or "")[:10]
    return (
        f"Measured on {machine}{cpus}{threads}{busy}; torch {env.get('torch', '?')}; "
        f"`{env.get('command', '?')}` at commit `{commit[:12]}{'+dirty' if commit.endswith('+dirty') else ''}`, {when}."
    )


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else (f"{ratio:.0f}×" if ratio >= 10 else f"{ratio:.1f}×")


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def jacobians(data: dict[str, Any]) -> list[Table]:
    names = {"loop": "per-row loop", "vectorize": "`vectorize=True`", "jacrev": "`jacrev`",
             "jacrev_rowwise": "`jacrev` per token (vmap)"}  # fmt: skip
    tables = []
    for size in data["config"]["sizes"]:
        rows = []
        for r in (r for r in data["results"] if r["size"] == size["name"]):
            cells = [r["quantity"], r["form"], f"{r['tokens']} / {r['L']}", _s(r["closed_form_s"])]
            for key in names:
                b = r["baselines"].get(key)
                if b is None or b.get("status") == "skipped":
                    cells.append("-")
                else:
                    cells.append(_x(b.get("ratio")) + (" (extrapolated)" if b["status"] == "extrapolated" else ""))
            rows.append(cells)
        head = f"{size['name']} size: L = {size['L']}, d = {size['d']}, d_ff = {size['d_ff']}"
        tables.append(([head, "form", "tokens", "closed form", *names.values()], rows))
    published = data.get("published", {})
    rows = [[q, _x(v["ratio"])] for q, v in published.items() if isinstance(v, dict)]
    if rows:
        tables.append((["published (P1 slides, CUDA, baseline not named)", "ratio"], rows))
    return tables


def hvp(data: dict[str, Any]) -> list[Table]:
    rows = []
    for r in data["results"]:
        m, agrees = r["methods"], r.get("agrees", {})

        def cell(name: str, m: dict[str, Any] = m, agrees: dict[str, bool] = agrees) -> str:
            if name not in m:
                return "-"
            return f"{_s(m[name]['median_s'])} ({_x(m[name]['ratio'])}){'' if agrees.get(name, True) else ' ✗ off'}"

        counts = r.get("hvp_counts_per_call", {})
        rows.append([r["size"], _s(m["curvwatch"]["median_s"]), cell("hvp_power"), cell("hvp_lanczos"),
                     cell("curvlinops"), " / ".join(str(counts.get(k, "-")) for k in ("hvp_power", "hvp_lanczos")),
                     _s(m.get("curvwatch_hessian_only", {}).get("median_s"))])  # fmt: skip
    header = ["size", "curvwatch", "HVP + power iteration", "HVP + Lanczos", "curvlinops + eigsh",
              "HVPs (power / Lanczos)", "curvwatch, every kind and term"]  # fmt: skip
    tables = [(header, rows)]
    sdpa = data.get("sdpa")
    if sdpa:
        routes = {
            "forward_over_reverse": "`torch.func.jvp(torch.func.grad(loss))`",
            "double_backward": "`torch.autograd.grad(..., create_graph=True)` twice",
            "curvlinops": "curvlinops `HessianLinearOperator @ v`",
            "curvwatch": "curvwatch on the captured `X`",
        }
        srows = []
        for key, label in routes.items():
            res = sdpa.get(key) or {}
            if res.get("ok") is None:
                text = "not run: " + str(res.get("note", "")).split(";")[0]
            elif res.get("ok"):
                text = "works"
            else:
                text = "fails: " + str(res.get("exception", "")).split(" that ")[0]
            srows.append([label, text])
        tables.append(([f"fused SDPA attention ({sdpa.get('sdpa_backward_node', '')})", "result"], srows))
    return tables


def cadence(data: dict[str, Any]) -> list[Table]:
    rows = []
    by = {}
    for r in data["rows"]:
        by.setdefault((r["full_cost"], r["terms_cost"]), {})[r["schedule"]] = r
    for (full, terms), pair in by.items():
        floor, alone = pair["floor"], pair["1% only"]

        def steps(r: dict[str, Any]) -> str:
            s = r["full_steps"]
            return ", ".join(map(str, s[:5])) + (f", ... ({len(s)} in all)" if len(s) > 5 else "")

        rows.append([f"{full:g} / {terms:g}", steps(floor), steps(alone), str(len(floor["terms_steps"])),
                     f"{100 * floor['overhead']:.2f}%"])  # fmt: skip
    steps_total = data["config"]["steps"]
    header = ["full / terms-only evaluation (training steps)", f"full evaluations on {steps_total} steps",
              "with the 1% budget alone", "terms-only evaluations", "overhead, both tiers"]  # fmt: skip
    return [(header, rows)]


def demo_ranges(data: dict[str, Any]) -> list[Table]:
    after = data["config"]["after"]
    rows = []
    for key, v in data["keys"].items():
        if v["min"] is None:
            continue
        span = f"{v['min']:.3g} to {v['max']:.3g}"
        if v.get("at_or_above_1") is not None:
            span += f" (at or above 1 at {v['at_or_above_1']} of {v['evaluations']} evaluations)"
        rows.append([f"`{key}`", span, "-" if v["at_step_0"] is None else f"{v['at_step_0']:.3g}",
                     "-" if v["last"] is None else f"{v['last']:.3g}"])  # fmt: skip
    run = data["run"]
    rows.append(["final exact-match accuracy", f"{100 * run['final_val_acc']:.1f}%", "", ""])
    return [(["key", f"range from step {after} on", "at step 0", "at the end"], rows)]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def overhead(data: dict[str, Any]) -> list[Table]:
    tables = []
    for r in data["results"]:
        rows = []
        d = r.get("defaults")
        if d:
            evals = ", ".join(str(e) for e in d["evaluations"])
            terms = ", ".join(str(e) for e in d["terms_evaluations"])
            spread = ", ".join(_pct(x["overhead"]) for x in d["rounds"])
            own = ", ".join(_pct(x["monitor_overhead_fraction"]) for x in d["rounds"])
            rows.append([f"`CurvatureMonitor()` at its defaults, {d['steps']} steps",
                         f"{_pct(d['overhead'])} (rounds: {spread})",
                         f"{_pct(d['monitor_overhead_fraction'])} (rounds: {own})",
                         f"{evals} full, {terms} terms-only (per round)"])  # fmt: skip
        for c, v in r["cadences"].items():
            if v.get("status") == "derived":
                continue
            steps = v.get("cost_per_eval_steps")
            rows.append([f"a full evaluation every {c} step(s)", _pct(v["overhead"]), "-",
                         "-" if steps is None else f"{steps:.3g} training steps each"])  # fmt: skip
        every_step = "a terms-only evaluation every step"
        for key, label in (("warnings_only_every_step", f'{every_step} (`terms_keys="warnings"`)'),
                           ("terms_only_every_step", f'{every_step} (`terms_keys="all"`)')):  # fmt: skip
            v = r.get(key)
            if v:
                steps = v.get("cost_per_eval_steps")
                rows.append([label, _pct(v["overhead"]), "-",
                             "-" if steps is None else f"{steps:.3g} training steps each"])  # fmt: skip
        name = f"{r['model']} model ({r.get('parameters', 0) / 1e3:.0f}k parameters, batch {r.get('batch_size')})"
        tables.append(([name, "step time added", "monitor / training seconds", "evaluations"], rows))
    return tables


RENDERERS: dict[str, Callable[[dict[str, Any]], list[Table]]] = {
    "bench_jacobians": jacobians,
    "bench_hvp": hvp,
    "bench_cadence": cadence,
    "demo_ranges": demo_ranges,
    "bench_overhead": overhead,
}


def render(name: str, view: str = "default") -> Rendered:
    if name not in RENDERERS:
        raise KeyError(f"no renderer for {name} (docs/_ext/benchmark_tables.py)")
    data = load(name)
    return Rendered(RENDERERS[name](data), provenance(data["environment"]))
