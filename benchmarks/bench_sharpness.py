"""Real-loss sharpness: Monte-Carlo error against the number of samples, the gap to the true block Hessian
along training, and the cost of the sampling, on the demo's addition task (no downloads).

For each model (our GPT; Hugging Face GPT-2 with eager attention) at three points of an AdamW run (initial
weights, mid-run, converged), for a few blocks ``XX`` (attention QQ/KK/VV of head 0, FFN W1W1/W2W2):

* exact, by ``torch.func`` in float64 (:func:`curvwatch.reference.real_loss.real_loss_blocks`): ``lambda_max`` of
  the Gauss-Newton block ``ggn``, of ``ggn + own`` (what ``sharpness/XX`` estimates) and of the true Hessian;
* the monitor's path (capture, sampled output gradients, closed-form kernels, float64, tight Lanczos): the
  relative error of ``sharpness/XX`` against ``lambda_max(ggn + own)`` for ``k`` samples, median and 90th
  percentile over seeds (each seed draws new labels);
* the cost: one evaluation with and without sampling (16 samples) on the demo model, side by side.

``--bias`` instead measures the upward bias of the largest eigenvalue of a few-sample estimate on held-out models
(Hugging Face GPT-2 built from a config, random tokens, all tokens kept, step 0) against the exact value by
matrix-free ``torch.func`` products in float64 (:func:`curvwatch.reference.real_loss.real_loss_top`): relative error
of ``sharpness/XX`` median / p90 / worst over seeds, and how often ``sharpness_spread`` covers the truth
(``--estimators`` compares the plain Monte-Carlo value and other estimators on the same samples).

Run: ``python -m benchmarks.bench_sharpness [--quick] [--out benchmarks/results/sharpness.md]``;
``python -m benchmarks.bench_sharpness --bias --width 128 --ks 16,64 --seeds 3``;
``python -m benchmarks.bench_sharpness --cost --width 64`` (the real-loss share of a full evaluation, vocab 50,257);
``python -m benchmarks.bench_sharpness --warm-store --width 768 --batch 2`` (the warm-start store's memory);
``python -m benchmarks.bench_sharpness --sampled GRAM_STEPS=4,12 --width 64 --batch 8 --seq 128 --repeats 3`` (a
setting of the sampled keys, here where the Gauss-Newton keys come from the samples' Gram matrix: time, operators
and Lanczos steps side by side).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from curvwatch.adapters import find_blocks
from curvwatch.capture import Capture
from curvwatch.closed_form.settings import Lanczos
from curvwatch.data import IGNORE_INDEX, VOCAB_SIZE, AdditionDataset
from curvwatch.engine import Engine, evaluate_block
from curvwatch.models.gpt import GPT, GPTConfig
from curvwatch.realloss import sample_outputs
from curvwatch.reference.real_loss import real_loss_blocks

TIGHT = Lanczos(tol=1e-8, max_iter=200, max_basis=None, warn=False)
# (block, pair, weight, columns of head 0 or None)
PROBES = (
    ("layer0/attn", "QQ", "W_Q", True),
    ("layer0/attn", "KK", "W_K", True),
    ("layer1/attn", "VV", "W_V", True),
    ("layer0/ffn", "W1W1", "W_1", False),
    ("layer1/ffn", "W2W2", "W_2", False),
)


def _precondition(rules) -> dict | None:
    """The engine's ``precondition`` from the optimizer's rules (``{block: StabilityRule}`` or None)."""
    return None if rules is None else {name: rule.precondition for name, rule in rules.items() if rule.precondition}


def _data(n: int, seed: int, n_digits: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ds = AdditionDataset(n_digits=n_digits, n_samples=n, seed=seed)
    x, y = zip(*(ds[i] for i in range(n)), strict=True)
    return torch.stack(x), torch.stack(y)


def our_gpt() -> tuple[torch.nn.Module, int, str]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB_SIZE, block_size=8, n_layer=2, n_head=2, d_model=16, d_ff=32, dropout=0.0,
                    attention="math")  # fmt: skip
    return GPT(cfg).double(), 8, "GPT (ours)"


def hf_gpt2() -> tuple[torch.nn.Module, int, str]:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=VOCAB_SIZE, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    cfg._attn_implementation = "eager"
    model = tf.GPT2LMHeadModel(cfg).double()
    return model, 8, "HF GPT-2"


def _logits(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _loss_fn(x, y):
    def fn(model):
        z = _logits(model, x)
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX), z

    return fn


def _train(model, steps: int, x, y) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = torch.zeros(())
    for i in range(steps):
        sel = torch.randint(0, x.shape[0], (64,), generator=torch.Generator().manual_seed(i))
        loss, _ = _loss_fn(x[sel], y[sel])(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)


def _head_slice(spec, weight):
    n_heads = int(spec.adapter.read_params(spec).get("n_heads", 1))
    width = spec.adapter.read_params(spec)[weight].shape[1] // n_heads
    return slice(0, width)


def _lam(M: torch.Tensor) -> float:
    return float(torch.linalg.eigvalsh((M + M.T) / 2)[-1])


def monitor_sharpness(model, x, y, k: int, seed: int) -> dict[str, dict[str, float]]:
    """The monitor's path: capture with k sampled output gradients, the engine in float64 (tight Lanczos)."""
    specs = find_blocks(model)
    from curvwatch.realloss.logits import find_logits_module

    _, logits_module = find_logits_module(model)
    with Capture(specs, max_tokens=10**6, logits_module=logits_module) as cap:
        loss, _ = _loss_fn(x, y)(model)
        sample_outputs(cap, loss, k, generator=torch.Generator().manual_seed(seed))
        loss.backward()
    model.zero_grad()
    engine = Engine(lanczos=TIGHT, dtype="float64", parts=("outer", "functional", "hessian"))
    return engine.evaluate(cap.blocks()).results


