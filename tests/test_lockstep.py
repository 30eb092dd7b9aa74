"""Blocks evaluated together (issue 23): their Lanczos stopping tests share one host read, the numbers stay those of
the blocks evaluated one at a time, and a block that fails inside the shared solve is left out alone."""

from __future__ import annotations

import pytest
import torch

import curvwatch.engine.core as engine_module
from benchmarks.bench_dispatch import OpCounter, count_host_reads
from curvwatch.closed_form.attention import AttentionOperator
from curvwatch.closed_form.ffn import FFNOperator
from curvwatch.closed_form.settings import Lanczos
from curvwatch.closed_form.solver import lanczos as _lanczos
from curvwatch.closed_form.solver import lockstep as _lockstep
from curvwatch.closed_form.solver.choices import CPU, GPU, forced
from curvwatch.closed_form.solver.lockstep import Lockstep, gathered, made_together
from curvwatch.engine import Engine
from curvwatch.rules import RuleSet
from tests.test_engine import _captured as captured_gpt

DT = torch.float64


@pytest.fixture(autouse=True)
def _gpu_choices():
    """The lockstep is the GPU's choice (``Engine(lockstep=None)`` takes it off the host): these tests run with the
    GPU's solver choices (stopping test every 4 steps, stacked products), as a GPU evaluates."""
    with forced(GPU):
        yield


def _captured():
    return captured_gpt(n_layer=2)


def _evaluate(lockstep: bool, blocks, **kwargs):
    counter = OpCounter()
    with counter, count_host_reads(counter):
        out = Engine(lockstep=lockstep).evaluate(blocks, **kwargs)
    return out, counter


@pytest.mark.parametrize("terms_only", [False, True])
def test_blocks_evaluated_together_give_the_same_numbers_with_fewer_host_reads(terms_only):
    """Every number equal (tolerance 0: the same products, start vectors and stopping tests), in the same block order,
    and fewer host syncs: the stopping tests of all blocks in one read per round instead of one per block."""
    blocks = _captured()
    alone, c_alone = _evaluate(False, blocks, terms_only=terms_only)
    together, c_together = _evaluate(True, blocks, terms_only=terms_only)
    assert list(together.results) == list(alone.results) and not together.failed
    for name, res in alone.results.items():
        assert list(together.results[name]) == list(res)
        for key, value in res.items():
            assert torch.equal(torch.as_tensor(together.results[name][key]), torch.as_tensor(value)), (name, key)
    if not terms_only:  # (at d = 16 a terms-only evaluation has no Lanczos run: its VV norm is exact)
        assert c_together.syncs < c_alone.syncs, (c_together.syncs, c_alone.syncs)
    # the operators of the kernels' own threads are counted too (the caller's dispatch modes follow them). Terms-only:
    # one window, the exact pieces of the two attention blocks are one gathered call each (their gram norms, the
    # signals' softmax norms), so fewer operators; a full evaluation's windows hold one layer each
    if terms_only:
        assert 0.5 * c_alone.total < c_together.total < 0.95 * c_alone.total, (c_together.total, c_alone.total)
    else:
        assert abs(c_together.total - c_alone.total) <= 0.02 * c_alone.total, (c_together.total, c_alone.total)


def test_gathered_vv_lanczos_is_one_run_for_every_layer(monkeypatch):
    """The signals' ``outer/VV`` by Lanczos (d > 256 in the monitor; forced here at d = 8): one run for both layers'
    heads, so the host reads its stopping tests once for both; the norms those of the layers' own runs."""
    monkeypatch.setattr(AttentionOperator, "vv_exact", staticmethod(lambda d, max_iter: False))
    blocks = _captured()
    tight = Lanczos(tol=1e-10, max_iter=None, max_basis=None, warn=False)
    runs = []
    original = _lanczos.LanczosRun.__init__

    def count(self, *args, **kwargs):
        runs.append(tuple(args[1].shape[:-1]))  # the batch shape of its start vectors
        original(self, *args, **kwargs)

    monkeypatch.setattr(_lanczos.LanczosRun, "__init__", count)
    kwargs = {"terms_only": True, "signal_pairs": RuleSet().exact_pairs}
    counters = {}
    for lockstep in (False, True):
        counter = OpCounter()
        with counter, count_host_reads(counter):
            counters[lockstep] = (Engine(lockstep=lockstep, lanczos=tight).evaluate(blocks, **kwargs), counter)
    assert runs == [(1, 2), (1, 2), (2, 2)]  # one per layer alone, then one for both: (layers, heads)
    (alone, c_alone), (together, c_together) = counters[False], counters[True]
    assert c_together.syncs < c_alone.syncs and c_together.total < c_alone.total
    for layer in ("layer0/attn", "layer1/attn"):
        a, b = alone.results[layer], together.results[layer]
        assert "outer/VV/h0" in a and set(a) == set(b)
        for key in a:
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-6, abs=1e-12), (layer, key)


