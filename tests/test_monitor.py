"""One monitor, three shells: the numbers a step logs are the same whichever loop drives :class:`curvwatch.Monitor`.

(a) the Lightning Trainer (``CurvatureMonitor``) against (b) a plain PyTorch loop on the same model and data;
(c) a Fabric loop written the way litgpt's ``pretrain.py`` writes it (bf16-mixed, gradient accumulation 2 with
``fabric.no_backward_sync``) and (d) Hugging Face's ``Trainer`` on a tiny Llama, each against the plain loop driving
the same model. Every test asserts on what reached a logger.
"""

from __future__ import annotations

import functools
import math
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from benchmarks.loggers import MemoryLogger
from curvwatch import Cadence, CurvatureMonitor, CurvatureNotice, Monitor, Sharpness, Warnings
from tests.ddp_script import VOCAB, TinyLM, loader

P = "curv/"
#: wall-clock keys: the only ones that differ between two runs of the same step
TIMING = ("eval_time_s", "overhead")
SETTINGS = dict(
    every_n_train_steps=1,
    cadence=Cadence(max_overhead=None, terms_every_n_train_steps=None),
    log_heatmap=False,
    warning_rules=Warnings(warn=False),
    log_level="all",  # every key reaches the sinks (the default "summary" keeps the headline ones)
)


class Recorder(MemoryLogger):
    """A Lightning logger that keeps what it is given: ``rows[step][key]``, the monitor's keys (``curv/...``,
    ``curv_...``)."""

    @property
    def rows(self) -> dict[int, dict[str, float]]:
        return {s: {k: v for k, v in m.items() if k.startswith(P[:-1])} for s, m in self.by_step().items()}


