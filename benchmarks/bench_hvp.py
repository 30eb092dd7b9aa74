"""Benchmark 2: per-block attention Hessian spectral norms, curvwatch's closed form vs the autograd HVP route.

Every per-head block norm ``hessian/{VV,QQ,KK}/h{i}`` of one attention layer under the papers' MSE loss
``||F - T||^2 / (L m)`` (curvwatch ``target=`` mode), at the same relative accuracy ``tol``, by

* ``curvwatch``: :func:`curvwatch.closed_form.multi_head_attention` with ``pairs=["VV", "QQ", "KK"]``,
  ``parts=["hessian"]``, ``terms=False`` (the norms the baselines compute, nothing else);
* ``hvp_power``: a lean ``torch.func.jvp(torch.func.grad(loss))`` (forward-over-reverse) HVP on the block's
  weight, power iteration stopped at a relative change of the Rayleigh quotient below ``tol`` (the rule of
  PyHessian and hessian-eigenthings), attention written as models do, ``softmax((X W_Q)(X W_K)^T/sqrt(d_K))``;
* ``hvp_lanczos``: the same HVP driven by curvwatch's own Lanczos with curvwatch's stopping rule (so the
  ratio isolates the cost of one Hessian-vector product);
* ``curvlinops``: ``curvlinops.HessianLinearOperator`` restricted to the block's parameter, built with its
  defaults, and ``scipy.sparse.linalg.eigsh(k=1, which="LM", tol=tol)`` (skipped when not importable).

All methods must agree within ``--agree`` (relative) before their times are reported. A last section shows
what happens to the HVP route when the loss uses fused ``scaled_dot_product_attention``.

Run ``python -m benchmarks.bench_hvp [--quick] [--device cpu|cuda] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import grad, jvp

from benchmarks.common import (
    cpu_peak_rss,
    environment,
    markdown_table,
    peak_memory_bytes,
    run_memory_child,
    select_device,
    time_interleaved,
    write_json,
)
from curvwatch.closed_form import AttentionWeights, OutputLoss, multi_head_attention
from curvwatch.closed_form.settings import Lanczos
from curvwatch.closed_form.solver import lanczos_max_abs, start_vectors

NAME = "bench_hvp"
BLOCKS = ("VV", "QQ", "KK")
METHODS = ("curvwatch", "hvp_power", "hvp_lanczos", "curvlinops", "curvwatch_hessian_only")
LABELS = {
    "curvwatch": "curvwatch multi_head_attention(pairs=[VV,QQ,KK], parts=[hessian], terms=False): the norms only",
    "hvp_power": "torch.func jvp(grad) HVP + power iteration (relative change < tol)",
    "hvp_lanczos": "torch.func jvp(grad) HVP + curvwatch's Lanczos (same stopping rule as curvwatch)",
    "curvlinops": "curvlinops HessianLinearOperator (defaults) + scipy eigsh(k=1, which='LM', tol)",
    "curvwatch_hessian_only": "DIAGNOSTIC: the same public call with all three parts and terms=True "
    "(outer, functional and hessian norms, bound terms and bounds, as the callback logs them)",
}
BASELINES = ("hvp_power", "hvp_lanczos", "curvlinops")
# Published reference (a 2-core CPU): L=512, d=512, d_K=64, Q/K/V norms, warm.
PUBLISHED = {"L": 512, "d": 512, "d_K": 64, "hvp_power_s": 0.33, "curvlinops_s": 2.1}
GOALS = {"hvp_power": 30.0, "curvlinops": 100.0}


@dataclass(frozen=True)
class Size:
    L: int
    d: int
    H: int = 1
    d_K: int = 64
    repeats: int = 3

    @property
    def name(self) -> str:
        return f"L={self.L}, d={self.d}, H={self.H}, d_K={self.d_K}"


FULL = (
    Size(128, 128),
    Size(128, 512),
    Size(512, 128),
    Size(512, 512, repeats=2),
    Size(128, 512, H=8, repeats=2),  # all heads of a d=512 layer, d_K = 64
)
QUICK = (Size(16, 8, d_K=4, repeats=1), Size(12, 8, H=2, d_K=4, repeats=1))


def _curvlinops():
    """``(HessianLinearOperator, eigsh)`` or the reason they cannot be used."""
    try:
        from curvlinops import HessianLinearOperator
        from scipy.sparse.linalg import eigsh
    except Exception as e:  # noqa: BLE001 - any import failure means "skip this baseline"
        return (
            None,
            f"curvlinops not importable ({type(e).__name__}: {e}); pip install curvlinops-for-pytorch",
        )
    return (HessianLinearOperator, eigsh), None


class Problem:
    """One attention layer, its loss and a closure per method that returns ``{key: norm}``."""

    def __init__(self, s: Size, device: torch.device, *, tol: float, max_iter: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        kw = dict(generator=gen, dtype=torch.float32)
        self.s, self.device, self.tol, self.max_iter = s, device, tol, max_iter
        H, d, d_K = s.H, s.d, s.d_K
        self.X = torch.randn(s.L, d, **kw).to(device)  # (L, d)
        self.W = {nm: (torch.randn(d, H * d_K, **kw) / math.sqrt(d)).to(device) for nm in "QKV"}  # (d, H d_K)
        if H == 1:
            self.W_O = torch.eye(d_K, device=device)  # F = A V: the papers' single head
        else:
            self.W_O = (torch.randn(H * d_K, d, **kw) / math.sqrt(H * d_K)).to(device)  # (H d_V, d)
        self.m = self.W_O.shape[1]
        self.T = torch.randn(s.L, self.m, **kw).to(device)  # (L, m)
        self.keys = [f"hessian/{b}/h{h}" for b in BLOCKS for h in range(H)]
        self.hvp_counts: dict[str, int] = {}
        self.diagnostic = True

    # -- the layer as a model computes it, and the papers' loss --
    def forward(self, W_Q: torch.Tensor, W_K: torch.Tensor, W_V: torch.Tensor, sdpa: bool = False) -> torch.Tensor:
        s = self.s
        P = (self.X @ W_Q).reshape(s.L, s.H, s.d_K).transpose(0, 1)  # (H, L, d_K)
        K = (self.X @ W_K).reshape(s.L, s.H, s.d_K).transpose(0, 1)
        V = (self.X @ W_V).reshape(s.L, s.H, s.d_K).transpose(0, 1)
        if sdpa:  # (B, H, L, d_K) layout of nn.MultiheadAttention / nanoGPT
            Fh = F.scaled_dot_product_attention(P[None], K[None], V[None])[0]
        else:
            Fh = torch.softmax(P @ K.mT / math.sqrt(s.d_K), dim=-1) @ V  # (H, L, d_V)
        return Fh.transpose(0, 1).reshape(s.L, s.H * s.d_K) @ self.W_O  # (L, m)

    def loss(self, W_Q, W_K, W_V, sdpa: bool = False) -> torch.Tensor:
        return ((self.forward(W_Q, W_K, W_V, sdpa) - self.T) ** 2).sum() / (self.s.L * self.m)

    def block_loss(self, block: str, h: int, sdpa: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """Loss as a function of head ``h``'s ``(d, d_K)`` slice of ``W_Q``, ``W_K`` or ``W_V``."""
        nm, d_K = block[0], self.s.d_K
        full = self.W[nm]

        def f(w: torch.Tensor) -> torch.Tensor:
            W = torch.cat([full[:, : h * d_K], w, full[:, (h + 1) * d_K :]], dim=1) if self.s.H > 1 else w
            args = {**self.W, nm: W}
            return self.loss(args["Q"], args["K"], args["V"], sdpa)

        return f

    def _w0(self, block: str, h: int) -> torch.Tensor:
        d_K = self.s.d_K
        return self.W[block[0]][:, h * d_K : (h + 1) * d_K].contiguous()

    def _start(self, n: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        v = torch.randn(n, generator=g, dtype=torch.float64).to(dtype=torch.float32, device=self.device)
        return v / v.norm()

    # -- methods --
    def curvwatch(self, parts=("hessian",), terms=False) -> dict[str, float]:
        W = self.W
        out = multi_head_attention(
            self.X,
            AttentionWeights(W["Q"], W["K"], W["V"], self.W_O, n_heads=self.s.H),
            loss=OutputLoss(target=self.T),
            pairs=list(BLOCKS),
            parts=parts,
            lanczos=Lanczos(tol=self.tol, max_iter=self.max_iter, max_basis=None, warn=False),
            terms=terms,
        )
        return {k: float(out[k]) for k in self.keys}

    def curvwatch_hessian_only(self) -> dict[str, float]:
        """DIAGNOSTIC (name kept for the JSON schema): what the callback computes per block, i.e. outer,
        functional and hessian norms plus the bound terms and corrected bounds, in one call."""
        return self.curvwatch(parts=("outer", "functional", "hessian"), terms=True)

    def _hvps(self) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]:
        res = []
        for b in BLOCKS:
            for h in range(self.s.H):
                g = grad(self.block_loss(b, h))
                w0 = self._w0(b, h)
                res.append((f"hessian/{b}/h{h}", lambda v, g=g, w0=w0: jvp(g, (w0,), (v.reshape(w0.shape),))[1], w0))
        return res

    def hvp_power(self) -> dict[str, float]:
        out, count = {}, 0
        for i, (key, hvp, w0) in enumerate(self._hvps()):
            v, lam_old, lam = self._start(w0.numel(), i), None, 0.0
            for _ in range(self.max_iter):
                Hv = hvp(v).reshape(-1)
                count += 1
                lam = float(Hv @ v)
                v = Hv / Hv.norm()
                if lam_old is not None and abs(lam - lam_old) <= self.tol * (abs(lam_old) + 1e-6):
                    break
                lam_old = lam
            out[key] = abs(lam)
        self.hvp_counts["hvp_power"] = count
        return out

    def hvp_lanczos(self) -> dict[str, float]:
        out, count = {}, 0
        for i, (key, hvp, w0) in enumerate(self._hvps()):
            n = w0.numel()
            calls = [0]

            def mv(v: torch.Tensor, hvp=hvp, calls=calls, n=n) -> torch.Tensor:  # (1, n) -> (1, n)
                calls[0] += 1
                return hvp(v[0]).reshape(1, n)

            start = start_vectors((1,), n, w0.dtype, self.device, seed=i)
            val, _ = lanczos_max_abs(mv, start, tol=self.tol, max_iter=self.max_iter)
            out[key] = float(val[0])
            count += calls[0]
        self.hvp_counts["hvp_lanczos"] = count
        return out

    def curvlinops(self) -> dict[str, float]:
        (HessianLinearOperator, eigsh), _ = _curvlinops()
        model = _AttentionModel(self)
        data = [(self.X[None], self.T[None])]  # one sequence: N = 1, 'mean' = ||F - T||^2 / (L m)
        out = {}
        for b in BLOCKS:
            param = getattr(model, f"W_{b[0]}")
            op = HessianLinearOperator(model, torch.nn.MSELoss(), [param], data)
            vals = eigsh(op.to_scipy(), k=1, which="LM", tol=self.tol, return_eigenvectors=False)
            out[f"hessian/{b}/h0"] = float(abs(vals[0]))
        return out

    def methods(self) -> tuple[dict[str, Callable[[], dict[str, float]]], dict[str, str]]:
        fns = {"curvwatch": self.curvwatch, "hvp_power": self.hvp_power, "hvp_lanczos": self.hvp_lanczos}
        if self.diagnostic:
            fns["curvwatch_hessian_only"] = self.curvwatch_hessian_only
        skipped = {}
        _, why = _curvlinops()
        if why is not None:
            skipped["curvlinops"] = why
        elif self.s.H > 1:
            skipped["curvlinops"] = (
                "per-head blocks are column slices of one nn.Parameter; curvlinops restricts to whole parameters"
            )
        else:
            fns["curvlinops"] = self.curvlinops
        return fns, skipped


