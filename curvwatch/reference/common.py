"""What every ground truth shares: input checks, the output-level losses, dense blocks by ``torch.func``, norms."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.func import grad, hessian, jacrev

from curvwatch.closed_form.inputs import OutputLoss
from curvwatch.closed_form.settings import PARTS

__all__ = [
    "as_batched",
    "batched_mask",
    "check_choice",
    "check_loss",
    "check_tensor",
    "dense_blocks",
    "dense_to_norms",
    "describe",
    "full_matrix",
    "layer_norm",
    "output_loss",
    "pair_keys",
    "spectral_norm",
    "with_columns",
]


def check_tensor(name: str, value: Tensor | None, shape: tuple[int, ...], like: Tensor) -> None:
    """Raise ValueError unless ``value`` is None or a tensor of ``shape`` with ``like``'s dtype/device."""
    if value is None:
        return
    if not isinstance(value, Tensor):
        raise ValueError(f"Invalid {name}: expected a torch.Tensor, got {type(value).__name__}.")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"Invalid {name} shape {tuple(value.shape)}. Expected {tuple(shape)}.")
    if value.dtype != like.dtype or value.device != like.device:
        raise ValueError(
            f"Invalid {name} dtype/device {value.dtype}/{value.device}. "
            f"All tensors must share the input's {like.dtype}/{like.device}; cast with .to(X)."
        )


def as_batched(name: str, X: Tensor) -> tuple[Tensor, bool]:
    """Return ``X`` as ``(B, L, d)`` and whether it was batched; validate rank and dtype."""
    if not isinstance(X, Tensor):
        raise ValueError(f"Invalid {name}: expected a torch.Tensor, got {type(X).__name__}.")
    if X.ndim not in (2, 3):
        raise ValueError(
            f"Invalid {name} shape {tuple(X.shape)}. Expected (L, d) or (B, L, d); add or remove a batch dimension."
        )
    if not X.is_floating_point():
        raise ValueError(f"Invalid {name} dtype {X.dtype}. Expected a floating dtype (use float64).")
    if X.shape[-2] == 0 or X.shape[-1] == 0 or (X.ndim == 3 and X.shape[0] == 0):
        raise ValueError(f"Invalid {name} shape {tuple(X.shape)}. Every dimension must be >= 1.")
    return (X if X.ndim == 3 else X.unsqueeze(0)), X.ndim == 3


