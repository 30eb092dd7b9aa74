"""Sanity checks of the torch.func ground truths in ``curvwatch.reference``.

The reference is what the closed forms are tested against, so it is checked here by independent means:
the Gauss-Newton split, symmetry, hand-written closed forms from the formula sheet, PyTorch's own
modules for the forward definitions, batch and mask invariances, and input validation.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
from torch import nn
from torch.func import hessian

from curvwatch import reference as ref
from curvwatch.closed_form import PARTS, AttentionStructure, AttentionWeights, FFNWeights, OutputLoss
from curvwatch.reference.attention import attention_forward, blocked_logits
from curvwatch.reference.block import transformer_block_forward
from curvwatch.reference.common import layer_norm
from curvwatch.reference.ffn import gelu
from tests.utils import TOL, assert_close_report

DT = torch.float64
RTOL = TOL["float64"]
ATOL_ZERO = 1e-13  # "exactly zero up to round-off" for blocks that must vanish
ATTENTION_PAIRS = ("VV", "QQ", "KK", "VQ", "VK", "QK")
BLOCK_PAIRS = [X + Y for X, Y in itertools.combinations_with_replacement(("V", "Q", "K", "W1", "W2"), 2)]


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, dtype=DT)


def check_split(out: dict[str, torch.Tensor]) -> None:
    """hessian == outer + functional for every reported pair, and the Hessian is not trivially zero."""
    hessian_keys = [k for k in out if k.startswith("hessian/")]
    assert hessian_keys
    for key in hessian_keys:
        rest = key[len("hessian/") :]
        assert_close_report(out[f"outer/{rest}"] + out[f"functional/{rest}"], out[key], RTOL, name=key)
    assert any(out[k].abs().max() > 1e-3 for k in hessian_keys)


def check_symmetric(M: torch.Tensor, name: str) -> None:
    assert_close_report(M, M.T, RTOL, name=f"{name} symmetry", atol=1e-14)


def loss_of(mode: str, shape: tuple[int, ...], **extra) -> OutputLoss:
    """A random target or output gradient of ``shape``."""
    if mode == "target":
        return OutputLoss(target=randn(*shape), **extra)
    return OutputLoss(grad_output=randn(*shape), **extra)


def truncated(t: torch.Tensor | None, b: int, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[b, rows]


# ----------------------------------------------------------------------------------------------------
# Self-attention
# ----------------------------------------------------------------------------------------------------


def case(id: str, **overrides) -> dict:
    """A test case: defaults (unbatched, target mode, non-causal, no padding) plus overrides."""
    return {"id": id, "B": None, "mode": "target", "causal": False, "pad": None, **overrides}


ATTENTION_CASES = [
    case("unbatched-target", L=3, d=3, d_K=2, d_V=2),
    case("unbatched-grad-causal", L=4, d=2, d_K=3, d_V=2, mode="grad_output", causal=True),
    case("batched-target-causal", B=2, L=3, d=3, d_K=2, d_V=3, causal=True),
    case("batched-grad-rightpad", B=2, L=4, d=3, d_K=2, d_V=2, mode="grad_output", pad="right"),
    case("batched-target-leftpad-causal", B=2, L=4, d=3, d_K=2, d_V=2, causal=True, pad="left"),
]


def padding_mask(B: int, L: int, pad: str | None) -> torch.Tensor | None:
    """Sequence 0 unpadded; sequence 1 padded at its last (right) or first (left) position."""
    if pad is None:
        return None
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, -1 if pad == "right" else 0] = True
    return mask


@pytest.fixture(params=ATTENTION_CASES, ids=lambda c: c["id"])
def attention_case(request):
    c = request.param
    torch.manual_seed(zlib.crc32(c["id"].encode()))
    lead = () if c["B"] is None else (c["B"],)
    X = randn(*lead, c["L"], c["d"])
    W_Q, W_K, W_V = randn(c["d"], c["d_K"]), randn(c["d"], c["d_K"]), randn(c["d"], c["d_V"])
    loss = loss_of(c["mode"], (*lead, c["L"], c["d_V"]))
    structure = AttentionStructure(causal=c["causal"], key_padding_mask=padding_mask(c["B"] or 1, c["L"], c["pad"]))
    return c, X, (W_Q, W_K, W_V), dict(loss=loss, structure=structure)


def test_self_attention_keys_shapes_split_symmetry(attention_case):
    c, X, (W_Q, W_K, W_V), kwargs = attention_case
    out = ref.self_attention_blocks(X, AttentionWeights(W_Q, W_K, W_V), **kwargs)
    n = {"V": c["d"] * c["d_V"], "Q": c["d"] * c["d_K"], "K": c["d"] * c["d_K"]}
    expected_keys = {f"{k}/{p}" for k in PARTS for p in (*ATTENTION_PAIRS, "QKV")}
    assert set(out) == expected_keys
    for kind in PARTS:
        for pair in ATTENTION_PAIRS:
            assert out[f"{kind}/{pair}"].shape == (n[pair[0]], n[pair[1]])
        full = out[f"{kind}/QKV"]
        check_symmetric(full, f"{kind}/QKV")
        # the full matrix is made of the pair blocks, in block order Q, K, V
        offsets = {"Q": 0, "K": n["Q"], "V": n["Q"] + n["K"]}
        for X_, Y_ in (p for p in ATTENTION_PAIRS):
            block = full[offsets[X_] : offsets[X_] + n[X_], offsets[Y_] : offsets[Y_] + n[Y_]]
            assert_close_report(block, out[f"{kind}/{X_}{Y_}"], RTOL, name=f"{kind}/QKV[{X_},{Y_}]")
    check_split(out)
    assert all(torch.isfinite(v).all() for v in out.values())


@pytest.mark.parametrize("mode", ["target", "grad_output"])
@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_outer_VV_matches_kronecker_closed_form(causal, mode):
    """Sheet §2: H_o(V,V) = c (AX)^T (AX) kron I_{d_V}, c = 2/(L d_V) (also the default c); H_f(V,V) = 0."""
    L, d, d_K, d_V = 4, 3, 2, 2
    X, W_Q, W_K, W_V = randn(L, d), randn(d, d_K), randn(d, d_K), randn(d, d_V)
    out = ref.self_attention_blocks(X, AttentionWeights(W_Q, W_K, W_V), loss=loss_of(mode, (L, d_V)),
                                    structure=AttentionStructure(causal=causal))  # fmt: skip
    T = X @ W_Q @ W_K.T @ X.T / math.sqrt(d_K)
    if causal:
        T = T.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    M1 = torch.softmax(T, dim=-1) @ X
    expected = 2.0 / (L * d_V) * torch.kron(M1.T @ M1, torch.eye(d_V, dtype=DT))
    assert_close_report(out["outer/VV"], expected, RTOL, name="outer/VV")
    assert_close_report(out["hessian/VV"], expected, RTOL, name="hessian/VV")
    assert out["functional/VV"].abs().max() < ATOL_ZERO


def test_self_attention_batched_target_is_mean_and_grad_output_is_sum():
    B, L, d, d_K, d_V = 3, 3, 3, 2, 2
    X, W = randn(B, L, d), (randn(d, d_K), randn(d, d_K), randn(d, d_V))
    T, G = randn(B, L, d_V), randn(B, L, d_V)
    W, causal = AttentionWeights(*W), AttentionStructure(causal=True)
    batched_t = ref.self_attention_blocks(X, W, loss=OutputLoss(target=T), structure=causal)
    batched_g = ref.self_attention_blocks(X, W, loss=OutputLoss(grad_output=G), structure=causal)
    singles_t = [ref.self_attention_blocks(X[b], W, loss=OutputLoss(target=T[b]), structure=causal) for b in range(B)]
    singles_g = [
        ref.self_attention_blocks(X[b], W, loss=OutputLoss(grad_output=G[b]), structure=causal) for b in range(B)
    ]
    for key in batched_t:
        mean = sum(s[key] for s in singles_t) / B
        assert_close_report(batched_t[key], mean, RTOL, name=f"target {key}", atol=ATOL_ZERO)
        total = sum(s[key] for s in singles_g)
        assert_close_report(batched_g[key], total, RTOL, name=f"grad_output {key}", atol=ATOL_ZERO)


@pytest.mark.parametrize("mode", ["target", "grad_output"])
@pytest.mark.parametrize("pad, causal", [("right", False), ("right", True), ("left", True), ("left", False)])
def test_self_attention_padding_equals_truncated_sequence(mode, pad, causal):
    """A padded position is invisible: the batch equals the unpadded sequences without it."""
    B, L, d, d_K, d_V = 2, 4, 3, 2, 2
    X, W = randn(B, L, d), (randn(d, d_K), randn(d, d_K), randn(d, d_V))
    mask = padding_mask(B, L, pad)
    kept = slice(0, L - 1) if pad == "right" else slice(1, L)
    c = 0.37  # explicit: the default 2/(L m) would differ between L and L - 1
    name = "target" if mode == "target" else "grad_output"
    extra = {} if mode == "target" else {"output_curvature": c}
    S = randn(B, L, d_V)
    W = AttentionWeights(*W)
    out = ref.self_attention_blocks(X, W, loss=OutputLoss(**{name: S}, **extra),
                                    structure=AttentionStructure(causal=causal, key_padding_mask=mask))  # fmt: skip
    full = ref.self_attention_blocks(X[0], W, loss=OutputLoss(**{name: S[0]}, **extra),
                                     structure=AttentionStructure(causal=causal))  # fmt: skip
    short = ref.self_attention_blocks(X[1, kept], W, loss=OutputLoss(**{name: S[1, kept]}, **extra),
                                      structure=AttentionStructure(causal=causal))  # fmt: skip
    for key in out:
        combined = full[key] + short[key]
        expected = combined / B if mode == "target" else combined
        assert_close_report(out[key], expected, RTOL, name=key, atol=ATOL_ZERO)


def test_self_attention_padded_content_changes_nothing():
    B, L, d, d_K, d_V = 2, 4, 3, 2, 2
    X, W = randn(B, L, d), (randn(d, d_K), randn(d, d_K), randn(d, d_V))
    T = randn(B, L, d_V)
    mask = padding_mask(B, L, "left")
    W, masked = AttentionWeights(*W), AttentionStructure(causal=True, key_padding_mask=mask)
    out = ref.self_attention_blocks(X, W, loss=OutputLoss(target=T), structure=masked)
    X2, T2 = X.clone(), T.clone()
    X2[1, 0] += 10 * randn(d)
    T2[1, 0] += 10 * randn(d_V)
    out2 = ref.self_attention_blocks(X2, W, loss=OutputLoss(target=T2), structure=masked)
    unmasked = ref.self_attention_blocks(X2, W, loss=OutputLoss(target=T2), structure=AttentionStructure(causal=True))
    for key in out:
        assert_close_report(out2[key], out[key], RTOL, name=key, atol=ATOL_ZERO)
    # and the change is visible without the mask, so this test can fail
    assert (unmasked["hessian/QKV"] - out["hessian/QKV"]).abs().max() > 1e-6


# ----------------------------------------------------------------------------------------------------
# Multi-head attention
# ----------------------------------------------------------------------------------------------------


def test_multi_head_with_identity_output_is_per_head_self_attention():
    """With W_O = I the head h blocks are those of single-head attention on head h's output columns."""
    B, L, d, H, d_K, d_V = 2, 3, 3, 2, 2, 2
    X = randn(B, L, d)
    W_Q, W_K, W_V = randn(d, H * d_K), randn(d, H * d_K), randn(d, H * d_V)
    G = randn(B, L, H * d_V)
    mask = padding_mask(B, L, "right")
    c = 0.25
    structure = AttentionStructure(causal=True, key_padding_mask=mask)
    out = ref.multi_head_attention_blocks(
        X, AttentionWeights(W_Q, W_K, W_V, torch.eye(H * d_V, dtype=DT), n_heads=H),
        loss=OutputLoss(grad_output=G, output_curvature=c), structure=structure,
    )  # fmt: skip
    assert set(out) == {f"{k}/{p}/h{h}" for k in PARTS for p in (*ATTENTION_PAIRS, "QKV") for h in range(H)}
    for h in range(H):
        qk, v = slice(h * d_K, (h + 1) * d_K), slice(h * d_V, (h + 1) * d_V)
        single = ref.self_attention_blocks(
            X, AttentionWeights(W_Q[:, qk], W_K[:, qk], W_V[:, v]),
            loss=OutputLoss(grad_output=G[..., v], output_curvature=c), structure=structure,
        )  # fmt: skip
        for key, value in single.items():
            assert_close_report(out[f"{key}/h{h}"], value, RTOL, name=f"{key}/h{h}", atol=ATOL_ZERO)