def numbers(rows: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """The logged numbers without the wall-clock keys."""
    return {s: {k: v for k, v in r.items() if not k.endswith(TIMING)} for s, r in rows.items() if r}


def assert_same(actual: dict, expected: dict, rtol: float = 0.0) -> None:
    assert sorted(actual) == sorted(expected), "different steps logged"
    for step in expected:
        assert sorted(actual[step]) == sorted(expected[step]), f"step {step}: different keys"
        for key, value in expected[step].items():
            got = actual[step][key]
            ok = (math.isnan(got) and math.isnan(value)) or abs(got - value) <= rtol * abs(value)
            assert ok, f"step {step} {key}: {got} vs {value} (rtol {rtol})"


def tiny_lm_loss(module: TinyLM, idx: torch.Tensor) -> torch.Tensor:
    """``TinyLM.training_step``'s loss, without ``self.log`` (no Trainer here)."""
    logits = module(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


def plain_loop(model, optimizer, batches, loss_fn, *, accumulate=1, autocast=None, **settings):
    """The plain PyTorch loop with the monitor's two lines; returns what reached the callable sink."""
    rows: dict[int, dict[str, float]] = {}
    monitor = Monitor(
        model, optimizer=optimizer, log=lambda m, s: rows.setdefault(s, {}).update(m),
        accumulate_grad_batches=accumulate, **{**SETTINGS, **settings},
    )  # fmt: skip
    for i, batch in enumerate(batches):
        step, accumulating = i // accumulate, (i + 1) % accumulate != 0
        with monitor.step(step, accumulating=accumulating):
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = loss_fn(model, batch)
            (loss / accumulate).backward()
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
    monitor.stop()
    return rows, monitor


def test_lightning_and_plain_loop_log_the_same_numbers(tmp_path):
    torch.manual_seed(0)
    module = TinyLM(lr=0.1)
    recorder = Recorder()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=2, logger=recorder, callbacks=[CurvatureMonitor(**SETTINGS)],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(module, loader())
    lightning = numbers(recorder.rows)

    torch.manual_seed(0)
    module = TinyLM(lr=0.1)
    batches = [idx for (idx,), _ in zip(loader(), range(2), strict=False)]
    rows, monitor = plain_loop(module, module.configure_optimizers(), batches, tiny_lm_loss)
    plain = numbers(rows)

    assert sorted(lightning) == [0, 1]
    # every feature reached the sink: block norms, summaries, the real-loss and edge-of-stability keys
    for key in ("summary/max_hessian", "layer0/attn/hessian/VV/h0", "layer0/attn/sharpness/VV/h0",
                "layer0/ffn/stability/max", "summary/stability/max", "summary/overhead"):  # fmt: skip
        assert P + key in rows[1], key
    assert_same(plain, lightning)  # exactly: the real-loss samples from the backward equal those before it
    assert monitor.book.evaluations == 2 and monitor.state_dict()["evaluations"] == 2


def test_plain_loop_accumulation_matches_one_big_micro_batch():
    """With accumulation the last micro-batch is captured and its gradients multiplied by k: the numbers equal
    those of the same micro-batch trained without accumulation (step 0: the weights have not moved yet)."""
    batches = [idx for (idx,), _ in zip(loader(), range(2), strict=False)]
    torch.manual_seed(0)
    module = TinyLM()
    accumulated, _ = plain_loop(module, module.configure_optimizers(), batches, tiny_lm_loss, accumulate=2)
    torch.manual_seed(0)
    module = TinyLM()
    single, _ = plain_loop(module, module.configure_optimizers(), batches[1:], tiny_lm_loss)
    assert_same(numbers(accumulated), numbers(single), rtol=1e-5)


def test_fabric_litgpt_loop_matches_the_plain_loop(tmp_path):
    """litgpt's pretrain loop shape: fabric.setup, bf16-mixed autocast, no_backward_sync, fabric.backward(loss / k)."""
    litgpt = pytest.importorskip("litgpt")
    from lightning.fabric import Fabric

    config = litgpt.Config.from_name(
        "Llama-3.2-1B", n_layer=1, n_embd=16, n_head=2, n_query_groups=1, intermediate_size=24, block_size=8,
        vocab_size=VOCAB, padded_vocab_size=VOCAB,
    )  # fmt: skip
    data = torch.randint(0, VOCAB, (4, 2, 9), generator=torch.Generator().manual_seed(0))  # 2 steps x 2 micro-batches
    k = 2

    def loss_fn(model, batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    torch.manual_seed(0)
    model = litgpt.GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    rows: dict[int, dict[str, float]] = {}
    monitor = Monitor(model, optimizer=optimizer, log=lambda m, s: rows.setdefault(s, {}).update(m),
                      accumulate_grad_batches=k, **SETTINGS)  # fmt: skip
    step_count = 0
    for iter_num, input_ids in enumerate(data, start=1):
        is_accumulating = iter_num % k != 0
        with monitor.step(step_count, accumulating=is_accumulating):  # the one line litgpt's loop gains
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                logits = model(input_ids[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))
                fabric.backward(loss / k)
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            step_count += 1
    monitor.stop()

    torch.manual_seed(0)
    model = litgpt.GPT(config)
    plain, _ = plain_loop(model, torch.optim.AdamW(model.parameters(), lr=1e-3), list(data), loss_fn,
                          accumulate=k, autocast=torch.bfloat16)  # fmt: skip
    assert sorted(numbers(rows)) == [0, 1]
    assert P + "layer0/attn/sharpness/VV/g0" in rows[0] and P + "summary/stability/max" in rows[1]  # Adam: step 1
    assert_same(numbers(rows), numbers(plain))
    # litgpt checkpoints its `state` dict with fabric.save: the monitor rides along (state_dict/load_state_dict)
    fabric.save(tmp_path / "state.pth", {"monitor": monitor, "step_count": step_count})
    resumed = Monitor(model, optimizer=optimizer, accumulate_grad_batches=k, **SETTINGS)
    fabric.load(tmp_path / "state.pth", {"monitor": resumed})
    assert resumed.book.evaluations == 2 and resumed.state_dict()["last_step"] == monitor.state_dict()["last_step"]


def hf_train(tmp_path, data, labels=None, *, k=1, max_steps=2, callbacks=(), before_train=None, resume=None, **args):  # noqa: E501
    """Train a tiny ``LlamaForCausalLM`` (from a config) with ``transformers.Trainer`` and the callback.

    Returns what reached the callable sink, the micro-batches in the Trainer's order (``(input_ids, labels)``), the
    initial weights and the callback.
    """
    pytest.importorskip("accelerate")  # transformers' Trainer needs it (the hf extra installs it)
    tf = pytest.importorskip("transformers")
    from curvwatch.hf_trainer import CurvatureCallback

    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    labels = data if labels is None else labels
    dataset = [{"input_ids": row, "labels": target} for row, target in zip(data, labels, strict=True)]
    rows: dict[int, dict[str, float]] = {}
    callback = CurvatureCallback(log=lambda m, s: rows.setdefault(s, {}).update(m), **SETTINGS)
    settings = dict(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=max_steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=k, save_strategy="no", logging_strategy="no", learning_rate=1e-3,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, optim="adamw_torch",
        seed=0, data_seed=0, disable_tqdm=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = tf.Trainer(model=model, args=tf.TrainingArguments(**{**settings, **args}), train_dataset=dataset,
                         callbacks=[*callbacks, callback])  # fmt: skip
    order = []  # the micro-batches in the Trainer's order
    original = model.forward

    @functools.wraps(original)  # the Trainer keeps the dataset columns the forward's signature names
    def forward(*args, **kwargs):
        order.append((kwargs["input_ids"].clone(), kwargs.get("labels")))
        return original(*args, **kwargs)

    model.forward = forward
    if before_train is not None:
        before_train(trainer, callback)
    trainer.train(resume_from_checkpoint=resume)
    model.forward = original
    return rows, order, initial, callback, config


def hf_plain_loop(tf_config, initial, order, accumulate=1):
    """The plain loop on the same Llama, weights and micro-batches (the model's own mean loss per micro-batch)."""
    tf = pytest.importorskip("transformers")
    model = tf.LlamaForCausalLM(tf_config)
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss_fn = lambda m, batch: m(input_ids=batch[0], labels=batch[1]).loss  # noqa: E731
    rows, _ = plain_loop(model, optimizer, order, loss_fn, accumulate=accumulate)
    return numbers(rows)


def test_hf_trainer_matches_the_plain_loop(tmp_path):
    data = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    rows, order, initial, _, config = hf_train(tmp_path, data)
    plain = hf_plain_loop(config, initial, order)
    assert sorted(numbers(rows)) == [0, 1]
    assert P + "layer0/attn/sharpness/VV/g0" in rows[0] and P + "summary/stability/max" in rows[1]
    assert_same(numbers(rows), plain)


def test_hf_trainer_accumulation_matches_the_plain_loop(tmp_path):
    """gradient_accumulation_steps=2: the last micro-batch is captured and its gradients scaled to its own mean
    loss, as the plain loop (and Lightning) with accumulate_grad_batches=2. The Trainer divides a Llama's summed
    loss by the tokens of both micro-batches (num_items_in_batch), the plain loop the mean loss by 2: with equal
    token counts the factors are both 2, and the numbers identical."""
    data = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(0))  # 2 steps x 2 micro-batches
    rows, order, initial, _, config = hf_train(tmp_path, data, k=2)
    assert len(order) == 4
    plain = hf_plain_loop(config, initial, order, accumulate=2)
    assert sorted(numbers(rows)) == [0, 1]
    assert P + "layer0/attn/sharpness/VV/g0" in rows[0] and P + "summary/stability/max" in rows[1]
    assert_same(numbers(rows), plain)
    # the captured micro-batch is the last of the step: against the first, the step-0 numbers differ
    first = hf_plain_loop(config, initial, order[:1])
    assert numbers(rows)[0][P + "summary/max_hessian"] != pytest.approx(first[0][P + "summary/max_hessian"])


def test_hf_trainer_accumulation_with_padding_counts_tokens(tmp_path):
    """With labels masked (-100) in the captured micro-batch the Trainer's num_items_in_batch is not k times its
    tokens: the factor num_items / its tokens gives the curvature of its own mean loss (step 0, same weights)."""
    data = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    labels = data.clone()
    labels[2:, 5:] = -100  # the second micro-batch (the captured one) has 8 of 14 targets
    rows, order, initial, _, config = hf_train(tmp_path, data, labels, k=2, max_steps=1)
    assert int(order[1][1][:, 1:].ne(-100).sum()) == 8 and int(order[0][1][:, 1:].ne(-100).sum()) == 14
    plain = hf_plain_loop(config, initial, order, accumulate=2)
    assert sorted(numbers(rows)) == [0]
    # the factors differ in rounding (the sum over 8 targets / 22 * 22/8 against their mean): 1e-5, except the
    # sample spreads, differences of close numbers (measured: 2.7e-4 at most); the factor k = 2 would be 27% off
    spread = lambda rows: {s: {k: v for k, v in r.items() if "spread" in k} for s, r in rows.items()}  # noqa: E731
    rest = lambda rows: {s: {k: v for k, v in r.items() if "spread" not in k} for s, r in rows.items()}  # noqa: E731
    assert_same(rest(numbers(rows)), rest(plain), rtol=1e-5)
    assert_same(spread(numbers(rows)), spread(plain), rtol=1e-3)


def test_hf_trainer_loss_outside_the_model_is_warned(tmp_path):
    """Label smoothing computes the loss outside the model (its labels popped): the token count is unknown; one
    warning says what the numbers are then."""
    data = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    with pytest.warns(CurvatureNotice, match=r"no labels \(label smoothing.*share of the accumulated loss"):
        rows, *_ = hf_train(tmp_path, data, k=2, max_steps=1, label_smoothing_factor=0.1)
    assert sorted(numbers(rows)) == [0]


def test_hf_trainer_fp16_loss_scale_is_divided_out(tmp_path):
    """fp16 on a GPU: accelerate's GradScaler multiplies the loss; the callback reads it from the optimizer
    (AcceleratedOptimizer.scaler, the accelerator's) and divides it out. On CPU accelerate makes no scaler, so a
    real torch.amp.GradScaler('cpu') stands in, put where accelerate puts it (the scaled backward and the unscaled
    optimizer step are accelerate's own code)."""
    scale = 2.0**12
    seen = []

    def stand_in(trainer, _):  # accelerate's prepare() hands the accelerator's scaler to the AcceleratedOptimizer
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=10**6)

    class Spy(pytest.importorskip("transformers").TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
            seen.append((optimizer.scaler.get_scale(), max(float(p.grad.abs().max()) for p in model.parameters())))

    data = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    rows, order, initial, _, config = hf_train(tmp_path, data, callbacks=[Spy()], before_train=stand_in)
    plain = hf_plain_loop(config, initial, order)
    assert [s for s, _ in seen] == [scale, scale] and min(g for _, g in seen) > 100  # the gradients were scaled
    assert sorted(numbers(rows)) == [0, 1]
    assert_same(numbers(rows), plain)  # exactly: the scale is a power of two


def test_hf_fp16_scale_it_cannot_see_is_warned(tmp_path):
    """fp16 with no GradScaler on the optimizer (DeepSpeed scales inside its engine): one clear warning."""
    from types import SimpleNamespace

    tf = pytest.importorskip("transformers")
    from curvwatch.hf_trainer import CurvatureCallback

    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16,
    ))  # fmt: skip
    callback = CurvatureCallback(log=lambda m, s: None, **SETTINGS)
    args = SimpleNamespace(fp16=True, deepspeed="ds_config.json", world_size=1, average_tokens_across_devices=True,
                           report_to=[])  # fmt: skip
    state = SimpleNamespace(global_step=0, stateful_callbacks={})
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.warns(CurvatureNotice, match=r"loss scale is not visible.*bf16=True"):
        callback.on_train_begin(args, state, None, model=model, optimizer=optimizer)
    callback.on_train_end(args, state, None)
    args.deepspeed = None  # fp16 on CPU: accelerate scales nothing, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CurvatureCallback(log=lambda m, s: None, **SETTINGS).on_train_begin(
            args, state, None, model=model, optimizer=optimizer
        )


