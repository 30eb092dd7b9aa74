"""Closed-form attention Hessians against torch.func (curvwatch.reference), bounds and scaling exponents."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import hessian, jacrev

from curvwatch import reference
from curvwatch.closed_form import (
    AttentionStructure,
    AttentionWeights,
    OutputLoss,
    multi_head_attention,
    self_attention,
)
from curvwatch.closed_form.attention import ATTENTION_PAIRS
from curvwatch.closed_form.settings import EXACT, Lanczos
from tests.cases import ATTENTION_CASES, DT, MHA_CASES, batch_shape, case_id, output_loss, rand
from tests.utils import TOL, assert_close_report


def _attention_inputs(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bs = batch_shape(case)
    X = rand(gen, *bs, case["L"], case["d"])
    W_Q, W_K = rand(gen, case["d"], case["d_K"]), rand(gen, case["d"], case["d_K"])
    W_V = rand(gen, case["d"], case["d_V"])
    loss = output_loss(gen, case, (*bs, case["L"], case["d_V"]))
    return X, AttentionWeights(W_Q, W_K, W_V), loss


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=case_id)
def test_self_attention_dense_blocks_match_autograd(case):
    X, weights, loss = _attention_inputs(case)
    structure = AttentionStructure(causal=case["causal"])
    ref = reference.self_attention_blocks(X, weights, loss=loss, structure=structure)
    out = self_attention(X, weights, loss=loss, structure=structure, dense=True, lanczos=EXACT)
    ref_norms = reference.dense_to_norms(ref)
    for key, mat in ref.items():
        if mat.ndim != 2:
            continue
        assert_close_report(out[f"dense/{key}"], mat, TOL["float64"], name=f"dense/{key}", atol=1e-13)
        assert_close_report(out[key], ref_norms[key], TOL["float64"], name=key, atol=1e-13)


@pytest.mark.parametrize("case", MHA_CASES, ids=case_id)
def test_multi_head_attention_matches_autograd(case):
    gen = torch.Generator().manual_seed(1)
    bs = batch_shape(case)
    B, L, d, H, d_K, d_V, m = case["B"], case["L"], case["d"], case["H"], case["d_K"], case["d_V"], case["m"]
    X = rand(gen, *bs, L, d)
    W = dict(
        W_Q=rand(gen, d, H * d_K),
        W_K=rand(gen, d, H * d_K),
        W_V=rand(gen, d, H * d_V),
        W_O=rand(gen, H * d_V, m),
    )
    if case["bias"]:
        W.update(b_Q=rand(gen, H * d_K), b_K=rand(gen, H * d_K), b_V=rand(gen, H * d_V), b_O=rand(gen, m))
    loss = output_loss(gen, case, (*bs, L, m))
    kpm = None
    if case["pad"]:
        kpm = torch.zeros(B or 1, L, dtype=torch.bool)
        kpm[0, -1] = True
        kpm = kpm if B else kpm[0]
    weights, structure = (
        AttentionWeights(**W, n_heads=H),
        AttentionStructure(causal=case["causal"], key_padding_mask=kpm),
    )
    ref = reference.multi_head_attention_blocks(X, weights, loss=loss, structure=structure)
    out = multi_head_attention(X, weights, loss=loss, structure=structure, dense=True, lanczos=EXACT)
    ref_norms = reference.dense_to_norms(ref)
    checked = 0
    for key, mat in ref.items():
        if mat.ndim != 2 or f"dense/{key}" not in out:
            continue
        checked += 1
        assert_close_report(out[f"dense/{key}"], mat, TOL["float64"], name=f"dense/{key}", atol=1e-13)
        assert_close_report(out[key], ref_norms[key], TOL["float64"], name=key, atol=1e-13)
    assert checked >= 3 * len(ATTENTION_PAIRS) * H


def test_tolerance_1e6_matches_eigvalsh_to_1e6():
    X, weights, loss = _attention_inputs(dict(B=None, L=6, d=5, d_K=3, d_V=4, mode="grad"), seed=3)
    exact = self_attention(X, weights, loss=loss, lanczos=EXACT)
    approx = self_attention(X, weights, loss=loss, lanczos=Lanczos(tol=1e-6))
    for key in exact:
        if key.startswith(("hessian/", "outer/", "functional/")):
            assert_close_report(approx[key], exact[key], TOL["lanczos"], name=key, atol=1e-12)


def test_functional_term_in_two_block_network_with_cross_entropy():
    """Block 1's functional term from the back-propagated gradient = H - J^T H_downstream J (autograd)."""
    gen = torch.Generator().manual_seed(5)
    L, d, H, d_K, V = 4, 4, 2, 2, 6
    X = rand(gen, L, d)
    W1 = [rand(gen, d, H * d_K), rand(gen, d, H * d_K), rand(gen, d, d), rand(gen, d, d)]
    W2 = [rand(gen, d, H * d_K), rand(gen, d, H * d_K), rand(gen, d, d), rand(gen, d, d)]
    W_head = rand(gen, d, V)
    labels = torch.randint(0, V, (L,), generator=gen)

    def mha(x, wq, wk, wv, wo):
        q = (x @ wq).reshape(L, H, d_K).transpose(0, 1)
        k = (x @ wk).reshape(L, H, d_K).transpose(0, 1)
        v = (x @ wv).reshape(L, H, d // H).transpose(0, 1)
        T = (q @ k.mT / math.sqrt(d_K)).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        return (torch.softmax(T, -1) @ v).transpose(0, 1).reshape(L, d) @ wo

    def downstream(F1):
        Z = F1 + mha(torch.tanh(F1), *W2)
        return torch.nn.functional.cross_entropy(Z @ W_head, labels)

    def loss(wq, wk, wv):
        return downstream(mha(X, wq, wk, wv, W1[3]))

    F1 = mha(X, *W1)
    G = torch.func.grad(downstream)(F1)
    H_down = hessian(downstream)(F1).reshape(L * d, L * d)
    J = jacrev(lambda wq, wk, wv: mha(X, wq, wk, wv, W1[3]), argnums=(0, 1, 2))(*W1[:3])
    Hfull = hessian(loss, argnums=(0, 1, 2))(*W1[:3])
    out = multi_head_attention(X, AttentionWeights(*W1, n_heads=H), loss=OutputLoss(grad_output=G),
                               structure=AttentionStructure(causal=True), dense=True, lanczos=EXACT)  # fmt: skip
    names = ["Q", "K", "V"]
    for h in range(H):
        sl = {
            "Q": slice(h * d_K, (h + 1) * d_K),
            "K": slice(h * d_K, (h + 1) * d_K),
            "V": slice(h * 2, (h + 1) * 2),
        }
        Jh = {n: J[i][:, :, :, sl[n]].reshape(L * d, -1) for i, n in enumerate(names)}
        for pair in ATTENTION_PAIRS:
            a, b = pair[0], pair[1]
            full = Hfull[names.index(a)][names.index(b)][:, sl[a], :, sl[b]].reshape(Jh[a].shape[1], Jh[b].shape[1])
            expected = full - Jh[a].T @ H_down @ Jh[b]
            assert_close_report(out[f"dense/functional/{pair}/h{h}"], expected, TOL["float64"], name=pair, atol=1e-13)


def _assert_bounds_hold(out: dict, rtol: float) -> None:
    """Every ``bound/outer/XY``, ``bound/functional/XY`` and ``bound/XY`` (total) is >= its measured norm."""
    n = 0
    for key, bound in out.items():
        if not key.startswith("bound/"):
            continue
        name = key[len("bound/") :]
        value = out[name] if name.startswith(("outer/", "functional/")) else out[f"hessian/{name}"]
        assert value <= bound * (1 + rtol), (key, float(value), float(bound))
        n += 1
    assert n >= 19


def _split_attention_instance(L: int, big: float = 40.0):
    """Formula sheet §3b: every query splits its attention 1/2-1/2 between two keys at +-u e1."""
    u, v = 1.0, 1.0
    X = torch.zeros(L, 2, dtype=DT)
    X[0, 0], X[1, 0] = u, -u
    X[2:, 1] = v
    W_Q = torch.tensor([[0.0, 0.0], [0.0, -big]], dtype=DT)
    W_K = torch.eye(2, dtype=DT)
    W_V = torch.eye(2, dtype=DT)
    return X, W_Q, W_K, W_V


@pytest.mark.parametrize("L", [4, 8, 16])
def test_corrected_bounds_hold_on_split_attention_where_paper_bound_fails(L):
    X, W_Q, W_K, W_V = _split_attention_instance(L)
    out = self_attention(X, AttentionWeights(W_Q, W_K, W_V), loss=OutputLoss(target=torch.zeros(L, 2, dtype=DT)),
                         lanczos=EXACT)  # fmt: skip
    _assert_bounds_hold(out, rtol=1e-12)
    # the papers' uniform-attention factor ||dA/dT|| <= 1/L fails here: the queries split 1/2-1/2
    assert out["term/softmax_jac_norm"] > 1.0 / L
    # P1's proof bound for H_o(QQ): 2/(L^3 d_V d_K) k^2 v^2 x^6 (sheet §3a) is exceeded for L >= 8
    x, k, v = (torch.linalg.matrix_norm(M, 2) for M in (X, W_K, W_V))
    paper = 2.0 / (L**3 * 2 * 2) * k**2 * v**2 * x**6
    if L >= 8:
        assert out["outer/QQ"] > paper


@pytest.mark.parametrize("seed", range(12))
def test_corrected_bounds_hold_on_random_inputs(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    B, L, d, H, d_K = 2, 5, 4, 2, 2
    scale = [0.1, 1.0, 3.0][seed % 3]
    X = rand(gen, B, L, d, scale=scale)
    W = [rand(gen, d, H * d_K), rand(gen, d, H * d_K), rand(gen, d, H * 2), rand(gen, H * 2, 3)]
    loss = OutputLoss(grad_output=rand(gen, B, L, 3)) if seed % 2 else OutputLoss(target=rand(gen, B, L, 3))
    out = multi_head_attention(X, AttentionWeights(*W, n_heads=H), loss=loss,
                               structure=AttentionStructure(causal=bool(seed % 4 == 1)), lanczos=EXACT)  # fmt: skip
    _assert_bounds_hold(out, rtol=1e-10)


def test_function_preserving_rescaling_breaks_paper_bound_not_ours():
    """Sheet §3b: W_Q -> s W_Q, W_K -> W_K/s keeps F but grows ||H|| like s^2; our bound follows."""
    gen = torch.Generator().manual_seed(7)
    X, W_Q, W_K, W_V = rand(gen, 5, 3), rand(gen, 3, 2), rand(gen, 3, 2), rand(gen, 3, 3)
    T = rand(gen, 5, 3)
    for s in (1.0, 30.0, 300.0):
        out = self_attention(X, AttentionWeights(s * W_Q, W_K / s, W_V), loss=OutputLoss(target=T), lanczos=EXACT)
        assert out["hessian/QKV"] <= out["bound/QKV"]
        assert out["hessian/KK"] <= out["bound/KK"]


@pytest.mark.parametrize(
    "key, exponent", [("outer/VV", 2.0), ("outer/QQ", 6.0), ("functional/QQ", 5.0), ("outer/VQ", 4.0)]
)
def test_data_scaling_exponents(key, exponent):
    """X -> tX with weights and the output gradient fixed: log-log slopes of the sheet §2 (small t)."""
    gen = torch.Generator().manual_seed(11)
    X, W_Q, W_K, W_V = rand(gen, 6, 4), rand(gen, 4, 3), rand(gen, 4, 3), rand(gen, 4, 4)
    G = rand(gen, 6, 4)
    vals = [
        self_attention(
            t * X,
            AttentionWeights(W_Q, W_K, W_V),
            loss=OutputLoss(grad_output=G, output_curvature=1.0),
            lanczos=EXACT,
            pairs=["VV", "QQ", "VQ"],
        )[key]
        for t in (1e-3, 2e-3)
    ]
    slope = math.log(float(vals[1] / vals[0])) / math.log(2.0)
    assert abs(slope - exponent) < 0.02, slope


def test_float32_agrees_with_float64():
    gen = torch.Generator().manual_seed(2)
    X, W = rand(gen, 2, 8, 6), [rand(gen, 6, 4), rand(gen, 6, 4), rand(gen, 6, 4), rand(gen, 4, 6)]
    G = rand(gen, 2, 8, 6)
    causal = AttentionStructure(causal=True)
    out64 = multi_head_attention(X, AttentionWeights(*W, n_heads=2), loss=OutputLoss(grad_output=G), structure=causal,
                                 lanczos=EXACT)  # fmt: skip
    out32 = multi_head_attention(
        X.float(),
        AttentionWeights(*(w.float() for w in W), n_heads=2),
        loss=OutputLoss(grad_output=G.float()),
        structure=causal,
        lanczos=EXACT,
    )
    for key, v in out64.items():
        assert out32[key].dtype == torch.float32
        assert_close_report(out32[key], v, TOL["float32"], name=key, atol=1e-6)


def test_bad_input_errors_say_how_to_fix():
    X = torch.randn(4, 3, dtype=DT)
    W = torch.randn(3, 2, dtype=DT)
    target = OutputLoss(target=torch.zeros(4, 2, dtype=DT))
    with pytest.raises(ValueError, match="exactly one of target"):
        self_attention(X, AttentionWeights(W, W, W), loss=OutputLoss())
    with pytest.raises(ValueError, match="math convention"):
        self_attention(X, AttentionWeights(torch.randn(2, 3, dtype=DT), W, W), loss=target)
    with pytest.raises(ValueError, match="n_heads"):
        multi_head_attention(X, AttentionWeights(W, W, W, W, n_heads=0), loss=target)
    with pytest.raises(ValueError, match="shape"):
        self_attention(X, AttentionWeights(W, W, W), loss=OutputLoss(target=torch.zeros(5, 2, dtype=DT)))
    with pytest.raises(ValueError, match="Unknown attention pair"):
        self_attention(X, AttentionWeights(W, W, W), loss=target, pairs=["QV"])
    with pytest.raises(ValueError, match="one head without output projection"):
        self_attention(X, AttentionWeights(W, W, W, W), loss=target)


def test_padded_rows_do_not_change_the_statistics_and_nan_is_refused():
    gen = torch.Generator().manual_seed(9)
    X, W = rand(gen, 2, 4, 3), [rand(gen, 3, 2), rand(gen, 3, 2), rand(gen, 3, 2), rand(gen, 2, 3)]
    G = rand(gen, 2, 4, 3)
    kpm = torch.tensor([[False, False, False, True], [False] * 4])
    call = dict(loss=OutputLoss(grad_output=G), structure=AttentionStructure(key_padding_mask=kpm))
    weights = AttentionWeights(*W)
    base = multi_head_attention(X, weights, **call, lanczos=EXACT)
    X2 = X.clone()
    X2[0, 3] = 1e4  # a padded token with huge values
    out = multi_head_attention(X2, weights, **call, lanczos=EXACT)
    for key in ("term/x_norm", "hessian/QQ/h0", "outer/VV/h0", "term/attn_entropy/h0"):
        assert_close_report(out[key], base[key], TOL["float64"], name=key)
    X2[0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        multi_head_attention(X2, weights, **call)


def test_terms_false_returns_the_same_norms_only():
    gen = torch.Generator().manual_seed(11)
    X = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    W = [torch.randn(4, 4, generator=gen, dtype=torch.float64) for _ in range(4)]
    G = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    weights, loss = AttentionWeights(*W, n_heads=2), OutputLoss(grad_output=G)
    full = multi_head_attention(X, weights, loss=loss, lanczos=EXACT)
    norms = multi_head_attention(X, weights, loss=loss, lanczos=EXACT, terms=False)
    assert not any(k.startswith(("term/", "bound/")) for k in norms)
    assert set(norms) == {k for k in full if not k.startswith(("term/", "bound/"))}
    for key, val in norms.items():
        assert_close_report(val, full[key], 1e-12, name=key)


def test_row_layout_views_are_permute_reshape_in_at_most_two_operators():
    """``attention.layout.as_view`` (the products' layout changes) equals ``t.permute(perm).reshape(shape)`` on
    contiguous, permuted, transposed, offset and expanded inputs: a view of ``t``'s memory wherever ``reshape`` gives
    one (one dispatched operator), a contiguous copy otherwise (two); ``unflat`` equals ``view`` then ``permute``."""
    from benchmarks.bench_dispatch import OpCounter
    from curvwatch.closed_form.attention.layout import as_view, unflat

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 2, 4, 5, 6, generator=g, dtype=DT)
    inputs = {
        "contiguous": base,
        "permuted memory": base.permute(2, 0, 1, 3, 4),
        "transposed": base.transpose(-1, -2),
        "offset": torch.randn(4, 2, 4, 5, 6, generator=g, dtype=DT)[1:],
        "expanded": torch.randn(1, 2, 4, 5, 1, generator=g, dtype=DT).expand(3, 2, 4, 5, 6),
        "size one": base[:1],
    }
    perms = [(0, 1, 2, 3, 4), (1, 2, 0, 3, 4), (1, 2, 3, 0, 4), (2, 0, 1, 3, 4), (1, 3, 0, 2, 4)]
    views = 0
    for name, t in inputs.items():
        for perm in perms:
            p = t.permute(perm)
            a, b, c, d, e = p.shape
            for shape in ([a * b, c * d, e], [a, b * c, d * e], [p.numel()]):
                want = p.reshape(shape)
                counter = OpCounter()
                with counter:
                    got = as_view(t, perm, shape)
                assert torch.equal(got, want), (name, perm, shape)
                is_view = want.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                assert (got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()) == is_view, (name, perm)
                assert counter.total == (1 if is_view else 2), (name, perm, shape, dict(counter.ops))
                views += is_view
    assert views >= 10  # the view path is taken
    flat = torch.randn(2 * 3 * 4 * 5, 6, generator=g, dtype=DT)
    for perm in [(0, 1, 2, 3, 4), (3, 0, 1, 2, 4), (2, 0, 1, 3, 4)]:
        assert torch.equal(unflat(flat, (2, 3, 4, 5, 6), perm), flat.view(2, 3, 4, 5, 6).permute(perm))