@pytest.mark.parametrize("mode", ["target", "grad_output"])
def test_multi_head_blocks_are_diagonal_head_blocks_of_the_full_hessian(mode):
    """Slicing check: hessian/XY/h{i} is the head-i sub-block of the Hessian in the full packed weights."""
    B, L, d, H, d_K, d_V, d_out = 2, 3, 3, 2, 2, 1, 2
    X = randn(B, L, d)
    W_Q, W_K, W_V, W_O = randn(d, H * d_K), randn(d, H * d_K), randn(d, H * d_V), randn(H * d_V, d_out)
    b = dict(b_Q=randn(H * d_K), b_K=randn(H * d_K), b_V=randn(H * d_V), b_O=randn(d_out))
    at_output = loss_of(mode, (B, L, d_out))
    out = ref.multi_head_attention_blocks(X, AttentionWeights(W_Q, W_K, W_V, W_O, n_heads=H, **b), loss=at_output,
                                          structure=AttentionStructure(causal=True))  # fmt: skip
    check_split(out)
    for h in range(H):
        check_symmetric(out[f"hessian/QKV/h{h}"], f"hessian/QKV/h{h}")

    # the loss written independently, as a function of the full packed weights
    blocked = torch.ones(L, L, dtype=torch.bool).triu(1)

    def loss(W_V_, W_Q_, W_K_):
        heads = []
        for h in range(H):
            Q = X @ W_Q_[:, h * d_K : (h + 1) * d_K] + b["b_Q"][h * d_K : (h + 1) * d_K]
            K = X @ W_K_[:, h * d_K : (h + 1) * d_K] + b["b_K"][h * d_K : (h + 1) * d_K]
            V = X @ W_V_[:, h * d_V : (h + 1) * d_V] + b["b_V"][h * d_V : (h + 1) * d_V]
            A = torch.softmax((Q @ K.mT / math.sqrt(d_K)).masked_fill(blocked, float("-inf")), -1)
            heads.append(A @ V)
        F = torch.cat(heads, -1) @ W_O + b["b_O"]
        if mode == "target":
            return (((F - at_output.target) ** 2).sum(dim=(1, 2)) / (L * d_out)).mean()
        return (at_output.grad_output * F).sum()  # <G, F>: its Hessian is the functional part

    full = hessian(loss, argnums=(0, 1, 2))(W_V, W_Q, W_K)
    widths = {"V": d_V, "Q": d_K, "K": d_K}
    index = {"V": 0, "Q": 1, "K": 2}
    for h, (P, R) in itertools.product(range(H), ATTENTION_PAIRS):
        rows, cols = slice(h * widths[P], (h + 1) * widths[P]), slice(h * widths[R], (h + 1) * widths[R])
        block = full[index[P]][index[R]][:, rows, :, cols].reshape(d * widths[P], d * widths[R])
        key = f"{'hessian' if mode == 'target' else 'functional'}/{P}{R}/h{h}"
        assert_close_report(out[key], block, RTOL, name=key, atol=ATOL_ZERO)


