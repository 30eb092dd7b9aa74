"""Closed-form gated-MLP (SwiGLU, GeGLU) Hessian blocks against torch.func (curvwatch.reference.gated_ffn).

Block names: W1 = W_gate, W3 = W_up, W2 = W_down (LLaMA's w1, w3, w2).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian, vmap

from curvwatch import reference
from curvwatch.closed_form import GatedFFNWeights, OutputLoss
from curvwatch.closed_form.gated_ffn import (
    GATE_OFF,
    GATED_FFN_PAIRS,
    GatedFFNOperator,
    gated_activation_derivatives,
    gated_ffn,
)
from curvwatch.closed_form.settings import EXACT, Lanczos
from curvwatch.reference.gated_ffn import gated_ffn_blocks, gated_ffn_forward
from tests.cases import DT, case_id, rand
from tests.utils import TOL, assert_close_report

# m: output width (the down projection need not map back to d); mask: drop a seeded subset of tokens
# (never a whole sequence); bias: random b_gate, b_up, b_down
GATED_CASES = [
    dict(B=None, L=1, d=3, f=4, m=2, activation="silu", bias=False, mask=False, mode="target"),  # L = 1
    dict(B=None, L=4, d=3, f=5, m=3, activation="silu", bias=True, mask=False, mode="grad"),
    dict(B=2, L=3, d=3, f=4, m=2, activation="silu", bias=False, mask=True, mode="target"),
    dict(B=2, L=1, d=2, f=3, m=2, activation="silu", bias=True, mask=False, mode="grad"),  # batched L = 1
    dict(B=2, L=3, d=2, f=4, m=3, activation="gelu", bias=True, mask=True, mode="grad"),
    dict(B=None, L=3, d=4, f=3, m=4, activation="gelu", bias=False, mask=False, mode="target"),  # f < d
    dict(B=2, L=2, d=3, f=4, m=3, activation="gelu_tanh", bias=True, mask=False, mode="target"),
    dict(B=None, L=5, d=2, f=3, m=1, activation="gelu_tanh", bias=False, mask=True, mode="grad"),  # m = 1
]


def _problem(case: dict, seed: int = 0) -> tuple[tuple, dict]:
    """Seeded ``(Y, weights)`` and the keyword arguments shared by kernel and reference."""
    gen = torch.Generator().manual_seed(seed)
    bs = (case["B"],) if case["B"] else ()
    d, f, m, L = case["d"], case["f"], case["m"], case["L"]
    Y, W = rand(gen, *bs, L, d), (rand(gen, d, f), rand(gen, d, f), rand(gen, f, m))
    biases = dict(b_gate=rand(gen, f), b_up=rand(gen, f), b_down=rand(gen, m)) if case["bias"] else {}
    args = (Y, GatedFFNWeights(*W, **biases))
    kw: dict = {"activation": case["activation"]}
    if case["mode"] == "target":
        kw["loss"] = OutputLoss(target=rand(gen, *bs, L, m))
    else:
        kw["loss"] = OutputLoss(grad_output=rand(gen, *bs, L, m), output_curvature=0.37)
    if case["mask"]:
        mask = torch.rand(case["B"] or 1, L, generator=gen) < 0.6
        mask[:, 0] = True  # every sequence keeps a token
        kw["row_mask"] = mask if case["B"] else mask[0]
    return args, kw


@pytest.mark.parametrize("case", GATED_CASES, ids=case_id)
def test_dense_blocks_and_norms_match_autograd(case):
    args, kw = _problem(case)
    ref = gated_ffn_blocks(*args, **kw)
    out = gated_ffn(*args, dense=True, lanczos=EXACT, **kw)
    assert len(ref) == 3 * len(GATED_FFN_PAIRS)
    norms = reference.dense_to_norms(ref)
    for key, mat in ref.items():
        assert_close_report(out[f"dense/{key}"], mat, TOL["float64"], name=key, atol=1e-13)
        assert_close_report(out[key], norms[key], TOL["float64"], name=key, atol=1e-13)


@pytest.mark.parametrize("case", GATED_CASES, ids=case_id)
def test_exact_blocks(case):
    """F is linear in W_down, and in W_up for fixed W_gate, W_down: functional W2W2 and W3W3 vanish (autograd
    agrees), so their Hessian blocks are the outer ones; W2W2 is a Gram eigenvalue (no Lanczos). The gate is
    not linear: its functional blocks do not vanish."""
    args, kw = _problem(case)
    ref = gated_ffn_blocks(*args, **kw)
    out = gated_ffn(*args, **kw)
    for p in ("W3W3", "W2W2"):
        assert ref[f"functional/{p}"].abs().max() <= 1e-14 * ref[f"outer/{p}"].abs().max()
        assert float(out[f"functional/{p}"]) == 0.0
        assert torch.equal(out[f"hessian/{p}"], out[f"outer/{p}"])
    assert not any("W2W2" in k for k in out if k.startswith("residual/"))  # W2W2 is exact
    for p in ("W1W1", "W1W3", "W1W2", "W3W2"):
        assert reference.spectral_norm(ref[f"functional/{p}"]) > 1e-6 * reference.spectral_norm(ref[f"outer/{p}"])
        assert float(out[f"functional/{p}"]) > 0.0
    # the exact W2W2 norm: lambda_max(sum_b c_b Hid_b^T Hid_b), by SVD of the stacked sqrt(c_b) Hid_b
    assert_close_report(out["outer/W2W2"], reference.spectral_norm(ref["outer/W2W2"]), TOL["float64"], name="W2W2")


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_gate_activation_derivatives(activation):
    z = torch.linspace(-12, 12, 241, dtype=DT)
    f = {
        "silu": torch.nn.functional.silu,
        "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    }[activation]
    a, a1, a2 = gated_activation_derivatives(z, activation)
    assert_close_report(a, f(z), TOL["float64"], name="act")
    assert_close_report(a1, vmap(grad(f))(z), TOL["float64"], name="act'")
    assert_close_report(a2, vmap(grad(grad(f)))(z), TOL["float64"], name="act''")


class _LlamaMLP(nn.Module):
    """The LLaMA / Mistral / Qwen MLP: ``down_proj(act(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, d: int, f: int, act: nn.Module):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize(("activation", "act"), [("silu", nn.SiLU()), ("gelu_tanh", nn.GELU(approximate="tanh"))])
def test_matches_llama_mlp_module(activation, act):
    """The kernel's forward and Hessian are those of an nn.Linear gated MLP, weights passed as ``.weight.T``."""
    torch.manual_seed(5)
    d, f, L = 3, 4, 5
    mlp = _LlamaMLP(d, f, act).to(DT)
    x = torch.randn(L, d, dtype=DT)
    names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    weights = [mlp.get_parameter(n).detach() for n in names]
    W = [w.T for w in weights]  # math convention
    with torch.no_grad():
        F_module = mlp(x)
    forward = gated_ffn_forward(x[None], GatedFFNWeights(*W), activation)[0]
    assert_close_report(forward, F_module, 1e-15, name="forward")
    # target = the module's output: the residual vanishes, so does every functional block (the kernel's forward
    # agrees with the module's); a wrong forward would leave an O(1) residual
    out0 = gated_ffn(x, GatedFFNWeights(*W), activation=activation, loss=OutputLoss(target=F_module), lanczos=EXACT)
    for p in GATED_FFN_PAIRS:
        assert float(out0[f"functional/{p}"]) <= 1e-12 * float(out0[f"outer/{p}"])
    # the Hessian of the module's loss in its own (out, in) weights, permuted to the kernel's vec_r of W = weight.T
    T = torch.randn(L, d, dtype=DT)

    def loss(*ws):
        F = functional_call(mlp, dict(zip(names, ws, strict=True)), (x,))
        return ((F - T) ** 2).sum() / (L * d)

    H = hessian(loss, argnums=(0, 1, 2))(*weights)
    out = gated_ffn(x, GatedFFNWeights(*W), activation=activation, loss=OutputLoss(target=T), dense=True)
    index = {"W1": 0, "W3": 1, "W2": 2}
    for p in GATED_FFN_PAIRS:
        i, j = index[p[:2]], index[p[2:]]
        expected = H[i][j].permute(1, 0, 3, 2).reshape(weights[i].numel(), weights[j].numel())
        assert_close_report(out[f"dense/hessian/{p}"], expected, TOL["float64"], name=p)


def test_statistics_and_terms():
    gen = torch.Generator().manual_seed(6)
    B, L, d, f, m = 2, 4, 3, 6, 2
    Y, W_g, W_u, W_d = rand(gen, B, L, d), rand(gen, d, f), rand(gen, d, f), rand(gen, f, m)
    b_g = torch.zeros(f, dtype=DT)
    b_g[0] = -1e3  # unit 0: gate off on every token
    b_g[1] = 1e3  # unit 1: gate always on
    mask = torch.tensor([[True, True, False, True], [True, False, True, True]])
    Y[0, 2] = 1e3  # a dropped token with huge pre-activations must not count anywhere
    out = gated_ffn(Y, GatedFFNWeights(W_g, W_u, W_d, b_gate=b_g), loss=OutputLoss(grad_output=rand(gen, B, L, m)),
                    row_mask=mask, pairs=["W2W2"])  # fmt: skip
    Z = (Y @ W_g + b_g)[mask]  # (kept tokens, f)
    assert float(out["gate_saturation"]) == pytest.approx(float((Z < GATE_OFF).double().mean()))
    assert float(out["active_fraction"]) == pytest.approx(float((Z > 0).double().mean()))
    assert float(out["dead_fraction"]) == pytest.approx(float((Z.amax(0) < GATE_OFF).double().mean()))
    assert float(out["dead_fraction"]) >= 1 / f  # unit 0 at least
    assert float(out["gate_saturation"]) >= 1 / f
    Hid = torch.nn.functional.silu(Y @ W_g + b_g) * (Y @ W_u) * mask[..., None]
    spec = lambda M: torch.linalg.matrix_norm(M, ord=2)
    assert_close_report(out["term/y_norm"], spec(Y * mask[..., None]).max(), TOL["float64"], name="y_norm")
    assert_close_report(out["term/hidden_norm"], spec(Hid).max(), TOL["float64"], name="hidden_norm")
    for key, w in (("wgate", W_g), ("wup", W_u), ("wdown", W_d)):
        assert_close_report(out[f"term/{key}_norm"], spec(w), TOL["float64"], name=key)


def test_pair_and_part_subsets_agree_with_the_full_call():
    args, kw = _problem(GATED_CASES[1], seed=7)
    full = gated_ffn(*args, lanczos=EXACT, **kw)
    only_w3 = gated_ffn(*args, pairs=["W3W3"], parts=("functional",), lanczos=EXACT, **kw)
    assert {k for k in only_w3 if "/" in k and not k.startswith("term/")} == {"functional/W3W3"}  # no Lanczos
    hess = gated_ffn(*args, pairs=["W3W3", "W1W2"], parts=("hessian",), lanczos=EXACT, **kw)
    assert_close_report(hess["hessian/W3W3"], full["outer/W3W3"], TOL["float64"], name="W3W3")
    assert_close_report(hess["hessian/W1W2"], full["hessian/W1W2"], TOL["float64"], name="W1W2")
    assert "outer/W1W2" not in hess
    exact_only = gated_ffn(*args, pairs="W2W2", **kw)  # needs no operator (no act', act'')
    assert not any(k.startswith("residual/") for k in exact_only)
    assert torch.equal(exact_only["outer/W2W2"], full["outer/W2W2"])


def test_float32_agrees_with_float64():
    args, kw = _problem(GATED_CASES[4], seed=3)
    o64 = gated_ffn(*args, lanczos=EXACT, **kw)
    Y, weights = args
    loss = kw["loss"]
    weights32 = GatedFFNWeights(*(None if w is None else w.float() for w in vars(weights).values()))
    loss32 = OutputLoss(grad_output=loss.grad_output.float(), output_curvature=loss.output_curvature)
    o32 = gated_ffn(Y.float(), weights32, lanczos=EXACT, **{**kw, "loss": loss32})
    assert o32.keys() == o64.keys()
    for k, v in o64.items():
        assert o32[k].dtype == torch.float32
        assert_close_report(o32[k], v, TOL["float32"], name=k, atol=1e-6)


@pytest.mark.slow
def test_default_lanczos_at_a_llama_like_size(monkeypatch):
    """L = 128, d = 256, f = 688 (LLaMA's f ~ 8/3 d): bounded products, every norm converged, no warning."""
    gen = torch.Generator().manual_seed(8)
    L, d, f = 128, 256, 688
    Y, G = torch.randn(L, d, generator=gen), torch.randn(L, d, generator=gen) / (L * d)
    W = [torch.randn(*s, generator=gen) / s[0] ** 0.5 for s in ((d, f), (d, f), (f, d))]
    products = []
    apply = GatedFFNOperator.apply

    def counting(self, tangent, *a, **k):
        products.append(next(iter(tangent.values())).shape[0])
        return apply(self, tangent, *a, **k)

    monkeypatch.setattr(GatedFFNOperator, "apply", counting)
    t0 = time.perf_counter()
    out = gated_ffn(Y, GatedFFNWeights(*W), loss=OutputLoss(grad_output=G))  # a LanczosWarning would raise
    seconds = time.perf_counter() - t0
    tol, runs = Lanczos().tol, 5  # W1W1, W3W3 (outer only), W1W3, W1W2, W3W2; W2W2 is exact
    residuals = {k: float(v) for k, v in out.items() if k.startswith("residual/")}
    assert len(residuals) == 3 * runs - 1  # hessian/W3W3 shares the outer run; functional/W3W3 = 0 exactly
    assert all(r <= tol for r in residuals.values()), residuals
    assert all(torch.isfinite(v).all() for v in out.values())
    assert len(products) <= runs * Lanczos().max_iter, len(products)
    print(f"gated_ffn L={L} d={d} f={f} float32: {seconds:.1f} s, {len(products)} operator products")


def test_bad_input_says_how_to_fix():
    Y = torch.randn(3, 4, dtype=DT)
    Wg, Wu, Wd = torch.randn(4, 5, dtype=DT), torch.randn(4, 5, dtype=DT), torch.randn(5, 2, dtype=DT)
    T = OutputLoss(target=torch.zeros(3, 2, dtype=DT))
    W = GatedFFNWeights(Wg, Wu, Wd)
    with pytest.raises(ValueError, match=r"activation='swish'.*'silu' for SwiGLU"):
        gated_ffn(Y, W, activation="swish", loss=T)
    with pytest.raises(ValueError, match=r"activation='relu'"):
        gated_activation_derivatives(Y, "relu")
    with pytest.raises(ValueError, match=r"W_up must have W_gate's shape \(d, f\) = \(4, 5\)"):
        gated_ffn(Y, GatedFFNWeights(Wg, torch.randn(4, 6, dtype=DT), Wd), loss=T)
    with pytest.raises(ValueError, match=r"W_gate has shape \(5, 4\).*nn.Linear.weight.T"):
        gated_ffn(Y, GatedFFNWeights(Wg.T, Wu, Wd), loss=T)  # the nn.Linear (out, in) layout
    with pytest.raises(ValueError, match=r"W_down has shape \(2, 5\).*nn.Linear.weight.T"):
        gated_ffn(Y, GatedFFNWeights(Wg, Wu, Wd.T), loss=OutputLoss(target=torch.zeros(3, 5, dtype=DT)))
    with pytest.raises(ValueError, match=r"target must have the output's shape \(3, 2\)"):
        gated_ffn(Y, W, loss=OutputLoss(target=Y))
    with pytest.raises(ValueError, match=r"Unknown gated-MLP pair 'W2W1'.*W1 = gate, W3 = up, W2 = down"):
        gated_ffn(Y, W, loss=T, pairs=["W2W1"])
    with pytest.raises(ValueError, match=r"Invalid parts"):
        gated_ffn(Y, W, loss=T, parts=("gn",))
    with pytest.raises(ValueError, match=r"Invalid row_mask shape \(2, 3\).*True = token in the loss"):
        gated_ffn(Y, W, loss=T, row_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"b_gate must have shape \(5,\)"):
        gated_ffn(Y, GatedFFNWeights(Wg, Wu, Wd, b_gate=torch.zeros(4, dtype=DT)), loss=T)
    with pytest.raises(ValueError, match=r"Pass exactly one of target="):
        gated_ffn(Y, W, loss=OutputLoss())
    with pytest.raises(ValueError, match=r"Invalid activation='swish'"):
        gated_ffn_blocks(Y, W, activation="swish", loss=T)
    with pytest.raises(ValueError, match=r"Invalid W_up shape \(4, 6\). Expected \(4, 5\)"):
        gated_ffn_blocks(Y, GatedFFNWeights(Wg, torch.randn(4, 6, dtype=DT), Wd), loss=T)
