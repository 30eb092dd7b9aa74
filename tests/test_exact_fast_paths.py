"""The exact-only evaluation path (batched eigen-decompositions, lazy operators) against direct computations."""

from __future__ import annotations

import pytest
import torch

from curvwatch.closed_form import AttentionWeights, FFNWeights, OutputLoss, ffn, layernorm, multi_head_attention
from curvwatch.closed_form.attention import AttentionOperator, GroupView, HeadWeights, group_keys
from curvwatch.closed_form.attention.operator import vv_gram_run
from curvwatch.closed_form.attention.views import grouped_vv_plan
from curvwatch.closed_form.bounds import softmax_bound_factors, softmax_hessian_frobenius, softmax_jacobian_norm
from curvwatch.closed_form.masks import keep_masks
from curvwatch.closed_form.settings import EXACT
from curvwatch.closed_form.solver import choices, gram_lambda_max, solve_planned, spectral_norm_2d, spectral_norms
from curvwatch.closed_form.solver.linalg import SQUARING_TOL, top_by_squaring
from tests.utils import TOL, assert_close_report

DT = torch.float64


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=DT)


@pytest.mark.parametrize("chosen", [choices.CPU, choices.GPU], ids=["eigvalsh", "squaring"])
def test_gram_lambda_max_groups_by_gram_size_and_keeps_batch_shapes(chosen):
    gen = torch.Generator().manual_seed(0)
    mats = [_rand(gen, 3, 2, 5, 4), _rand(gen, 7, 4), _rand(gen, 4, 9), _rand(gen, 6, 3), _rand(gen, 2, 3, 3)]
    with choices.forced(chosen):
        lams = gram_lambda_max(*mats)
        norm = spectral_norm_2d(mats[0])
    assert len(lams) == len(mats)
    for i, (M, lam) in enumerate(zip(mats, lams, strict=True)):
        assert lam.shape == M.shape[:-2]
        expected = torch.linalg.matrix_norm(M, ord=2) ** 2
        assert_close_report(lam, expected, TOL["float64"], name=f"lambda_max {i}")
    assert_close_report(norm, torch.linalg.matrix_norm(mats[0], ord=2), TOL["float64"])


def _spectrum(gen, k: int, top: list[float], spread: bool = False) -> torch.Tensor:
    """A ``(k, k)`` float64 PSD matrix with the eigenvalues ``top`` above a random rest in ``[0, 0.9]``, in a random
    basis; ``spread``: the top eigenvector is ``1 / sqrt(k)`` in every coordinate (the least any column of ``G^p``
    holds of it, the case the tolerance is derived for)."""
    if spread:  # the Householder reflection taking e_1 to the uniform vector: its first column is that vector
        w = -torch.ones(k, dtype=DT) / k**0.5
        w[0] += 1.0
        Q = torch.eye(k, dtype=DT) - 2 * torch.outer(w, w) / (w @ w)
    else:
        Q, _ = torch.linalg.qr(_rand(gen, k, k))
    ev = torch.rand(k, generator=gen, dtype=DT) * 0.9
    ev[: len(top)] = torch.tensor(top, dtype=DT)
    return (Q * ev) @ Q.mT


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_top_by_squaring_is_a_rayleigh_quotient_within_its_tolerance(dtype):
    """:func:`top_by_squaring` never exceeds ``lambda_max`` (beyond round-off) and falls short by at most
    ``SQUARING_TOL``: random Grams of the shapes the bound terms take (432 of 64 rows, 12 of 512), clustered and
    degenerate tops, a top eigenvector spread evenly over the coordinates, zero and extreme scales. Measured: float64
    errors of round-off size but where the top two eigenvalues are closer than ``SQUARING_TOL`` (the quotient lies
    between them: 7.4e-7 for a gap of 1e-6, 2e-9 for 1e-4), float32 ones below 2e-6 (float32 ``eigvalsh``'s reach 6e-6
    on random Grams of these shapes)."""
    gen = torch.Generator().manual_seed(3)
    cases = {
        "random 64": (lambda M: M.mT @ M)(_rand(gen, 432, 192, 64)),
        "random 512": (lambda M: M.mT @ M)(_rand(gen, 12, 600, 512)),
    }
    for k in (64, 512):
        for top in ([1.0, 1 - 1e-4], [1.0, 1 - 1e-3, 1 - 2e-3], [1.0] * 5, [1.0, 1 - 1e-6], [1.0, 1 - 2e-3]):
            cases[f"clustered {k} {top}"] = _spectrum(gen, k, top)[None]
        cases[f"spread {k}"] = _spectrum(gen, k, [1.0, 1 - 2e-3], spread=True)[None]
    scaled = torch.zeros(3, 64, 64, dtype=DT)
    scaled[1], scaled[2] = torch.eye(64, dtype=DT) * 1e-30, _spectrum(gen, 64, [1.0]) * 1e30
    cases["zero, tiny, huge"] = scaled
    worst = 0.0
    for name, G in cases.items():
        exact = torch.linalg.eigvalsh(G)[:, -1]
        got = top_by_squaring(G.to(dtype)).to(DT)
        rel = (exact - got) / exact.clamp_min(torch.finfo(DT).tiny)
        assert (rel >= -(1e-12 if dtype == torch.float64 else 1e-6)).all(), (name, rel.min().item())
        assert (rel <= SQUARING_TOL).all(), (name, rel.max().item())
        worst = max(worst, rel.abs().max().item())
    assert worst < (1e-6 if dtype == torch.float64 else 2e-6), worst


