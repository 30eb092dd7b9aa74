"""Closed-form Hessian of a whole Transformer block (attention, residuals, LayerNorms, FFN), post- or pre-LN.

This module composes the sub-block closed forms with the chain rule (P1 Thms 4-5, corrected):
``d^2 l/dW_i dW_j = c (J_Z B_i)^T (J_Z B_j) + (g^T x I) H_tr^(i,j)``. We apply that Hessian to a vector
without building any Kronecker factor: a forward sweep pushes the weight perturbation through the closed-form
Jacobians (attention, LayerNorm rows, FFN), and a backward sweep pulls back both the output curvature
(the Gauss-Newton part) and, for the functional part, the gradient-contracted second derivatives of every
sub-block: the attention ``Phi`` terms, the contracted LayerNorm Hessian and the FFN
``act''`` and cross terms. This is exactly P1's ``xi_ij`` / ``H_Z`` expansion, evaluated right to left.

Post-LN: ``U = X + MHA(X)``, ``Y = LN1(U)``, ``S = act(Y W_1 + b_1) W_2 + b_2 + Y``, ``Z = LN2(S)``.
Pre-LN (GPT-2 style): ``U = X + MHA(LN1(X))``, ``V = LN2(U)``, ``Z = U + act(V W_1 + b_1) W_2 + b_2``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._common import as_batched, check_weight, output_cotangent
from .attention import AttentionOperator, HeadWeights
from .ffn import activation_derivatives
from .inputs import OutputLoss
from .layernorm import LayerNormRows
from .masks import keep_masks, split_heads
from .settings import PARTS, Lanczos, check_parts
from .solver.operator import BlockOperator, ParamInfo, dense_blocks
from .solver.plan import spectral_norms

BLOCK_NAMES = ("V", "Q", "K", "W1", "W2")
BLOCK_PAIRS = tuple(a + b for i, a in enumerate(BLOCK_NAMES) for b in BLOCK_NAMES[i:])


class TransformerBlockOperator(BlockOperator):
    """Closed-form Hessian operator of one Transformer block in ``(V, Q, K)`` per head and ``W1``, ``W2``."""

    def __init__(self, X, p, *, norm, activation, eps, causal, loss: OutputLoss, batched):
        B, L, d = X.shape
        self.norm = norm
        self.dtype, self.device = X.dtype, X.device
        H = p["n_heads"]
        self.n_heads, self.head_diagonal = H, False
        keep, row_keep = keep_masks(B, L, causal, None, X.device)
        self.row_keep = row_keep
        self.W_1, self.W_2 = p["W_1"], p["W_2"]
        ln1_w, ln2_w = p.get("ln1_weight"), p.get("ln2_weight")
        ln1_b, ln2_b = p.get("ln1_bias"), p.get("ln2_bias")
        b1 = p.get("b_1")
        b2 = p.get("b_2")

        if norm == "pre":
            self.ln1 = LayerNormRows(X, eps, ln1_w)
            X_att = self.ln1.forward(ln1_b)
        else:
            X_att = X
        # attention forward (its cotangent is set after the backward sweep below)
        heads = HeadWeights(p["W_Q"], p["W_K"], p["W_V"], p["W_O"], p.get("b_Q"), p.get("b_K"), p.get("b_V"))
        att = AttentionOperator(X_att, heads, keep, row_keep)
        F = att.output(p.get("b_O"))
        U = X + F
        if norm == "post":
            self.ln1 = LayerNormRows(U, eps, ln1_w)
            self.Yin = self.ln1.forward(ln1_b)  # FFN input
        else:
            self.ln2 = LayerNormRows(U, eps, ln2_w)
            self.Yin = self.ln2.forward(ln2_b)
        Zpre = self.Yin @ self.W_1 + (0 if b1 is None else b1)
        self.Hid, self.a1, self.a2 = activation_derivatives(Zpre, activation)
        S = self.Hid @ self.W_2 + (0 if b2 is None else b2)
        if norm == "post":
            S = S + self.Yin
            self.ln2 = LayerNormRows(S, eps, ln2_w)
            Z = self.ln2.forward(ln2_b)
        else:
            Z = U + S
        self.Z = Z
        g, c, _ = output_cotangent(
            Z,
            row_keep,
            target=loss.target,
            grad_output=loss.grad_output,
            output_curvature=loss.output_curvature,
            batched=batched,
        )
        self.g, self.c = g, c
        # primal backward sweep: cotangents at every intermediate
        if norm == "post":
            self.gS = self.ln2.vjp(g)
            self.gHid = self.gS @ self.W_2.mT
            self.gZpre = self.gHid * self.a1
            self.gY = self.gZpre @ self.W_1.mT + self.gS
            gU = self.ln1.vjp(self.gY)
        else:
            self.gS = g
            self.gHid = g @ self.W_2.mT
            self.gZpre = self.gHid * self.a1
            self.gY = self.gZpre @ self.W_1.mT  # cotangent at V = LN2(U)
            gU = g + self.ln2.vjp(self.gY)
        # the attention operator now gets its true cotangent dl/dF = gU
        att.set_cotangent(gU, torch.zeros(B, dtype=X.dtype, device=X.device))  # outer part is chained here
        self.att, self.W_O = att, p["W_O"]
        d_K, d_V = att.d_K, att.d_V
        self.params = {
            "V": ParamInfo((d, d_V), True),
            "Q": ParamInfo((d, d_K), True),
            "K": ParamInfo((d, d_K), True),
            "W1": ParamInfo(tuple(self.W_1.shape), False),
            "W2": ParamInfo(tuple(self.W_2.shape), False),
        }

    def apply(self, tangent):
        n = next(iter(tangent.values())).shape[0]
        t = {nm: tangent[nm] if nm in tangent else self._zeros(n, nm) for nm in self.params}
        att, W1, W2, a1, a2 = self.att, self.W_1, self.W_2, self.a1, self.a2
        # ---- forward sweep (tangents) ----
        dFh, inter = att.jvp({"Q": t["Q"], "K": t["K"], "V": t["V"]})
        dU = torch.einsum("nbhlv,hvm->nblm", dFh, self.W_O)
        if self.norm == "post":
            dY = self.ln1.jvp(dU)
        else:
            dY = self.ln2.jvp(dU)
        dZpre = dY @ W1 + torch.einsum("bld,ndf->nblf", self.Yin, t["W1"])
        dHid = a1 * dZpre
        dS = dHid @ W2 + torch.einsum("blf,nfm->nblm", self.Hid, t["W2"])
        if self.norm == "post":
            dS = dS + dY
            dZ = self.ln2.jvp(dS)
        else:
            dZ = dU + dS

        # ---- backward sweeps ----
        def pull_back(dgZ, second_order: bool):
            """Tangent of every cotangent; ``second_order`` adds the g-contracted second derivatives."""
            if self.norm == "post":
                dgS = self.ln2.vjp(dgZ)
                if second_order:
                    dgS = dgS + self.ln2.hvp(self.g, dS)
            else:
                dgS = dgZ
            dgHid = dgS @ W2.mT
            if second_order:
                dgHid = dgHid + torch.einsum("blm,nfm->nblf", self.gS, t["W2"])
            dgZpre = dgHid * a1
            if second_order:
                dgZpre = dgZpre + self.gHid * a2 * dZpre
            dgY = dgZpre @ W1.mT
            if second_order:
                dgY = dgY + torch.einsum("blf,ndf->nbld", self.gZpre, t["W1"])
            gW2 = torch.einsum("blf,nblm->nfm", self.Hid, dgS)
            gW1 = torch.einsum("bld,nblf->ndf", self.Yin, dgZpre)
            if second_order:
                gW2 = gW2 + torch.einsum("nblf,blm->nfm", dHid, self.gS)
                gW1 = gW1 + torch.einsum("nbld,blf->ndf", dY, self.gZpre)
            if self.norm == "post":
                dgY = dgY + dgS
                dgU = self.ln1.vjp(dgY)
                if second_order:
                    dgU = dgU + self.ln1.hvp(self.gY, dU)
            else:
                dgU = dgZ + self.ln2.vjp(dgY)
                if second_order:
                    dgU = dgU + self.ln2.hvp(self.gY, dU)
            u_h = torch.einsum("nblm,hvm->nbhlv", dgU, self.W_O)
            g_att = att.vjp(u_h)
            if second_order:
                f_att = att.functional(inter)
                g_att = {k: g_att[k] + f_att[k] for k in g_att}
            return {**g_att, "W1": gW1, "W2": gW2}

        dgZ = dZ * (self.c[:, None, None] * self.row_keep.to(self.dtype)[..., None])
        outer = pull_back(dgZ, second_order=False)
        func = pull_back(torch.zeros_like(dZ), second_order=True)
        return outer, func


def _prepare_params(params: dict, X: torch.Tensor) -> dict:
    """Validate ``params`` and bring them to per-head layout ``(H, d, k)`` on X's dtype/device."""
    d = X.shape[-1]
    required = ("W_Q", "W_K", "W_V", "W_1", "W_2")
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(f"params is missing {missing}; it needs {list(required)} (math convention X @ W).")
    H = int(params.get("n_heads", 1))
    if H < 1:
        raise ValueError(f"Invalid n_heads={H}. Must be >= 1.")
    p = {"n_heads": H}
    p["W_Q"] = split_heads(check_weight(params["W_Q"], d, "W_Q", X), H, "W_Q")
    p["W_K"] = split_heads(check_weight(params["W_K"], d, "W_K", X), H, "W_K")
    p["W_V"] = split_heads(check_weight(params["W_V"], d, "W_V", X), H, "W_V")
    d_V = p["W_V"].shape[-1]
    if params.get("W_O") is None:
        if H * d_V != d:
            raise ValueError(f"Without W_O the heads' output width H*d_V={H * d_V} must equal d={d} for the residual.")
        W_O = torch.eye(d, dtype=X.dtype, device=X.device)
    else:
        W_O = params["W_O"].to(dtype=X.dtype, device=X.device)
        if tuple(W_O.shape) != (H * d_V, d):
            raise ValueError(f"W_O must have shape (H*d_V, d) = {(H * d_V, d)}; got {tuple(W_O.shape)}.")
    p["W_O"] = split_heads(W_O, H, "W_O", per_head_cols=False)
    p["W_1"] = check_weight(params["W_1"], d, "W_1", X)
    p["W_2"] = check_weight(params["W_2"], p["W_1"].shape[1], "W_2", X)
    if p["W_2"].shape[1] != d:
        raise ValueError(f"W_2 must map back to d={d} for the residual; got {tuple(p['W_2'].shape)}.")
    for k in ("b_Q", "b_K", "b_V"):
        if params.get(k) is not None:
            p[k] = params[k].to(dtype=X.dtype, device=X.device).reshape(H, -1)
    for k in ("b_O", "b_1", "b_2", "ln1_weight", "ln1_bias", "ln2_weight", "ln2_bias"):
        if params.get(k) is not None:
            p[k] = params[k].to(dtype=X.dtype, device=X.device)
    unknown = (
        set(params)
        - set(required)
        - {
            "n_heads",
            "W_O",
            "b_Q",
            "b_K",
            "b_V",
            "b_O",
            "b_1",
            "b_2",
            "ln1_weight",
            "ln1_bias",
            "ln2_weight",
            "ln2_bias",
        }
    )
    if unknown:
        raise ValueError(f"Unknown params keys {sorted(unknown)}.")
    return p


