"""Text reports: the run summary (:meth:`CurvatureMonitor.summary_text`) and the set-up table of monitored blocks.

Pure functions from plain numbers and specs to text; nothing here sees a ``Trainer`` or a logger.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch  # noqa: F401  (used by the doctests)

from curvwatch.adapters import BlockSpec
from curvwatch.adapters.projections import UnsupportedWrapperError, weights_note
from curvwatch.alerts import Alert

__all__ = ["coverage_rows", "coverage_text", "evaluation_notices", "progress_line", "summary_text", "weight_notes"]


def summary_text(
    *,
    evaluations: int,
    terms_evaluations: int | None,
    skipped: int,
    last_step: int,
    fired: int,
    last_norms: Mapping[str, float],
    last_summary: Mapping[str, float],
    peak: Mapping[str, Any],
    history: Sequence[Alert],
    errors: Sequence[str],
    max_iter: int,
    tol: float,
    top: int = 5,
) -> str:
    """A readable multi-line summary of a run: most curved blocks, heterogeneity, warnings, skipped evaluations.

    Args:
        evaluations, terms_evaluations, skipped: Counters (``terms_evaluations`` None: the tier is off).
        last_step: The last step evaluated (``-1``: never).
        fired: Warnings fired so far.
        last_norms: ``{block: norm}`` of the last full evaluation.
        last_summary: Its summaries (``summary/...``).
        peak: ``{"value", "block", "step"}`` of the largest block norm so far, or empty.
        history: The fired alerts (most recent last).
        errors: Why evaluations were skipped (most recent last).
        max_iter, tol: The Lanczos settings (for the convergence line).
        top: How many of the most curved blocks to list.

    Example:
        >>> print(summary_text(evaluations=1, terms_evaluations=None, skipped=0, last_step=0, fired=0,
        ...                    last_norms={"layer0/attn": 2.0}, last_summary={}, peak={}, history=[], errors=[],
        ...                    max_iter=60, tol=1e-2))
        CurvatureMonitor: 1 evaluation(s) (last at step 0), 0 skipped, 0 warning(s)
        Most curved blocks at the last evaluation (largest Hessian spectral norm):
          layer0/attn  2.000e+00
    """
    last = "never" if last_step < 0 else f"last at step {last_step}"
    terms = f", {terms_evaluations} terms-only" if terms_evaluations is not None else ""
    lines = [f"CurvatureMonitor: {evaluations} evaluation(s){terms} ({last}), {skipped} skipped, {fired} warning(s)"]
    if last_norms:
        lines.append("Most curved blocks at the last evaluation (largest Hessian spectral norm):")
        ranked = sorted(last_norms.items(), key=lambda kv: -kv[1])[:top]
        width = max(len(name) for name, _ in ranked)
        lines += [f"  {name:<{width}}  {norm:.3e}" for name, norm in ranked]
    s = last_summary
    if "summary/heterogeneity/model" in s:
        per_layer = ", ".join(
            f"{k.rsplit('/', 1)[-1]} {v:.2f}" for k, v in s.items() if k.startswith("summary/heterogeneity/layer")
        )
        lines.append(
            f"Heterogeneity (log10 max/min of block norms): model {s['summary/heterogeneity/model']:.2f}"
            + (f"; {per_layer}" if per_layer else "")
        )
    extras = [
        (label, s[key])
        for label, key in (
            ("V/Q ratio median", "summary/vv_qq_ratio/median"),
            ("functional/outer max", "summary/functional_outer/max"),
            ("LayerNorm var_min/eps min", "summary/ln/var_min_over_eps"),
        )
        if key in s
    ]
    if extras:
        lines.append("   ".join(f"{label}: {value:.3g}" for label, value in extras))
    if s.get("summary/lanczos/unconverged", 0) > 0:
        lines.append(
            f"Lanczos: {s['summary/lanczos/unconverged']:.0f} of {s['summary/lanczos/norms']:.0f} norms stopped "
            f"at max_iter={max_iter} above tol={tol:g} (worst relative residual "
            f"{s['summary/lanczos/rel_residual_max']:.2g})"
        )
    if peak:
        lines.append(f"Peak so far: {peak['value']:.3e} in {peak['block']} at step {peak['step']}")
    if history:
        lines.append("Warnings fired:")
        lines += [
            f"  step {a.step}: {a.kind} in {a.block} ({a.value:.3g}, threshold {a.threshold:.3g})"
            for a in history[-10:]
        ]
    if errors:
        lines.append("Skipped evaluations:")
        lines += [f"  {e}" for e in errors[-5:]]
    return "\n".join(lines)


def part_name(spec: BlockSpec) -> str:
    """The ``part`` column of a block's row: its name without the layer (``"attn"`` of ``"layer0/attn"``)."""
    return spec.name.split("/", 1)[-1]


