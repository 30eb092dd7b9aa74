"""Keys as data: every key the monitor logs, with its meaning and how it is combined across ranks.

A :class:`KeySpec` is one row: a key *pattern* relative to a block (``hessian/{XY}[/{head}]``) or to the prefix
(``summary/max_hessian``), what it means, and its cross-rank reduction. The block kinds declare the rows of
their kernels' keys (:attr:`curvwatch.kinds.BlockKind.keys`); the rows below are the keys every kind shares and
those the monitor derives. :func:`key_table` assembles the one table, from which ``docs/metrics.md`` is written
(``python -m curvwatch.keys``) and against which a test checks the docs and the callback's docstring.

Pattern placeholders: ``{XY}`` a block pair (``QQ``, ``W1W2``), ``{head}`` a head (``h0``) or a key/value group
(``g0``), ``{i}`` a layer index, ``{part}`` a sub-block's name within its layer (``attn``, ``ffn``), ``{module}`` a
low-rank adapter of the block, named after its projection (``q_proj``; ``qkv_q`` for one part of a fused projection);
``[...]`` is optional.

Log levels (``log_level``, :class:`curvwatch.options.LogLevel`): which keys reach the loggers. ``"summary"`` (the
default): the model-wide keys of :data:`SUMMARY_LEVEL` and the per-layer keys of :data:`LAYER_KEYS`; ``"blocks"``:
also every per-block key that is neither per head nor a bound, term or cross-check (:func:`block_level`) and the
other ``summary/...`` keys; ``"all"``: everything. Summaries, warnings, heatmaps and tables always read the whole
evaluation.

Reductions: ``"mean"`` (norms, ratios and terms: each rank saw its own batch, the mean estimates the global
batch), ``"max"`` / ``"min"`` (quantities that are extremes by definition, which are also those the warnings
watch: the worst rank's), ``"derived"`` (computed after the reduction from reduced numbers: never all-reduced).

Example:
    >>> reduce_op("hessian/QQ/h0"), reduce_op("ln/inv_var_max"), reduce_op("ln/var_min_over_eps")
    ('mean', 'max', 'min')
    >>> spec_of("residual/hessian/QQ/h0").reduce
    'max'
"""

from __future__ import annotations

import functools
import re

__all__ = [
    "BLOCK_KEYS", "LAYER_KEYS", "SUMMARY_KEYS", "SUMMARY_LEVEL", "KeySpec", "block_level", "key_table", "layer_key",
    "markdown", "reduce_op", "spec_of", "summary_level",
]  # fmt: skip

from curvwatch.kinds import KINDS
from curvwatch.names import _HEAD, KeySpec

# per-block categories logged only at log_level="all": bound terms and bounds, and the in-run cross-check
_ALL_ONLY = ("bound", "term", "verify")


