"""The ground truths of the original kernels (attention, LayerNorm, FFN, whole block); see the package docstring."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.func import grad, hessian, jacrev

__all__ = [
    # attention
    "self_attention_blocks",
    "multi_head_attention_blocks",
    # layer norm
    "layernorm_dense",
    "layernorm_contracted_hessian",
    # feed-forward and the full block
    "ffn_blocks",
    "transformer_block_blocks",
    # norms
    "spectral_norm",
    "dense_to_norms",
]

_ATTENTION_ORDER = ("V", "Q", "K")
_ATTENTION_PAIRS = (("V", "V"), ("Q", "Q"), ("K", "K"), ("V", "Q"), ("V", "K"), ("Q", "K"))
_BLOCK_ORDER = ("V", "Q", "K", "W1", "W2")
_BLOCK_PAIRS = tuple(itertools.combinations_with_replacement(_BLOCK_ORDER, 2))
_ACTIVATIONS = ("relu", "gelu")
_NORMS = ("post", "pre")
_KINDS = ("hessian", "outer", "functional")


# ----------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------


def _check_tensor(name: str, value: Tensor | None, shape: tuple[int, ...], like: Tensor) -> None:
    """Raise ValueError unless ``value`` is None or a tensor of ``shape`` with ``like``'s dtype/device."""
    if value is None:
        return
    if not isinstance(value, Tensor):
        raise ValueError(f"Invalid {name}: expected a torch.Tensor, got {type(value).__name__}.")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"Invalid {name} shape {tuple(value.shape)}. Expected {tuple(shape)}.")
    if value.dtype != like.dtype or value.device != like.device:
        raise ValueError(
            f"Invalid {name} dtype/device {value.dtype}/{value.device}. "
            f"All tensors must share the input's {like.dtype}/{like.device}; cast with .to(X)."
        )


def _as_batched(name: str, X: Tensor) -> tuple[Tensor, bool]:
    """Return ``X`` as ``(B, L, d)`` and whether it was batched; validate rank and dtype."""
    if not isinstance(X, Tensor):
        raise ValueError(f"Invalid {name}: expected a torch.Tensor, got {type(X).__name__}.")
    if X.ndim not in (2, 3):
        raise ValueError(
            f"Invalid {name} shape {tuple(X.shape)}. Expected (L, d) or (B, L, d); "
            f"add or remove a batch dimension."
        )
    if not X.is_floating_point():
        raise ValueError(f"Invalid {name} dtype {X.dtype}. Expected a floating dtype (use float64).")
    if X.shape[-2] == 0 or X.shape[-1] == 0 or (X.ndim == 3 and X.shape[0] == 0):
        raise ValueError(f"Invalid {name} shape {tuple(X.shape)}. Every dimension must be >= 1.")
    return (X if X.ndim == 3 else X.unsqueeze(0)), X.ndim == 3


def _batched_mask(name: str, mask: Tensor | None, B: int, L: int, batched: bool) -> Tensor | None:
    """Validate a ``(B, L)`` bool mask (``(L,)`` or ``(1, L)`` for an unbatched input); return ``(B, L)``."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"Invalid {name} dtype {got}. Expected a torch.bool tensor of shape (B, L).")
    allowed = [(B, L)] if batched else [(L,), (1, L)]
    if tuple(mask.shape) not in allowed:
        raise ValueError(f"Invalid {name} shape {tuple(mask.shape)}. Expected one of {allowed}.")
    return mask.reshape(B, L)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"Invalid {name}={value!r}. Must be one of {list(allowed)}.")


# ----------------------------------------------------------------------------------------------------
# Forward passes, written the obvious way. All take and return batched tensors (B, L, .).
# ----------------------------------------------------------------------------------------------------


def _blocked_logits(
    B: int, L: int, causal: bool, key_padding_mask: Tensor | None, device: torch.device
) -> Tensor:
    """Bool ``(B, L, L)``: True where query ``i`` may not attend to key ``j``.

    Future keys (``j > i``) are blocked when ``causal``; padded keys are blocked for every query. A row
    that would be blocked entirely (only a padded query can be, since query ``i`` always sees key ``i``)
    is left unblocked to avoid NaNs; such a row is dropped from the loss, so its content is irrelevant.
    """
    blocked = torch.zeros(B, L, L, dtype=torch.bool, device=device)
    if causal:
        blocked = blocked | torch.ones(L, L, dtype=torch.bool, device=device).triu(1)
    if key_padding_mask is not None:
        blocked = blocked | key_padding_mask[:, None, :]  # (B, 1, L): same keys for every query
    return blocked & ~blocked.all(dim=-1, keepdim=True)


def _attention_head(
    X: Tensor, W_Q: Tensor, W_K: Tensor, W_V: Tensor, blocked: Tensor, b_Q=None, b_K=None, b_V=None
) -> Tensor:
    """One head: ``softmax((X W_Q + b_Q)(X W_K + b_K)^T / sqrt(d_K)) (X W_V + b_V)``, ``(B, L, d_V)``."""
    Q = X @ W_Q + (0 if b_Q is None else b_Q)  # (B, L, d_K)
    K = X @ W_K + (0 if b_K is None else b_K)  # (B, L, d_K)
    V = X @ W_V + (0 if b_V is None else b_V)  # (B, L, d_V)
    T = Q @ K.transpose(-1, -2) / math.sqrt(W_Q.shape[-1])  # (B, L, L)
    A = torch.softmax(T.masked_fill(blocked, float("-inf")), dim=-1)  # rows sum to 1
    return A @ V


def _multi_head_attention(
    X: Tensor,
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    W_O: Tensor | None,
    n_heads: int,
    blocked: Tensor,
    b_Q=None,
    b_K=None,
    b_V=None,
    b_O=None,
    **modern,
) -> Tensor:
    """``concat_h(head_h) W_O + b_O``, ``(B, L, d_out)``; ``W_O=None`` means the identity.

    ``modern`` holds the options of :func:`_modern_attention` (grouped-query heads, memory, rotary, scale, QK-norm,
    rows that see no key); without them the heads are computed one by one as in the papers.
    """
    if any(v is not None and v is not False for v in modern.values()):
        return _modern_attention(X, W_Q, W_K, W_V, W_O, n_heads, blocked, b_Q, b_K, b_V, b_O, **modern)
    d_K = W_Q.shape[1] // n_heads
    d_V = W_V.shape[1] // n_heads
    heads = []
    for h in range(n_heads):
        qk, v = slice(h * d_K, (h + 1) * d_K), slice(h * d_V, (h + 1) * d_V)
        heads.append(
            _attention_head(
                X,
                W_Q[:, qk],
                W_K[:, qk],
                W_V[:, v],
                blocked,
                None if b_Q is None else b_Q[qk],
                None if b_K is None else b_K[qk],
                None if b_V is None else b_V[v],
            )
        )
    out = torch.cat(heads, dim=-1)  # (B, L, H * d_V)
    if W_O is not None:
        out = out @ W_O
    return out + (0 if b_O is None else b_O)


def _attention_blocked(
    B: int, L: int, L_kv: int, causal: bool, window: int | None, key_pad: Tensor | None, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(blocked (B, L, L_kv), dead (B, L))``: True where query ``i`` may not attend key ``j``; rows that see no key.

    Blocked: ``j > i`` when ``causal``; with a window ``w`` also ``j <= i - w`` (causal) or ``|i - j| >= w``; padded
    keys (``key_pad`` True) for every query. A row blocked entirely is unblocked (no NaN) and reported ``dead``: its
    attention is set to zero afterwards, so it outputs ``b_O`` and carries no curvature.
    """
    i = torch.arange(L, device=device)[:, None]
    j = torch.arange(L_kv, device=device)[None, :]
    blocked = torch.zeros(B, L, L_kv, dtype=torch.bool, device=device)
    if causal:
        blocked = blocked | (j > i)
    if window is not None:
        blocked = blocked | ((j <= i - window) if causal else ((i - j).abs() >= window))
    if key_pad is not None:
        blocked = blocked | key_pad[:, None, :]  # (B, 1, L_kv): same keys for every query
    dead = blocked.all(dim=-1)
    return blocked & ~dead[..., None], dead


