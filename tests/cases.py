"""Data-driven cases for the closed-form tests: lists of dicts turned into seeded tensors."""

from __future__ import annotations

import torch

from curvwatch.closed_form import OutputLoss

DT = torch.float64

ATTENTION_CASES = [
    dict(B=None, L=5, d=4, d_K=3, d_V=2, causal=False, mode="target"),
    dict(B=None, L=4, d=3, d_K=2, d_V=4, causal=True, mode="target"),  # d != d_V, d_K < d
    dict(B=2, L=3, d=4, d_K=2, d_V=3, causal=True, mode="grad"),
    dict(B=2, L=4, d=3, d_K=2, d_V=3, causal=False, mode="target"),
    dict(B=None, L=1, d=3, d_K=2, d_V=2, causal=False, mode="target"),  # L = 1
    dict(B=None, L=2, d=3, d_K=2, d_V=3, causal=True, mode="grad"),  # L = 2
]

MHA_CASES = [
    dict(B=None, L=4, d=4, H=2, d_K=2, d_V=2, m=4, causal=True, mode="grad", bias=True, pad=False),
    dict(B=2, L=4, d=3, H=2, d_K=2, d_V=3, m=5, causal=False, mode="target", bias=False, pad=True),
    dict(B=2, L=3, d=4, H=3, d_K=1, d_V=2, m=4, causal=True, mode="grad", bias=True, pad=True),
]

LN_CASES = [
    dict(B=None, L=3, n=4, eps=0.0, affine=False),
    dict(B=2, L=2, n=5, eps=1e-5, affine=True),
    dict(B=None, L=2, n=3, eps=0.1, affine=True),
    dict(B=None, L=3, n=2, eps=0.3, affine=False),
    dict(B=None, L=2, n=6, eps=0.0, affine=True),
]

FFN_CASES = [
    dict(B=None, L=4, d=3, f=5, activation="relu", residual=True, mode="target"),
    dict(B=2, L=3, d=3, f=4, activation="gelu", residual=False, mode="grad"),
    dict(B=None, L=3, d=2, f=6, activation="gelu", residual=True, mode="target"),
]

BLOCK_CASES = [
    dict(
        B=None,
        L=3,
        d=4,
        H=1,
        d_K=2,
        f=5,
        norm="post",
        activation="relu",
        eps=0.0,
        causal=False,
        mode="target",
    ),
    dict(B=2, L=3, d=4, H=2, d_K=2, f=5, norm="pre", activation="gelu", eps=1e-5, causal=True, mode="grad"),
    dict(
        B=None, L=2, d=4, H=2, d_K=3, f=3, norm="post", activation="gelu", eps=0.1, causal=True, mode="grad"
    ),
    dict(
        B=None,
        L=1,
        d=3,
        H=1,
        d_K=2,
        f=4,
        norm="pre",
        activation="relu",
        eps=1e-5,
        causal=False,
        mode="target",
    ),
    dict(
        B=2, L=2, d=3, H=1, d_K=2, f=4, norm="post", activation="gelu", eps=1e-5, causal=False, mode="target"
    ),
]


def case_id(case: dict) -> str:
    return "-".join(f"{k}{v}" for k, v in case.items())


def rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=gen, dtype=DT)


def batch_shape(case: dict) -> tuple[int, ...]:
    return (case["B"],) if case["B"] else ()


def output_loss(gen: torch.Generator, case: dict, out_shape: tuple[int, ...]) -> OutputLoss:
    """The case's loss at the block output ``out_shape``: a random target, or a random output gradient with
    curvature 0.37."""
    if case["mode"] == "target":
        return OutputLoss(target=rand(gen, *out_shape))
    return OutputLoss(grad_output=rand(gen, *out_shape), output_curvature=0.37)
