"""The ``"layernorm"`` kind: LayerNorm over the last dimension, its variance statistics and exact norms."""

from __future__ import annotations

from curvwatch.keys import KeySpec
from curvwatch.kinds import BlockKind, Summary, register_kind


def _collapse_stats(result, eps):
    """The collapse warning's statistics from a LayerNorm block's (prefixed) result."""
    stats = {k.split("/", 1)[1]: v for k, v in result.items() if k.startswith("ln/")}
    if eps is not None:
        stats["eps"] = float(eps)
    return stats


KIND = register_kind(
    BlockKind(
        name="layernorm",
        closed_form="layernorm",
        prefix="ln",
        work_elements=lambda B, L, d, p: 16 * B * L * d,
        keys=(
            KeySpec("ln/var_min", "smallest row variance of the LayerNorm input", "min"),
            KeySpec("ln/var_mean", "mean row variance of the LayerNorm input"),
            KeySpec(
                "ln/var_min_over_eps",
                "`var_min / eps`; the collapse warning fires below `collapse_ratio` (default 5)",
                "min",
            ),
            KeySpec("ln/inv_var_max", "`1 / min(var + eps)`", "max"),
            KeySpec("ln/inv_std_max", "`1 / min sqrt(var + eps)`", "max"),
            KeySpec("ln/collapsed_fraction", "fraction of rows with `var <= 10 eps`"),
            KeySpec("ln/jacobian_norm", "exact norm of the normalisation's input Jacobian (max over rows)"),
            KeySpec("ln/hessian_norm", "exact norm of the normalisation's input Hessian (max over rows)"),
            KeySpec("ln/jacobian_norm_affine_bound", "`ln/jacobian_norm` times `max |γ|`"),
            KeySpec("ln/hessian_norm_affine_bound", "`ln/hessian_norm` times `max |γ|`"),
            KeySpec("ln/contracted_hessian_norm", "the Hessian contracted with the output gradient, exact"),
            KeySpec("ln/contracted_hessian_bound", "its bound `6‖g‖/(√n s²)` (formula sheet §4)"),
        ),
        summaries=(
            Summary("ln/inv_var_max", "ln/inv_var_max", "max", "max over LayerNorms of `ln/inv_var_max`"),
            Summary("ln/var_min", "ln/var_min", "min", "min over LayerNorms of `ln/var_min`"),
            Summary(
                "ln/var_min_over_eps",
                "ln/var_min_over_eps",
                "min",
                "min over LayerNorms of `ln/var_min_over_eps` (headline; the collapse warning watches it)",
                finite=False,
            ),
        ),
        collapse_stats=_collapse_stats,
        input_only_keys=True,
        label="LayerNorm",
        doc="LayerNorm over the last dimension: variance statistics, exact Jacobian/Hessian norms (no weight blocks)",
    )
)
