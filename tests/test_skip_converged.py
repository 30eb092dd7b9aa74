"""Lanczos products leave out the kinds whose batch members have all converged, without changing any norm."""

from __future__ import annotations

import pytest
import torch

from curvwatch.closed_form import _lanczos, _operator, ffn, multi_head_attention, transformer_block
from curvwatch.closed_form._lanczos import LanczosRun, lanczos_max_abs
from curvwatch.closed_form.attention import AttentionOperator
from curvwatch.closed_form.block import TransformerBlockOperator
from curvwatch.closed_form.ffn import FFNOperator
from curvwatch.closed_form.settings import EXACT, Lanczos
from tests.cases import DT, rand

CPU = torch.device("cpu")


def test_lanczos_pass_live_marks_the_nonzero_rows_and_changes_nothing():
    gen = torch.Generator().manual_seed(0)
    # eigenvalue gaps from large to tiny: the members converge after very different numbers of steps
    Q, _ = torch.linalg.qr(torch.randn(4, 30, 30, generator=gen, dtype=DT))
    ev = torch.linspace(0.0, 1.0, 30, dtype=DT).repeat(4, 1)
    ev[:, -1] = torch.tensor([3.0, 1.5, 1.05, 1.001], dtype=DT)
    S = Q @ torch.diag_embed(ev) @ Q.mT
    seen = []

    def mv(v, live=None):
        if live is not None:
            seen.append((torch.from_numpy(live.copy()), v.abs().sum(-1) > 0))
        return (S @ v.unsqueeze(-1)).squeeze(-1)

    plain = lanczos_max_abs(mv, (4,), 30, dtype=DT, device=CPU, tol=1e-8)
    live_run = lanczos_max_abs(mv, (4,), 30, dtype=DT, device=CPU, tol=1e-8, pass_live=True)
    assert torch.equal(plain[0], live_run[0]) and torch.equal(plain[1], live_run[1])
    assert all(live.device.type == "cpu" and torch.equal(live, nonzero) for live, nonzero in seen)
    assert seen[0][0].all() and not seen[-1][0].all()  # some members stopped before the others


def _problems():
    """``(name, operator class, call)``: the three operators through their public calls."""
    gen = torch.Generator().manual_seed(1)
    B, L, d, H, f = 2, 5, 6, 2, 7
    X = rand(gen, B, L, d)
    Wq, Wk, Wv, Wo = rand(gen, d, H * 3), rand(gen, d, H * 3), rand(gen, d, H * 3), rand(gen, H * 3, d)
    T = rand(gen, B, L, d)
    W1, W2 = rand(gen, d, f), rand(gen, f, d)
    p = {"n_heads": H, "W_Q": Wq, "W_K": Wk, "W_V": Wv, "W_O": Wo, "W_1": W1, "W_2": W2}

    def att(**kw):
        return multi_head_attention(X, Wq, Wk, Wv, Wo, H, target=T, causal=True, terms=False, **kw)

    def mlp(**kw):
        return ffn(X, W1, W2, activation="gelu", target=T, pairs=("W1W1", "W1W2"), **kw)

    def blk(**kw):
        return transformer_block(X, p, target=T, pairs=("QQ", "VK", "W1W1"), **kw)

    return [("attention", AttentionOperator, att), ("ffn", FFNOperator, mlp), ("block", TransformerBlockOperator, blk)]


