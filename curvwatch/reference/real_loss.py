"""Ground truth of a block's curvature in the real training loss of a whole model, by ``torch.func``.

For one weight block ``theta`` of a monitored sub-block (``W_Q`` of one head, an FFN's ``W_1``) in a model whose
loss reads logits ``z``, :func:`real_loss_blocks` returns three dense ``(n, n)`` matrices:

* ``hessian``: the true Hessian of the loss in ``theta`` (everything downstream included);
* ``ggn``: the Gauss-Newton block ``J^T H_z J``, ``J = dz/dtheta``, ``H_z`` the loss's Hessian at the logits
  (softmax cross-entropy: ``sum_n w_n (diag p_n - p_n p_n^T)``; squared error: ``2 w I``), what the Monte-Carlo
  samples of :mod:`curvwatch.realloss` estimate;
* ``own``: the block's own functional term ``sum_i g_i d^2 F_i / dtheta^2``, ``g = dl/dF`` at the block output
  ``F`` (the real gradient), which the closed forms compute exactly.

``sharpness`` keys estimate ``lambda_max(ggn + own)``; ``hessian - ggn - own`` is the downstream second-order part
that no closed form reaches. Tiny models only (dense Jacobians of the logits), in float64;
``F.scaled_dot_product_attention`` runs on its math backend here (the fused ones have no forward-mode or double
backward); other fused attention kernels must be switched off by the caller (Hugging Face:
``attn_implementation="eager"``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from curvwatch.adapters import BlockSpec
from curvwatch.realloss.stability import param_index_map, param_positions

__all__ = ["real_loss_blocks", "real_loss_top"]


class _Call(nn.Module):
    """``loss_fn(model)`` as a module, so that ``torch.func.functional_call`` can swap the model's parameters."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module], tuple[Tensor, Tensor]]) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self) -> tuple[Tensor, Tensor]:
        return self.loss_fn(self.model)


def real_loss_blocks(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], tuple[Tensor, Tensor]],
    spec: BlockSpec,
    weight: str,
    columns: slice | None = None,
    loss: str = "cross_entropy",
) -> dict[str, Tensor]:
    """Dense ``hessian``, ``ggn`` and ``own`` blocks of ``theta`` (see the module docstring).

    Args:
        model: The model (float64, twice differentiable).
        loss_fn: ``model -> (loss, logits)``, a forward pass on a fixed batch; ``logits`` ``(..., V)``.
        spec: The monitored sub-block the weight belongs to (:func:`curvwatch.find_blocks`).
        weight: The weight as its adapter reads it: ``"W_Q"``, ``"W_1"``, ...
        columns: Columns of that ``(d_in, d_out)`` weight (one head: ``slice(h d_K, (h + 1) d_K)``); ``None``: all.
        loss: ``"cross_entropy"`` (weights ``w_n`` read from the gradient at the logits, hard labels), ``"mse"``
            (the mean over every element), or a soft-target reduction (``"soft_mean"``, ``"soft_batchmean"``,
            ``"soft_sum"``: :func:`curvwatch.realloss.weights.loss_weights`).

    Returns:
        ``{"hessian", "ggn", "own"}``, each ``(n, n)`` in the row-major order of ``W[:, columns]``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # fused attention kernels have no forward-mode or double backward
        return _blocks(model, loss_fn, spec, weight, columns, loss)


def _perturbed(model, loss_fn, spec, weight, columns) -> tuple[Callable, Tensor]:
    """``(run, zero)`` of :func:`_blocks` and :func:`_top`: ``run(delta, keep=None) -> (loss, logits)`` evaluates the
    model with ``delta`` ``(n,)`` added to the block's weight entries ``W[:, columns]`` (row-major), and stores the
    block's output under ``keep["F"]`` when ``keep`` is given; ``zero`` is the ``(n,)`` zero perturbation."""
    params, index = param_index_map(spec, (weight,))[weight]
    index = index if columns is None else index[:, columns]
    parts = param_positions(params, index)
    names = {id(p): n for n, p in model.named_parameters()}
    base = {n: p.detach() for n, p in model.named_parameters()}
    call = _Call(model, loss_fn)
    out_module = spec.adapter.capture_modules(spec)[1]

    def run(delta: Tensor, keep: dict | None = None) -> tuple[Tensor, Tensor]:
        new = dict(base)
        for p, elements, pos in parts:
            new[names[id(p)]] = base[names[id(p)]].reshape(-1).index_add(0, pos, delta[elements]).reshape(p.shape)
        handle = None
        if keep is not None:
            handle = out_module.register_forward_hook(
                lambda m, a, o: keep.setdefault("F", spec.adapter.read_output(spec, o))
            )
        try:
            return torch.func.functional_call(call, {f"model.{n}": t for n, t in new.items()}, ())
        finally:
            if handle is not None:
                handle.remove()

    return run, torch.zeros(index.numel(), dtype=next(iter(base.values())).dtype)


def _own_term(run: Callable, g_F: Tensor) -> Callable[[Tensor], Tensor]:
    """``d -> <F(d), g_F>``: the block output contracted with its fixed gradient, whose Hessian in ``d`` is the
    block's own (second-order) term."""

    def own_term(d: Tensor) -> Tensor:
        kept: dict = {}
        run(d, kept)
        return (kept["F"] * g_F).sum()

    return own_term