def test_hf_trainer_checkpoint_restores_the_monitor_state(tmp_path):
    """The monitor's state rides in the checkpoint's trainer_state.json (stateful_callbacks) and comes back on
    resume_from_checkpoint in a new Trainer with a new callback: counters, schedule, rule windows."""
    import json

    data = torch.randint(0, VOCAB, (6, 8), generator=torch.Generator().manual_seed(0))
    _, _, _, first, _ = hf_train(tmp_path, data, max_steps=2, save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "checkpoint-2"
    saved = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"]["CurvatureCallback"]
    saved = saved["attributes"]["monitor_state"]
    assert saved["evaluations"] == 2 and saved["last_step"] == 1 and saved["rules"]["points"]
    clockless = lambda state: {k: v for k, v in state.items() if "seconds" not in k}  # noqa: E731 (wall-clock)
    assert clockless(saved) == clockless(json.loads(json.dumps(first.monitor.state_dict())))

    restored = []

    class Spy(pytest.importorskip("transformers").TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # after every on_train_begin
            if not restored:
                restored.append(json.loads(json.dumps(self.callback.monitor.state_dict())))

    spy = Spy()
    rows, _, _, callback, _ = hf_train(tmp_path, data, max_steps=3, callbacks=[spy], resume=str(checkpoint),
                                       before_train=lambda _, callback: setattr(spy, "callback", callback))  # fmt: skip
    assert restored[0]["evaluations"] == 2 and restored[0]["rules"] == saved["rules"]
    assert clockless(restored[0]) == clockless(saved)
    assert restored[0]["train_seconds"] >= saved["train_seconds"]  # the restored clock runs on from the saved
    assert sorted(numbers(rows)) == [2] and callback.monitor.book.evaluations == 3
    assert rows[2][P + "summary/evaluations"] == 3.0
    # restore_callback_states_from_checkpoint=True: transformers swaps in CurvatureCallback() built from the JSON
    # (default settings, no log=: it says it has nowhere to log too); the stand-in warns and still restores the state
    with pytest.warns(CurvatureNotice) as seen:
        hf_train(tmp_path, data, max_steps=3, resume=str(checkpoint), restore_callback_states_from_checkpoint=True,
                 before_train=lambda trainer, _: restored.append(trainer))  # fmt: skip
    assert any("rebuilt by transformers" in str(w.message) and "Leave that argument False" in str(w.message)
               for w in seen)  # fmt: skip
    rebuilt = [c for c in restored[-1].callback_handler.callbacks if type(c).__name__ == "CurvatureCallback"]
    assert len(rebuilt) == 1 and rebuilt[0].monitor.book.evaluations == 2  # restored; step 2 not due by default


def test_monitor_logs_to_a_lightning_logger_and_checkpoints():
    torch.manual_seed(0)
    module = TinyLM()
    recorder = Recorder()
    monitor = Monitor(module, log=[recorder], **{**SETTINGS, "sharpness": False})
    idx = next(iter(loader()))[0]
    with monitor.step(0):
        tiny_lm_loss(module, idx).backward()
    assert P + "summary/max_hessian" in recorder.rows[0]
    state = monitor.state_dict()
    again = Monitor(module, **{**SETTINGS, "sharpness": False})
    again.load_state_dict(state)
    assert again.book.evaluations == 1 and again.schedule.last_step == 0


def test_a_reused_monitor_after_reset_starts_afresh():
    """Issue 26's per-fit reset, in the Trainer-free monitor: after ``reset()`` a second run's steps 0 and 2 are
    evaluated again with counters from 1 (without it, step 0 is below the last run's step 2: nothing is due)."""
    torch.manual_seed(0)
    module = TinyLM()
    recorder = Recorder()
    monitor = Monitor(module, log=[recorder], **{**SETTINGS, "every_n_train_steps": 2, "sharpness": False})
    idx = next(iter(loader()))[0]

    def run() -> dict[int, float]:
        recorder.calls.clear()
        for step in range(3):
            with monitor.step(step):
                tiny_lm_loss(module, idx).backward()
        return {s: r[P + "summary/evaluations"] for s, r in recorder.rows.items() if P + "summary/evaluations" in r}

    assert run() == {0: 1.0, 2: 2.0}
    assert run() == {}  # the same record goes on: steps 0-2 are behind it
    monitor.reset()
    assert run() == {0: 1.0, 2: 2.0} and monitor.book.evaluations == 2


def test_plain_loop_log_level_decides_what_reaches_the_sink():
    """i25d's log_level in the Trainer-free monitor: at "summary" no per-block key reaches the sink, the per-layer
    block norms and headline summaries do; at "all" the per-block, per-head keys do too."""
    logged = {}
    for level in ("summary", "all"):
        torch.manual_seed(0)
        module = TinyLM(lr=0.1)
        batches = [idx for (idx,), _ in zip(loader(), range(1), strict=False)]
        rows, monitor = plain_loop(module, module.configure_optimizers(), batches, tiny_lm_loss, log_level=level)
        assert monitor.log_level.value == level
        logged[level] = set(rows[0])
    assert P + "summary/max_hessian" in logged["summary"] and "curv_hessian/layer0/attn" in logged["summary"]
    assert not any(k.startswith(P + "layer0/") for k in logged["summary"]), sorted(logged["summary"])
    assert P + "layer0/attn/hessian/VV/h0" in logged["all"] and logged["summary"] < logged["all"]
    with pytest.raises(ValueError, match=r"Invalid log_level='heads'"):
        Monitor(log_level="heads")


def test_monitor_step_without_model_and_bad_log_say_how_to_fix():
    with pytest.raises(ValueError, match=r"Invalid log=3\. Must be a W&B run"):
        Monitor(log=3)
    with pytest.raises(RuntimeError, match=r"pass it to Monitor\(model, \.\.\.\) or call attach\(model\)"):
        with Monitor().step(0):
            pass
    with pytest.raises(ValueError, match="Invalid accumulate_grad_batches=0"):
        Monitor(accumulate_grad_batches=0)


def test_verify_in_a_plain_loop_needs_the_loss_and_says_so():
    from curvwatch.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    module = TinyLM()
    module.model = GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, d_model=8, d_ff=16,
                                 attention="math"))  # double backward: no fused attention  # fmt: skip
    idx = next(iter(loader()))[0]
    settings = {**SETTINGS, "sharpness": Sharpness(verify_every_n_evals=1)}
    rows: dict[int, dict[str, float]] = {}
    monitor = Monitor(module, log=lambda m, s: rows.setdefault(s, {}).update(m), **settings)
    with pytest.warns(CurvatureNotice, match=r"call monitor\.before_backward\(loss\)"):
        with monitor.step(0):
            tiny_lm_loss(module, idx).backward()
    assert P + "layer0/attn/sharpness/VV/h0" in rows[0] and not any("verify/" in k for k in rows[0])
    with monitor.step(1):  # handing the loss over gives the check
        loss = tiny_lm_loss(module, idx)
        monitor.before_backward(loss)
        loss.backward()
    assert any("/verify/ratio/VV" in k for k in rows[1])


