"""Finding the module whose output is the logits, and what to tell about the model's own backward hooks."""

from __future__ import annotations

from torch import nn

#: Module names tried, in this order, for the module whose output is the logits (``logits_module=None``).
LOGITS_NAMES = ("lm_head", "head", "classifier", "output", "score", "fc_out", "decoder")


def find_logits_module(model: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """``(name, module)`` of the module whose output is the logits the loss reads.

    Args:
        model: The LightningModule (or any module).
        name: A dotted module name (``"lm_head"``, ``"model.classifier"``); ``None``: the first of
            :data:`LOGITS_NAMES` found, searched as a suffix of every module's name, the shortest name first.

    Raises:
        ValueError: If no module matches, with the names tried and how to pass ``logits_module``.

    Example:
        >>> net = nn.Sequential()
        >>> net.add_module("body", nn.Linear(4, 4)); net.add_module("lm_head", nn.Linear(4, 9))
        >>> find_logits_module(net)[0]
        'lm_head'
    """
    modules = dict(model.named_modules())
    if name is not None:
        if name not in modules:
            close = [n for n in modules if n.endswith(name.split(".")[-1])][:5]
            raise ValueError(
                f"Invalid logits_module={name!r}: the model has no such module"
                + (f" (similar names: {close})" if close else "")
                + f". Modules whose output looks like logits: {logits_candidates(model)}. Pass the dotted name of "
                "the module whose output is the logits, as in model.named_modules()."
            )
        return name, modules[name]
    for candidate in LOGITS_NAMES:
        hits = sorted((n for n in modules if n == candidate or n.endswith("." + candidate)), key=len)
        if hits:
            return hits[0], modules[hits[0]]
    raise ValueError(
        f"Cannot find the module whose output is the logits (tried the names {list(LOGITS_NAMES)}). Modules whose "
        f"output looks like logits: {logits_candidates(model)}. Pass "
        "sharpness=curvwatch.Sharpness(logits_module='<dotted name>'), or sharpness=False to leave the real-loss "
        "curvature out."
    )


def logits_candidates(model: nn.Module, top: int = 3) -> list[str]:
    """Names of the ``nn.Linear`` modules whose output looks like logits: first those outside the repeated layers
    (no numbered part in their name, as ``layers.3.mlp``), then the widest, then the last in the model.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 50))
        >>> logits_candidates(net)
        ['1', '0']
    """
    linears = [
        (not any(part.isdigit() for part in n.split(".")[:-1]), m.out_features, i, n)
        for i, (n, m) in enumerate(model.named_modules())
        if isinstance(m, nn.Linear) and n
    ]
    return [t[-1] for t in sorted(linears, reverse=True)[:top]]


def backward_hooks_note(model: nn.Module) -> str | None:
    """What to tell the user at set-up when ``model`` has backward hooks of its own (module full backward hooks,
    backward pre-hooks, global module backward hooks), else ``None``.

    The sampled backward passes (:func:`curvwatch.realloss.sampling.sample_outputs`) run from the logits to the block
    outputs, through every hook on that path: no PyTorch API runs a backward pass without them. Every
    :class:`~curvwatch.capture.Capture` (a second monitor's too) ignores these passes; a user's hooks cannot, and
    tensor hooks (``Tensor.register_hook``) cannot be seen at set-up at all.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> backward_hooks_note(net) is None
        True
        >>> _ = net.register_full_backward_hook(lambda m, gi, go: None)
        >>> backward_hooks_note(net)[:60]
        "the model has backward hooks (on ''): on every full evaluati"
    """
    from torch.nn.modules import module as nn_module

    hooked = [n for n, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]
    if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        hooked.insert(0, "<global module hooks>")
    if not hooked:
        return None
    return (
        f"the model has backward hooks (on {', '.join(repr(n) for n in hooked[:3])}"
        + (f" and {len(hooked) - 3} more" if len(hooked) > 3 else "")
        + "): on every full evaluation the sampled backward passes run through the hooks between the logits and the "
        "blocks once per sample (Sharpness.samples passes), and a tensor hook on the logits themselves runs once more "
        "when the loss's gradient at the logits is read before the backward (Monitor.before_backward); pass "
        "sharpness=False if your hooks must see only the training's own backward"
    )
