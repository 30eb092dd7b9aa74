"""What an evaluation of a captured block allocates: the estimates behind the engine's memory budget and windows.

With ``n_W`` the elements of one Lanczos vector of the block (its kind's ``basis_numel``: ``W_Q`` per head group for
attention, ``W_1`` for an FFN), the element size of the closed forms' dtype and ``k = min(max_iter, max_basis)`` the
Lanczos vectors held per norm, one evaluation takes at most the kind's ``work_elements`` (attention ``32 B H L^2 +
64 B L d``, the per-head ``(B, H, L, L)`` tangents of the Lanczos products; FFN ``32 B L d_ff``; LayerNorm ``16 B L
d``) plus ``6 k n_W`` (the Lanczos bases: :func:`basis_bytes`). With ``output_samples`` (the real-loss keys) it takes
twice the work and three times the bases: the sampled keys' Lanczos members hold bases of their own, solved together
with the block's (the attention's ``QQ`` and ``KK`` runs, 12 rows of ``n_W`` beside its own 6), beside the Gram
columns and their products' rows. The factors bound the peaks measured on CPU with the default diagonal pairs;
``pairs="all"`` takes more.

Example:
    >>> from curvwatch.capture import CapturedBlock
    >>> vectors_held(40, 16), vectors_held(40, None)
    (16, 40)
"""

from __future__ import annotations

import torch

from curvwatch.capture import CapturedBlock
from curvwatch.kinds import KINDS

__all__ = ["basis_bytes", "evaluation_bytes", "vectors_held"]


def vectors_held(max_iter: int, max_basis: int | None) -> int:
    """Lanczos vectors one norm holds at most: ``max_iter``, or fewer with ``max_basis`` (thick restarts)."""
    return max_iter if max_basis is None else min(max_iter, max_basis)


def evaluation_bytes(
    block: CapturedBlock, dtype: torch.dtype = torch.float32, max_iter: int = 20, max_basis: int | None = None
) -> int:
    """Rough upper estimate of the extra memory one evaluation of ``block`` allocates, in bytes (see the module
    docstring); 0 for a block without inputs."""
    X = block.inputs.get("X")
    if X is None:
        return 0
    B, L, d = X.shape
    n = KINDS[block.spec.kind].work_elements(B, L, d, block.params)
    return _sampled_factor(block) * n * dtype.itemsize + basis_bytes(block, dtype, vectors_held(max_iter, max_basis))


def basis_bytes(block: CapturedBlock, dtype: torch.dtype = torch.float32, vectors: int = 20) -> int:
    """The Lanczos bases' share of :func:`evaluation_bytes`: ``6 vectors n_W`` elements (0 without Lanczos), three
    times that with ``output_samples`` (the sampled keys' runs, solved together with the block's).

    It does not depend on the tokens: only ``max_basis`` (thick restarts) bounds it. The engine lets a kernel's runs
    share their stopping tests while their bases stay within it (``Lanczos.solve_bytes``).
    """
    if block.inputs.get("X") is None:
        return 0
    numel = KINDS[block.spec.kind].basis_numel(block.params)
    rows = 18 if _sampled_factor(block) > 1 else 6
    return rows * vectors * numel * dtype.itemsize


def _sampled_factor(block: CapturedBlock) -> int:
    """2 where the block holds ``output_samples`` (its evaluation computes the real-loss keys too), else 1."""
    return 2 if "output_samples" in block.inputs else 1