def _rope_reference(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of ``x`` ``(B, heads, L, d_K)`` written out; tables ``(B or 1, L, r)``, halves duplicated.

    Half-split: ``x * cos + rotate_half(x) * sin`` on the first ``r`` dims. Interleaved (GPT-J): the frequencies
    repeated in pairs and ``rotate_every_two(x) = [-x_1, x_0, -x_3, x_2, ...]``. Dims ``r:`` pass unchanged.
    """
    r = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # (B or 1, 1, L, r)
    x_rot, x_pass = x[..., :r], x[..., r:]
    if interleaved:
        c = cos[..., : r // 2].repeat_interleave(2, dim=-1)
        s = sin[..., : r // 2].repeat_interleave(2, dim=-1)
        rotated = torch.stack([-x_rot[..., 1::2], x_rot[..., 0::2]], dim=-1).flatten(-2)
        y = x_rot * c + rotated * s
    else:
        half = r // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        y = x_rot * cos + rotated * sin
    return torch.cat([y, x_pass], dim=-1)


def _qk_norm_reference(x: Tensor, qk_norm: Mapping, side: str) -> Tensor:
    """Per-head RMSNorm ``x / sqrt(mean(x^2) + eps) * (offset + w)`` or LayerNorm over ``d_K`` of ``x``."""
    w = qk_norm.get(f"weight_{side}")
    w = None if w is None else w + qk_norm.get("weight_offset", 0.0)
    if qk_norm["kind"] == "rmsnorm":
        y = x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + qk_norm["eps"])
        return y if w is None else y * w
    return _layer_norm(x, qk_norm["eps"], w, qk_norm.get(f"bias_{side}"))


def _modern_attention(
    X: Tensor,
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    W_O: Tensor | None,
    n_heads: int,
    blocked: Tensor,
    b_Q=None,
    b_K=None,
    b_V=None,
    b_O=None,
    *,
    n_kv_heads: int | None = None,
    memory: Tensor | None = None,
    rotary: tuple[Tensor, Tensor] | None = None,
    rotary_interleaved: bool = False,
    scale: float | None = None,
    qk_norm: Mapping | None = None,
    dead: Tensor | None = None,
) -> Tensor:
    """Attention as modern models compute it, ``(B, L, d_out)``: QK-norm then rotary on the queries and keys, kv heads
    repeated for grouped-query attention (``repeat_interleave``), keys and values from ``memory`` in cross-attention,
    softmax scale ``scale`` (default ``1/sqrt(d_K)``), ``dead`` query rows ``(B, L)`` set to zero attention."""
    B, L, _ = X.shape
    X_kv = X if memory is None else memory
    L_kv = X_kv.shape[1]
    H_kv = n_heads if n_kv_heads is None else n_kv_heads
    d_K, d_V = W_Q.shape[1] // n_heads, W_V.shape[1] // H_kv
    q = (X @ W_Q + (0 if b_Q is None else b_Q)).reshape(B, L, n_heads, d_K).transpose(1, 2)  # (B, H, L, d_K)
    k = (X_kv @ W_K + (0 if b_K is None else b_K)).reshape(B, L_kv, H_kv, d_K).transpose(1, 2)  # (B, H_kv, L_kv, d_K)
    v = (X_kv @ W_V + (0 if b_V is None else b_V)).reshape(B, L_kv, H_kv, d_V).transpose(1, 2)  # (B, H_kv, L_kv, d_V)
    if qk_norm is not None:
        q, k = _qk_norm_reference(q, qk_norm, "q"), _qk_norm_reference(k, qk_norm, "k")
    if rotary is not None:
        cos, sin = (t if t.ndim == 3 else t[None] for t in rotary)
        q, k = _rope_reference(q, cos, sin, rotary_interleaved), _rope_reference(k, cos, sin, rotary_interleaved)
    k = k.repeat_interleave(n_heads // H_kv, dim=1)  # (B, H, L_kv, d_K): query head h reads kv head h // G
    v = v.repeat_interleave(n_heads // H_kv, dim=1)
    s = 1.0 / math.sqrt(d_K) if scale is None else scale
    T = q @ k.transpose(-1, -2) * s  # (B, H, L, L_kv)
    A = torch.softmax(T.masked_fill(blocked[:, None], float("-inf")), dim=-1)
    if dead is not None:
        A = A.masked_fill(dead[:, None, :, None], 0.0)
    out = (A @ v).transpose(1, 2).reshape(B, L, n_heads * d_V)
    if W_O is not None:
        out = out @ W_O
    return out + (0 if b_O is None else b_O)


def _layer_norm(X: Tensor, eps: float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """``(x - mean) / sqrt(biased var + eps) * weight + bias`` over the last dim."""
    mu = X.mean(dim=-1, keepdim=True)
    var = ((X - mu) ** 2).mean(dim=-1, keepdim=True)
    Y = (X - mu) / torch.sqrt(var + eps)
    if weight is not None:
        Y = Y * weight
    if bias is not None:
        Y = Y + bias
    return Y


def _gelu(x: Tensor) -> Tensor:
    """Exact GELU, ``x * Phi(x)`` with the normal CDF written through ``erf``."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _activation(name: str) -> Callable[[Tensor], Tensor]:
    return torch.relu if name == "relu" else _gelu


def _ffn(Y: Tensor, W_1: Tensor, W_2: Tensor, activation: str, residual: bool, b_1=None, b_2=None) -> Tensor:
    """``act(Y W_1 + b_1) W_2 + b_2 (+ Y)``, ``(B, L, d)``."""
    act = _activation(activation)
    S = act(Y @ W_1 + (0 if b_1 is None else b_1)) @ W_2 + (0 if b_2 is None else b_2)
    return S + Y if residual else S


def _transformer_block(
    X: Tensor,
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    W_1: Tensor,
    W_2: Tensor,
    fixed: Mapping[str, Tensor | None],
    n_heads: int,
    norm: str,
    activation: str,
    eps: float,
    blocked: Tensor,
) -> Tensor:
    """Post-LN or pre-LN block output ``Z``, ``(B, L, d)``; ``fixed`` holds W_O, biases and LN affine."""

    def mha(inp: Tensor) -> Tensor:
        return _multi_head_attention(
            inp, W_Q, W_K, W_V, fixed["W_O"], n_heads, blocked,
            fixed["b_Q"], fixed["b_K"], fixed["b_V"], fixed["b_O"],
        )  # fmt: skip

    def ln1(inp: Tensor) -> Tensor:
        return _layer_norm(inp, eps, fixed["ln1_weight"], fixed["ln1_bias"])

    def ln2(inp: Tensor) -> Tensor:
        return _layer_norm(inp, eps, fixed["ln2_weight"], fixed["ln2_bias"])

    if norm == "post":
        U = X + mha(X)
        Y = ln1(U)
        S = _ffn(Y, W_1, W_2, activation, True, fixed["b_1"], fixed["b_2"])  # includes + Y
        return ln2(S)
    Y = ln1(X)
    U = X + mha(Y)
    V = ln2(U)
    return U + _ffn(V, W_1, W_2, activation, False, fixed["b_1"], fixed["b_2"])


def _with_columns(W: Tensor, block: Tensor, start: int) -> Tensor:
    """``W`` with columns ``start:start + block.shape[1]`` replaced by ``block`` (a head's slice)."""
    stop = start + block.shape[1]
    return torch.cat([W[:, :start], block, W[:, stop:]], dim=1)


# ----------------------------------------------------------------------------------------------------
# The output-level loss and the generic dense-block computation
# ----------------------------------------------------------------------------------------------------


def _output_loss(
    F0: Tensor,
    keep: Tensor | None,
    target: Tensor | None,
    grad_output: Tensor | None,
    output_curvature: float | Tensor | None,
    batched: bool,
) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """Build ``loss(F)`` for a batched output ``F0`` ``(B, L, m)`` and its output Hessian diagonal.

    Returns:
        ``(loss, weight)``: ``loss`` maps ``(B, L, m)`` to a scalar; ``weight`` ``(B, L, m)`` is the
        diagonal of ``d^2 loss / dF^2`` (the loss is quadratic in ``F`` with a diagonal Hessian).
    """
    B, L, m = F0.shape
    out_shape = tuple(F0.shape) if batched else (L, m)
    if (target is None) == (grad_output is None):
        raise ValueError(
            "Pass exactly one of target= (squared-error loss) or grad_output= (surrogate loss); got "
            f"{'both' if target is not None else 'neither'}."
        )
    keep = torch.ones(B, L, dtype=torch.bool, device=F0.device) if keep is None else keep
    rows = keep[..., None].to(F0.dtype)  # (B, L, 1), 1 = row enters the loss
    L_b = keep.sum(dim=-1)  # (B,)
    if bool((L_b == 0).any()):
        raise ValueError(
            f"Invalid mask: sequence(s) {torch.nonzero(L_b == 0).flatten().tolist()} have no unmasked "
            "row, so their loss is undefined. Drop them from the batch."
        )

    if target is not None:
        if output_curvature is not None:
            raise ValueError(
                "output_curvature is only used with grad_output=; in target mode the curvature is "
                "fixed by the loss (2 / (L_b m B)). Remove output_curvature."
            )
        _check_tensor("target", target, out_shape, F0)
        T = target.reshape(B, L, m)

        def loss(F: Tensor) -> Tensor:
            per_sequence = (((F - T) ** 2) * rows).sum(dim=(-2, -1)) / (L_b * m)  # (B,)
            return per_sequence.mean()

        c_b = 2.0 / (L_b.to(F0.dtype) * m * B)  # (B,)
        return loss, c_b[:, None, None] * rows.expand(B, L, m)

    _check_tensor("grad_output", grad_output, out_shape, F0)
    G = grad_output.reshape(B, L, m)
    if output_curvature is None:
        c = torch.tensor(2.0 / (L * m), dtype=F0.dtype, device=F0.device)
    else:
        c = torch.as_tensor(output_curvature, dtype=F0.dtype, device=F0.device)
        if c.numel() != 1 or not bool(torch.isfinite(c).all()) or float(c) < 0:
            raise ValueError(f"Invalid output_curvature={output_curvature!r}. Must be a finite scalar >= 0.")
        c = c.reshape(())

    def surrogate(F: Tensor) -> Tensor:
        linear = (G * F * rows).sum()
        quadratic = 0.5 * c * (((F - F0) ** 2) * rows).sum()
        return linear + quadratic

    return surrogate, c * rows.expand(B, L, m)


def _dense_blocks(
    forward: Callable[..., Tensor],
    blocks: Mapping[str, Tensor],
    make_loss: Callable[[Tensor], tuple[Callable[[Tensor], Tensor], Tensor]],
) -> dict[str, dict[tuple[str, str], Tensor]]:
    """Dense hessian / outer / functional blocks for every ordered pair of ``blocks``.

    Args:
        forward: maps the block tensors (positionally, in ``blocks`` order) to the output ``(B, L, m)``.
        blocks: name -> parameter tensor at which to evaluate (``params0``).
        make_loss: maps the detached output ``F0`` to ``(loss, weight)`` as in :func:`_output_loss`.

    Returns:
        ``{kind: {(X, Y): (n_X, n_Y) matrix}}`` for kind in hessian, outer, functional.
    """
    names = list(blocks)
    primals = tuple(blocks.values())
    argnums = tuple(range(len(primals)))
    F0 = forward(*primals).detach()
    loss_of_output, weight = make_loss(F0)
    g = grad(loss_of_output)(F0).detach()  # dl/dF at params0, (B, L, m)

    def loss(*params: Tensor) -> Tensor:
        return loss_of_output(forward(*params))

    def linearised(*params: Tensor) -> Tensor:
        return (g * forward(*params)).sum()

    H = hessian(loss, argnums=argnums)(*primals)  # H[i][j]: shape_i + shape_j
    H_f = hessian(linearised, argnums=argnums)(*primals)
    J = jacrev(forward, argnums=argnums)(*primals)  # J[i]: F.shape + shape_i
    J = [J_i.reshape(F0.numel(), -1) for J_i in J]  # (B L m, n_i)
    w = weight.reshape(-1, 1)  # (B L m, 1)

    out: dict[str, dict[tuple[str, str], Tensor]] = {kind: {} for kind in _KINDS}
    for (i, X), (j, Y) in itertools.product(enumerate(names), repeat=2):
        n_X, n_Y = primals[i].numel(), primals[j].numel()
        out["hessian"][X, Y] = H[i][j].reshape(n_X, n_Y)
        out["functional"][X, Y] = H_f[i][j].reshape(n_X, n_Y)
        out["outer"][X, Y] = J[i].T @ (w * J[j])
    return out


def _pair_keys(
    mats: dict[str, dict[tuple[str, str], Tensor]], pairs: Sequence[tuple[str, str]], suffix: str = ""
) -> dict[str, Tensor]:
    return {f"{kind}/{X}{Y}{suffix}": mats[kind][X, Y] for kind in _KINDS for X, Y in pairs}


def _full_matrix(mats: dict[str, dict[tuple[str, str], Tensor]], order: Sequence[str], suffix: str = ""):
    """``{kind}/{order joined}{suffix}``: the block matrix of the blocks in ``order``."""
    name = "".join(order)
    return {
        f"{kind}/{name}{suffix}": torch.cat(
            [torch.cat([mats[kind][X, Y] for Y in order], dim=1) for X in order], dim=0
        )
        for kind in _KINDS
    }


# ----------------------------------------------------------------------------------------------------
# Public: attention
# ----------------------------------------------------------------------------------------------------


def self_attention_blocks(
    X: Tensor,
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    *,
    target: Tensor | None = None,
    grad_output: Tensor | None = None,
    output_curvature: float | Tensor | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Dense Hessian blocks of a single-head self-attention layer, by ``torch.func``.

    The layer is :math:`F = \\mathrm{softmax}_{\\text{row}}(X W_Q W_K^\\top X^\\top / \\sqrt{d_K}) X W_V`,
    with future keys set to :math:`-\\infty` when ``causal`` and padded keys when ``key_padding_mask``
    says so. Losses as in the module docstring.

    Args:
        X: input, ``(L, d)`` or ``(B, L, d)``.
        W_Q: query weight, ``(d, d_K)``.
        W_K: key weight, ``(d, d_K)``.
        W_V: value weight, ``(d, d_V)``.
        target: ``(L, d_V)`` or ``(B, L, d_V)``; squared-error loss, mean over the batch.
        grad_output: same shape as ``target``; surrogate loss, summed over the batch.
        output_curvature: ``c`` of the surrogate (``grad_output`` only); default ``2 / (L d_V)``.
        causal: block attention to future positions.
        key_padding_mask: ``(B, L)`` bool (``(L,)`` for an unbatched ``X``), True = padded. Padded keys
            are never attended to and padded query rows are dropped from the loss.

    Returns:
        ``{kind}/{XY}`` for kind in ``hessian, outer, functional`` and XY in ``VV, QQ, KK, VQ, VK, QK``,
        each ``(n_X, n_Y)`` with ``n_V = d d_V``, ``n_Q = n_K = d d_K``; plus ``{kind}/QKV``, the full
        ``(2 d d_K + d d_V)``-square matrix in block order Q, K, V.

    Raises:
        ValueError: on inconsistent shapes, dtypes or masks, or unless exactly one of ``target`` and
            ``grad_output`` is given.

    Example:
        >>> X = torch.randn(3, 4, dtype=torch.float64)
        >>> W_Q, W_K, W_V = (torch.randn(4, 2, dtype=torch.float64) for _ in range(3))
        >>> out = self_attention_blocks(X, W_Q, W_K, W_V, target=torch.zeros(3, 2, dtype=torch.float64))
        >>> out["hessian/VQ"].shape, out["outer/QKV"].shape
        (torch.Size([8, 8]), torch.Size([24, 24]))
    """
    Xb, batched = _as_batched("X", X)
    B, L, d = Xb.shape
    if not isinstance(W_Q, Tensor) or W_Q.ndim != 2:
        raise ValueError(f"Invalid W_Q: expected a (d, d_K) = ({d}, d_K) tensor, got {_describe(W_Q)}.")
    if not isinstance(W_V, Tensor) or W_V.ndim != 2:
        raise ValueError(f"Invalid W_V: expected a (d, d_V) = ({d}, d_V) tensor, got {_describe(W_V)}.")
    _check_tensor("W_Q", W_Q, (d, W_Q.shape[1]), Xb)
    _check_tensor("W_K", W_K, tuple(W_Q.shape), Xb)
    _check_tensor("W_V", W_V, (d, W_V.shape[1]), Xb)
    padded = _batched_mask("key_padding_mask", key_padding_mask, B, L, batched)
    blocked = _blocked_logits(B, L, causal, padded, Xb.device)
    keep = None if padded is None else ~padded

    def forward(V: Tensor, Q: Tensor, K: Tensor) -> Tensor:
        return _attention_head(Xb, Q, K, V, blocked)

    mats = _dense_blocks(
        forward,
        {"V": W_V, "Q": W_Q, "K": W_K},
        lambda F0: _output_loss(F0, keep, target, grad_output, output_curvature, batched),
    )
    return {**_pair_keys(mats, _ATTENTION_PAIRS), **_full_matrix(mats, ("Q", "K", "V"))}


def multi_head_attention_blocks(
    X: Tensor,
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    n_heads: int,
    *,
    b_Q: Tensor | None = None,
    b_K: Tensor | None = None,
    b_V: Tensor | None = None,
    b_O: Tensor | None = None,
    target: Tensor | None = None,
    grad_output: Tensor | None = None,
    output_curvature: float | Tensor | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    n_kv_heads: int | None = None,
    window: int | None = None,
    scale: float | None = None,
    rotary: tuple[Tensor, Tensor] | None = None,
    rotary_interleaved: bool = False,
    qk_norm: Mapping | None = None,
    memory: Tensor | None = None,
    memory_padding_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-head dense Hessian blocks of multi-head attention, by ``torch.func``.

    :math:`F = \\mathrm{concat}_h(A_h (X W_V^h + b_V^h)) W_O + b_O` with
    :math:`A_h = \\mathrm{softmax}((X W_Q^h + b_Q^h)(X W_K^h + b_K^h)^\\top / \\sqrt{d_K})`. For each head
    ``h`` the blocks are those of that head's own slices ``W_V^h, W_Q^h, W_K^h`` (the diagonal head
    blocks of the full Hessian); pairs between different heads are not computed. Losses as in the
    module docstring with output width ``m = d_out``.

    Args:
        X: input, ``(L, d)`` or ``(B, L, d)``.
        W_Q: ``(d, H d_K)``; head ``h`` owns columns ``h d_K:(h+1) d_K``.
        W_K: ``(d, H d_K)``.
        W_V: ``(d, H d_V)``.
        W_O: ``(H d_V, d_out)``; head ``h`` owns rows ``h d_V:(h+1) d_V``.
        n_heads: ``H``, a positive int dividing the widths of ``W_Q`` and ``W_V``.
        b_Q: optional ``(H d_K,)``. b_K: optional ``(H d_K,)``. b_V: optional ``(H d_V,)``.
        b_O: optional ``(d_out,)``.
        target: ``(L, d_out)`` or ``(B, L, d_out)``; squared-error loss, mean over the batch.
        grad_output: same shape as ``target``; surrogate loss, summed over the batch.
        output_curvature: ``c`` of the surrogate (``grad_output`` only); default ``2 / (L d_out)``.
        causal: block attention to future positions.
        key_padding_mask: ``(B, L)`` bool, True = padded (see :func:`self_attention_blocks`); with ``memory`` it
            only drops query rows from the loss.
        n_kv_heads: ``H_kv`` key/value heads (grouped-query attention): ``W_K`` ``(d_kv, H_kv d_K)``, ``W_V``
            ``(d_kv, H_kv d_V)``, query head ``h`` reads kv head ``h // (H / H_kv)`` (the kv heads are
            ``repeat_interleave``-d). ``None``: ``H``.
        window: sliding window ``w``: key ``j`` visible to query ``i`` iff ``i - w < j <= i`` (causal) or
            ``|i - j| < w``.
        scale: softmax scale (default ``1/sqrt(d_K)``).
        rotary: ``(cos, sin)``, each ``(L, r)`` or ``(B or 1, L, r)``, the frequencies' halves duplicated
            (``cos[..., i] == cos[..., i + r/2]``); the first ``r`` dims of each head's queries and keys rotate.
        rotary_interleaved: GPT-J layout (pairs ``2i, 2i + 1``) instead of the half-split one.
        qk_norm: ``{"kind": "rmsnorm" | "layernorm", "eps", "weight_q", "weight_k", "bias_q", "bias_k",
            "weight_offset"}``, applied per head to the queries and keys before the rotary embedding.
        memory: ``(B, L_kv, d_kv)`` cross-attention source of the keys and values.
        memory_padding_mask: ``(B, L_kv)`` bool, True = padded memory position. A query row that sees no key
            has zero attention.

    Returns:
        ``{kind}/{XY}/h{i}`` for kind in ``hessian, outer, functional``, XY in
        ``VV, QQ, KK, VQ, VK, QK`` and every head ``i``; plus ``{kind}/QKV/h{i}`` (block order Q, K, V).
        With a ``qk_norm`` that has parameters, ``{kind}/N1N1``, ``{kind}/N2N2``, ``{kind}/N1N2`` (no head suffix):
        the blocks of the query norm's parameters ``N1 = [weight_q; bias_q]`` (those it has, ``(p, d_K)`` in vec_r
        order) and the key norm's ``N2``, each shared by every head.
        With ``H_kv < H`` the blocks with a query weight stay per query head (``QQ/h{i}``; ``VQ/h{i}`` and
        ``QK/h{i}`` pair head ``i``'s ``W_Q`` with its group's ``W_V``, ``W_K``), those of ``W_K``, ``W_V`` alone are
        per kv group (``KK/g{j}``, ``VV/g{j}``, ``VK/g{j}``), and ``QKV/g{j}`` is group ``j``'s whole Hessian in block
        order ``Q`` (its query heads in order), ``K``, ``V``.

    Raises:
        ValueError: on inconsistent shapes, dtypes, masks or ``n_heads``, or unless exactly one of
            ``target`` and ``grad_output`` is given.

    Example:
        >>> X = torch.randn(3, 4, dtype=torch.float64)
        >>> W_Q, W_K, W_V = (torch.randn(4, 4, dtype=torch.float64) for _ in range(3))
        >>> out = multi_head_attention_blocks(
        ...     X, W_Q, W_K, W_V, torch.eye(4, dtype=torch.float64), 2, grad_output=torch.ones(3, 4).double()
        ... )
        >>> out["outer/QQ/h1"].shape
        torch.Size([8, 8])
    """
    Xb, batched = _as_batched("X", X)
    B, L, d = Xb.shape
    modern = dict(
        n_kv_heads=n_kv_heads,
        window=window,
        scale=scale,
        rotary=rotary,
        rotary_interleaved=rotary_interleaved,
        qk_norm=qk_norm,
        memory=memory,
        memory_padding_mask=memory_padding_mask,
    )
    if any(v is not None and v is not False for v in modern.values()):
        return _modern_attention_blocks(
            Xb, batched, W_Q, W_K, W_V, W_O, n_heads, b_Q=b_Q, b_K=b_K, b_V=b_V, b_O=b_O, target=target,
            grad_output=grad_output, output_curvature=output_curvature, causal=causal,
            key_padding_mask=key_padding_mask, **modern,
        )  # fmt: skip
    d_K, d_V = _check_heads(d, W_Q, W_K, W_V, n_heads, Xb)
    if not isinstance(W_O, Tensor) or W_O.ndim != 2:
        raise ValueError(f"Invalid W_O: expected a (H d_V, d_out) tensor, got {_describe(W_O)}.")
    _check_tensor("W_O", W_O, (n_heads * d_V, W_O.shape[1]), Xb)
    _check_tensor("b_Q", b_Q, (n_heads * d_K,), Xb)
    _check_tensor("b_K", b_K, (n_heads * d_K,), Xb)
    _check_tensor("b_V", b_V, (n_heads * d_V,), Xb)
    _check_tensor("b_O", b_O, (W_O.shape[1],), Xb)
    padded = _batched_mask("key_padding_mask", key_padding_mask, B, L, batched)
    blocked = _blocked_logits(B, L, causal, padded, Xb.device)
    keep = None if padded is None else ~padded

    out: dict[str, Tensor] = {}
    for h in range(n_heads):

        def forward(V: Tensor, Q: Tensor, K: Tensor, h: int = h) -> Tensor:
            return _multi_head_attention(
                Xb,
                _with_columns(W_Q, Q, h * d_K),
                _with_columns(W_K, K, h * d_K),
                _with_columns(W_V, V, h * d_V),
                W_O, n_heads, blocked, b_Q, b_K, b_V, b_O,
            )  # fmt: skip

        head_blocks = {
            "V": W_V[:, h * d_V : (h + 1) * d_V],
            "Q": W_Q[:, h * d_K : (h + 1) * d_K],
            "K": W_K[:, h * d_K : (h + 1) * d_K],
        }
        mats = _dense_blocks(
            forward,
            head_blocks,
            lambda F0: _output_loss(F0, keep, target, grad_output, output_curvature, batched),
        )
        out.update(_pair_keys(mats, _ATTENTION_PAIRS, f"/h{h}"))
        out.update(_full_matrix(mats, ("Q", "K", "V"), f"/h{h}"))
    return out


def _modern_attention_blocks(
    Xb: Tensor,
    batched: bool,
    W_Q: Tensor,
    W_K: Tensor,
    W_V: Tensor,
    W_O: Tensor,
    n_heads: int,
    *,
    b_Q,
    b_K,
    b_V,
    b_O,
    target,
    grad_output,
    output_curvature,
    causal: bool,
    key_padding_mask,
    n_kv_heads,
    window,
    scale,
    rotary,
    rotary_interleaved: bool,
    qk_norm,
    memory,
    memory_padding_mask,
) -> dict[str, Tensor]:
    """:func:`multi_head_attention_blocks` with the modern options: one dense Hessian per kv group."""
    B, L, d = Xb.shape
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"Invalid n_heads={n_heads!r}. Must be an int >= 1.")
    H_kv = n_heads if n_kv_heads is None else n_kv_heads
    if isinstance(H_kv, bool) or not isinstance(H_kv, int) or H_kv < 1 or n_heads % H_kv:
        raise ValueError(f"Invalid n_kv_heads={n_kv_heads!r}. Must be an int >= 1 dividing n_heads={n_heads}.")
    G = n_heads // H_kv
    mem = None
    if memory is not None:
        mem, mem_batched = _as_batched("memory", memory)
        if mem_batched != batched or mem.shape[0] != B:
            raise ValueError(f"Invalid memory shape {tuple(memory.shape)}. It must be batched like X ({B} sequences).")
        _check_tensor("memory", mem, tuple(mem.shape), Xb)
    L_kv, d_kv = (L, d) if mem is None else mem.shape[1:]
    for name, W, rows in (("W_Q", W_Q, d), ("W_K", W_K, d_kv), ("W_V", W_V, d_kv), ("W_O", W_O, None)):
        if not isinstance(W, Tensor) or W.ndim != 2 or (rows is not None and W.shape[0] != rows):
            raise ValueError(f"Invalid {name}: expected a ({rows}, heads * width) tensor, got {_describe(W)}.")
        _check_tensor(name, W, tuple(W.shape), Xb)
    if W_Q.shape[1] % n_heads or W_K.shape[1] % H_kv or W_V.shape[1] % H_kv:
        raise ValueError("Invalid widths: W_Q must split into n_heads heads, W_K and W_V into n_kv_heads heads.")
    d_K, d_V = W_Q.shape[1] // n_heads, W_V.shape[1] // H_kv
    if W_K.shape[1] != H_kv * d_K or W_O.shape[0] != n_heads * d_V:
        raise ValueError(
            f"Invalid W_K {tuple(W_K.shape)} or W_O {tuple(W_O.shape)}: expected ({d_kv}, {H_kv * d_K}) and "
            f"({n_heads * d_V}, d_out)."
        )
    for name, b, n in (("b_Q", b_Q, n_heads * d_K), ("b_K", b_K, H_kv * d_K), ("b_V", b_V, H_kv * d_V)):
        _check_tensor(name, b, (n,), Xb)
    _check_tensor("b_O", b_O, (W_O.shape[1],), Xb)
    if rotary is not None:
        if mem is not None:
            raise ValueError("rotary applies to self-attention only.")
        if not (isinstance(rotary, (tuple, list)) and len(rotary) == 2):
            raise ValueError("Invalid rotary: expected a (cos, sin) pair of tensors.")
        for t in rotary:
            if t.ndim not in (2, 3) or t.shape[-2] != L or t.shape[-1] % 2 or t.shape[-1] > d_K:
                raise ValueError(f"Invalid rotary table shape {tuple(t.shape)}. Expected (L, r) or (B, L, r).")
    padded = _batched_mask("key_padding_mask", key_padding_mask, B, L, batched)
    mem_padded = None if mem is None else _batched_mask("memory_padding_mask", memory_padding_mask, B, L_kv, batched)
    key_pad = padded if mem is None else mem_padded
    blocked, dead = _attention_blocked(B, L, L_kv, causal, window, key_pad, Xb.device)
    keep = None if padded is None else ~padded
    opts = dict(
        n_kv_heads=H_kv, memory=mem, rotary=rotary, rotary_interleaved=rotary_interleaved, scale=scale,
        qk_norm=qk_norm, dead=dead,
    )  # fmt: skip
    q_names = ["Q"] if G == 1 else [f"Q{s}" for s in range(G)]

    out: dict[str, Tensor] = {}
    for j in range(H_kv):

        def forward(V: Tensor, *rest: Tensor, j: int = j) -> Tensor:
            *Qs, K = rest
            Wq = W_Q
            for s, Q in enumerate(Qs):
                Wq = _with_columns(Wq, Q, (j * G + s) * d_K)
            return _multi_head_attention(
                Xb, Wq, _with_columns(W_K, K, j * d_K), _with_columns(W_V, V, j * d_V),
                W_O, n_heads, blocked, b_Q, b_K, b_V, b_O, **opts,
            )  # fmt: skip

        group_blocks = {"V": W_V[:, j * d_V : (j + 1) * d_V]}
        group_blocks.update((nm, W_Q[:, (j * G + s) * d_K : (j * G + s + 1) * d_K]) for s, nm in enumerate(q_names))
        group_blocks["K"] = W_K[:, j * d_K : (j + 1) * d_K]
        mats = _dense_blocks(
            forward,
            group_blocks,
            lambda F0: _output_loss(F0, keep, target, grad_output, output_curvature, batched),
        )
        g_suffix = f"/h{j}" if G == 1 else f"/g{j}"
        for kind in _KINDS:
            for X_, Y_ in (("V", "V"), ("K", "K"), ("V", "K")):
                out[f"{kind}/{X_}{Y_}{g_suffix}"] = mats[kind][X_, Y_]
            for s, nm in enumerate(q_names):
                h = j * G + s
                for pair, (X_, Y_) in (("QQ", (nm, nm)), ("VQ", ("V", nm)), ("QK", (nm, "K"))):
                    out[f"{kind}/{pair}/h{h}"] = mats[kind][X_, Y_]
            order = [*q_names, "K", "V"]
            out[f"{kind}/QKV{g_suffix}"] = torch.cat(
                [torch.cat([mats[kind][X_, Y_] for Y_ in order], dim=1) for X_ in order], dim=0
            )
    if qk_norm is not None:

        def with_norm(norm: Mapping) -> Tensor:
            return _multi_head_attention(
                Xb, W_Q, W_K, W_V, W_O, n_heads, blocked, b_Q, b_K, b_V, b_O, **{**opts, "qk_norm": norm}
            )  # fmt: skip

        out.update(
            _qk_norm_parameter_blocks(
                qk_norm, with_norm, lambda F0: _output_loss(F0, keep, target, grad_output, output_curvature, batched)
            )
        )
    return out


def _qk_norm_parameter_blocks(
    qk_norm: Mapping,
    forward: Callable[[Mapping], Tensor],
    make_loss: Callable[[Tensor], tuple[Callable[[Tensor], Tensor], Tensor]],
) -> dict[str, Tensor]:
    """``{kind}/N1N1``, ``{kind}/N2N2``, ``{kind}/N1N2``: the blocks of the QK-norm's own parameters.

    ``N1`` is the query norm's ``[weight_q; bias_q]`` (the entries ``qk_norm`` has, stacked as rows, vec_r order),
    ``N2`` the key norm's; ``forward`` maps a ``qk_norm`` dict to the attention output. A norm with neither weight
    nor bias has no block.
    """
    entries = {s: [e for e in ("weight", "bias") if qk_norm.get(f"{e}_{s}") is not None] for s in ("q", "k")}
    sides = {name: side for name, side in (("N1", "q"), ("N2", "k")) if entries[side]}
    blocks = {name: torch.stack([qk_norm[f"{e}_{side}"] for e in entries[side]]) for name, side in sides.items()}
    if not blocks:
        return {}

    def of_parameters(*params: Tensor) -> Tensor:
        norm = dict(qk_norm)
        for name, p in zip(blocks, params, strict=True):
            norm.update({f"{e}_{sides[name]}": p[i] for i, e in enumerate(entries[sides[name]])})
        return forward(norm)

    mats = _dense_blocks(of_parameters, blocks, make_loss)
    pairs = [(X_, Y_) for X_, Y_ in (("N1", "N1"), ("N2", "N2"), ("N1", "N2")) if X_ in blocks and Y_ in blocks]
    return _pair_keys(mats, pairs)


def _describe(value: object) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def _check_heads(d: int, W_Q, W_K, W_V, n_heads: int, like: Tensor) -> tuple[int, int]:
    """Validate packed attention weights and ``n_heads``; return per-head ``(d_K, d_V)``."""
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"Invalid n_heads={n_heads!r}. Must be an int >= 1.")
    for name, W in (("W_Q", W_Q), ("W_K", W_K), ("W_V", W_V)):
        if not isinstance(W, Tensor) or W.ndim != 2:
            raise ValueError(f"Invalid {name}: expected a ({d}, H * width) tensor, got {_describe(W)}.")
    _check_tensor("W_Q", W_Q, (d, W_Q.shape[1]), like)
    _check_tensor("W_K", W_K, tuple(W_Q.shape), like)
    _check_tensor("W_V", W_V, (d, W_V.shape[1]), like)
    for name, W in (("W_Q", W_Q), ("W_V", W_V)):
        if W.shape[1] % n_heads != 0 or W.shape[1] == 0:
            raise ValueError(
                f"Invalid {name} width {W.shape[1]} for n_heads={n_heads}. The width must be a positive "
                f"multiple of n_heads (head h owns columns h*width:(h+1)*width)."
            )
    return W_Q.shape[1] // n_heads, W_V.shape[1] // n_heads


