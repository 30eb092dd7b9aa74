"""Monte-Carlo output curvature of the closed-form kernels (``output_samples``, ``precondition``): the sampled GGN,
sharpness and preconditioned keys against dense torch.func references (curvwatch.closed_form.solver.sampled and the
modules beside it).

The reference of a diagonal block ``XX``: ``J_X = jacrev`` of the block output ``(B, L, m)`` in weight ``X`` (one
head's or one kv group's columns where per head), ``C`` built explicitly from the samples (block diagonal over the
sequences, masked rows zeroed), ``H_f`` the Hessian of ``<G, F(X)>``; then ``eigvalsh(...)[-1]`` of ``J^T C J``,
``J^T C J + H_f`` and ``P^{-1/2} (.) P^{-1/2}``.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch.func import hessian, jacrev

from curvwatch.closed_form import (
    EXACT,
    AttentionStructure,
    AttentionWeights,
    FFNWeights,
    GatedFFNWeights,
    Lanczos,
    OutputLoss,
    WarmStart,
    ffn,
    gated_ffn,
    multi_head_attention,
    self_attention,
)
from curvwatch.closed_form.ffn import activation_derivatives
from curvwatch.closed_form.solver import choices, debiasing, gram, members, plan, sampled, sampled_keys
from curvwatch.closed_form.solver.debiasing import debias
from curvwatch.reference.attention import attention_blocked, attention_forward, attention_head, blocked_logits
from curvwatch.reference.common import with_columns
from curvwatch.reference.ffn import ffn_forward
from curvwatch.reference.gated_ffn import gated_ffn_forward
from tests.cases import DT, case_id, rand
from tests.utils import assert_close_report, live_memory

# Tolerances, relative. The kernels' Lanczos with EXACT (run to the block size) vs dense eigvalsh, float64: round-off.
RTOL = 1e-8
# the relative Lanczos residual reported by EXACT runs (Krylov space exhausted or full: round-off)
EXACT_RESIDUAL = 1e-6
# a Lanczos(tol=1e-10) run (stopping test, not exhaustion) vs dense eigvalsh
CONVERGED = 1e-6

K = 3  # samples


@dataclass
class Block:
    """One diagonal block: its key (``QQ/h1``), the kernel's weight argument, the block weight and output map."""

    key: str
    arg: str
    W0: torch.Tensor
    forward: Callable[[torch.Tensor], torch.Tensor]  # block weight -> output (B, L, m)


@dataclass
class Problem:
    call: Callable[..., dict]  # kernel(**extra) with the case's inputs
    samples: torch.Tensor  # as passed to the kernel
    precondition: dict[str, torch.Tensor]  # kernel argument name -> P, as passed
    blocks: list[Block]
    G: torch.Tensor  # (B, L, m)
    S: torch.Tensor  # (k, B, L, m)
    keep: torch.Tensor  # (B, L) bool
    cols: dict[str, slice]  # block key -> the columns of its weight argument (P's block)


def _positive(gen, *shape):
    return 0.05 + torch.rand(*shape, generator=gen, dtype=DT)


def _keep_mask(gen, B, L):
    mask = torch.rand(B, L, generator=gen) < 0.6
    mask[:, 0] = True  # every sequence keeps a token
    return mask


def _call(kernel, X, weights, loss: OutputLoss, **fixed):
    """``call(**extra)``: ``kernel(X, weights, loss=..., **fixed, **extra)``, the loss's fields in ``extra``
    (``output_samples``, ``grad_output``, ...) replacing its own."""

    def call(**extra):
        names = {f.name for f in dataclasses.fields(OutputLoss)}
        own = dataclasses.replace(loss, **{k: extra.pop(k) for k in list(extra) if k in names})
        return kernel(X, weights, loss=own, **fixed, **extra)

    return call


def _finish(call, gen, case, out_shape, blocks, cols, keep, P, G):
    """The samples and the batched reference tensors common to every kernel."""
    B, L, m = out_shape
    lead = (case["B"],) if case["B"] else ()
    samples = rand(gen, K, *lead, L, m)
    pre = {nm: p for nm, p in P.items() if nm in case["pre"]}
    S = samples if case["B"] else samples.unsqueeze(1)
    G = G if case["B"] else G.unsqueeze(0)
    return Problem(call, samples, pre, blocks, G, S, keep, cols)


def _ffn_problem(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, L, d, f, m = case["B"] or 1, case["L"], case["d"], case["f"], case["m"]
    lead = (case["B"],) if case["B"] else ()
    Y, W_1, W_2 = rand(gen, *lead, L, d), rand(gen, d, f), rand(gen, f, m)
    G = rand(gen, *lead, L, m)
    kw = dict(activation=case["activation"], residual=case["residual"])
    b_1 = b_2 = None
    if case["bias"]:
        b_1, b_2 = rand(gen, f), rand(gen, m)
    keep = torch.ones(B, L, dtype=torch.bool)
    if case["mask"]:
        keep = _keep_mask(gen, B, L)
        kw["row_mask"] = keep if case["B"] else keep[0]
    Yb = Y if case["B"] else Y.unsqueeze(0)

    def fwd(W1, W2):
        return ffn_forward(Yb, W1, W2, case["activation"], case["residual"], b_1, b_2)

    blocks = [Block("W1W1", "W_1", W_1, lambda W: fwd(W, W_2)), Block("W2W2", "W_2", W_2, lambda W: fwd(W_1, W))]
    P = {"W_1": _positive(gen, d, f), "W_2": _positive(gen, f, m)}
    cols = {"W1W1": slice(None), "W2W2": slice(None)}
    call = _call(ffn, Y, FFNWeights(W_1, W_2, b_1, b_2), OutputLoss(grad_output=G, output_curvature=0.37), **kw)
    return _finish(call, gen, case, (B, L, m), blocks, cols, keep, P, G)


def _gated_problem(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, L, d, f, m = case["B"] or 1, case["L"], case["d"], case["f"], case["m"]
    lead = (case["B"],) if case["B"] else ()
    Y, Wg, Wu, Wd = rand(gen, *lead, L, d), rand(gen, d, f), rand(gen, d, f), rand(gen, f, m)
    G = rand(gen, *lead, L, m)
    kw = dict(activation=case["activation"])
    bg = bu = bd = None
    if case["bias"]:
        bg, bu, bd = rand(gen, f), rand(gen, f), rand(gen, m)
    keep = torch.ones(B, L, dtype=torch.bool)
    if case["mask"]:
        keep = _keep_mask(gen, B, L)
        kw["row_mask"] = keep if case["B"] else keep[0]
    Yb = Y if case["B"] else Y.unsqueeze(0)

    def fwd(W1, W3, W2):
        return gated_ffn_forward(Yb, GatedFFNWeights(W1, W3, W2, bg, bu, bd), case["activation"])

    blocks = [
        Block("W1W1", "W_gate", Wg, lambda W: fwd(W, Wu, Wd)),
        Block("W3W3", "W_up", Wu, lambda W: fwd(Wg, W, Wd)),
        Block("W2W2", "W_down", Wd, lambda W: fwd(Wg, Wu, W)),
    ]
    P = {"W_gate": _positive(gen, d, f), "W_up": _positive(gen, d, f), "W_down": _positive(gen, f, m)}
    cols = {b.key: slice(None) for b in blocks}
    call = _call(gated_ffn, Y, GatedFFNWeights(Wg, Wu, Wd, bg, bu, bd), OutputLoss(grad_output=G), **kw)
    return _finish(call, gen, case, (B, L, m), blocks, cols, keep, P, G)


def _right_padding(gen, B, L):
    """``(B, L)`` bool, True = padded: a seeded number of trailing positions per sequence (never all)."""
    lengths = torch.randint(2, L + 1, (B,), generator=gen)
    return torch.arange(L)[None] >= lengths[:, None]


def _self_attention_problem(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, L, d, d_K, d_V = case["B"] or 1, case["L"], case["d"], case["d_K"], case["d_V"]
    lead = (case["B"],) if case["B"] else ()
    X, W_Q, W_K, W_V = rand(gen, *lead, L, d), rand(gen, d, d_K), rand(gen, d, d_K), rand(gen, d, d_V)
    G = rand(gen, *lead, L, d_V)
    structure = AttentionStructure(causal=case["causal"])
    padded = None
    if case["pad"]:
        padded = _right_padding(gen, B, L)
        structure = dataclasses.replace(structure, key_padding_mask=padded if case["B"] else padded[0])
    keep = torch.ones(B, L, dtype=torch.bool) if padded is None else ~padded
    Xb = X if case["B"] else X.unsqueeze(0)
    blocked = blocked_logits(B, L, case["causal"], padded, X.device)
    W = {"W_Q": W_Q, "W_K": W_K, "W_V": W_V}

    def fwd(arg):
        return lambda blk: attention_head(Xb, *({**W, arg: blk}[a] for a in ("W_Q", "W_K", "W_V")), blocked)

    blocks = [Block(f"{p}", f"W_{p[0]}", W[f"W_{p[0]}"], fwd(f"W_{p[0]}")) for p in ("VV", "QQ", "KK")]
    P = {nm: _positive(gen, *w.shape) for nm, w in W.items()}
    cols = {b.key: slice(None) for b in blocks}
    loss = OutputLoss(grad_output=G, output_curvature=0.37)
    call = _call(self_attention, X, AttentionWeights(W_Q, W_K, W_V), loss, structure=structure)
    return _finish(call, gen, case, (B, L, d_V), blocks, cols, keep, P, G)


def _rotary_tables(L, r):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=DT) / r))  # (r/2,)
    ang = torch.arange(L, dtype=DT)[:, None] * inv_freq[None]  # (L, r/2)
    ang = torch.cat([ang, ang], -1)  # halves duplicated, as Hugging Face builds them
    return ang.cos(), ang.sin()


