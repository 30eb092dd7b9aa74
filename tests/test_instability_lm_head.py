"""The LM-head signals of the instability suite against torch.func in float64, and the recorder on a tiny run."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.func import hessian

from benchmarks.instability.lm_head import (
    LMHeadRecorder,
    adam_precondition,
    head_hvp,
    head_statistics,
    lanczos_top,
)
from tests.utils import TOL, assert_close_report

DT = torch.float64

CASES = [
    {"N": 12, "d": 3, "V": 5, "scale": 1.0, "seed": 0},
    {"N": 7, "d": 4, "V": 6, "scale": 4.0, "seed": 1},  # peaked softmax: A_t far from its bound 1/2
    {"N": 30, "d": 2, "V": 9, "scale": 0.3, "seed": 2},  # N > V d
]


@pytest.fixture(params=CASES, ids=lambda c: f"N{c['N']}-d{c['d']}-V{c['V']}-s{c['scale']}")
def case(request):
    c = request.param
    gen = torch.Generator().manual_seed(c["seed"])
    X = torch.randn(c["N"], c["d"], generator=gen, dtype=DT)
    W = c["scale"] * torch.randn(c["V"], c["d"], generator=gen, dtype=DT)
    y = torch.randint(0, c["V"], (c["N"],), generator=gen)
    P = torch.rand(c["V"], c["d"], generator=gen, dtype=DT) + 0.1  # a positive Adam preconditioner
    return X, W, y, P


def _dense_hessian(X, W, y):
    """``(V d, V d)`` Hessian of the mean cross-entropy of ``X W^T`` w.r.t. ``W`` (row-major ``vec``)."""
    V, d = W.shape
    H = hessian(lambda w: F.cross_entropy(X @ w.reshape(V, d).T, y))(W.reshape(-1))
    return H


def test_hvp_matches_torch_func(case):
    X, W, y, _ = case
    H = _dense_hessian(X, W, y)
    E = torch.randn(W.shape, generator=torch.Generator().manual_seed(5), dtype=DT)
    P = torch.softmax(X @ W.T, -1)
    assert_close_report(head_hvp(X, P, E).reshape(-1), H @ E.reshape(-1), TOL["float64"], "H vec(E)")


def test_lambda_max_matches_eigvalsh(case):
    X, W, y, P = case
    H = _dense_hessian(X, W, y)
    values, vectors, _ = head_statistics(X, X @ W.T, W, precondition=P, lr=0.1, beta1=0.9, iters=W.numel())
    expected = torch.linalg.eigvalsh(H)[-1]
    assert_close_report(torch.tensor(values["sharpness"]), expected, TOL["lanczos"], "lambda_max(H)")
    D = P.reshape(-1).rsqrt()
    expected_adam = torch.linalg.eigvalsh(D[:, None] * H * D[None, :])[-1]
    assert_close_report(torch.tensor(values["adam_sharpness"]), expected_adam, TOL["lanczos"], "lambda_max(P^-1/2 H)")
    assert values["adam_ratio"] == pytest.approx(0.1 * float(expected_adam) / 38.0, rel=1e-6)
    # the Ritz vector is the top eigenvector: a warm start converges in one product
    again, _, residual = lanczos_top(lambda E: head_hvp(X, torch.softmax(X @ W.T, -1), E), vectors["sharpness"], 1)
    assert again == pytest.approx(float(expected), rel=1e-8) and residual < 1e-6
    # the bounds bound it, and the per-token ones are what they say
    assert float(expected) <= values["sharpness_bound"] * (1 + 1e-12)
    assert values["sharpness_bound"] <= 0.5 * values["x_spec"] * (1 + 1e-12)
    assert values["x_spec"] <= values["x_fro"] * (1 + 1e-12)
    assert values["lse_mean"] == pytest.approx(float(torch.logsumexp(X @ W.T, -1).mean()), rel=1e-12)
    assert values["logit_bound"] >= float((X @ W.T).abs().amax())


def test_adam_precondition_is_sqrt_v_hat_plus_eps():
    W = torch.nn.Parameter(torch.randn(3, 2, dtype=DT))
    opt = torch.optim.AdamW([W], lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    assert adam_precondition(opt, W) is None  # no state before the first step
    grads = [torch.randn(3, 2, generator=torch.Generator().manual_seed(i), dtype=DT) for i in range(2)]
    for g in grads:
        W.grad = g.clone()
        opt.step()
    P, lr, beta1 = adam_precondition(opt, W)
    v = 0.05 * (0.95 * grads[0].square() + grads[1].square())
    assert_close_report(P, (v / (1 - 0.95**2)).sqrt() + 1e-8, 1e-6, "P")
    assert (lr, beta1) == (0.01, 0.9)


def test_recorder_leaves_training_unchanged():
    from benchmarks.instability.models import ModelSpec
    from benchmarks.instability.train import RunConfig, run

    cfg = RunConfig(
        model=ModelSpec(arch="torch", d_model=16, seq_len=16, final_norm=False), steps=6, batch_size=4, lr=((0, 1e-2),)
    )
    plain = run(cfg, monitor=False)
    recorder = LMHeadRecorder("torch", iters=3)
    recorded = run(cfg, monitor=False, callbacks=[recorder])
    assert recorded["series"]["loss"] == plain["series"]["loss"]
    series = recorder.series(recorded["steps"])
    assert len(series["head/sharpness"]) == 6 and all(v > 0 for v in series["head/sharpness"])
    assert series["head/adam_ratio"][0] is None and all(v > 0 for v in series["head/adam_ratio"][1:])


def test_recorder_rejects_unknown_arch():
    with pytest.raises(ValueError, match="Invalid arch='rnn'"):
        LMHeadRecorder("rnn")
    with pytest.raises(ValueError, match="Invalid iters=0"):
        LMHeadRecorder("torch", iters=0)


def test_monitor_off_keeps_losses():
    """The LM-head runs train without the monitor: the losses are those of a run with it."""
    from benchmarks.instability.models import ModelSpec
    from benchmarks.instability.train import RunConfig, run

    cfg = RunConfig(model=ModelSpec(arch="torch", d_model=16, seq_len=16), steps=4, batch_size=4, max_tokens=32)
    cfg = replace(cfg, full_every=2)
    assert run(cfg, monitor=False)["series"]["loss"] == run(cfg)["series"]["loss"]