@pytest.mark.parametrize("chosen", [choices.CPU, choices.GPU], ids=["eigvalsh", "squaring"])
def test_the_bound_matrices_top_eigenvalue_is_their_perron_root(chosen):
    """The whole ``QKV`` bound is the largest eigenvalue of a symmetric matrix of block bounds (entries >= 0): its
    spectral norm, taken as :func:`gram_lambda_max`'s square root; zero diagonals and zero matrices included."""
    from curvwatch.closed_form.bounds import _perron_root

    gen = torch.Generator().manual_seed(6)
    N = _rand(gen, 50, 5, 5).abs() * torch.logspace(-3, 3, 50, dtype=DT)[:, None, None]
    N = N + N.mT
    N[:10].diagonal(dim1=-2, dim2=-1).zero_()
    N[10] = 0.0
    with choices.forced(chosen):
        got = _perron_root(N)
    assert_close_report(got, torch.linalg.eigvalsh(N)[:, -1], 1e-12, name="perron root")


def test_the_gpu_choices_take_no_eigen_decomposition_for_the_exact_norms(monkeypatch):
    """Under the GPU's choices :func:`gram_lambda_max` dispatches no ``eigvalsh`` (a sync and milliseconds on a GPU);
    on the host it does."""
    calls = []
    eigvalsh = torch.linalg.eigvalsh
    monkeypatch.setattr(torch.linalg, "eigvalsh", lambda *a, **k: calls.append(1) or eigvalsh(*a, **k))
    M = _rand(torch.Generator().manual_seed(4), 3, 9, 5)
    with choices.forced(choices.GPU):
        gram_lambda_max(M)
    assert not calls
    with choices.forced(choices.CPU):
        gram_lambda_max(M)
    assert calls


def test_softmax_bound_factors_equal_the_separate_terms():
    gen = torch.Generator().manual_seed(1)
    T = _rand(gen, 3, 2, 6, 6) * torch.tensor([0.1, 1.0, 30.0], dtype=DT)[:, None, None, None]
    T[0, 0, :, 3:] = float("-inf")  # masked keys
    A = torch.softmax(T, -1)
    A[1, 1, 2] = 0.0  # a fully masked row
    alpha, beta = softmax_bound_factors(A)
    assert torch.equal(alpha, softmax_jacobian_norm(A))
    assert torch.equal(beta, softmax_hessian_frobenius(A))
    one = torch.ones(2, 3, 1, 1, dtype=DT)  # a single key
    assert torch.equal(softmax_bound_factors(one)[0], torch.zeros(2, 3, dtype=DT))