def test_verify_under_sharded_training_is_off_and_says_so():
    """With a reader of sharded weights (FSDP2's) the true-Hessian check cannot differentiate by the parameters: one
    notice, no verify/... keys, the real-loss keys as usual."""
    from curvwatch import sharding

    torch.manual_seed(0)
    module = TinyLM()
    settings = {**SETTINGS, "sharpness": Sharpness(verify_every_n_evals=1)}
    rows: dict[int, dict[str, float]] = {}
    monitor = Monitor(log=lambda m, s: rows.setdefault(s, {}).update(m), **settings)
    monitor.attach(module, read_params=sharding.full_params)  # plain tensors here: read as they are
    with pytest.warns(CurvatureNotice, match="verify_every_n_evals is not supported under sharded training"):
        with monitor.step(0):
            loss = tiny_lm_loss(module, next(iter(loader()))[0])
            monitor.before_backward(loss)
            loss.backward()
    assert P + "layer0/attn/sharpness/VV/h0" in rows[0] and not any("verify/" in k for k in rows[0])


@pytest.fixture
def wandb_run(tmp_path, monkeypatch):
    """An offline W&B run in ``tmp_path``, finished afterwards."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run = wandb.init(project="curvwatch-test", dir=str(tmp_path), mode="offline")
    try:
        yield run
    finally:
        wandb.finish()


def test_monitor_logs_to_a_wandb_run(wandb_run):
    run = wandb_run
    torch.manual_seed(0)
    module = TinyLM()
    monitor = Monitor(module, log=run, **{**SETTINGS, "sharpness": False, "log_heatmap": True})
    with monitor.step(0):
        tiny_lm_loss(module, next(iter(loader()))[0]).backward()
    # reached the run, with the run-summary rule the monitor defined (the max over steps)
    assert math.isfinite(dict(run.summary[P + "summary/max_hessian"])["max"])
    assert run.config["curvwatch/blocks"][0]["part"] == "attn"  # the set-up table too


def test_setup_table_says_stability_starts_after_step_0_under_adam(wandb_run):
    """The set-up table that reaches the W&B run config has a ``sharpness`` row; under AdamW it says that
    ``stability/max`` starts at the optimizer's first step, and indeed step 0 logs none and step 1 does."""
    from curvwatch.report import coverage_text

    run = wandb_run
    torch.manual_seed(0)
    module = TinyLM()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    rows: dict[int, dict[str, float]] = {}
    log = [run, lambda m, s: rows.setdefault(s, {}).update(m)]
    monitor = Monitor(module, optimizer=optimizer, log=log, **{**SETTINGS, "sharpness": Sharpness(samples=2)})
    for step in range(2):
        with monitor.step(step):
            tiny_lm_loss(module, next(iter(loader()))[0]).backward()
        optimizer.step()
        optimizer.zero_grad()
    (row,) = [r for r in run.config["curvwatch/blocks"] if r["part"] == "sharpness"]
    assert row["status"].startswith("on: logits from 'model.head'") and "none at step 0" in row["status"]
    assert "stability/max under Adam/AdamW from the optimizer's first step on" in row["status"]
    assert "none at step 0" in coverage_text(monitor.coverage)
    assert P + "summary/stability/max" not in rows[0] and P + "summary/stability/max" in rows[1]
    assert P + "layer0/ffn/stability/max" not in rows[0] and P + "layer0/ffn/stability/max" in rows[1]


