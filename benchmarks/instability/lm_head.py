"""LM-head signals for the instability suite: the head's exact Hessian, its bounds and cheap head statistics.

Does anything at the LM head lead the output-logit divergence (``logit_div``), which no monitored block sees?
For a linear head ``Z = X W^T`` (``X`` the ``(N, d)`` final hidden states of the ``N = B L`` tokens, ``W`` the
``(V, d)`` head weight) and the mean cross-entropy, the Hessian with respect to ``W`` is exactly its Gauss-Newton
matrix (the head is linear, the loss convex in the logits)::

    H = (1/N) sum_t A_t (x) x_t x_t^T,    A_t = diag(p_t) - p_t p_t^T,    H vec(E) = (1/N) sum_t (A_t E x_t) x_t^T

so one product costs two ``(N, V, d)`` matmuls and needs nothing but the forward's ``X`` and logits.
:func:`head_statistics` turns those into named numbers (Lanczos ``lambda_max(H)``, the Adam-preconditioned
``lambda_max(P^{-1/2} H P^{-1/2})`` and its edge-of-stability ratio, bounds, norms, log-partition, saturation);
:class:`LMHeadRecorder` records them at every training step (a forward hook on the head, the AdamW state of
``W``) next to the timing of each part. The script re-trains suite runs with the recorder and without the
monitor (training does not depend on it; the losses match the stored suite traces), then scores every signal
with the suite's own generic detector and onset::

    python -m benchmarks.instability.lm_head train [--only logit_div ...] [--seeds 0 1 2] [--variants control ...]
    python -m benchmarks.instability.lm_head score

Traces go to ``benchmarks/results/instability_lm_head/runs/`` (the suite's file names), scores to
``.../results.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from benchmarks.common import RESULTS_DIR, markdown_table

DEFAULT_OUT = RESULTS_DIR / "instability_lm_head"
PREFIX = "head/"
ITERS = 8  # Lanczos iterations per step, warm-started from the previous step's top eigenvector

#: Architecture -> its LM head (a bias-free ``nn.Linear`` from the final hidden states to the logits).
HEADS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "gpt": lambda model: model.head,
    "torch": lambda model: model.head,
    "llama": lambda model: model.lm_head,
}


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


def head_hvp(X: Tensor, P: Tensor, E: Tensor) -> Tensor:
    """``H vec(E)`` of the mean cross-entropy of ``X W^T`` with respect to ``W``, reshaped like ``W``.

    Args:
        X: ``(N, d)`` head inputs.
        P: ``(N, V)`` softmax of the logits.
        E: ``(V, d)`` direction.

    Returns:
        ``(V, d)``: ``(1/N) sum_t (diag(p_t) - p_t p_t^T) (E x_t) x_t^T``.
    """
    U = X @ E.T  # (N, V): E x_t
    U = P * (U - (P * U).sum(-1, keepdim=True))  # (N, V): A_t E x_t
    return U.T @ X / X.shape[0]  # (V, d)


def lanczos_top(matvec: Callable[[Tensor], Tensor], start: Tensor, iters: int) -> tuple[float, Tensor, float]:
    """Largest eigenvalue of a symmetric operator by ``iters`` Lanczos steps (full re-orthogonalisation).

    Args:
        matvec: ``v -> A v`` on tensors shaped like ``start``.
        start: Starting vector (any shape; need not be normalised).
        iters: Lanczos steps (products with ``A``).

    Returns:
        ``(theta, u, residual)``: the top Ritz value, its Ritz vector (shaped like ``start``, unit norm) and the
        relative residual bound ``||A u - theta u|| / |theta|`` (zero once the Krylov space is invariant).
    """
    shape = start.shape
    q = start.reshape(-1) / start.norm()
    Q = [q]
    alphas: list[float] = []
    betas: list[float] = []
    beta = 0.0
    for _ in range(iters):
        w = matvec(Q[-1].reshape(shape)).reshape(-1)
        alphas.append(float(w @ Q[-1]))
        basis = torch.stack(Q)  # (j, n)
        for _ in range(2):  # twice is enough (Parlett's "twice is enough")
            w = w - basis.T @ (basis @ w)
        beta = float(w.norm())
        if beta <= 1e-12 * max(abs(a) for a in alphas) or len(alphas) == iters:
            break
        betas.append(beta)
        Q.append(w / beta)
    k = len(alphas)
    T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if k > 1:
        off = torch.tensor(betas[: k - 1], dtype=torch.float64)
        T = T + torch.diag(off, 1) + torch.diag(off, -1)
    evals, evecs = torch.linalg.eigh(T)
    theta, y = float(evals[-1]), evecs[:, -1]
    u = (torch.stack(Q[:k]).T.double() @ y).to(start.dtype)
    residual = abs(beta * float(y[-1])) / max(abs(theta), 1e-300)
    return theta, (u / u.norm()).reshape(shape), residual


def head_statistics(
    X: Tensor,
    logits: Tensor,
    W: Tensor,
    precondition: Tensor | None = None,
    lr: float | None = None,
    beta1: float | None = None,
    iters: int = ITERS,
    starts: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, float], dict[str, Tensor], dict[str, float]]:
    """The LM-head quantities of one forward.

    Args:
        X: ``(N, d)`` head inputs (final hidden states of the ``N`` tokens).
        logits: ``(N, V)`` head outputs ``X W^T``.
        W: ``(V, d)`` head weight.
        precondition: ``(V, d)`` Adam's ``P = sqrt(v_hat) + eps`` for ``W`` (``None``: no preconditioned
            numbers).
        lr: The head's learning rate (for the edge-of-stability ratio).
        beta1: Adam's ``beta_1``.
        iters: Lanczos steps per eigenvalue.
        starts: Warm starts ``{"sharpness", "adam"}`` (``(V, d)``; random where missing).

    Returns:
        ``(values, vectors, seconds)``: ``values`` the named numbers below, ``vectors`` the top eigenvectors
        (warm starts of the next call), ``seconds`` the wall time of each group (``stats``, ``sharpness``,
        ``adam``).

        * ``sharpness``: ``lambda_max(H)``; ``sharpness_residual``: its Lanczos relative residual bound;
        * ``sharpness_bound``: ``||X||_2^2 / N * max_t min(1 - ||p_t||^2, 2 max_i p_ti (1 - p_ti))`` (``A_t`` is
          PSD with that trace and Gershgorin bound, so ``H <= max_t lambda_max(A_t) I (x) X^T X / N``);
        * ``x_spec``: ``||X||_2^2 / N``; ``x_fro``: ``||X||_F^2 / N``; ``x_rms_max``, ``x_rms_mean``: max over
          tokens of ``||x_t|| / sqrt(d)`` and the RMS over all entries;
        * ``w_norm``: ``||W||_2``; ``logit_bound``: ``max_t ||x_t|| ||W||_2`` (bounds every logit);
        * ``lse_mean``, ``lse_max``, ``lse_sq_mean``: mean and max of ``log Z_t = logsumexp(z_t)``, mean of its
          square (the z-loss);
        * ``pmax_mean``: mean over tokens of the largest probability; ``entropy_min``, ``entropy_mean``: of the
          output distributions, in nats;
        * ``adam_sharpness``: ``lambda_max(P^{-1/2} H P^{-1/2})`` (``adam_sharpness_residual``: as above);
          ``adam_ratio``: ``lr * adam_sharpness /
          ((2 + 2 beta_1) / (1 - beta_1))`` (1 at the edge of stability;
          ``curvwatch.realloss.stability.stability_rule``).
    """
    starts = starts or {}
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    dtype = torch.promote_types(X.dtype, torch.float32)  # float32 in training, float64 in the tests
    X, logits, W = X.detach().to(dtype), logits.detach().to(dtype), W.detach().to(dtype)
    N, d = X.shape
    P = torch.softmax(logits, -1)  # (N, V)
    logp = torch.log_softmax(logits, -1)
    lse = torch.logsumexp(logits, -1)  # (N,)
    row_sq = X.square().sum(-1)  # (N,): ||x_t||^2
    x_spec = float(torch.linalg.eigvalsh(X.T @ X)[-1]) / N
    a_max = torch.minimum(1 - P.square().sum(-1), 2 * (P * (1 - P)).amax(-1))  # (N,) >= lambda_max(A_t)
    w_norm = float(torch.linalg.matrix_norm(W, 2))
    values = {
        "sharpness_bound": x_spec * float(a_max.amax()),
        "x_spec": x_spec,
        "x_fro": float(row_sq.mean()),
        "x_rms_max": math.sqrt(float(row_sq.amax()) / d),
        "x_rms_mean": math.sqrt(float(row_sq.mean()) / d),
        "w_norm": w_norm,
        "logit_bound": math.sqrt(float(row_sq.amax())) * w_norm,
        "lse_mean": float(lse.mean()),
        "lse_max": float(lse.amax()),
        "lse_sq_mean": float(lse.square().mean()),
        "pmax_mean": float(P.amax(-1).mean()),
        "entropy_min": float((-(P * logp).sum(-1)).amin()),
        "entropy_mean": float((-(P * logp).sum(-1)).mean()),
    }
    seconds["stats"] = time.perf_counter() - t0

    def start(name: str) -> Tensor:
        given = starts.get(name)
        if given is not None and given.shape == W.shape and bool(torch.isfinite(given).all()):
            return given
        return torch.randn(W.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)

    vectors: dict[str, Tensor] = {}
    t0 = time.perf_counter()
    theta, vectors["sharpness"], residual = lanczos_top(lambda E: head_hvp(X, P, E), start("sharpness"), iters)
    values["sharpness"], values["sharpness_residual"] = theta, residual
    seconds["sharpness"] = time.perf_counter() - t0
    if precondition is not None:
        t0 = time.perf_counter()
        D = precondition.detach().to(dtype).rsqrt()  # (V, d): P^{-1/2}
        theta, vectors["adam"], residual = lanczos_top(lambda E: D * head_hvp(X, P, D * E), start("adam"), iters)
        values["adam_sharpness"], values["adam_sharpness_residual"] = theta, residual
        if lr is not None and beta1 is not None:
            values["adam_ratio"] = lr * theta / ((2 + 2 * beta1) / (1 - beta1))
        seconds["adam"] = time.perf_counter() - t0
    return values, vectors, seconds


def adam_precondition(optimizer: Any, W: Tensor) -> tuple[Tensor, float, float] | None:
    """``(P, lr, beta_1)`` of ``W`` in an Adam/AdamW optimizer, ``P = sqrt(v_hat) + eps``; ``None`` before its
    first step or for another optimizer (the convention of ``curvwatch.realloss.stability.stability_rule``)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    state = opt.state.get(W, {})
    step = float(state.get("step", 0))
    if "exp_avg_sq" not in state or step < 1:
        return None
    group = next(g for g in opt.param_groups if any(p is W for p in g["params"]))
    beta1, beta2 = (float(b) for b in group["betas"])
    v_hat = state["exp_avg_sq"].detach().float() / (1 - beta2**step)
    return v_hat.sqrt() + float(group["eps"]), float(group["lr"]), beta1