@pytest.mark.parametrize("case", _problems(), ids=lambda c: c[0])
def test_converged_kinds_are_not_computed(case, monkeypatch):
    name, cls, call = case
    kw = dict(lanczos=Lanczos(tol=1e-5, max_iter=40, max_basis=None, warn=False))
    runs = []  # per Lanczos run, per product: (tangent rows the operator got, kinds with a live member)
    current: list = [None]  # the products of the run whose product is being computed (runs go in lockstep)
    def counting(apply):
        def counted(self, tangent, *a, **k):
            current[0].append([next(iter(tangent.values())).shape[0]])
            return apply(self, tangent, *a, **k)

        return counted

    class Counting(LanczosRun):
        def __init__(self, matvec, batch_shape, n, *, pass_live=False, **k):
            assert pass_live
            products: list = []
            runs.append(products)

            def mv(v, live):
                current[0] = products
                out = matvec(v, live)
                products[-1].append(int(live.reshape(batch_shape[0], -1).any(-1).sum()))
                return out

            super().__init__(mv, batch_shape, n, pass_live=True, **k)

    for method in ("apply", "apply_masked"):  # (apply_masked: the one-pass product of the operators that have it)
        if hasattr(cls, method):
            monkeypatch.setattr(cls, method, counting(getattr(cls, method)))
    monkeypatch.setattr(_operator, "LanczosRun", Counting)
    # one run per maker: the products are counted per run (a merged run's product calls each member run's operator,
    # _operator.MERGE_RUNS, tested in tests/test_sampled_curvature.py)
    monkeypatch.setattr(_operator, "MERGE_RUNS", False)
    # a stopping test every step: kinds of these small blocks converge a few steps apart, which tests every
    # CHECK_EVERY steps would often merge
    monkeypatch.setattr(_lanczos, "CHECK_EVERY", 1)
    reference = call(**kw)
    runs.clear()
    again = call(**kw)
    assert again.keys() == reference.keys()
    assert all(torch.equal(again[k], reference[k]) for k in reference), name
    # tangent rows per kind (1 or 2 copies, times the heads where the operator couples them) are fixed per run:
    # every product gets exactly the rows of its live kinds
    fewer = 0
    for products in runs:
        assert products and all(len(p) == 2 for p in products)
        rows0, kinds0 = products[0]
        per_kind = rows0 // kinds0
        for rows, live_kinds in products:
            assert rows == per_kind * live_kinds, (name, products)
            fewer += live_kinds < kinds0
    assert fewer > 0, f"{name}: no product with a converged kind left out; the test does not exercise it"

    # without the skipping (every product over all kinds) the norms are the same to float64 round-off: the products
    # stack the tangent rows into one matrix of a bmm (attention.py's _left/_right), and a BLAS matmul's rounding may
    # depend on the number of rows it gets (measured: 4.3e-13 attention, 1.5e-12 block, 0 FFN, Lanczos included)
    monkeypatch.setattr(_operator, "LanczosRun", lambda *a, pass_live=False, **k: LanczosRun(*a, **k))
    full = call(**kw)
    worst = max(float(((full[k] - reference[k]).abs() / reference[k].abs().clamp_min(1e-300)).max()) for k in reference)
    assert worst <= 1e-10, (name, worst)


def test_block_kind_subsets_of_an_off_diagonal_pair():
    """Outer + hessian rows of an off-diagonal pair cover every tangent row, out of order; they were read as
    in order (``hessian/VK`` came out 1e4x too large), which a converged functional kind also triggers."""
    gen = torch.Generator().manual_seed(0)
    X = rand(gen, 2, 4, 4)
    p = {"n_heads": 2, "W_Q": rand(gen, 4, 6), "W_K": rand(gen, 4, 6), "W_V": rand(gen, 4, 4)}
    p.update(W_O=rand(gen, 4, 4), W_1=rand(gen, 4, 3), W_2=rand(gen, 3, 4))
    T = rand(gen, 2, 4, 4)
    every = transformer_block(X, p, target=T, pairs=("VK", "QW1"), lanczos=EXACT)
    for kinds in (("outer", "hessian"), ("functional", "hessian"), ("hessian",)):
        some = transformer_block(X, p, target=T, pairs=("VK", "QW1"), kinds=kinds, lanczos=EXACT)
        for key in (k for k in some if k.split("/")[0] in kinds):
            assert torch.allclose(some[key], every[key], rtol=1e-9, atol=1e-12), (kinds, key)
