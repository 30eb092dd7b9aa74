"""Issue 23 goal 5: on recorded training states, every norm the monitor reports as converged (warm starts included,
blocks evaluated together) is within 1% of a tight cold solve of the same captured tensors: the indefinite
``functional/...`` and ``hessian/...`` norms (both spectrum ends) as well as the Gauss-Newton ones.

Before issue 23, at the defaults over 12 training steps, 11 of 744 norms were more than 5% below a tight cold solve
(worst ``layer0/ffn/functional/W1W1`` -64%) while reported converged: the warm start (the last evaluation's Ritz
vector with 1e-3 of noise) stopped on the old end of a spectrum whose other end had grown.
"""

from __future__ import annotations

import torch

from curvwatch.adapters import find_blocks
from curvwatch.capture import Capture
from curvwatch.closed_form.settings import Lanczos
from curvwatch.engine import MONITOR_LANCZOS, Engine
from curvwatch.metrics import residuals
from curvwatch.models.gpt import GPT, GPTConfig
from curvwatch.realloss import sample_outputs

STEPS = 12
TIGHT = Lanczos(tol=1e-7, max_iter=400, max_basis=None)


def test_converged_norms_on_training_states_are_within_1_percent_of_a_tight_cold_solve():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=31, block_size=12, n_layer=2, n_head=2, d_model=16, d_ff=48, activation="gelu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)  # large steps: the spectra move between evaluations
    specs = find_blocks(model)
    monitor = Engine()  # the monitor's defaults: warm starts, tol 1e-2, 16 vectors, blocks together
    checked = worst = 0.0
    bad: list[str] = []
    for step in range(STEPS):
        idx = torch.randint(0, 31, (4, 13))
        with Capture(specs, monitor.token_limit) as capture:
            logits = model(idx[:, :-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, 31), idx[:, 1:].reshape(-1)).backward()
        blocks = capture.blocks()
        warm = monitor.evaluate(blocks)
        cold = Engine(lanczos=TIGHT, lockstep=False).evaluate(blocks)  # a fresh engine: cold starts
        for name, res in warm.results.items():
            for key, rel in residuals(res).items():
                if rel > MONITOR_LANCZOS.tol:  # not reported as converged (max_iter cut it): not held to 1%
                    continue
                got, ref = float(res[key]), float(cold.results[name][key])
                err = abs(got - ref) / max(abs(ref), 1e-12)
                checked += 1
                worst = max(worst, err)
                if err > 0.01:
                    bad.append(f"step {step} {name}/{key}: {got:.6g} vs {ref:.6g} ({err:.1%})")
        opt.step()
        opt.zero_grad()
    assert checked >= 300, checked  # the norms of 12 evaluations (QQ, KK, VV, W1W1 x kinds x heads)
    print(f"checked {checked:.0f} converged norms, worst relative error {worst:.2e}")
    assert not bad, "\n".join(bad)
    assert worst < 0.01


def test_debiased_sampled_keys_with_warm_starts_are_within_1_percent_of_a_tight_cold_solve():
    """The same for the real-loss keys: each ``sharpness/XX`` and ``ggn/XX`` is a Richardson extrapolation
    ``2 full - mean(halves)`` of three Lanczos members (or exact, from the samples' Gram matrix), which carries the
    members' errors into the estimate, weighted (by 13x the estimate's scale where the correction is large, as at
    these initial weights). With the members solved to the key's own tol (``MEMBER_TOL = 1``) the worst key here read
    22% above the tight solve (``layer1/ffn/sharpness/W1W1`` 0.0727 vs 0.0596) while reported converged; at
    ``MEMBER_TOL`` 0.2, 0.01%. Held-out HF GPT-2 (d 64, 2 layers, random tokens), 16 samples, four captures in a row
    (new samples each: the warm starts are the last capture's), the monitor's defaults."""
    from benchmarks.bench_sharpness import _full_ce, held_out_gpt2
    from curvwatch.realloss.logits import find_logits_module

    torch.manual_seed(0)
    model, x, y = held_out_gpt2(64, vocab=256, B=2, L=64)
    specs = find_blocks(model)
    _, head = find_logits_module(model)
    monitor = Engine()
    checked = worst = 0.0
    bad: list[str] = []
    for seed in range(4):
        with Capture(specs, monitor.token_limit, logits_module=head) as cap:
            loss, _ = _full_ce(x, y)(model)
            sample_outputs(cap, loss, 16, generator=torch.Generator().manual_seed(seed))
            loss.backward()
        model.zero_grad()
        blocks = cap.blocks()
        warm = monitor.evaluate(blocks)
        cold = Engine(lanczos=TIGHT, lockstep=False).evaluate(blocks)
        for name, res in warm.results.items():
            rel = residuals(res)
            for key, value in res.items():
                if not key.startswith(("sharpness/", "ggn/")) or rel.get(key, 0.0) > MONITOR_LANCZOS.tol:
                    continue
                got, ref = float(value), float(cold.results[name][key])
                err = abs(got - ref) / max(abs(ref), 1e-12)
                checked += 1
                worst = max(worst, err)
                if err > 0.01:
                    bad.append(f"capture {seed} {name}/{key}: {got:.6g} vs {ref:.6g} ({err:.1%})")
    assert checked >= 100, checked  # 4 captures x (QQ, KK per head, VV per head, W1W1, W2W2) x (ggn, sharpness)
    assert not bad, "\n".join(bad)