def batched_mask(name: str, mask: Tensor | None, B: int, L: int, batched: bool) -> Tensor | None:
    """Validate a ``(B, L)`` bool mask (``(L,)`` or ``(1, L)`` for an unbatched input); return ``(B, L)``."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"Invalid {name} dtype {got}. Expected a torch.bool tensor of shape (B, L).")
    allowed = [(B, L)] if batched else [(L,), (1, L)]
    if tuple(mask.shape) not in allowed:
        raise ValueError(f"Invalid {name} shape {tuple(mask.shape)}. Expected one of {allowed}.")
    return mask.reshape(B, L)


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"Invalid {name}={value!r}. Must be one of {list(allowed)}.")


def describe(value: object) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__


def check_loss(loss: OutputLoss) -> OutputLoss:
    """The ``loss`` argument of a ground truth: an :class:`~curvwatch.closed_form.OutputLoss` without
    ``output_samples`` (the sampled keys have their own ground truths, :mod:`curvwatch.reference.real_loss` and the
    tests' Gauss-Newton blocks of the samples).

    Raises:
        ValueError: on another type or with ``output_samples``.
    """
    if not isinstance(loss, OutputLoss):
        raise ValueError(f"Invalid loss: expected a curvwatch.closed_form.OutputLoss, got {type(loss).__name__}.")
    if loss.output_samples is not None:
        raise ValueError("Invalid loss: the dense ground truths take target= or grad_output=, not output_samples=.")
    return loss


def layer_norm(X: Tensor, eps: float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """``(x - mean) / sqrt(biased var + eps) * weight + bias`` over the last dim."""
    mu = X.mean(dim=-1, keepdim=True)
    var = ((X - mu) ** 2).mean(dim=-1, keepdim=True)
    Y = (X - mu) / torch.sqrt(var + eps)
    if weight is not None:
        Y = Y * weight
    if bias is not None:
        Y = Y + bias
    return Y


def with_columns(W: Tensor, block: Tensor, start: int) -> Tensor:
    """``W`` with columns ``start:start + block.shape[1]`` replaced by ``block`` (a head's slice)."""
    stop = start + block.shape[1]
    return torch.cat([W[:, :start], block, W[:, stop:]], dim=1)


def output_loss(
    F0: Tensor, keep: Tensor | None, loss: OutputLoss, batched: bool
) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """Build ``loss(F)`` for a batched output ``F0`` ``(B, L, m)`` and its output Hessian diagonal: the ``target``
    or ``grad_output`` loss of ``loss`` (the package docstring) over the rows ``keep`` ``(B, L)`` (None: all).

    Returns:
        ``(loss, weight)``: ``loss`` maps ``(B, L, m)`` to a scalar; ``weight`` ``(B, L, m)`` is the
        diagonal of ``d^2 loss / dF^2`` (the loss is quadratic in ``F`` with a diagonal Hessian).
    """
    B, L, m = F0.shape
    target, grad_output, output_curvature = loss.target, loss.grad_output, loss.output_curvature
    out_shape = tuple(F0.shape) if batched else (L, m)
    if (target is None) == (grad_output is None):
        raise ValueError(
            "Pass exactly one of target= (squared-error loss) or grad_output= (surrogate loss); got "
            f"{'both' if target is not None else 'neither'}."
        )
    keep = torch.ones(B, L, dtype=torch.bool, device=F0.device) if keep is None else keep
    rows = keep[..., None].to(F0.dtype)  # (B, L, 1), 1 = row enters the loss
    L_b = keep.sum(dim=-1)  # (B,)
    if bool((L_b == 0).any()):
        raise ValueError(
            f"Invalid mask: sequence(s) {torch.nonzero(L_b == 0).flatten().tolist()} have no unmasked "
            "row, so their loss is undefined. Drop them from the batch."
        )

    if target is not None:
        if output_curvature is not None:
            raise ValueError(
                "output_curvature is only used with grad_output=; in target mode the curvature is "
                "fixed by the loss (2 / (L_b m B)). Remove output_curvature."
            )
        check_tensor("target", target, out_shape, F0)
        T = target.reshape(B, L, m)

        def squared_error(F: Tensor) -> Tensor:
            per_sequence = (((F - T) ** 2) * rows).sum(dim=(-2, -1)) / (L_b * m)  # (B,)
            return per_sequence.mean()

        c_b = 2.0 / (L_b.to(F0.dtype) * m * B)  # (B,)
        return squared_error, c_b[:, None, None] * rows.expand(B, L, m)

    check_tensor("grad_output", grad_output, out_shape, F0)
    G = grad_output.reshape(B, L, m)
    if output_curvature is None:
        c = torch.tensor(2.0 / (L * m), dtype=F0.dtype, device=F0.device)
    else:
        c = torch.as_tensor(output_curvature, dtype=F0.dtype, device=F0.device)
        if c.numel() != 1 or not bool(torch.isfinite(c).all()) or float(c) < 0:
            raise ValueError(f"Invalid output_curvature={output_curvature!r}. Must be a finite scalar >= 0.")
        c = c.reshape(())

    def surrogate(F: Tensor) -> Tensor:
        linear = (G * F * rows).sum()
        quadratic = 0.5 * c * (((F - F0) ** 2) * rows).sum()
        return linear + quadratic

    return surrogate, c * rows.expand(B, L, m)


def dense_blocks(
    forward: Callable[..., Tensor],
    blocks: Mapping[str, Tensor],
    make_loss: Callable[[Tensor], tuple[Callable[[Tensor], Tensor], Tensor]],
) -> dict[str, dict[tuple[str, str], Tensor]]:
    """Dense hessian / outer / functional blocks for every ordered pair of ``blocks``.

    Args:
        forward: maps the block tensors (positionally, in ``blocks`` order) to the output ``(B, L, m)``.
        blocks: name -> parameter tensor at which to evaluate (``params0``).
        make_loss: maps the detached output ``F0`` to ``(loss, weight)`` as in :func:`output_loss`.

    Returns:
        ``{part: {(X, Y): (n_X, n_Y) matrix}}`` for part in outer, functional, hessian.
    """
    names = list(blocks)
    primals = tuple(blocks.values())
    argnums = tuple(range(len(primals)))
    F0 = forward(*primals).detach()
    loss_of_output, weight = make_loss(F0)
    g = grad(loss_of_output)(F0).detach()  # dl/dF at params0, (B, L, m)

    def loss(*params: Tensor) -> Tensor:
        return loss_of_output(forward(*params))

    def linearised(*params: Tensor) -> Tensor:
        return (g * forward(*params)).sum()

    H = hessian(loss, argnums=argnums)(*primals)  # H[i][j]: shape_i + shape_j
    H_f = hessian(linearised, argnums=argnums)(*primals)
    J = jacrev(forward, argnums=argnums)(*primals)  # J[i]: F.shape + shape_i
    J = [J_i.reshape(F0.numel(), -1) for J_i in J]  # (B L m, n_i)
    w = weight.reshape(-1, 1)  # (B L m, 1)

    out: dict[str, dict[tuple[str, str], Tensor]] = {part: {} for part in PARTS}
    for (i, X), (j, Y) in itertools.product(enumerate(names), repeat=2):
        n_X, n_Y = primals[i].numel(), primals[j].numel()
        out["hessian"][X, Y] = H[i][j].reshape(n_X, n_Y)
        out["functional"][X, Y] = H_f[i][j].reshape(n_X, n_Y)
        out["outer"][X, Y] = J[i].T @ (w * J[j])
    return out


def pair_keys(
    mats: dict[str, dict[tuple[str, str], Tensor]], pairs: Sequence[tuple[str, str]], suffix: str = ""
) -> dict[str, Tensor]:
    return {f"{part}/{X}{Y}{suffix}": mats[part][X, Y] for part in PARTS for X, Y in pairs}


def full_matrix(mats: dict[str, dict[tuple[str, str], Tensor]], order: Sequence[str], suffix: str = ""):
    """``{part}/{order joined}{suffix}``: the block matrix of the blocks in ``order``."""
    name = "".join(order)
    return {
        f"{part}/{name}{suffix}": torch.cat([torch.cat([mats[part][X, Y] for Y in order], dim=1) for X in order], dim=0)
        for part in PARTS
    }


def spectral_norm(M: Tensor) -> Tensor:
    """Spectral norm (largest singular value) of a matrix.

    Symmetric square matrices (to relative round-off ``1e-10``) use ``max |eigvalsh|``; all others use
    ``max svdvals``. The two agree on symmetric input; ``eigvalsh`` is just cheaper and more accurate.

    Args:
        M: ``(p, q)``.

    Returns:
        0-d tensor in ``M``'s dtype.

    Raises:
        ValueError: unless ``M`` is a 2-D floating tensor.

    Example:
        >>> spectral_norm(torch.tensor([[2.0, 0.0], [0.0, -3.0]]))
        tensor(3.)
    """
    if not isinstance(M, Tensor) or M.ndim != 2 or not M.is_floating_point():
        raise ValueError(f"Invalid M: expected a 2-D floating tensor, got {describe(M)}.")
    if M.numel() == 0:
        return M.new_zeros(())
    scale = M.abs().max()
    if M.shape[0] == M.shape[1] and bool((M - M.mT).abs().max() <= 1e-10 * scale):
        return torch.linalg.eigvalsh(0.5 * (M + M.mT)).abs().max()
    return torch.linalg.svdvals(M).max()


def dense_to_norms(blocks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Spectral norm of every dense entry of a result dict, under the same key.

    Entries with ``ndim >= 2`` are dense; an ``ndim > 2`` tensor (the LayerNorm ``hessian``) is first
    flattened to ``(prod(shape[:-1]), shape[-1])`` (``(Ln, Ln, Ln)`` to ``((Ln)^2, Ln)``). Lower-rank
    entries (scalars) are not dense and are left out.

    Args:
        blocks: e.g. the output of :func:`self_attention_blocks`.

    Returns:
        ``{key: 0-d tensor}``.

    Example:
        >>> dense_to_norms({"outer/VV": 2 * torch.eye(3), "term/x": torch.tensor(1.0)})
        {'outer/VV': tensor(2.)}
    """
    if not isinstance(blocks, Mapping):
        raise ValueError(f"Invalid blocks: expected a dict of tensors, got {type(blocks).__name__}.")
    return {
        key: spectral_norm(value.reshape(-1, value.shape[-1]))
        for key, value in blocks.items()
        if isinstance(value, Tensor) and value.ndim >= 2
    }
