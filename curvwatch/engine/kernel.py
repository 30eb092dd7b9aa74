"""The one place a kernel is called: a captured block's closed form, with what to compute.

:func:`kernel_inputs` turns a :class:`~curvwatch.capture.CapturedBlock` into its kind's kernel arguments (padded rows
zeroed, cast to the closed forms' dtype); :func:`evaluate_block` calls the kernel with them and with what the
evaluation asks for (pairs, parts, Lanczos settings, preconditioner, a signals evaluation).

Example:
    >>> from curvwatch.adapters import find_blocks
    >>> from curvwatch.capture import Capture
    >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    >>> with Capture(find_blocks(layer), max_tokens=16) as capture:
    ...     layer(torch.randn(2, 4, 8)).square().sum().backward()
    >>> result = evaluate_block(capture.blocks()[2], dtype=torch.float64)  # the LayerNorm after attention
    >>> "var_min" in result
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from curvwatch.capture import CapturedBlock
from curvwatch.closed_form.settings import PARTS, Lanczos
from curvwatch.kinds import KINDS

__all__ = ["evaluate_block", "kernel_inputs"]

_DTYPES = (torch.float32, torch.float64)


def kernel_inputs(block: CapturedBlock, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The keyword arguments of ``block``'s closed form (all of them, ``X``/``Y`` and weights included), grouped as the
    kernel takes them (:attr:`~curvwatch.kinds.BlockKind.prepare`); the ground truths of :mod:`curvwatch.reference`
    take the same.

    Padded positions (the block's key padding or row mask) are zeroed in the input, the output gradient and the
    output samples: no statistic may see what a padded position holds. A block's low-rank adapters (``adapters``, the
    curvature in their parameters) go with its output samples only.

    Args:
        block: A captured block (its weights are read now under sharding, :meth:`CapturedBlock.with_params`).
        dtype: Cast floating tensors to it (``None``: keep the captured dtype). Masks stay bool.

    Raises:
        RuntimeError: If the block was not captured completely (``reason`` says why).
    """
    if block.reason is not None:
        raise RuntimeError(f"Block {block.spec.name!r} cannot be evaluated: {block.reason}")
    if block.params_fn is not None:
        return kernel_inputs(block.with_params(), dtype)
    kind = KINDS[block.spec.kind]
    kwargs: dict[str, Any] = {kind.input_name: block.inputs["X"]}
    kwargs.update(block.params)
    kwargs.update({k: v for k, v in block.inputs.items() if k not in ("X", "grad_output")})
    kwargs["grad_output"] = block.inputs.get("grad_output")
    if "output_samples" not in block.inputs or not kwargs.get("adapters"):
        kwargs.pop("adapters", None)
    mask = kwargs[kind.mask_name] = block.inputs.get(kind.mask_name)
    if mask is not None:  # padded rows carry no information: no statistic may see their values
        padded = (mask if kind.mask_name == "key_padding_mask" else ~mask)[..., None]
        for name in (kind.input_name, "grad_output", "output_samples"):
            if isinstance(kwargs.get(name), Tensor):
                kwargs[name] = kwargs[name].masked_fill(padded, 0.0)
    if dtype is not None:
        kwargs = _cast(kwargs, dtype)
    return kind.kernel_kwargs(kwargs)


def evaluate_block(
    block: CapturedBlock,
    *,
    lanczos: Lanczos | None = None,
    dtype: torch.dtype = torch.float64,
    pairs: Sequence[str] | None = None,
    parts: Sequence[str] = PARTS,
    precondition: dict[str, Tensor] | None = None,
    signals: bool = False,
) -> dict[str, Tensor]:
    """Run the closed form of ``block``'s kind on its captured tensors.

    Args:
        block: A captured block.
        lanczos: Settings of the iterative norms (attention, FFN; ``None``: the closed forms' default), its
            ``warm_start`` kept between evaluations of this block.
        dtype: ``torch.float32`` or ``torch.float64``; inputs and weights are cast to it.
        pairs: Block pairs to compute (attention: ``VV, QQ, KK, VQ, VK, QK, QKV``; FFN: ``W1W1, W2W2, W1W2``); pairs
            of other kinds are ignored. ``None``: all of the kernel's pairs.
        parts: The Hessian parts whose norms to compute (attention, FFN): a subset of :data:`PARTS
            <curvwatch.closed_form.settings.PARTS>`.
        precondition: ``{weight name: P}`` in the kernel's weight layout (Adam's ``sqrt(v_hat) + eps``), for the
            ``precond_sharpness/...`` keys of a block with ``output_samples``, and ``{"lora/<name>": P}`` for its
            adapters' ``[vec A, vec B]``; ``None``: none.
        signals: Pass the kind's :attr:`~curvwatch.kinds.BlockKind.signal_kwargs` too: only what the warning rules
            read (and ``pairs``).

    Returns:
        ``dict[str, Tensor]`` of 0-d tensors keyed relative to the block (``"outer/QQ/h0"``, ...).

    Raises:
        ValueError: If ``dtype`` is not float32/float64, or the closed form does not support a setting of the block
            (e.g. its activation).
        RuntimeError: If the block was not captured completely (``reason`` says why).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"Invalid dtype={dtype}. Must be torch.float32 or torch.float64.")
    kind = KINDS[block.spec.kind]
    kwargs = kernel_inputs(block, dtype)
    if kind.iterative:
        kwargs.update(lanczos=lanczos, parts=parts)
        if pairs is not None:
            kwargs["pairs"] = [p for p in dict.fromkeys(pairs) if p in kind.pairs]
    if "output_samples" in block.inputs and precondition is not None:
        kwargs["precondition"] = _cast(precondition, dtype)
    if signals and kind.signal_kwargs:
        kwargs.update(kind.signal_kwargs)
    return kind.kernel()(**kwargs)


def _cast(kwargs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Floating tensors in ``kwargs`` (nested dicts too) cast to ``dtype``; masks and settings unchanged."""
    return {
        k: v.to(dtype)
        if isinstance(v, Tensor) and v.is_floating_point()
        else _cast(v, dtype)
        if isinstance(v, dict)
        else v
        for k, v in kwargs.items()
    }