#: Per-block keys every kind with Hessian norms shares, and those the monitor derives per block.
BLOCK_KEYS: tuple[KeySpec, ...] = (
    KeySpec("hessian/{XY}[/{head}]", "`‖H(XY)‖`, spectral norm of the pair's block of the loss Hessian"),
    KeySpec("outer/{XY}[/{head}]", "`‖H_o(XY)‖`, its outer (Gauss-Newton) part"),
    KeySpec("functional/{XY}[/{head}]", "`‖H_f(XY)‖`, its functional part"),
    KeySpec(
        "residual/hessian/{XY}[/{head}]",
        "relative Lanczos residual of `hessian/XY` (kernels only; logged as `lanczos/rel_residual_max`)",
        "max",
        logged=False,
    ),
    KeySpec("residual/outer/{XY}[/{head}]", "the same for `outer/XY`", "max", logged=False),
    KeySpec("residual/functional/{XY}[/{head}]", "the same for `functional/XY`", "max", logged=False),
    KeySpec(
        "ggn/{XY}[/{head}]",
        "`λ_max(J_Xᵀ C J_X)` of a diagonal pair: its Gauss-Newton block with the Monte-Carlo output curvature "
        "`C = Σ_b (1/k) Σ_j s_jb s_jbᵀ` of `k` sampled output gradients `s_j` (kernels' `output_samples`), "
        "debiased over the two halves of the samples (`k ≥ 2`)",
    ),
    KeySpec(
        "sharpness/{XY}[/{head}]",
        "largest algebraic eigenvalue (may be negative) of `J_Xᵀ C J_X + H_f(XX)`: the block of the real loss's "
        "Hessian, without the second-order part of the layers downstream of the block; no value where "
        "`sharpness_spread/XY` is above 1 (too uncertain: named once; the same for the `ggn` and `precond_` keys "
        "by their own uncertainty)",
    ),
    KeySpec(
        "precond_ggn/{XY}[/{head}]",
        "`ggn/XY` of `P^{-1/2} (·) P^{-1/2}`, `P` the optimizer's diagonal preconditioner (Adam: `√v̂ + ε`)",
    ),
    KeySpec("precond_sharpness/{XY}[/{head}]", "`sharpness/XY` of `P^{-1/2} (·) P^{-1/2}`"),
    KeySpec(
        "sharpness_spread/{XY}[/{head}]",
        "uncertainty of `sharpness/XY` relative to it: two standard errors of the debiased estimate over the "
        "samples (delta method; with fewer than 4 samples the half-sample estimates' half-difference) plus half the "
        "debiasing correction plus the Lanczos members' error carried through it (`k ≥ 2` samples; none for a zero "
        "sharpness; docs/sharpness.md)",
    ),
    KeySpec(
        "ggn/lora/{module}",
        "`ggn/XY` of the parameters `θ = [vec A, vec B]` of the block's low-rank adapter `s A B` on `{module}` "
        "(LoRA: the optimizer steps `A`, `B`, not the weight): `λ_max(Dᵀ J_Wᵀ C J_W D)`, `D(dA, dB) = s (dA B + A dB)` "
        "into the weights the update writes",
    ),
    KeySpec(
        "sharpness/lora/{module}",
        "`sharpness/XY` of the adapter's parameters: largest algebraic eigenvalue of `Dᵀ (J_Wᵀ C J_W + H_f) D + K`, "
        "`K(dA, dB) = s (G dBᵀ, dAᵀ G)` the curvature of `W = W_0 + s A B` itself with `G = ∂L/∂W` (all the heads "
        "it moves together)",
    ),
    KeySpec(
        "precond_ggn/lora/{module}",
        "`ggn/lora/{module}` of `P^{-1/2} (·) P^{-1/2}`, `P` the optimizer's preconditioner of `A` and `B`",
    ),
    KeySpec("precond_sharpness/lora/{module}", "`sharpness/lora/{module}` of `P^{-1/2} (·) P^{-1/2}`"),
    KeySpec("sharpness_spread/lora/{module}", "uncertainty of `sharpness/lora/{module}`, as `sharpness_spread/XY`"),
    KeySpec("residual/ggn/{XY}[/{head}]", "relative Lanczos residual of `ggn/XY`", "max", logged=False),
    KeySpec("residual/sharpness/{XY}[/{head}]", "the same for `sharpness/XY`", "max", logged=False),
    KeySpec("residual/precond_ggn/{XY}[/{head}]", "the same for `precond_ggn/XY`", "max", logged=False),
    KeySpec("residual/precond_sharpness/{XY}[/{head}]", "the same for `precond_sharpness/XY`", "max", logged=False),
    KeySpec("residual/ggn/lora/{module}", "the same for `ggn/lora/{module}`", "max", logged=False),
    KeySpec("residual/sharpness/lora/{module}", "the same for `sharpness/lora/{module}`", "max", logged=False),
    KeySpec("residual/precond_ggn/lora/{module}", "the same for `precond_ggn/lora/{module}`", "max", logged=False),
    KeySpec(
        "residual/precond_sharpness/lora/{module}",
        "the same for `precond_sharpness/lora/{module}`",
        "max",
        logged=False,
    ),
    KeySpec("hessian/max", "block norm: the largest `hessian/...` of the block", "derived"),
    KeySpec(
        "ratio/functional_outer",
        "`max ‖H_f‖ / max ‖H_o‖` over the pairs and heads: near 0 Gauss-Newton captures the curvature; near or "
        "above 1 the part GGN/K-FAC drop matters",
        "derived",
    ),
    KeySpec(
        "ratio/VV_QQ[/{head}]",
        "`‖H(VV)‖ / ‖H(QQ)‖` of a head; value curvature grows like `‖X‖²`, query like `‖X‖⁶`",
        "derived",
    ),
    KeySpec(
        "lanczos/rel_residual_max",
        "largest relative Lanczos residual of the block's iterative norms (`≤ tol` once converged)",
        "derived",
    ),
    KeySpec(
        "stability/{XY}[/{head}]",
        "real-loss sharpness / the stability threshold of the block's optimizer (SGD: `(2 + 2β)/lr` on "
        "`sharpness/XY`; Adam: `(2 + 2β₁)/((1 − β₁) lr)` on `precond_sharpness/XY`, from the optimizer's first step "
        "on: none at step 0): `≥ 1` is past the edge of stability",
    ),
    KeySpec(
        "stability/lora/{module}",
        "`stability/XY` of the block's low-rank adapter on `{module}`: `sharpness/lora/{module}` (SGD) or "
        "`precond_sharpness/lora/{module}` (Adam/AdamW, `P` from the adapter's own second moments) over the threshold "
        "of its parameter group's learning rate and momentum; an adapted block's only ratios (none for an adapter on "
        "`W_O`, nor under DoRA: named once)",
    ),
    KeySpec("sharpness/max", "largest `sharpness/XY` of the block (not the adapters': other units)", "derived"),
    KeySpec(
        "verify/hessian/{XY}[/{head}]",
        "`verify_every_n_evals`: the true block Hessian's largest eigenvalue (Hessian-vector products of the whole "
        "loss, head 0), the truth `sharpness/XY` approximates",
    ),
    KeySpec("verify/ratio/{XY}[/{head}]", "`verify/hessian/XY / sharpness/XY` (1: the closed-form view is exact)"),
    KeySpec(
        "stability/max",
        "largest `stability/...` of the block, its adapters' included (under Adam/AdamW none at step 0: no optimizer "
        "state)",
        "derived",
    ),
    KeySpec(
        "skipped_nonfinite",
        "1 on evaluations where the block's captured `X`/`grad_output` (or its result) held NaN or Inf: its "
        "numbers are left out",
        "max",
    ),
)