# ----------------------------------------------------------------------------------------------------
# Public: LayerNorm
# ----------------------------------------------------------------------------------------------------


def _check_layernorm(X: Tensor, eps: float, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """Validate LayerNorm inputs; return ``X`` as ``(N, n)`` rows."""
    if not isinstance(X, Tensor) or X.ndim not in (2, 3):
        raise ValueError(f"Invalid X: expected (L, n) or (B, L, n), got {_describe(X)}.")
    if not X.is_floating_point():
        raise ValueError(f"Invalid X dtype {X.dtype}. Expected a floating dtype (use float64).")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"Invalid eps={eps!r}. Must be a finite number >= 0.")
    n = X.shape[-1]
    _check_tensor("weight", weight, (n,), X)
    _check_tensor("bias", bias, (n,), X)
    return X.reshape(-1, n)


def layernorm_dense(
    X: Tensor, *, eps: float = 1e-5, weight: Tensor | None = None, bias: Tensor | None = None
) -> dict[str, Tensor]:
    """Dense Jacobian and Hessian of LayerNorm over the last dim, by ``torch.func``.

    :math:`y_i = (x_i - \\mu_i) / \\sqrt{\\sigma_i^2 + \\epsilon} \\odot \\text{weight} + \\text{bias}` for
    every row ``x_i`` (biased variance, as ``torch.nn.functional.layer_norm``), seen as a map of
    :math:`x = \\mathrm{vec}_r(X)` flattened over all ``N`` rows (``N = L`` or ``B L``).

    Args:
        X: ``(L, n)`` or ``(B, L, n)``.
        eps: the variance floor, ``>= 0``.
        weight: optional ``(n,)`` affine scale. bias: optional ``(n,)`` affine shift.

    Returns:
        ``jacobian``: ``(N n, N n)``, ``[k, a] = dy_k/dx_a``;
        ``hessian``: ``(N n, N n, N n)``, ``[k, a, b] = d^2 y_k / dx_a dx_b``.
        Both are block-diagonal over rows.

    Raises:
        ValueError: on a bad shape, dtype or ``eps``.

    Example:
        >>> out = layernorm_dense(torch.randn(2, 3, dtype=torch.float64))
        >>> out["jacobian"].shape, out["hessian"].shape
        (torch.Size([6, 6]), torch.Size([6, 6, 6]))
    """
    rows = _check_layernorm(X, eps, weight, bias)

    def ln_flat(x: Tensor) -> Tensor:
        return _layer_norm(x.reshape(rows.shape), eps, weight, bias).reshape(-1)

    x = rows.reshape(-1)
    return {"jacobian": jacrev(ln_flat)(x), "hessian": hessian(ln_flat)(x)}