def accuracy_table(build, checkpoints, ks, seeds, n_eval: int) -> list[str]:
    model, _, label = build()
    x, y = _data(2000, 0)
    xe, ye = x[:n_eval], y[:n_eval]
    rows = []
    done = 0
    for name, steps in checkpoints:
        loss = _train(model, steps - done, x, y) if steps > done else float(_loss_fn(xe, ye)(model)[0])
        done = steps
        specs = {s.name: s for s in find_blocks(model)}
        exact = {}
        for block, pair, weight, per_head in PROBES:
            spec = specs[block]
            cols = _head_slice(spec, weight) if per_head else None
            r = real_loss_blocks(model, _loss_fn(xe, ye), spec, weight, cols)
            exact[(block, pair)] = (_lam(r["ggn"]), _lam(r["ggn"] + r["own"]), _lam(r["hessian"]))
        errors = {key: {k: [] for k in ks} for key in exact}
        for k in ks:
            for seed in range(seeds):
                res = monitor_sharpness(model, xe, ye, k, seed)
                for (block, pair), (_, target, _) in exact.items():
                    key = f"sharpness/{pair}" + ("/h0" if pair in ("QQ", "KK", "VV") else "")
                    errors[(block, pair)][k].append(abs(float(res[block][key]) - target) / abs(target))
        for (block, pair), (ggn, target, true) in exact.items():
            cells = []
            for k in ks:
                e = sorted(errors[(block, pair)][k])
                cells.append(f"{statistics.median(e):.2f} / {e[int(0.9 * (len(e) - 1))]:.2f}")
            rows.append(
                f"| {label} | {name} (loss {loss:.2f}) | {block} {pair} | {ggn:.3g} | {target:.3g} | {true:.3g} | "
                f"{true / target:.2f} | " + " | ".join(cells) + " |"
            )
    return rows


def cost_table(repeats: int) -> list[str]:
    """One evaluation of the demo-size model without and with 16 samples (SGD: two Lanczos members per pair; AdamW:
    four, with the preconditioned pair), interleaved, float32, the monitor's defaults."""
    from curvwatch.realloss.logits import find_logits_module
    from curvwatch.realloss.plugin import RealLoss

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=11, n_layer=2, n_head=4, d_model=64, dropout=0.0))
    x, y = _data(64, 1, n_digits=3)  # the demo's model and batch
    specs = find_blocks(model)
    _, head = find_logits_module(model)
    adam = torch.optim.AdamW(model.parameters(), lr=5e-3)
    loss, _ = _loss_fn(x, y)(model)
    loss.backward()
    adam.step()  # second moments exist
    model.zero_grad()
    real = RealLoss()
    names = ("step (forward + backward)", "evaluation without sampling", "with 16 samples (SGD)",
             "with 16 samples (AdamW: + preconditioned)", "of which the 16 sampled backward passes")  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for mode in ("plain", "sgd", "adam"):
            t0 = time.perf_counter()
            with Capture(specs, max_tokens=512, logits_module=None if mode == "plain" else head) as cap:
                loss, _ = _loss_fn(x, y)(model)
                t1 = time.perf_counter()
                if mode != "plain":
                    sample_outputs(cap, loss, 16, generator=torch.Generator().manual_seed(0))
                t2 = time.perf_counter()
                loss.backward()
            t3 = time.perf_counter()
            blocks = cap.blocks()
            rules = (
                real.rules(adam, [b.spec for b in blocks if "output_samples" in b.inputs])[0]
                if mode == "adam"
                else None
            )
            Engine().evaluate(blocks, precondition=_precondition(rules))
            t4 = time.perf_counter()
            model.zero_grad()
            if mode == "plain":
                times[names[0]].append(t3 - t0)
                times[names[1]].append(t4 - t3)
            else:
                times[names[2] if mode == "sgd" else names[3]].append(t4 - t3 + t2 - t1)
                times[names[4]].append(t2 - t1)
    return [f"| {k} | {statistics.median(v) * 1e3:.1f} |" for k, v in times.items()]


