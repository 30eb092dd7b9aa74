"""Lanczos products leave out the parts whose batch members have all converged, without changing any norm."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from curvwatch.closed_form import (
    AttentionStructure,
    AttentionWeights,
    FFNWeights,
    OutputLoss,
    ffn,
    multi_head_attention,
    transformer_block,
)
from curvwatch.closed_form.attention import AttentionOperator
from curvwatch.closed_form.block import TransformerBlockOperator
from curvwatch.closed_form.ffn import FFNOperator
from curvwatch.closed_form.settings import EXACT, Lanczos
from curvwatch.closed_form.solver import choices, plan
from curvwatch.closed_form.solver.lanczos import LanczosRun, lanczos_max_abs, start_vectors
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

    plain = lanczos_max_abs(mv, start_vectors((4,), 30, DT, CPU), tol=1e-8)
    live_run = lanczos_max_abs(mv, start_vectors((4,), 30, DT, CPU), tol=1e-8, pass_live=True)
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
        return multi_head_attention(X, AttentionWeights(Wq, Wk, Wv, Wo, n_heads=H), loss=OutputLoss(target=T),
                                    structure=AttentionStructure(causal=True), terms=False, **kw)  # fmt: skip

    def mlp(**kw):
        return ffn(X, FFNWeights(W1, W2), activation="gelu", loss=OutputLoss(target=T), pairs=("W1W1", "W1W2"), **kw)

    def blk(**kw):
        return transformer_block(X, p, loss=OutputLoss(target=T), pairs=("QQ", "VK", "W1W1"), **kw)

    return [("attention", AttentionOperator, att), ("ffn", FFNOperator, mlp), ("block", TransformerBlockOperator, blk)]


@pytest.mark.parametrize("case", _problems(), ids=lambda c: c[0])
def test_converged_parts_are_not_computed(case, monkeypatch):
    name, cls, call = case
    kw = dict(lanczos=Lanczos(tol=1e-5, max_iter=40, max_basis=None, warn=False))
    runs = []  # per Lanczos run, per product: (tangent rows the operator got, parts with a live member)
    current: list = [None]  # the products of the run whose product is being computed (runs go in lockstep)
    def counting(apply):
        def counted(self, tangent, *a, **k):
            current[0].append([next(iter(tangent.values())).shape[0]])
            return apply(self, tangent, *a, **k)

        return counted

    class Counting(LanczosRun):
        def __init__(self, matvec, start, *, pass_live=False, **k):
            assert pass_live
            products: list = []
            runs.append(products)

            def mv(v, live):
                current[0] = products
                out = matvec(v, live)
                products[-1].append(int(live.reshape(start.shape[0], -1).any(-1).sum()))
                return out

            super().__init__(mv, start, pass_live=True, **k)

    for method in ("apply", "apply_masked"):  # (apply_masked: the one-pass product of the operators that have it)
        if hasattr(cls, method):
            monkeypatch.setattr(cls, method, counting(getattr(cls, method)))
    # the products are counted per run, each made by plan.norm_run (runs merged into one, plan._made, still call each
    # member run's product for its rows)
    monkeypatch.setattr(plan, "LanczosRun", Counting)
    # a stopping test every step: parts of these small blocks converge a few steps apart, which tests every few steps
    # would often merge
    with choices.forced(dataclasses.replace(choices.CPU, check_every=1)):
        reference = call(**kw)
        runs.clear()
        again = call(**kw)
    assert again.keys() == reference.keys()
    assert all(torch.equal(again[k], reference[k]) for k in reference), name
    # tangent rows per part (1 or 2 copies, times the heads where the operator couples them) are fixed per run:
    # every product gets exactly the rows of its live parts
    fewer = 0
    for products in runs:
        assert products and all(len(p) == 2 for p in products)
        rows0, parts0 = products[0]
        per_part = rows0 // parts0
        for rows, live_parts in products:
            assert rows == per_part * live_parts, (name, products)
            fewer += live_parts < parts0
    assert fewer > 0, f"{name}: no product with a converged part left out; the test does not exercise it"

    # without the skipping (every product over all parts) the norms are the same to float64 round-off: the products
    # stack the tangent rows into one matrix of a bmm (attention.layout's lmul/rmul), and a BLAS matmul's rounding may
    # depend on the number of rows it gets (~1e-12 for the attention and the block, 0 for the FFN, Lanczos included).
    # A relative residual is compared on the scale of tol: far below it (1e-9 to 1e-11 once a member waited for its
    # Ritz values to stand still) the same round-off is a larger share of it, and says nothing about the verdict.
    monkeypatch.setattr(plan, "LanczosRun", lambda *a, pass_live=False, **k: LanczosRun(*a, **k))
    with choices.forced(dataclasses.replace(choices.CPU, check_every=1)):
        full = call(**kw)
    scale = {k: reference[k].abs().clamp_min(kw["lanczos"].tol if k.startswith("residual/") else 1e-300) for k in full}
    worst = max(float(((full[k] - reference[k]).abs() / scale[k]).max()) for k in reference)
    assert worst <= 1e-10, (name, worst)


def test_block_part_subsets_of_an_off_diagonal_pair():
    """Outer + hessian rows of an off-diagonal pair cover every tangent row, out of order: they must be summed by
    their row indices, not read as in order (which gives ``hessian/VK`` 1e4x too large), which a converged functional
    part also triggers."""
    gen = torch.Generator().manual_seed(0)
    X = rand(gen, 2, 4, 4)
    p = {"n_heads": 2, "W_Q": rand(gen, 4, 6), "W_K": rand(gen, 4, 6), "W_V": rand(gen, 4, 4)}
    p.update(W_O=rand(gen, 4, 4), W_1=rand(gen, 4, 3), W_2=rand(gen, 3, 4))
    T = rand(gen, 2, 4, 4)
    loss = OutputLoss(target=T)
    every = transformer_block(X, p, loss=loss, pairs=("VK", "QW1"), lanczos=EXACT)
    for parts in (("outer", "hessian"), ("functional", "hessian"), ("hessian",)):
        some = transformer_block(X, p, loss=loss, pairs=("VK", "QW1"), parts=parts, lanczos=EXACT)
        for key in (k for k in some if k.split("/")[0] in parts):
            assert torch.allclose(some[key], every[key], rtol=1e-9, atol=1e-12), (parts, key)