def layernorm_contracted_hessian(
    X: Tensor, grad_output: Tensor, *, eps: float = 1e-5, weight: Tensor | None = None
) -> Tensor:
    """:math:`\\sum_k g_k \\nabla^2 y_k` for LayerNorm, by ``torch.func``.

    The Hessian of :math:`x \\mapsto \\langle g, \\mathrm{LN}(x)\\rangle` with
    :math:`g = \\mathrm{vec}_r(\\text{grad\\_output})` held fixed; the bias does not enter.

    Args:
        X: ``(L, n)`` or ``(B, L, n)``.
        grad_output: same shape as ``X``.
        eps: the variance floor, ``>= 0``.
        weight: optional ``(n,)`` affine scale.

    Returns:
        ``(N n, N n)``, block-diagonal over the ``N`` rows.

    Raises:
        ValueError: on a bad shape, dtype or ``eps``.

    Example:
        >>> X = torch.randn(2, 3, dtype=torch.float64)
        >>> layernorm_contracted_hessian(X, torch.ones_like(X)).shape
        torch.Size([6, 6])
    """
    rows = _check_layernorm(X, eps, weight, None)
    _check_tensor("grad_output", grad_output, tuple(X.shape), X)
    g = grad_output.reshape(-1).detach()

    def contracted(x: Tensor) -> Tensor:
        return (g * _layer_norm(x.reshape(rows.shape), eps, weight).reshape(-1)).sum()

    return hessian(contracted)(rows.reshape(-1))