def _adam_gpt2(width: int, vocab: int, B: int, L: int, device: str = "cpu"):
    """``(model, x, y, block specs, logits module, AdamW)``: the held-out GPT-2 of :func:`held_out_gpt2` on
    ``device`` after one AdamW step (its second moments exist, so the stability rules precondition)."""
    from curvwatch.realloss.logits import find_logits_module

    model, x, y = held_out_gpt2(width, vocab=vocab, B=B, L=L)
    model, x, y = model.to(device), x.to(device), y.to(device)
    specs = find_blocks(model)
    _, head = find_logits_module(model)
    adam = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss, _ = _full_ce(x, y)(model)
    loss.backward()
    adam.step()
    model.zero_grad()
    return model, x, y, specs, head, adam


def _sampled_capture(model, x, y, specs, head, adam, real, seed: int):
    """``(blocks, rules)``: one captured step of ``model`` on ``(x, y)`` with 16 sampled output gradients (seed
    ``seed``, ``max_tokens`` 512) and the real-loss rules of ``real`` for ``adam`` (no optimizer step)."""
    with Capture(specs, max_tokens=512, logits_module=head) as cap:
        loss, _ = _full_ce(x, y)(model)
        sample_outputs(cap, loss, 16, generator=torch.Generator().manual_seed(seed))
        loss.backward()
    model.zero_grad()
    blocks = cap.blocks()
    return blocks, real.rules(adam, [b.spec for b in blocks if "output_samples" in b.inputs])[0]


def cost_share(
    width: int = 64,
    B: int = 8,
    L: int = 128,
    vocab: int = 50_257,
    repeats: int = 1,
    samples: int = 16,
    device: str = "cpu",
) -> list[str]:
    """The real-loss part of a full evaluation at a 50K vocabulary: time and dispatched operators of one evaluation
    without sampling (capture, ``Engine.evaluate``) and with it (``samples`` samples, ``sample_outputs`` before the
    backward, AdamW rules: the preconditioned pairs too), side by side in one process (interleaved, median of
    ``repeats``), float32, the monitor's defaults (``max_tokens`` 512). The real-loss part is the difference; its
    share is ``part / with``. The sampled passes run batched (:func:`~curvwatch.realloss.sampling.passes_at_once`), and
    in a third variant one at a time (``batched=False``), interleaved with the others. Held-out Hugging Face GPT-2
    (eager attention), random tokens. On ``device`` "cpu" the seconds are this process's CPU time (one thread: the
    shared machine's load aside); on a GPU wall-clock seconds with the device synchronised at each reading (the GPU's
    figures: ``benchmarks/gpu_scale.sh``)."""
    from benchmarks.bench_dispatch import OpCounter
    from curvwatch.realloss.plugin import RealLoss

    model, x, y, specs, head, adam = _adam_gpt2(width, vocab, B, L, device)
    real, engine = RealLoss(), Engine()
    # new samples at every evaluation, as in training (with the same samples every time the warm starts were the last
    # answers of the same matrices, and the Lanczos members looked cheaper than they are)
    seeds = itertools.count()
    cuda = torch.device(device).type == "cuda"

    def clock() -> float:
        if cuda:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return time.process_time()

    def one(mode: str, counters: tuple[OpCounter, OpCounter] | None = None) -> dict[str, float]:
        sample_ops, eval_ops = counters or (contextlib.nullcontext(), contextlib.nullcontext())
        t0 = clock()
        with Capture(specs, max_tokens=512, logits_module=None if mode == "plain" else head) as cap:
            loss, _ = _full_ce(x, y)(model)
            t1 = clock()
            if mode != "plain":
                with sample_ops:
                    generator = torch.Generator(device=device).manual_seed(next(seeds))
                    sample_outputs(cap, loss, samples, generator=generator, batched=mode == "real")
            t2 = clock()
            loss.backward()
        t3 = clock()
        blocks = cap.blocks()
        rules = (
            real.rules(adam, [b.spec for b in blocks if "output_samples" in b.inputs])[0] if mode != "plain" else None
        )
        with eval_ops:
            engine.evaluate(blocks, precondition=_precondition(rules))
        model.zero_grad()
        return {"step": t3 - t0 - (t2 - t1), "sampling": t2 - t1, "evaluate": clock() - t3}

    one("plain"), one("real"), one("loop")  # warm-up (and the engine's warm starts)
    times = {m: [] for m in ("plain", "real", "loop")}
    for _ in range(repeats):
        for m in times:
            times[m].append(one(m))
    ops = {m: (OpCounter(), OpCounter()) for m in ("plain", "real", "loop")}
    for m, c in ops.items():
        one(m, c)
    med = {m: {k: statistics.median(t[k] for t in ts) for k in ts[0]} for m, ts in times.items()}
    off, on = (med[m]["sampling"] + med[m]["evaluate"] for m in ("plain", "real"))
    ops_off, ops_on = (sum(c.total for c in ops[m]) for m in ("plain", "real"))
    part, ops_part = on - off, ops_on - ops_off
    where = f"{torch.cuda.get_device_name(device)}, wall-clock seconds" if cuda else "CPU time of one thread"
    return [
        f"HF GPT-2 d {width}, 2 layers, vocab {vocab}, B {B}, L {L}, max_tokens 512, {samples} samples, AdamW rules; "
        f"{where}, median of {repeats}",
        f"| | {'time' if cuda else 'CPU time'} (s) | operators |",
        "| --- | --- | --- |",
        f"| training step (forward + backward, captured) | {med['plain']['step']:.2f} | - |",
        f"| full evaluation without real-loss keys | {off:.2f} | {ops_off} |",
        f"| full evaluation with real-loss keys | {on:.2f} | {ops_on} |",
        f"| real-loss part (difference) | **{part:.2f} ({part / on:.0%})** | "
        f"**{ops_part} ({ops_part / ops_on:.0%})** |",
        f"| of which the sampling (`sample_outputs`) | {med['real']['sampling']:.2f} | {ops['real'][0].total} |",
        f"| the sampling, its passes one at a time (`batched=False`) | {med['loop']['sampling']:.2f} | "
        f"{ops['loop'][0].total} |",
        f"| of which the sampled keys in the kernels | {med['real']['evaluate'] - med['plain']['evaluate']:.2f} | "
        f"{ops['real'][1].total - ops['plain'][1].total} |",
    ]