def transformer_block(
    X: torch.Tensor,
    params: dict,
    *,
    norm: str = "post",
    activation: str = "relu",
    eps: float = 1e-5,
    causal: bool = False,
    loss: OutputLoss,
    pairs: Sequence[str] | None = None,
    parts: Sequence[str] = PARTS,
    lanczos: Lanczos | None = None,
    dense: bool = False,
) -> dict[str, torch.Tensor]:
    """Closed-form Hessian block norms of a whole Transformer block in ``V, Q, K`` (per head), ``W1``, ``W2``.

    Args:
        X: ``(L, d)`` or ``(B, L, d)`` block input.
        params: ``W_Q, W_K`` ``(d, H d_K)``, ``W_V`` ``(d, H d_V)``, ``W_1`` ``(d, f)``, ``W_2`` ``(f, d)``;
            optional ``n_heads`` (default 1), ``W_O`` ``(H d_V, d)`` (default identity), biases ``b_Q, b_K, b_V,
            b_O, b_1, b_2`` and LayerNorm affine ``ln1_weight, ln1_bias, ln2_weight, ln2_bias``.
        norm: ``"post"`` (Ormaniec et al. 2024) or ``"pre"`` (GPT-2 style, see module docstring).
        activation: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``.
        eps: LayerNorm epsilon.
        causal: causal attention mask.
        loss: the loss at the block output ``Z`` ``(L, d)`` or ``(B, L, d)`` (:class:`~.inputs.OutputLoss`:
            ``target`` or ``grad_output``, ``output_curvature`` default ``c = 2/(L d)``; no ``output_samples``).
        pairs: subset of the 15 pairs among ``V, Q, K, W1, W2`` (``"VQ"``, ``"QW1"``, ``"W1W2"``...).
        parts: subset of ``("outer", "functional", "hessian")``.
        lanczos: settings of the iterative norms (:class:`~curvwatch.closed_form.Lanczos`, default ``Lanczos()``).
        dense: also return ``dense/{outer,functional,hessian}/XY`` blocks ``(n_X, n_Y)``.

    Returns:
        ``{outer,functional,hessian}/XY`` spectral norms (``/h{i}`` suffix on attention pairs when
        ``n_heads > 1``) and LayerNorm terms ``term/ln1_inv_std_max``, ``term/ln2_inv_std_max``,
        ``term/ln1_inv_var_max``, ``term/ln2_inv_var_max``.

    Example:
        >>> X = torch.randn(4, 4, dtype=torch.float64)
        >>> W = lambda *s: torch.randn(*s, dtype=torch.float64)
        >>> p = {"W_Q": W(4, 2), "W_K": W(4, 2), "W_V": W(4, 4), "W_1": W(4, 8), "W_2": W(8, 4)}
        >>> out = transformer_block(X, p, norm="pre", loss=OutputLoss(target=W(4, 4)), pairs=["VV", "W1W2"])
        >>> sorted(k for k in out if k.startswith("hessian/"))
        ['hessian/VV', 'hessian/W1W2']
    """
    if norm not in ("post", "pre"):
        raise ValueError(f"Invalid norm={norm!r}. Use 'post' or 'pre'.")
    if loss.output_samples is not None:
        raise ValueError(
            "transformer_block has no sampled keys: drop loss.output_samples (the sub-block kernels take them)."
        )
    X3, batched = as_batched(X)
    p = _prepare_params(params, X3)
    op = TransformerBlockOperator(
        X3,
        p,
        norm=norm,
        activation=activation,
        eps=float(eps),
        causal=causal,
        loss=loss,
        batched=batched,
    )
    op.suffix_heads = p["n_heads"] > 1
    pairs = BLOCK_PAIRS if pairs is None else tuple(pairs)
    for q in pairs:
        if q not in BLOCK_PAIRS:
            raise ValueError(f"Unknown block pair {q!r}; choose from {BLOCK_PAIRS}.")
    lz = Lanczos() if lanczos is None else lanczos
    out = spectral_norms(op, pairs, parts=check_parts(parts), lanczos=lz)
    for name, ln in (("ln1", op.ln1), ("ln2", op.ln2)):
        s_min = ln.s.min()
        out[f"term/{name}_inv_std_max"] = 1.0 / s_min
        out[f"term/{name}_inv_var_max"] = 1.0 / (s_min * s_min)
    if dense:
        out.update(dense_blocks(op, pairs))
    lz.warn_unconverged(out, "transformer_block")
    return out