# ----------------------------------------------------------------------------------------------------
# Public: FFN and the full Transformer block
# ----------------------------------------------------------------------------------------------------


def ffn_blocks(
    Y: Tensor,
    W_1: Tensor,
    W_2: Tensor,
    *,
    b_1: Tensor | None = None,
    b_2: Tensor | None = None,
    activation: str = "relu",
    residual: bool = True,
    target: Tensor | None = None,
    grad_output: Tensor | None = None,
    output_curvature: float | Tensor | None = None,
    row_mask: Tensor | None = None,
) -> dict[str, Tensor]:
    """Dense Hessian blocks of a feed-forward layer, by ``torch.func``.

    :math:`S = \\sigma(Y W_1 + b_1) W_2 + b_2\\ (+\\,Y \\text{ if residual})` with ``relu`` or the exact
    (erf) ``gelu``. Losses as in the module docstring with output width ``m = d``.

    Args:
        Y: input, ``(L, d)`` or ``(B, L, d)``.
        W_1: ``(d, d_ff)``. W_2: ``(d_ff, d)``.
        b_1: optional ``(d_ff,)``. b_2: optional ``(d,)``.
        activation: ``"relu"`` or ``"gelu"``.
        residual: add ``Y`` to the output.
        target: same shape as ``Y``; squared-error loss, mean over the batch.
        grad_output: same shape as ``Y``; surrogate loss, summed over the batch.
        output_curvature: ``c`` of the surrogate (``grad_output`` only); default ``2 / (L d)``.
        row_mask: ``(B, L)`` bool (``(L,)`` for an unbatched ``Y``), True = keep; dropped rows contribute
            nothing and shrink the target-mode normaliser to ``L_b d``.

    Returns:
        ``{kind}/{XY}`` for kind in ``hessian, outer, functional`` and XY in ``W1W1, W2W2, W1W2``.

    Raises:
        ValueError: on inconsistent shapes, dtypes, masks or ``activation``, or unless exactly one of
            ``target`` and ``grad_output`` is given.

    Example:
        >>> Y = torch.randn(3, 2, dtype=torch.float64)
        >>> W_1, W_2 = torch.randn(2, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
        >>> ffn_blocks(Y, W_1, W_2, activation="gelu", target=torch.zeros_like(Y))["hessian/W1W2"].shape
        torch.Size([8, 8])
    """
    _check_choice("activation", activation, _ACTIVATIONS)
    Yb, batched = _as_batched("Y", Y)
    B, L, d = Yb.shape
    if not isinstance(W_1, Tensor) or W_1.ndim != 2:
        raise ValueError(f"Invalid W_1: expected a (d, d_ff) = ({d}, d_ff) tensor, got {_describe(W_1)}.")
    d_ff = W_1.shape[1]
    _check_tensor("W_1", W_1, (d, d_ff), Yb)
    _check_tensor("W_2", W_2, (d_ff, d), Yb)
    _check_tensor("b_1", b_1, (d_ff,), Yb)
    _check_tensor("b_2", b_2, (d,), Yb)
    keep = _batched_mask("row_mask", row_mask, B, L, batched)

    def forward(W1: Tensor, W2: Tensor) -> Tensor:
        return _ffn(Yb, W1, W2, activation, residual, b_1, b_2)

    mats = _dense_blocks(
        forward,
        {"W1": W_1, "W2": W_2},
        lambda F0: _output_loss(F0, keep, target, grad_output, output_curvature, batched),
    )
    return _pair_keys(mats, (("W1", "W1"), ("W2", "W2"), ("W1", "W2")))