#: Model-wide keys (``summary/...``), computed after the reduction. The kinds add their own (``summary/ln/...``).
SUMMARY_KEYS: tuple[KeySpec, ...] = (
    KeySpec("summary/max_hessian", "largest block norm `‖H‖` over the blocks with Hessian norms (headline)", "derived"),
    KeySpec("summary/max_hessian_layer", "layer index of that block", "derived"),
    KeySpec(
        "summary/max_hessian_block",
        "index of that block in the monitored block list (order of `find_blocks`)",
        "derived",
    ),
    KeySpec(
        "summary/heterogeneity/model",
        "`log10 max − log10 min` of the block norms over the model (headline): orders of magnitude between the "
        "flattest and the most curved block",
        "derived",
    ),
    KeySpec("summary/heterogeneity/layer{i}", "the same within layer `i` (attention vs FFN)", "derived"),
    KeySpec(
        "summary/vv_qq_ratio/median", "median over all attention heads of `‖H(VV)‖ / ‖H(QQ)‖` (headline)", "derived"
    ),
    KeySpec("summary/functional_outer/max", "max over blocks of `ratio/functional_outer`", "derived"),
    KeySpec("summary/functional_outer/median", "median over blocks of `ratio/functional_outer`", "derived"),
    KeySpec("summary/sharpness/max", "largest real-loss `sharpness/...` over the blocks", "derived"),
    KeySpec(
        "summary/stability/max",
        "largest `stability/...` over the blocks, low-rank adapters' included (headline): `≥ 1` means some block is "
        "past the edge of stability for its optimizer and learning rate; under Adam/AdamW none at step 0 (no second "
        "moments before the first step; the set-up table's `sharpness` row says so)",
        "derived",
    ),
    KeySpec("summary/stability/max_layer", "layer index of that block", "derived"),
    KeySpec("summary/stability/max_block", "index of that block in the monitored block list", "derived"),
    KeySpec(
        "summary/eval_time_s",
        "seconds the evaluation took on rank zero (with the sampled backward passes of the real-loss keys; the "
        "capture excluded)",
        "derived",
    ),
    KeySpec(
        "summary/terms_eval_time_s",
        "seconds a terms-only evaluation took on rank zero; on terms-only steps, in place of `summary/eval_time_s`",
        "derived",
    ),
    KeySpec(
        "summary/overhead",
        "the monitor's seconds per training second so far (its evaluations and logging over the wall time without "
        "them): 0.01 is 1% of the training time, above 1 the monitor took longer than the training; `max_overhead` "
        "keeps it at or below its value by skipping due steps",
        "derived",
    ),
    KeySpec("summary/evaluations", "full evaluations so far (this one included)", "derived"),
    KeySpec("summary/terms_evaluations", "terms-only evaluations so far (with `terms_every_n_train_steps`)", "derived"),
    KeySpec(
        "summary/skipped_evaluations",
        'evaluations skipped after an exception (`on_error="warn"`); logged alone on a skipped step',
        "derived",
    ),
    KeySpec("summary/skipped_blocks", "blocks of this evaluation whose closed form raised: left out alone", "derived"),
    KeySpec(
        "summary/nonfinite_blocks",
        "blocks of this evaluation whose captured `X`/`grad_output` (or result) held NaN or Inf",
        "derived",
    ),
    KeySpec("summary/warnings", "warnings fired so far", "derived"),
    KeySpec(
        "summary/lanczos/rel_residual_max",
        "largest relative residual over the evaluation's Lanczos norms (`≤ tol` when all converged)",
        "derived",
    ),
    KeySpec("summary/lanczos/unconverged", "how many Lanczos norms stopped at `max_iter` above `tol`", "derived"),
    KeySpec("summary/lanczos/norms", "how many Lanczos norms the evaluation computed", "derived"),
    KeySpec(
        "summary/heatmap", "image (W&B, TensorBoard; needs matplotlib): `log10 ‖H‖`, layers × sub-blocks", "derived"
    ),
    KeySpec(
        "summary/stability_heatmap",
        "image: `log10` of each block's `stability/max`, layers × sub-blocks (0 = the edge of stability)",
        "derived",
    ),
    KeySpec(
        "summary/layers",
        "W&B table (full evaluations, with a `WandbLogger`): one row per block, its layer, kind and maxima "
        "(`hessian_max`, `stability_max`, `sharpness_max`, `functional_outer`, the warning signals, the Lanczos "
        "residual)",
        "derived",
    ),
    KeySpec(
        "summary/signals/softmax_jac_min",
        "smallest softmax-Jacobian norm of any attention head (`term/softmax_jac_norm`): the `attn_saturation` rule "
        "fires when a head's stays below `saturation_level`",
        "derived",
    ),
    KeySpec(
        "summary/signals/logit_bound_max",
        "largest attention-logit bound `‖X‖² max_h ‖W_Q^h‖ ‖W_K^h‖` of any attention block: the `growth` rule "
        "watches each block's rise",
        "derived",
    ),
    KeySpec(
        "summary/signals/outer_vv_max",
        "largest exact value curvature `max_h ‖H_o(VV)‖` of any attention block: the `growth` rule watches each "
        "block's rise",
        "derived",
    ),
)

