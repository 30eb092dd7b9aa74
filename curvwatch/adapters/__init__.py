"""Model discovery: the table of Transformer layer types, their adapters and the ``BlockSpec``s they yield.

An adapter knows one layer type: which of its sub-modules carry each sub-block (``"attention"``, one
``"layernorm"`` per LayerNorm, ``"ffn"``), how to read their weights in the math convention ``X @ W``, which
module's forward input is ``X``, which module's output carries ``grad_output``, and how to read the
attention masks from the attention call. ``ADAPTERS`` is the one table from module type to adapter;
:func:`register_adapter` extends it and :func:`find_blocks` walks a model with it.

Built-in adapters, as ``layer type: attention X-module -> output-module; ffn X-module -> output-module``
(``X`` is the forward input of the first module, ``grad_output`` the gradient at the output of the second):

* ``curvwatch.models.gpt.Block``: ``attn -> attn.out_proj``; ``mlp.fc -> mlp.proj``.
* ``torch.nn.TransformerEncoderLayer`` and ``TransformerDecoderLayer`` (self-attention only):
  ``self_attn -> self_attn`` (its output 0); ``linear1 -> linear2``.
* Hugging Face ``GPT2Block``: ``attn.c_attn -> attn.c_proj``; ``mlp.c_fc -> mlp.c_proj``.
* Hugging Face ``BertLayer``: ``attention.self -> attention.output.dense``;
  ``intermediate.dense -> output.dense``.

Every LayerNorm is its own block, captured at the LayerNorm module itself: ``ln_1``/``ln_2`` of the GPTs,
``norm1``/``norm2`` (``norm3`` of the decoder: ``ln_3``) of the PyTorch layers, ``attention.output.LayerNorm``
(``ln_1``) and ``output.LayerNorm`` (``ln_2``) of BERT.

Why these capture points: the gradient is taken at the innermost module that computes ``... W_O + b_O`` (or
``... W_2 + b_2``), before any residual dropout, so the sub-block is exactly the deterministic map the
closed forms model, and the residual (outside the FFN/attention module) is excluded (``residual=False``).
``nn.MultiheadAttention`` calls ``out_proj`` functionally, so hooks on ``out_proj`` never fire; its block
output is the module's own output 0 (it has no dropout after ``out_proj``). Not modelled: dropout on the
attention probabilities (run monitored steps with ``attn_pdrop=0`` or in eval mode if it matters), the
cross-attention of decoder layers (only their self-attention is monitored), KV caches with past tokens.

Activations are reported as strings: ``"relu"``, ``"gelu"`` (exact erf) and ``"gelu_tanh"``, the tanh
approximation ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` used by GPT-2 (Hugging Face
``"gelu_new"``, ``"gelu_pytorch_tanh"``, ``"gelu_fast"``; ``nn.GELU(approximate="tanh")``). If the closed
form does not implement an activation, evaluating that FFN block raises a ``ValueError`` naming it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch  # noqa: F401  (used by the doctests)
from torch import nn

from curvwatch.adapters.base import Adapter, BlockSpec, Masks, UnsupportedBlockError, activation_name
from curvwatch.adapters.builtin import (
    BertLayerAdapter,
    GPT2BlockAdapter,
    GPTBlockAdapter,
    TorchTransformerLayerAdapter,
)
from curvwatch.adapters.hf import BartLayerAdapter, GPTNeoXLayerAdapter, HFDecoderLayerAdapter, ViTLayerAdapter
from curvwatch.adapters.litgpt import LitGPTBlockAdapter
from curvwatch.adapters.structural import recognize
from curvwatch.kinds import KINDS

__all__ = [
    "ADAPTERS",
    "Adapter",
    "BlockSpec",
    "LayerDescription",
    "Masks",
    "UnsupportedBlockError",
    "activation_name",
    "adapter_for",
    "describe_layer",
    "find_blocks",
    "register_adapter",
]

# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------

_TORCH_LAYER = TorchTransformerLayerAdapter()

#: Layer type -> adapter, the one table :func:`find_blocks` consults. Keys are classes, or
#: ``"module:QualName"`` strings for classes of optional or heavy packages, so that curvwatch never imports
#: ``transformers`` itself. Exact types are matched: a subclass that changes ``forward`` needs its own entry
#: (which may be the parent's adapter). Extend it with :func:`register_adapter`.
ADAPTERS: dict[type | str, Adapter] = {
    nn.TransformerEncoderLayer: _TORCH_LAYER,
    nn.TransformerDecoderLayer: _TORCH_LAYER,
    "curvwatch.models.gpt:Block": GPTBlockAdapter(),
    "transformers.models.gpt2.modeling_gpt2:GPT2Block": GPT2BlockAdapter(),
    "transformers.models.bert.modeling_bert:BertLayer": BertLayerAdapter(),
    "litgpt.model:Block": LitGPTBlockAdapter(),
    "litgpt.lora:Block": LitGPTBlockAdapter(),
    "transformers.models.llama.modeling_llama:LlamaDecoderLayer": HFDecoderLayerAdapter(),
    "transformers.models.mistral.modeling_mistral:MistralDecoderLayer": HFDecoderLayerAdapter(),
    "transformers.models.qwen2.modeling_qwen2:Qwen2DecoderLayer": HFDecoderLayerAdapter(),
    "transformers.models.qwen3.modeling_qwen3:Qwen3DecoderLayer": HFDecoderLayerAdapter(),
    "transformers.models.gemma.modeling_gemma:GemmaDecoderLayer": HFDecoderLayerAdapter(),
    "transformers.models.gpt_neox.modeling_gpt_neox:GPTNeoXLayer": GPTNeoXLayerAdapter(),
    "transformers.models.vit.modeling_vit:ViTLayer": ViTLayerAdapter(),
    "transformers.models.bart.modeling_bart:BartEncoderLayer": BartLayerAdapter(),
    "transformers.models.bart.modeling_bart:BartDecoderLayer": BartLayerAdapter(),
}


def adapter_for(module_type: type) -> Adapter | None:
    """The entry of :data:`ADAPTERS` for exactly ``module_type`` (by class, then by ``"module:QualName"``).

    Example:
        >>> type(adapter_for(torch.nn.TransformerEncoderLayer)).__name__
        'TorchTransformerLayerAdapter'
        >>> adapter_for(torch.nn.Linear) is None
        True
    """
    adapter = ADAPTERS.get(module_type)
    if adapter is None:
        adapter = ADAPTERS.get(f"{module_type.__module__}:{module_type.__qualname__}")
    return adapter


def register_adapter(module_type: type, adapter: Adapter) -> None:
    """Add (or replace) the adapter used for layers of exactly ``module_type``.

    Args:
        module_type: An ``nn.Module`` subclass, e.g. your Transformer layer class.
        adapter: An :class:`Adapter` instance, possibly an existing entry of :data:`ADAPTERS` when the layer
            has the same structure as a known one.

    Raises:
        TypeError: If ``module_type`` is not an ``nn.Module`` subclass or ``adapter`` not an ``Adapter``.

    Example:
        >>> class MyLayer(torch.nn.TransformerEncoderLayer):
        ...     pass
        >>> register_adapter(MyLayer, ADAPTERS[torch.nn.TransformerEncoderLayer])
        >>> len(find_blocks(MyLayer(8, 2, dim_feedforward=16)))
        4
        >>> del ADAPTERS[MyLayer]
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"Invalid module_type={module_type!r}. Must be an nn.Module subclass.")
    if not isinstance(adapter, Adapter):
        raise TypeError(f"Invalid adapter={adapter!r}. Must be a curvwatch.adapters.Adapter instance.")
    ADAPTERS[module_type] = adapter