# Optional params of transformer_block_blocks: held fixed, not differentiated.
_BLOCK_BIASES = ("b_Q", "b_K", "b_V", "b_O", "b_1", "b_2")
_BLOCK_LN_AFFINE = ("ln1_weight", "ln1_bias", "ln2_weight", "ln2_bias")
_BLOCK_FIXED = ("W_O", *_BLOCK_BIASES, *_BLOCK_LN_AFFINE)
_BLOCK_KEYS = {"W_Q", "W_K", "W_V", "W_1", "W_2", "n_heads", *_BLOCK_FIXED}


def transformer_block_blocks(
    X: Tensor,
    params: Mapping[str, Tensor | int],
    *,
    norm: str = "post",
    activation: str = "relu",
    eps: float = 1e-5,
    causal: bool = False,
    target: Tensor | None = None,
    grad_output: Tensor | None = None,
    output_curvature: float | Tensor | None = None,
) -> dict[str, Tensor]:
    """Dense Hessian blocks of a full post-LN or pre-LN Transformer block, by ``torch.func``.

    * post (formula sheet §6): :math:`U = X + \\mathrm{MHA}(X)`, :math:`Y = \\mathrm{LN}_1(U)`,
      :math:`S = \\sigma(Y W_1 + b_1) W_2 + b_2 + Y`, :math:`Z = \\mathrm{LN}_2(S)`.
    * pre: :math:`Y = \\mathrm{LN}_1(X)`, :math:`U = X + \\mathrm{MHA}(Y)`, :math:`V = \\mathrm{LN}_2(U)`,
      :math:`Z = U + \\sigma(V W_1 + b_1) W_2 + b_2`.

    MHA is that of :func:`multi_head_attention_blocks`; the loss acts on ``Z`` (width ``m = d``).

    Args:
        X: input, ``(L, d)`` or ``(B, L, d)``.
        params: ``W_Q, W_K`` ``(d, H d_K)``, ``W_V`` ``(d, H d_V)``, ``W_1`` ``(d, d_ff)``,
            ``W_2`` ``(d_ff, d)``; optional ``n_heads`` (int, default 1), ``W_O`` ``(H d_V, d)`` (default
            the identity, which needs ``H d_V = d``), biases ``b_Q, b_K`` ``(H d_K,)``, ``b_V`` ``(H d_V,)``,
            ``b_O, b_2`` ``(d,)``, ``b_1`` ``(d_ff,)``, LayerNorm affine ``ln1_weight, ln1_bias,
            ln2_weight, ln2_bias`` ``(d,)`` (default identity / zero).
        norm: ``"post"`` or ``"pre"``.
        activation: ``"relu"`` or ``"gelu"`` (exact).
        eps: LayerNorm variance floor, ``>= 0``.
        causal: block attention to future positions.
        target: same shape as ``X``; squared-error loss, mean over the batch.
        grad_output: same shape as ``X``; surrogate loss, summed over the batch.
        output_curvature: ``c`` of the surrogate (``grad_output`` only); default ``2 / (L d)``.

    Returns:
        ``{kind}/{XY}`` for kind in ``hessian, outer, functional`` and the 15 pairs XY of the block
        order ``V, Q, K, W1, W2`` with X not after Y (``VV, VQ, ..., W1W2, W2W2``). With ``n_heads > 1``
        every pair involving an attention block is per head with suffix ``/h{i}`` (pairs between
        different heads are not computed); ``W1W1, W1W2, W2W2`` have no suffix.

    Raises:
        ValueError: on unknown or missing ``params`` keys, inconsistent shapes or dtypes, a bad
            ``norm``/``activation``/``eps``, or unless exactly one of ``target`` and ``grad_output`` is given.

    Example:
        >>> X = torch.randn(3, 4, dtype=torch.float64)
        >>> p = {k: torch.randn(4, 4, dtype=torch.float64) for k in ("W_Q", "W_K", "W_V", "W_1", "W_2")}
        >>> out = transformer_block_blocks(X, p, norm="pre", grad_output=torch.ones_like(X))
        >>> out["hessian/QW1"].shape
        torch.Size([16, 16])
    """
    _check_choice("norm", norm, _NORMS)
    _check_choice("activation", activation, _ACTIVATIONS)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0 or math.isinf(eps):
        raise ValueError(f"Invalid eps={eps!r}. Must be a finite number >= 0.")
    if not isinstance(params, Mapping):
        raise ValueError(f"Invalid params: expected a dict of tensors, got {type(params).__name__}.")
    unknown = sorted(set(params) - _BLOCK_KEYS)
    if unknown:
        raise ValueError(f"Invalid params keys {unknown}. Allowed keys: {sorted(_BLOCK_KEYS)}.")
    missing = [k for k in ("W_Q", "W_K", "W_V", "W_1", "W_2") if k not in params]
    if missing:
        raise ValueError(f"Missing params {missing}; W_Q, W_K, W_V, W_1 and W_2 are required.")
    Xb, batched = _as_batched("X", X)
    B, L, d = Xb.shape
    n_heads = params.get("n_heads", 1)
    W_Q, W_K, W_V, W_1, W_2 = (params[k] for k in ("W_Q", "W_K", "W_V", "W_1", "W_2"))
    d_K, d_V = _check_heads(d, W_Q, W_K, W_V, n_heads, Xb)
    if not isinstance(W_1, Tensor) or W_1.ndim != 2:
        raise ValueError(f"Invalid W_1: expected a (d, d_ff) = ({d}, d_ff) tensor, got {_describe(W_1)}.")
    d_ff = W_1.shape[1]
    _check_tensor("W_1", W_1, (d, d_ff), Xb)
    _check_tensor("W_2", W_2, (d_ff, d), Xb)
    fixed = {k: params.get(k) for k in _BLOCK_FIXED}
    if fixed["W_O"] is None and n_heads * d_V != d:
        raise ValueError(
            f"Invalid params: W_O omitted (identity) needs n_heads * d_V == d, got {n_heads} * {d_V} != {d}. "
            f"Pass W_O of shape ({n_heads * d_V}, {d})."
        )
    expected = {
        "W_O": (n_heads * d_V, d), "b_Q": (n_heads * d_K,), "b_K": (n_heads * d_K,),
        "b_V": (n_heads * d_V,), "b_O": (d,), "b_1": (d_ff,), "b_2": (d,),
        "ln1_weight": (d,), "ln1_bias": (d,), "ln2_weight": (d,), "ln2_bias": (d,),
    }  # fmt: skip
    for k, shape in expected.items():
        _check_tensor(k, fixed[k], shape, Xb)
    blocked = _blocked_logits(B, L, causal, None, Xb.device)

    out: dict[str, Tensor] = {}
    for h in range(n_heads):

        def forward(V: Tensor, Q: Tensor, K: Tensor, W1: Tensor, W2: Tensor, h: int = h) -> Tensor:
            return _transformer_block(
                Xb,
                _with_columns(W_Q, Q, h * d_K),
                _with_columns(W_K, K, h * d_K),
                _with_columns(W_V, V, h * d_V),
                W1, W2, fixed, n_heads, norm, activation, eps, blocked,
            )  # fmt: skip

        blocks = {
            "V": W_V[:, h * d_V : (h + 1) * d_V],
            "Q": W_Q[:, h * d_K : (h + 1) * d_K],
            "K": W_K[:, h * d_K : (h + 1) * d_K],
            "W1": W_1,
            "W2": W_2,
        }
        mats = _dense_blocks(
            forward,
            blocks,
            lambda F0: _output_loss(F0, None, target, grad_output, output_curvature, batched),
        )
        attention_pairs = [p for p in _BLOCK_PAIRS if p[0] in _ATTENTION_ORDER]
        out.update(_pair_keys(mats, attention_pairs, f"/h{h}" if n_heads > 1 else ""))
        if h == 0:
            out.update(_pair_keys(mats, [p for p in _BLOCK_PAIRS if p[0] not in _ATTENTION_ORDER]))
    return {k: out[k] for k in sorted(out, key=_canonical_position)}


