"""The public closed forms with their documented defaults at the sizes people train (Lanczos bases allocated for
``max_iter`` = the block size would take 48 GiB for one self-attention call).

With the default :class:`~curvwatch.closed_form.Lanczos` (tol 1e-3, at most 100 steps and 16 vectors per norm)
every call below finishes in seconds, every norm converges (an unconverged one would raise its LanczosWarning:
pytest runs with warnings as errors) and the memory the bases take is bounded by ``max_basis``.
"""

from __future__ import annotations

import time

import pytest
import torch

from curvwatch.closed_form import (
    AttentionStructure,
    AttentionWeights,
    FFNWeights,
    Lanczos,
    OutputLoss,
    ffn,
    multi_head_attention,
    self_attention,
)

CAUSAL = AttentionStructure(causal=True)

pytestmark = pytest.mark.slow


def _w(gen, *shape):
    return torch.randn(*shape, generator=gen) / shape[0] ** 0.5


def _converged(out):
    tol = Lanczos().tol
    residuals = {k: float(v) for k, v in out.items() if k.startswith("residual/")}
    assert residuals, "no Lanczos norm was computed"
    assert all(r <= tol for r in residuals.values()), residuals
    assert all(torch.isfinite(v).all() for v in out.values())


def test_self_attention_defaults_at_L_d_512():
    gen = torch.Generator().manual_seed(0)
    L = d = 512
    X = torch.randn(L, d, generator=gen)
    weights = AttentionWeights(_w(gen, d, 64), _w(gen, d, 64), _w(gen, d, 64))
    out = self_attention(X, weights, loss=OutputLoss(grad_output=torch.randn(L, 64, generator=gen)))
    _converged(out)
    assert "residual/outer/VV" in out  # d > 256: the VV Gram eigenvalue is a (small) Lanczos norm too


def test_multi_head_attention_defaults_at_B4_L128_d256():
    gen = torch.Generator().manual_seed(1)
    X, G = torch.randn(4, 128, 256, generator=gen), torch.randn(4, 128, 256, generator=gen)
    W = [_w(gen, 256, 256) for _ in range(4)]
    out = multi_head_attention(X, AttentionWeights(*W, n_heads=4), loss=OutputLoss(grad_output=G), structure=CAUSAL)
    _converged(out)
    assert sum(k.startswith("hessian/QQ/h") for k in out) == 4


def test_signals_terms_tier_at_B4_L512_d512_gqa():
    """The monitor's default terms-only evaluation (``terms="signals"``, exact ``VV`` only) at a training size with
    grouped-query attention (``VV`` per kv group is then a Lanczos norm over ``d``-vectors): seconds, converged,
    and the same numbers as the full terms tier."""
    gen = torch.Generator().manual_seed(3)
    B, L, d, H, H_kv = 4, 512, 512, 8, 2
    X, G = torch.randn(B, L, d, generator=gen), torch.randn(B, L, d, generator=gen)
    W_Q, W_K, W_V, W_O = _w(gen, d, d), _w(gen, d, d // 4), _w(gen, d, d // 4), _w(gen, d, d)
    weights = AttentionWeights(W_Q, W_K, W_V, W_O, n_heads=H, n_kv_heads=H_kv)
    kw = dict(loss=OutputLoss(grad_output=G), structure=CAUSAL, pairs=("VV",))
    start = time.perf_counter()
    signals = multi_head_attention(X, weights, terms="signals", **kw)
    seconds = time.perf_counter() - start
    _converged(signals)
    everything = multi_head_attention(X, weights, **kw)
    assert {k for k in signals if k.startswith("term/")} < {k for k in everything if k.startswith("term/")}
    for key, value in signals.items():
        if not key.startswith(("residual/", "lanczos/")):
            torch.testing.assert_close(value, everything[key], rtol=1e-5, atol=0, msg=key)
    assert seconds < 60, seconds


def test_ffn_defaults_at_L128_d256_dff1024():
    gen = torch.Generator().manual_seed(2)
    Y, G = torch.randn(128, 256, generator=gen), torch.randn(128, 256, generator=gen)
    out = ffn(Y, FFNWeights(_w(gen, 256, 1024), _w(gen, 1024, 256)), activation="gelu", loss=OutputLoss(grad_output=G))
    _converged(out)


def test_unconverged_default_call_warns_and_says_how_to_fix():
    gen = torch.Generator().manual_seed(3)
    Y, G = torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen)
    with pytest.warns(UserWarning, match=r"stopped at max_iter=2 above tol=0.001.*Lanczos\(max_iter=\.\.\.\)"):
        ffn(
            Y,
            FFNWeights(_w(gen, 16, 64), _w(gen, 64, 16)),
            activation="gelu",
            loss=OutputLoss(grad_output=G),
            lanczos=Lanczos(max_iter=2),
        )


def test_sampled_sharpness_defaults_at_B4_L128_d256_with_16_samples():
    """The real-loss keys (16 samples, an Adam-like preconditioner) at the default Lanczos settings: converged."""
    gen = torch.Generator().manual_seed(4)
    X, G = torch.randn(4, 128, 256, generator=gen), torch.randn(4, 128, 256, generator=gen) * 1e-3
    S = torch.randn(16, 4, 128, 256, generator=gen) * 1e-2
    W = [_w(gen, 256, 256) for _ in range(4)]
    P = {name: torch.rand(256, 256, generator=gen) + 0.5 for name in ("W_Q", "W_K", "W_V")}
    start = time.perf_counter()
    out = multi_head_attention(
        X,
        AttentionWeights(*W, n_heads=4),
        loss=OutputLoss(grad_output=G, output_samples=S),
        structure=CAUSAL,
        precondition=P,
    )
    elapsed = time.perf_counter() - start
    _converged(out)
    assert sum(k.startswith("precond_sharpness/QQ/h") for k in out) == 4 and elapsed < 120
    Y = torch.randn(128, 256, generator=gen)
    weights = FFNWeights(_w(gen, 256, 1024), _w(gen, 1024, 256))
    out = ffn(Y, weights, activation="gelu", loss=OutputLoss(grad_output=G[0], output_samples=S[:, 0]))
    _converged(out)
    assert "sharpness/W1W1" in out
