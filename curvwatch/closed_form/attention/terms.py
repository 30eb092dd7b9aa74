"""The attention's exact pieces: spectral norms of its factors, the bound terms the rules read, and the bounds.

Every exact spectral norm of an evaluation (the ``VV`` Gram factor, the weights, ``X``, the queries, keys and values)
goes through one batched call (:func:`exact_norms`, one ``eigvalsh`` per Gram size, gathered with the other
evaluations of a Lockstep); :func:`signal_terms` and :func:`terms_and_bounds` turn them into the ``term/...`` and
``bound/...`` keys (docs: "Bound terms and corrected bounds"; :mod:`curvwatch.closed_form.bounds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..bounds import attention_bound_table, grouped_attention_bound_tables, softmax_bound_factors, softmax_jacobian_norm
from ..solver.linalg import gram_lambda_max
from ..solver.lockstep import gathered
from .operator import AttentionOperator

__all__ = [
    "Forward",
    "Suffixes",
    "exact_norms",
    "head_softmax_norm",
    "spectral_norms_of",
    "signal_terms",
    "terms_and_bounds",
]


@dataclass(frozen=True)
class Suffixes:
    """The head suffixes of a kernel's keys: none for :func:`~.kernels.self_attention`'s one head (``single``), else
    ``/h{i}`` per query head and, with grouped-query attention, ``/g{j}`` per kv group."""

    single: bool
    H: int
    H_kv: int

    def hk(self, base: str) -> list[str]:
        """Per-query-head keys of ``base``."""
        return [base] if self.single else [f"{base}/h{h}" for h in range(self.H)]

    def gk(self, base: str) -> list[str]:
        """Per-kv-group keys of ``base`` (the head keys without grouping)."""
        return self.hk(base) if self.H_kv == self.H else [f"{base}/g{j}" for j in range(self.H_kv)]


@dataclass(eq=False)
class Forward:
    """An attention kernel's forward pass: its operator ``op`` on the queries ``X`` ``(B, L, d)``, the loss's
    cotangent ``g`` ``(B, L, m)``, curvature ``c`` ``(B,)`` and residual ``resid``, the query rows in the loss
    ``row_keep`` ``(B, L)``, the keys attended to ``kv_keep`` ``(B, L_kv)`` and the checked ``samples``
    ``(k, B, L, m)`` (or None)."""

    X: torch.Tensor
    op: AttentionOperator
    g: torch.Tensor
    c: torch.Tensor
    resid: torch.Tensor
    row_keep: torch.Tensor
    kv_keep: torch.Tensor
    samples: torch.Tensor | None


def exact_norms(*Ms: torch.Tensor, batch_dims: tuple[int, ...]) -> torch.Tensor:
    """``||M||_2^2`` of each matrix of every batch ``Ms[i]`` ``(..., *batch_i, p_i, q_i)`` (:func:`gram_lambda_max`),
    then ``||M||_2``, flat along the last dimension: ``(..., 2 sum_i n_i)`` with ``n_i = prod(batch_i)``, for leading
    dimensions ``...`` (the blocks of a gathered call); ``batch_dims[i] = len(batch_i)``."""
    lead = Ms[0].dim() - 2 - batch_dims[0]
    sq = [t.flatten(lead) if t.dim() > lead else t.unsqueeze(-1) for t in gram_lambda_max(*Ms)]
    flat = torch.cat(sq, -1)
    return torch.cat([flat, flat.clamp_min(0).sqrt()], -1)


def head_softmax_norm(A: torch.Tensor) -> torch.Tensor:
    """:func:`softmax_jacobian_norm` of ``A`` ``(..., B, H, L, L_kv)``, max over the sequences: ``(..., H)``."""
    return softmax_jacobian_norm(A).amax(-2)


def spectral_norms_of(mats: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(squared, spectral)`` norms of every matrix of the batches ``mats`` (``name -> (*batch, p, q)``), in one
    gathered :func:`exact_norms` call (the squared and plain norms of every block of a Lockstep that meets here, one
    ``(sum of sizes,)`` tensor per block, split into its pieces), each ``batch``-shaped; ``"vv"`` only squared."""
    shapes = [M.shape[:-2] for M in mats.values()]
    sizes = [math.prod(shape) for shape in shapes]
    flat = () if not mats else gathered(exact_norms, *mats.values(), batch_dims=tuple(map(len, shapes)))
    flat = () if not mats else flat.split(sizes + sizes)
    flat = [t if len(shape) == 1 else t.view(shape) for t, shape in zip(flat, shapes + shapes, strict=True)]
    sq = dict(zip(mats, flat[: len(mats)], strict=True))
    norms = {k: v for k, v in zip(mats, flat[len(mats) :], strict=True) if k != "vv"}
    return sq, norms


def signal_terms(op: AttentionOperator, norms: dict[str, torch.Tensor], keys: Suffixes) -> dict[str, torch.Tensor]:
    """The bound terms the warning rules read (:mod:`curvwatch.rules`), no others and no bounds: ``term/x_norm``,
    ``term/x_norm6``, ``term/softmax_jac_norm/h*``, ``term/wq_norm/h*``, ``term/wk_norm/h*`` (``/g*`` per kv group),
    each the same number :func:`terms_and_bounds` gives. ``norms`` holds ``x`` ``(B,)``, ``wq`` ``(H,)``,
    ``wk`` ``(H_kv,)``."""
    hk, gk = keys.hk, keys.gk
    x_max = norms["x"].max()
    out = {"term/x_norm": x_max, "term/x_norm6": x_max**6}
    per_head = torch.stack([gathered(head_softmax_norm, op.A), norms["wq"]])  # (2, H)
    out.update(zip([f"term/{k}" for name in ("softmax_jac_norm", "wq_norm") for k in hk(name)],
                   per_head.flatten().unbind(), strict=True))  # fmt: skip
    wk = hk("wk_norm") if op.G == 1 else gk("wk_norm")
    out.update(zip([f"term/{k}" for k in wk], norms["wk"].unbind(), strict=True))
    return out