def test_multi_head_forward_matches_torch_multihead_attention():
    """The forward definition (packing, scaling, masks) is that of nn.MultiheadAttention."""
    B, L, d, H = 2, 4, 4, 2
    mha = nn.MultiheadAttention(d, H, batch_first=True, dtype=DT)
    with torch.no_grad():
        mha.in_proj_bias.copy_(randn(3 * d))
        mha.out_proj.bias.copy_(randn(d))
    X = randn(B, L, d)
    padded = padding_mask(B, L, "right")
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    expected, _ = mha(X, X, X, key_padding_mask=padded, attn_mask=causal, need_weights=False)
    W_Q, W_K, W_V = (w.T for w in mha.in_proj_weight.detach().chunk(3))
    b_Q, b_K, b_V = mha.in_proj_bias.detach().chunk(3)
    blocked = blocked_logits(B, L, True, padded, X.device)
    W_O, b_O = mha.out_proj.weight.detach().T, mha.out_proj.bias.detach()
    weights = AttentionWeights(W_Q, W_K, W_V, W_O, n_heads=H, b_Q=b_Q, b_K=b_K, b_V=b_V, b_O=b_O)
    actual = attention_forward(X, weights, blocked)
    assert_close_report(actual, expected.detach(), RTOL, name="MHA forward")


