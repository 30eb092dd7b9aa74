"""The ``"ffn"`` kind: a two-layer feed-forward sub-block ``act(Y W_1 + b_1) W_2 + b_2`` (ReLU, GELU)."""

from __future__ import annotations

from curvwatch.closed_form.inputs import FFNWeights
from curvwatch.kinds import BlockKind, grouped, register_kind
from curvwatch.names import KeySpec

# the keys every FFN kind reports (the gated one too)
ACTIVITY_KEYS = (
    KeySpec("ffn/dead_fraction", "fraction of hidden units inactive on every captured token"),
    KeySpec("ffn/active_fraction", "mean fraction of positive pre-activations"),
    KeySpec("term/y_norm", "spectral norm of the input (max over sequences)"),
    KeySpec("term/hidden_norm", "spectral norm of the hidden activations (max over sequences)"),
)

KIND = register_kind(
    BlockKind(
        name="ffn",
        closed_form="ffn",
        prefix="ffn",
        input_name="Y",
        mask_name="row_mask",
        pairs=("W1W1", "W2W2", "W1W2"),
        exact_pairs=("W2W2",),
        iterative=True,
        sampled=True,
        adapted=("W_1", "W_2"),
        has_norms=True,
        prepare=lambda kwargs: grouped(kwargs, "Y", FFNWeights),
        work_elements=lambda B, L, d, p: 32 * B * L * p["W_1"].shape[-1],
        basis_numel=lambda p: p["W_1"].numel(),
        keys=(
            *ACTIVITY_KEYS,
            KeySpec("term/w1_norm", "spectral norm of `W_1`"),
            KeySpec("term/w2_norm", "spectral norm of `W_2`"),
        ),
        label="FFN",
        doc="feed-forward `act(Y W_1) W_2` (ReLU, GELU erf/tanh): blocks `W1W1`, `W2W2` (exact), `W1W2`",
    )
)
