"""Operators and host syncs of one warm evaluation (issue 23): deterministic counts, held under ceilings.

On a GPU an evaluation of many small tensors waits on what the host dispatches and on every read of a device value;
both counts are the same on any device, so the CPU run here guards them (benchmarks/bench_dispatch.py measures them at
GPT-2-small width, docs/performance.md section 5). The ceilings sit ~15% above the counts measured when they were set,
so a change that adds dispatches per Lanczos step or a read per block fails here.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.bench_dispatch import OpCounter, count_host_reads
from curvwatch.adapters import find_blocks
from curvwatch.capture import Capture
from curvwatch.closed_form.attention import AttentionOperator
from curvwatch.engine import Engine
from curvwatch.models.gpt import GPT, GPTConfig
from curvwatch.rules import RuleSet

N_LAYER = 2


def _evaluations(n_layer: int = N_LAYER, tiers=("full", "terms"), signal_pairs=()):
    """A warm full and a warm terms-only (signals) evaluation of a GPT: ``{tier: OpCounter}``."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=n_layer, n_head=4, d_model=32))
    idx = torch.randint(0, 32, (2, 17))
    engine = Engine()
    specs = find_blocks(model)

    def captured():
        with Capture(specs, engine.token_limit) as capture:
            logits = model(idx[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 32), idx[:, 1:].reshape(-1)).backward()
        model.zero_grad()
        return capture.blocks()

    counts = {}
    for tier, kwargs in (("full", {}), ("terms", {"terms_only": True, "signal_pairs": signal_pairs})):
        if tier not in tiers:
            continue
        engine.evaluate(captured(), **kwargs)  # warm starts in place, as at every evaluation after the first
        blocks = captured()
        counter = OpCounter()
        with counter, count_host_reads(counter):
            evaluation = engine.evaluate(blocks, **kwargs)
        assert evaluation.results and not evaluation.failed
        counts[tier] = counter
    return counts


def test_evaluation_operators_and_host_syncs_stay_under_their_ceilings():
    counts = _evaluations()
    full, terms = counts["full"], counts["terms"]
    per_layer = {tier: (c.total / N_LAYER, c.syncs / N_LAYER) for tier, c in counts.items()}
    # host syncs: the one NaN/Inf read of all blocks, then one read per round of Lanczos stopping tests (every
    # CHECK_EVERY steps, all runs of the blocks evaluated together in lockstep)
    assert terms.syncs <= 1, terms.syncs
    assert full.syncs / N_LAYER <= FULL_SYNCS_PER_LAYER, per_layer
    assert full.total / N_LAYER <= FULL_OPS_PER_LAYER, per_layer
    assert terms.total / N_LAYER <= TERMS_OPS_PER_LAYER, per_layer


def test_terms_only_evaluation_of_a_deep_model_meets_in_gathered_calls(monkeypatch):
    """GPT-2-small's depth (12 layers), the monitor's signals (the rules' exact pairs, ``outer/VV`` by Lanczos as at
    d > 256): the blocks' exact pieces are gathered calls for all layers at once (one Lanczos run for every layer's
    ``VV``, one attention forward, one softmax norm, one Gram call, one LayerNorm statistics call), so the operators
    per layer are a fixed share plus a few per block, and the host reads a handful of values in all."""
    monkeypatch.setattr(AttentionOperator, "vv_exact", staticmethod(lambda d, max_iter: False))
    terms = _evaluations(DEEP, tiers=("terms",), signal_pairs=RuleSet().exact_pairs)["terms"]
    assert terms.syncs <= DEEP_TERMS_SYNCS, terms.syncs
    assert terms.total / DEEP <= DEEP_TERMS_OPS_PER_LAYER, terms.total / DEEP