def terms_and_bounds(
    fwd: Forward, norms: dict[str, torch.Tensor], keys: Suffixes, *, target: bool, bounds: bool = True
) -> dict[str, torch.Tensor]:
    """Bound terms (``term/...``) and corrected bounds (``bound/...``) of an attention kernel's forward pass ``fwd``.

    ``norms`` holds the spectral norms computed with the exact ones: ``x`` ``(B,)`` (padded rows excluded),
    ``mem`` ``(B,)`` (cross-attention), ``P`` ``(B, H)``, ``K``, ``V`` ``(B, H_kv)`` and ``wq`` ``(H,)``, ``wk``,
    ``wv`` ``(H_kv,)``, ``wo`` ``(H,)`` (no ``wo`` without projection). ``target``: the loss has a target (then
    ``term/residual_norm``). ``bounds=False`` (QK-norm) leaves out every ``bound/...`` key: the bounds do not cover a
    normalised ``P``, ``K``.
    """
    X3, op, g, c, row_keep, kv_keep = fwd.X, fwd.op, fwd.g, fwd.c, fwd.row_keep, fwd.kv_keep
    hk, gk = keys.hk, keys.gk
    A = op.A
    B, H, L = A.shape[:3]
    G = op.G
    x_b = norms["x"]  # (B,)
    alpha, beta = gathered(softmax_bound_factors, A)  # ||dA/dT||_2 and the softmax second derivative's bound, (B, H)
    ent = -torch.special.xlogy(A, A).sum(-1)  # (B, H, L); 0 log 0 = 0
    rk = row_keep.to(A.dtype).unsqueeze(1)  # (B, 1, L)
    entropy = (ent * rk).sum((0, 2)) / rk.sum((0, 2)).clamp_min(1)  # (H,)
    w_o = norms.get("wo")
    L_b = row_keep.sum(-1).to(X3.dtype)
    L_kv_b = kv_keep.sum(-1).to(X3.dtype)  # keys per sequence, the entropy's ceiling is log(L_kv_b)
    x_max = x_b.max()
    out: dict[str, torch.Tensor] = {
        "term/x_norm": x_max,
        "term/x_norm6": x_max**6,
        "term/inv_L3": torch.tensor(1.0 / L**3, dtype=X3.dtype, device=X3.device),
        "term/grad_norm": g.norm(),
    }
    if "mem" in norms:
        out["term/memory_norm"] = norms["mem"].max()
    if target:
        out["term/residual_norm"] = fwd.resid.norm()
    per_head = {
        "softmax_jac_norm": alpha.amax(0),
        "softmax_hess_frob": beta.amax(0),
        "attn_entropy": entropy,
        "attn_entropy_norm": entropy / torch.log(L_kv_b.clamp_min(2)).mean(),
        "wq_norm": norms["wq"],
    }
    per_group = {"wk_norm": norms["wk"], "wv_norm": norms["wv"]}  # (H_kv,)
    if G == 1:
        per_head.update(per_group)
        per_group = {}
    if w_o is not None:
        per_head["wo_norm"] = w_o
    head_keys = [f"term/{key}" for name in per_head for key in hk(name)]
    head_vals = [torch.stack(list(per_head.values()))]  # (n_terms, H)
    group_keys = [f"term/{key}" for name in per_group for key in gk(name)]
    group_vals = [torch.stack(list(per_group.values()))] if per_group else []  # (n_terms, H_kv)
    if bounds:
        rmax = None if op.rotary is None else op.rotary.norm()  # ||R_i||_2: 1 for a rotation
        x_kv = norms.get("mem")  # None: keys and values read X
        x_k = x_kv if rmax is None else (x_b if x_kv is None else x_kv) * rmax
        kw = dict(
            x=x_b,
            p=norms["P"],
            kap=norms["K"].repeat_interleave(G, 1) if G > 1 else norms["K"],  # per query head (B, H)
            nu=norms["V"].repeat_interleave(G, 1) if G > 1 else norms["V"],
            gam=op.g_h.flatten(-2).norm(dim=-1).expand(B, H),
            c=c,
            alpha=alpha,
            beta=beta,
            w_o=torch.ones(H, dtype=X3.dtype, device=X3.device) if w_o is None else w_o,
            L_b=L_b,
            d_K=op.d_K,
            scale=abs(op.scale),
            x_q=None if rmax is None else x_b * rmax,
            x_k=x_k,
            x_v=x_kv,
        )
        if G == 1:
            names, table = attention_bound_table(**kw)  # (n_bounds, H)
            head_keys += [f"bound/{key}" for name in names for key in hk(name)]
            head_vals.append(table)
        else:
            (names_h, table_h), (names_g, table_g) = grouped_attention_bound_tables(groups=G, **kw)
            head_keys += [f"bound/{key}" for name in names_h for key in hk(name)]
            head_vals.append(table_h)
            group_keys += [f"bound/{key}" for name in names_g for key in gk(name)]
            group_vals.append(table_g)
    for keys, vals in ((head_keys, head_vals), (group_keys, group_vals)):
        if keys:  # one view per (quantity, head or group)
            out.update(zip(keys, torch.cat(vals).flatten().unbind(), strict=True))
    return out