#: Per-layer keys, logged at every level, each under a W&B section of its own: ``{stem}_{pattern}`` with ``stem``
#: the prefix without its ``/`` (``curv_hessian/layer3/attn``; :func:`layer_key`).
LAYER_KEYS: tuple[KeySpec, ...] = (
    KeySpec(
        "hessian/layer{i}/{part}",
        "block norm `hessian/max` of sub-block `{part}` (`attn`, `ffn`, ...) of layer `i`: the largest Hessian "
        "norm over its pairs and heads (full evaluations)",
        "derived",
    ),
    KeySpec(
        "stability/layer{i}",
        "largest `stability/max` over the sub-blocks of layer `i` (real-loss keys, full evaluations): `≥ 1` is past "
        "the edge of stability",
        "derived",
    ),
)

#: The model-wide keys logged at ``log_level="summary"`` (the others of :data:`SUMMARY_KEYS` from ``"blocks"`` on).
SUMMARY_LEVEL: frozenset[str] = frozenset(
    {
        "summary/max_hessian", "summary/max_hessian_layer", "summary/heterogeneity/model",
        "summary/vv_qq_ratio/median", "summary/functional_outer/max", "summary/stability/max",
        "summary/stability/max_layer", "summary/ln/var_min_over_eps", "summary/rms/ms_min_over_eps",
        "summary/signals/softmax_jac_min", "summary/signals/logit_bound_max", "summary/signals/outer_vv_max",
        "summary/eval_time_s", "summary/terms_eval_time_s", "summary/overhead", "summary/evaluations",
        "summary/terms_evaluations", "summary/skipped_evaluations", "summary/skipped_blocks",
        "summary/nonfinite_blocks", "summary/warnings", "summary/lanczos/unconverged", "summary/heatmap",
        "summary/stability_heatmap", "summary/layers",
    }
)  # fmt: skip