def _blocks(model, loss_fn, spec, weight, columns, loss) -> dict[str, Tensor]:
    from curvwatch.realloss.weights import LossKind, loss_weights

    run, zero = _perturbed(model, loss_fn, spec, weight, columns)
    hessian = torch.func.hessian(lambda d: run(d)[0])(zero)
    # the loss's Hessian at the logits
    keep: dict = {}
    with torch.enable_grad():
        loss0, z = run(zero.clone().requires_grad_(True), keep)
        gz, g_F = torch.autograd.grad(loss0, (z, keep["F"]), retain_graph=True)
    zr = z.detach().reshape(-1, z.shape[-1])
    if loss == "mse":
        H_z = torch.eye(zr.numel(), dtype=zr.dtype) * 2.0 / zr.numel()
    else:
        w, _, _ = loss_weights(z.detach(), gz, LossKind(loss))
        p = torch.softmax(zr, -1)
        blocks = [wi * (torch.diag(pi) - torch.outer(pi, pi)) for wi, pi in zip(w.double(), p, strict=True)]
        H_z = torch.block_diag(*blocks)
    J = torch.func.jacrev(lambda d: run(d)[1].reshape(-1))(zero)  # (N V, n)
    ggn = J.T @ H_z @ J
    g_F = g_F.detach()

    own_term = _own_term(run, g_F)

    own = torch.func.hessian(own_term)(zero)
    return {"hessian": hessian, "ggn": ggn, "own": own}


def real_loss_top(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], tuple[Tensor, Tensor]],
    spec: BlockSpec,
    weight: str,
    columns: slice | None = None,
    own: bool = True,
    tol: float = 1e-8,
    loss: str = "cross_entropy",
) -> dict[str, float]:
    """Largest eigenvalues of the Gauss-Newton block and of Gauss-Newton + own term, matrix-free.

    The same quantities as :func:`real_loss_blocks` (``lambda_max(ggn)``, ``lambda_max(ggn + own)``, what the
    ``ggn/XX`` and ``sharpness/XX`` keys estimate), without dense Jacobians: each product is one forward-mode
    Jacobian-vector product of the logits in the weight (``torch.func.jvp``), the loss's Hessian at the logits
    (softmax cross-entropy, per-row weights read from the gradient) and one vector-Jacobian product back, plus the
    own term's Hessian-vector product; the largest eigenvalue by ARPACK (``scipy.sparse.linalg.eigsh``). Cross-entropy
    losses only. For blocks of 10^4-10^6 weights in float64 models of a few layers.

    Args:
        model, loss_fn, spec, weight, columns: As for :func:`real_loss_blocks`.
        own: Add the own term (``False``: a block whose output is linear in the weight, where it is zero:
            ``W_2``, ``W_V``; saves its Hessian-vector products).
        tol: ARPACK's relative tolerance.
        loss: ``"cross_entropy"`` (weights read from the gradient at the logits) or a soft-target reduction
            (``"soft_mean"``, ``"soft_batchmean"``, ``"soft_sum"``), as for
            :func:`curvwatch.realloss.weights.loss_weights`.

    Returns:
        ``{"ggn": lambda_max(ggn), "sharpness": lambda_max(ggn + own), "n": weights}``.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return _top(model, loss_fn, spec, weight, columns, own, tol, loss)


def _top(model, loss_fn, spec, weight, columns, own, tol, loss) -> dict[str, float]:
    import numpy as np
    from scipy.sparse.linalg import LinearOperator, eigsh

    from curvwatch.realloss.weights import LossKind, loss_weights

    run, zero = _perturbed(model, loss_fn, spec, weight, columns)
    keep: dict = {}
    with torch.enable_grad():
        loss0, z = run(zero.clone().requires_grad_(True), keep)
        gz, g_F = torch.autograd.grad(loss0, (z, keep["F"]))
    w, _, _ = loss_weights(z.detach(), gz, LossKind(loss))
    w = w.double()[:, None]
    p = torch.softmax(z.detach().reshape(-1, z.shape[-1]), -1)
    g_F = g_F.detach()
    _, vjp = torch.func.vjp(lambda d: run(d)[1], zero)

    def ggn(v: Tensor) -> Tensor:
        _, jv = torch.func.jvp(lambda d: run(d)[1], (zero,), (v,))
        u = jv.reshape(p.shape)
        hu = w * (p * u - p * (p * u).sum(-1, keepdim=True))
        return vjp(hu.reshape(z.shape).to(zero.dtype))[0]

    own_term = _own_term(run, g_F)

    def own_mv(v: Tensor) -> Tensor:
        return torch.func.jvp(torch.func.grad(own_term), (zero,), (v,))[1]

    def top(mv) -> float:
        op = LinearOperator(
            (zero.numel(), zero.numel()),
            matvec=lambda x: mv(torch.from_numpy(np.ascontiguousarray(x).reshape(-1)).to(zero.dtype)).numpy(),
            dtype=np.float64,
        )
        v0 = np.random.default_rng(0).standard_normal(zero.numel())
        return float(eigsh(op, k=1, which="LA", tol=tol, v0=v0, ncv=min(zero.numel(), 40))[0][0])

    lam_ggn = top(ggn)
    lam_sharp = top(lambda v: ggn(v) + own_mv(v)) if own else lam_ggn
    return {"ggn": lam_ggn, "sharpness": lam_sharp, "n": zero.numel()}