def test_attention_vv_matvec_matches_the_formed_factor():
    """The Lanczos path of ``outer/VV`` (d > 256) applies ``M^T M`` without forming ``M``; same operator."""
    gen = torch.Generator().manual_seed(2)
    B, L, d, H, k = 3, 6, 9, 2, 4
    X = _rand(gen, B, L, d)
    W_Q, W_K, W_V, W_O = _rand(gen, H, d, k), _rand(gen, H, d, k), _rand(gen, H, d, k), _rand(gen, H, k, 5)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -2:] = True
    keep, row_keep = keep_masks(B, L, True, kpm, X.device)
    op = AttentionOperator(X, HeadWeights(W_Q, W_K, W_V, W_O), keep, row_keep, _rand(gen, B, L, 5))
    op.set_cotangent(_rand(gen, B, L, 5), torch.rand(B, generator=gen, dtype=DT))
    M = op.vv_factor()  # (H, B L, d)
    v = _rand(gen, H, d)
    expected = torch.einsum("hnd,hn->hd", M, torch.einsum("hnd,hd->hn", M, v))
    # the product of the run, for two blocks stacked
    two = [torch.stack([t, t]) for t in (op.A, op.c, op.row_keep, op.Xkv, torch.zeros(H, d, dtype=DT))]
    two[1][1] *= 4  # c of the second block 4 times the first's: the rows sqrt(c) twice, M^T M 4 times
    run = vv_gram_run(*two, tol=0.0, max_iter=None, max_basis=None)
    got = run.matvec(torch.stack([v, v]))
    assert_close_report(got[0], expected, TOL["float64"], name="M^T M v")
    assert_close_report(got[1], 4 * expected, TOL["float64"], name="M^T M v, second block")
    exact = op.outer_vv_norm(EXACT)
    op.vv_exact = lambda d, max_iter: False  # take the Lanczos path at this small d
    assert_close_report(op.outer_vv_norm(EXACT.replace(max_iter=d)), exact, TOL["lanczos"], name="outer/VV by Lanczos")


def test_grouped_vv_run_equals_the_group_views_lanczos():
    """Grouped-query attention (``G = 3``): ``outer/VV/g*`` from the stacked run of :func:`grouped_vv_run` (one
    product for every layer's groups in a terms-only evaluation; planned, :func:`grouped_vv_plan`) equals the norms
    of the group view's own operator products, and both equal the dense block's largest eigenvalue."""
    gen = torch.Generator().manual_seed(4)
    B, L, d, H, H_kv, k, m = 2, 5, 6, 6, 2, 3, 4
    X = _rand(gen, B, L, d)
    W_Q, W_K, W_V, W_O = _rand(gen, H, d, k), _rand(gen, H_kv, d, k), _rand(gen, H_kv, d, k), _rand(gen, H, k, m)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -1] = True
    keep, row_keep = keep_masks(B, L, True, kpm, X.device)
    op = AttentionOperator(X, HeadWeights(W_Q, W_K, W_V, W_O), keep, row_keep, _rand(gen, B, L, m))
    op.set_cotangent(_rand(gen, B, L, m), torch.rand(B, generator=gen, dtype=DT) + 0.1)
    tight = EXACT.replace(tol=1e-10, max_iter=None, max_basis=None)
    new = solve_planned([grouped_vv_plan(GroupView(op), tight)])[0]
    old = group_keys(spectral_norms(GroupView(op), ["VV"], parts=("outer",), lanczos=tight))
    for j in range(H_kv):
        key = f"outer/VV/g{j}"
        assert_close_report(new[key], old[key], TOL["lanczos"], name=key)
        assert new[f"hessian/VV/g{j}"] is new[key] and float(new[f"functional/VV/g{j}"]) == 0.0
        assert float(new[f"residual/{key}"]) <= 1e-10


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("masked", [False, True])
def test_ffn_exact_only_path_equals_the_full_path(activation, masked):
    """Without iterative pairs the FFN skips its operator and act', act''; the exact keys do not change."""
    gen = torch.Generator().manual_seed(3)
    B, L, d, f = 2, 5, 3, 7
    Y = _rand(gen, B, L, d)
    weights = FFNWeights(_rand(gen, d, f), _rand(gen, f, d), b_1=_rand(gen, f))
    kw = dict(activation=activation, loss=OutputLoss(grad_output=_rand(gen, B, L, d)))
    if masked:
        mask = torch.ones(B, L, dtype=torch.bool)
        mask[1, 3:] = False
        kw["row_mask"] = mask
    exact = ffn(Y, weights, **kw, pairs=("W2W2",))
    full = ffn(Y, weights, **kw, pairs=("W2W2", "W1W2"))
    for key, val in exact.items():
        assert torch.equal(val, full[key]), key
    assert "outer/W1W2" not in exact
    Z = Y @ weights.W_1 + weights.b_1
    kept = Z[kw["row_mask"]] if masked else Z.reshape(-1, f)
    assert float(exact["dead_fraction"]) == pytest.approx(float((kept <= 0).all(0).to(DT).mean()))
    assert float(exact["active_fraction"]) == pytest.approx(float((kept > 0).to(DT).mean()))