# --------------------------------------------------------------------------------------------------
# Recorder
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def capture_head(head: nn.Module) -> Iterator[dict[str, Tensor]]:
    """Forward hook on ``head`` for the ``with`` body: ``{"X": (N, d), "Z": (N, V)}``, detached, of its last call."""
    store: dict[str, Tensor] = {}

    def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
        store["X"] = args[0].detach().reshape(-1, args[0].shape[-1])
        store["Z"] = output.detach().reshape(-1, output.shape[-1])

    handle = head.register_forward_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


class LMHeadRecorder(Callback):
    """Records :func:`head_statistics` of every training step (after the backward, before the optimizer step,
    with the AdamW state the step will update) and the wall time of each part.

    Args:
        arch: Key of :data:`HEADS` (how to find the head of the suite's ``pl_module.model``).
        iters: Lanczos steps per eigenvalue.

    Raises:
        ValueError: For an architecture not in :data:`HEADS`.
    """

    def __init__(self, arch: str, iters: int = ITERS) -> None:
        if arch not in HEADS:
            raise ValueError(f"Invalid arch={arch!r}. Must be one of {sorted(HEADS)}; add its head to HEADS.")
        if iters < 1:
            raise ValueError(f"Invalid iters={iters}. Must be >= 1.")
        self.arch, self.iters = arch, iters
        self.rows: list[dict[str, float]] = []
        self._stack = contextlib.ExitStack()
        self._store: dict[str, Tensor] = {}
        self._starts: dict[str, Tensor] = {}

    def _head(self, pl_module: Any) -> nn.Module:
        return HEADS[self.arch](pl_module.model)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stack.close()
        self._store = self._stack.enter_context(capture_head(self._head(pl_module)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        store, self._store = self._store, {}
        self._stack.close()
        if "X" not in store:
            return
        W = self._head(pl_module).weight
        row: dict[str, float] = {"step": float(trainer.global_step)}
        if not (bool(torch.isfinite(store["X"]).all()) and bool(torch.isfinite(store["Z"]).all())):
            self.rows.append(row)
            return
        adam = adam_precondition(optimizer, W)
        values, self._starts, seconds = head_statistics(
            store["X"],
            store["Z"],
            W,
            precondition=None if adam is None else adam[0],
            lr=None if adam is None else adam[1],
            beta1=None if adam is None else adam[2],
            iters=self.iters,
            starts=self._starts,
        )
        row.update(values)
        row.update({f"time_s/{k}": v for k, v in seconds.items()})
        self.rows.append(row)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._stack.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stack.close()

    def series(self, steps: Sequence[int]) -> dict[str, list[float | None]]:
        """``{"head/<name>": [value per step of steps]}`` (``None`` where not recorded or not finite)."""
        by_step = {int(r["step"]): r for r in self.rows}
        names = sorted({k for r in self.rows for k in r if k != "step"})
        out = {}
        for name in names:
            values = [by_step.get(s, {}).get(name) for s in steps]
            out[PREFIX + name] = [v if v is not None and math.isfinite(v) else None for v in values]
        return out


# --------------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------------


def train(
    out: Path,
    only: Sequence[str] | None,
    variants: Sequence[str] | None,
    seeds: Sequence[int],
    reuse: bool = True,
    iters: int = ITERS,
) -> None:
    """Train the selected suite runs with :class:`LMHeadRecorder` (no monitor) and write their traces."""
    from benchmarks.instability.cases import TRAIN_SEEDS, mechanisms
    from benchmarks.instability.suite import _round, run_path
    from benchmarks.instability.train import run

    for mech in mechanisms():
        if only and mech.name not in only:
            continue
        for variant in mech.variants:
            if variants and variant.name not in variants:
                continue
            for seed in seeds:
                path = run_path(out, mech.name, variant.name, seed)
                if reuse and path.exists():
                    continue
                cfg = replace(variant.config, seed=seed)
                recorder = LMHeadRecorder(cfg.model.arch, iters=iters)
                trace = run(cfg, monitor=False, callbacks=[recorder])
                trace["series"].update(recorder.series(trace["steps"]))
                trace = _round(trace)
                trace["label"] = {
                    "mechanism": mech.name,
                    "variant": variant.name,
                    "role": variant.role,
                    "seed": seed,
                    "split": "train" if seed in TRAIN_SEEDS else "held_out",
                    "diverges": mech.diverges,
                }
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False))
                print(f"[lm_head] {mech.name}/{variant.name} s{seed}: {len(trace['steps'])} steps, "
                      f"{trace['wall_s']:.1f} s", flush=True)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------------

