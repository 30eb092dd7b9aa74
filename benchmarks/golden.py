"""Golden run: every key of a few monitored steps, recorded to compare two versions of the code bit for bit.

A change that should not move the numbers (a refactor) is checked by recording before it and comparing after::

    python -m benchmarks.golden record /tmp/before.json          # at the old commit
    python -m benchmarks.golden record /tmp/after.json           # at the new one
    python -m benchmarks.golden compare /tmp/before.json /tmp/after.json --rtol 1e-12

Each case trains the demo's models (the GPT with LayerNorm and a GELU MLP; the LLaMA-style litgpt model with rotary
positions, grouped-query attention, RMSNorm and SwiGLU) on n-digit addition with AdamW for four steps, seeded, with
a :class:`curvwatch.Monitor` logging every key (``log_level="all"``) through a callable. The cases cover full
evaluations at every step (real-loss keys on, the in-run check on), terms-only evaluations of every term and of the
warning rules' signals, SGD, and a run without the real-loss keys. Only the public API is used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from typing import Any

import torch

from curvwatch import Cadence, Evaluation, Monitor, Sharpness, Warnings
from curvwatch.data import IGNORE_INDEX, VOCAB_SIZE, AdditionDataModule, sequence_length
from curvwatch.models.gpt import GPT, GPTConfig

STEPS = 4

#: name -> (arch, optimizer, monitor settings, call before_backward)
CASES: dict[str, tuple[str, str, dict[str, Any], bool]] = {
    "gpt_full": ("gpt", "adamw", {"every_n_train_steps": 1}, True),
    "gpt_full_verify": (
        "gpt_math",
        "adamw",
        {"every_n_train_steps": 1, "sharpness": Sharpness(verify_every_n_evals=2)},
        True,
    ),
    "gpt_full_sgd": ("gpt", "sgd", {"every_n_train_steps": 1}, False),
    "gpt_no_sharpness": ("gpt", "adamw", {"every_n_train_steps": 1, "sharpness": False}, False),
    "gpt_terms_all": ("gpt", "adamw", {"every_n_train_steps": 100, "terms_keys": "all"}, False),
    "gpt_terms_warnings": ("gpt", "adamw", {"every_n_train_steps": 100}, False),
    "llama_full": ("llama", "adamw", {"every_n_train_steps": 1}, False),
    "llama_terms_warnings": ("llama", "adamw", {"every_n_train_steps": 100}, False),
}


def _model(arch: str) -> torch.nn.Module:
    block = sequence_length(3)
    if arch in ("gpt", "gpt_math"):  # gpt_math: attention by explicit matmuls (the in-run check's double backward)
        attention = "math" if arch == "gpt_math" else "sdpa"
        return GPT(
            GPTConfig(
                vocab_size=VOCAB_SIZE,
                block_size=block,
                n_layer=2,
                n_head=4,
                d_model=64,
                norm="pre",
                attention=attention,
            )
        )
    from examples.demo import build_model, model_config

    s = {"n_digits": 3, "n_layer": 2, "n_head": 4, "n_query_groups": 2, "d_model": 64, "norm": "pre"}
    return build_model("llama", model_config("llama", s))


def run_case(name: str) -> dict[str, dict[str, float]]:
    """``{step: {key: value}}`` of case ``name``."""
    arch, opt, settings, before_backward = CASES[name]
    settings = dict(settings)
    torch.manual_seed(0)
    model = _model(arch)
    params = model.parameters()
    optimizer = torch.optim.AdamW(params, lr=5e-3) if opt == "adamw" else torch.optim.SGD(params, lr=0.05)
    data = AdditionDataModule(n_digits=3, n_train=256, n_val=8, batch_size=16, seed=0)
    data.setup("fit")
    logged: dict[str, dict[str, float]] = {}

    def log(metrics: dict, step: int) -> None:
        row = logged.setdefault(str(step), {})
        for key, value in metrics.items():
            if isinstance(value, (int, float)) or (torch.is_tensor(value) and value.numel() == 1):
                row[key] = float(value)

    every = settings.pop("every_n_train_steps")
    terms_keys = settings.pop("terms_keys", "warnings")
    monitor = Monitor(
        model,
        optimizer=optimizer,
        log=log,
        cadence=Cadence(every_n_train_steps=every, terms_every_n_train_steps=1, max_overhead=None),
        evaluation=Evaluation(terms_keys=terms_keys),
        warning_rules=Warnings(warn=False),
        log_level="all",
        log_heatmap=False,
        **settings,
    )
    batches = iter(data.train_dataloader())
    for step in range(STEPS):
        torch.manual_seed(1000 + step)  # the real-loss draws
        x, y = next(batches)
        with monitor.step(step):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE_INDEX
            )
            if before_backward:
                monitor.before_backward(loss)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return logged


# keys whose value is a time or a fraction of time: not compared
_TIMED = ("eval_time_s", "overhead")


def record(path: str, cases: list[str]) -> None:
    out = {}
    for name in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = run_case(name)
        n = sum(len(v) for v in out[name].values())
        print(f"{name}: {n} values over {len(out[name])} steps", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=0, sort_keys=True)


def compare(a_path: str, b_path: str, rtol: float) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    bad = 0
    total = equal = 0
    worst = (0.0, "")
    for case in sorted(set(a) | set(b)):
        for step in sorted(set(a.get(case, {})) | set(b.get(case, {}))):
            ra, rb = a.get(case, {}).get(step, {}), b.get(case, {}).get(step, {})
            for key in sorted(set(ra) | set(rb)):
                if any(t in key for t in _TIMED):
                    continue
                if key not in ra or key not in rb:
                    print(f"{case} step {step}: {key} only in {'before' if key in ra else 'after'}")
                    bad += 1
                    continue
                x, y = ra[key], rb[key]
                total += 1
                if x == y or (math.isnan(x) and math.isnan(y)):
                    equal += 1
                    continue
                rel = abs(x - y) / max(abs(x), abs(y), 1e-300)
                if rel > worst[0]:
                    worst = (rel, f"{case} step {step} {key}: {x!r} vs {y!r}")
                if rel > rtol:
                    bad += 1
                    if bad <= 40:
                        print(f"{case} step {step}: {key} {x!r} vs {y!r} (rel {rel:.3g})")
    print(f"{total} values compared: {equal} bit-equal, {bad} differ beyond rtol {rtol:g} or missing; "
          f"largest relative difference {worst[0]:.3g} {worst[1]}")  # fmt: skip
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out")
    r.add_argument("--cases", nargs="*", default=list(CASES))
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--rtol", type=float, default=1e-12)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.cmd == "record":
        record(args.out, args.cases)
        return 0
    return compare(args.before, args.after, args.rtol)


if __name__ == "__main__":
    sys.exit(main())