def _row_sums(x: torch.Tensor, *, scale: float) -> torch.Tensor:
    CALLS.append(tuple(x.shape))
    if bool((x < 0).any()):
        raise ValueError("negative input")
    return x.sum(-1) * scale


CALLS: list[tuple[int, ...]] = []


def test_gathered_calls_meet_in_stacked_calls_and_an_error_stays_with_its_evaluation(monkeypatch):
    """Requests with the same function, settings and input shapes meet in one stacked call (at most GATHER_BYTES of
    inputs at a time); a stacked call that raises is answered one request at a time, so only the evaluation whose
    own input raises gets the error; outside a Lockstep the function is called as it is."""
    a, b, c = torch.ones(2, 3), 2 * torch.ones(2, 3), torch.ones(4)
    bad = -torch.ones(2, 3)
    assert torch.equal(gathered(_row_sums, a, scale=2.0), a.sum(-1) * 2)
    CALLS.clear()
    fns = [lambda: gathered(_row_sums, a, scale=2.0), lambda: gathered(_row_sums, b, scale=2.0),
           lambda: gathered(_row_sums, a, scale=3.0), lambda: gathered(_row_sums, c, scale=2.0)]  # fmt: skip
    results = Lockstep().run(fns)
    assert CALLS == [(2, 2, 3), (2, 3), (4,)]  # a and b stacked; the other settings and shape alone, as they are
    expected = [a.sum(-1) * 2, b.sum(-1) * 2, a.sum(-1) * 3, c.sum(-1) * 2]
    assert all(torch.equal(r, e) and err is None for (r, err), e in zip(results, expected, strict=True))
    CALLS.clear()
    results = Lockstep().run([fns[0], lambda: gathered(_row_sums, bad, scale=2.0), fns[1]])
    assert CALLS == [(3, 2, 3), (2, 3), (2, 3), (2, 3)]  # stacked, raised, then one at a time
    assert torch.equal(results[0][0], expected[0]) and torch.equal(results[2][0], expected[1])
    assert results[1][0] is None and isinstance(results[1][1], ValueError)
    CALLS.clear()
    monkeypatch.setattr(_lockstep, "GATHER_BYTES", 2 * a.numel() * a.element_size())  # two requests per call
    results = Lockstep().run([fns[0], fns[1], fns[0]])
    assert CALLS == [(2, 2, 3), (2, 3)] and torch.equal(results[2][0], expected[0])


def test_a_block_failing_inside_the_shared_solve_is_left_out_alone(monkeypatch):
    """An error raised by one block's product while the runs of several blocks are solved together ends that block
    alone, as it would one at a time; the other blocks' numbers are unchanged."""
    blocks = _captured()
    reference = Engine(lockstep=False).evaluate(blocks)
    calls = {"n": 0}
    original = FFNOperator.apply_masked

    def fail_later(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:  # inside the joint solve, not at the first product
            raise FloatingPointError("induced")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FFNOperator, "apply_masked", fail_later)
    out = Engine().evaluate(blocks)
    assert set(out.failed) == {"layer0/ffn", "layer1/ffn"}
    assert all(isinstance(e, FloatingPointError) for e in out.failed.values())
    for name in ("layer0/attn", "layer1/attn", "layer0/ln_1"):
        assert {k: float(v) for k, v in out.results[name].items()} == {
            k: float(v) for k, v in reference.results[name].items()
        }