def weight_notes(specs: Sequence[BlockSpec]) -> dict[str, str]:
    """``{block: status}`` of the blocks whose weights are not plain parameters, from one read of each block's
    structure (:func:`~curvwatch.adapters.projections.weights_note`): ``"monitored (base + LoRA r=4 on q_proj, v_proj;
    merged view)"`` for a block with adapters, ``"not monitored: <why>"`` for one whose wrapper is not understood.

    Example:
        >>> from curvwatch.adapters import find_blocks
        >>> weight_notes(find_blocks(torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)))
        {}
    """
    out = {}
    for s in specs:
        owner = s.layer_module if s.layer_module is not None else s.module
        names = {id(m): name for name, m in owner.named_modules()}
        try:
            note = weights_note(s.adapter.read_params, s, names)
        except UnsupportedWrapperError as err:
            out[s.name] = f"not monitored: {err}"
            continue
        if note is not None:
            out[s.name] = f"monitored ({note})"
    return out


def coverage_rows(
    specs: Sequence[BlockSpec], model: torch.nn.Module | None = None, notes: Mapping[str, str] | None = None
) -> list[dict[str, str]]:
    """One row per block and per part no block covers: ``{"layer", "part", "kind", "status"}``.

    The parts left out come from each layer's adapter (:meth:`~curvwatch.adapters.Adapter.unmonitored`), asked once
    per layer module, and, with ``model``, from the modules with parameters outside every monitored layer
    (embeddings, final norm, output head: layer ``"-"``).

    Args:
        specs: The blocks.
        model: The model, to name what lies outside the layers.
        notes: ``{block: status}`` for blocks whose status is not plain ``"monitored"`` (:func:`weight_notes`).

    Example:
        >>> from curvwatch.adapters import find_blocks
        >>> rows = coverage_rows(find_blocks(torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)))
        >>> [(r["part"], r["status"]) for r in rows][:2]
        [('attn', 'monitored'), ('ln_1', 'monitored')]
    """
    notes = notes or {}
    rows = [
        {"layer": str(s.layer), "part": part_name(s), "kind": s.kind, "status": notes.get(s.name, "monitored")}
        for s in specs
    ]
    layers = {id(s.layer_module): s for s in specs if s.layer_module is not None}
    for s in layers.values():
        for part, why in s.adapter.unmonitored(s.layer_module):
            rows.append({"layer": str(s.layer), "part": part, "kind": "-", "status": f"not monitored: {why}"})
    rows.sort(key=lambda r: int(r["layer"]))
    if model is not None:
        inside = {id(m) for layer in layers.values() for m in layer.layer_module.modules()}
        inside |= {id(m) for s in specs for m in s.module.modules()}
        outside = [
            name
            for name, m in model.named_modules()
            if id(m) not in inside and any(True for _ in m.parameters(recurse=False))
        ]
        if outside:
            why = "outside the Transformer layers (embeddings, final norm, output head): not modelled"
            rows.append({"layer": "-", "part": ", ".join(outside), "kind": "-", "status": f"not monitored: {why}"})
    return rows


def sharpness_row(status: str) -> dict[str, str]:
    """The set-up table's row of the real-loss keys (``sharpness/...``, ``stability/...``): on or off and why
    (:meth:`curvwatch.realloss.RealLoss.resolve`'s status, which says when ``stability/...`` starts).

    Example:
        >>> sharpness_row("off (sharpness=False)")
        {'layer': '-', 'part': 'sharpness', 'kind': 'real loss', 'status': 'off (sharpness=False)'}
    """
    return {"layer": "-", "part": "sharpness", "kind": "real loss", "status": status}


