"""Model-wide curvature summaries: pure functions from per-block result dicts to named numbers.

Every function here takes plain numbers (``float`` or 0-d tensors) keyed as
:func:`~curvwatch.engine.kernel.evaluate_block` keys them, relative to a block (``"hessian/QQ/h0"``,
``"outer/VV/h1"``, ``"ln/inv_var_max"``), and returns new ``dict[str, float]``. Nothing here sees a ``Trainer``,
a hook or a logger.

Structure of the keys (see ``docs/metrics.md``): ``{part}/{pair}[/h{head}]`` with ``part`` one of
``hessian`` (``H = H_o + H_f``), ``outer`` (Gauss-Newton ``H_o``) and ``functional`` (``H_f``), and ``pair``
a block pair named by its parameter letters (``QQ``, ``VQ``, ``W1W1``, ``QKV`` for the whole attention block).
A pair is *diagonal* when it is one parameter twice (``QQ``, ``W1W1``).

Example:
    >>> results = {
    ...     "layer0/attn": {"hessian/QQ/h0": 1e-4, "hessian/VV/h0": 1e-1, "outer/QQ/h0": 1e-4,
    ...                     "outer/VV/h0": 1e-1, "functional/QQ/h0": 2e-5, "functional/VV/h0": 0.0},
    ...     "layer0/ffn": {"hessian/W1W1": 1e-2},
    ... }
    >>> norms = block_norms(results)
    >>> norms
    {'layer0/attn': 0.1, 'layer0/ffn': 0.01}
    >>> round(log10_spread(norms.values()), 6)
    1.0
    >>> vv_qq_ratios(results["layer0/attn"])
    {'ratio/VV_QQ/h0': 1000.0}
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence

import torch

from curvwatch.kinds import KINDS
from curvwatch.names import _HEAD, _PAIR, is_diagonal_pair, pair_of

__all__ = [
    "block_derived",
    "block_norm",
    "block_norms",
    "functional_outer_ratio",
    "is_diagonal_pair",
    "lanczos_accuracy",
    "log10_spread",
    "pair_of",
    "derive",
    "kind_summaries",
    "layer_maxima",
    "residuals",
    "select_pairs",
    "signal_summaries",
    "summarize",
    "to_float",
    "vv_qq_ratios",
]

_LAYER = re.compile(r"layer(\d+)")


def to_float(value: float | torch.Tensor) -> float:
    """A Python float from a float or a 0-d (or one-element) tensor."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def select_pairs(
    result: Mapping[str, float | torch.Tensor], pairs: str | Sequence[str]
) -> dict[str, float | torch.Tensor]:
    """Keep the keys of the selected block pairs (and every key that is about no pair).

    Args:
        result: One block's results.
        pairs: ``"all"``, ``"diagonal"`` or a sequence of pair names such as ``("VV", "QQ", "W1W1")``.

    Returns:
        The filtered dict (same values).

    Example:
        >>> sorted(select_pairs({"hessian/QQ/h0": 1.0, "hessian/VQ/h0": 2.0, "term/x_norm": 3.0}, "diagonal"))
        ['hessian/QQ/h0', 'term/x_norm']
    """
    if pairs == "all":
        return dict(result)
    keep = is_diagonal_pair if pairs == "diagonal" else set(pairs).__contains__
    out = {}
    for key, value in result.items():
        pair = pair_of(key)
        if pair is None or keep(pair):
            out[key] = value
    return out


def _part_values(result: Mapping[str, float | torch.Tensor], part: str) -> dict[str, float]:
    """``{pair[/h]: value}`` of the keys ``{part}/{pair}[/h{i}]`` (bounds excluded)."""
    out = {}
    for key, value in result.items():
        pieces = key.split("/")
        if pieces[0] == part and len(pieces) in (2, 3) and _PAIR.match(pieces[1]):
            if len(pieces) == 3 and not _HEAD.match(pieces[2]):
                continue
            out["/".join(pieces[1:])] = to_float(value)
    return out


