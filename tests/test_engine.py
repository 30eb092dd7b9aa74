"""The evaluation engine without a Trainer: named numbers from captured blocks, fault policy, memory policy."""

from __future__ import annotations

import math

import pytest
import torch

import curvwatch.engine.core as engine_core
from curvwatch.adapters import find_blocks
from curvwatch.capture import Capture
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import NONFINITE, BlockError, Engine, basis_bytes, evaluate_block
from curvwatch.models.gpt import GPT, GPTConfig
from curvwatch.realloss import sample_outputs


def _captured(seed=0, n_layer=1):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=n_layer, n_head=2, d_model=8, d_ff=16))
    with Capture(find_blocks(model), max_tokens=12) as capture:
        model(torch.randint(0, 11, (2, 6))).square().mean().backward()
    return capture.blocks()


def test_the_engine_defaults_to_the_monitors_lanczos_settings():
    """``Engine()`` (the benchmarks replay through it) solves as the monitor does with ``Evaluation()``'s defaults."""
    from curvwatch import Evaluation
    from curvwatch.engine import MONITOR_LANCZOS

    e, m = Evaluation(), MONITOR_LANCZOS
    assert (m.tol, m.max_iter, m.max_basis) == (e.tol, e.max_iter, e.max_basis)
    assert Engine().lanczos == MONITOR_LANCZOS


def test_results_equal_the_blocks_own_closed_forms():
    blocks = _captured()
    engine = Engine(dtype="float64", lanczos=Lanczos(tol=1e-6, max_iter=200, max_basis=None))
    out = engine.evaluate(blocks)
    assert list(out.results) == [b.spec.name for b in blocks] and not out.failed and not out.excluded
    attn = blocks[0]
    expected = evaluate_block(
        attn, lanczos=Lanczos(tol=1e-6, max_iter=200, max_basis=None, warn=False), dtype=torch.float64
    )
    for key in ("hessian/QQ/h0", "outer/VV/h1", "term/x_norm"):
        assert float(out.results["layer0/attn"][key]) == pytest.approx(float(expected[key]), rel=1e-9)
    assert "ln/var_min" in out.results["layer0/ln_1"] and "ffn/dead_fraction" in out.results["layer0/ffn"]
    assert out.cold == {"layer0/attn", "layer0/ffn"}  # the Lanczos kinds, before their first vectors
    assert engine.evaluate(blocks).cold == set()  # the second evaluation starts warm


def test_a_failing_block_is_left_out_alone(monkeypatch):
    original = engine_core.evaluate_block

    def fail_ffn(self, **kwargs):
        if self.spec.kind == "ffn":
            raise FloatingPointError("induced")
        return original(self, **kwargs)

    monkeypatch.setattr(engine_core, "evaluate_block", fail_ffn)
    out = Engine().evaluate(_captured())
    assert set(out.results) == {"layer0/attn", "layer0/ln_1", "layer0/ln_2"}
    assert isinstance(out.failed["layer0/ffn"], FloatingPointError)
    with pytest.raises(BlockError, match="layer0/ffn: FloatingPointError: induced"):
        Engine(raise_errors=True).evaluate(_captured())


def test_every_block_failing_raises_the_first_error(monkeypatch):
    monkeypatch.setattr(engine_core, "evaluate_block", lambda self, **kw: 1 / 0)
    with pytest.raises(BlockError, match="layer0/attn: ZeroDivisionError"):
        Engine().evaluate(_captured())


def test_nonfinite_blocks_are_flagged_and_layernorm_keeps_its_input_statistics():
    blocks = _captured()
    for b in blocks:
        b.inputs["grad_output"][0, 0, 0] = math.nan
    with pytest.warns(UserWarning, match="its captured grad_output hold NaN") as seen:
        out = Engine().evaluate(blocks)
    assert len(seen) == 4  # one warning per block (once per run each)
    assert out.results["layer0/attn"] == {NONFINITE: 1.0}
    assert out.results["layer0/ln_1"][NONFINITE] == 1.0 and "ln/var_min" in out.results["layer0/ln_1"]
    assert sorted(out.nonfinite) == sorted(b.spec.name for b in blocks)