def _no_layer_message(model: nn.Module) -> str:
    """Short: the model, its likeliest layer type, and the one call that makes it known (``describe_layer``).

    Every class named is one of ``model``'s: its most repeated module with submodules, else (a model of plain modules,
    such as an MLP of ``Linear`` and ``ReLU``) the classes it holds, and the model's own class as the layer to
    describe when it is not a container.
    """
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    counts = Counter(
        type(m) for m in model.modules() if m is not model and not isinstance(m, containers) and any(m.children())
    )
    name = type(model).__name__
    example = (
        "q='attn.q', k='attn.k', v='attn.v', o='attn.o', n_heads=8, norms=('ln_1', 'ln_2'), "
        "up='mlp.fc', down='mlp.proj'"
    )
    if counts:
        layer = counts.most_common(1)[0][0].__name__
        return (
            f"find_blocks found no known Transformer layer in {name} (its most repeated module with submodules: "
            f"{layer}). Fix: describe that layer type once, before training, e.g.\n"
            f"    curvwatch.describe_layer({layer}, curvwatch.LayerDescription({example}))\n"
            "with the dotted names of its submodules (help(curvwatch.LayerDescription)), or pass blocks=[BlockSpec...]."
        )
    leaves = Counter(type(m).__name__ for m in model.modules() if m is not model and not any(m.children()))
    listed = ", ".join(f"{n} x{k}" for n, k in leaves.most_common(6)) or "none"
    fix = (
        f"If {name} is itself a Transformer layer, describe it once, before training:\n"
        f"    curvwatch.describe_layer({name}, curvwatch.LayerDescription({example}))\n"
        "with the dotted names of its submodules (help(curvwatch.LayerDescription)), or pass blocks=[BlockSpec...]."
        if not isinstance(model, containers) and any(model.children())
        else "Describe your layer class once with curvwatch.describe_layer (help(curvwatch.LayerDescription)), "
        "or pass blocks=[BlockSpec...]."
    )
    return (
        f"find_blocks found no known Transformer layer in {name}: it holds only {listed}, no layer with attention. "
        f"curvwatch monitors the attention, normalisation and MLP sub-blocks of Transformer layers. {fix}"
    )


