"""The ``"layernorm"`` kind: LayerNorm over the last dimension, its variance statistics and exact norms."""

from __future__ import annotations

from curvwatch.kinds import register_kind
from curvwatch.kinds._norms import norm_kind

KIND = register_kind(
    norm_kind(
        name="layernorm",
        prefix="ln",
        label="LayerNorm",
        stat="var",
        root="std",
        stat_text="row variance",
        affine="‖γ‖_∞",
        bound="`6‖g‖/(√n s²)`",
        doc="LayerNorm over the last dimension: variance statistics, exact Jacobian/Hessian norms (no weight blocks)",
    )
)