def test_hf_trainer_accumulation_is_scaled_and_not_noticed(tmp_path):
    """gradient_accumulation_steps=2: the Trainer's first micro-batch is captured and scaled by 2, so the two backward
    passes of a step are no manual micro-batches: the real-loss keys are there and no notice says otherwise."""
    pytest.importorskip("accelerate")
    tf = pytest.importorskip("transformers")
    from curvwatch.hf_trainer import CurvatureCallback

    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    data = torch.randint(0, VOCAB, (8, 8), generator=torch.Generator().manual_seed(0))
    rows: dict[int, dict[str, float]] = {}
    callback = CurvatureCallback(log=lambda m, s: rows.setdefault(s, {}).update(m), **SETTINGS)
    args = tf.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    torch.manual_seed(0)
    dataset = [{"input_ids": row, "labels": row} for row in data]
    trainer = tf.Trainer(model=tf.LlamaForCausalLM(config), args=args, train_dataset=dataset, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("error", CurvatureNotice)
        trainer.train()
    assert sorted(rows) == [0, 1] and all(any("/sharpness/" in k for k in r) for r in rows.values())


def test_a_monitor_with_nowhere_to_log_says_so_once_naming_the_class_built(tmp_path):
    """``Monitor(..., log=None)`` (e.g. ``log=wandb.run`` before ``wandb.init``), a Trainer without a logger and the
    Hugging Face callback with ``report_to="none"`` compute and log nowhere: each says so once, at the start, naming
    the class the user built and how to give it a destination."""
    torch.manual_seed(0)
    model = TinyLM()
    idx = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    monitor = Monitor(model, log=None, every_n_train_steps=1, sharpness=False, warning_rules=Warnings(warn=False))
    with pytest.warns(CurvatureNotice) as seen:
        for step in range(2):
            with monitor.step(step):
                tiny_lm_loss(model, idx).backward()
    messages = [str(w.message) for w in seen if "nowhere" in str(w.message)]
    assert len(messages) == 1 and messages[0].startswith("Monitor has nowhere to write its numbers: log=None; pass")
    assert "CurvatureMonitor" not in messages[0] and "summary/max_hessian" in monitor.latest

    callback = CurvatureMonitor(every_n_train_steps=1, sharpness=False)
    trainer = L.Trainer(max_steps=1, logger=False, callbacks=[callback], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.warns(CurvatureNotice, match=r"^CurvatureMonitor has nowhere .*the Trainer has no logger"):
        trainer.fit(TinyLM(), loader(n=4))

    tf = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from curvwatch.hf_trainer import CurvatureCallback

    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                            num_attention_heads=2, max_position_embeddings=16, attn_implementation="eager")  # fmt: skip
    data = [{"input_ids": row, "labels": row} for row in torch.randint(0, VOCAB, (2, 8))]
    args = tf.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_steps=1,
                                per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True)  # fmt: skip
    hf = tf.Trainer(model=tf.LlamaForCausalLM(config), args=args, train_dataset=data,
                    callbacks=[CurvatureCallback(every_n_train_steps=1, sharpness=False)])  # fmt: skip
    with pytest.warns(CurvatureNotice, match=r"^CurvatureCallback has nowhere .*report_to='wandb'"):
        hf.train()
    with pytest.raises(TypeError, match=r"^CurvatureCallback\(\) got an unexpected keyword argument 'max_tokens'"):
        CurvatureCallback(max_tokens=64)