def layer_key(prefix: str, key: str) -> str:
    """The logged name of a per-layer key (:data:`LAYER_KEYS`): its own W&B section, named after the prefix.

    Example:
        >>> layer_key("curv/", "hessian/layer3/attn"), layer_key("", "stability/layer3")
        ('curv_hessian/layer3/attn', 'stability/layer3')
    """
    stem = prefix.rstrip("/")
    return f"{stem}_{key}" if stem else key


def block_level(key: str) -> str:
    """The lowest log level at which a per-block key (relative to its block) is logged: ``"all"`` for per-head
    keys, bounds, terms and the cross-check (``verify/...``), ``"blocks"`` for the rest.

    Example:
        >>> block_level("hessian/QQ/h0"), block_level("term/x_norm"), block_level("hessian/max")
        ('all', 'all', 'blocks')
    """
    pieces = key.split("/")
    return "all" if pieces[0] in _ALL_ONLY or _HEAD.match(pieces[-1]) else "blocks"


def summary_level(key: str) -> str:
    """The lowest log level at which a ``summary/...`` key is logged: ``"summary"`` or ``"blocks"``.

    Example:
        >>> summary_level("summary/max_hessian"), summary_level("summary/heterogeneity/layer3")
        ('summary', 'blocks')
    """
    return "summary" if key in SUMMARY_LEVEL else "blocks"


def _pattern_level(pattern: str) -> str:
    """The docs' *level* column of a key pattern."""
    if pattern.startswith("summary/"):
        return summary_level(pattern)
    if pattern.split("/")[0] in _ALL_ONLY or pattern.endswith("/{head}"):
        return "all"
    return "blocks (per head: all)" if pattern.endswith("[/{head}]") else "blocks"