def sampled_setting_table(
    name: str,
    settings: Sequence[float],
    width: int = 64,
    B: int = 8,
    L: int = 128,
    vocab: int = 50_257,
    repeats: int = 3,
    train: int = 0,
) -> list[str]:
    """A setting of the sampled keys (``curvwatch.closed_form.solver.sampled_keys.<name>``: ``GRAM_STEPS``, where
    the Gauss-Newton keys come from the samples' Gram matrix; ``MEMBER_TOL``, how tight the Lanczos members are solved):
    one full evaluation with the real-loss keys (16 samples, AdamW rules, ``max_tokens`` 512) under each value of
    ``settings``, side by side on the same captures (each repeat a new capture: new samples, as at a later
    evaluation), CPU time of one thread (median of ``repeats``, interleaved in alternating order), its dispatched
    operators, and the steps of the runs holding sampled members (``(sampled rows x heads, steps): runs``). With
    ``train``, that many AdamW steps (lr 1e-3) before each capture: the warm starts are then an earlier state's, as at
    an evaluation every ``train`` steps (without, every capture is of the same weights and a warm start is nearly the
    answer). Held-out Hugging Face GPT-2, random tokens. An unknown ``name`` raises."""
    import collections

    from benchmarks.bench_dispatch import OpCounter
    from curvwatch.closed_form.solver import lanczos, sampled_keys

    if name not in ("GRAM_STEPS", "MEMBER_TOL"):
        raise ValueError(f"Unknown sampled setting {name!r}; choose GRAM_STEPS or MEMBER_TOL.")
    from curvwatch.realloss.plugin import RealLoss

    model, x, y, specs, head, adam = _adam_gpt2(width, vocab, B, L)
    real, engines = RealLoss(), {m: Engine() for m in settings}
    steps: dict[float, collections.Counter] = {m: collections.Counter() for m in settings}
    current: list[float | None] = [None]
    finish = lanczos.LanczosRun._finish

    def counted(run) -> None:  # the sampled members are the algebraic ones (in a run merged with a kernel's own)
        if run.alg_h.any() and current[0] is not None:
            steps[current[0]][(int(run.alg_h.sum()), run.j + 1)] += 1
        finish(run)

    for group in adam.param_groups if train else ():
        group["lr"] = 1e-3

    def capture(seed: int):
        for _ in range(train):
            loss, _ = _full_ce(x, y)(model)
            loss.backward()
            adam.step()
            model.zero_grad()
        return _sampled_capture(model, x, y, specs, head, adam, real, seed)

    def one(m: float, blocks, rules, counter=None) -> float:
        saved, current[0] = getattr(sampled_keys, name), m
        setattr(sampled_keys, name, m)
        t = time.process_time()
        try:
            with counter or contextlib.nullcontext():
                engines[m].evaluate(blocks, precondition=_precondition(rules))
        finally:
            setattr(sampled_keys, name, saved)
            current[0] = None
        return time.process_time() - t

    lanczos.LanczosRun._finish = counted
    try:
        blocks, rules = capture(0)
        for m in settings:  # warm-up, and the warm starts of each setting's engine
            one(m, blocks, rules)
        for m in settings:
            steps[m].clear()
        times: dict[float, list[float]] = {m: [] for m in settings}
        for r in range(repeats):
            blocks, rules = capture(r + 1)
            for m in settings if r % 2 == 0 else settings[::-1]:
                times[m].append(one(m, blocks, rules))
        runs = {m: dict(c) for m, c in steps.items()}  # those of the timed evaluations
        blocks, rules = capture(repeats + 1)  # (evaluated once more, a capture's warm starts would be its answers)
        ops = {}
        for m in settings:
            c = OpCounter()
            one(m, blocks, rules, c)
            ops[m] = c.total
    finally:
        lanczos.LanczosRun._finish = finish
    kept = next(b.inputs["output_samples"].shape[1] for b in blocks if "output_samples" in b.inputs)
    lines = [
        f"HF GPT-2 d {width}, 2 layers, vocab {vocab}, B {B}, L {L}: {kept} kept sequences, k B = {16 * kept} Gram "
        f"columns; 16 samples, AdamW rules; CPU time of one thread, median of {repeats}"
        + (f"; {train} AdamW steps before each capture" if train else ""),
        f"| {name} | full evaluation (s) | operators | sampled runs: (rows x heads, steps): runs |",
        "| --- | --- | --- | --- |",
    ]
    for m in settings:
        counts = ", ".join(f"({b}, {j}): {c}" for (b, j), c in sorted(runs[m].items()))
        lines.append(f"| {m} | {statistics.median(times[m]):.3f} | {ops[m]} | {counts} |")
    return lines