# ----------------------------------------------------------------------------------------------------
# LayerNorm
# ----------------------------------------------------------------------------------------------------

LN_CASES = [
    dict(id="unbatched", shape=(3, 4), eps=1e-5, affine=False),
    dict(id="batched-affine", shape=(2, 2, 5), eps=1e-5, affine=True),
    dict(id="eps0-small-var", shape=(2, 3), eps=0.0, affine=False, scale=1e-2),
]


@pytest.fixture(params=LN_CASES, ids=lambda c: c["id"])
def ln_case(request):
    c = request.param
    torch.manual_seed(zlib.crc32(c["id"].encode()))
    n = c["shape"][-1]
    X = randn(*c["shape"], scale=c.get("scale", 1.0)) + 0.3
    weight, bias = (randn(n), randn(n)) if c["affine"] else (None, None)
    return c, X, weight, bias


def test_layernorm_forward_matches_torch(ln_case):
    c, X, weight, bias = ln_case
    n = X.shape[-1]
    expected = nn.functional.layer_norm(X, (n,), weight, bias, eps=c["eps"])
    assert_close_report(layer_norm(X, c["eps"], weight, bias), expected, RTOL, name="LN forward")


def test_layernorm_jacobian_and_hessian_match_sheet_formulas(ln_case):
    """Sheet §4 per row: J_i = (C - y y^T / n) / s and
    d2y_k / dx_a dx_b = [-C_ka y_b - C_kb y_a - y_k C_ab + 3/n y_k y_a y_b] / (n s^2)."""
    c, X, weight, bias = ln_case
    out = ref.layernorm_dense(X, eps=c["eps"], weight=weight, bias=bias)
    rows = X.reshape(-1, X.shape[-1])
    N, n = rows.shape
    C = torch.eye(n, dtype=DT) - 1.0 / n
    w = torch.ones(n, dtype=DT) if weight is None else weight
    J = torch.zeros(N * n, N * n, dtype=DT)
    Hs = torch.zeros(N * n, N * n, N * n, dtype=DT)
    for i, x in enumerate(rows):
        s = torch.sqrt(x.var(unbiased=False) + c["eps"])
        y = (x - x.mean()) / s
        block = slice(i * n, (i + 1) * n)
        J[block, block] = w[:, None] * (C - torch.outer(y, y) / n) / s
        H_row = (
            -torch.einsum("ka,b->kab", C, y)
            - torch.einsum("kb,a->kab", C, y)
            - torch.einsum("k,ab->kab", y, C)
            + 3.0 / n * torch.einsum("k,a,b->kab", y, y, y)
        ) / (n * s**2)
        Hs[block, block, block] = w[:, None, None] * H_row
    assert_close_report(out["jacobian"], J, RTOL, name="LN jacobian")
    assert_close_report(out["hessian"], Hs, RTOL, name="LN hessian")