def test_layernorm_without_mask_equals_an_all_true_mask():
    gen = torch.Generator().manual_seed(4)
    X = _rand(gen, 2, 4, 5)
    X[0, 1] = 0.25  # a constant row
    kw = dict(weight=_rand(gen, 5), bias=_rand(gen, 5), grad_output=_rand(gen, 2, 4, 5))
    for eps in (1e-5, 0.0):
        plain = layernorm(X, eps=eps, **kw)
        masked = layernorm(X, eps=eps, row_mask=torch.ones(2, 4, dtype=torch.bool), **kw)
        assert plain.keys() == masked.keys()
        for key in plain:
            assert torch.equal(plain[key], masked[key]), (eps, key)
        if eps == 0.0:
            assert torch.isinf(plain["jacobian_norm"]) and torch.isinf(plain["inv_std_max"])


def test_attention_grad_output_mode_needs_no_forward_output():
    """grad_output mode reads only the output's shape: terms and bounds equal those of a target giving that g."""
    gen = torch.Generator().manual_seed(5)
    X = _rand(gen, 2, 4, 6)
    W = [_rand(gen, 6, 4) for _ in range(3)]
    W_O = _rand(gen, 4, 6)
    G = _rand(gen, 2, 4, 6)
    weights = AttentionWeights(*W, W_O, n_heads=2)
    out = multi_head_attention(X, weights, loss=OutputLoss(grad_output=G), pairs=("VV",))
    assert_close_report(out["term/grad_norm"], G.norm(), TOL["float64"])
    with pytest.raises(ValueError, match="exactly one"):
        multi_head_attention(X, weights, loss=OutputLoss(), pairs=("VV",))


