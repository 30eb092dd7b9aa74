"""The matrix-free Lanczos iteration and the softmax bound terms against dense linear algebra."""

from __future__ import annotations

import torch

from curvwatch.closed_form import softmax_hessian_frobenius, softmax_jacobian_norm
from curvwatch.closed_form._lanczos import lanczos_max_abs
from tests.utils import TOL, assert_close_report

DT = torch.float64


def test_lanczos_matches_eigvalsh_batched():
    gen = torch.Generator().manual_seed(0)
    M = torch.randn(3, 4, 40, 40, generator=gen, dtype=DT)
    S = M + M.mT
    expected = torch.linalg.eigvalsh(S).abs().amax(-1)
    val, vec = lanczos_max_abs(
        lambda v: (S @ v.unsqueeze(-1)).squeeze(-1), (3, 4), 40, dtype=DT, device=torch.device("cpu")
    )
    assert_close_report(val, expected, TOL["lanczos"])
    exact, _ = lanczos_max_abs(
        lambda v: (S @ v.unsqueeze(-1)).squeeze(-1), (3, 4), 40, dtype=DT, device=torch.device("cpu"), tol=0.0
    )
    assert_close_report(exact, expected, 1e-12)
    # the Ritz vector is an eigenvector: warm start converges at once
    again, _ = lanczos_max_abs(
        lambda v: (S @ v.unsqueeze(-1)).squeeze(-1),
        (3, 4),
        40,
        dtype=DT,
        device=torch.device("cpu"),
        v0=vec,
        max_iter=3,
    )
    assert_close_report(again, expected, 1e-6)


def test_lanczos_zero_operator_and_negative_spectrum():
    val, _ = lanczos_max_abs(lambda v: 0 * v, (2,), 5, dtype=DT, device=torch.device("cpu"))
    assert torch.equal(val, torch.zeros(2, dtype=DT))
    D = torch.diag(torch.tensor([-7.0, 1.0, 2.0], dtype=DT))
    val, _ = lanczos_max_abs(lambda v: v @ D, (), 3, dtype=DT, device=torch.device("cpu"))
    assert abs(float(val) - 7.0) < 1e-6


def _dense_softmax_terms(a: torch.Tensor):
    J = torch.diag(a) - torch.outer(a, a)
    L = a.numel()
    eye = torch.eye(L, dtype=DT)
    # d^2 a_j / dT_k dT_l = a_j [2 a_k a_l + d_jk d_jl - d_kl a_k - d_jk a_l - a_k d_jl]
    S = a[:, None, None] * (
        2 * a[None, :, None] * a[None, None, :]
        + eye[:, :, None] * eye[:, None, :]
        - eye[None, :, :] * a[None, :, None]
        - eye[:, :, None] * a[None, None, :]
        - a[None, :, None] * eye[:, None, :]
    )
    return torch.linalg.eigvalsh(J)[-1], S.norm()


def test_softmax_terms_match_dense():
    gen = torch.Generator().manual_seed(1)
    T = 3 * torch.randn(2, 6, 6, generator=gen, dtype=DT)
    T[0, 0, :] = 0.0  # a uniform row (ties everywhere)
    T[1, 2, :2] = 50.0  # two tied maxima
    T[1, 3, 1] = 30.0  # nearly one-hot: the other entries are ~1e-13 (catastrophic cancellation case)
    T[0, 4, 5] = 21.0  # nearly one-hot, ~1e-9 elsewhere
    A = torch.softmax(T, -1)
    alpha, beta = softmax_jacobian_norm(A), softmax_hessian_frobenius(A)
    for b in range(2):
        rows = [_dense_softmax_terms(A[b, i]) for i in range(6)]
        assert_close_report(alpha[b], max(r[0] for r in rows), 1e-10)
        assert_close_report(beta[b], max(r[1] for r in rows), 1e-10)
        for i, (a_i, b_i) in enumerate(rows):  # row by row: tiny values of near-one-hot rows must be right too
            row = A[b, i].unsqueeze(0)  # one query row
            assert_close_report(softmax_jacobian_norm(row), a_i, 1e-6, name=f"alpha row {b},{i}", atol=1e-15)
            assert_close_report(softmax_hessian_frobenius(row), b_i, 1e-6, name=f"beta row {b},{i}", atol=1e-15)
    assert float(alpha.max()) <= 0.5