def test_layernorm_contracted_hessian(ln_case):
    """sum_k g_k Hess y_k equals the dense contraction and the sheet's row formula (with g * weight)."""
    c, X, weight, bias = ln_case
    g = randn(*X.shape)
    out = ref.layernorm_contracted_hessian(X, g, eps=c["eps"], weight=weight)
    dense = ref.layernorm_dense(X, eps=c["eps"], weight=weight, bias=bias)["hessian"]
    assert_close_report(out, torch.einsum("k,kab->ab", g.reshape(-1), dense), RTOL, name="dense contraction")
    rows, g_rows = X.reshape(-1, X.shape[-1]), g.reshape(-1, X.shape[-1])
    N, n = rows.shape
    C = torch.eye(n, dtype=DT) - 1.0 / n
    expected = torch.zeros(N * n, N * n, dtype=DT)
    for i, (x, g_i) in enumerate(zip(rows, g_rows, strict=True)):
        g_i = g_i if weight is None else g_i * weight
        s2 = x.var(unbiased=False) + c["eps"]
        y = (x - x.mean()) / torch.sqrt(s2)
        Cg, gy = C @ g_i, g_i @ y
        block = -(torch.outer(Cg, y) + torch.outer(y, Cg)) - gy * C + 3.0 / n * gy * torch.outer(y, y)
        expected[i * n : (i + 1) * n, i * n : (i + 1) * n] = block / (n * s2)
    assert_close_report(out, expected, RTOL, name="contracted formula")
    check_symmetric(out, "contracted LN Hessian")


def test_layernorm_jacobian_norm_is_inverse_min_std():
    """Sheet §4: ||J_LN||_2 = 1 / min_i sqrt(var_i + eps) for n >= 3."""
    X, eps = randn(3, 5), 1e-5
    X[1] *= 0.1  # make one row clearly the smallest-variance one
    norms = ref.dense_to_norms(ref.layernorm_dense(X, eps=eps))
    expected = 1.0 / torch.sqrt(X.var(dim=-1, unbiased=False) + eps).min()
    assert_close_report(norms["jacobian"], expected, 1e-9, name="||J_LN||")


# ----------------------------------------------------------------------------------------------------
# FFN
# ----------------------------------------------------------------------------------------------------

FFN_CASES = [
    case("relu-res-target", act="relu", residual=True, bias=False, mask=False),
    case("gelu-res-grad", act="gelu", residual=True, mode="grad_output", bias=True, mask=False),
    case(
        "relu-nores-grad-batched", B=2, act="relu", residual=False, mode="grad_output", bias=True, mask=True
    ),
    case("gelu-nores-target-batched", B=2, act="gelu", residual=False, bias=False, mask=True),
]


@pytest.fixture(params=FFN_CASES, ids=lambda c: c["id"])
def ffn_case(request):
    c = request.param
    torch.manual_seed(zlib.crc32(c["id"].encode()))
    L, d, d_ff = 3, 2, 4
    lead = () if c["B"] is None else (c["B"],)
    Y, W_1, W_2 = randn(*lead, L, d), randn(d, d_ff), randn(d_ff, d)
    kw = dict(activation=c["act"], residual=c["residual"], loss=loss_of(c["mode"], (*lead, L, d)))
    biases = dict(b_1=randn(d_ff), b_2=randn(d)) if c["bias"] else {}
    if c["mask"]:
        kw["row_mask"] = torch.tensor([[True, True, True], [True, False, True]])
    return c, Y, FFNWeights(W_1, W_2, **biases), kw


def test_ffn_split_and_vanishing_functional_blocks(ffn_case):
    c, Y, weights, kw = ffn_case
    W_1, W_2 = weights.W_1, weights.W_2
    out = ref.ffn_blocks(Y, weights, **kw)
    assert set(out) == {f"{k}/{p}" for k in PARTS for p in ("W1W1", "W2W2", "W1W2")}
    assert out["hessian/W1W2"].shape == (W_1.numel(), W_2.numel())
    check_split(out)
    for key in ("hessian/W1W1", "hessian/W2W2"):
        check_symmetric(out[key], key)
    assert out["functional/W2W2"].abs().max() < ATOL_ZERO  # S is linear in W_2
    if c["act"] == "relu":
        assert out["functional/W1W1"].abs().max() < ATOL_ZERO  # relu'' = 0 a.e.
    else:
        assert out["functional/W1W1"].abs().max() > 1e-6  # ... but not for GELU
    assert out["functional/W1W2"].abs().max() > 1e-6


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ffn_blocks_match_sheet_formulas(activation):
    """Sheet §5 (loss on S): outer W2W2 = c sigma^T sigma kron I and
    H_f(W1, W2)[(a, b), (b', e)] = delta_bb' sum_i Y_ia sigma'_ib G_ie."""
    L, d, d_ff = 3, 2, 3
    Y, W_1, W_2, G = randn(L, d), randn(d, d_ff), randn(d_ff, d), randn(L, d)
    c = 0.7
    loss = OutputLoss(grad_output=G, output_curvature=c)
    out = ref.ffn_blocks(Y, FFNWeights(W_1, W_2), activation=activation, loss=loss)
    Z = (Y @ W_1).requires_grad_(True)
    act = torch.relu if activation == "relu" else nn.functional.gelu
    sigma = act(Z)
    (d_sigma,) = torch.autograd.grad(sigma.sum(), Z)
    sigma = sigma.detach()
    expected_outer = c * torch.kron(sigma.T @ sigma, torch.eye(d, dtype=DT))
    assert_close_report(out["outer/W2W2"], expected_outer, RTOL, name="outer/W2W2")
    cross = torch.einsum("ia,ib,ie->abe", Y, d_sigma, G)  # (d, d_ff, d)
    expected_cross = torch.zeros(d, d_ff, d_ff, d, dtype=DT)
    for b in range(d_ff):
        expected_cross[:, b, b, :] = cross[:, b, :]
    expected_cross = expected_cross.reshape(d * d_ff, d_ff * d)
    assert_close_report(out["functional/W1W2"], expected_cross, RTOL, name="functional/W1W2")