def test_windows_hold_at_most_the_memory_factor_and_sharded_blocks_go_alone(monkeypatch):
    blocks = _captured()
    engine = Engine()
    windows = engine._windows(blocks, torch.float32, terms_only=False)
    assert [b for w in windows for b in w] == list(blocks) and len(windows) < len(blocks)
    assert len(engine._windows(blocks, torch.float32, terms_only=True)) == 1
    monkeypatch.setattr(engine_module, "LOCKSTEP_BLOCKS", 3)  # at most that many threads at once
    assert [len(w) for w in engine._windows(blocks, torch.float32, terms_only=True)] == [3, 3, 2]
    assert all(len(w) == 1 for w in Engine(lockstep=False)._windows(blocks, torch.float32, False))
    tiny = Engine(memory_budget_mb=1e-6)  # no two blocks fit together
    assert all(len(w) == 1 for w in tiny._windows(blocks, torch.float32, False))


def test_the_engine_takes_the_lockstep_off_the_host_only():
    """``Engine()`` (``lockstep=None``): on the CPU one block at a time (its choices, solver.choices.CPU), with the
    GPU's choices consecutive blocks together; ``lockstep=True`` / ``False`` whatever the device."""
    blocks = _captured()
    with forced(CPU):
        assert all(len(w) == 1 for w in Engine()._windows(blocks, torch.float32, terms_only=False))
        assert len(Engine(lockstep=True)._windows(blocks, torch.float32, terms_only=False)) < len(blocks)
    assert len(Engine()._windows(blocks, torch.float32, terms_only=False)) < len(blocks)  # (forced GPU: the fixture)
    assert all(len(w) == 1 for w in Engine(lockstep=False)._windows(blocks, torch.float32, terms_only=False))


def test_lockstep_hands_each_evaluation_its_own_error_and_result():
    M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=DT))

    def norm(scale):
        return float(
            _lanczos.lanczos_max_abs(lambda v: v @ (M * scale), _lanczos.start_vectors((), 3, DT, M.device))[0]
        )

    def broken():
        return _lanczos.lanczos_max_abs(lambda v: 1 / 0, _lanczos.start_vectors((), 3, DT, M.device))

    lock = Lockstep()
    (a, ea), (b, eb), (c, ec) = lock.run([lambda: norm(1.0), broken, lambda: norm(3.0)])
    assert (round(a, 9), round(c, 9)) == (5.0, 15.0) and ea is None and ec is None
    assert b is None and isinstance(eb, ZeroDivisionError)
    assert lock.rounds >= 1


def test_lockstep_threads_are_kept_and_reused_between_runs():
    """A thread per evaluation would start (~0.3 ms here) at every evaluation: the carriers park between runs and the
    next run takes them, an evaluation that raised included; each evaluation still runs in its caller's context."""
    import contextvars
    import threading

    from curvwatch.closed_form.solver import lockstep as _lockstep

    tag = contextvars.ContextVar("tag", default="unset")
    M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=DT))

    def norm(scale):
        value = float(
            _lanczos.lanczos_max_abs(lambda v: v @ (M * scale), _lanczos.start_vectors((), 3, DT, M.device))[0]
        )
        return value, tag.get(), threading.current_thread().name

    def broken():
        raise ValueError("induced")

    def carriers():
        return sum(t.name == "curvwatch-lockstep" and t.is_alive() for t in threading.enumerate())

    lock = Lockstep()
    lock.run([lambda: norm(1.0), lambda: norm(2.0), broken])  # (warms the pool: three carriers)
    before, idle = carriers(), len(_lockstep._IDLE)
    assert idle >= 3
    for k in range(3):
        tag.set(f"run {k}")
        results = lock.run([lambda: norm(1.0), broken, lambda: norm(3.0)])
        seen = [(round(r[0][0], 9), r[0][1]) if r[0] else type(r[1]) for r in results]
        assert seen == [(5.0, f"run {k}"), ValueError, (15.0, f"run {k}")]
        assert results[0][0][2] == "curvwatch-lockstep"  # (on a carrier, not the caller's thread)
    assert carriers() == before and len(_lockstep._IDLE) == idle  # none started, none lost
    # a parked carrier keeps nothing of its last evaluation alive (its result here)
    import gc
    import time
    import weakref

    class Result:
        pass

    results = lock.run([lambda: Result(), lambda: Result()])
    refs = [weakref.ref(result) for result, _ in results]
    del results
    for _ in range(100):  # (the carrier lets go as it parks, just after handing the result over)
        gc.collect()
        if all(ref() is None for ref in refs):
            break
        time.sleep(0.01)
    assert [ref() for ref in refs] == [None, None]


