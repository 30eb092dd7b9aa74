"""The ``"gated_ffn"`` kind: SwiGLU / GeGLU ``(act(Y W_gate) * (Y W_up)) W_down`` (LLaMA, Mistral, Qwen, Gemma).

Blocks are named as in Meta's LLaMA code: ``W1`` = ``W_gate``, ``W3`` = ``W_up``, ``W2`` = ``W_down``.
"""

from __future__ import annotations

from curvwatch.closed_form.inputs import GatedFFNWeights
from curvwatch.kinds import BlockKind, grouped, register_kind
from curvwatch.kinds.ffn import ACTIVITY_KEYS
from curvwatch.names import KeySpec

KIND = register_kind(
    BlockKind(
        name="gated_ffn",
        closed_form="gated_ffn",
        prefix="ffn",
        input_name="Y",
        mask_name="row_mask",
        pairs=("W1W1", "W3W3", "W2W2", "W1W3", "W1W2", "W3W2"),
        exact_pairs=("W2W2",),
        iterative=True,
        sampled=True,
        adapted=("W_gate", "W_up", "W_down"),
        has_norms=True,
        prepare=lambda kwargs: grouped(kwargs, "Y", GatedFFNWeights),
        # gate and up pre-activations, the gated hidden layer and their tangents: (B, L, f) each
        work_elements=lambda B, L, d, p: 48 * B * L * p["W_gate"].shape[-1],
        basis_numel=lambda p: p["W_gate"].numel(),
        keys=(
            *ACTIVITY_KEYS,
            KeySpec("ffn/gate_saturation", "fraction of gate pre-activations below -4 (gate nearly off)"),
            KeySpec("term/wgate_norm", "spectral norm of `W_gate`"),
            KeySpec("term/wup_norm", "spectral norm of `W_up`"),
            KeySpec("term/wdown_norm", "spectral norm of `W_down`"),
        ),
        label="gated FFN",
        doc="gated MLP (SwiGLU, GeGLU): blocks `W1` (gate), `W3` (up), `W2` (down, exact), diagonal and cross",
    )
)
