"""Corrected spectral-norm bounds for self-attention blocks and the softmax factors that drive them.

The published bound of Petrov et al. (P1, Thm 1) uses ``||dA/dT||_2 <= 1/L``, true only for uniform
attention, and omits the KK/VK blocks; both make it fail (docs: "What the papers print, and what holds"). The
bounds here are the corrected ones, written with measured norms so they are valid for biases and an output
projection too. Per sequence ``b`` and head ``h``, with ``x = ||X||_2``, ``p = ||X W_Q + b_Q||_2``,
``kappa = ||X W_K + b_K||_2``, ``nu = ||X W_V + b_V||_2``, ``omega = ||W_O^h||_2``, ``gamma = ||g W_O^h^T||_F``,
``alpha = ||dA/dT||_2`` (measured, <= 1/2), ``beta`` = Frobenius norm of the softmax second derivative
(measured per row, max over rows):

* Jacobian norms: ``||J_V|| <= sqrt(L) x omega``, ``||J_Q|| <= alpha x kappa nu omega / sqrt(d_K)``,
  ``||J_K|| <= alpha x p nu omega / sqrt(d_K)``; outer blocks ``||H_o(XY)|| <= c ||J_X|| ||J_Y||``.
* functional: ``H_f(VV) = 0``; ``||H_f(VQ)|| <= alpha x^2 kappa gamma / sqrt(d_K)`` (``kappa -> p`` for VK);
  ``||H_f(QQ)|| <= beta gamma nu x^2 kappa^2 / d_K`` (``kappa -> p`` for KK);
  ``||H_f(QK)|| <= beta gamma nu x^2 kappa p / d_K + alpha gamma nu x^2 / sqrt(d_K)``.
* totals: ``||H(XY)|| <= bound_o + bound_f``; the whole QKV Hessian is bounded by the spectral norm of the
  3x3 matrix of block bounds (<= 3 max, the corrected form). Batches add: ``||sum_b H_b|| <= sum_b ||H_b||``.

With ``kappa = x ||W_K||``, ``nu = x ||W_V||`` and ``gamma = c r`` these are exactly the corrected bounds of the docs.
The only L-dependence left is through ``c = 2/(L d_V)`` and ``sqrt(L)`` in ``J_V``.

Modern attention (docs "Modern attention"): ``1/sqrt(d_K)`` becomes the softmax scale ``s`` (every bound is linear
in the factor ``s`` of ``T = s P K^T``). Each ``x`` above bounds one map from a weight perturbation to ``dP``,
``dK`` or ``dV`` and is replaced by ``x_q``, ``x_k`` or ``x_v``: with rotary ``dP = R(X dW)``, ``||R(X dW)||_F <=
max_i ||R_i|| x ||dW||_F`` (``max_i ||R_i|| = max sqrt(cos^2 + sin^2)``, 1 for a rotation), and in cross-attention
``dK``, ``dV`` read the memory (``x_kv``); ``||A||_2 <= sqrt(L_b)`` holds for an ``L x L_kv`` row-stochastic ``A``
(column sums ``<= L_b``). Grouped-query attention sums the heads that share ``W_K``, ``W_V``
(:func:`grouped_attention_bound_tables`). QK-norm is not covered: the kernels emit no bound with it.
"""

from __future__ import annotations

import math

import torch

from .solver.linalg import gram_lambda_max


def softmax_jacobian_norm(A: torch.Tensor, iters: int = 8) -> torch.Tensor:
    """``||dA/dT||_2`` per matrix: ``max_i lambda_max(diag(a_i) - a_i a_i^T)``, by Newton on the secular equation.

    For a row ``a`` with largest entry ``a_1`` and second ``a_2``, the largest eigenvalue ``lambda`` of
    ``diag(a) - a a^T`` lies in ``[a_2, a_1]`` and solves ``1 = sum_j a_j^2 / (a_j - lambda)``. Written as
    ``h(lambda) = (a_1 - lambda)(1 + psi(lambda)) - a_1^2 = 0`` with ``psi = sum_{j != 1} a_j^2 / (lambda - a_j)``,
    ``h`` is decreasing and convex on ``(a_2, a_1)``, so Newton's method started left of the root (at a
    Rayleigh quotient: ``max(a_1 (1 - a_1), q((e_1 - e_2)/sqrt 2))``) climbs monotonically to it and converges
    quadratically: ``iters = 8`` reaches round-off on every row tried (checked against ``eigvalsh`` row by row
    in the tests). ``1 - a_1`` is formed as the sum of the other entries (no cancellation on near-one-hot rows).
    Cost ``O(iters * L^2)`` elementwise, no ``L x L`` eigen-decomposition per row, no host-device sync.

    Args:
        A: ``(..., L, L)`` row-stochastic (rows may be all zero: fully masked).
        iters: Newton steps.

    Returns:
        ``(...)`` tensor, max over rows.
    """
    return _jacobian_norm(*_split_top(A), iters)