def _canonical_position(key: str) -> tuple[int, int, str]:
    """Sort keys by kind, then by the canonical pair order, then by head suffix."""
    kind, pair, *head = key.split("/")
    pair_names = ["".join(p) for p in _BLOCK_PAIRS]
    return _KINDS.index(kind), pair_names.index(pair), "/".join(head)


# ----------------------------------------------------------------------------------------------------
# Public: norms
# ----------------------------------------------------------------------------------------------------


def spectral_norm(M: Tensor) -> Tensor:
    """Spectral norm (largest singular value) of a matrix.

    Symmetric square matrices (to relative round-off ``1e-10``) use ``max |eigvalsh|``; all others use
    ``max svdvals``. The two agree on symmetric input; ``eigvalsh`` is just cheaper and more accurate.

    Args:
        M: ``(p, q)``.

    Returns:
        0-d tensor in ``M``'s dtype.

    Raises:
        ValueError: unless ``M`` is a 2-D floating tensor.

    Example:
        >>> spectral_norm(torch.tensor([[2.0, 0.0], [0.0, -3.0]]))
        tensor(3.)
    """
    if not isinstance(M, Tensor) or M.ndim != 2 or not M.is_floating_point():
        raise ValueError(f"Invalid M: expected a 2-D floating tensor, got {_describe(M)}.")
    if M.numel() == 0:
        return M.new_zeros(())
    scale = M.abs().max()
    if M.shape[0] == M.shape[1] and bool((M - M.mT).abs().max() <= 1e-10 * scale):
        return torch.linalg.eigvalsh(0.5 * (M + M.mT)).abs().max()
    return torch.linalg.svdvals(M).max()


def dense_to_norms(blocks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Spectral norm of every dense entry of a result dict, under the same key.

    Entries with ``ndim >= 2`` are dense; an ``ndim > 2`` tensor (the LayerNorm ``hessian``) is first
    flattened to ``(prod(shape[:-1]), shape[-1])``, the sheet's ``(Ln)^2 x Ln`` layout. Lower-rank
    entries (scalars) are not dense and are left out.

    Args:
        blocks: e.g. the output of :func:`self_attention_blocks`.

    Returns:
        ``{key: 0-d tensor}``.

    Example:
        >>> dense_to_norms({"outer/VV": 2 * torch.eye(3), "term/x": torch.tensor(1.0)})
        {'outer/VV': tensor(2.)}
    """
    if not isinstance(blocks, Mapping):
        raise ValueError(f"Invalid blocks: expected a dict of tensors, got {type(blocks).__name__}.")
    return {
        key: spectral_norm(value.reshape(-1, value.shape[-1]))
        for key, value in blocks.items()
        if isinstance(value, Tensor) and value.ndim >= 2
    }
