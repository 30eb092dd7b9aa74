"""The ``"rmsnorm"`` kind: RMSNorm over the last dimension (LLaMA, Mistral, Qwen, Gemma), its mean-square statistics.

RMSNorm divides by ``sqrt(ms + eps)`` with ``ms = ‖x‖²/n``, so the mean square plays LayerNorm's variance: the same
collapse warning watches ``rms/ms_min_over_eps``.
"""

from __future__ import annotations

from curvwatch.kinds import register_kind
from curvwatch.kinds._norms import norm_kind

KIND = register_kind(
    norm_kind(
        name="rmsnorm",
        prefix="rms",
        label="RMSNorm",
        stat="ms",
        root="rms",
        stat_text="row mean square `‖x‖²/n`",
        affine="‖offset + γ‖_∞",
        bound="`4‖g'‖/(√n r²)` (docs/closed_forms.md, RMSNorm)",
        doc="RMSNorm `x / sqrt(mean(x²) + eps) (offset + γ)`: mean-square statistics, exact Jacobian/Hessian norms",
    )
)