class _AttentionModel(torch.nn.Module):
    """Single-head attention as an ``nn.Module`` for curvlinops: ``(1, L, d) -> (1, L, d_V)``."""

    def __init__(self, p: Problem):
        super().__init__()
        self.p = p
        for nm in "QKV":
            setattr(self, f"W_{nm}", torch.nn.Parameter(p.W[nm].clone()))

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        s = self.p.s
        P, K, V = X @ self.W_Q, X @ self.W_K, X @ self.W_V  # (1, L, d_K)
        return torch.softmax(P @ K.mT / math.sqrt(s.d_K), dim=-1) @ V


# ---------------------------------------------------------------------------------------------------------
# fused SDPA


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"


def sdpa_check(device: torch.device, L: int = 128, d: int = 64, d_K: int = 64, tol: float = 1e-3) -> dict[str, Any]:
    """Try the HVP route with fused ``scaled_dot_product_attention`` in the loss; curvwatch on captures."""
    p = Problem(Size(L, d, d_K=d_K), device, tol=tol, max_iter=200)
    f = p.block_loss("QQ", 0, sdpa=True)
    w0 = p._w0("QQ", 0)
    v = torch.randn_like(w0)
    res: dict[str, Any] = {"size": {"L": L, "d": d, "d_K": d_K}, "layout": "(B, H, L, d_K) = (1, 1, L, d_K)"}
    with torch.enable_grad():
        P = (p.X @ w0).requires_grad_()
        K, V = p.X @ p.W["K"], p.X @ p.W["V"]
        node = F.scaled_dot_product_attention(P[None, None], K[None, None], V[None, None]).grad_fn
        res["sdpa_backward_node"] = type(node).__name__

    def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
        try:
            fn()
            return {"ok": True}
        except Exception as e:  # noqa: BLE001 - the exception text is the result
            return {"ok": False, "exception": _first_line(e)}

    res["forward_over_reverse"] = attempt(lambda: jvp(grad(f), (w0,), (v,)))

    def double_backward():
        w = w0.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(w), w, create_graph=True)
        torch.autograd.grad(g, w, v)

    res["double_backward"] = attempt(double_backward)
    api, why = _curvlinops()
    if api is None:
        res["curvlinops"] = {"ok": None, "note": why}
    else:
        HessianLinearOperator, _ = api

        class SDPAModel(_AttentionModel):
            def forward(self, X):
                P, K, V = X @ self.W_Q, X @ self.W_K, X @ self.W_V
                return F.scaled_dot_product_attention(P[:, None], K[:, None], V[:, None])[:, 0]

        model = SDPAModel(p)

        def cl():
            op = HessianLinearOperator(model, torch.nn.MSELoss(), [model.W_Q], [(p.X[None], p.T[None])])
            op @ torch.randn(w0.numel(), device=device)

        res["curvlinops"] = attempt(cl)

    # curvwatch: the model runs fused SDPA; curvwatch only needs the captured input X (and the target)
    captured = {}
    with torch.no_grad():
        model = _AttentionModel(p)
        X = p.X[None]
        captured["X"] = X[0].detach().clone()
        P, K, V = X @ model.W_Q, X @ model.W_K, X @ model.W_V
        F.scaled_dot_product_attention(P[:, None], K[:, None], V[:, None])
    try:
        out = multi_head_attention(
            captured["X"],
            AttentionWeights(p.W["Q"], p.W["K"], p.W["V"], p.W_O, n_heads=1),
            loss=OutputLoss(target=p.T),
            pairs=["QQ"],
            lanczos=Lanczos(tol=tol, max_iter=200, max_basis=None, warn=False),
        )
        ref = p.hvp_lanczos()  # the same loss written with an explicit softmax
        rel = abs(float(out["hessian/QQ/h0"]) - ref["hessian/QQ/h0"]) / ref["hessian/QQ/h0"]
        res["curvwatch"] = {
            "ok": True,
            "hessian/QQ/h0": float(out["hessian/QQ/h0"]),
            "rel_diff_vs_softmax_hvp": rel,
        }
    except Exception as e:  # noqa: BLE001
        res["curvwatch"] = {"ok": False, "exception": _first_line(e)}
    return res


