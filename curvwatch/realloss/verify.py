"""The opt-in check of the real-loss sharpness against the true block Hessian, by Hessian-vector products.

:func:`true_sharpness` runs Lanczos on the live graph's Hessian restricted to one weight block (everything
downstream of the block included), for the monitor's ``verify_every_n_evals``; ``verify/ratio/XX`` then says how
far the closed-form view (:mod:`curvwatch.realloss`) is from the truth on the user's own model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from curvwatch.realloss.stability import param_positions

__all__ = ["VERIFIED", "true_sharpness"]

#: Diagonal pair -> (weight read by the adapter, whether the key is per head): what :func:`true_sharpness` checks.
VERIFIED = {
    "attention": (("QQ", "W_Q", True), ("KK", "W_K", True), ("VV", "W_V", True)),
    "ffn": (("W1W1", "W_1", False), ("W2W2", "W_2", False)),
    "gated_ffn": (("W1W1", "W_gate", False), ("W3W3", "W_up", False), ("W2W2", "W_down", False)),
}


def _head_columns(spec: Any, weight: str, index: Tensor) -> Tensor:
    """The positions of head (or kv group) 0's columns of a ``(d, heads d_K)`` weight."""
    params = spec.adapter.read_params(spec)
    heads = (
        int(params.get("n_heads", 1)) if weight == "W_Q" else int(params.get("n_kv_heads", params.get("n_heads", 1)))
    )
    return index[:, : index.shape[1] // max(heads, 1)]


def true_sharpness(
    loss: Tensor,
    maps: Mapping[str, tuple[Any, Mapping[str, tuple[list[Tensor], Tensor]]]],
    factor: float = 1.0,
    max_iter: int = 30,
    tol: float = 1e-3,
) -> dict[str, dict[str, float]]:
    """The true block Hessian's largest eigenvalue, by Hessian-vector products of the live graph (double backward).

    For each block and diagonal pair of :data:`VERIFIED` (attention: head 0 and kv group 0), Lanczos on
    ``v -> d/dtheta <grad_theta loss, v>`` over the pair's elements of the module parameters (mapped by
    :func:`curvwatch.realloss.stability.param_index_map`): everything downstream included, the full batch. Expensive (a
    backward with ``create_graph`` and up to ``max_iter`` double-backward products per pair): the monitor's opt-in
    ``verify_every_n_evals``.

    Args:
        loss: The loss before its backward (graph alive).
        maps: ``{block: (spec, param_index_map(spec))}``.
        factor: Multiplies the Hessian (undoes Lightning's accumulation and AMP factors of ``loss``).
        max_iter, tol: Lanczos steps and relative residual.

    Returns:
        ``{block: {"verify/hessian/XX[/h0]": value}}`` (the suffix is added by the caller to match the block's keys).

    Raises:
        RuntimeError: If the graph has no double backward (fused attention kernels, e.g. SDPA's flash backend).
    """
    from curvwatch.closed_form.solver.lanczos import lanczos_max_abs, start_vectors

    # (frozen parameters have no gradient to differentiate: their blocks are skipped, as blocks without one are)
    params = list(dict.fromkeys(p for _, m in maps.values() for ps, _ in m.values() for p in ps if p.requires_grad))
    grads = torch.autograd.grad(loss, params, create_graph=True, retain_graph=True, allow_unused=True)
    grad_of = dict(zip((id(p) for p in params), grads, strict=True))
    out: dict[str, dict[str, float]] = {}
    for block, (spec, weights) in maps.items():
        for pair, weight, per_head in VERIFIED.get(spec.kind, ()):
            if weight not in weights:
                continue
            ps, index = weights[weight]
            index = _head_columns(spec, weight, index) if per_head else index
            parts = [(p, el.to(p.device), pos.to(p.device)) for p, el, pos in param_positions(ps, index)]
            if any(grad_of.get(id(p)) is None for p, _, _ in parts):
                continue
            n = index.numel()

            def matvec(u: Tensor, parts=parts, n=n) -> Tensor:
                v = u.reshape(-1)  # (n,), the weight's elements in index order
                dot = sum((grad_of[id(p)].reshape(-1)[pos] * v[el].to(p.dtype)).sum() for p, el, pos in parts)
                hv = torch.autograd.grad(dot, [p for p, _, _ in parts], retain_graph=True, allow_unused=True)
                Hv = torch.zeros(n, dtype=u.dtype, device=u.device)
                for h, (_, el, pos) in zip(hv, parts, strict=True):
                    if h is not None:
                        Hv[el] = h.reshape(-1)[pos].to(u.dtype)
                return Hv.reshape(u.shape) * factor

            device = parts[0][0].device
            dtype = torch.float64 if parts[0][0].dtype == torch.float64 else torch.float32
            value, _ = lanczos_max_abs(matvec, start_vectors((1,), n, dtype, device), tol=tol,
                                       max_iter=min(max_iter, n), algebraic=True)  # fmt: skip
            out.setdefault(block, {})[f"verify/hessian/{pair}"] = float(value.reshape(-1)[0])
    return out