def find_blocks(model: nn.Module, blocks: str | Sequence[BlockSpec] = "auto") -> list[BlockSpec]:
    """The monitored sub-blocks of ``model``, in module order.

    With ``blocks="auto"`` every module whose exact type is in :data:`ADAPTERS` is a Transformer layer
    (numbered 0, 1, ... in ``model.modules()`` order; its descendants are not searched further) and yields
    its attention, each LayerNorm, and its FFN. An explicit list of :class:`BlockSpec` is validated and
    returned as is.

    Args:
        model: The model to search.
        blocks: ``"auto"`` or a list of :class:`BlockSpec`.

    Returns:
        The specs, names unique.

    Raises:
        ValueError: If ``"auto"`` finds no known layer (the message lists the module types found and how
            to register an adapter or pass specs), or an explicit list is empty, has duplicate names, unknown
            kinds or modules outside ``model``.

    Example:
        >>> find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        Traceback (most recent call last):
        ...
        ValueError: find_blocks found no known Transformer layer in Sequential: it holds only Linear x1, ...
    """
    if isinstance(blocks, str):
        if blocks != "auto":
            raise ValueError(f"Invalid blocks={blocks!r}. Must be 'auto' or a list of BlockSpec.")
        specs: list[BlockSpec] = []
        inside: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(p + ".") for p in inside):
                continue
            adapter = adapter_for(type(module))
            if adapter is None:
                adapter = recognize(module)
            if adapter is not None:
                specs.extend(adapter.specs(module, len(inside)))
                inside.append(name)
        if not specs:
            raise ValueError(_no_layer_message(model))
        return specs
    specs = list(blocks)
    if not specs:
        raise ValueError("Invalid blocks=[]. Pass 'auto' or a non-empty list of BlockSpec.")
    modules = {id(m) for m in model.modules()}
    seen: set[str] = set()
    for spec in specs:
        if not isinstance(spec, BlockSpec):
            raise ValueError(f"Invalid entry {spec!r} in blocks. Must be a curvwatch.BlockSpec.")
        if spec.kind not in KINDS:
            raise ValueError(
                f"Invalid kind={spec.kind!r} in BlockSpec {spec.name!r}. Must be one of {sorted(KINDS)}."
            )
        if spec.name in seen:
            raise ValueError(f"Duplicate BlockSpec name {spec.name!r}. Names must be unique.")
        if id(spec.module) not in modules:
            raise ValueError(f"BlockSpec {spec.name!r}: its module is not a submodule of the model.")
        if not isinstance(spec.adapter, Adapter):
            raise ValueError(f"BlockSpec {spec.name!r}: adapter={spec.adapter!r} is not an Adapter instance.")
        seen.add(spec.name)
    return specs


# layers described in a few lines (it registers through register_adapter, defined above)
from curvwatch.adapters.described import LayerDescription, describe_layer  # noqa: E402