def warm_store(width: int = 768, B: int = 2, L: int = 128, vocab: int = 50_257) -> list[str]:
    """The engine's warm-start store (held on the model's device between evaluations) after two full evaluations with
    the real-loss keys (16 samples, AdamW rules, new samples each): MiB of the engine's own keys and of the sampled
    keys'. Held-out Hugging Face GPT-2, 2 layers."""
    from curvwatch.realloss.plugin import RealLoss

    model, x, y, specs, head, adam = _adam_gpt2(width, vocab, B, L)
    engine = Engine()
    for seed in (1, 2):
        blocks, rules = _sampled_capture(model, x, y, specs, head, adam, RealLoss(), seed)
        engine.evaluate(blocks, precondition=_precondition(rules))
    size = {"engine": 0, "sharpness": 0}
    for warm in engine.warm.values():
        for key, v in warm._vectors.items():
            size["sharpness" if key[0] == "sharpness" else "engine"] += v.numel() * v.element_size()
    return [
        f"HF GPT-2 d {width}, 2 layers, B {B}, L {L}: warm-start store after two full evaluations (MiB)",
        "| engine keys | sampled keys |",
        "| --- | --- |",
        f"| {size['engine'] / 2**20:.3f} | {size['sharpness'] / 2**20:.3f} |",
    ]