_DOWN = ("entropy_min", "entropy_mean")
_HEAD_SIGNALS = (
    "sharpness", "sharpness_bound", "x_spec", "x_fro", "x_rms_max", "x_rms_mean", "w_norm", "logit_bound",
    "lse_mean", "lse_max", "lse_sq_mean", "pmax_mean", "entropy_min", "entropy_mean", "adam_sharpness", "adam_ratio",
)  # fmt: skip
#: what each signal costs: the timing groups it needs
_COST = {"sharpness": ("stats", "sharpness"), "adam_sharpness": ("stats", "adam"), "adam_ratio": ("stats", "adam")}


def signals() -> dict[str, Any]:
    """The suite's baselines, the stored ``lse`` (mean log-partition) and every LM-head signal."""
    from benchmarks.instability.analysis import SIGNALS, Signal, _series

    out = {name: s for name, s in SIGNALS.items() if s.tier == "baseline"}
    out["lse"] = Signal("lse", "up", "baseline", "mean log-partition of the output (recorded)", _series("lse"))
    for name in _HEAD_SIGNALS:
        direction = "down" if name in _DOWN else "up"
        out[f"head_{name}"] = Signal(f"head_{name}", direction, "head", name, _series(PREFIX + name))
    return out


def costs(traces: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Median over runs of ``median(time of the signal's groups) / median(training step without them)``."""
    per_group: dict[str, list[float]] = {}
    for t in traces:
        s = t["series"]
        groups = [k[len(PREFIX + "time_s/") :] for k in s if k.startswith(PREFIX + "time_s/")]
        spent = [sum(s[PREFIX + "time_s/" + g][i] or 0.0 for g in groups) for i in range(len(t["steps"]))]
        train_s = [total - x for total, x in zip(s["step_time_s"][1:], spent[1:], strict=True) if total is not None]
        step = statistics.median(train_s)
        for g in groups:
            kept = [v for v in s[PREFIX + "time_s/" + g][1:] if v is not None]
            if kept:
                per_group.setdefault(g, []).append(statistics.median(kept) / step)
    group_cost = {g: statistics.median(v) for g, v in per_group.items()}
    return {name: sum(group_cost.get(g, 0.0) for g in _COST.get(name, ("stats",))) for name in _HEAD_SIGNALS}


def score(traces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every signal through the suite's generic detector: theta fitted on the training seeds' stable runs."""
    from benchmarks.instability.analysis import BURN_IN, detector_alarms, excursions, fit_theta
    from benchmarks.instability.evaluate import DETECTORS, _is_control, _key, _per_run_scores, run_summary

    runs = {_key(t): run_summary(t) for t in traces}
    by_key = {_key(t): t for t in traces}
    train_controls = [k for k, r in runs.items() if _is_control(r) and r["split"] == "train"]
    out: dict[str, Any] = {}
    for name, sig in signals().items():
        values = {k: sig.read(t) for k, t in by_key.items()}
        for kind in DETECTORS:
            exc = {k: excursions(v, sig.direction, kind) for k, v in values.items()}
            theta = fit_theta(exc[k] for k in train_controls)
            alarms = {k: detector_alarms(e, theta) for k, e in exc.items()}
            out[f"{name}/{kind}"] = {"theta_decades": theta, **_per_run_scores(alarms, runs)}
    # the edge of stability itself, nothing fitted: the per-step ratio crosses 1 (from BURN_IN on, unsmoothed)
    ratio = {k: signals()["head_adam_ratio"].read(t) for k, t in by_key.items()}
    exc = {k: {s: math.log10(v) for s, v in r.items() if s >= BURN_IN and v > 0} for k, r in ratio.items()}
    alarms = {k: detector_alarms(e, 0.0) for k, e in exc.items()}
    out["head_adam_ratio/eos"] = {"theta_decades": 0.0, **_per_run_scores(alarms, runs)}
    return {"runs": runs, "train_controls": train_controls, "signals": out, "cost_steps": costs(traces)}


def table(results: Mapping[str, Any]) -> str:
    """Signal x (theta, lead per unstable run, false alarms per 1000 steps per split, cost per step)."""
    runs = results["runs"]
    diverged = sorted(
        (k for k, r in runs.items() if r["diverged"]),
        key=lambda k: (runs[k]["mechanism"] != "logit_div", runs[k]["mechanism"], runs[k]["variant"], k),
    )
    header = ["signal", "theta", *diverged, "FA/1000 train", "FA/1000 held-out", "cost / step"]
    rows = []
    cost = results["cost_steps"]
    for key, s in results["signals"].items():
        leads = []
        for k in diverged:
            r = s["per_run"][k]
            leads.append("miss" if r["first_alarm"] is None else f"{r['lead']:+d}")
        name = key.split("/")[0].removeprefix("head_")
        rows.append([
            key, f"{s['theta_decades']:.2f}", *leads, f"{s['false_alarms']['train']['per_1000']:.3g}",
            f"{s['false_alarms']['held_out']['per_1000']:.3g}",
            f"{cost[name]:.3g}" if key.startswith("head_") and name in cost else "-",
        ])  # fmt: skip
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.instability.lm_head", description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("train", "score"))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--only", nargs="+", default=None, help="mechanisms to train")
    p.add_argument("--variants", nargs="+", default=None, help="variants to train (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--retrain", action="store_true", help="train runs whose trace already exists again")
    p.add_argument("--iters", type=int, default=ITERS, help=f"Lanczos steps per eigenvalue [{ITERS}]")
    p.add_argument(
        "--drop",
        nargs="+",
        default=[],
        help="runs left out of the scoring (mechanism/variant/sSEED): a sensitivity check",
    )
    p.add_argument("--results", default="results.json", help="file name of the scores under --out")
    args = p.parse_args(argv)
    if args.command == "train":
        train(args.out, args.only, args.variants, args.seeds, reuse=not args.retrain, iters=args.iters)
        return
    from benchmarks.instability.evaluate import _key

    traces = [json.loads(f.read_text()) for f in sorted((args.out / "runs").glob("*.json"))]
    unknown = set(args.drop) - {_key(t) for t in traces}
    if unknown:
        p.error(f"Invalid --drop {sorted(unknown)}: no such run in {args.out / 'runs'}.")
    traces = [t for t in traces if _key(t) not in args.drop]
    results = {**score(traces), "dropped": args.drop}
    (args.out / args.results).write_text(json.dumps(results, indent=1, allow_nan=False) + "\n")
    print(f"{len(traces)} runs; theta fitted on {len(results['train_controls'])} training-seed stable runs\n")
    print(table(results))


if __name__ == "__main__":
    main()
