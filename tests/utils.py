"""Shared test helpers: the one table of tolerances and comparisons that say where they failed."""

from __future__ import annotations

import inspect
import os

import torch

# Largest relative error seen by assert_close_report, per test module and rtol class ("float64", ...):
# printed at the end of the pytest run (tests/conftest.py) so the accuracy is on record.
WORST: dict[tuple[str, float], float] = {}

# Relative tolerances, in one place. float64 closed form vs torch.func: round-off only.
TOL = {
    "float64": 1e-10,
    # float32 closed form vs float64 closed form (same inputs, cast): accumulated round-off
    "float32": 2e-4,
    # Lanczos run to convergence vs dense eigvalsh, float64
    "lanczos": 1e-6,
    # logged monitor numbers (float64, Lanczos residual 1e-10) vs dense torch.func eigvalsh on the model's own modules
    "end_to_end": 1e-9,
}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ||a - e|| / max(||e||, tiny)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    denom = max(e.norm().item(), 1e-300)
    return (a - e).norm().item() / denom


def assert_close_report(actual, expected, rtol: float, name: str = "", atol: float = 0.0) -> float:
    """Assert ``||actual - expected|| <= rtol * ||expected|| + atol`` and report where it failed.

    Returns the relative error so callers can record the worst one.
    """
    a = torch.as_tensor(actual).detach().to(torch.float64)
    e = torch.as_tensor(expected).detach().to(torch.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    diff = (a - e).abs()
    err = diff.norm().item()
    ref = e.norm().item()
    if not torch.isfinite(a).all():
        raise AssertionError(f"{name}: non-finite values in actual")
    # recorded only where the relative tolerance decides (atol negligible next to it): a (near-)zero reference
    # is checked by atol alone and its relative error means nothing (it read as "worst 4e-06 vs tolerance 1e-06")
    if ref > 0 and rtol * ref >= 1e3 * atol:
        caller = os.path.basename(inspect.stack()[1].filename)
        key = (caller, rtol)
        WORST[key] = max(WORST.get(key, 0.0), err / max(ref, 1e-300))
    if err > rtol * ref + atol:
        idx = int(diff.reshape(-1).argmax())
        pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), a.shape)) if a.ndim else ()
        raise AssertionError(
            f"{name}: relative error {err / max(ref, 1e-300):.3e} > rtol {rtol:.1e} (abs {err:.3e}); "
            f"worst entry at {pos}: actual {a.reshape(-1)[idx].item():.6e} vs expected {e.reshape(-1)[idx].item():.6e}"
        )
    return err / max(ref, 1e-300)


def live_memory(events) -> list[tuple[int, int]]:
    """``[(ns, bytes)]``: the live CPU memory after every allocation and free of a profile made with
    ``profile_memory=True`` (``prof.profiler.kineto_results.events()``), in time order, counted from its start."""
    live, timeline = 0, []
    for e in sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns()):
        live += e.nbytes()
        timeline.append((e.start_ns(), live))
    return timeline
