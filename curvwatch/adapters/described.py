"""Layers you wrote yourself: describe where the sub-blocks are, in a few lines, instead of writing an adapter.

A :class:`LayerDescription` names the modules of one Transformer layer type by their dotted names inside the
layer (``"attn.wq"``), and :func:`describe_layer` registers an adapter built from it:

* attention: the ``nn.Linear`` projections ``q, k, v, o``, or ``qkv, o`` with one fused ``qkv`` projection (nanoGPT's
  ``c_attn``, split ``[q | k | v]`` in the forward), ``n_heads`` query heads and ``n_kv_heads`` key/value heads for
  grouped-query attention, the attention module whose forward gets ``X`` (default: the nearest module holding the
  projections), causality, an optional softmax scale and an optional rotary function that reads the ``(cos, sin)``
  tables from that module's call;
* norms: ``nn.LayerNorm``, ``nn.RMSNorm`` or any module with ``weight`` and ``eps`` that normalises by the root mean
  square (``"rmsnorm"``);
* the MLP: ``up`` and ``down`` (an FFN ``down(act(up(x)))``), plus ``gate`` for a gated MLP
  ``down(act(gate(x)) * up(x))``.

Everything else with parameters in the layer is named as not monitored in the set-up table. Errors name the missing
module and list the layer's modules.

Example:
    >>> class Layer(torch.nn.Module):
    ...     def __init__(self, d=8):
    ...         super().__init__()
    ...         self.norm = torch.nn.LayerNorm(d)
    ...         self.attn = torch.nn.Module()
    ...         for name in "qkvo":
    ...             setattr(self.attn, name, torch.nn.Linear(d, d))
    >>> describe_layer(Layer, LayerDescription(q="attn.q", k="attn.k", v="attn.v", o="attn.o", n_heads=2,
    ...                                       norms=("norm",)))
    >>> from curvwatch.adapters import ADAPTERS, find_blocks
    >>> [(s.name, s.kind) for s in find_blocks(Layer())]
    [('layer0/attn', 'attention'), ('layer0/norm', 'layernorm')]
    >>> del ADAPTERS[Layer]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor, nn

from curvwatch.adapters import register_adapter
from curvwatch.adapters._shared import (
    grouped_attention_params,
    leftover,
    norm_params,
    split_fused_qkv,
    squeeze_rotary,
)
from curvwatch.adapters.base import Adapter, BlockSpec, Masks
from curvwatch.adapters.projections import _linear, projection_features
from curvwatch.options import choice

__all__ = ["LayerDescription", "QKVLayout", "describe_layer"]

_FFN_ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
_GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


class QKVLayout(str, Enum):
    """How a fused ``qkv`` projection orders its output features (``d_K`` the head size, ``G = H / H_kv``)."""

    CONCAT = "concat"  # [q (H d_K) | k (H_kv d_K) | v (H_kv d_K)]: q, k, v = qkv(x).split(...) (nanoGPT)
    PER_HEAD = "per_head"  # per kv head g: [its G query heads | k_g | v_g]: .view(B, L, H_kv, G + 2, d_K) (GPT-NeoX)


@dataclass(frozen=True, kw_only=True)
class LayerDescription:
    """Where the sub-blocks of one layer type are; module names are dotted paths inside the layer (keyword arguments).

    Args:
        q, k, v, o: The ``nn.Linear`` query, key, value and output projections (``q.out_features = n_heads d_K``,
            ``k``/``v``: ``n_kv_heads d_K``; heads are consecutive column groups, as ``view(B, L, H, d_K)`` reads them).
            ``o`` is always needed; ``q, k, v`` unless ``qkv`` is given.
        qkv: One fused ``nn.Linear`` in place of ``q, k, v`` (not with them), with ``(n_heads + 2 n_kv_heads) d_K``
            outputs, ``d_K = o.in_features / n_heads`` (values of another head size: write an Adapter subclass).
        qkv_layout: The order of the fused outputs (:class:`QKVLayout`): ``"concat"`` ``[q | k | v]``, each head a
            consecutive column group (``q, k, v = qkv(x).split([H d_K, H_kv d_K, H_kv d_K], dim=-1)``: nanoGPT and
            most hand-written code), or ``"per_head"``: for each key/value head ``g`` its ``n_heads / n_kv_heads``
            query heads, then its key, then its value (``qkv(x).view(B, L, H_kv, H / H_kv + 2, d_K)``: GPT-NeoX for
            ``n_kv_heads = n_heads``). Another interleaving needs an Adapter subclass.
        n_heads: Query heads.
        n_kv_heads: Key/value heads (grouped-query attention; ``None``: ``n_heads``).
        attention: The module whose forward's first argument is the attention input ``X`` (default: the nearest
            module holding ``q, k, v, o``).
        causal: Whether query ``i`` sees only keys ``j <= i``.
        scale: Softmax scale of the scores (``None``: ``1/sqrt(d_K)``).
        rotary: ``(args, kwargs) -> (cos, sin)`` of the attention module's call: the rotary tables applied to the
            queries and keys of every head, ``(L, r)`` or ``(B, L, r)`` with ``r <= d_K`` rotated dimensions, in the
            half-split layout (dimension ``i`` pairs with ``i + r/2``) unless ``rotary_interleaved``. ``None``: no
            rotary embedding.
        rotary_interleaved: The GPT-J layout (``2i`` pairs with ``2i + 1``).
        norms: The norm modules to monitor (``("ln_1", "ln_2")``); each is a block named after its path.
        up, down: The MLP's input and output ``nn.Linear`` (``None``: no MLP block).
        gate: The gate ``nn.Linear`` of a gated MLP (SwiGLU: ``down(silu(gate(x)) * up(x))``), or ``None``.
        activation: ``"relu"``, ``"gelu"``, ``"gelu_tanh"`` (FFN) or ``"silu"``, ``"gelu"``, ``"gelu_tanh"`` (gated).

    Raises:
        ValueError: If ``qkv`` is given with ``q``/``k``/``v`` or neither is complete, for an unknown ``qkv_layout``,
            heads that are not ints >= 1, half an MLP or an activation its MLP does not have.

    Example:
        A nanoGPT-style attention, ``q, k, v = self.c_attn(x).split([4 * 2, 2 * 2, 2 * 2], dim=2)``:

        >>> class Fused(torch.nn.Module):
        ...     def __init__(self, d=8):
        ...         super().__init__()
        ...         self.ln_1, self.attn = torch.nn.LayerNorm(d), torch.nn.Module()
        ...         self.attn.c_attn, self.attn.c_proj = torch.nn.Linear(d, 16), torch.nn.Linear(d, d)
        >>> describe_layer(Fused, LayerDescription(qkv="attn.c_attn", o="attn.c_proj", n_heads=4, n_kv_heads=2,
        ...                                       norms=("ln_1",)))
        >>> from curvwatch.adapters import ADAPTERS, find_blocks
        >>> attn = find_blocks(Fused())[0]
        >>> {k: tuple(attn.adapter.read_params(attn)[k].shape) for k in ("W_Q", "W_K", "W_V")}
        {'W_Q': (8, 8), 'W_K': (8, 4), 'W_V': (8, 4)}
        >>> del ADAPTERS[Fused]
    """

    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    qkv_layout: QKVLayout | str = QKVLayout.CONCAT
    o: str
    n_heads: int
    n_kv_heads: int | None = None
    attention: str | None = None
    causal: bool = True
    scale: float | None = None
    rotary: Callable[[tuple, dict], tuple[Tensor, Tensor]] | None = None
    rotary_interleaved: bool = False
    norms: tuple[str, ...] = ()
    up: str | None = None
    down: str | None = None
    gate: str | None = None
    activation: str = "gelu"

    def __post_init__(self) -> None:
        separate = {"q": self.q, "k": self.k, "v": self.v}
        given = ", ".join(f"{name}={path!r}" for name, path in separate.items())
        if self.qkv is not None and any(path is not None for path in separate.values()):
            raise ValueError(
                f"Invalid qkv={self.qkv!r} together with {given}: name either the fused projection (qkv=) or the "
                "three projections (q=, k=, v=), not both."
            )
        if self.qkv is None and any(path is None for path in separate.values()):
            raise ValueError(f"Invalid {given}: name all three projections q=, k=, v=, or one fused qkv=.")
        object.__setattr__(self, "qkv_layout", choice("qkv_layout", self.qkv_layout, QKVLayout))
        if self.qkv is None and self.qkv_layout is not QKVLayout.CONCAT:
            raise ValueError(f"Invalid qkv_layout={self.qkv_layout.value!r} without qkv=: it orders a fused qkv.")
        for name in ("n_heads", "n_kv_heads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Invalid {name}={value!r}. Must be an int >= 1.")
        if (self.up is None) != (self.down is None):
            raise ValueError(f"Invalid up={self.up!r}, down={self.down!r}: name both MLP projections, or neither.")
        if self.gate is not None and self.up is None:
            raise ValueError(f"Invalid gate={self.gate!r}: a gated MLP also needs up= and down=.")
        allowed = _GATED_ACTIVATIONS if self.gate is not None else _FFN_ACTIVATIONS
        if self.up is not None and self.activation not in allowed:
            kind = "gated MLP" if self.gate is not None else "FFN"
            raise ValueError(f"Invalid activation={self.activation!r} for a {kind}. Must be one of {allowed}.")


def describe_layer(layer_type: type, description: LayerDescription) -> None:
    """Register an adapter for ``layer_type`` built from ``description`` (see the module docstring).

    Raises:
        TypeError: If ``layer_type`` is not an ``nn.Module`` subclass or ``description`` not a LayerDescription.
    """
    if not isinstance(description, LayerDescription):
        raise TypeError(f"Invalid description={description!r}. Must be a curvwatch.adapters.LayerDescription.")
    register_adapter(layer_type, DescribedAdapter(description))


class DescribedAdapter(Adapter):
    """The adapter of a :class:`LayerDescription` (:func:`describe_layer` registers it)."""

    def __init__(self, description: LayerDescription) -> None:
        self.d = description

    def _get(self, layer: nn.Module, path: str, linear: bool = False) -> nn.Module:
        try:
            module = layer.get_submodule(path)
        except AttributeError:
            names = [n for n, _ in layer.named_modules() if n][:30]
            raise ValueError(
                f"{type(layer).__name__} has no module {path!r} (from its LayerDescription); its modules are "
                f"{names}. Use dotted names relative to the layer."
            ) from None
        if linear and projection_features(module) is None:
            raise ValueError(
                f"{type(layer).__name__}.{path} is a {type(module).__name__}; the LayerDescription needs an nn.Linear "
                "(or a LoRA wrapper of one) there (a fused q|k|v projection: qkv=; other fused projections: register "
                "an Adapter subclass)."
            )
        return module

    def _features(self, layer: nn.Module, path: str) -> tuple[int, int]:
        """``(d_in, d_out)`` of the projection at ``path`` (an ``nn.Linear`` or a wrapper of one)."""
        return projection_features(self._get(layer, path, linear=True))

    def _projections(self) -> tuple[str, ...]:
        """The attention's projection paths: ``(qkv, o)`` or ``(q, k, v, o)``."""
        d = self.d
        return (d.qkv, d.o) if d.qkv is not None else (d.q, d.k, d.v, d.o)

    def _heads(self, layer: nn.Module) -> tuple[int, int, int]:
        """``(H, H_kv, d_K)``, checked against the projections' sizes.

        Raises:
            ValueError: If the heads do not divide the projections, or a fused ``qkv`` has another width than
                ``(H + 2 H_kv) d_K``.
        """
        d = self.d
        H, H_kv = d.n_heads, d.n_kv_heads or d.n_heads
        name = type(layer).__name__
        if d.qkv is None:
            q_out, k_out = self._features(layer, d.q)[1], self._features(layer, d.k)[1]
            if q_out % H or k_out % H_kv or H % H_kv:
                raise ValueError(
                    f"{name}: q has {q_out} outputs and k {k_out}, which n_heads={H} "
                    f"and n_kv_heads={H_kv} do not divide into heads (or n_kv_heads does not divide n_heads)."
                )
            return H, H_kv, q_out // H
        qkv_out, o_in = self._features(layer, d.qkv)[1], self._features(layer, d.o)[0]
        d_K = o_in // H
        if H % H_kv or o_in % H or qkv_out != (H + 2 * H_kv) * d_K:
            raise ValueError(
                f"{name}: qkv={d.qkv!r} has {qkv_out} outputs, but n_heads={H} and n_kv_heads={H_kv} with "
                f"head size d_K = o.in_features / n_heads = {o_in}/{H} need (n_heads + 2 n_kv_heads) d_K = "
                f"{(H + 2 * H_kv) * d_K} (and n_kv_heads dividing n_heads). Fix: n_heads and n_kv_heads as your "
                "forward splits qkv (.split([H d_K, H_kv d_K, H_kv d_K])); value heads of another size need an "
                "Adapter subclass."
            )
        return H, H_kv, d_K

    def _attention_module(self, layer: nn.Module) -> nn.Module:
        if self.d.attention is not None:
            return self._get(layer, self.d.attention)
        parts = [p.split(".")[:-1] for p in self._projections()]
        common = []
        for names in zip(*parts, strict=False):
            if len(set(names)) > 1:
                break
            common.append(names[0])
        return self._get(layer, ".".join(common)) if common else layer

    def specs(self, layer: nn.Module, index: int) -> list[BlockSpec]:
        d = self.d
        for path in self._projections():
            self._get(layer, path, linear=True)
        self._heads(layer)
        specs = [BlockSpec(f"layer{index}/attn", index, "attention", self._attention_module(layer), self, layer)]
        for path in d.norms:
            norm = self._get(layer, path)
            kind = norm_params(norm)[0]
            specs.append(BlockSpec(f"layer{index}/{path.replace('.', '_')}", index, kind, norm, self, layer))
        if d.up is not None:
            first = self._get(layer, d.gate or d.up, linear=True)
            self._get(layer, d.down, linear=True)
            kind = "gated_ffn" if d.gate is not None else "ffn"
            specs.append(BlockSpec(f"layer{index}/ffn", index, kind, first, self, layer))
        return specs

    def capture_modules(self, spec: BlockSpec) -> tuple[nn.Module, nn.Module, nn.Module]:
        layer = spec.layer_module
        attention = self._attention_module(layer)
        if spec.kind == "attention":
            return attention, self._get(layer, self.d.o), attention
        if spec.kind in ("ffn", "gated_ffn"):
            return spec.module, self._get(layer, self.d.down), attention
        return spec.module, spec.module, attention

    def read_masks(self, spec: BlockSpec, args: tuple, kwargs: dict) -> Masks:
        rotary = None
        if self.d.rotary is not None:
            cos, sin = self.d.rotary(args, kwargs)
            rotary = squeeze_rotary(cos, sin)
        return Masks(causal=self.d.causal, rotary=rotary, rotary_interleaved=self.d.rotary_interleaved)

    def read_params(self, spec: BlockSpec) -> dict[str, Any]:
        layer, d = spec.layer_module, self.d
        if spec.kind in ("layernorm", "rmsnorm"):
            return norm_params(spec.module)[1]
        if spec.kind == "gated_ffn":
            projections = (_linear(self._get(layer, p)) for p in (d.gate, d.up, d.down))
            (W_gate, b_gate), (W_up, b_up), (W_down, b_down) = projections
            return dict(W_gate=W_gate, W_up=W_up, W_down=W_down, b_gate=b_gate, b_up=b_up, b_down=b_down,
                        activation=d.activation)  # fmt: skip
        if spec.kind == "ffn":
            (W_1, b_1), (W_2, b_2) = (_linear(self._get(layer, p)) for p in (d.up, d.down))
            return dict(W_1=W_1, W_2=W_2, b_1=b_1, b_2=b_2, activation=d.activation, residual=False)
        H, H_kv, d_K = self._heads(layer)
        W_O, b_O = _linear(self._get(layer, d.o))
        if d.qkv is None:
            (W_Q, b_Q), (W_K, b_K), (W_V, b_V) = (_linear(self._get(layer, p)) for p in (d.q, d.k, d.v))
        else:
            W, b = _linear(self._get(layer, d.qkv))  # (d, (H + 2 H_kv) d_K), (H + 2 H_kv) d_K
            W_Q, W_K, W_V = split_fused_qkv(W, d.qkv_layout, H, H_kv, d_K)
            b_Q, b_K, b_V = (None, None, None) if b is None else split_fused_qkv(b, d.qkv_layout, H, H_kv, d_K)
        scale = d_K**-0.5 if d.scale is None else float(d.scale)
        return grouped_attention_params((W_Q, W_K, W_V, W_O), (b_Q, b_K, b_V, b_O), H, H_kv, scale, d_K, None)

    def unmonitored(self, layer: nn.Module) -> list[tuple[str, str]]:
        d = self.d
        paths = [*self._projections(), *d.norms, *(p for p in (d.up, d.down, d.gate) if p is not None)]
        return leftover(layer, [layer.get_submodule(p) for p in paths])


# keep torch referenced for the doctest namespace
_ = torch