def test_ffn_gelu_is_exact_erf_gelu():
    x = torch.linspace(-4, 4, 41, dtype=DT)
    assert_close_report(gelu(x), nn.functional.gelu(x), RTOL, name="gelu")


@pytest.mark.parametrize("mode", ["target", "grad_output"])
def test_ffn_row_mask_drops_rows(mode):
    B, L, d, d_ff = 2, 3, 2, 3
    Y, W_1, W_2 = randn(B, L, d), randn(d, d_ff), randn(d_ff, d)
    name = "target" if mode == "target" else "grad_output"
    S = randn(B, L, d)
    extra = {} if mode == "target" else {"output_curvature": 0.4}
    keep = torch.tensor([[True, True, True], [False, True, True]])
    W = FFNWeights(W_1, W_2)
    out = ref.ffn_blocks(Y, W, activation="gelu", loss=OutputLoss(**{name: S}, **extra), row_mask=keep)
    Y2, S2 = Y.clone(), S.clone()
    Y2[1, 0], S2[1, 0] = 5 * randn(d), 5 * randn(d)
    out2 = ref.ffn_blocks(Y2, W, activation="gelu", loss=OutputLoss(**{name: S2}, **extra), row_mask=keep)
    singles = [
        ref.ffn_blocks(Y[0], W, activation="gelu", loss=OutputLoss(**{name: S[0]}, **extra)),
        ref.ffn_blocks(Y[1, 1:], W, activation="gelu", loss=OutputLoss(**{name: S[1, 1:]}, **extra)),
    ]
    for key in out:
        assert_close_report(out2[key], out[key], RTOL, name=f"changed dropped row {key}", atol=ATOL_ZERO)
        expected = singles[0][key] + singles[1][key]
        expected = expected / B if mode == "target" else expected
        assert_close_report(out[key], expected, RTOL, name=f"truncated {key}", atol=ATOL_ZERO)


# ----------------------------------------------------------------------------------------------------
# Full Transformer block
# ----------------------------------------------------------------------------------------------------

BLOCK_CASES = [
    case("post-relu-1head-target", norm="post", act="relu", H=1, extras=False),
    case("pre-gelu-1head-grad", norm="pre", act="gelu", H=1, mode="grad_output", extras=True),
    case("post-gelu-2heads-grad-batched", norm="post", act="gelu", H=2, B=2, mode="grad_output", extras=True),
    case("pre-relu-2heads-target-batched", norm="pre", act="relu", H=2, B=2, extras=False),
]


def block_params(d: int, H: int, d_K: int, d_V: int, d_ff: int, extras: bool) -> dict:
    p = dict(W_Q=randn(d, H * d_K), W_K=randn(d, H * d_K), W_V=randn(d, H * d_V), W_1=randn(d, d_ff))
    p.update(W_2=randn(d_ff, d), n_heads=H)
    if extras:
        p.update(W_O=randn(H * d_V, d), b_Q=randn(H * d_K), b_K=randn(H * d_K), b_V=randn(H * d_V))
        p.update(b_O=randn(d), b_1=randn(d_ff), b_2=randn(d))
        p.update({k: randn(d) for k in ("ln1_weight", "ln1_bias", "ln2_weight", "ln2_bias")})
    return p