def _shared_run(scales: torch.Tensor) -> _lanczos.LanczosRun:
    """One run for every request: member ``i`` is ``diag(3, -5, 1) * scales[i]``; a negative scale raises in the
    product."""
    M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=DT))

    def mv(v: torch.Tensor) -> torch.Tensor:
        if bool((scales < 0).any()):
            raise FloatingPointError("induced")
        return (v @ M) * scales[:, None]

    return _lanczos.LanczosRun(mv, _lanczos.start_vectors((len(scales),), 3, DT, M.device))


def test_a_shared_run_steps_once_per_round_and_an_error_reaches_only_its_own_evaluation():
    """A run that several evaluations hold (:func:`made_together`) advances once per round for all of them; when its
    product raises, each evaluation solves its own part again alone, so the error reaches only the evaluation whose
    own product raises it (as evaluated one at a time)."""

    def norm(scale: float) -> float:
        shared = made_together(_shared_run, torch.tensor(scale, dtype=DT))
        _lanczos.solve([shared.run])
        run, i = shared.solved()
        return float(run.norm[i])

    steps = []
    original = _lanczos.LanczosRun.step

    def count(self):
        steps.append(id(self))
        original(self)

    lock = Lockstep()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_lanczos.LanczosRun, "step", count)
        (a, ea), (b, eb) = lock.run([lambda: norm(1.0), lambda: norm(2.0)])
    assert (round(a, 9), round(b, 9), ea, eb) == (5.0, 10.0, None, None)
    assert len(set(steps)) == 1 and len(steps) == lock.rounds  # one run, one step per round
    (a, ea), (b, eb), (c, ec) = Lockstep().run([lambda: norm(1.0), lambda: norm(-1.0), lambda: norm(3.0)])
    assert round(a, 9) == 5.0 and round(c, 9) == 15.0 and ea is None and ec is None
    assert b is None and isinstance(eb, FloatingPointError)  # its own error, not the shared run's


def test_a_shared_run_solved_with_an_evaluations_own_runs_fails_alone():
    """A shared run (:func:`made_together`) solved in one ``solve`` with runs of the evaluation's own (their stopping
    tests share host reads): when its product raises, it ends alone; the other runs of every evaluation finish, each
    evaluation gets its part of the shared run solved again alone (:meth:`Shared.solved`), and the error reaches only
    the evaluation whose own request raises it."""
    M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=DT))

    def norms(scale: float) -> tuple[float, float]:
        shared = made_together(_shared_run, torch.tensor(scale, dtype=DT))
        own = _lanczos.LanczosRun(lambda v: v @ (M * 2), _lanczos.start_vectors((), 3, DT, M.device))
        _lanczos.solve([shared.run, own])
        assert own.error is None
        run, i = shared.solved()
        return round(float(run.norm[i]), 9), round(float(own.norm), 9)

    (a, ea), (b, eb) = Lockstep().run([lambda: norms(1.0), lambda: norms(2.0)])
    assert (a, b, ea, eb) == ((5.0, 10.0), (10.0, 10.0), None, None)
    (a, ea), (b, eb), (c, ec) = Lockstep().run([lambda: norms(1.0), lambda: norms(-1.0), lambda: norms(3.0)])
    assert a == (5.0, 10.0) and c == (15.0, 10.0) and ea is None and ec is None
    assert b is None and isinstance(eb, FloatingPointError)  # its own error, not the shared run's
