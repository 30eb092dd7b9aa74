"""Blocks evaluated together (issue 23): their Lanczos stopping tests share one host read, the numbers stay those of
the blocks evaluated one at a time, and a block that fails inside the shared solve is left out alone."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_dispatch import OpCounter, count_host_reads
from curvwatch import engine as engine_module
from curvwatch.closed_form import _lanczos
from curvwatch.closed_form._lockstep import Lockstep
from curvwatch.closed_form.ffn import FFNOperator
from curvwatch.engine import Engine
from tests.test_engine import _captured as captured_gpt

DT = torch.float64


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
    # the operators of the kernels' own threads are counted too (the caller's dispatch modes follow them)
    assert abs(c_together.total - c_alone.total) <= 0.02 * c_alone.total, (c_together.total, c_alone.total)


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


def test_lockstep_hands_each_evaluation_its_own_error_and_result():
    M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=DT))

    def norm(scale):
        return float(_lanczos.lanczos_max_abs(lambda v: v @ (M * scale), (), 3, dtype=DT, device=M.device)[0])

    def broken():
        return _lanczos.lanczos_max_abs(lambda v: 1 / 0, (), 3, dtype=DT, device=M.device)

    lock = Lockstep()
    (a, ea), (b, eb), (c, ec) = lock.run([lambda: norm(1.0), broken, lambda: norm(3.0)])
    assert (round(a, 9), round(c, 9)) == (5.0, 15.0) and ea is None and ec is None
    assert b is None and isinstance(eb, ZeroDivisionError)
    assert lock.rounds >= 1