def softmax_bound_factors(A: torch.Tensor, iters: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax_jacobian_norm(A, iters), softmax_hessian_frobenius(A))``, sharing the split of every row.

    Both start from each row's largest entry and the row without it; one evaluation of the bound terms needs
    both, so the split is done once.

    Args:
        A: ``(..., L, L)`` row-stochastic.

    Returns:
        Two ``(...)`` tensors.
    """
    split = _split_top(A)
    return _jacobian_norm(*split, iters), _hessian_frobenius(A, *split)


def _split_top(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a_1, i_1, others)``: the largest entry of each row ``(..., L)``, its index ``(..., L)`` and the row
    with it set to zero ``(..., L, L)``."""
    a1, i1 = A.max(-1)
    return a1, i1, A.scatter(-1, i1.unsqueeze(-1), 0.0)


#: Rows of each matrix that :func:`softmax_jacobian_norm` runs Newton's method on: those of the largest upper bounds
#: (:func:`_row_upper_bound`). A matrix whose next row's bound exceeds the answer (it could hold the maximum) is solved
#: on every row.
TOP_ROWS = 32


def _jacobian_norm(a1: torch.Tensor, i1: torch.Tensor, others: torch.Tensor, iters: int) -> torch.Tensor:
    """:func:`softmax_jacobian_norm` from :func:`_split_top`.

    Each row's eigenvalue lies below its bound :func:`_row_upper_bound`; Newton runs on the :data:`TOP_ROWS` rows of
    the largest bounds of each matrix, whose largest eigenvalue is the matrix's wherever the next row's bound does not
    exceed it. Where some matrix's next bound does (one host read tells), every row of every matrix is solved. At
    ``L = 512`` the Newton steps (the cost: ``7 iters`` passes over what they solve) then read 16x fewer entries.
    """
    if others.shape[-1] == 1:  # a single key: the softmax is constant
        return torch.zeros(others.shape[:-2], dtype=others.dtype, device=others.device)
    # per row quantities keep a trailing 1 (..., L, 1): every step's tensors broadcast against (..., L, L) as they are
    a1 = a1.unsqueeze(-1)
    a2 = others.amax(-1, keepdim=True)  # the second largest entry (= a_1 on ties)
    rest = others.sum(-1, keepdim=True)  # 1 - a_1, as the sum of the others (no cancellation)
    L = others.shape[-2]
    if L <= TOP_ROWS:
        return _newton_rows(a1, a2, rest, others, iters).amax(-1)
    bound = _row_upper_bound(a1, a2, rest, torch.linalg.vector_norm(others, dim=-1, keepdim=True).square())
    top, rows = bound.squeeze(-1).topk(TOP_ROWS + 1, dim=-1)  # (..., TOP_ROWS + 1)
    rows = rows[..., :TOP_ROWS].unsqueeze(-1)  # (..., TOP_ROWS, 1)
    picked = [torch.take_along_dim(t, rows, -2) for t in (a1, a2, rest)]
    lam = _newton_rows(*picked, torch.take_along_dim(others, rows, -2), iters).amax(-1)  # (...)
    if bool((top[..., TOP_ROWS] <= lam).all()):  # no row left out could hold more (a host read)
        return lam
    return _newton_rows(a1, a2, rest, others, iters).amax(-1)


