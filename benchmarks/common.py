"""Shared benchmark helpers: device choice, interleaved timing, memory, JSON output and markdown tables."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def select_device(name: str | None) -> torch.device:
    """``"cuda"`` or ``"cpu"``; ``None`` picks CUDA when available. CUDA without a GPU is an error."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise ValueError(f"Invalid device={name!r}. Must be 'cpu' or 'cuda'.")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("Invalid device='cuda': torch.cuda.is_available() is False. Pass --device cpu.")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so a wall-clock reading covers them (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    device: torch.device,
    *,
    repeats: int = 15,
    min_repeats: int = 3,
    warmup: int = 1,
    min_time_s: float = 0.02,
    budget_s: float = float("inf"),
) -> dict[str, dict[str, Any]]:
    """Time several functions side by side: warm-up, then round-robin repeats, median of per-repeat times.

    Each repeat runs every function once in turn (the order rotates from repeat to repeat), so slow
    drifts of a shared machine hit all methods alike. A repeat of a fast function runs it ``number``
    times back to back (chosen during warm-up so one repeat lasts at least ``min_time_s``) and records
    the time per call. A function that has spent ``budget_s`` in total stops after ``min_repeats`` repeats.

    Args:
        fns: Name -> zero-argument callable; the return value is discarded.
        device: Synchronised after each repeat.
        repeats: Repeats per function (at most).
        min_repeats: Repeats per function (at least), whatever the budget.
        warmup: Untimed calls per function before calibration.
        min_time_s: Shortest repeat.
        budget_s: Time per function after which it stops once it has ``min_repeats`` repeats.

    Returns:
        Name -> ``{"median_s", "min_s", "iqr_rel", "times_s", "number", "repeats"}``; ``times_s``: per-call
        time of each repeat; ``iqr_rel``: interquartile range over the median.
    """
    number: dict[str, int] = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        once = max(time.perf_counter() - t0, 1e-7)
        number[name] = max(1, min(10_000, math.ceil(min_time_s / once)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    names = list(fns)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if len(times[name]) >= min_repeats and spent[name] >= budget_s:
                continue
            fn, k = fns[name], number[name]
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            synchronize(device)
            elapsed = time.perf_counter() - t0
            spent[name] += elapsed
            times[name].append(elapsed / k)
    return {name: _summary(ts, number[name]) for name, ts in times.items()}


def _summary(ts: list[float], number: int) -> dict[str, Any]:
    med = statistics.median(ts)
    q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else (med, med, med)
    return {
        "median_s": med,
        "min_s": min(ts),
        "iqr_rel": (q3 - q1) / med,  # interquartile range / median: the run's noise for this method
        "times_s": ts,
        "number": number,
        "repeats": len(ts),
    }


def peak_memory_bytes(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Peak CUDA memory allocated during one call, in bytes; ``None`` on CPU (no allocator statistics)."""
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def tensor_bytes(obj: Any) -> int:
    """Bytes held by the tensors in ``obj`` (a tensor, a dataclass of tensors, or a list/tuple/dict of them).

    Stride-0 (expanded) views count as the storage they really use.
    """
    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    return 0


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ``||a - e|| / ||e||``, accumulated in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def _cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``; ``None`` where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def command_line() -> str:
    """The command that is running, as a user would type it: ``python -m benchmarks.<name> <args>``."""
    script = Path(sys.argv[0])
    if script.suffix == ".py" and script.parent.name == "benchmarks":
        head = f"python -m benchmarks.{script.stem}"
    elif script.suffix == ".py" and script.parent.parent.name == "benchmarks":
        head = f"python -m benchmarks.{script.parent.name}.{script.stem}"
    else:
        head = f"python {sys.argv[0]}"
    return " ".join([head, *sys.argv[1:]])


def git_commit() -> str | None:
    """The repository's commit (``+dirty`` when tracked files other than results differ from it); ``None`` outside a
    git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        # result files are data, not code: a rewritten one does not make the measured tree dirty
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=root, capture_output=True, text=True,
                               check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on, with which command, at which commit."""
    env = {
        "command": command_line(),
        "commit": git_commit(),
        "cpu_model": _cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        # the load of the machine when the run began: other jobs on it make absolute times drift
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "timestamp_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        env["cuda_device"] = torch.cuda.get_device_name(device)
    return env


def write_json(name: str, data: dict[str, Any], out: str | os.PathLike | None = None) -> Path:
    """Write ``data`` to ``out`` or ``benchmarks/results/<name>.json``; returns the path."""
    path = Path(out) if out is not None else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    return path


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _proc_status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``), or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def cpu_peak_rss(fn: Callable[[], Any]) -> dict[str, Any]:
    """Peak resident memory of one call of ``fn`` above the RSS before it (CPU, this process).

    Linux: the peak mark is reset through ``/proc/self/clear_refs`` and read back as ``VmHWM``. Elsewhere
    the lifetime ``ru_maxrss`` delta is returned (``peak_reset=False``; it includes earlier peaks). Run it in
    a fresh process after a warm-up call of the same size (:func:`run_memory_child`): memory the allocator
    kept from earlier, larger work would otherwise hide this call's own.
    """
    import resource

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    before = _proc_status_kib("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    after = _proc_status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"bytes": 1024 * (after - before), "rss_before_kib": before, "peak_kib": after, "peak_reset": reset}


def run_memory_child(module: str, args: Sequence[str], timeout_s: float = 1800) -> dict[str, Any]:
    """Run ``python -m module *args`` (a benchmark's hidden memory-child mode) and parse the JSON it prints last."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        return {"status": "failed", "stderr": r.stderr[-500:]}
    return {"status": "measured", **json.loads(r.stdout.strip().splitlines()[-1])}


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode and still alive (CPU or GPU).

    This counts allocations: what a GPU holds. On CPU a large ``torch.empty`` whose pages are never written
    (the Lanczos basis buffer) counts in full although it is not resident.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key, n):
        self.live -= n
        self._seen.discard(key)

    def track(self, t: torch.Tensor, lifetime: Any = None) -> bool:
        """Count the storage of ``t`` as alive, once, until ``lifetime`` is freed (``t`` by default; its storage: for
        as long as any view of it lives). Returns whether it was new."""
        storage = t.untyped_storage()
        key, n = storage.data_ptr(), storage.nbytes()
        if not n or key in self._seen:
            return False
        self._seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(t if lifetime is None else lifetime, self._free, key, n)
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out