@pytest.fixture(params=BLOCK_CASES, ids=lambda c: c["id"])
def block_case(request):
    c = request.param
    torch.manual_seed(zlib.crc32(c["id"].encode()))
    L, d, d_ff = 3, 4, 3
    lead = () if c["B"] is None else (c["B"],)
    params = block_params(d, c["H"], d // c["H"], d // c["H"], d_ff, c["extras"])
    return c, randn(*lead, L, d), params, loss_of(c["mode"], (*lead, L, d))


def test_transformer_block_keys_split_symmetry(block_case):
    c, X, params, loss = block_case
    out = ref.transformer_block_blocks(X, params, norm=c["norm"], activation=c["act"], causal=True, loss=loss)
    H = c["H"]
    ffn_pairs = {"W1W1", "W1W2", "W2W2"}
    suffixes = [f"/h{h}" for h in range(H)] if H > 1 else [""]
    expected = {f"{k}/{p}" for k in PARTS for p in ffn_pairs}
    expected |= {f"{k}/{p}{s}" for k in PARTS for p in BLOCK_PAIRS if p not in ffn_pairs for s in suffixes}
    assert set(out) == expected
    check_split(out)
    # assemble the 5x5 Hessian of each head's blocks and check its symmetry
    n = {"V": params["W_V"].shape[0] * params["W_V"].shape[1] // H, "W1": params["W_1"].numel()}
    n.update(Q=params["W_Q"].numel() // H, K=params["W_K"].numel() // H, W2=params["W_2"].numel())
    order = ("V", "Q", "K", "W1", "W2")
    for kind, s in itertools.product(PARTS, suffixes):

        def block(P, R, kind=kind, s=s):
            if order.index(P) > order.index(R):
                return block(R, P).T
            return out[f"{kind}/{P}{R}" + ("" if P + R in ffn_pairs else s)]

        full = torch.cat([torch.cat([block(P, R) for R in order], 1) for P in order], 0)
        assert full.shape == (sum(n.values()),) * 2
        check_symmetric(full, f"{kind} full{s}")
    # LN curvature makes H_f(V, V) non-zero in the full block (sheet §6)
    assert out[f"functional/VV{suffixes[0]}"].abs().max() > 1e-6


def test_transformer_block_batched_target_is_mean():
    X, p = randn(2, 3, 4), block_params(4, 2, 2, 2, 3, extras=True)
    T = randn(2, 3, 4)
    kw = dict(norm="pre", activation="gelu")
    out = ref.transformer_block_blocks(X, p, **kw, loss=OutputLoss(target=T))
    singles = [ref.transformer_block_blocks(X[b], p, **kw, loss=OutputLoss(target=T[b])) for b in range(2)]
    for key in out:
        assert_close_report(out[key], (singles[0][key] + singles[1][key]) / 2, RTOL, name=key, atol=ATOL_ZERO)


@pytest.mark.parametrize("norm", ["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_block_forward_matches_torch_modules(norm, activation):
    """The composition of §6 (post) and the pre-LN variant, built from nn modules."""
    B, L, d, H, d_ff, eps = 2, 4, 4, 2, 3, 1e-5
    mha = nn.MultiheadAttention(d, H, batch_first=True, dtype=DT)
    ln1, ln2 = nn.LayerNorm(d, eps=eps, dtype=DT), nn.LayerNorm(d, eps=eps, dtype=DT)
    lin1, lin2 = nn.Linear(d, d_ff, dtype=DT), nn.Linear(d_ff, d, dtype=DT)
    with torch.no_grad():
        for p in (mha.in_proj_bias, mha.out_proj.bias, ln1.weight, ln1.bias, ln2.weight, ln2.bias):
            p.copy_(randn(*p.shape))
    act = nn.functional.relu if activation == "relu" else nn.functional.gelu
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)

    def attn(inp):
        return mha(inp, inp, inp, attn_mask=causal, need_weights=False)[0]

    X = randn(B, L, d)
    with torch.no_grad():
        if norm == "post":
            Y = ln1(X + attn(X))
            expected = ln2(lin2(act(lin1(Y))) + Y)
        else:
            U = X + attn(ln1(X))
            expected = U + lin2(act(lin1(ln2(U))))
    W_Q, W_K, W_V = (w.T for w in mha.in_proj_weight.detach().chunk(3))
    b_Q, b_K, b_V = mha.in_proj_bias.detach().chunk(3)
    fixed = dict(
        W_O=mha.out_proj.weight.detach().T, b_Q=b_Q, b_K=b_K, b_V=b_V, b_O=mha.out_proj.bias.detach(),
        b_1=lin1.bias.detach(), b_2=lin2.bias.detach(),
        ln1_weight=ln1.weight.detach(), ln1_bias=ln1.bias.detach(),
        ln2_weight=ln2.weight.detach(), ln2_bias=ln2.bias.detach(),
    )  # fmt: skip
    blocked = blocked_logits(B, L, True, None, X.device)
    W_1, W_2 = lin1.weight.detach().T, lin2.weight.detach().T
    actual = transformer_block_forward(X, W_Q, W_K, W_V, W_1, W_2, fixed, H, norm, activation, eps, blocked)
    assert_close_report(actual, expected, RTOL, name=f"{norm} block forward")


# ----------------------------------------------------------------------------------------------------
# Norms
# ----------------------------------------------------------------------------------------------------


def test_spectral_norm_symmetric_and_general():
    A = randn(5, 5)
    S = A + A.T - 3 * torch.eye(5, dtype=DT)  # symmetric indefinite
    R = randn(4, 6)
    for M in (S, R, A):
        assert_close_report(ref.spectral_norm(M), torch.linalg.matrix_norm(M, ord=2), 1e-12, name="norm")
    assert_close_report(ref.spectral_norm(S), torch.linalg.eigvalsh(S).abs().max(), 1e-12, name="eig")


def test_dense_to_norms_keeps_keys_of_dense_entries():
    X, W = randn(3, 2), (randn(2, 2), randn(2, 2), randn(2, 2))
    out = ref.self_attention_blocks(X, AttentionWeights(*W), loss=OutputLoss(grad_output=randn(3, 2)))
    norms = ref.dense_to_norms({**out, "term/scalar": torch.tensor(1.0, dtype=DT)})
    assert set(norms) == set(out)
    for key, value in norms.items():
        assert value.ndim == 0
        assert_close_report(value, torch.linalg.matrix_norm(out[key], ord=2), 1e-10, name=key)


# ----------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------


def _zeros(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def _sa(X_shape=(3, 2), W_K_shape=(2, 2), key_padding_mask=None, **loss):
    """Self-attention call with small valid defaults (L=3, d=d_K=d_V=2) and overrides (``loss``: OutputLoss
    fields)."""
    return lambda: ref.self_attention_blocks(
        randn(*X_shape), AttentionWeights(randn(2, 2), randn(*W_K_shape), randn(2, 2)), loss=OutputLoss(**loss),
        structure=AttentionStructure(key_padding_mask=key_padding_mask),
    )  # fmt: skip


def _mha(W_Q_shape=(2, 2), W_O_shape=(2, 2), n_heads=1):
    def call():
        W_Q, W_K, W_V, W_O = randn(*W_Q_shape), randn(*W_Q_shape), randn(2, 2), randn(*W_O_shape)
        weights = AttentionWeights(W_Q, W_K, W_V, W_O, n_heads=n_heads)
        return ref.multi_head_attention_blocks(randn(3, 2), weights, loss=OutputLoss(target=randn(3, 2)))

    return call


def _ffn(W_2_shape=(3, 2), Y_shape=(3, 2), **kw):
    return lambda: ref.ffn_blocks(
        randn(*Y_shape), FFNWeights(randn(2, 3), randn(*W_2_shape)), loss=OutputLoss(target=randn(*Y_shape)), **kw
    )


def _block(params_update=(), drop=(), **kw):
    p = block_params(4, 2, 2, 2, 3, extras=False)
    p.update(dict(params_update))
    for k in drop:
        p.pop(k)
    return lambda: ref.transformer_block_blocks(randn(3, 4), p, loss=OutputLoss(target=randn(3, 4)), **kw)


T0 = _zeros(3, 2)  # a valid (L, d_V) target / grad_output
BAD_INPUTS = {
    # (call, regex the message must match)
    "neither-loss": (_sa(), "exactly one"),
    "both-losses": (_sa(target=T0, grad_output=T0), "exactly one"),
    "target-shape": (_sa(target=_zeros(3, 3)), "target shape"),
    "target-dtype": (_sa(target=_zeros(3, 2, dtype=torch.float32)), "dtype"),
    "curvature-with-target": (_sa(target=T0, output_curvature=1.0), "output_curvature"),
    "negative-curvature": (_sa(grad_output=T0, output_curvature=-1.0), "output_curvature"),
    "mask-dtype": (_sa(target=T0, key_padding_mask=_zeros(1, 3)), "key_padding_mask dtype"),
    "mask-shape": (_sa(target=T0, key_padding_mask=_zeros(2, 3, dtype=torch.bool)), "key_padding_mask shape"),
    "all-padded": (_sa(target=T0, key_padding_mask=torch.ones(3, dtype=torch.bool)), "no unmasked"),
    "X-rank": (_sa(X_shape=(3,), target=T0), "Invalid X shape"),
    "W_K-shape": (_sa(W_K_shape=(2, 3), target=T0), "W_K shape"),
    "heads-divide": (_mha(W_Q_shape=(2, 3), n_heads=2), "multiple of n_heads"),
    "heads-zero": (_mha(n_heads=0), "n_heads"),
    "W_O-shape": (_mha(W_O_shape=(3, 2)), "W_O shape"),
    "ln-eps": (lambda: ref.layernorm_dense(randn(2, 3), eps=-1.0), "eps"),
    "ln-weight": (lambda: ref.layernorm_dense(randn(2, 3), weight=randn(2)), "weight shape"),
    "ln-grad-shape": (
        lambda: ref.layernorm_contracted_hessian(randn(2, 3), randn(3, 2)),
        "grad_output shape",
    ),
    "ffn-activation": (_ffn(activation="tanh"), "activation"),
    "ffn-W_2": (_ffn(W_2_shape=(2, 3)), "W_2 shape"),
    "ffn-row-mask": (_ffn(Y_shape=(2, 3, 2), row_mask=torch.ones(3, dtype=torch.bool)), "row_mask shape"),
    "block-norm": (_block(norm="mid"), "norm"),
    "block-missing": (_block(drop=("W_1",)), "Missing params"),
    "block-unknown": (_block(params_update={"W_X": randn(2)}), "W_X"),
    "block-identity-W_O": (_block(params_update={"W_V": randn(4, 2)}), "W_O"),
    "block-ln-weight": (_block(params_update={"ln1_weight": randn(3)}), "ln1_weight shape"),
    "spectral-1d": (lambda: ref.spectral_norm(randn(3)), "2-D"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_invalid_inputs_raise_value_error(name):
    call, match = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=match):
        call()
