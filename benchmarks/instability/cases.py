"""The suite's mechanisms: for each, an unstable run and a stable control that differs in one knob.

Every mechanism is run on several seeds (the seed draws the weights and the batch order). The seeds in
:data:`TRAIN_SEEDS` are the ones the warning thresholds were chosen on; :data:`HELD_OUT_SEEDS` are scored
with the thresholds frozen. Most mechanisms raise their stressor gradually (a learning-rate ramp), so the
instability builds up over tens of steps, as it does in real runs, and a warning has something to lead.

====================  =====  ==================================================  ============================
mechanism             arch   unstable run                                        control (one knob)
====================  =====  ==================================================  ============================
``attn_logit``        gpt    pre-LN, lr ramped 1e-3 -> 1.0 over 400 steps        ramp to 0.1 (lower lr)
``attn_logit_llama``  llama  the same ramp on a LLaMA-style litgpt model         ramp to 0.1 (lower lr)
``logit_div``         torch  pre-LN, no LayerNorm before the head, ramp to 0.1   final LayerNorm restored
``rewarm``            gpt    trained 200 steps (3e-3, cosine), re-warmed to 0.3  re-warmed to 3e-3 (its peak)
``rewarm_llama``      llama  the same on the LLaMA-style model                   re-warmed to 3e-3 (its peak)
``postln_depth``      torch  post-LN, 6 layers, 2e-3 then ramped to 4e-2         pre-LN (``norm_first``)
``ln_collapse``       torch  embeddings under weight decay 1000: var -> eps      embedding weight decay 0.1
``ln_collapse_llama`` llama  the same on the LLaMA-style model (RMSNorm)         embedding weight decay 0.1
====================  =====  ==================================================  ============================

``logit_div`` also runs ``z_loss`` (the issue's suggested control: z-loss 1e-3 with the unstable model), scored
as what it turns out to be. Every run: d = 64, 2 heads, L = 64, batch 16, AdamW (0.9, 0.95), weight decay 0.1,
no clipping, monitor terms-only every step and full every 10 steps.

Another architecture: register it in :data:`benchmarks.instability.models.ARCHITECTURES` and add a
:class:`Mechanism` here (or an ``arch=`` variant of an existing one), as ``attn_logit_llama`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from benchmarks.instability.models import ModelSpec
from benchmarks.instability.train import RunConfig

TRAIN_SEEDS = (0, 1)
HELD_OUT_SEEDS = (2,)
QUICK_SEEDS = (0,)


@dataclass(frozen=True)
class Variant:
    """One run recipe of a mechanism.

    Args:
        name: ``"unstable"``, ``"control"`` or the name of an extra variant.
        role: ``"unstable"`` (expected to diverge), ``"control"`` (expected stable) or ``"extra"`` (scored as
            what it turns out to be).
        config: The run (its ``seed`` is replaced per seed).
    """

    name: str
    role: str
    config: RunConfig


@dataclass(frozen=True)
class Mechanism:
    """A reproducible instability and its control.

    Args:
        name: Identifier used in result files.
        title: One line for the docs.
        knob: What the control changes.
        variants: The runs.
        diverges: Whether the unstable run's loss is expected to show an onset (the collapse case is scored on
            the collapse itself).
    """

    name: str
    title: str
    knob: str
    variants: tuple[Variant, ...]
    diverges: bool = True


def _ramp(top: float, steps: int = 400, start: float = 1e-3) -> tuple[tuple[int, float], ...]:
    return ((0, start), (steps, top))


def mechanisms(quick: bool = False) -> list[Mechanism]:
    """The suite (``quick``: two shortened mechanisms on small models, seconds each)."""
    if quick:
        return _quick()
    gpt = ModelSpec(arch="gpt")
    llama = ModelSpec(arch="llama")
    torch_pre = ModelSpec(arch="torch")
    base = RunConfig(model=gpt, steps=400)
    attn = replace(base, lr=_ramp(1.0))
    logit = replace(base, model=replace(torch_pre, final_norm=False), lr=_ramp(0.1))
    rewarm = replace(base, lr=((0, 3e-4), (20, 3e-3), (200, 3e-4), (400, 0.3)))
    postln = replace(
        base,
        model=ModelSpec(arch="torch", norm="post", n_layer=6),
        lr=((0, 1e-4), (50, 2e-3), (200, 2e-3), (400, 4e-2)),
    )
    collapse = replace(
        base,
        model=replace(torch_pre, bias=False),
        lr=((0, 3e-4), (20, 3e-3)),
        emb_weight_decay=1000.0,
        emb_lr_mult=5e-3,
    )
    rewarm_mech = Mechanism(
        "rewarm",
        "learning-rate re-warm of a trained model (continued pretraining)",
        "re-warm peak 0.3 -> 3e-3",
        (
            Variant("unstable", "unstable", rewarm),
            Variant("control", "control", replace(rewarm, lr=((0, 3e-4), (20, 3e-3), (200, 3e-4), (400, 3e-3)))),
        ),
    )
    attn_logit = Mechanism(
        "attn_logit",
        "attention-logit growth at a high learning rate (no QK-norm)",
        "peak learning rate 1.0 -> 0.1",
        (Variant("unstable", "unstable", attn), Variant("control", "control", replace(attn, lr=_ramp(0.1)))),
    )
    ln_collapse = Mechanism(
        "ln_collapse",
        "LayerNorm variance collapse: embeddings shrink under strong weight decay",
        "embedding weight decay 1000 -> 0.1",
        (
            Variant("unstable", "unstable", collapse),
            Variant("control", "control", replace(collapse, emb_weight_decay=0.1)),
        ),
        diverges=False,
    )
    return [
        attn_logit,
        _on_model(
            attn_logit,
            llama,
            "attn_logit_llama",
            "attention-logit growth at a high learning rate, LLaMA-style (litgpt: RMSNorm, SwiGLU, rotary, GQA)",
        ),
        Mechanism(
            "logit_div",
            "output-logit divergence: no normalisation before the LM head",
            "final LayerNorm before the head",
            (
                Variant("unstable", "unstable", logit),
                Variant("control", "control", replace(logit, model=torch_pre)),
                Variant("z_loss", "extra", replace(logit, z_loss=1e-3)),
            ),
        ),
        rewarm_mech,
        _on_model(
            rewarm_mech,
            llama,
            "rewarm_llama",
            "learning-rate re-warm of a trained LLaMA-style model (litgpt: RMSNorm, SwiGLU, rotary, GQA)",
        ),
        Mechanism(
            "postln_depth",
            "6-layer post-LN pushed to a high learning rate",
            "LayerNorm placement post -> pre (norm_first)",
            (
                Variant("unstable", "unstable", postln),
                Variant("control", "control", replace(postln, model=replace(postln.model, norm="pre"))),
            ),
        ),
        ln_collapse,
        _on_model(
            ln_collapse,
            llama,
            "ln_collapse_llama",
            "RMSNorm collapse, LLaMA-style (litgpt): token embeddings shrink under strong weight decay",
        ),
    ]


def _on_model(mechanism: Mechanism, model: ModelSpec, name: str, title: str) -> Mechanism:
    """``mechanism`` with every variant on ``model``: the same recipe and knob on another architecture."""
    variants = tuple(replace(v, config=replace(v.config, model=model)) for v in mechanism.variants)
    return replace(mechanism, name=name, title=title, variants=variants)


def _quick() -> list[Mechanism]:
    """Two mechanisms on d = 32, L = 32 models, 120 steps: a divergence and a collapse."""
    small = ModelSpec(arch="gpt", d_model=32, seq_len=32)
    base = RunConfig(model=small, steps=100, batch_size=8, full_every=20, max_tokens=128, stop_after=10)
    attn = replace(base, lr=_ramp(2.0, steps=100))
    collapse = replace(
        base,
        model=ModelSpec(arch="torch", d_model=32, seq_len=32, bias=False),
        lr=((0, 3e-4), (10, 3e-3)),
        emb_weight_decay=1000.0,
        emb_lr_mult=2e-2,
    )
    return [
        Mechanism(
            "attn_logit",
            "attention-logit growth at a high learning rate (quick)",
            "peak learning rate 2.0 -> 0.03",
            (
                Variant("unstable", "unstable", attn),
                Variant("control", "control", replace(attn, lr=_ramp(0.03, steps=100))),
            ),
        ),
        Mechanism(
            "ln_collapse",
            "LayerNorm variance collapse (quick)",
            "embedding weight decay 1000 -> 0.1",
            (
                Variant("unstable", "unstable", collapse),
                Variant("control", "control", replace(collapse, emb_weight_decay=0.1)),
            ),
            diverges=False,
        ),
    ]
