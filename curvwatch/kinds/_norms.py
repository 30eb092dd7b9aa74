"""The normalisation kinds (LayerNorm, RMSNorm) share one shape: a statistic of each input row (its variance or
its mean square) that the normalisation divides by, its collapse towards ``eps``, and exact input-curvature norms.
:func:`norm_kind` declares such a kind from the names of its statistic."""

from __future__ import annotations

from curvwatch.kinds import BlockKind, Summary
from curvwatch.names import KeySpec


def norm_kind(
    *, name: str, prefix: str, label: str, stat: str, root: str, stat_text: str, affine: str, bound: str, doc: str
) -> BlockKind:
    """A normalisation kind whose kernel reports ``{stat}_min``, ``{stat}_mean``, ``{stat}_min_over_eps``,
    ``inv_{stat}_max``, ``inv_{root}_max``, ``collapsed_fraction`` and the exact Jacobian/Hessian norms.

    Args:
        name, prefix, label, doc: As in :class:`~curvwatch.kinds.BlockKind`.
        stat: The row statistic's key stem: ``"var"`` (LayerNorm), ``"ms"`` (RMSNorm).
        root: The stem of its square root: ``"std"``, ``"rms"``.
        stat_text: What the statistic is, e.g. ``"row variance"``.
        affine: The affine factor bounding the affine norms, e.g. ``"‖γ‖_∞"`` (a table cell: no ``|``).
        bound: The contracted-Hessian bound and where it is derived.
    """
    p = prefix

    return BlockKind(
        name=name,
        closed_form=name,
        prefix=p,
        work_elements=lambda B, L, d, params: 16 * B * L * d,
        signal_kwargs={"stats_only": True},  # the row statistics the collapse warnings read, no norms
        keys=(
            KeySpec(f"{p}/{stat}_min", f"smallest {stat_text} of the {label} input", "min"),
            KeySpec(f"{p}/{stat}_mean", f"mean {stat_text} of the {label} input"),
            KeySpec(
                f"{p}/{stat}_min_over_eps",
                f"`{stat}_min / eps`; the collapse warning fires below `collapse_ratio` (default 5)",
                "min",
            ),
            KeySpec(f"{p}/inv_{stat}_max", f"`1 / min({stat} + eps)`", "max"),
            KeySpec(f"{p}/inv_{root}_max", f"`1 / min sqrt({stat} + eps)`", "max"),
            KeySpec(f"{p}/collapsed_fraction", f"fraction of rows with `{stat} <= 10 eps`"),
            KeySpec(f"{p}/jacobian_norm", "exact norm of the normalisation's input Jacobian (max over rows)"),
            KeySpec(f"{p}/hessian_norm", "exact norm of the normalisation's input Hessian (max over rows)"),
            KeySpec(f"{p}/jacobian_norm_affine_bound", f"`{p}/jacobian_norm` times `{affine}`"),
            KeySpec(f"{p}/hessian_norm_affine_bound", f"`{p}/hessian_norm` times `{affine}`"),
            KeySpec(f"{p}/contracted_hessian_norm", "the Hessian contracted with the output gradient, exact"),
            KeySpec(f"{p}/contracted_hessian_bound", f"its bound {bound}"),
        ),
        summaries=(
            Summary(f"{p}/inv_{stat}_max", f"{p}/inv_{stat}_max", "max", f"max over {label}s of `{p}/inv_{stat}_max`"),
            Summary(f"{p}/{stat}_min", f"{p}/{stat}_min", "min", f"min over {label}s of `{p}/{stat}_min`"),
            Summary(
                f"{p}/{stat}_min_over_eps",
                f"{p}/{stat}_min_over_eps",
                "min",
                f"min over {label}s of `{p}/{stat}_min_over_eps` (headline; the collapse warning watches it)",
                finite=False,
            ),
        ),
        input_only_keys=True,
        label=label,
        doc=doc,
    )
