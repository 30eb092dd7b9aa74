"""Writes ``docs/instability.md`` and ``docs/instability/*.png`` from the suite's results and traces.

``python -m benchmarks.instability.report [--out DIR]`` reads ``DIR/results.json`` and ``DIR/runs/*.json``
(default ``benchmarks/results/instability``); ``python -m benchmarks.instability --report`` calls it after a run.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import markdown_table
from benchmarks.instability.analysis import SIGNALS
from benchmarks.instability.cases import HELD_OUT_SEEDS, TRAIN_SEEDS, mechanisms
from benchmarks.instability.evaluate import _fmt, _is_control, lead_cell, mechanism_rows, signals_table

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "instability.md"
FIG_DIR = ROOT / "docs" / "instability"
# per mechanism: the monitor signal its plot shows under the loss
PLOT_SIGNAL = {
    "attn_logit": "softmax_jac_min",
    "logit_div": "outer_VV",
    "rewarm": "outer_VV",
    "postln_depth": "outer_VV",
    "ln_collapse": "ln_var_ratio",
}


def _plot_mechanism(name: str, traces: Sequence[Mapping[str, Any]], results: Mapping[str, Any], path: Path) -> bool:
    """Loss, max attention logit and one monitor signal of seed 0's runs, onsets and first alarms marked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError:
        return False
    runs = [t for t in traces if t["label"]["mechanism"] == name and t["label"]["seed"] == min(TRAIN_SEEDS)]
    if not runs:
        return False
    signal = SIGNALS[PLOT_SIGNAL.get(name, "outer_VV")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2), dpi=72)
    colors = {"unstable": "tab:red", "control": "tab:blue"}
    for t in runs:
        lab = t["label"]
        key = f"{lab['mechanism']}/{lab['variant']}/s{lab['seed']}"
        color = colors.get(lab["variant"], "tab:gray")
        steps = t["steps"]
        axes[0].plot(steps, t["series"]["loss"], color=color, lw=0.8, label=lab["variant"])
        axes[1].semilogy(steps, t["series"]["max_attn_logit"], color=color, lw=0.8)
        values = signal.read(t)
        axes[2].semilogy(sorted(values), [max(values[s], 1e-30) for s in sorted(values)], color=color, lw=0.8)
        onset = results["runs"][key]["onset"]
        first = results["rules"]["suite"]["per_run"][key]["first_alarm"]
        for ax in axes:
            if onset is not None:
                ax.axvline(onset, color=color, ls="--", lw=0.8)
            if first is not None:
                ax.axvline(first, color=color, ls=":", lw=1.2)
    axes[0].set_title("loss (dashed: onset, dotted: first alarm)", fontsize=7)
    axes[1].set_title("max attention logit (baseline)", fontsize=8)
    axes[2].set_title(f"{signal.name}: {signal.description}", fontsize=7)
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(name, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _runs_table(results: Mapping[str, Any]) -> str:
    header = ["mechanism", "variant", "onset per seed", "steps", "wall s (median)", "terms eval / train step",
              "full eval / train step"]  # fmt: skip
    rows = []
    for mech, variants in mechanism_rows(results).items():
        for variant, keys in variants.items():
            rs = [results["runs"][k] for k in keys]
            med = lambda xs: _fmt(sorted(x for x in xs if x is not None)[len(xs) // 2] if xs else None)
            rows.append([
                mech, variant, " / ".join(_fmt(r["onset"]) for r in rs), " / ".join(str(r["steps"]) for r in rs),
                med([r["wall_s"] for r in rs]), med([r["terms_cost_steps"] for r in rs]),
                med([r["full_cost_steps"] for r in rs]),
            ])  # fmt: skip
    return markdown_table(header, rows)


def _compare_table(results: Mapping[str, Any]) -> str:
    runs = results["runs"]
    header = ["mechanism", "onset per seed", "lead per seed", "first alarm kind", "FA/1000 ctrl"]
    rows = []
    for mech, variants in mechanism_rows(results).items():
        unstable = variants.get("unstable", [])
        ctrl = [k for v, ks in variants.items() if v != "unstable" for k in ks if _is_control(runs[k])]
        cells = [mech, " / ".join(_fmt(runs[k]["onset"]) for k in unstable)]
        rule = results["rules"]["suite"]
        fa = max((rule["per_run"][k]["per_1000"] for k in ctrl), default=None)
        cells.append(lead_cell(rule["per_run"], runs, unstable))
        first = [f"{f[1]} ({f[2]})" if f else "-" for f in (rule["first"][k] for k in unstable)]
        cells.append(", ".join(f"{x} x{first.count(x)}" for x in dict.fromkeys(first)))
        cells.append(_fmt(fa))
        rows.append(cells)
    return markdown_table(header, rows)


def _head_section(head: Mapping[str, Any] | None) -> list[str]:
    """The LM head measured as a signal for ``logit_div`` (``python -m benchmarks.instability.lm_head``), if run."""
    if not head:
        return []
    keys = [k for k in head["runs"] if k.startswith("logit_div/unstable/")]
    rows = []
    shown = ("head_sharpness/level", "head_adam_sharpness/level", "head_adam_ratio/eos", "head_x_spec/level",
             "head_lse_mean/level", "head_entropy_min/level", "grad_norm/level", "max_out_logit/level")  # fmt: skip
    for name in shown:
        sig = head["signals"].get(name)
        if sig is None:
            continue
        base = name.split("/")[0].removeprefix("head_")
        cost = head.get("cost_steps", {}).get(base)
        rows.append([f"`{name}`", " / ".join(_fmt(sig["per_run"][k]["lead"]) if sig["per_run"][k]["lead"] is not None
                                             else "miss" for k in sorted(keys)),  # fmt: skip
                     _fmt(sig["false_alarms"]["train"]["per_1000"]), _fmt(sig["false_alarms"]["held_out"]["per_1000"]),
                     "-" if cost is None else _fmt(cost)])  # fmt: skip
    return [
        "## The LM head, measured",
        "",
        "Is the output-logit divergence visible in the LM head? `python -m benchmarks.instability.lm_head train` then",
        "`score` re-trains the runs (bit-identical losses, monitor off) with a recorder on the head `nn.Linear`: the",
        "exact Hessian of the mean cross-entropy in the head weight, `(1/N) sum_t (diag p_t - p_t p_tᵀ) ⊗ x_t x_tᵀ`",
        "(its largest eigenvalue by 8 warm-started Lanczos steps; checked against `torch.func` in",
        "`tests/test_instability_lm_head.py`), its Adam-preconditioned version and edge-of-stability ratio",
        "(`eos`: the raw ratio above 1 from step 100, nothing fitted), the head input's norms, `‖W‖`, `log Z`, the",
        "softmax saturation; scored with the generic detector above (theta fitted on the same training controls).",
        "Leads on `logit_div` per seed, false alarms per 1000 steps, cost in training steps:",
        "",
        markdown_table(["signal", "logit_div lead per seed", "FA/1000 train", "FA/1000 held-out", "cost / step"], rows),
        "",
        "No head quantity leads by 30 steps on every seed: the head's curvature *falls* while `‖W‖` grows and",
        "everything moves with the loss in the last 10-25 steps. The raw Adam ratio crossing 1 comes closest",
        "but misses 30 steps on two seeds (the held-out one included) and fires on the z-loss run that diverges",
        "just after the horizon. So an LM-head block kind would not give this mechanism a useful warning here.",
        "",
    ]


def _cadence_table(results: Mapping[str, Any]) -> str:
    runs = results["runs"]
    header = ["terms-only every", "overhead (this model)", "FA/1000 train ctrl", "FA/1000 held-out ctrl",
              *[m for m in mechanism_rows(results)]]  # fmt: skip
    rows = []
    for every, c in results["cadence"].items():
        cells = [every, _fmt(c["overhead"]), _fmt(c["false_alarms"]["train"]["per_1000"]),
                 _fmt(c["false_alarms"]["held_out"]["per_1000"])]  # fmt: skip
        for _, variants in mechanism_rows(results).items():
            cells.append(lead_cell(c["per_run"], runs, variants.get("unstable", [])))
        rows.append(cells)
    return markdown_table(header, rows)


# rule quantity -> (RuleSet default, how the calibration statistic relates to it)
_THRESHOLDS = {
    "saturation": ("saturation_level", "-log10 of the geometric-mean softmax-Jacobian level"),
    "logit": ("logit_growth", "decades per window_steps"),
    "outer_VV": ("outer_vv_growth", "decades per window_steps"),
    "W2W2": ("w2w2_growth", "decades per window_steps (off by default)"),
    "ln_ratio_min": ("collapse_ratio", "-log10 of the smallest var_min / eps"),
}


def _thresholds_table(results: Mapping[str, Any]) -> str:
    from curvwatch.rules import RuleSet

    rules = RuleSet()
    default = {
        "saturation": -math.log10(rules.saturation_level),
        "logit": rules.thresholds["logit"],
        "outer_VV": rules.thresholds["outer_VV"],
        "W2W2": rules.thresholds["W2W2"],
        "ln_ratio_min": -math.log10(rules.collapse_ratio),
    }
    cal = results["calibration"]
    header = ["quantity", "default", "statistic", "worst training control (every 1 / 10)",
              "worst held-out control (every 1 / 10)", "unstable training runs, smallest (every 1)"]  # fmt: skip
    rows = []
    for q, (name, what) in _THRESHOLDS.items():
        cells = [q, f"`{name}` -> {default[q]:.2f}", what]
        for split in ("train", "held_out"):
            vals = [cal[split].get(c, {}).get("controls", {}).get(q) for c in ("1", "10")]
            cells.append(" / ".join("-" if v is None else f"{v[0]:.2f} ({v[1]})" for v in vals))
        unstable = cal["train"].get("1", {}).get("unstable", {}).get(q, [])
        cells.append(" ".join(f"{v:.2f}" for v, _ in unstable[:3]) + (" ..." if len(unstable) > 3 else ""))
        rows.append(cells)
    return markdown_table(header, rows)


def render(results: Mapping[str, Any], figures: Sequence[str], head: Mapping[str, Any] | None = None) -> str:
    """The markdown of ``docs/instability.md`` (``head``: the LM-head scores of ``benchmarks.instability.lm_head``)."""
    mechs = {m.name: m for m in mechanisms(results.get("quick", False))}
    mech_rows = [
        [f"`{m.name}`", m.variants[0].config.model.arch, m.title, m.knob,
         ", ".join(v.name for v in m.variants[1:])]
        for m in mechs.values()
    ]  # fmt: skip
    fa = results["rules"]
    wall = results.get("wall_s")
    parts = [
        "# Instability suite: do the warnings predict divergences?",
        "",
        "<!-- generated by `python -m benchmarks.instability.report`; edit benchmarks/instability/report.py -->",
        "",
        "Small byte-level causal LMs trained on the Python standard library's own sources (every top-level `*.py`",
        "of `sysconfig.get_paths()['stdlib']`, sorted, first 2 MB; nothing downloaded, nothing written here) are",
        "pushed into reproducible instabilities, each next to a stable control that differs in one knob, on "
        f"seeds {', '.join(map(str, TRAIN_SEEDS))} (threshold fitting) and {', '.join(map(str, HELD_OUT_SEEDS))} "
        "(held out).",
        "Every run records per step the loss, the gradient norm, the largest attention logit `max |q.k|/sqrt(d_K)`",
        "(forward hook), the output logits, and everything the `CurvatureMonitor` logs with",
        "`terms_every_n_train_steps=1` and a full evaluation every 10 steps (`max_overhead=None`).",
        "",
        "```bash",
        "python -m benchmarks.instability            # the suite: every run, results.json, tables on stdout",
        "python -m benchmarks.instability --quick    # two small mechanisms, one seed: the CI smoke run",
        "python -m benchmarks.instability.report     # this page and its plots, from stored results",
        "python -m benchmarks.instability.cost       # what a default terms-only evaluation costs on these models",
        "```",
        "",
        f"Last full run: {len(results['runs'])} runs, {_fmt(results.get('train_wall_s'))} s of training wall time "
        f"(scoring {_fmt(wall)} s) on {results.get('environment', {}).get('processor', '?')} "
        f"({results.get('environment', {}).get('cpu_count', '?')} CPUs shared with other jobs; each run trains on "
        "one thread, and runs split over processes with `--only` share the CPUs, so wall times are noisy); results "
        "in `benchmarks/results/instability/` (`results.json`, one trace per run in `runs/`).",
        "",
        "## Mechanisms",
        "",
        markdown_table(["mechanism", "arch", "what goes wrong", "control knob", "other variants"], mech_rows),
        "",
        "Details and sizes: `benchmarks/instability/cases.py`. `gpt` is `curvwatch.models.gpt.GPT`; `torch` a",
        "stack of `nn.TransformerEncoderLayer` under a causal mask. A LLaMA-style model plugs in through",
        "`benchmarks/instability/models.py` (`ARCHITECTURES`).",
        "",
        "**Onset.** The first step from which the trailing 10-step mean of the loss stays more than 0.5 nats",
        "above its running minimum for 20 consecutive steps, or the first non-finite loss. A run stops 25 steps",
        "after it. **Lead** = onset - first alarm (negative: the first alarm came late; `miss`: none).",
        "**False alarms** are alarms per 1000 steps on runs that stayed stable (controls, and variants without",
        "onset); on unstable runs alarms before the onset count as the lead, not as false.",
        "",
        "## Runs",
        "",
        _runs_table(results),
        "",
        "`terms eval / train step`: the median time of one terms-only evaluation over the median training step",
        "of the same run (the monitor's cost at `terms_every_n_train_steps=1`); `full eval`: the same for a full",
        "evaluation. These models are tiny (d = 64): on larger models a terms-only evaluation is a much smaller",
        "fraction of a step (`docs/performance.md`).",
        "",
        "## The warning rules",
        "",
        "`curvwatch.rules.RuleSet()` at its defaults, replayed on the traces as the monitor feeds it. Cells: one",
        f"value per seed ({', '.join(map(str, TRAIN_SEEDS + HELD_OUT_SEEDS))}; the last is held out).",
        "",
        _compare_table(results),
        "",
        f"False alarms over all controls: {_fmt(fa['suite']['false_alarms']['train']['per_1000'])} (training seeds)"
        f" / {_fmt(fa['suite']['false_alarms']['held_out']['per_1000'])} (held out) per 1000 steps.",
        "",
        "## How the defaults were fixed",
        "",
        "`python -m benchmarks.instability.calibrate` replays each rule's own statistic on the stable runs of the",
        "training seeds and prints the worst value (before any onset); every default of `RuleSet` sits above it.",
        "The held-out seed's controls were read only afterwards. (A statistic of an unstable run may stay low: it",
        "only has to be high for the mechanism that rule is for; `ln_ratio_min` and the drop rule are for the",
        "collapse, scored apart.)",
        "",
        _thresholds_table(results),
        "",
        "## What the new rules need, and what that costs",
        "",
        "The rules read only terms-only numbers. Replayed with terms-only evaluations every N steps and no full",
        "evaluation at all (overhead = terms-only evaluation time / (N x training step), measured on these models in",
        "their traces, which record every bound term, `terms_keys=\"all\"`). `auto` is the default,",
        "`terms_every_n_train_steps=\"auto\"`: every 10 steps while the terms-only seconds stay within 4% of training,",
        "i.e. for each run the multiple of 10 that the cost of a default (`terms_keys=\"warnings\"`) terms-only",
        "evaluation of its model allows (measured by `python -m benchmarks.instability.cost`; a model not measured",
        "there is priced by its trace's own `\"all\"` cost); its overhead column is that cost"
        + (f" (median: every {_fmt(results['cadence']['auto'].get('every'))} steps on these tiny models)"
           if "auto" in results["cadence"] else "") + ":",  # fmt: skip
        "",
        _cadence_table(results),
        "",
        "## Every signal, one generic detector",
        "",
        "Each signal (reduced over blocks and heads: max of growth signals, min of saturation signals) goes",
        "through the same detector: the trailing 10-step median of `log10(signal)` moves more than `theta`",
        "decades in the bad direction, above its running minimum since step 20 (`level`) or above its own value",
        "50 steps earlier (`trend`). `theta` is the smallest value silent on every *training-seed* control, plus",
        "0.05; the table gives the median lead over seeds per mechanism (negative: late, `-`: no alarm) and the",
        "false-alarm rates on training and held-out controls. Gradient norm, max attention logit and max output",
        "logit are the non-monitor baselines.",
        "",
        signals_table(results),
        "",
        *_head_section(head),
    ]
    if figures:
        parts += ["## Plots (seed 0)", ""]
        parts += [f"![{Path(f).stem}](instability/{Path(f).name})" for f in figures]
        parts.append("")
    parts += _findings(results)
    return "\n".join(parts) + "\n"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _cost_text() -> str:
    """The measured cost of a default terms-only evaluation on the suite's models (``cost.json``)."""
    from benchmarks.instability.cost import COST_PATH

    if not COST_PATH.exists():
        return "not measured here (run `python -m benchmarks.instability.cost`)"
    models = json.loads(COST_PATH.read_text())["models"]
    warn = [m["warnings"]["terms_cost_steps"] for m in models]
    ratio = [m["ratio_all_over_warnings"] for m in models]
    return (f"{min(warn):.2f}-{max(warn):.2f} training steps of the same models, {min(ratio):.1f}-{max(ratio):.1f}x"
            " less")


def _leads(results: Mapping[str, Any], label: str, mech: str) -> str:
    keys = mechanism_rows(results)[mech].get("unstable", [])
    rule = results["rules"][label] if label in results["rules"] else results["cadence"][label]
    return lead_cell(rule["per_run"], results["runs"], keys)


def _onsets(results: Mapping[str, Any], mech: str) -> str:
    """The unstable runs' onsets per seed, ``-`` for none."""
    keys = mechanism_rows(results).get(mech, {}).get("unstable", [])
    return " / ".join(_fmt(results["runs"][k]["onset"]) for k in keys)


def _first_steps(results: Mapping[str, Any], label: str, mech: str) -> str:
    keys = mechanism_rows(results)[mech].get("unstable", [])
    return " / ".join(_fmt(results["rules"][label]["per_run"][k]["first_alarm"]) for k in keys)


def _findings(results: Mapping[str, Any]) -> list[str]:
    """What the tables say, in words (numbers filled in from the results)."""
    mechs = mechanism_rows(results)
    if not {"attn_logit", "logit_div", "rewarm", "postln_depth", "ln_collapse"} <= set(mechs):
        return []
    runs = results["runs"]
    fa = results["rules"]
    z = [runs[k]["onset"] for k in mechs["logit_div"].get("z_loss", [])]
    plain = [runs[k]["onset"] for k in mechs["logit_div"]["unstable"]]
    return [
        "## What the suite shows",
        "",
        "* **Attention saturation is the earliest sign of attention-logit growth.** In every `attn_logit` run one",
        "  head of layer 0 went one-hot for every query (softmax-Jacobian norm below 1e-2, where healthy heads sit",
        "  near 0.5 and no stable run's level fell below 0.2) well before the loss moved: leads "
        f"{_leads(results, 'suite', 'attn_logit')} steps. The max attention logit (Wortsman et al. 2023) grows",
        "  by decades in the lower-learning-rate control too (to ~8e3 at the end of its ramp), so its level does",
        "  not separate the runs; its trend does, later (signal table).",
        "* **Re-warming and post-LN: the smooth exact norms lead.** The attention-logit bound and the exact value",
        "  curvature `outer/VV` of one block rise by more than 1.1 and 1.5 decades per 50 steps, which no stable",
        f"  run did: leads {_leads(results, 'suite', 'rewarm')} (re-warm) and "
        f"{_leads(results, 'suite', 'postln_depth')}",
        "  (post-LN); on the LLaMA-style re-warm "
        f"{_leads(results, 'suite', 'rewarm_llama')} (onsets {_onsets(results, 'rewarm_llama')}; the re-warm",
        "  starts at step 200, so the earliest onset leaves little to lead).",
        "  Per block beats model-wide: the generic detector on the maximum over blocks is late on",
        "  post-LN, because the largest block is not the one that grows.",
        "* **Output-logit divergence without a final LayerNorm is invisible to every monitored block.** The",
        "  blow-up happens in the LM head, which no block covers; every monitor signal, the gradient norm and the",
        f"  max output logit come late (new rules: {_leads(results, 'suite', 'logit_div')}). z-loss 1e-3, the",
        "  suggested control, did not prevent it in float32 (onsets "
        f"{' / '.join(_fmt(x) for x in z)} with z-loss, {' / '.join(_fmt(x) for x in plain)} without); a",
        "  LayerNorm before the head did (the control). The LM head itself was measured too (its exact curvature,",
        "  the Adam edge-of-stability ratio, `log Z`, ...: section \"The LM head, measured\"): just as late.",
        "* **LayerNorm collapse is caught, and announced, but did not diverge.** With the embeddings under weight",
        "  decay 1000 the first LayerNorm's `var_min / eps` fell from 40 to about 1e-3; `ln_variance_drop` fired",
        f"  at steps {_first_steps(results, 'suite', 'ln_collapse')} and `ln_collapse` (3 evaluations' patience)",
        "  about 10 steps after that, never on a control. The loss did not diverge: AdamW normalises the",
        "  1/sqrt(var + eps) growth of the gradients (the gradient norm ended ~100x above the control's), and the",
        "  loss ended only 0.02-0.06 nats above the control's (other optimizers were not tried).",
        f"* **No false alarms.** The rules raised {_fmt(fa['suite']['false_alarms']['train']['per_1000'])} / "
        f"{_fmt(fa['suite']['false_alarms']['held_out']['per_1000'])} false alarms per 1000 steps of the stable "
        "runs (training / held-out seeds).",
        "* **Cost.** The new rules read terms-only numbers only. At one terms-only evaluation every 10 steps every",
        "  mechanism that some signal can lead keeps a lead of 30 steps or more (attention "
        f"{_leads(results, '10', 'attn_logit')}, re-warm {_leads(results, '10', 'rewarm')}, post-LN "
        f"{_leads(results, '10', 'postln_depth')}); at every 25 steps the post-LN warning comes late. The suite's",
        "  traces record every bound term (`terms_keys=\"all\"`: ~1.2 training steps of these d = 64 models per",
        "  evaluation); the default computes only what the rules read (`terms_keys=\"warnings\"`, the same numbers,",
        f"  tested equal): {_cost_text()}, measured side by side (`python -m benchmarks.instability.cost`). The",
        "  default (`terms_every_n_train_steps=\"auto\"`) runs them every 10 steps within 4% of training, which on",
        f"  these tiny models is every {_fmt(results['cadence'].get('auto', {}).get('every'))} steps (the `auto` row,",
        f"  {_pct(results['cadence'].get('auto', {}).get('overhead'))} of training): attention "
        f"{_leads(results, 'auto', 'attn_logit')}, LLaMA attention {_leads(results, 'auto', 'attn_logit_llama')},",
        f"  re-warm {_leads(results, 'auto', 'rewarm')}, post-LN {_leads(results, 'auto', 'postln_depth')}. On",
        "  larger models a terms-only evaluation costs a smaller share of a step and every 10 steps costs less than",
        "  the budget (`docs/performance.md`).",
        "",
        "## Limits",
        "",
        "* Tiny models (d = 64, 2-6 layers, L = 64), float32 on CPU, a few hundred steps: bf16 effects, long",
        "  runs and large models are not covered. Most stressors are learning-rate ramps; a sudden jump gives no",
        "  rule anything to lead.",
        "* `attn_saturation` assumes healthy heads keep some query soft. Large trained models can have heads that",
        "  attend to the first token from every query (attention sinks); such a head would read as saturated.",
        "  Raise `saturation_level` towards 0 (or disable it) if a healthy run warns.",
        "* Three seeds per variant, two for fitting: the margins in the thresholds table are what the held-out",
        "  seed can confirm, no more. The LLaMA-style architecture (litgpt: RMSNorm, SwiGLU, rotary, GQA) is in three",
        "  mechanisms (`attn_logit_llama`, `rewarm_llama`, `ln_collapse_llama`; the rules were fixed before",
        "  `rewarm_llama` was added, so all three of its seeds are held out for them); its logit divergence and",
        "  post-LN depth are not.",
        "",
    ]


def write_report(results: Mapping[str, Any], traces: Sequence[Mapping[str, Any]]) -> Path:
    """Write the page and its plots (with the LM-head scores where they were run); returns the page's path."""
    from benchmarks.instability.lm_head import DEFAULT_OUT as HEAD_OUT

    head_file = HEAD_OUT / "results.json"
    head = json.loads(head_file.read_text()) if head_file.exists() else None
    figures = []
    for name in mechanism_rows(results):
        path = FIG_DIR / f"{name}.png"
        if _plot_mechanism(name, traces, results, path):
            figures.append(str(path))
    DOC.write_text(render(results, figures, head))
    return DOC


def main(argv: list[str] | None = None) -> Path:
    from benchmarks.instability.suite import DEFAULT_OUT

    p = argparse.ArgumentParser(prog="python -m benchmarks.instability.report", description=__doc__)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results folder of the suite")
    args = p.parse_args(argv)
    results = json.loads((args.out / "results.json").read_text())
    traces = [json.loads(p.read_text()) for p in sorted((args.out / "runs").glob("*.json"))]
    path = write_report(results, traces)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