def key_table() -> tuple[KeySpec, ...]:
    """Every key: the shared block keys, each registered kind's keys and summaries, the model-wide keys."""

    rows = list(BLOCK_KEYS)
    for kind in KINDS.values():
        rows += [k for k in kind.keys if k not in rows]
    rows += SUMMARY_KEYS
    for kind in KINDS.values():
        rows += [KeySpec(f"summary/{s.key}", s.meaning, "derived") for s in kind.summaries]
    return tuple(dict.fromkeys(rows))


@functools.lru_cache(maxsize=4096)
def _spec_of(key: str, table: tuple[KeySpec, ...]) -> KeySpec | None:
    return next((spec for spec in table if spec.regex.match(key)), None)


def spec_of(key: str) -> KeySpec | None:
    """The row of ``key`` (relative to a block, or ``summary/...``), or ``None`` if no row matches."""
    return _spec_of(key, key_table())


def reduce_op(key: str) -> str:
    """How the ranks combine ``key``: ``"mean"``, ``"max"`` or ``"min"`` (see the module docstring).

    Raises:
        ValueError: If ``key`` has no row in the table (a kind that forgot to declare it), or is derived.
    """
    spec = spec_of(key)
    if spec is None:
        raise ValueError(
            f"Key {key!r} has no row in the key table (curvwatch.keys); declare it in its BlockKind's keys."
        )
    if spec.reduce == "derived":
        raise ValueError(f"Key {key!r} is derived after the reduction; it is never all-reduced.")
    return spec.reduce


def markdown(rows: tuple[KeySpec, ...], level: str | None = None) -> str:
    """A markdown table ``| key | meaning | ranks | level |`` of ``rows`` (those logged); ``level`` for all rows
    (else each pattern's, :func:`block_level` / :func:`summary_level`)."""
    lines = ["| key | meaning | ranks | level |", "| --- | --- | --- | --- |"]
    lines += [
        f"| `{r.pattern}` | {r.meaning} | {r.reduce} | {level or _pattern_level(r.pattern)} |" for r in rows if r.logged
    ]
    return "\n".join(lines)


def doc_sections() -> dict[str, str]:
    """The generated tables of ``docs/metrics.md``, by marker name: ``block``, ``summary`` and one per kind."""

    sections = {"block": markdown(BLOCK_KEYS), "layers": markdown(LAYER_KEYS, "summary")}
    summaries = list(SUMMARY_KEYS)
    for kind in KINDS.values():
        sections[f"kind:{kind.name}"] = markdown(kind.keys)
        summaries += [KeySpec(f"summary/{s.key}", s.meaning, "derived") for s in kind.summaries]
    sections["summary"] = markdown(tuple(summaries))
    return sections


def render_docs(text: str) -> str:
    """``text`` with every ``<!-- keys:NAME -->`` ... ``<!-- /keys -->`` section replaced by its generated table.

    Raises:
        ValueError: If a marker names an unknown section, or a section of :func:`doc_sections` has no marker.
    """
    sections = doc_sections()
    pattern = re.compile(r"(<!-- keys:(?P<name>[\w:]+) -->\n)(?P<body>.*?)(<!-- /keys -->)", re.S)
    seen = set()

    def fill(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in sections:
            raise ValueError(f"docs marker keys:{name} names no key table section; known: {sorted(sections)}")
        seen.add(name)
        return f"{match.group(1)}{sections[name]}\n{match.group(4)}"

    out = pattern.sub(fill, text)
    missing = sorted(set(sections) - seen)
    if missing:
        raise ValueError(f"docs/metrics.md has no marker for the key table sections {missing}: add <!-- keys:NAME -->.")
    return out


if __name__ == "__main__":  # python -m curvwatch.keys [docs/metrics.md]: rewrite the generated tables in place
    import pathlib
    import sys

    path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "docs/metrics.md")
    path.write_text(render_docs(path.read_text()))
    print(f"wrote the key tables of {path}")