# ---------------------------------------------------------------------------------------------------------
# memory: max RSS delta of one call, in a fresh subprocess per method


def _memory_child(method: str, s: Size, tol: float, max_iter: int) -> None:
    device = torch.device("cpu")
    torch.set_num_threads(1)
    warm = Problem(Size(8, 8, H=s.H, d_K=4), device, tol=tol, max_iter=max_iter)
    getattr(warm, method)()  # load kernels / libraries at a tiny size
    p = Problem(s, device, tol=tol, max_iter=max_iter)
    getattr(p, method)()  # warm at the full size too (allocator pools, library workspaces), as the timings are
    print(json.dumps(cpu_peak_rss(getattr(p, method))))


def rss_delta_bytes(method: str, s: Size, tol: float, max_iter: int) -> dict[str, Any]:
    args = ["--_memory-child", method, "--_size", json.dumps(asdict(s)), "--tol", str(tol), "--max-iter", str(max_iter)]
    return run_memory_child("benchmarks.bench_hvp", args)


# ---------------------------------------------------------------------------------------------------------


def bench_size(s: Size, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    p = Problem(s, device, tol=args.tol, max_iter=args.max_iter, seed=args.seed)
    p.diagnostic = args.diagnostic
    fns, skipped = p.methods()
    # verification call (also the warm-up): every method's norms against curvwatch's
    norms = {k: fn() for k, fn in fns.items()}
    ref = norms["curvwatch"]
    rel = {
        k: max(abs(v[key] - ref[key]) / max(abs(ref[key]), 1e-30) for key in p.keys)
        for k, v in norms.items()
        if k != "curvwatch"
    }
    agrees = {k: r <= args.agree for k, r in rel.items()}
    # curvwatch must agree with an independent exact-stopping baseline; a baseline that does not reach the
    # accuracy is still timed but flagged (its stopping rule, not curvwatch, is at fault)
    agree = any(agrees.get(k, False) for k in ("hvp_lanczos", "curvlinops"))
    row: dict[str, Any] = {
        "size": s.name,
        **asdict(s),
        "n_block": s.d * s.d_K,
        "norms": norms,
        "max_rel_diff": rel,
        "agree": agree,
        "agrees": agrees,
        "hvp_counts_per_call": dict(p.hvp_counts),
        "skipped": skipped,
    }
    if not agree:
        row["status"] = "norms disagree: times not reported"
        return row
    timing = time_interleaved(fns, device, repeats=s.repeats, min_repeats=1, warmup=0, budget_s=args.budget_s)
    row["status"] = "measured"
    row["methods"] = {
        k: {"label": LABELS[k], "median_s": t["median_s"], "times_s": t["times_s"], "repeats": t["repeats"]}
        for k, t in timing.items()
    }
    base = timing["curvwatch"]["median_s"]
    for k in row["methods"]:
        row["methods"][k]["ratio"] = row["methods"][k]["median_s"] / base
    if device.type == "cuda":
        for k, fn in fns.items():
            row["methods"][k]["peak_bytes"] = peak_memory_bytes(fn, device)
    elif args.memory and ((s.L, s.d, s.H, s.d_K) == (512, 512, 1, 64) or args.memory_all):
        for k in fns:
            if k != "curvwatch_hessian_only":
                row["methods"][k]["rss_delta"] = rss_delta_bytes(k, s, args.tol, args.max_iter)
    return row


def _fmt_s(x: float) -> str:
    return f"{x:.3g}"


def _fmt_ratio(r: float) -> str:
    return f"{r:.0f}×" if r >= 10 else f"{r:.2g}×"


def ratio_table(rows: Sequence[dict[str, Any]]) -> str:
    header = [
        "size",
        "curvwatch (s)",
        "hvp_power (s)",
        "ratio",
        "hvp_lanczos (s)",
        "ratio",
        "curvlinops (s)",
        "ratio",
        "max rel diff vs curvwatch",
        "HVPs (power / lanczos)",
        "diagnostic: all three parts (s)",
    ]
    body = []
    for r in rows:
        if r["status"] != "measured":
            body.append([r["size"], r["status"], *["—"] * 9])
            continue
        m = r["methods"]

        def cell(k: str, r: dict[str, Any] = r, m: dict[str, Any] = m) -> list[str]:
            if k not in m:
                return ["skipped", "—"]
            flag = "" if r["agrees"].get(k, True) else f" ✗ (off by {r['max_rel_diff'][k]:.1e})"
            return [_fmt_s(m[k]["median_s"]) + flag, _fmt_ratio(m[k]["ratio"])]

        c = r["hvp_counts_per_call"]
        diag = m.get("curvwatch_hessian_only")
        body.append(
            [
                r["size"],
                _fmt_s(m["curvwatch"]["median_s"]),
                *cell("hvp_power"),
                *cell("hvp_lanczos"),
                *cell("curvlinops"),
                ", ".join(f"{k} {v:.0e}" for k, v in r["max_rel_diff"].items() if k in BASELINES),
                f"{c.get('hvp_power', '—')} / {c.get('hvp_lanczos', '—')}",
                "—" if diag is None else f"{_fmt_s(diag['median_s'])} ({_fmt_ratio(diag['ratio'])} of curvwatch)",
            ]
        )
    return markdown_table(header, body)


def memory_table(rows: Sequence[dict[str, Any]]) -> str | None:
    body = []
    for r in rows:
        for k, m in r.get("methods", {}).items():
            if "rss_delta" in m and m["rss_delta"]["status"] == "measured":
                body.append([r["size"], k, f"{m['rss_delta']['bytes'] / 2**20:.0f}"])
            elif "peak_bytes" in m and m["peak_bytes"] is not None:
                body.append([r["size"], k, f"{m['peak_bytes'] / 2**20:.0f}"])
    if not body:
        return None
    return markdown_table(["size", "method", "peak memory above setup (MiB)"], body)


def published_table(rows: Sequence[dict[str, Any]]) -> str | None:
    ref = [r for r in rows if r["status"] == "measured" and (r["L"], r["d"], r["H"], r["d_K"]) == (512, 512, 1, 64)]
    if not ref:
        return None
    m = ref[0]["methods"]
    body = []
    for k, pub in (("hvp_power", PUBLISHED["hvp_power_s"]), ("curvlinops", PUBLISHED["curvlinops_s"])):
        if k not in m:
            body.append([k, f"{pub} s", "skipped", "—", f"{GOALS[k]:.0f}×", "—"])
            continue
        ratio = m[k]["ratio"]
        body.append(
            [
                k,
                f"{pub} s",
                f"{m[k]['median_s']:.3g} s",
                _fmt_ratio(ratio),
                f"{GOALS[k]:.0f}×",
                "yes" if ratio >= GOALS[k] else "NO",
            ]
        )
    return markdown_table(
        ["baseline", "published time", "our time (this run)", "ratio vs curvwatch", "goal", "met"], body
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_hvp", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{NAME}.json)")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared, oversubscribed CPU, OpenMP barriers of 2 "
        "threads "
        "slow small kernels by 10-50x and drown the comparison)",
    )
    ap.add_argument("--tol", type=float, default=1e-3, help="relative accuracy of every method (default 1e-3)")
    ap.add_argument("--max-iter", type=int, default=100, help="most matvecs per norm, every method (default 100)")
    ap.add_argument("--agree", type=float, default=1e-2, help="largest relative disagreement allowed (1e-2)")
    ap.add_argument("--budget-s", type=float, default=60.0, help="time per method per size after min repeats")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the RSS subprocesses")
    ap.add_argument("--memory-all", action="store_true", help="RSS at every size (default: L=d=512 only)")
    ap.add_argument(
        "--no-diagnostic",
        dest="diagnostic",
        action="store_false",
        help="skip the private-API 'hessian kind only' timing of curvwatch's operator",
    )
    ap.add_argument("--no-sdpa", dest="sdpa", action="store_false", help="skip the fused-SDPA check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_size", dest="size", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"Invalid --threads={args.threads}. Must be >= 1.")
    if not 0 < args.tol < 1:
        ap.error(f"Invalid --tol={args.tol}. Must be in (0, 1).")
    if args.max_iter < 2:
        ap.error(f"Invalid --max-iter={args.max_iter}. Must be >= 2.")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, write the JSON, print the tables; returns the JSON data."""
    args = parse_args(argv)
    if args.memory_child is not None:
        _memory_child(args.memory_child, Size(**json.loads(args.size)), args.tol, args.max_iter)
        return {}
    device = select_device(args.device)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        sizes = QUICK if args.quick else FULL
        if args.quick:
            args.memory = args.memory and args.memory_all
        t0 = time.perf_counter()
        rows = [bench_size(s, device, args) for s in sizes]
        sdpa = sdpa_check(device, *((16, 8, 4) if args.quick else (128, 64, 64)), tol=args.tol) if args.sdpa else None
        _, why = _curvlinops()
        data = {
            "name": NAME,
            "config": {
                "quick": args.quick,
                "device": str(device),
                "threads": args.threads,
                "dtype": "float32",
                "tol": args.tol,
                "max_iter": args.max_iter,
                "agree": args.agree,
                "seed": args.seed,
                "sizes": [asdict(s) for s in sizes],
                "wall_s": time.perf_counter() - t0,
                "loss": "||F - T||^2 / (L m), T ~ N(0, 1); X ~ N(0, 1); W ~ N(0, 1/d); W_O = I for H = 1",
                "timing": "one verification call per method (warm-up), then round-robin repeats (rotating "
                "order), median per-call time",
                "ratio": "baseline median time / curvwatch median time (> 1: curvwatch faster)",
                "memory": "CUDA: max_memory_allocated above the start; CPU: peak RSS of one call above "
                "the RSS before it, in a fresh subprocess per method after a tiny and a full-size warm-up "
                "call (peak mark reset through /proc/self/clear_refs and read as VmHWM; without it, the "
                "ru_maxrss delta)",
            },
            "environment": environment(device),
            "curvlinops": "available" if why is None else why,
            "methods": LABELS,
            "published": {
                "source": "reference numbers quoted in the task (CPU, warm)",
                **PUBLISHED,
                "goals": GOALS,
            },
            "results": rows,
            "sdpa": sdpa,
        }
        path = write_json(NAME, data, args.out)
        print(
            f"## Per-block attention Hessian norms, {device}, float32, {args.threads} threads, "
            f"tol={args.tol} "
            f"({path})\n"
        )
        print(ratio_table(rows))
        for title, table in (
            ("Peak memory", memory_table(rows)),
            ("Against the published numbers", published_table(rows)),
        ):
            if table is not None:
                print(f"\n## {title}\n\n{table}")
        if sdpa is not None:
            print("\n## Fused SDPA in the loss\n")
            for k in ("forward_over_reverse", "double_backward", "curvlinops", "curvwatch"):
                print(f"- {k}: {sdpa[k]}")
        return data
    finally:
        torch.set_num_threads(threads_before)


if __name__ == "__main__":
    main(sys.argv[1:])