def block_norm(result: Mapping[str, float | torch.Tensor], part: str = "hessian") -> float | None:
    """Spectral-norm proxy of one block: the largest ``{part}/{pair}[/h]`` norm it reports.

    For a symmetric matrix the norm of any sub-block is at most the norm of the whole, so this is a lower
    bound of ``||H||_2`` of the block, exact when the whole block (``QKV``) is among the pairs.
    ``None`` when the block reports no such key (e.g. a LayerNorm without Hessian norms).
    """
    values = [abs(v) for v in _part_values(result, part).values() if math.isfinite(v)]
    return max(values) if values else None


def block_norms(results: Mapping[str, Mapping[str, float | torch.Tensor]]) -> dict[str, float]:
    """``{block: block_norm}`` for every block that reports Hessian norms, in input order."""
    out = {}
    for name, result in results.items():
        norm = block_norm(result)
        if norm is not None:
            out[name] = norm
    return out


def log10_spread(values: Iterable[float]) -> float:
    """Heterogeneity ``log10(max) - log10(min)`` over the positive, finite values (``nan`` if none).

    0 means all equal; 3 means three orders of magnitude between the flattest and the most curved.
    """
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if not positive:
        return math.nan
    return math.log10(max(positive)) - math.log10(min(positive))


def vv_qq_ratios(result: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """``ratio/VV_QQ[/h{i}]`` = ``||H(VV)|| / ||H(QQ)||`` per head of an attention block.

    The papers' scaling argument says the value block grows like ``||X||^2`` and the query block like
    ``||X||^6``, so this ratio tracks how input scale shifts curvature between the two.
    Heads with ``||H(QQ)|| = 0`` give ``inf``.
    """
    hess = _part_values(result, "hessian")
    out = {}
    for key, vv in hess.items():
        pieces = key.split("/")
        if pieces[0] != "VV":
            continue
        qq = hess.get("/".join(["QQ", *pieces[1:]]))
        if qq is None:
            continue
        out["/".join(["ratio/VV_QQ", *pieces[1:]])] = vv / qq if qq != 0 else math.inf
    return out


def functional_outer_ratio(result: Mapping[str, float | torch.Tensor]) -> float | None:
    """``max ||H_f|| / max ||H_o||`` over the pairs (and heads) of one block, or ``None``.

    Near 0 the Gauss-Newton part dominates (a GGN/K-FAC preconditioner sees the curvature); near or above
    1 the functional part, which GN-based methods drop, matters as much.
    """
    outer = block_norm(result, "outer")
    functional = block_norm(result, "functional")
    if outer is None or functional is None:
        return None
    return functional / outer if outer != 0 else math.inf


def residuals(result: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """``{norm key: relative residual}`` of the norms found by Lanczos (keys ``residual/{norm key}``).

    The relative residual ``r`` of a norm says that some eigenvalue lies within ``r * norm`` of it; it is at
    most the kernels' ``tol`` once Lanczos converged, larger when ``max_iter`` stopped it first (the norm
    may then read low). Exact norms (``VV``, ``W2W2``, LayerNorm) have none.

    Example:
        >>> residuals({"hessian/QQ": 2.0, "residual/hessian/QQ": 4e-4, "hessian/VV": 1.0})
        {'hessian/QQ': 0.0004}
    """
    return {key[len("residual/") :]: to_float(v) for key, v in result.items() if key.startswith("residual/")}


def prefix_max(result: Mapping[str, float | torch.Tensor], prefix: str) -> float | None:
    """Largest value of the keys ``{prefix}/{pair}[/h{i}]`` of one block (NaN left out), or ``None``; for
    ``"stability"`` the adapters' ``stability/lora/<name>`` too (ratios of one scale; a sharpness in an adapter's
    parameters is in other units than the weights').

    Example:
        >>> prefix_max({"stability/QQ/h0": 0.5, "stability/KK/h0": 1.5, "sharpness/QQ/h0": 9.0}, "stability")
        1.5
        >>> prefix_max({"stability/lora/q_proj": 0.7, "sharpness/lora/q_proj": 9.0}, "stability")
        0.7
    """
    adapters = f"{prefix}/lora/" if prefix == "stability" else None

    def counted(key: str) -> bool:
        return key.startswith(prefix + "/") and (
            pair_of(key) is not None or bool(adapters and key.startswith(adapters))
        )

    values = [to_float(v) for k, v in result.items() if counted(k)]
    values = [v for v in values if not math.isnan(v)]
    return max(values) if values else None


def block_derived(result: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """Per-block derived numbers: ``hessian/max``, ``ratio/functional_outer``, ``ratio/VV_QQ[/h{i}]``,
    ``lanczos/rel_residual_max`` (the largest :func:`residuals` value of the block) and, with the real-loss keys,
    ``sharpness/max`` and ``stability/max`` (the adapters' ratios included).

    Example:
        >>> block_derived({"hessian/VV": 4.0, "hessian/QQ": 2.0, "outer/QQ": 2.0, "functional/QQ": 1.0})
        {'hessian/max': 4.0, 'ratio/functional_outer': 0.5, 'ratio/VV_QQ': 2.0}
    """
    out: dict[str, float] = {}
    norm = block_norm(result)
    if norm is not None:
        out["hessian/max"] = norm
    ratio = functional_outer_ratio(result)
    if ratio is not None:
        out["ratio/functional_outer"] = ratio
    out.update(vv_qq_ratios(result))
    res = residuals(result)
    if res:
        out["lanczos/rel_residual_max"] = max(res.values())
    for prefix in ("sharpness", "stability"):
        top = prefix_max(result, prefix)
        if top is not None:
            out[f"{prefix}/max"] = top
    return out


def lanczos_accuracy(results: Mapping[str, Mapping[str, float | torch.Tensor]], tol: float) -> dict[str, float]:
    """How well the Lanczos norms of one evaluation converged.

    Args:
        results: ``{block name: {relative key: value}}`` of one evaluation.
        tol: the relative tolerance the norms were asked for.

    Returns:
        ``summary/lanczos/rel_residual_max`` (largest relative residual over all Lanczos norms),
        ``summary/lanczos/unconverged`` (how many norms have a residual above ``tol``; none when ``tol = 0``,
        which asks for ``max_iter`` steps) and ``summary/lanczos/norms`` (how many there are); ``{}`` when no
        block reports a Lanczos norm.

    Example:
        >>> acc = lanczos_accuracy({"attn": {"residual/hessian/QQ": 5e-4, "residual/hessian/KK": 0.02}}, 1e-3)
        >>> acc["summary/lanczos/unconverged"], acc["summary/lanczos/norms"]
        (1.0, 2.0)
    """
    values = [v for result in results.values() for v in residuals(result).values()]
    if not values:
        return {}
    return {
        "summary/lanczos/rel_residual_max": max(values),
        "summary/lanczos/unconverged": float(sum(tol > 0 and not v <= tol for v in values)),
        "summary/lanczos/norms": float(len(values)),
    }


def _layer_of(name: str, layers: Mapping[str, int] | None) -> int | None:
    if layers is not None and name in layers:
        return layers[name]
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def _finite(values: Iterable[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def summarize(
    results: Mapping[str, Mapping[str, float | torch.Tensor]],
    layers: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Model-wide summary of one evaluation, keys relative to ``summary/``'s parent.

    Args:
        results: ``{block name: {relative key: value}}`` of one evaluation.
        layers: ``{block name: layer index}``; by default parsed from ``layer{i}`` in the name.

    Returns:
        ``summary/max_hessian`` (largest block norm), ``summary/max_hessian_layer`` and
        ``summary/max_hessian_block`` (its layer and its position in ``results``),
        ``summary/heterogeneity/model`` and ``summary/heterogeneity/layer{i}`` (log10 spread of block norms),
        ``summary/vv_qq_ratio/median`` (over all attention heads), ``summary/functional_outer/max`` and
        ``/median`` (over blocks), ``summary/sharpness/max``, ``summary/stability/max`` with
        ``summary/stability/max_layer`` and ``summary/stability/max_block`` (real-loss keys), and the block kinds'
        summaries (:func:`kind_summaries`: ``summary/ln/var_min``, ...). Keys whose inputs are absent are omitted.

    Example:
        >>> s = summarize({"layer0/attn": {"hessian/QQ": 1.0}, "layer1/attn": {"hessian/QQ": 100.0}})
        >>> s["summary/max_hessian"], s["summary/max_hessian_layer"], s["summary/heterogeneity/model"]
        (100.0, 1.0, 2.0)
    """
    out: dict[str, float] = {}
    names = list(results)
    norms = block_norms(results)
    if norms:
        top = max(norms, key=norms.__getitem__)
        out["summary/max_hessian"] = norms[top]
        layer = _layer_of(top, layers)
        if layer is not None:
            out["summary/max_hessian_layer"] = float(layer)
        out["summary/max_hessian_block"] = float(names.index(top))
        spread = log10_spread(norms.values())  # nan when no norm is positive: "no data", not logged
        if math.isfinite(spread):
            out["summary/heterogeneity/model"] = spread
        by_layer: dict[int, list[float]] = {}
        for name, norm in norms.items():
            layer = _layer_of(name, layers)
            if layer is not None:
                by_layer.setdefault(layer, []).append(norm)
        for layer in sorted(by_layer):
            spread = log10_spread(by_layer[layer])
            if math.isfinite(spread):
                out[f"summary/heterogeneity/layer{layer}"] = spread
    ratios = _finite(v for result in results.values() for v in vv_qq_ratios(result).values())
    if ratios:
        out["summary/vv_qq_ratio/median"] = statistics.median(ratios)
    fo = [functional_outer_ratio(result) for result in results.values()]
    fo_finite = _finite(v for v in fo if v is not None)
    if fo_finite:
        out["summary/functional_outer/max"] = max(fo_finite)
        out["summary/functional_outer/median"] = statistics.median(fo_finite)
    for prefix in ("sharpness", "stability"):
        tops = {name: prefix_max(result, prefix) for name, result in results.items()}
        tops = {name: v for name, v in tops.items() if v is not None}
        if tops:
            top = max(tops, key=tops.__getitem__)
            out[f"summary/{prefix}/max"] = tops[top]
            if prefix == "stability":
                layer = _layer_of(top, layers)
                if layer is not None:
                    out["summary/stability/max_layer"] = float(layer)
                out["summary/stability/max_block"] = float(names.index(top))
    out.update(kind_summaries(results))
    return out


def kind_summaries(results: Mapping[str, Mapping[str, float | torch.Tensor]]) -> dict[str, float]:
    """The block kinds' own summaries (:attr:`curvwatch.kinds.BlockKind.summaries`): ``summary/ln/var_min``, ...

    Each is the max (min) over the blocks that report its key; NaN never counts, ``+-inf`` only for summaries
    declared with ``finite=False`` (``ln/var_min_over_eps``, infinite with ``eps = 0``).

    Example:
        >>> kind_summaries({"a": {"ln/var_min": 2.0}, "b": {"ln/var_min": 0.5, "ln/inv_var_max": 3.0}})
        {'summary/ln/inv_var_max': 3.0, 'summary/ln/var_min': 0.5}
    """

    out: dict[str, float] = {}
    for kind in KINDS.values():
        for s in kind.summaries:
            values = [to_float(r[s.block_key]) for r in results.values() if s.block_key in r]
            values = [v for v in values if (not math.isnan(v) if not s.finite else math.isfinite(v))]
            if values:
                out[f"summary/{s.key}"] = max(values) if s.reduce == "max" else min(values)
    return out


def derive(
    results: Mapping[str, Mapping[str, float]],
    layers: Mapping[str, int],
    *,
    terms_only: bool,
    tol: float,
    skip_norms: Sequence[str] = (),
) -> tuple[dict[str, dict[str, float]], dict[str, float], dict[str, float]]:
    """What one evaluation's (reduced) numbers give: ``(per-block keys, summaries, block norms)``.

    Args:
        results: ``{block: {relative key: value}}`` of the evaluation, after the cross-rank reduction.
        layers: ``{block: layer index}``, in the monitored order (``summary/max_hessian_block`` indexes it).
        terms_only: A terms-only evaluation has no Lanczos norms, so nothing derived from a block's norms is
            computed from it (``hessian/max``, ratios, norm summaries): a maximum over its exact pairs alone would
            read as the block's norm. Its kind summaries (``summary/ln/...``) are kept.
        tol: The Lanczos tolerance the norms were asked for (``summary/lanczos/unconverged``).
        skip_norms: Blocks whose norms do not count (non-finite ones).

    Returns:
        The per-block keys to log (the results plus :func:`block_derived`, without the per-norm ``residual/``
        keys), the summaries (:func:`summarize` and :func:`lanczos_accuracy`) and ``{block: norm}`` of the blocks
        with Hessian norms (empty for a terms-only evaluation).

    Example:
        >>> per_block, summary, norms = derive({"layer0/attn": {"hessian/QQ/h0": 2.0}}, {"layer0/attn": 0},
        ...                                    terms_only=False, tol=1e-2)
        >>> per_block["layer0/attn"]["hessian/max"], summary["summary/max_hessian"], norms
        (2.0, 2.0, {'layer0/attn': 2.0})
    """
    per_block = {}
    for block, result in results.items():
        keys = {**result, **({} if terms_only else block_derived(result))}
        per_block[block] = {k: v for k, v in keys.items() if not k.startswith("residual/")}
    if terms_only:
        summary = kind_summaries(results)
        norms: dict[str, float] = {}
    else:
        summary = summarize(results, layers)
        norms = {b: v for b, v in block_norms(results).items() if b not in skip_norms}
        for key in ("summary/max_hessian_block", "summary/stability/max_block"):
            if key in summary:  # index into the monitored blocks, not the evaluated ones
                name = list(results)[int(summary[key])]
                summary[key] = float(list(layers).index(name))
    summary.update(lanczos_accuracy(results, tol))
    return per_block, summary, norms


def layer_maxima(per_block: Mapping[str, Mapping[str, float]], layers: Mapping[str, int | None]) -> dict[str, float]:
    """Per layer, the maxima per sub-block: ``hessian/layer{i}/{part}`` (the block norm ``hessian/max`` of each
    sub-block with Hessian norms, ``part`` the block's name after ``layer{i}/``) and ``stability/layer{i}`` (the
    largest ``stability/max`` over the layer's sub-blocks). Blocks without a layer index are left out.

    Example:
        >>> per_block = {"layer0/attn": {"hessian/max": 2.0, "stability/max": 0.1},
        ...              "layer0/ffn": {"hessian/max": 3.0, "stability/max": 0.4}, "layer0/ln_1": {"ln/var_min": 1.0}}
        >>> layer_maxima(per_block, {"layer0/attn": 0, "layer0/ffn": 0, "layer0/ln_1": 0})
        {'hessian/layer0/attn': 2.0, 'hessian/layer0/ffn': 3.0, 'stability/layer0': 0.4}
    """
    out: dict[str, float] = {}
    stability: dict[int, float] = {}
    for block, keys in per_block.items():
        layer = _layer_of(block, layers)
        if layer is None:
            continue
        head = f"layer{layer}/"
        part = block[len(head) :] if block.startswith(head) else block
        if "hessian/max" in keys:
            out[f"hessian/layer{layer}/{part.replace('/', '_')}"] = keys["hessian/max"]
        value = keys.get("stability/max")
        if value is not None and not math.isnan(value):
            stability[layer] = max(value, stability.get(layer, -math.inf))
    out.update({f"stability/layer{layer}": v for layer, v in sorted(stability.items())})
    return out


def signal_summaries(quantities: Mapping[tuple[str, str], float]) -> dict[str, float]:
    """Model-wide extremes of what the suite's warning rules watch (:func:`curvwatch.rules.block_quantities`):
    ``summary/signals/softmax_jac_min`` (the smallest softmax-Jacobian norm of any head: ``attn_saturation``),
    ``summary/signals/logit_bound_max`` (the largest attention-logit bound: ``growth``) and
    ``summary/signals/outer_vv_max`` (the largest exact value curvature: ``growth``). The LayerNorm/RMSNorm one
    is ``summary/ln/var_min_over_eps`` (``summary/rms/ms_min_over_eps``).

    Example:
        >>> signal_summaries({("layer0/attn", "saturation"): 0.4, ("layer1/attn", "saturation"): 0.2,
        ...                   ("layer0/attn", "logit"): 30.0, ("layer0/ln_1", "ln_ratio"): 9.0})
        {'summary/signals/softmax_jac_min': 0.2, 'summary/signals/logit_bound_max': 30.0}
    """
    out: dict[str, float] = {}
    for quantity, key, pick in (
        ("saturation", "summary/signals/softmax_jac_min", min),
        ("logit", "summary/signals/logit_bound_max", max),
        ("outer_VV", "summary/signals/outer_vv_max", max),
    ):
        values = [v for (_, q), v in quantities.items() if q == quantity]
        if values:
            out[key] = pick(values)
    return out
