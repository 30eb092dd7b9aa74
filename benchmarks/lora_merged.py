"""LoRA against merged weights: every key of one monitored step of an adapted model and of its merged copy.

The forward of a model with low-rank adapters is the forward of the merged model (``W + s B A``), so every curvature
key must be the same on both. The script trains a tiny model with adapters for a few steps, then logs one monitored
step of the adapted model and one of the merged copy on the same batch, with the same seeds (float64 closed forms,
Lanczos to 1e-9), and prints how many keys differ by more than 1e-3 relative and the largest difference::

    python -m benchmarks.lora_merged                       # Hugging Face Llama, peft LoRA on q_proj, v_proj
    python -m benchmarks.lora_merged --targets all-linear  # every projection
    python -m benchmarks.lora_merged --model gpt2          # GPT-2's Conv1D projections (peft fan_in_fan_out)
    python -m benchmarks.lora_merged --model litgpt        # litgpt's LoRA GPT (fused qkv, LLaMA MLP)
    python -m benchmarks.lora_merged --dora                # DoRA

The stability ratios (``stability/...``) and the summaries are left out of the comparison: the ratios depend on the
optimizer, which steps the adapters in one model and the merged weights in the other; so are the adapters' own keys
(``.../lora/<name>``: the curvature in their parameters, which the merged model does not have) and the blocks' largest
Lanczos residual (``lanczos/rel_residual_max``, over the adapters' runs too). With ``--frozen-input`` the
embeddings stay frozen, as peft leaves them: the first layer's input norm then gets no gradient in the adapted model
and is left out there (a key only the merged model has). Models are built from configs (nothing is downloaded).
Needs ``peft`` (Hugging Face models) or ``litgpt``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from curvwatch import Cadence, Evaluation, Monitor, Warnings

VOCAB = 37


@dataclass
class Adapted:
    """A model with adapters, how to merge a copy of it, and its loss on a batch of token ids ``(B, L)``."""

    model: torch.nn.Module
    merge: Callable[[torch.nn.Module], torch.nn.Module]
    loss: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def _hf_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _lit_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def hf_adapted(
    name: str, targets: str = "qv", *, dora: bool = False, hidden: int = 64, seed: int = 0, **lora: Any
) -> Adapted:
    """A 2-layer Hugging Face causal LM (``"llama"`` or ``"gpt2"``, 4 heads) with peft LoRA (r=4, alpha 8) on the
    query/value projections (``targets="qv"``; GPT-2: its fused ``c_attn``) or every projection (``"all-linear"``)."""
    import peft
    import transformers as tf

    torch.manual_seed(seed)
    if name == "llama":
        config = tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, attention_dropout=0.0,
            use_cache=False,
        )  # fmt: skip
        modules: Any = ["q_proj", "v_proj"] if targets == "qv" else "all-linear"
        base: torch.nn.Module = tf.LlamaForCausalLM(config)
    else:
        config = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=hidden, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        modules = ["c_attn"] if targets == "qv" else ["c_attn", "c_proj", "c_fc"]
        base = tf.GPT2LMHeadModel(config)
    config._attn_implementation = "eager"
    settings = dict(r=4, lora_alpha=8, target_modules=modules, lora_dropout=0.0, use_dora=dora)
    model = with_peft(base, peft.LoraConfig(**{**settings, "fan_in_fan_out": name == "gpt2", **lora}))
    return Adapted(model, lambda m: copy.deepcopy(m).merge_and_unload(), _hf_loss)


def with_peft(base: torch.nn.Module, config: Any) -> torch.nn.Module:
    """``peft.get_peft_model(base, config)`` without its notes (``fan_in_fan_out`` for ``Conv1D``, transformers'
    deprecations)."""
    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(base, config)


def litgpt_adapted(targets: str = "qv", *, hidden: int = 64, seed: int = 0) -> Adapted:
    """A 2-layer litgpt LoRA GPT (LLaMA layout, 4 heads, r=4, alpha 8) with LoRA on the fused ``qkv``'s query and
    value parts (``targets="qv"``) or on every projection (``"all-linear"``)."""
    from litgpt import lora

    torch.manual_seed(seed)
    every = targets != "qv"
    config = lora.Config.from_name(
        "Llama-2-7b-hf", n_layer=2, n_embd=hidden, n_head=4, intermediate_size=2 * hidden, block_size=64,
        vocab_size=VOCAB, padded_vocab_size=VOCAB, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True,
        lora_key=every, lora_projection=every, lora_mlp=every,
    )  # fmt: skip
    model = lora.GPT(config)
    lora.mark_only_lora_as_trainable(model)

    def merge(m: torch.nn.Module) -> torch.nn.Module:
        out = copy.deepcopy(m)
        lora.merge_lora_weights(out)
        return out

    return Adapted(model, merge, _lit_loss)


def train(adapted: Adapted, batches: list[torch.Tensor], lr: float = 2e-2) -> torch.optim.Optimizer:
    """AdamW steps on the trainable parameters (the adapters) over ``batches``; returns the optimizer."""
    optimizer = torch.optim.AdamW([p for p in adapted.model.parameters() if p.requires_grad], lr=lr)
    for ids in batches:
        adapted.loss(adapted.model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def step_keys(
    model: torch.nn.Module, loss: Callable, ids: torch.Tensor, optimizer: torch.optim.Optimizer, **settings: Any
) -> tuple[dict[str, float], Monitor]:
    """Every key of one monitored step (float64 closed forms, tight Lanczos, seeded), and the monitor."""
    rows: dict[str, float] = {}
    defaults = dict(
        every_n_train_steps=1, cadence=Cadence(max_overhead=None, terms_every_n_train_steps=None), log_heatmap=False,
        log_level="all", warning_rules=Warnings(warn=False),
        evaluation=Evaluation(dtype="float64", tol=1e-9, max_iter=300, max_basis=None),
    )  # fmt: skip
    monitor = Monitor(model, optimizer=optimizer, log=lambda m, s: rows.update(m), **{**defaults, **settings})
    torch.manual_seed(1234)
    with monitor.step(0):
        loss(model, ids).backward()
    monitor.stop()
    optimizer.zero_grad()
    return {k: v for k, v in rows.items() if not k.endswith(("eval_time_s", "overhead"))}, monitor


def is_curvature_key(key: str) -> bool:
    """A block's key that depends on the model's function only (not the stability ratios, summaries, timings, nor the
    curvature in the adapters' parameters and the Lanczos residuals it adds)."""
    skip = ("/summary/", "stability/", "/lora/", "lanczos/rel_residual_max")
    return not any(s in key for s in skip) and not key.startswith("curv/summary")


def relative_differences(adapted: dict[str, float], merged: dict[str, float]) -> dict[str, float]:
    """``|a - m| / |m|`` of each curvature key both have (0 where both are NaN)."""
    out = {}
    for k in sorted(set(adapted) & set(merged)):
        if not is_curvature_key(k):
            continue
        a, m = adapted[k], merged[k]
        out[k] = 0.0 if math.isnan(a) and math.isnan(m) else abs(a - m) / max(abs(m), 1e-12)
    return out


def compare(adapted: Adapted, steps: int = 10, batch: int = 4, length: int = 12, frozen_input: bool = False,
            seed: int = 0, **settings: Any) -> dict[str, Any]:  # fmt: skip
    """Train ``steps`` AdamW steps, then the keys of one monitored step of the model and of its merged copy."""
    model = adapted.model.double()
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, VOCAB, (batch, length), generator=g) for _ in range(steps + 1)]
    optimizer = train(adapted, batches[:-1])
    merged = adapted.merge(model)
    for p in merged.parameters():  # the merged model's own gradients (its optimizer is not compared)
        p.requires_grad_(True)
    if not frozen_input:  # every block gets a gradient, as in the merged model
        next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).weight.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keys, monitor = step_keys(model, adapted.loss, batches[-1], optimizer, **settings)
        plain, _ = step_keys(merged, adapted.loss, batches[-1], torch.optim.AdamW(merged.parameters()), **settings)
    rel = relative_differences(keys, plain)
    curvature = [k for k in plain if is_curvature_key(k)]
    return {
        "curvature_keys": len(curvature),
        "only_merged": sorted(k for k in curvature if k not in keys),
        "only_adapted": sorted(k for k in keys if is_curvature_key(k) and k not in plain),
        "differ_1e-3": sum(r > 1e-3 for r in rel.values()),
        "max_rel": max(rel.values(), default=0.0),
        "worst": [(k, keys[k], plain[k]) for k in sorted(rel, key=rel.__getitem__, reverse=True)[:3]],
        "coverage": monitor.coverage,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("llama", "gpt2", "litgpt"), default="llama")
    p.add_argument("--targets", choices=("qv", "all-linear"), default="qv")
    p.add_argument("--dora", action="store_true")
    p.add_argument("--frozen-input", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.model == "litgpt":
        adapted = litgpt_adapted(args.targets, seed=args.seed)
    else:
        adapted = hf_adapted(args.model, args.targets, dora=args.dora, seed=args.seed)
    out = compare(adapted, steps=args.steps, frozen_input=args.frozen_input, seed=args.seed)
    case = f"{args.model} {args.targets}{' dora' if args.dora else ''}"
    coverage = [f"{r['layer']} {r['part']}: {r['status']}" for r in out.pop("coverage") if r["layer"] in ("0", "-")]
    print(json.dumps({"case": case, **out, "coverage (layer 0)": coverage}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