def test_required_sharpness_fails_at_the_first_evaluation_whose_logits_module_gave_no_logits():
    """``Sharpness(enabled=True)`` is required: a logits module that is never called (a wrong name) fails the first
    full evaluation with the fix; ``"auto"`` says so once and logs the other keys."""

    class TwoHeads(TinyLM):
        def __init__(self):
            super().__init__()
            self.aux_head = torch.nn.Linear(8, VOCAB)  # never called

    idx = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    for enabled in (True, "auto"):
        torch.manual_seed(0)
        model = TwoHeads()
        monitor = Monitor(model, log=lambda m, s: None, every_n_train_steps=1, warning_rules=Warnings(warn=False),
                          sharpness=Sharpness(enabled=enabled, logits_module="aux_head"))  # fmt: skip
        if enabled is True:
            with pytest.raises(ValueError, match=r"^sharpness=True: Monitor has no real-loss keys .* 'aux_head' "
                                                 r"produced no output with gradient tracking"):  # fmt: skip
                with monitor.step(0):
                    tiny_lm_loss(model, idx).backward()
        else:
            with pytest.warns(CurvatureNotice, match=r"'aux_head' produced no output with gradient tracking"):
                with monitor.step(0):
                    tiny_lm_loss(model, idx).backward()
            assert "summary/max_hessian" in monitor.latest


def test_hooks_note_says_how_often_a_users_backward_hooks_run():
    """A full backward hook of the user's on a module between the logits and the blocks (the final LayerNorm) runs once
    per sampled pass on every full evaluation (4 extra with Sharpness(samples=4)): the set-up table says so."""
    torch.manual_seed(0)
    model = TinyLM()
    calls = []
    model.model.ln_f.register_full_backward_hook(lambda *a: calls.append(1))
    idx = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    monitor = Monitor(model, log=lambda m, s: None, every_n_train_steps=1, warning_rules=Warnings(warn=False),
                      sharpness=Sharpness(samples=4))  # fmt: skip
    assert "once per sample (Sharpness.samples passes)" in monitor.real_loss.hooks_note
    with monitor.step(0):
        tiny_lm_loss(model, idx).backward()
    assert len(calls) == 1 + 4  # the training's backward and the 4 sampled passes