def _mha_problem(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B, L, d, m = case["B"] or 1, case["L"], case["d"], case["m"]
    H, H_kv, d_K, d_V = case["H"], case["H_kv"], case["d_K"], case["d_V"]
    G_ = H // H_kv
    lead = (case["B"],) if case["B"] else ()
    X = rand(gen, *lead, L, d)
    W = {"W_Q": rand(gen, d, H * d_K), "W_K": rand(gen, d, H_kv * d_K), "W_V": rand(gen, d, H_kv * d_V)}
    W_O = rand(gen, H * d_V, m)
    G = rand(gen, *lead, L, m)
    biases = dict(b_Q=None, b_K=None, b_V=None, b_O=None)
    if case["bias"]:
        biases = dict(b_Q=rand(gen, H * d_K), b_K=rand(gen, H_kv * d_K), b_V=rand(gen, H_kv * d_V), b_O=rand(gen, m))
    rotary = _rotary_tables(L, d_K) if case["rotary"] else None
    padded = None
    if case["pad"]:
        padded = _right_padding(gen, B, L)
    kpm = None if padded is None else padded if case["B"] else padded[0]
    structure = AttentionStructure(causal=case["causal"], key_padding_mask=kpm, scale=case["scale"], rotary=rotary)
    keep = torch.ones(B, L, dtype=torch.bool) if padded is None else ~padded
    Xb = X if case["B"] else X.unsqueeze(0)
    blocked, dead = attention_blocked(B, L, L, case["causal"], None, padded, X.device)
    weights = AttentionWeights(**W, W_O=W_O, n_heads=H, n_kv_heads=H_kv, **biases)

    def fwd(arg, start):
        def forward(blk):
            w = dataclasses.replace(weights, **{arg: with_columns(W[arg], blk, start)})
            return attention_forward(Xb, w, blocked, rotary=rotary, scale=case["scale"], dead=dead)

        return forward

    blocks, cols = [], {}
    for h in range(H):  # QQ per query head
        c = slice(h * d_K, (h + 1) * d_K)
        blocks.append(Block(f"QQ/h{h}", "W_Q", W["W_Q"][:, c], fwd("W_Q", c.start)))
        cols[f"QQ/h{h}"] = c
    for j in range(H_kv):  # VV, KK per kv group (per head without grouping)
        suffix = f"/h{j}" if G_ == 1 else f"/g{j}"
        for pair, arg, width in (("VV", "W_V", d_V), ("KK", "W_K", d_K)):
            c = slice(j * width, (j + 1) * width)
            blocks.append(Block(f"{pair}{suffix}", arg, W[arg][:, c], fwd(arg, c.start)))
            cols[f"{pair}{suffix}"] = c
    P = {nm: _positive(gen, *w.shape) for nm, w in W.items()}
    call = _call(
        multi_head_attention, X, weights, OutputLoss(grad_output=G, output_curvature=0.37), structure=structure
    )
    return _finish(call, gen, case, (B, L, m), blocks, cols, keep, P, G)


PROBLEMS = {
    "ffn": _ffn_problem,
    "gated_ffn": _gated_problem,
    "self_attention": _self_attention_problem,
    "mha": _mha_problem,
}

# fmt: off
CASES = [
    ("ffn", dict(B=2, L=3, d=4, f=5, m=4, activation="gelu", residual=True, bias=True, mask=True, pre=("W_1", "W_2"))),
    ("ffn", dict(B=None, L=4, d=3, f=4, m=2, activation="relu", residual=False, bias=False, mask=False, pre=("W_1",))),
    ("gated_ffn", dict(B=2, L=3, d=3, f=4, m=2, activation="silu", bias=True, mask=True, pre=("W_gate", "W_down"))),
    ("gated_ffn", dict(B=None, L=4, d=3, f=5, m=3, activation="gelu_tanh", bias=False, mask=True,
                       pre=("W_gate", "W_up", "W_down"))),
    ("self_attention", dict(B=2, L=4, d=4, d_K=2, d_V=3, causal=False, pad=True, pre=("W_Q", "W_K", "W_V"))),
    ("self_attention", dict(B=2, L=3, d=3, d_K=2, d_V=2, causal=True, pad=True, pre=("W_K",))),
    ("self_attention", dict(B=None, L=4, d=3, d_K=2, d_V=2, causal=True, pad=False, pre=())),
    ("mha", dict(B=2, L=4, d=4, H=2, H_kv=2, d_K=2, d_V=2, m=5, causal=True, pad=True, bias=True, rotary=False,
                 scale=None, pre=("W_Q", "W_K", "W_V"))),
    ("mha", dict(B=2, L=3, d=4, H=4, H_kv=2, d_K=2, d_V=3, m=4, causal=False, pad=False, bias=False, rotary=True,
                 scale=0.7, pre=("W_Q", "W_V"))),  # GQA, rotary, scale
    ("mha", dict(B=None, L=4, d=3, H=2, H_kv=1, d_K=2, d_V=2, m=3, causal=True, pad=False, bias=True, rotary=True,
                 scale=None, pre=("W_K", "W_V"))),  # multi-query, unbatched
]
# fmt: on


def _ids(param):
    return case_id(param) if isinstance(param, dict) else param


def _assert_sampled_keys_close(got: dict, ref: dict, tol: float) -> list[str]:
    """``got`` has ``ref``'s keys, and each of ``ref``'s sampled keys (``ggn``, ``sharpness`` and their
    ``precond_`` variants; some) is within ``tol`` of it in ``got``; returns those keys."""
    keys = [k for k in ref if k.split("/")[0] in ("sharpness", "precond_sharpness", "ggn", "precond_ggn")]
    assert keys and set(got) == set(ref)
    for key in keys:
        assert_close_report(got[key], ref[key], tol, name=key)
    return keys


def _reference(prob: Problem, block: Block, G: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Dense ``lambda_max`` of ``J^T C J`` (``ggn``) and ``J^T C J + H_f`` (``sharpness``), and of their
    ``P^{-1/2} (.) P^{-1/2}`` where the problem preconditions the block's weight, each debiased as the kernels do
    (:func:`~curvwatch.closed_form.solver.debias` of the values with all samples and with each half; ``raw``: the
    plain ones); plus ``H_f`` itself and the dense GGN of all samples."""
    G = prob.G if G is None else G
    F0 = block.forward(block.W0)
    B, L, m = F0.shape
    n = block.W0.numel()
    J = jacrev(block.forward)(block.W0).reshape(B * L * m, n)
    S = prob.S * prob.keep[None, :, :, None].to(DT)  # masked rows zeroed
    Gk = G * prob.keep[..., None].to(DT)
    H_f = hessian(lambda W: (Gk * block.forward(W)).sum())(block.W0).reshape(n, n)

    def top(M):
        return torch.linalg.eigvalsh(M)[-1]

    k = S.shape[0]

    def values(samples):
        """The estimate's top eigenvalues and each sample's part of its Gauss-Newton quotient at the top vector
        (``(k,)``, zero outside ``samples``; ``debias``'s ``shares``), per name."""
        ks = len(samples)
        Se = S[samples]
        C = torch.block_diag(*(Se[:, b].reshape(ks, -1).T @ Se[:, b].reshape(ks, -1) / ks for b in range(B)))
        ggn = J.T @ C @ J
        one = torch.ones(n, dtype=DT)
        mats = {"ggn": (ggn, one), "sharpness": (ggn + H_f, one)}
        if block.arg in prob.precondition:
            D = prob.precondition[block.arg][:, prob.cols[block.key]].reshape(-1).rsqrt()  # vec_r order, as W0
            mats["precond_ggn"] = (D[:, None] * ggn * D, D)
            mats["precond_sharpness"] = (D[:, None] * (ggn + H_f) * D, D)
        out, shares = {}, {}
        for name, (M, scale) in mats.items():
            lam, U = torch.linalg.eigh(M)
            out[name] = lam[-1]
            u = (J @ (scale * U[:, -1])).reshape(B, -1)  # the output tangent of the top vector, per sequence
            shares[name] = torch.zeros(k, dtype=DT)
            shares[name][samples] = torch.einsum("jbx,bx->jb", Se.reshape(ks, B, -1), u).square().sum(1) / ks
        return out, ggn, shares

    raw, ggn, s_full = values(list(range(k)))
    out = dict(raw)
    if k >= 2:
        (a, _, s_a), (b, _, s_b) = values(list(range(k // 2))), values(list(range(k // 2, k)))
        for name in raw:
            shares = torch.stack([s_full[name], s_a[name], s_b[name]])[..., None] if k >= 4 else None  # (3, k, 1)
            out[name], spread = debias(raw[name][None], a[name][None], b[name][None], (k, k // 2, k - k // 2),
                                       psd=name.endswith("ggn"), shares=shares)  # fmt: skip
            out[name] = out[name][0]
            if name == "sharpness":
                out["sharpness_spread"] = spread[0]
    return {**out, "raw": raw, "H_f": H_f, "ggn_dense": ggn}


@pytest.mark.parametrize("k", [K, 5], ids=["k3", "k5"])
@pytest.mark.parametrize("gram", [True, False], ids=["gram", "lanczos"])
@pytest.mark.parametrize("kernel, case", CASES, ids=_ids)
def test_sampled_keys_match_dense_reference_and_leave_the_other_keys_bitwise(kernel, case, gram, k, monkeypatch):
    """Both ways to the Gauss-Newton keys (the samples' Gram matrix, used up to ``GRAM_STEPS`` columns per Lanczos
    member it replaces, and the Lanczos runs above it) against the dense reference. With 3 samples (halves of 1 and
    2) the spread's noise is the halves' difference; with 5 (2 and 3) the delta method's standard error from each
    sample's part of each member's value at its top vector (``debias``'s ``shares``: the Gram's eigenvectors, or the
    Ritz vectors through the operator), against the dense top eigenvectors."""
    if not gram:
        monkeypatch.setattr(sampled_keys, "GRAM_STEPS", 0)
    monkeypatch.setattr(sys.modules[__name__], "K", k)
    prob = PROBLEMS[kernel](case)
    plain = prob.call(lanczos=EXACT)
    out = prob.call(lanczos=EXACT, output_samples=prob.samples, precondition=prob.precondition)
    for key, value in plain.items():
        assert torch.equal(out[key], value), f"{key} changed with output_samples"
    expected = set()
    for block in prob.blocks:
        ref = _reference(prob, block)
        for name in ("ggn", "sharpness", "precond_ggn", "precond_sharpness"):
            key = f"{name}/{block.key}"
            if name not in ref:
                assert key not in out
                continue
            expected |= {key, f"residual/{key}"}
            assert_close_report(out[key], ref[name], RTOL, name=key)
            assert float(out[f"residual/{key}"]) <= EXACT_RESIDUAL, key
        key = f"sharpness_spread/{block.key}"
        expected.add(key)
        assert_close_report(out[key], ref["sharpness_spread"], RTOL, name=key)
    assert set(out) - set(plain) == expected


def _solved_runs(runs: list) -> list:
    """The runs a ``solve`` steps, a merged run (``lanczos.merge_runs``, ``plan._made``) as the runs merged into it:
    which runs share a solve, whether or not they share a run."""
    return [r for run in runs for r in ([part[0] for part in run.merged] if run.merged else [run])]


@pytest.mark.parametrize(
    "kernel, case, gram_steps",
    # (the attention cases whose sampled QQ and KK members are one run, as the shipped design stacks them, have one
    # sampled run: nothing to share a solve with)
    [(*CASES[0], 0), (*CASES[2], 0), (*CASES[4], 0), (*CASES[8], None)],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_the_pairs_sampled_runs_are_solved_together_with_the_values_of_one_run_at_a_time(
    kernel, case, gram_steps, monkeypatch
):
    """The sampled keys' Lanczos runs of a call's pairs (the attention's ``QQ`` and ``KK``, through the query and group
    views with grouped-query attention; with ``GRAM_STEPS = 0`` the FFN's ``W1W1`` and ``W2W2`` too) share one
    ``solve`` (the attention's with its own runs), so that their stopping tests share host reads, and every Gram
    product is made before any run (no Gram temporaries beside a Lanczos basis). Over ``SOLVE_BYTES`` of bases the
    sampled runs go one at a time, each made when its solve starts; the keys are the same (float64, tight Lanczos,
    ``CONVERGED``). (Pairs whose blocks stack share one run, tested below.)"""
    if gram_steps is not None:
        monkeypatch.setattr(sampled_keys, "GRAM_STEPS", gram_steps)
    solves, events, made = [], [], []  # the runs of each solve, what happened in order, the sampled runs
    inner_solve, inner_columns, inner_run = plan.solve, sampled_keys.gram_columns, sampled_keys.norm_run

    def spy_solve(runs):
        solves.append(_solved_runs(runs))  # (held: no id of a freed run is reused)
        events.append("solve")
        return inner_solve(runs)

    def spy_columns(*args, **kwargs):
        events.append("columns")
        return inner_columns(*args, **kwargs)

    def spy_run(*args, **kwargs):
        events.append("run")
        made.append(inner_run(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(plan, "solve", spy_solve)
    monkeypatch.setattr(sampled_keys, "gram_columns", spy_columns)
    monkeypatch.setattr(sampled_keys, "norm_run", spy_run)
    prob = PROBLEMS[kernel](case)

    def keys() -> dict:
        solves.clear(), events.clear(), made.clear()
        lanczos = Lanczos(tol=1e-11, max_iter=400, warm_start=None)
        return prob.call(lanczos=lanczos, output_samples=prob.samples, precondition=prob.precondition)

    def sampled_per_solve() -> list[int]:  # the sampled runs in each solve that has any
        counts = [sum(any(r is m for m in made) for r in runs) for runs in solves]
        return [n for n in counts if n]

    together = keys()
    runs = len(made)
    assert runs >= 2 and sampled_per_solve() == [runs], (solves, events)  # one solve, all the sampled runs
    assert "columns" not in events[events.index("run") :], events
    # over SOLVE_BYTES of bases: one sampled run at a time, each made when its solve starts
    monkeypatch.setattr(plan, "SOLVE_BYTES", 1)
    capped = keys()
    sampled_solves = [r for r in solves if any(x is m for x in r for m in made)]
    assert [len(r) for r in sampled_solves] == [1] * runs, (solves, events)
    assert all(events[i + 1] == "solve" for i, e in enumerate(events) if e == "run"), events
    _assert_sampled_keys_close(together, capped, CONVERGED)


@pytest.mark.parametrize(
    "kernel, case, gram_steps, stacked_runs",
    [(*CASES[4], None, 1), (*CASES[4], 0, 2), (*CASES[5], None, 2), (*CASES[6], None, 1), (*CASES[7], None, 1),
     (*CASES[7], 0, 1)],
    ids=lambda v: v if isinstance(v, str) else None,
)  # fmt: skip
def test_the_attentions_qq_and_kk_sampled_members_share_one_run(kernel, case, gram_steps, stacked_runs, monkeypatch):
    """The sampled keys' Lanczos members of the attention's ``QQ`` and ``KK`` (and ``VV`` where it has members,
    ``GRAM_STEPS = 0``, and ``W_V`` has the shape of ``W_Q``) are rows of one run (``members_matvec`` with several
    blocks: each block's ``D`` and Gram columns, 0/1 row masks where two blocks' rows share a product): one Lanczos
    step per step for all of them. Pairs that cannot share a run stay apart (``pre=("W_K",)``: ``KK`` has
    preconditioned members, ``QQ`` none; ``d_V != d_K``: ``VV`` alone). The keys are those of the dense reference
    (float64, tight Lanczos, ``CONVERGED``), and the same with every row of a run in one product."""
    if gram_steps is not None:
        monkeypatch.setattr(sampled_keys, "GRAM_STEPS", gram_steps)
    runs = []
    inner = sampled_keys.norm_run

    def spy(op, emb, mv, parts, *args, **kwargs):
        runs.append(len(parts))
        return inner(op, emb, mv, parts, *args, **kwargs)

    monkeypatch.setattr(sampled_keys, "norm_run", spy)
    prob = PROBLEMS[kernel](case)

    def keys() -> dict:
        runs.clear()
        lanczos = Lanczos(tol=1e-11, max_iter=400, warm_start=None)
        return prob.call(lanczos=lanczos, output_samples=prob.samples, precondition=prob.precondition)

    together = keys()
    assert len(runs) == stacked_runs, runs
    for block in prob.blocks:
        ref = _reference(prob, block)
        for name in ("ggn", "sharpness", "precond_ggn", "precond_sharpness"):
            if name in ref:
                assert_close_report(together[f"{name}/{block.key}"], ref[name], CONVERGED, name=f"{name}/{block.key}")
    # every row of a run in one product (both blocks' paths, their D and Gram columns, in one operator call)
    monkeypatch.setattr(members, "MEMBER_ROWS", 64)
    _assert_sampled_keys_close(keys(), together, CONVERGED)


@pytest.mark.parametrize("kernel, case", [CASES[i] for i in (0, 2, 4, 6, 8)], ids=_ids)
def test_a_kernels_own_and_sampled_runs_are_merged_into_one_lanczos_run(kernel, case, monkeypatch):
    """The runs of one solve whose vectors have one size (a kernel's own run and its sampled members' run; the
    grouped-query views' runs) are one Lanczos run (``plan._made``), each member with its own start, tolerance and end
    of the spectrum (a merged run's members give the numbers of the runs apart, to the bit:
    ``tests/test_lanczos.py``)."""
    made = []  # the runs each solve steps: "merged" (of several runs' members) or "run"
    inner = plan.solve

    def counted(runs):
        made.extend("merged" if run.merged else "run" for run in runs)
        return inner(runs)

    monkeypatch.setattr(plan, "solve", counted)
    prob = PROBLEMS[kernel](case)
    prob.call(lanczos=Lanczos(warm_start=WarmStart()), output_samples=prob.samples, precondition=prob.precondition)
    assert "merged" in made, made


@pytest.mark.parametrize("kernel, case", CASES[:4], ids=_ids)
def test_the_ffns_own_and_sampled_runs_share_one_solve_within_solve_bytes(kernel, case, monkeypatch):
    """The FFN kernels (plain and gated; ReLU's and the gated ``W3W3``'s outer-only runs included) solve their own
    Lanczos runs and the sampled keys' in one ``solve`` while the bases stay within ``lanczos.solve_bytes`` (the
    monitor passes each block's memory estimate of its bases), so that their stopping tests share host reads: at
    GPT-2-small width one solve after the other costs 9-14 reads per layer. Past the budget (``solve_bytes=1``) no solve
    mixes the engine's runs with the sampled ones; the keys are the same (float64, tight Lanczos, ``CONVERGED``)."""
    solves, made = [], []
    inner_solve, inner_run = plan.solve, sampled_keys.norm_run

    def spy_solve(runs):
        solves.append(_solved_runs(runs))
        return inner_solve(runs)

    def spy_run(*args, **kwargs):
        made.append(inner_run(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(plan, "solve", spy_solve)
    monkeypatch.setattr(sampled_keys, "norm_run", spy_run)
    monkeypatch.setattr(sampled_keys, "GRAM_STEPS", 0)  # every sampled key by Lanczos: runs of both parts
    prob = PROBLEMS[kernel](case)

    def keys(solve_bytes: int | None) -> dict:
        solves.clear(), made.clear()
        lanczos = Lanczos(tol=1e-11, max_iter=400, warm_start=None, solve_bytes=solve_bytes)
        return prob.call(lanczos=lanczos, output_samples=prob.samples, precondition=prob.precondition)

    def is_sampled(run) -> bool:
        return any(run is m for m in made)

    together = keys(None)
    assert len(solves) == 1, solves
    own = [r for r in solves[0] if not is_sampled(r)]
    assert own and len(own) < len(solves[0]), solves  # the engine's runs and the sampled ones, one solve
    if case["activation"] == "relu" or kernel == "gated_ffn":  # the outer-only run and the others' run(s)
        assert len(own) >= 2, own
    apart = keys(1)
    assert len(solves) > 1 and all(len({is_sampled(r) for r in runs}) == 1 for runs in solves), solves
    assert set(together) == set(apart)
    for key, value in apart.items():
        if not key.startswith("residual/"):
            assert_close_report(together[key], value, CONVERGED, name=key)


@pytest.mark.parametrize("kernel, case", [CASES[0], CASES[2], CASES[4], CASES[8]], ids=_ids)
@pytest.mark.parametrize("gram", [False, True], ids=["lanczos", "gram"])
def test_default_lanczos_and_warm_start(kernel, case, gram, monkeypatch):
    """With the default settings the other keys stay bitwise (and their warm-start vectors too); the sampled runs
    store theirs under keys of their own and start from them next time, except those that start at their top
    Gauss-Newton direction (where the Gram path is taken: here every one), which keep nothing."""
    if not gram:
        monkeypatch.setattr(sampled_keys, "GRAM_STEPS", 0)
    prob = PROBLEMS[kernel](case)
    warm0, warm1 = WarmStart(), WarmStart()
    plain = prob.call(lanczos=Lanczos(warm_start=warm0))
    extra = dict(output_samples=prob.samples, precondition=prob.precondition)
    out = prob.call(lanczos=Lanczos(warm_start=warm1), **extra)
    for key, value in plain.items():
        assert torch.equal(out[key], value), key
    new = set(warm1._vectors) - set(warm0._vectors)
    if gram:
        assert not new, new
    else:
        assert new and all(k[0] == "sharpness" for k in new), new
    assert all(torch.equal(warm1._vectors[k], v) for k, v in warm0._vectors.items())
    again = prob.call(lanczos=Lanczos(warm_start=warm1), **extra)
    keys = [k for k in out if k.split("/")[0] in ("ggn", "sharpness", "precond_ggn", "precond_sharpness")]
    assert keys
    for key in keys:  # both runs converged to tol = 1e-3: some eigenvalue within that of each
        assert_close_report(again[key], out[key], 3 * Lanczos().tol, name=key)
        assert float(out[f"residual/{key}"]) <= Lanczos().tol, key


@pytest.mark.parametrize("kernel", ["ffn", "gated_ffn", "self_attention"])
def test_gram_path_runs_lanczos_for_the_sharpness_only_and_none_for_linear_blocks(kernel, monkeypatch):
    """With few samples times sequences the GGN keys come from the Gram matrix (exact: residual 0), the sharpness
    of a block whose own functional term is zero (``W2W2``, ``W3W3``, ``VV``: ``F`` linear in it) is its GGN with no
    Lanczos run at all, and the other sharpness keys run one Lanczos member per estimate and preconditioning (not
    two: no GGN members); the values as the Lanczos-only path's to its tolerance."""
    runs = []
    inner = sampled_keys.norm_run

    def counted(op, emb, mv, parts, *args, **kwargs):
        runs.append(tuple(parts))
        return inner(op, emb, mv, parts, *args, **kwargs)

    monkeypatch.setattr(sampled_keys, "norm_run", counted)
    case = next(c for k, c in CASES if k == kernel)
    prob = PROBLEMS[kernel](case)
    out = prob.call(lanczos=Lanczos(tol=1e-10), output_samples=prob.samples, precondition=prob.precondition)
    linear = {"ffn": ("W2W2",), "gated_ffn": ("W2W2", "W3W3"), "self_attention": ("VV",)}[kernel]
    assert runs and all(set(parts) == {"hessian"} for parts in runs), runs
    # a run per block with a functional term; the attention's QQ and KK in one (their blocks stack)
    assert len(runs) == (1 if kernel == "self_attention" else len({b.key for b in prob.blocks} - set(linear))), runs
    # one member per estimate (full sample, two halves) and preconditioning of each block with a functional term
    members = sum(3 * (2 if b.arg in prob.precondition else 1) for b in prob.blocks if b.key not in linear)
    assert sum(map(len, runs)) == members, runs
    for key, value in out.items():
        if key.startswith("residual/") and "ggn/" in key:
            assert float(value) == 0, key
    for pair in linear:
        assert torch.equal(out[f"sharpness/{pair}"], out[f"ggn/{pair}"]), pair
    monkeypatch.setattr(sampled_keys, "GRAM_STEPS", 0)
    runs.clear()
    slow = prob.call(lanczos=Lanczos(tol=1e-10), output_samples=prob.samples, precondition=prob.precondition)
    assert all(set(parts) == {"outer", "hessian"} for parts in runs), runs
    for key, value in slow.items():
        if not key.startswith("residual/"):
            assert_close_report(out[key], value, CONVERGED, name=key)


@pytest.mark.parametrize("kernel, case", [CASES[0], CASES[4]], ids=_ids)
def test_the_sampled_runs_take_no_second_look_and_the_kernels_own_do(kernel, case, monkeypatch):
    """The real-loss keys estimate from a few sampled output gradients: their relative uncertainty
    (``sharpness_spread``) exceeds the 1-5% a second Lanczos look finds, so their runs take none; the kernel's own
    norms in the same call keep it (``Lanczos.second_look``)."""
    import curvwatch.closed_form.solver.lanczos as lanczos_module

    looks = []
    init = lanczos_module.LanczosRun.__init__

    def spied(self, *args, second_look=True, **kwargs):
        looks.append(np.asarray(second_look, dtype=bool).copy())
        init(self, *args, second_look=second_look, **kwargs)

    sampled = []
    inner = sampled_keys.norm_run

    def counted(op, emb, mv, parts, key, diagonal, lanczos, *args, **kwargs):
        sampled.append(lanczos.second_look)
        return inner(op, emb, mv, parts, key, diagonal, lanczos, *args, **kwargs)

    monkeypatch.setattr(lanczos_module.LanczosRun, "__init__", spied)
    monkeypatch.setattr(sampled_keys, "norm_run", counted)
    monkeypatch.setattr(sampled_keys, "GRAM_STEPS", 0)  # every sampled key by Lanczos
    prob = PROBLEMS[kernel](case)
    prob.call(lanczos=Lanczos(), output_samples=prob.samples, precondition=prob.precondition)
    assert sampled and not any(sampled), sampled
    flat = np.concatenate([a.reshape(-1) for a in looks])
    assert flat.any() and not flat.all(), looks  # the kernel's own members look twice where crowded, the sampled never


@pytest.mark.parametrize("chosen", [choices.CPU, choices.GPU], ids=["eigh", "squaring"])
@pytest.mark.parametrize("k, split", [(4, True), (5, True), (3, False)])
def test_gram_eigenvalues_of_several_blocks_in_one_batch_equal_each_blocks_dense_ones(k, split, chosen):
    """``gram_eigen``: the Gram matrices (``gram_matrices``) of blocks with different head counts and scales,
    decomposed in one batch (the full samples' in one call, the halves' in a second when of one size, ``k`` odd:
    one each; ``eigh`` on the host, repeated squaring with the GPU's choices), give each block's top eigenvalue of
    ``D A_S A_S^T D / k_S`` per estimate (``S``: all samples, the first ``k // 2``, the others) and its top eigenvector
    ``D A_S u`` (float64, to 1e-10 against ``eigvalsh`` / ``eigh`` of the dense ``size x size`` blocks)."""
    g = torch.Generator().manual_seed(0)
    B = 2
    curvature = sampled.SampledCurvature(torch.randn(k, B, 1, 3, generator=g, dtype=DT))
    _, ka, kb = curvature.counts
    blocks = [(torch.randn(3, k * B, 7, generator=g, dtype=DT), torch.rand(3, 7, generator=g, dtype=DT) + 0.5),
              (torch.randn(1, k * B, 7, generator=g, dtype=DT), None)]  # fmt: skip
    items = []
    for j, (A, D) in enumerate(blocks):
        (G,) = gram.gram_matrices(A, curvature, [D])
        items.append((j, G, A, D))
    with choices.forced(chosen):
        out = gram.gram_eigen(items, curvature, split, DT)
    estimates = [(slice(None), k)] + ([(slice(None, ka * B), ka), (slice(ka * B, None), kb)] if split else [])
    for (A, D), (values, tops, _) in zip(blocks, out, strict=True):
        assert values.shape == (len(estimates), A.shape[0]) and tops.shape == (len(estimates), *A.shape[::2])
        for e, (cols, count) in enumerate(estimates):
            M = A[:, cols].mT @ A[:, cols] / count  # (H, size, size): J^T C_S J of the estimate
            if D is not None:
                M = D[:, :, None] * M * D[:, None, :]
            lam, U = torch.linalg.eigh(M)
            assert_close_report(values[e], lam[:, -1], 1e-10, name=f"values {e}")
            v = tops[e] / tops[e].norm(dim=-1, keepdim=True)  # (unnormalised, sign free)
            assert_close_report((v * U[..., -1]).sum(-1).abs(), torch.ones(A.shape[0], dtype=DT), 1e-10, name=f"{e}")


@pytest.mark.parametrize("chosen", [choices.CPU, choices.GPU], ids=["eigh", "squaring"])
@pytest.mark.parametrize("spectrum", ["spike", "decay"])
def test_the_debiased_values_standard_error_matches_their_spread_over_repeated_samples(spectrum, chosen):
    """``debias``'s noise term, two standard errors by the delta method from each sample's part of each estimate's
    value (``shares``, here from ``gram_eigen``), is calibrated: over 200 independent sample sets of a Gaussian
    Gauss-Newton block (20 weights: one spiked eigenvalue, or a decaying spectrum; 16 samples of 4 sequences, as the
    kernels see them), the standard deviation of the debiased value is within 20% of the mean standard error (about
    0.96-1.11x). Without the halves' sample counts in the variance (``var`` alone) it would read 3x too small."""
    k, B, p, R = 16, 4, 20, 200
    g = torch.Generator().manual_seed(0)
    spec = (
        torch.tensor([10.0] + [1.0] * (p - 1), dtype=DT)
        if spectrum == "spike"
        else 1 / torch.arange(1, p + 1, dtype=DT)
    )
    curvature = sampled.SampledCurvature(torch.zeros(k, B, 1, 1, dtype=DT))
    q = debiasing.richardson_q(curvature.counts)
    estimates, errors = [], []
    for _ in range(R):
        A = torch.randn(1, k * B, p, generator=g, dtype=DT) * spec.sqrt()  # columns of the block's samples
        (G,) = gram.gram_matrices(A, curvature, [None])
        with choices.forced(chosen):
            ((values, _, shares),) = gram.gram_eigen([(0, G, None, None)], curvature, True, DT)
        est, width = debias(*values.unbind(), curvature.counts, psd=True, shares=shares)
        correction = ((values[1] + values[2]) / 2 - values[0]) * q
        errors.append(float((width * est.abs() - debiasing.SPREAD_FACTOR * correction.abs()) / debiasing.NOISE_SE))
        estimates.append(float(est))
    ratio = torch.tensor(estimates).std() / torch.tensor(errors).mean()
    assert 0.8 < ratio < 1.25, ratio


def test_debias_without_shares_or_with_a_half_of_one_sample_takes_the_halves_difference():
    """With fewer than 4 samples (or no shares) the noise term is the halves' half-difference."""
    full, a, b = torch.tensor([1.2], dtype=DT), torch.tensor([1.5], dtype=DT), torch.tensor([1.3], dtype=DT)
    shares = torch.rand(3, 3, 1, dtype=DT)
    for counts, s in (((3, 1, 2), shares), ((16, 8, 8), None)):
        est, width = debias(full, a, b, counts, shares=s)
        q = debiasing.richardson_q(counts)
        correction = ((a + b) / 2 - full) * q
        expected = ((a - b).abs() / 2 + debiasing.SPREAD_FACTOR * correction.abs()) / est.abs()
        assert_close_report(width, expected, 1e-12, name=str(counts))


def test_pairs_select_the_sampled_keys():
    """Only the diagonal pairs asked for; W2W2 alone (exact otherwise, no operator) still gets its keys."""
    prob = _ffn_problem(CASES[0][1])
    out = prob.call(pairs=("W2W2",), output_samples=prob.samples, lanczos=EXACT)
    assert sorted(k for k in out if "ggn" in k or "sharpness" in k) == [
        "ggn/W2W2", "residual/ggn/W2W2", "residual/sharpness/W2W2", "sharpness/W2W2", "sharpness_spread/W2W2"
    ]  # fmt: skip
    assert_close_report(out["sharpness/W2W2"], out["ggn/W2W2"], RTOL)  # H_f(W2W2) = 0
    out = prob.call(pairs=("W1W2",), output_samples=prob.samples)  # no diagonal pair: no sampled key
    assert not [k for k in out if "ggn" in k or "sharpness" in k]


@pytest.mark.spread_limit
def test_keys_above_the_spread_limit_get_no_value(monkeypatch):
    """``SPREAD_LIMIT``: a debiased key whose relative uncertainty exceeds it gets no value: left out of a direct
    call's result (its ``sharpness_spread`` kept, so the reason is visible), NaN ("no data") inside the engine, which
    the logbook's ``flatten`` drops without flagging the block; the keys within the limit are those of the unlimited
    call, bit for bit."""
    from curvwatch.closed_form import inputs_checked
    from curvwatch.logbook import flatten

    prob = _ffn_problem(CASES[0][1])
    kw = dict(output_samples=prob.samples, lanczos=EXACT, pairs=("W1W1", "W2W2"))
    monkeypatch.setattr(debiasing, "SPREAD_LIMIT", math.inf)
    free = prob.call(**kw)
    s1, s2 = float(free["sharpness_spread/W1W1"]), float(free["sharpness_spread/W2W2"])
    assert s1 != s2, (s1, s2)
    low, high = ("W1W1", "W2W2") if s1 < s2 else ("W2W2", "W1W1")
    monkeypatch.setattr(debiasing, "SPREAD_LIMIT", (s1 + s2) / 2)  # between the two: one resolved, one not
    out = prob.call(**kw)
    assert f"sharpness/{high}" not in out and f"sharpness_spread/{high}" in out
    assert torch.equal(out[f"sharpness/{low}"], free[f"sharpness/{low}"])
    assert set(out) <= set(free)
    for key in free:  # every key without a value is a debiased one above the limit
        assert key in out or key.split("/")[0] in ("ggn", "sharpness", "precond_ggn", "precond_sharpness"), key
    with inputs_checked():
        marked = prob.call(**kw)
    assert torch.isnan(marked[f"sharpness/{high}"]) and not torch.isnan(marked[f"sharpness/{low}"])
    flat = flatten({"ffn": marked})
    assert ("ffn", f"sharpness/{high}") not in flat and ("ffn", "skipped_nonfinite") not in flat
    assert flat[("ffn", f"sharpness_spread/{high}")] == pytest.approx(max(s1, s2))


def test_dominant_negative_functional_part():
    """Tiny samples and the sign of G chosen so that H_f's largest |eigenvalue| is negative: sharpness is the
    largest algebraic eigenvalue, well below the largest |eigenvalue|, by EXACT and by a converging Lanczos."""
    case = dict(B=2, L=4, d=3, d_K=2, d_V=2, causal=False, pad=False, pre=("W_Q",))
    prob = _self_attention_problem(case)
    block = next(b for b in prob.blocks if b.key == "QQ")
    ev = torch.linalg.eigvalsh(_reference(prob, block)["H_f"])
    sign = -1.0 if ev[-1] > -ev[0] else 1.0  # H_f is linear in G
    G = sign * (prob.G if case["B"] else prob.G[0])
    prob.G = sign * prob.G
    prob.S = 1e-3 * prob.S
    samples = 1e-3 * prob.samples
    ref = _reference(prob, block)
    M = ref["ggn_dense"] + ref["H_f"]
    ev = torch.linalg.eigvalsh(M)
    assert ev[-1] < 0.9 * -ev[0], "the case must have a dominant negative eigenvalue"
    kw = dict(grad_output=G, output_samples=samples, precondition=prob.precondition, pairs=("QQ",))
    exact = prob.call(lanczos=EXACT, **kw)
    tight = prob.call(lanczos=Lanczos(tol=1e-10), **kw)
    for name in ("ggn", "sharpness", "precond_ggn", "precond_sharpness"):
        assert_close_report(exact[f"{name}/QQ"], ref[name], RTOL, name=name)
        assert_close_report(tight[f"{name}/QQ"], ref[name], CONVERGED, name=name)
    assert float(exact["sharpness/QQ"]) < 0.9 * float(-ev[0])


def test_negative_definite_functional_part_gives_negative_sharpness():
    """FFN with ``G`` built so that every ``act''(z) (G W_2^T)`` is negative: ``H_f(W1W1) = sum_n y_n y_n^T x
    diag(c_n)`` is negative definite, and with tiny samples the sharpness (and its preconditioned variant) is
    negative."""
    gen = torch.Generator().manual_seed(3)
    B, L, d, f, m = 2, 3, 3, 3, 4
    Y, W_1, W_2 = rand(gen, B, L, d), rand(gen, d, f), rand(gen, f, m)
    _, _, a2 = activation_derivatives(Y @ W_1, "gelu")  # (B, L, f)
    t = -torch.sign(a2) * (0.5 + torch.rand(B, L, f, generator=gen, dtype=DT))  # the wanted G W_2^T
    G = t @ torch.linalg.solve(W_2 @ W_2.T, W_2)  # G W_2^T = t
    samples = 1e-4 * rand(gen, K, B, L, m)
    P = _positive(gen, d, f)
    prob = Problem(None, samples, {"W_1": P}, [], G, samples, torch.ones(B, L, dtype=torch.bool), {"W1W1": slice(None)})
    block = Block("W1W1", "W_1", W_1, lambda W: ffn_forward(Y, W, W_2, "gelu", False))
    ref = _reference(prob, block)
    assert float(torch.linalg.eigvalsh(ref["H_f"])[-1]) < 0
    out = ffn(Y, FFNWeights(W_1, W_2), activation="gelu", residual=False,
              loss=OutputLoss(grad_output=G, output_samples=samples), precondition={"W_1": P}, pairs=("W1W1",),
              lanczos=EXACT)  # fmt: skip
    for name in ("sharpness", "precond_sharpness"):
        assert float(ref[name]) < 0
        assert_close_report(out[f"{name}/W1W1"], ref[name], RTOL, name=name)
    assert float(out["functional/W1W1"]) > 0  # the norm, not the signed eigenvalue


# ---- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["ffn", "gated_ffn", "self_attention", "mha"])
def test_bad_samples_and_preconditioners_say_how_to_fix(kernel):
    case = next(c for k, c in CASES if k == kernel)
    prob = PROBLEMS[kernel](case)
    S = prob.samples
    with pytest.raises(ValueError, match=r"Invalid output_samples shape .* Expected \(k, B, L, m\)"):
        prob.call(output_samples=S[..., :-1])
    with pytest.raises(ValueError, match=r"Invalid output_samples shape"):
        prob.call(output_samples=S[0])  # no sample dimension
    with pytest.raises(ValueError, match=r"Invalid output_samples shape .* k >= 1"):
        prob.call(output_samples=S[:0])
    with pytest.raises(ValueError, match=r"precondition= needs output_samples="):
        prob.call(precondition=prob.precondition)
    name, P = next(iter(prob.precondition.items()))
    with pytest.raises(ValueError, match=rf"Invalid precondition\['{name}'\] shape \({P.shape[0]}, {P.shape[1] - 1}\)"):
        prob.call(output_samples=S, precondition={name: P[:, :-1]})
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=rf"precondition\['{name}'\]: every entry must be finite and > 0"):
            prob.call(output_samples=S, precondition={name: P.index_fill(0, torch.tensor([0]), bad)})
    with pytest.raises(ValueError, match=r"Invalid precondition names \['W_X'\]"):
        prob.call(output_samples=S, precondition={"W_X": P})
    with pytest.raises(ValueError, match=r"Invalid precondition=list"):
        prob.call(output_samples=S, precondition=[P])


@pytest.mark.parametrize("kernel", ["ffn", "gated_ffn", "self_attention", "mha"])
def test_target_mode_refuses_samples(kernel):
    case = next(c for k, c in CASES if k == kernel)
    prob = PROBLEMS[kernel](case)
    G = prob.G if case["B"] else prob.G[0]
    with pytest.raises(ValueError, match=r"output_samples= applies to grad_output= mode only"):
        prob.call(grad_output=None, output_curvature=None, target=G, output_samples=prob.samples)
    with pytest.raises(ValueError, match=r"needs output_samples= \(grad_output mode only\)"):
        prob.call(grad_output=None, output_curvature=None, target=G, precondition=prob.precondition)


def test_unbatched_input_wants_unbatched_samples():
    prob = _ffn_problem(CASES[1][1])  # Y (L, d)
    with pytest.raises(ValueError, match=r"Expected \(k, L, m\) = \(k, 4, 2\)"):
        prob.call(output_samples=prob.samples.unsqueeze(1))


# ---- a moderate size -------------------------------------------------------------------------------------------


def test_smoke_moderate_ffn():
    """B = 4, L = 64, d = 128, f = 512, k = 8 with the default Lanczos: every sampled norm converges (residual <= tol;
    a LanczosWarning would raise) and costs about as much as the norms without samples."""
    gen = torch.Generator().manual_seed(0)
    B, L, d, f, k = 4, 64, 128, 512, 8
    Y = rand(gen, B, L, d)
    W_1, W_2 = rand(gen, d, f, scale=d**-0.5), rand(gen, f, d, scale=f**-0.5)
    G, S = rand(gen, B, L, d, scale=1 / (B * L)), rand(gen, k, B, L, d, scale=1 / (B * L))
    pre = {"W_1": _positive(gen, d, f), "W_2": _positive(gen, f, d)}
    kw = dict(activation="gelu", pairs=("W1W1", "W2W2"))
    t0 = time.perf_counter()
    ffn(Y, FFNWeights(W_1, W_2), loss=OutputLoss(grad_output=G), **kw)
    t1 = time.perf_counter()
    out = ffn(Y, FFNWeights(W_1, W_2), loss=OutputLoss(grad_output=G, output_samples=S), precondition=pre, **kw)
    t2 = time.perf_counter()
    names = ("ggn", "sharpness", "precond_ggn", "precond_sharpness")
    sampled = {k: float(v) for k, v in out.items() if k.removeprefix("residual/").split("/")[0] in names}
    residuals = {k: v for k, v in sampled.items() if k.startswith("residual/")}
    assert len(residuals) == 8  # (ggn, sharpness) x (plain, preconditioned) x (W1W1, W2W2)
    assert all(r <= Lanczos().tol for r in residuals.values()), residuals
    assert all(math.isfinite(v) for v in sampled.values())
    print(f"ffn B={B} L={L} d={d} f={f} k={k} float64: {t1 - t0:.2f} s without samples, {t2 - t1:.2f} s with")


def test_gram_path_holds_its_columns_once():
    """The Gram path's memory is its columns ``A`` (``k B`` x the block's weights) and a chunk of them: the columns
    are written in place and the preconditioned Gram matrix is built a chunk of rows at a time (no second ``A`` from
    concatenated chunks, no scaled copy ``A D``). Peak of live CPU memory from the columns' start to
    the Gram eigenvalues' end over what was live at the start, from torch's profiler's allocation events, against
    ``A``'s bytes (FFN ``W_1``: d 64 x 256, 64 columns, chunks of 16: about 1.94 ``A``, of which about 0.9 the
    products' temporaries while the columns are made)."""

    g = torch.Generator().manual_seed(0)
    B, L, d, k = 4, 8, 64, 16
    X, G, S = (torch.randn(*s, generator=g) for s in ((B, L, d), (B, L, d), (k, B, L, d)))
    W1, W2 = torch.randn(d, 4 * d, generator=g) * d**-0.5, torch.randn(4 * d, d, generator=g) * 0.1
    P = {"W_1": torch.rand(d, 4 * d, generator=g) + 0.1, "W_2": torch.rand(4 * d, d, generator=g) + 0.1}

    def labelled(fn, label):
        def call(*args, **kwargs):
            with torch.profiler.record_function(label):
                return fn(*args, **kwargs)

        return call

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sampled_keys, "gram_columns", labelled(sampled_keys.gram_columns, "columns"))
            mp.setattr(sampled_keys, "gram_matrices", labelled(sampled_keys.gram_matrices, "gram"))
            loss = OutputLoss(grad_output=G * 1e-2, output_samples=S * 1e-2)
            ffn(X, FFNWeights(W1, W2), activation="gelu", loss=loss, lanczos=Lanczos(), precondition=P)
    events = prof.profiler.kineto_results.events()
    starts = sorted(e.start_ns() for e in events if e.name() == "columns")
    ends = sorted(e.start_ns() + e.duration_ns() for e in events if e.name() == "gram")
    spans = list(zip(starts, ends, strict=True))
    assert len(spans) == 2  # W1W1 (the GGN keys) and W2W2 (all keys): both by the Gram at 64 columns
    timeline = live_memory(events)
    a_bytes = k * B * d * 4 * d * 4  # float32 columns of W_1 (W_2 has as many weights)
    for t0, t1 in spans:
        start = next((b for t, b in reversed(timeline) if t < t0), 0)  # live when the call starts
        peak = max(b for t, b in timeline if t0 <= t <= t1) - start
        assert a_bytes <= peak <= 2.05 * a_bytes, peak / a_bytes


@pytest.mark.parametrize("kernel, case", [CASES[8], CASES[9]], ids=_ids)
def test_grouped_query_keys_take_the_gram_path(kernel, case, monkeypatch):
    """Grouped-query attention: the Gauss-Newton keys of the per-kv-group ``KK`` and ``VV`` (and ``VV``'s sharpness,
    ``F`` linear in ``V``) through the group view and of the per-query-head ``QQ`` through the query view (a ``Q``-only
    product is the base operator's, unmixed) come from the samples' Gram matrix (exact: residual 0; the values against
    the dense reference in ``test_sampled_keys_match_dense_reference_and_leave_the_other_keys_bitwise``); the
    sharpness of ``QQ`` and ``KK`` (own terms) keeps its Lanczos members."""
    calls = []
    inner = sampled_keys.gram_columns

    def counted(op, X, *args, **kwargs):
        calls.append(X)
        return inner(op, X, *args, **kwargs)

    monkeypatch.setattr(sampled_keys, "gram_columns", counted)
    prob = PROBLEMS[kernel](case)
    out = prob.call(lanczos=Lanczos(tol=1e-10), output_samples=prob.samples, precondition=prob.precondition)
    assert sorted(calls) == ["K", "Q", "V"], calls
    exact = [k for k in out if k.startswith("residual/") and ("ggn/" in k or "sharpness/VV" in k)]
    assert exact and all(float(out[k]) == 0 for k in exact), exact
    assert any(k.startswith("residual/sharpness/QQ") and float(out[k]) > 0 for k in out)


def _assert_reference_keys(prob: Problem, out: dict, tol: float) -> None:
    """Every sampled key of every block of ``prob`` in ``out`` is within ``tol`` of the dense reference's."""
    for block in prob.blocks:
        ref = _reference(prob, block)
        for name in ("ggn", "sharpness", "precond_ggn", "precond_sharpness"):
            if name in ref:
                assert_close_report(out[f"{name}/{block.key}"], ref[name], tol, name=f"{name}/{block.key}")


@pytest.mark.parametrize("kernel, case", [CASES[i] for i in (0, 2, 4, 7, 8, 9)], ids=_ids)
def test_sharpness_members_take_their_gauss_newton_part_from_the_gram_columns(kernel, case, monkeypatch):
    """Where a pair's Gram columns are made and the block has its own functional term (``QQ``, ``KK``, ``W1W1``), the
    sharpness members' products are the operator's functional part plus ``A W A^T`` from the columns: the columns do
    serve them, and the keys are the dense reference's (float64, tight Lanczos, warm starts off; preconditioned
    members included)."""
    served = []
    inner = sampled_keys.members_matvec

    def spy(*args, **kwargs):
        served.append(any(A is not None for _, _, A in args[1]))  # blocks: [(X, D, columns)]
        return inner(*args, **kwargs)

    monkeypatch.setattr(sampled_keys, "members_matvec", spy)
    prob = PROBLEMS[kernel](case)
    lanczos = Lanczos(tol=1e-11, max_iter=400, warm_start=None)
    out = prob.call(lanczos=lanczos, output_samples=prob.samples, precondition=prob.precondition)
    assert any(served), served
    _assert_reference_keys(prob, out, CONVERGED)


@pytest.mark.parametrize("kernel, case", [CASES[i] for i in (0, 2, 4, 8)], ids=_ids)
def test_sharpness_members_start_at_their_estimates_top_gauss_newton_direction(kernel, case, monkeypatch):
    """Where the Gram columns ``A`` of a pair with its own functional term are made, each sharpness member starts at
    the top eigenvector of its estimate's sampled Gauss-Newton block (the full sample's or a half's columns ``A_S``;
    the preconditioned members ``D A_S``): checked against a dense eigendecomposition of ``A_S A_S^T`` (float64,
    relative residual 1e-8, the plain members); and the keys are the dense reference's (tight Lanczos,
    ``CONVERGED``)."""
    columns, starts = [], []  # the columns each run's product holds (members_matvec's), each run's start: in order
    inner_columns, inner_norms = sampled_keys.members_matvec, sampled_keys.norm_run

    def spy_columns(*args, **kwargs):
        columns.append([A for _, _, A in args[1]])  # per stacked block (blocks: [(X, D, columns)])
        return inner_columns(*args, **kwargs)

    def spy_norms(*args, **kwargs):
        starts.append(kwargs.get("v0"))
        return inner_norms(*args, **kwargs)

    monkeypatch.setattr(sampled_keys, "members_matvec", spy_columns)
    monkeypatch.setattr(sampled_keys, "norm_run", spy_norms)
    prob = PROBLEMS[kernel](case)
    lanczos = Lanczos(tol=1e-11, max_iter=400, warm_start=WarmStart())
    prob.call(lanczos=lanczos, output_samples=prob.samples, precondition=prob.precondition)  # warm starts kept
    columns.clear(), starts.clear()
    gram = prob.call(lanczos=lanczos, output_samples=prob.samples, precondition=prob.precondition)
    pairs = list(zip(columns, starts, strict=True))  # one product per run, made in the same order
    given = []  # (a block's columns, its members' starts): a run's start holds its stacked blocks' rows in order
    for As, v0 in pairs:
        if v0 is not None:
            r = v0.shape[0] // len(As)
            given += [(A, v0[g * r : (g + 1) * r]) for g, A in enumerate(As)]
    assert given, "no sharpness members started at the Gauss-Newton direction"
    k = prob.samples.shape[0]
    for A, v0 in given:  # A (H, k B, size), v0 (P E, H, size): the plain members first, full sample then halves
        H, n, _ = A.shape
        B = n // k
        half = (k // 2) * B  # the first half: the first k // 2 samples (SampledCurvature.counts)
        for e, cols in enumerate([slice(None), slice(None, half), slice(half, None)][: 3 if k >= 2 else 1]):
            As = A[:, cols].double()  # (H, |S|, size)
            v = v0[e].double()  # (H, size)
            top = torch.linalg.eigvalsh(As @ As.mT)[:, -1]  # (H,)
            Mv = torch.einsum("hcs,hc->hs", As, torch.einsum("hcs,hs->hc", As, v))
            resid = (Mv - top[:, None] * v).norm(dim=-1) / (top * v.norm(dim=-1)).clamp_min(1e-300)
            assert float(resid.max()) < 1e-8, (e, resid)
    _assert_reference_keys(prob, gram, CONVERGED)