def held_out_gpt2(width: int, layers: int = 2, heads: int = 4, vocab: int = 256, B: int = 8, L: int = 64):
    """A Hugging Face GPT-2 built from a config (eager attention, no dropout), float32, and a batch of random tokens
    and labels ``(B, L)`` (all ``B L`` tokens scored, mean cross-entropy)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=vocab, n_positions=L, n_embd=width, n_layer=layers, n_head=heads, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    cfg._attn_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, vocab, (B, L), generator=g), torch.randint(0, vocab, (B, L), generator=g)
    return tf.GPT2LMHeadModel(cfg), x, y


def _full_ce(x, y):
    def fn(model):
        z = _logits(model, x)
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1)), z

    return fn


def bias_rows(
    width: int,
    ks,
    seeds: int,
    layers: int = 2,
    max_tokens: int = 512,
    L: int = 64,
    tol: float = 1e-6,
    own: bool = False,
    B: int = 8,
) -> list[dict]:
    """Per block, ``k`` and seed: the logged ``sharpness`` and ``sharpness_spread`` and the
    exact ``lambda_max(ggn + own)`` of the held-out GPT-2 of :func:`held_out_gpt2` (``layers`` layers, ``max(4, width
    // 64)`` heads, ``B`` sequences of ``L`` tokens; probes: every layer's FFN ``W2W2``, layer 0's attention ``VV``
    of head 0; their own terms are zero; with ``own`` also layer 0's FFN ``W1W1``, whose own term is not). Each probe
    is evaluated alone (``evaluate_block(block, pairs=...)``), float64, Lanczos ``tol`` with at most 32 vectors held,
    with ``SPREAD_LIMIT`` lifted (the estimate's value even where the monitor withholds it; the table counts those); the
    exact value by ARPACK at the same ``tol``."""
    import copy

    from curvwatch.closed_form.solver import debiasing
    from curvwatch.realloss.logits import find_logits_module
    from curvwatch.reference.real_loss import real_loss_top

    heads = max(4, width // 64)
    model, x, y = held_out_gpt2(width, layers, heads=heads, B=B, L=L)
    probes = [(f"layer{i}/ffn", "W2W2", "W_2", None) for i in range(layers)]
    probes.append(("layer0/attn", "VV", "W_V", slice(0, width // heads)))
    if own:
        probes.append(("layer0/ffn", "W1W1", "W_1", None))
    m64 = copy.deepcopy(model).double()
    specs64 = {s.name: s for s in find_blocks(m64)}
    exact = {}
    for block, pair, weight, cols in probes:
        t0 = time.perf_counter()
        exact[block, pair] = real_loss_top(
            m64, _full_ce(x, y), specs64[block], weight, cols, own=weight == "W_1", tol=tol
        )
        exact[block, pair]["seconds"] = time.perf_counter() - t0
        print(f"exact {block} {pair}: {exact[block, pair]}", flush=True)
    del m64
    specs = find_blocks(model)
    _, head = find_logits_module(model)
    lanczos = Lanczos(tol=tol, max_iter=300, max_basis=32, warn=False)
    rows = []
    limit, debiasing.SPREAD_LIMIT = debiasing.SPREAD_LIMIT, math.inf
    try:
        for k in ks:
            for seed in range(seeds):
                with Capture(specs, max_tokens=max_tokens, logits_module=head) as cap:
                    loss, _ = _full_ce(x, y)(model)
                    sample_outputs(cap, loss, k, generator=torch.Generator().manual_seed(seed))
                    loss.backward()
                model.zero_grad()
                blocks = {b.spec.name: b for b in cap.blocks()}
                for block, pair, _, cols in probes:
                    t0 = time.perf_counter()
                    res = evaluate_block(blocks[block], lanczos=lanczos, pairs=(pair,), parts=("outer",))
                    seconds = time.perf_counter() - t0
                    suffix = "/h0" if cols is not None else ""
                    rows.append(dict(
                        width=width, layers=layers, B=B, L=L, block=block, pair=pair, n=exact[block, pair]["n"],
                        k=k, seed=seed, exact=exact[block, pair]["sharpness"],
                        logged=float(res[f"sharpness/{pair}{suffix}"]),
                        spread=float(res.get(f"sharpness_spread/{pair}{suffix}", float("nan"))),
                        seconds=seconds, exact_seconds=exact[block, pair]["seconds"],
                    ))  # fmt: skip
                    print(rows[-1], flush=True)
    finally:
        debiasing.SPREAD_LIMIT = limit
    return rows


def estimator_rows(width: int, ks, seeds: int, layers: int = 2, L: int = 64) -> list[dict]:
    """Alternative estimators of ``lambda_max(ggn)`` of every FFN ``W2W2`` of :func:`held_out_gpt2`, from the same
    samples as the monitor, against the exact value: the ``N = k B`` per-sample, per-sequence gradients
    ``g = H_b^T s_{j,b}`` (``H`` the FFN's hidden activations; their Gram matrix ``K = g g^T / k`` has the nonzero
    eigenvalues of the Monte-Carlo block) are formed explicitly, so each estimator is exact linear algebra on ``K``:

    * ``plain``: ``lambda_max(K)`` (the monitor's plain key); ``richardson``: ``2 plain - mean(halves)`` (the
      monitor's debiased key); ``richardson2``: second order with quarters too;
    * ``hollow``: ``lambda_max(K - diag K)`` (the U-statistic part); ``trace``: ``plain - tr(K) / N`` (the
      diagonal's mean bias);
    * ``spike``: the spiked-covariance inversion ``plain = l + (1/N) sum_p (m_p - l^p) / l^(p-1)``, ``p <= 4``, with
      unbiased moments ``m_p ~ tr(GGN^p)`` from distinct-index products of ``K``;
    * ``m4/m3``: a lower bound from those moments (``tr``, ``tr2``: the first two, over the exact value's powers);
      ``crossfit``: top vector of one half, Rayleigh quotient on the
      other (a lower bound in expectation), averaged over both directions; ``crossfit16``: the same with the
      top-16 subspace of one half.
    """
    import copy

    from curvwatch.realloss.logits import find_logits_module
    from curvwatch.reference.real_loss import real_loss_top

    model, x, y = held_out_gpt2(width, layers, heads=max(4, width // 64), L=L)
    m64 = copy.deepcopy(model).double()
    specs64 = {s.name: s for s in find_blocks(m64)}
    exact = {
        i: real_loss_top(m64, _full_ce(x, y), specs64[f"layer{i}/ffn"], "W_2", own=False, tol=1e-8)["ggn"]
        for i in range(layers)
    }
    specs = find_blocks(model)
    _, head = find_logits_module(model)

    def top(K: torch.Tensor) -> float:
        return float(torch.linalg.eigvalsh(K)[-1])

    def subspace_crossfit(ga, ka, gb, kb, s: int) -> float:
        _, V = torch.linalg.eigh(ga @ ga.T / ka)
        P, _ = torch.linalg.qr(ga.T @ V[:, -s:])
        Y = gb @ P
        return top(Y.T @ Y / kb)

    rows = []
    for k in ks:
        for seed in range(seeds):
            with Capture(specs, max_tokens=10**6, logits_module=head) as cap:
                loss, _ = _full_ce(x, y)(model)
                sample_outputs(cap, loss, k, generator=torch.Generator().manual_seed(seed))
                loss.backward()
            model.zero_grad()
            blocks = {b.spec.name: b for b in cap.blocks()}
            for i in range(layers):
                b, mlp = blocks[f"layer{i}/ffn"], m64.transformer.h[i].mlp
                with torch.no_grad():
                    H = mlp.act(mlp.c_fc(b.inputs["X"].double()))  # (B, L, f)
                    S = b.inputs["output_samples"].double()  # (k, B, L, m)
                    g = torch.einsum("blf,kblm->kbfm", H, S).reshape(k * S.shape[1], -1)  # (N, f m), row j B + b
                N, B = g.shape[0], S.shape[1]
                K = g @ g.T / k
                d = K.diagonal()
                lam = top(K)
                sample = torch.arange(N) // B
                half = sample < k // 2

                def part(mask, kk, g=g):
                    return top(g[mask] @ g[mask].T / kk)

                halves = (part(half, k // 2) + part(~half, k - k // 2)) / 2
                quarters = sum(part(sample % 4 == r, k // 4) for r in range(4)) / 4
                Kh = K - torch.diag(d)
                r2 = (Kh**2).sum(1)
                m = [float(d.sum()), float((Kh**2).sum()), float(torch.trace(Kh @ Kh @ Kh)),
                     float(torch.trace(Kh @ Kh @ Kh @ Kh) - 2 * (r2**2).sum() + (Kh**4).sum())]  # fmt: skip

                def spike(lv: float, m=m, N=N, lam=lam) -> float:
                    return lv + sum((m[p - 1] - lv**p) / lv ** (p - 1) for p in range(1, 5)) / N - lam

                lo, hi = 1e-12 * lam, lam
                if spike(hi) < 0:
                    hi = float("nan")
                else:
                    for _ in range(200):
                        mid = (lo + hi) / 2
                        lo, hi = (lo, mid) if spike(mid) > 0 else (mid, hi)
                _, Va = torch.linalg.eigh(g[half] @ g[half].T)
                _, Vb = torch.linalg.eigh(g[~half] @ g[~half].T)
                va, vb = g[half].T @ Va[:, -1], g[~half].T @ Vb[:, -1]
                va, vb = va / va.norm(), vb / vb.norm()
                cross = (
                    float(((g[~half] @ va) ** 2).sum()) / (k - k // 2) + float(((g[half] @ vb) ** 2).sum()) / (k // 2)
                ) / 2
                cross16 = (subspace_crossfit(g[half], k // 2, g[~half], k - k // 2, 16)
                           + subspace_crossfit(g[~half], k - k // 2, g[half], k // 2, 16)) / 2  # fmt: skip
                values = dict(plain=lam, richardson=2 * lam - halves, richardson2=(8 * lam - 6 * halves + quarters) / 3,
                              hollow=top(Kh), trace=lam - m[0] / N, spike=hi, m4_m3=m[3] / m[2], crossfit=cross,
                              crossfit16=cross16)  # fmt: skip
                rows.append(dict(width=width, block=f"layer{i}/ffn", n=g.shape[1], k=k, seed=seed, exact=exact[i],
                                 tr=m[0] / exact[i], tr2=m[1] / exact[i] ** 2,
                                 **{name: v / exact[i] for name, v in values.items()}))  # fmt: skip
                print(rows[-1], flush=True)
    return rows


ESTIMATORS = ("plain", "richardson", "richardson2", "hollow", "trace", "spike", "m4_m3", "crossfit", "crossfit16")
#: Also tabulated: the unbiased moment estimates tr(GGN) / lambda_max and tr(GGN^2) / lambda_max^2.
MOMENTS = ("tr", "tr2")


def estimator_table(rows: list[dict]) -> list[str]:
    """Markdown: per W2 block and ``k``, each estimator's ratio to the exact value, median (min-max over seeds), and
    the moment estimates ``tr`` (``tr(GGN) / lambda_max``) and ``tr2`` (``tr(GGN^2) / lambda_max^2``)."""
    names = ESTIMATORS + MOMENTS
    lines = ["| block | parameters | k | " + " | ".join(names) + " |", "|" + " --- |" * (3 + len(names))]
    for key in sorted({(r["width"], r["block"], r["k"]) for r in rows}):
        sel = [r for r in rows if (r["width"], r["block"], r["k"]) == key]
        cells = []
        for name in names:
            v = sorted(r[name] for r in sel)
            cells.append(f"{statistics.median(v):.2f} ({v[0]:.2f}-{v[-1]:.2f})")
        lines.append(f"| d={key[0]} {key[1]} W2W2 | {sel[0]['n']:,} | {key[2]} | " + " | ".join(cells) + " |")
    return lines


def bias_table(rows: list[dict]) -> list[str]:
    """Markdown: relative error median / p90 / worst per block and ``k``, the coverage of ``sharpness_spread``, how
    many of the values the monitor withholds (spread above ``SPREAD_LIMIT``: no value at the defaults) and the seconds
    of one probe's evaluation and of the exact value."""
    from curvwatch.closed_form.solver.debiasing import SPREAD_LIMIT

    lines = [
        "| model | block | parameters | exact | k | relative error: median / p90 / worst | spread covers | "
        "mean spread | withheld (spread > limit) | seconds: estimate / exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def group(r):
        return (r["width"], r.get("layers", 2), r.get("B", 8), r.get("L", 64), r["block"], r["pair"], r["k"])

    for key in sorted({group(r) for r in rows}):
        width, layers, B, L, block, pair, k = key
        sel = [r for r in rows if group(r) == key]
        e = sorted(abs(r["logged"] - r["exact"]) / r["exact"] for r in sel)
        error = f"{statistics.median(e):.2f} / {e[int(0.9 * (len(e) - 1) + 0.5)]:.2f} / {e[-1]:.2f}"
        seconds = statistics.median(r["seconds"] for r in sel)
        covered = sum(abs(r["logged"] - r["exact"]) <= r["spread"] * abs(r["logged"]) for r in sel)
        spread = statistics.mean(r["spread"] for r in sel)
        withheld = sum(r["spread"] > SPREAD_LIMIT for r in sel)  # no value at the defaults
        lines.append(
            f"| d={width}, {layers} layers, {f'B={B}, ' if B != 8 else ''}L={L} | {block} {pair} | {sel[0]['n']:,} | "
            f"{sel[0]['exact']:.4g} | {k} | {error} | {covered}/{len(sel)} | {spread:.2f} | {withheld}/{len(sel)} | "
            f"{seconds:.1f} / {sel[0]['exact_seconds']:.1f} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one model, two checkpoints, few seeds (smoke test)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--bias", action="store_true", help="the bias table on a held-out GPT-2 (see the docstring)")
    parser.add_argument("--cost", action="store_true", help="the real-loss share of a full evaluation, vocab 50,257")
    parser.add_argument("--warm-store", action="store_true", help="MiB of the warm-start store")
    parser.add_argument("--width", type=int, nargs="+", default=[128], help="--bias: GPT-2 widths (n_embd)")
    parser.add_argument("--ks", default="16,64", help="--bias: sample counts, comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="--bias: seeds per k")
    parser.add_argument("--layers", type=int, default=2, help="--bias: GPT-2 layers")
    parser.add_argument(
        "--seq",
        type=int,
        default=None,
        help="tokens per sequence (--bias: 8 sequences, default 64; --cost: default 128)",
    )
    parser.add_argument("--batch", type=int, default=8, help="--cost, --bias: sequences per batch")
    parser.add_argument("--repeats", type=int, default=1, help="--cost: evaluations per mode (the median)")
    parser.add_argument("--samples", type=int, nargs="+", default=[16], help="--cost: sample counts, one table each")
    parser.add_argument("--device", default="cpu", help="--cost: the device (cuda: wall-clock seconds)")
    parser.add_argument("--tol", type=float, default=1e-6, help="--bias: Lanczos / ARPACK relative tolerance")
    parser.add_argument("--estimators", action="store_true", help="alternative estimators on the W2 blocks")
    parser.add_argument("--own", action="store_true", help="--bias: also layer 0's FFN W1W1 (with its own term)")
    parser.add_argument("--json", type=Path, default=None, help="--bias: also write the rows as JSON")
    parser.add_argument("--train", type=int, default=0, help="--sampled: AdamW steps before each capture")
    parser.add_argument(
        "--sampled",
        default=None,
        help="a setting of closed_form.solver.sampled_keys and its values side by side: GRAM_STEPS=4,12 or "
        "MEMBER_TOL=1,0.2",
    )
    args = parser.parse_args(argv)
    if args.sampled:
        name, values = args.sampled.split("=")
        cast = int if name == "GRAM_STEPS" else float
        text = "\n".join(
            sampled_setting_table(
                name,
                [cast(v) for v in values.split(",")],
                args.width[0],
                B=args.batch,
                L=args.seq or 128,
                repeats=max(args.repeats, 1),
                train=args.train,
            )
        )
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    if args.estimators:
        ks = [int(k) for k in args.ks.split(",")]
        rows = [r for w in args.width for r in estimator_rows(w, ks, args.seeds, args.layers, L=args.seq or 64)]
        text = "\n".join(estimator_table(rows))
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    if args.bias:
        ks = [int(k) for k in args.ks.split(",")]
        rows = [
            r
            for w in args.width
            for r in bias_rows(
                w, ks, args.seeds, args.layers, L=args.seq or 64, tol=args.tol, own=args.own, B=args.batch
            )
        ]
        if args.json:
            import json

            args.json.write_text(json.dumps(rows, indent=1))
        text = "\n".join(bias_table(rows))
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    if args.warm_store:
        text = "\n".join(warm_store(args.width[0], B=args.batch, L=args.seq or 128))
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    if args.cost:
        text = "\n\n".join(
            "\n".join(cost_share(args.width[0], B=args.batch, L=args.seq or 128, repeats=args.repeats, samples=k,
                                 device=args.device))
            for k in args.samples
        )  # fmt: skip
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    if args.quick:
        builds, checkpoints, ks, seeds, n_eval, repeats = [our_gpt], [("init", 0)], (1, 16), 2, 16, 1
    else:
        builds = [our_gpt, hf_gpt2]
        checkpoints, ks, seeds, n_eval, repeats = (
            [("init", 0), ("mid", 150), ("converged", 1500)],
            (1, 4, 16, 64),
            8,
            32,
            5,
        )
    head = (
        "| model | weights | block | λ(GGN) | λ(GGN + own) | λ(true H) | true / sharpness | "
        + " | ".join(f"rel. error k={k} (median / p90)" for k in ks)
        + " |"
    )
    lines = [head, "|" + " --- |" * (7 + len(ks))]
    for build in builds:
        lines += accuracy_table(build, checkpoints, ks, seeds, n_eval)
    lines += ["", "| cost per evaluation (demo model, float32, CPU) | ms (median) |", "| --- | --- |"]
    lines += cost_table(repeats)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