def coverage_text(rows: Sequence[Mapping[str, str]]) -> str:
    """The rows of :func:`coverage_rows` as an aligned text table.

    Example:
        >>> print(coverage_text([{"layer": "0", "part": "attn", "kind": "attention", "status": "monitored"}]))
        layer  part  kind       status
        0      attn  attention  monitored
    """
    cols = ("layer", "part", "kind", "status")
    widths = [max(len(c), *(len(r[c]) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    lines += ["  ".join(r[c].ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def evaluation_notices(
    step: int,
    excluded: Mapping[str, str],
    failed: Mapping[str, BaseException],
    warm_results: Mapping[str, Mapping[str, Any]],
    tol: float,
    max_iter: int,
    prefix: str,
) -> list[tuple[str, str]]:
    """``(key, message)`` of the one-time notices about one evaluation: blocks left out, blocks whose closed form
    failed, Lanczos norms that stayed unconverged although warm-started (``warm_results``: the blocks that were not
    cold-started). The caller warns once per key.

    Example:
        >>> notices = evaluation_notices(3, {"layer0/ffn": "no gradient arrived"}, {}, {}, 1e-2, 40, "curv/")
        >>> notices[0]
        ('layer0/ffn', "CurvatureMonitor leaves block 'layer0/ffn' out: no gradient arrived.")
    """
    from curvwatch import metrics as M

    out = [(name, f"CurvatureMonitor leaves block '{name}' out: {reason}.") for name, reason in excluded.items()]
    for name, error in failed.items():
        out.append((
            f"failed:{name}",
            f"CurvatureMonitor leaves block '{name}' out of the evaluation at step {step} (and of later ones where "
            f"it fails again, without further warnings): its closed form raised {type(error).__name__}: {error}. "
            "The other blocks are logged; pass on_error='raise' to get the traceback, or blocks=[...] to leave the "
            "block out.",
        ))  # fmt: skip
    # a cold start (first evaluation of a block, or after a resume) may need more than max_iter steps once; the
    # notice is about norms that stay unconverged although Lanczos started from the last Ritz vectors
    accuracy = M.lanczos_accuracy(warm_results, tol)
    if accuracy.get("summary/lanczos/unconverged", 0) > 0:
        worst = {b: max(M.residuals(r).values(), default=0.0) for b, r in warm_results.items()}
        block = max(worst, key=worst.__getitem__)
        n = accuracy["summary/lanczos/unconverged"]
        out.append((
            "lanczos_unconverged",
            f"CurvatureMonitor: at step {step}, {n:.0f} of {accuracy['summary/lanczos/norms']:.0f} warm-started "
            f"Lanczos norms stopped at max_iter={max_iter} before reaching tol={tol:g} (worst relative "
            f"residual {worst[block]:.2g}, in '{block}'); such a norm may read low by up to about that fraction "
            f"(usually far less). {prefix}summary/lanczos/unconverged and {prefix}<block>/lanczos/rel_residual_max "
            "track it. Raise it (evaluation=curvwatch.Evaluation(max_iter=...)) for tighter norms (each step "
            "costs about one more product), or take a larger tol.",
        ))  # fmt: skip
    return out


def progress_line(
    step: int, summary: Mapping[str, float], norms: Mapping[str, float], fired: int, elapsed: float, terms_only: bool
) -> str:
    """The one line ``verbose=True`` prints per evaluation.

    Example:
        >>> summary = {"summary/max_hessian": 2.0, "summary/heterogeneity/model": 0.5}
        >>> progress_line(5, summary, {"a": 2.0}, 0, 0.1, False)
        '[CurvatureMonitor] step 5: max ||H|| 2.000e+00 in a, heterogeneity 0.50 decades, 0 warning(s), 0.10 s'
    """
    if terms_only:
        return (
            f"[CurvatureMonitor] step {step}: terms only, LayerNorm var_min/eps "
            f"{summary.get('summary/ln/var_min_over_eps', math.nan):.3g}, {fired} warning(s), {elapsed:.3f} s"
        )
    where = f" in {max(norms, key=norms.__getitem__)}" if norms else ""
    return (
        f"[CurvatureMonitor] step {step}: max ||H|| {summary.get('summary/max_hessian', math.nan):.3e}{where}, "
        f"heterogeneity {summary.get('summary/heterogeneity/model', math.nan):.2f} decades, "
        f"{fired} warning(s), {elapsed:.2f} s"
    )