# Measured when set (issue 23, this 2-layer d 32 GPT): full 5,562 operators and 9.5 syncs per layer, terms-only 352.5
# and 0.5 (first ceilings: full 8,199 and 15; before issue 23 at GPT-2-small width: full 15,988 and 287, terms-only 386
# and 6; docs/performance.md section 5). The full evaluation's syncs: one NaN/Inf read, then one read per round of
# stopping tests of the layer's blocks evaluated together (Engine._windows). Session 18 (the attention's row layouts in
# one view each, the Lanczos step's transposed basis once): full 4,876.5 -> 4,418.5 per layer (ceiling was 6,400); the
# FFN products' shared operands expanded into one bmm (_common.shared_times): 4,112.5; a row mask's view made once per
# rank (_operator.RowMask): 4,049.5. Session 21 (the attention's QQ and KK sampled members in one run, its shared
# matmul operands' views made once per operator): 4,041.5 -> 3,905.5 (ceiling lowered to about 15% above); every
# Lanczos member's Ritz vector taken when it stops and thick restarts in slices (for merged runs): 3,962.
FULL_SYNCS_PER_LAYER = 11
FULL_OPS_PER_LAYER = 4_500
TERMS_OPS_PER_LAYER = 410
# The deep terms-only evaluation (12 layers, d 32): measured 85 operators per layer and 2 host reads in all when set
# (session 13: the NaN/Inf read and the VV run's stopping test, warm); the issue's goal is 150 and 2 per layer.
DEEP = 12
DEEP_TERMS_SYNCS = 3
DEEP_TERMS_OPS_PER_LAYER = 100