@pytest.mark.parametrize("sampled", [False, True])
def test_a_product_over_the_live_members_gives_the_full_products_rows(sampled, monkeypatch):
    """Inside a Lanczos product that names its live members (``LIVE_MEMBERS``, ``(rows, H)``, set by
    ``skip_dead_parts``), the attention operator computes only those: per part (``apply``) the heads with a live member
    (:meth:`AttentionOperator.heads_view`), in one pass (``apply_masked``) the live members packed into the heads of one
    row (:meth:`AttentionOperator.slots_view`), the rows tiled where the tangent repeats the parts (an off-diagonal
    pair's two halves). The same rows as the full product, zero on the members whose tangents are zero, with a
    stand-in and a sampled curvature; ``skip_dead_parts`` names exactly the members of the parts it computes.
    Grouped-query heads (``G > 1``) mix: the full product."""
    import numpy as np

    from curvwatch.closed_form.attention import operator as attention_operator
    from curvwatch.closed_form.solver.operator import ALL_ROWS, LIVE_MEMBERS, RowMask, live_members, skip_dead_parts

    monkeypatch.setattr(attention_operator, "HEADS_VIEW_MIN", 0)  # (this operator is below it)
    from curvwatch.closed_form.solver.sampled import SampledCurvature, with_sampled

    gen = torch.Generator().manual_seed(7)
    B, L, d, H, k, m = 2, 5, 6, 4, 3, 5
    X = _rand(gen, B, L, d)
    W_Q, W_K, W_V, W_O = _rand(gen, H, d, k), _rand(gen, H, d, k), _rand(gen, H, d, k), _rand(gen, H, k, m)
    keep, row_keep = keep_masks(B, L, True, None, X.device)
    op = AttentionOperator(X, HeadWeights(W_Q, W_K, W_V, W_O), keep, row_keep, _rand(gen, B, L, m))
    op.set_cotangent(_rand(gen, B, L, m), torch.rand(B, generator=gen, dtype=DT) + 0.1)
    if sampled:
        op = with_sampled(op, SampledCurvature.of_heads(_rand(gen, 6, B, L, m), W_O))
    members = np.array([[True, False, False, False], [False, False, True, False], [True, False, True, False]])
    for repeat in (1, 2):  # (2: the rows repeat the parts, as an off-diagonal pair's product)
        live = np.tile(members, (repeat, 1))
        on = torch.tensor(live, dtype=DT)[:, :, None, None]
        tangent = {nm: _rand(gen, 3 * repeat, H, d, k) * on for nm in "QKV"}
        rows = torch.tensor([0, 2]), torch.tensor([1, 2]), torch.tensor([0])
        full = op.apply(tangent, total_rows=rows[2], outer_rows=rows[0], func_rows=rows[1])
        masks = [torch.tensor([1.0, 0.0, 1.0] * repeat, dtype=DT), torch.tensor([0.0, 1.0, 1.0] * repeat, dtype=DT)]
        one = op.apply_masked(tangent, ("V", "Q", "K"), RowMask(masks[0]), RowMask(masks[1]))
        with live_members(members):
            assert LIVE_MEMBERS.get() is members
            got = op.apply(tangent, total_rows=rows[2], outer_rows=rows[0], func_rows=rows[1])
            views = op.__dict__["_views"][1]
            assert list(views)[-1] == (0, 2)  # per part: the two heads with a live member
            got_one = op.apply_masked(tangent, ("V", "Q", "K"), RowMask(masks[0]), RowMask(masks[1]))
            assert list(views)[-1] == tuple(np.nonzero(live)[1])  # in one pass: a slot per live member
        assert LIVE_MEMBERS.get() is None
        for part, (a, b) in enumerate(zip(full, got, strict=True)):
            for nm in "QKV":
                assert_close_report(b[nm], a[nm], 1e-12, name=f"part {part} {nm}")
                assert b[nm][:, [1, 3]].abs().max() == 0
        for nm in "QKV":
            assert_close_report(got_one[nm], one[nm], 1e-12, name=f"one pass {nm}, rows x{repeat}")
            assert got_one[nm][~torch.tensor(live)].abs().max() == 0
    # skip_dead_parts names the members of the parts it computes (part 1: none live, left out)
    seen = []
    mv = skip_dead_parts(["a", "b", "c"], lambda ks: lambda u: seen.append(LIVE_MEMBERS.get()) or u)
    live = np.array([[False, True, False, False], [False, False, False, False], [True, False, False, False]])
    mv(torch.zeros(3, H, 2), live)
    mv(torch.zeros(3, H, 2), np.ones((3, H), dtype=bool))
    assert seen[0].tolist() == live[[0, 2]].tolist() and seen[1] is None
    # grouped-query attention: the heads of a group mix, every head is computed
    gq = AttentionOperator(X, HeadWeights(W_Q, W_K[:2], W_V[:2], W_O), keep, row_keep, _rand(gen, B, L, m))
    gq.set_cotangent(_rand(gen, B, L, m), torch.ones(B, dtype=DT))
    with live_members(members):
        gq.apply({"Q": tangent["Q"]})
        gq.apply_masked({"Q": tangent["Q"]}, ("Q",), None, ALL_ROWS)
    assert "_views" not in gq.__dict__
