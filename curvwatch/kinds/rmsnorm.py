"""The ``"rmsnorm"`` kind: RMSNorm over the last dimension (LLaMA, Mistral, Qwen, Gemma), its mean-square statistics."""

from __future__ import annotations

from curvwatch.keys import KeySpec
from curvwatch.kinds import BlockKind, Summary, register_kind


def _collapse_stats(result, eps):
    """The collapse warning's statistics: RMSNorm divides by ``sqrt(ms + eps)``, so ``ms`` plays LayerNorm's var."""
    stats = {
        "var_min_over_eps": result.get("rms/ms_min_over_eps"),
        "var_min": result.get("rms/ms_min"),
        "inv_var_max": result.get("rms/inv_ms_max"),
    }
    stats = {k: v for k, v in stats.items() if v is not None}
    if eps is not None:
        stats["eps"] = float(eps)
    return stats


KIND = register_kind(
    BlockKind(
        name="rmsnorm",
        closed_form="rmsnorm",
        prefix="rms",
        work_elements=lambda B, L, d, p: 16 * B * L * d,
        keys=(
            KeySpec("rms/ms_min", "smallest row mean square `‖x‖²/n` of the RMSNorm input", "min"),
            KeySpec("rms/ms_mean", "mean row mean square of the RMSNorm input"),
            KeySpec("rms/ms_min_over_eps", "`ms_min / eps`; the collapse warning fires below `collapse_ratio`", "min"),
            KeySpec("rms/inv_ms_max", "`1 / min(ms + eps)`", "max"),
            KeySpec("rms/inv_rms_max", "`1 / min sqrt(ms + eps)`", "max"),
            KeySpec("rms/collapsed_fraction", "fraction of rows with `ms <= 10 eps`"),
            KeySpec("rms/jacobian_norm", "exact norm of the normalisation's input Jacobian (max over rows)"),
            KeySpec("rms/hessian_norm", "exact norm of the normalisation's input Hessian (max over rows)"),
            KeySpec("rms/jacobian_norm_affine_bound", "`rms/jacobian_norm` times `max |offset + γ|`"),
            KeySpec("rms/hessian_norm_affine_bound", "`rms/hessian_norm` times `max |offset + γ|`"),
            KeySpec("rms/contracted_hessian_norm", "the Hessian contracted with the output gradient, exact"),
            KeySpec("rms/contracted_hessian_bound", "its bound `4‖g'‖/(√n r²)` (docs/closed_forms.md, RMSNorm)"),
        ),
        summaries=(
            Summary("rms/inv_ms_max", "rms/inv_ms_max", "max", "max over RMSNorms of `rms/inv_ms_max`"),
            Summary("rms/ms_min", "rms/ms_min", "min", "min over RMSNorms of `rms/ms_min`"),
            Summary(
                "rms/ms_min_over_eps",
                "rms/ms_min_over_eps",
                "min",
                "min over RMSNorms of `rms/ms_min_over_eps` (the collapse warning watches it)",
                finite=False,
            ),
        ),
        collapse_stats=_collapse_stats,
        input_only_keys=True,
        label="RMSNorm",
        doc="RMSNorm `x / sqrt(mean(x²) + eps) (offset + γ)`: mean-square statistics, exact Jacobian/Hessian norms",
    )
)