@pytest.mark.parametrize("gram_steps", [None, 0])
def test_sampled_sharpness_keys_stay_under_their_ceilings(gram_steps, monkeypatch):
    """The real-loss keys of one attention, one FFN and one grouped-query attention kernel call (16 samples, Adam-
    preconditioned: three estimates x two preconditionings per key): their operators and host reads on top of the call
    without samples. The Lanczos members of a run share operator products of up to ``MEMBER_ROWS`` rows; with 2
    sequences (``k B`` = 32 Gram columns) the Gauss-Newton keys come from the samples' Gram matrix at the default
    ``GRAM_STEPS``, and the Lanczos members are solved to ``MEMBER_TOL`` times the tolerance (measured when set,
    ``GRAM_STEPS`` 12 and ``MEMBER_TOL`` 0.2: attention 5,818 operators and 13 reads, FFN 3,285 and 11; ``MEMBER_TOL``
    1: 4,838 / 11 and 2,866 / 10; ``GRAM_STEPS`` 4 as well, where the ``QQ``, ``KK`` and ``W1W1`` GGN keys were Lanczos
    members: 6,748 / 11 and 3,644 / 10). Grouped-query attention (4 query heads, 2 kv heads): 5,734 / 13, its ``QQ``,
    ``KK`` and ``VV`` GGN keys by the Gram through the query and group views (6,597 / 13 with ``KK`` and ``VV`` only;
    9,560 / 17 when all were Lanczos members). The chunked Gram matrix added ~150 operators to the first two (5,962 / 13
    and 3,381 / 11 now). ``gram_steps=0``: every key by Lanczos members, 12 rows per run (9,024 / 16, 5,814 / 16, 9,560
    / 17; at ``MEMBER_TOL`` 1 8,176 / 14 and 5,027 / 14; with one product per member as well, ``STACK_MEMBERS = False``:
    17,479 and 8,638). Since then (per-head keys by one unbind, the debiasing once for all variants of a key, the
    preconditioned rows scaled in place): 5,614 / 13, 3,121 / 11, 5,426 / 13; with gram_steps=0 8,540 / 16, 5,350 / 16,
    9,104 / 17. Session 16, the sharpness members' Gauss-Newton part from the Gram columns (``GRAM_SHARPNESS``; the
    Gram's eigenvalues by ``bmm``): 5,530 / 13, 3,065 / 11, 5,342 / 13 without it, 5,070 / 13, 2,609 / 11, 4,826 / 13
    with it (ceilings lowered to about 15% above). Session 17, the sharpness members started at their top Gauss-Newton
    direction (``GRAM_START``): 4,810 / 12, 2,424 / 10, 4,940 / 13 (ceilings kept). Session 18, the attention's row
    layouts in one view each (``attention._as``): 4,260 / 12, 2,392 / 10, 4,390 / 13; with gram_steps=0 7,430 / 16,
    5,314 / 16, 7,994 / 17; the FFN's shared operands expanded into one ``bmm`` (``_common.shared_times``): FFN 1,996 /
    10, with gram_steps=0 4,346 / 16 (ceilings lowered to about 15% above). Session 19, the runs of a call's pairs in
    one solve (``SOLVE_PAIRS``: the attention's ``QQ`` and ``KK`` runs' stopping tests share reads): 4,250 / 7, 1,996 /
    10, 4,390 / 13 (12 / 10 / 13 reads with one solve per pair); with gram_steps=0 7,195 / 7, 4,243 / 11, 7,776 / 13
    (16 / 16 / 17); the grouped-query kernel's query and group views in one solve as well: 4,371 / 7, with
    gram_steps=0 7,753 / 7; the attention's own runs and its sampled runs in one solve (``solve_planned``): attention
    4,350 / 2, GQA 4,472 / 2, with gram_steps=0 7,445 / 2 and 8,004 / 2 (read ceilings lowered). Session 20, the
    FFN's own runs and its sampled runs in one solve: FFN 1,973 / 2, with gram_steps=0 4,213 / 2 (read ceilings
    lowered). Session 21, the attention's ``QQ`` and ``KK`` members as rows of one run (``STACK_PAIRS``) and its shared
    matmul operands' views made once per operator (``AttentionOperator._bh``): attention 4,350 -> 4,055 / 2, GQA 4,472
    -> 4,273 / 2, with gram_steps=0 7,445 -> 6,405 / 2 and 8,004 -> 7,264 / 2, FFN unchanged (side by side with a
    worktree of the session's start; ceilings lowered to about 15% above). Then the Gram matrices' eigenvalues of a
    call in batches (``_gram_eigen``: 18 / 12 / 18 ``eigh`` calls -> 4 / 2 / 2): 3,955 / 2, FFN 1,910 / 2, GQA 4,144 /
    2; the keys of every pair and variant debiased at once (``sampled_plan``'s finish): 3,760 / 2, FFN 1,812 / 2, GQA
    3,953 / 2; with gram_steps=0 6,210 / 2, 4,115 / 2, 7,073 / 2. Then a kernel's own run and its sampled run as one
    Lanczos run (``_operator.MERGE_RUNS``; every member's Ritz vector taken when it stops, thick restarts in four slices
    of the members): 3,531 / 2, FFN 1,347 / 2, GQA 3,569 / 2; with gram_steps=0 5,964 / 2, 3,328 / 2, 6,673 / 2.
    Session 22, the grouped-query kernel's query-view, group-view and grouped ``VV`` runs as one run
    (``_lanczos.merge_runs``): GQA 3,373 / 2, with gram_steps=0 6,477 / 2 (the call without samples 18,137 -> 17,682);
    every ceiling lowered to about 15% above. Session 25, the debiased keys' standard errors (``_member_shares``: one
    more product of the members' Ritz vectors per pair, read against the samples): attention 3,533 -> 3,747 / 2, FFN
    1,349 -> 1,452 / 2, GQA 3,373 -> 3,586 / 2; with gram_steps=0 5,966 -> 6,368, 3,331 -> 3,513, 6,477 -> 6,910 (side
    by side with a worktree of 231d759; ceilings kept: 6-9% above now)."""
    from curvwatch.closed_form import _sampled

    if gram_steps is not None:
        monkeypatch.setattr(_sampled, "GRAM_STEPS", gram_steps)
    from curvwatch.closed_form import Lanczos, ffn, multi_head_attention

    g = torch.Generator().manual_seed(0)
    B, L, d, H, k = 2, 16, 32, 4, 16

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    X, G, S = r(B, L, d), r(B, L, d, scale=1e-2), r(k, B, L, d, scale=1e-2)
    W = [r(d, d, scale=d**-0.5) for _ in range(4)]
    W1, W2 = r(d, 4 * d, scale=d**-0.5), r(4 * d, d, scale=0.1)
    P_attn = {nm: r(d, d).abs() + 0.1 for nm in ("W_Q", "W_K", "W_V")}
    P_ffn = {"W_1": r(d, 4 * d).abs() + 0.1, "W_2": r(4 * d, d).abs() + 0.1}
    Wkv = [r(d, d // 2, scale=d**-0.5) for _ in range(2)]  # 2 kv heads of d / H for 4 query heads
    P_gqa = {"W_Q": r(d, d).abs() + 0.1, "W_K": r(d, d // 2).abs() + 0.1, "W_V": r(d, d // 2).abs() + 0.1}

    def count(call) -> tuple[int, int]:
        lanczos = Lanczos()
        call(lanczos)  # warm starts, as at every evaluation after the first
        counter = OpCounter()
        with counter, count_host_reads(counter):
            call(lanczos)
        eighs.append(counter.ops["aten._linalg_eigh.default"])
        return counter.total, counter.syncs

    eighs = []  # the eigen-decompositions of each count

    kernels = {
        "attention": (lambda lz, **kw: multi_head_attention(X, *W, H, grad_output=G, causal=True, lanczos=lz, **kw),
                      P_attn, *((4_100, 4) if gram_steps is None else (6_900, 4))),
        "ffn": (lambda lz, **kw: ffn(X, W1, W2, activation="gelu", grad_output=G, lanczos=lz, **kw), P_ffn,
                *((1_550, 4) if gram_steps is None else (3_850, 4))),
        "gqa": (lambda lz, **kw: multi_head_attention(X, W[0], Wkv[0], Wkv[1], W[3], H, n_kv_heads=2, grad_output=G,
                                                      causal=True, lanczos=lz, **kw),
                P_gqa, *((3_900, 4) if gram_steps is None else (7_500, 4))),
    }  # fmt: skip
    # the calls without samples (the engine's own runs), measured in session 22: attention 12,511, FFN 4,656, GQA
    # 17,682 (18,137 before its query-view, group-view and grouped VV runs were one run); ceilings about 15% above
    own = {"attention": 14_400, "ffn": 5_350, "gqa": 20_300}
    for name, (call, precondition, max_ops, max_reads) in kernels.items():
        ops0, reads0 = count(call)
        assert ops0 <= own[name], (name, ops0)
        ops, reads = count(lambda lz, call=call, p=precondition: call(lz, output_samples=S, precondition=p))
        assert ops - ops0 <= max_ops, (name, ops - ops0)
        assert reads - reads0 <= max_reads, (name, reads - reads0)
        # the Gram matrices of every pair, preconditioning and estimate in batches of two eigh calls (the full
        # samples', the halves'): each costs milliseconds on a GPU whatever its batch (_sampled._gram_eigen; 18 and 12
        # calls before). Here the attention's go in two batches (its matrices outgrow its largest pair's Gram
        # columns, 32 columns of 256 numbers a head); at GPT-2-small width in one.
        assert eighs[-1] - eighs[-2] <= (4 if gram_steps is None else 0), (name, eighs[-2:])


def test_read_labels_name_the_runs_each_stopping_test_read_served():
    """``bench_dispatch --reads`` (:class:`~benchmarks.bench_dispatch.ReadLabels`): two runs solved together share their
    reads (each read names both), a third solved after them has reads of its own, a run merged from two is named by
    theirs; the steps counted are the runs' products, and nothing is recorded while inactive (outside the counted
    step)."""
    from benchmarks.bench_dispatch import ReadLabels
    from curvwatch.closed_form import _lanczos

    M = torch.diag(torch.linspace(1.0, 2.0, 40, dtype=torch.float64))

    def run(width: int) -> _lanczos.LanczosRun:
        def mv(v: torch.Tensor) -> torch.Tensor:
            return v @ M

        return _lanczos.LanczosRun(mv, (width,), 40, dtype=M.dtype, device=M.device, tol=1e-8, max_iter=12)

    labels = ReadLabels()
    with labels.patched():
        _lanczos.solve([run(1)])  # inactive: not recorded
        labels.active = True
        pair = [run(1), run(2)]
        _lanczos.solve(pair)
        shared = len(labels.reads)
        _lanczos.solve([run(3)])
        merged = _lanczos.merge_runs([run(1), run(2)])
        _lanczos.solve([merged])  # labelled as what it was merged from, those runs never step themselves
        labels.active = False
    assert _lanczos.LanczosRun.step.__name__ == "step" and _lanczos.to_host.__name__ == "to_host"  # restored
    one, two, three = (f"test_read_labels_name_the_runs_each_stopping_test_read_served.run.mv ({w},) n=40"
                       for w in (1, 2, 3))  # fmt: skip
    assert shared >= 2 and all(set(r) <= {one, two} and r for r in labels.reads[:shared])
    assert any(set(r) == {one, two} for r in labels.reads[:shared])  # one read for both
    name = "test_read_labels_name_the_runs_each_stopping_test_read_served.run.mv"
    both = f"merged[{name} (1,) + {name} (2,)] (3,) n=40"
    assert len(labels.reads) > shared and all(set(r) in ({three}, {both}) for r in labels.reads[shared:])
    assert labels.runs == {one: 1, two: 1, three: 1, both: 1}
    assert labels.steps[one] == labels.steps[two] == 12 == labels.steps[three]  # max_iter, tol out of reach
    summary = labels.summary()
    assert summary["reads"] == len(labels.reads) and summary["runs"][three] == {"made": 1, "steps": 12}


def test_the_gpu_benchmark_reads_issue_23s_goals_from_its_measured_costs():
    """``bench_dispatch --device cuda`` prints goals 1-3 met or not from its timings (:func:`goals`; no GPU needed to
    check the reading): the issue's own H200 figures meet none, its goals' limits meet all."""
    from benchmarks.bench_dispatch import goals

    def res(full, terms, first, plain_peak, full_peak):
        return {
            "full": {"steps": full, "first_steps": first},
            "terms": {"steps": terms},
            "extra_peak_fraction": {"full": full_peak / plain_peak - 1, "terms": 0.0},
        }

    before = goals(res(600.0, 18.0, 540.0, 9.6, 18.7))  # issue 23's table
    assert not any(before["met"].values()) and before["cadence_2000"]["full"] == [0]
    assert "goal 1: full evaluation 600.00 training steps (<= 10: NOT met)" in before["lines"][0]
    at_goals = goals(res(10.0, 0.25, 10.0, 9.6, 11.0))
    assert all(at_goals["met"].values()), at_goals["lines"]
    assert at_goals["cadence_2000"]["full"] == [0, 500, 1000, 1500] and "met" in at_goals["lines"][2]


def test_the_gpu_timing_path_runs_on_cpu(tmp_path):
    """``bench_dispatch``'s timing path (``--device cuda`` in ``gpu_scale.sh``) end to end on CPU (``--time``): the
    three runs, the costs in training steps and the goals printed, so that a GPU session does not find its bugs. One
    GPT-2-small-width layer at a toy batch; peak memory is CUDA's only (NaN here: goal 2 reads not met)."""
    from benchmarks import bench_dispatch

    out = tmp_path / "t.json"
    argv = ["--time", "--n-layer", "1", "--d-model", "64", "--seq", "16", "--batch", "1", "--vocab", "64", "--repeats",
            "1", "--full-repeats", "1", "--precision", "32-true", "--out", str(out)]  # fmt: skip
    res = bench_dispatch.main(argv)
    assert res["full"]["steps"] > 0 and res["plain_ms"] > 0 and math.isfinite(res["full"]["first_steps"])
    assert res["goals"]["met"]["2_memory"] is False and len(res["goals"]["lines"]) == 3
    assert res["goals"]["cadence_2000"]["full"][0] == 0
    assert json.loads(out.read_text())["goals"]["met"] == res["goals"]["met"]