def test_out_of_memory_halves_the_tokens_and_retries_once(monkeypatch):
    original, calls = engine_core.evaluate_block, []

    def oom_once(self, **kwargs):
        calls.append((self.spec.name, self.tokens))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("induced")
        return original(self, **kwargs)

    monkeypatch.setattr(engine_core, "evaluate_block", oom_once)
    # the tokens' intermediates dominate the estimate (else the engine holds fewer Lanczos vectors instead: at this
    # tiny size the attention's QQ and KK bases, held at once, would)
    monkeypatch.setattr(engine_core, "basis_bytes", lambda self, dtype=None, vectors=20: 0)
    engine = Engine(max_tokens=12)
    with pytest.warns(UserWarning, match="ran out of memory evaluating block 'layer0/attn' on 12 tokens"):
        out = engine.evaluate(_captured())
    assert calls[:2] == [("layer0/attn", 12), ("layer0/attn", 6)] and engine.token_limit == 6
    assert "hessian/QQ/h0" in out.results["layer0/attn"]
    state = engine.state_dict()
    fresh = Engine(max_tokens=12)
    fresh.load_state_dict(state)
    assert fresh.token_limit == 6


def test_each_block_lets_its_lanczos_runs_share_solves_within_its_basis_estimate(monkeypatch):
    """The engine passes every block's kernel ``solve_bytes``: the block's own estimate of its Lanczos bases (which the
    memory windows and ``memory_budget_mb`` count), at least ``plan.SOLVE_BYTES``; an out-of-memory retry solves
    one run at a time (``solve_bytes=0``), and later blocks share solves again within their estimate at the vectors
    the retry left."""
    from curvwatch.closed_form.solver import plan
    from curvwatch.engine import MONITOR_LANCZOS, vectors_held

    seen, original = [], engine_core.evaluate_block

    def spy(self, **kwargs):
        seen.append((self, kwargs["lanczos"]))
        if len(seen) == 1:
            raise torch.OutOfMemoryError("induced")
        return original(self, **kwargs)

    def estimate(self, dtype=torch.float32, max_iter=20, max_basis=None):  # the bases dominate: the retry holds fewer
        return 2 * basis_bytes(self, dtype, vectors_held(max_iter, max_basis))

    monkeypatch.setattr(engine_core, "evaluate_block", spy)
    monkeypatch.setattr(engine_core, "evaluation_bytes", estimate)
    monkeypatch.setattr(plan, "SOLVE_BYTES", 1)  # below every block's estimate here
    with pytest.warns(UserWarning, match="holding at most 8 Lanczos vectors per norm"):
        Engine().evaluate(_captured())
    held = vectors_held(MONITOR_LANCZOS.max_iter, MONITOR_LANCZOS.max_basis)
    (block, first), (again, retry) = seen[:2]
    assert again is block and first.max_basis == held == 16 and retry.max_basis == 8
    assert first.solve_bytes == basis_bytes(block, torch.float32, 16) > 1
    assert retry.solve_bytes == 0
    later = seen[2:]
    assert later and all(lz.max_basis == 8 and lz.solve_bytes == max(1, basis_bytes(b, torch.float32, 8))
                         for b, lz in later)  # fmt: skip
    # tiny blocks: the default budget
    monkeypatch.setattr(plan, "SOLVE_BYTES", 2**30)
    seen[:] = [None]  # (no induced error this time)
    Engine().evaluate(_captured())
    assert len(seen) > 1 and all(lz.solve_bytes == 2**30 for _, lz in seen[1:])


def test_invalid_dtype_is_refused():
    with pytest.raises(ValueError, match="Invalid dtype='float16'"):
        Engine(dtype="float16")


