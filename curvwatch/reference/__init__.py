"""Slow, obviously correct ground truths for the closed forms, built on ``torch.func`` only.

Every function here writes a Transformer sub-block and its loss the plain way and lets
``torch.func.hessian`` / ``jacrev`` differentiate it. Nothing is clever, nothing is cached; the point
is that a reviewer can check each line against the formulas (``docs/closed_forms.md``) and then
trust the closed forms in :mod:`curvwatch.closed_form` because they agree with this module in float64.
Use tiny shapes: the cost is that of dense Hessians.

Conventions (``docs/design.md``):

* Weights act as ``X @ W``, so ``W`` is ``(d_in, d_out)``. Multi-head packing: head ``h`` owns columns
  ``h*d_K:(h+1)*d_K`` of ``W_Q, W_K``, columns ``h*d_V:(h+1)*d_V`` of ``W_V`` and the same rows of ``W_O``.
* ``vec_r`` (row-major) flattening: a dense block for parameters ``P_X, P_Y`` is
  ``torch.func.hessian(loss, argnums=(i, j))`` reshaped to ``(P_X.numel(), P_Y.numel())``.
* ``X`` is ``(L, d)`` or ``(B, L, d)``; the module output ``F`` is ``(L, m)`` or ``(B, L, m)``.

Every function takes the kernels' grouped inputs (:mod:`curvwatch.closed_form.inputs`): the weights, the attention's
structure and the loss at the block output as an :class:`~curvwatch.closed_form.OutputLoss`, so a test calls a ground
truth and its closed form the same way. Output-level losses (exactly one of ``target`` / ``grad_output``):

* ``target=T``: per-sequence loss :math:`\\|F_b - T_b\\|_F^2 / (L_b m)`, averaged over the batch, so the
  output curvature is :math:`c_b = 2 / (L_b m B)`. ``L_b = L`` unless a mask drops rows.
* ``grad_output=G``: the surrogate
  :math:`\\ell = \\sum_b \\langle G_b, F_b\\rangle + \\tfrac{c}{2}\\|F_b - F_b(\\theta_0)\\|_F^2` with
  :math:`F(\\theta_0)` a detached constant and ``c = output_curvature`` (default ``2 / (L m)``); its
  gradient at :math:`\\theta_0` is ``G`` and its output Hessian is ``c I``.
* Masked rows (``key_padding_mask`` True = padded, ``row_mask`` False = dropped) contribute nothing.

Each ``*_blocks`` function returns, for every reported pair of parameter blocks ``XY``, three dense
matrices of shape ``(n_X, n_Y)`` (the Hessian parts of :data:`curvwatch.closed_form.PARTS`):

* ``hessian/XY``: the Hessian of the loss;
* ``outer/XY``: the Gauss-Newton part :math:`J_X^\\top (\\partial^2\\ell/\\partial F^2) J_Y` with
  :math:`J = \\partial\\,\\mathrm{vec}_r F / \\partial\\,\\mathrm{vec}_r P` from ``jacrev``;
* ``functional/XY``: the Hessian of :math:`\\theta \\mapsto \\langle g, F(\\theta)\\rangle` with the
  detached output gradient :math:`g = \\partial\\ell/\\partial F`.

``hessian == outer + functional`` holds exactly (up to round-off) because every loss is quadratic in ``F``.
"""

from __future__ import annotations

from curvwatch.reference.attention import multi_head_attention_blocks, self_attention_blocks
from curvwatch.reference.block import transformer_block_blocks
from curvwatch.reference.common import dense_to_norms, spectral_norm
from curvwatch.reference.ffn import ffn_blocks
from curvwatch.reference.gated_ffn import gated_ffn_blocks
from curvwatch.reference.layernorm import layernorm_contracted_hessian, layernorm_dense
from curvwatch.reference.rmsnorm import rmsnorm_contracted_hessian, rmsnorm_dense

__all__ = [
    # attention
    "self_attention_blocks",
    "multi_head_attention_blocks",
    # layer norm
    "layernorm_dense",
    "layernorm_contracted_hessian",
    # RMSNorm
    "rmsnorm_dense",
    "rmsnorm_contracted_hessian",
    # feed-forward and the full block
    "ffn_blocks",
    "gated_ffn_blocks",
    "transformer_block_blocks",
    # norms
    "spectral_norm",
    "dense_to_norms",
]