def _row_upper_bound(a1: torch.Tensor, a2: torch.Tensor, rest: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """An upper bound of each row's ``lambda_max(diag(a) - a a^T)`` from its largest entry ``a1``, second ``a2``, the
    sum ``rest`` and the sum of squares ``s2`` of the entries other than ``a1`` (``(..., L, 1)`` each).

    On ``(a_2, a_1)`` every other entry has ``lambda - a_j >= lambda - a_2``, so ``psi(lambda) <= s2 / (lambda -
    a_2)`` and ``h`` (:func:`softmax_jacobian_norm`) lies below ``(a_1 - lambda)(1 + s2 / (lambda - a_2)) - a_1^2``,
    which also decreases; its root, the larger root of ``lambda^2 - b lambda + q`` with ``b = a_1 rest + a_2 - s2``
    and ``q = a_1 (a_2 rest - s2) >= 0``, is at least ``h``'s. It is exact where the other entries are all equal to
    ``a_2`` (two entries; uniform rows). A relative ``1e-6`` is added for the round-off of the root.
    """
    b = a1 * rest + a2 - s2
    q = a1 * (a2 * rest - s2).clamp_min(0)
    root = 0.5 * (b + (b * b - 4 * q).clamp_min(0).sqrt())
    return torch.minimum(root, a1) * (1 + 1e-6)


def _newton_rows(
    a1: torch.Tensor, a2: torch.Tensor, rest: torch.Tensor, others: torch.Tensor, iters: int
) -> torch.Tensor:
    """Each row's ``lambda_max`` by :func:`softmax_jacobian_norm`'s Newton steps: ``(..., n)`` from the rows' largest
    entry ``a1``, second ``a2`` and sum of the others ``rest`` ``(..., n, 1)`` and the rows without their largest entry
    ``others`` ``(..., n, L_kv)``."""
    sq = others * others
    a1_rest = a1 * rest  # a_1 (1 - a_1)
    lam = torch.maximum(a1_rest, 0.5 * (a1 + a2) - 0.5 * (a1 - a2) ** 2)  # Rayleigh quotients <= lambda
    tiny = torch.finfo(others.dtype).tiny
    D, R = torch.empty_like(others), torch.empty_like(others)  # (..., n, L_kv) buffers, reused by every step
    for _ in range(iters):
        torch.sub(lam, others, out=D).clamp_min_(tiny)
        torch.div(sq, D, out=R)
        psi = R.sum(-1, keepdim=True)
        gap = a1 - lam
        # h = (a_1 - lambda)(1 + psi) - a_1^2 expanded as a_1 (1 - a_1) - lambda + (a_1 - lambda) psi: on a
        # near-one-hot row every term is ~lambda, while the product form cancels against 1 (0.71x at 1e-20)
        h = torch.addcmul(a1_rest - lam, gap, psi)
        # -h' = 1 + psi + (a_1 - lambda) psi' >= 1; the Newton step h / -h' (0 where it is NaN: inf / inf)
        den = torch.addcmul(psi.add_(1.0), gap, R.div_(D).sum(-1, keepdim=True))
        lam = torch.minimum(lam + h.div_(den).nan_to_num_(nan=0.0, posinf=torch.inf, neginf=-torch.inf), a1)
    lam = torch.where(a1 - a2 <= 0, a1, lam)  # ties: e_1 - e_2 is an eigenvector with eigenvalue a_1
    return lam.squeeze(-1)


def softmax_hessian_frobenius(A: torch.Tensor) -> torch.Tensor:
    """Frobenius norm of the softmax second derivative, max over rows: an upper bound of every unfolding's norm.

    For a row ``a`` with Jacobian ``J = diag(a) - a a^T``, the second derivative is
    ``S_jkl = d J_jk / dT_l = J_jl (delta_jk - a_k) - a_j J_kl`` (P2 Lemma C.1). With
    ``w_j = sum_k (delta_jk - a_k)^2``, ``r_j = sum_l J_jl^2 = a_j^2 w_j``, ``p_2 = sum a^2`` and
    ``J a = a * (a - p_2)``, expanding the square gives, in ``O(L)`` per row,

    ``||S||_F^2 = sum_j r_j w_j - 2 (sum_j a_j r_j - ||J a||^2) + p_2 sum_j r_j``.

    Near one-hot rows every term is tiny, so ``1 - a_top``, ``sum_{l != top} a_l^2`` and ``a_top - p_2`` are
    formed from the other entries, never as differences of numbers close to 1 (the closed form in powers of
    ``a`` cancels catastrophically there and can under-estimate the norm by orders of magnitude).

    Args:
        A: ``(..., L, L)``.

    Returns:
        ``(...)`` tensor.
    """
    return _hessian_frobenius(A, *_split_top(A))


def _hessian_frobenius(A: torch.Tensor, a1: torch.Tensor, i1: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """:func:`softmax_hessian_frobenius` from :func:`_split_top`."""
    top = torch.zeros_like(A, dtype=torch.bool).scatter_(-1, i1.unsqueeze(-1), True)  # the largest entry of each row
    # Every term of ||S||_F^2 is O(t^2) with t = 1 - a_top, so the formula is evaluated on terms divided by
    # t^2 (off-top entries as a / t <= 1): squares of attention weights below 1e-154 would underflow to 0
    # in float64 (the bound then read 0 below a true norm of 1e-238, found by the property test).
    t = others.sum(-1, keepdim=True)  # 1 - a_top, without cancellation
    ts = t.clamp_min(torch.finfo(A.dtype).tiny)
    u = others / ts  # off-top entries relative to t
    a_top = a1.unsqueeze(-1)
    a_top2, t2, uu = a_top * a_top, t * t, u * u
    s_top_t2 = uu.sum(-1, keepdim=True)  # sum of the other squares / t^2
    p2 = a_top2 + t2 * s_top_t2  # sum a^2
    # w_j = (1 - a_j)^2 + sum_{l != j} a_l^2; off the top entry it is O(1); at the top w / t^2 = 1 + s_top / t^2
    w = torch.where(top, 1.0 + s_top_t2, (1.0 - A) ** 2 + (p2 - A * A))
    # r_j / t^2 = a_j^2 w_j / t^2
    r = torch.where(top, a_top2 * w, uu * w)
    w_true = torch.where(top, t2 * w, w)  # w itself, for the sum r_j w_j
    # m_j = a_j - p_2: at the top a_top t - s_top = t (a_top - t s_top / t^2), so (a_j^2 m_j^2) / t^2 is
    m_top_t = a_top - t * s_top_t2
    Ja2 = torch.where(top, a_top2 * m_top_t * m_top_t, uu * (A - p2) ** 2).sum(-1)
    sq = (r * w_true).sum(-1) - 2 * ((A * r).sum(-1) - Ja2) + p2.squeeze(-1) * r.sum(-1)
    return (t.squeeze(-1) * sq.clamp_min(0).sqrt()).amax(-1)


# the six block pairs in output order, their (row, column) blocks in Q, K, V order, and the symmetric 3x3
# matrix of block bounds as indices into that order
_PAIRS = ("VV", "QQ", "KK", "VQ", "VK", "QK")
_ROWS, _COLS = [2, 0, 1, 2, 2, 0], [2, 0, 1, 0, 1, 1]
_QKV = [[1, 5, 3], [5, 2, 4], [3, 4, 0]]


def attention_bounds(*, x, P, Kk, Vv, g_h, c, alpha, beta, w_o, L_b, d_K) -> dict[str, torch.Tensor]:
    """Corrected per-head bounds, summed over the batch.

    Args:
        x: ``(B,)`` ``||X_b||_2``.
        P, Kk: ``(B, H, L, d_K)`` queries and keys; Vv: ``(B, H, L, d_V)`` values.
        g_h: ``(B, H, L, d_V)`` per-head cotangent ``g W_O^h^T``.
        c: ``(B,)`` output curvature per sequence.
        alpha, beta: ``(B, H)`` from :func:`softmax_jacobian_norm` and :func:`softmax_hessian_frobenius`.
        w_o: ``(H,)`` ``||W_O^h||_2`` (ones without projection).
        L_b: ``(B,)`` sequence lengths (kept rows).
        d_K: key width.

    Returns:
        ``{"XY": (H,), "outer/XY": (H,), "functional/XY": (H,), "QKV": (H,)}`` for the six pairs.
    """
    p, kap, nu = (t.clamp_min(0).sqrt() for t in gram_lambda_max(P, Kk, Vv))  # (B, H)
    gam = g_h.flatten(-2).norm(dim=-1)  # (B, H)
    names, table = attention_bound_table(
        x=x, p=p, kap=kap, nu=nu, gam=gam, c=c, alpha=alpha, beta=beta, w_o=w_o, L_b=L_b, d_K=d_K
    )
    return dict(zip(names, table.unbind(), strict=True))


def _bound_pieces(*, x, p, kap, nu, gam, c, alpha, beta, w_o, L_b, d_K, scale=None, x_q=None, x_k=None, x_v=None):
    """Per sequence and head: Jacobian bounds ``(3, B, H)`` (Q, K, V) and functional bounds ``(6, B, H)`` (``_PAIRS``).

    ``x_q``, ``x_k``, ``x_v`` ``(B,)`` bound the maps from a weight perturbation to ``dP``, ``dK``, ``dV`` (default
    ``x``): with a rotary map ``R``, ``||R(X dW)||_F <= max_i ||R_i|| x ||dW||_F``; in cross-attention keys and values
    read the memory. ``scale``: the softmax scale (default ``1/sqrt(d_K)``).
    """
    s = 1.0 / math.sqrt(d_K) if scale is None else scale
    xb = x[:, None]  # (B, 1)
    xq, xk, xv = (xb if t is None else t[:, None] for t in (x_q, x_k, x_v))
    xw_q, xw_k, xw_v = xq * w_o[None], xk * w_o[None], xv * w_o[None]  # x omega, (B, H)
    J = torch.stack(
        [alpha * xw_q * nu * s * kap, alpha * xw_k * nu * s * p, L_b.sqrt()[:, None] * xw_v]
    )  # ||J_Q||, ||J_K||, ||J_V|| bounds, (3, B, H)

    def ag(x2):  # alpha x^2 gamma s
        return alpha * x2 * gam * s

    def bg(x2):  # beta gamma nu x^2 s^2
        return beta * gam * nu * x2 * (s * s)

    x_qk = xq * xk
    func = torch.stack(
        [
            torch.zeros_like(alpha * xq),  # H_f(VV) = 0
            bg(xq * xq) * kap * kap,
            bg(xk * xk) * p * p,
            ag(xq * xv) * kap,
            ag(xk * xv) * p,
            bg(x_qk) * kap * p + alpha * gam * nu * x_qk * s,
        ]
    )  # (6, B, H)
    return J, func


def _perron_root(N: torch.Tensor) -> torch.Tensor:
    """The largest eigenvalue of each symmetric matrix ``N`` ``(n, k, k)`` with entries ``>= 0``: its spectral norm
    (Perron-Frobenius), the square root of :func:`gram_lambda_max`'s (no eigen-decomposition on a GPU)."""
    return gram_lambda_max(N)[0].clamp_min(0).sqrt()


def attention_bound_table(**kw) -> tuple[list[str], torch.Tensor]:
    """The bounds of :func:`attention_bounds` from the measured norms, as ``(names, (19, H) tensor)``.

    Args:
        p, kap, nu: ``(B, H)`` ``||P||_2``, ``||K||_2``, ``||V||_2`` per sequence and head.
        gam: ``(B, H)`` ``||g W_O^h^T||_F``.
        x, c, alpha, beta, w_o, L_b, d_K: as in :func:`attention_bounds`.
        scale, x_q, x_k, x_v: see :func:`_bound_pieces`.
    """
    c = kw["c"]
    J, func = _bound_pieces(**kw)
    outer = (c[:, None] * J[_ROWS] * J[_COLS]).sum(1)  # c ||J_X|| ||J_Y|| summed over the batch, (6, H)
    func = func.sum(1)  # (6, H)
    total = outer + func
    # whole QKV Hessian: spectral norm of the 3x3 matrix of block bounds (order Q, K, V)
    N = total[torch.tensor(_QKV, device=total.device)].permute(2, 0, 1)  # (3, 3, H) -> (H, 3, 3), symmetric, >= 0
    qkv = _perron_root(N)
    names = [n for k in _PAIRS for n in (f"outer/{k}", f"functional/{k}", k)] + ["QKV"]
    table = torch.cat([torch.stack([outer, func, total], 1).flatten(0, 1), qkv[None]])  # (19, H)
    return names, table


def grouped_attention_bound_tables(*, groups: int, **kw) -> tuple[tuple[list[str], torch.Tensor], ...]:
    """Bounds with ``G = groups`` query heads per kv group: per query head and per group.

    A group's ``W_K`` (``W_V``) reaches the output through each of its query heads, so its Jacobian bound is the
    sum of theirs (triangle inequality), ``||J_K^g|| <= sum_{h in g} ||J_K^h||``; a functional block of shared weights
    is the sum of the heads' (each bounded as before), and one with ``W_Q^h`` is head ``h``'s alone. The whole
    group Hessian over ``(Q^{g,0}, ..., Q^{g,G-1}, K^g, V^g)`` is bounded by the spectral norm of the
    ``(G + 2) x (G + 2)`` matrix of block bounds (``||H|| <= ||[||H_ij||]||_2`` for any block matrix); the blocks
    between two query heads of a group are outer only, ``c ||J_Q^h|| ||J_Q^h'||``.

    Returns:
        ``((names, (9, H)), (names, (10, H_kv)))``: ``QQ``, ``VQ``, ``QK`` per query head (outer, functional, total);
        ``VV``, ``KK``, ``VK`` and ``QKV`` per group.
    """
    G = groups
    cb = kw["c"][:, None]  # (B, 1)
    J, func = _bound_pieces(**kw)  # (3, B, H), (6, B, H)
    B, H = J.shape[1:]
    H_kv = H // G
    JQ = J[0]
    JK, JV = (j.unflatten(1, (H_kv, G)).sum(-1) for j in (J[1], J[2]))  # per group, (B, H_kv)
    JK_h, JV_h = JK.repeat_interleave(G, 1), JV.repeat_interleave(G, 1)  # the group's, per query head (B, H)
    outer_h = torch.stack([cb * JQ * JQ, cb * JV_h * JQ, cb * JQ * JK_h]).sum(1)  # QQ, VQ, QK: (3, H)
    func_h = func[[1, 3, 5]].sum(1)
    total_h = outer_h + func_h
    outer_g = torch.stack([cb * JV * JV, cb * JK * JK, cb * JV * JK]).sum(1)  # VV, KK, VK: (3, H_kv)
    func_g = func[[0, 2, 4]].unflatten(2, (H_kv, G)).sum((1, 3))
    total_g = outer_g + func_g
    JQg = JQ.unflatten(1, (H_kv, G))  # (B, H_kv, G)
    N = total_g.new_zeros(H_kv, G + 2, G + 2)  # order Q_0 .. Q_{G-1}, K, V
    N[:, :G, :G] = (cb[..., None, None] * JQg[..., :, None] * JQg[..., None, :]).sum(0)  # outer between query heads
    idx = torch.arange(G, device=N.device)
    N[:, idx, idx] += func_h[0].unflatten(0, (H_kv, G))  # + H_f(QQ) on the diagonal: the total QQ bound
    for col, row in ((G, total_h[2]), (G + 1, total_h[1])):  # QK, VQ
        N[:, :G, col] = N[:, col, :G] = row.unflatten(0, (H_kv, G))
    N[:, G, G], N[:, G + 1, G + 1] = total_g[1], total_g[0]
    N[:, G, G + 1] = N[:, G + 1, G] = total_g[2]
    qkv = _perron_root(N)
    names_h = [n for k in ("QQ", "VQ", "QK") for n in (f"outer/{k}", f"functional/{k}", k)]
    names_g = [n for k in ("VV", "KK", "VK") for n in (f"outer/{k}", f"functional/{k}", k)] + ["QKV"]
    table_h = torch.stack([outer_h, func_h, total_h], 1).flatten(0, 1)  # (9, H)
    table_g = torch.cat([torch.stack([outer_g, func_g, total_g], 1).flatten(0, 1), qkv[None]])  # (10, H_kv)
    return (names_h, table_h), (names_g, table_g)