def test_preconditioners_are_checked_in_the_engines_one_read_not_per_kernel(monkeypatch):
    """The Adam preconditioners join the engine's one NaN/Inf read of all blocks (the kernels
    then skip their own check, a host read per call): a finite one gives the preconditioned keys with no read in the
    kernel's check; a non-finite one (a diverged optimizer state) flags its block as non-finite, naming it, and no
    other. Called directly, the kernel still checks (and refuses) it."""
    import importlib

    from benchmarks.bench_dispatch import OpCounter, count_host_reads
    from curvwatch.closed_form.solver import sampled
    from curvwatch.realloss.logits import find_logits_module

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=11, block_size=6, n_layer=1, n_head=2, d_model=8, d_ff=16))
    specs = find_blocks(model)

    def captured():
        with Capture(specs, max_tokens=12, logits_module=find_logits_module(model)[1]) as capture:
            logits = model(torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1)))
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), torch.arange(12) % 11)
            sample_outputs(capture, loss, 4, generator=torch.Generator().manual_seed(0))
            loss.backward()
        return capture.blocks()

    reads = []
    check = sampled.check_precondition

    def counted(*args, **kwargs):
        counter = OpCounter()
        with counter, count_host_reads(counter):
            result = check(*args, **kwargs)
        reads.append(counter.syncs)
        return result

    monkeypatch.setattr(sampled, "check_precondition", counted)
    ffn_module = importlib.import_module("curvwatch.closed_form.ffn")  # (the package's ffn is the function)
    monkeypatch.setattr(ffn_module, "check_precondition", counted)  # imported by name there
    block = next(s for s in specs if s.kind == "ffn")
    W_1 = torch.rand(8, 16) + 0.5
    out = Engine().evaluate(captured(), precondition={block.name: {"W_1": W_1}})
    assert "precond_sharpness/W1W1" in out.results[block.name] and not out.nonfinite
    assert reads and not any(reads), reads
    bad = W_1.clone()
    bad[0, 0] = math.nan
    with pytest.warns(UserWarning, match=r"its captured precondition\[W_1\] hold NaN"):
        out = Engine().evaluate(captured(), precondition={block.name: {"W_1": bad}})
    assert out.nonfinite == [block.name] and out.results[block.name] == {NONFINITE: 1.0}
    assert "hessian/QQ/h0" in out.results["layer0/attn"]
    ffn_block = next(b for b in captured() if b.spec.name == block.name)
    with pytest.raises(ValueError, match=r"Invalid precondition\['W_1'\]: every entry must be finite and > 0"):
        evaluate_block(ffn_block, precondition={"W_1": bad})


def test_each_evaluation_draws_its_own_lanczos_starts_and_a_resumed_engine_goes_on_counting(monkeypatch):
    """One seed for every evaluation hands each the same random start (the whole of a cold start, the noise of a warm
    one): a draw nearly orthogonal to a block's top eigenvector then misses it at every evaluation for as long as that
    eigenvector stays, and a run resumed from a checkpoint starts from its step-0 draw again. The engine seeds each
    evaluation with its count of evaluations, which its state dict keeps."""
    from curvwatch.closed_form.solver import plan

    seeds: list[int] = []
    draw = plan.start_vectors

    def recorded(batch_shape, n, dtype, device, v0=None, seed=0):
        seeds.append(seed)
        return draw(batch_shape, n, dtype, device, v0, seed)

    monkeypatch.setattr(plan, "start_vectors", recorded)
    blocks = _captured()
    engine = Engine()
    drawn = []
    for _ in range(2):
        engine.evaluate(blocks)
        drawn.append(set(seeds))
        seeds.clear()
    resumed = Engine()
    resumed.load_state_dict(engine.state_dict())
    assert not resumed.warm  # (the warm starts are not kept)
    resumed.evaluate(blocks)
    assert drawn + [set(seeds)] == [{0}, {1}, {2}]
    fresh = Engine()
    fresh.load_state_dict({k: v for k, v in engine.state_dict().items() if k != "lanczos_draws"})  # an older checkpoint
    assert fresh.draws == 0
