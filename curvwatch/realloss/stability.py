"""Edge-of-stability thresholds of the optimizer that updates a block, and the ratios they give."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from curvwatch.adapters.projections import TRACE_STRIDE, tracing
from curvwatch.adapters.updates import AdapterSite
from curvwatch.closed_form.adapted import ADAPTER_PREFIX

#: Weight arguments of the kernels that a preconditioner can be read for (see :func:`param_index_map`); a dotted name
#: is an entry of a dict argument (``"qk_norm.weight_q"``: the attention's QK-norm parameters, blocks ``N1``, ``N2``).
PRECONDITIONED = (
    "W_Q", "W_K", "W_V", "W_1", "W_2", "W_gate", "W_up", "W_down",
    "qk_norm.weight_q", "qk_norm.bias_q", "qk_norm.weight_k", "qk_norm.bias_k",
)  # fmt: skip


def _read_weight(read: Mapping[str, Any], name: str) -> Any:
    """``read[name]``, or ``read["qk_norm"]["weight_q"]`` for a dotted ``name`` (None where absent)."""
    outer, _, inner = name.partition(".")
    value = read.get(outer)
    if inner:
        value = value.get(inner) if isinstance(value, Mapping) else None
    return value


#: Why an Adam block has no ratio on the optimizer's first step (expected: not warned about).
NO_STATE_YET = "the optimizer has no second-moment state yet (before its first step)"


@dataclass(frozen=True)
class StabilityRule:
    """The stability threshold of the optimizer updating one block.

    Args:
        optimizer: ``"sgd"`` or ``"adam"`` (Adam and AdamW).
        lr: Learning rate of the block's parameter group.
        beta: Momentum (SGD) or ``beta_1`` (Adam).
        threshold: ``(2 + 2 beta) / lr`` (SGD) or ``(2 + 2 beta_1) / ((1 - beta_1) lr)`` (Adam).
        precondition: ``{kernel weight name: (same shape) P}`` with ``P = sqrt(v_hat) + eps`` (Adam), else
            ``None``: the ratio then reads ``sharpness/...``, with it ``precond_sharpness/...``. A block's adapter
            ``"lora/<name>"`` has ``P`` of its parameters ``[vec A, vec B]``.
        adapters: The rule is that of the block's low-rank adapters (LoRA): the optimizer steps their parameters,
            not the block's weights, so only their keys (``.../lora/<name>``) get a ratio.
    """

    optimizer: str
    lr: float
    beta: float
    threshold: float
    precondition: dict[str, Tensor] | None = None
    adapters: bool = False


def _param_groups(optimizer: Any) -> dict[int, dict]:
    """``id(param) -> param group`` of a torch optimizer (Lightning's wrapper unwrapped)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    return {id(p): group for group in getattr(opt, "param_groups", []) for p in group["params"]}


def _full(t: Tensor) -> Tensor:
    """``t`` as a full tensor: a ``DTensor`` (FSDP2's optimizer state, sharded as its parameter) all-gathered (a
    collective: every rank asks for the same states in the same order), any other tensor as it is."""
    if type(t).__name__ == "DTensor":
        return t.full_tensor()
    return t


def stability_rule(
    optimizer: Any, params: Mapping[str, tuple[list[Tensor], Tensor]], steps: Mapping[int, float] | None = None
) -> tuple[StabilityRule | None, str | None]:
    """The rule of the optimizer for one block, or ``(None, why not)``.

    Args:
        optimizer: The optimizer (``torch.optim.SGD``, ``Adam``, ``AdamW``; Lightning's ``LightningOptimizer``), or a
            list of them (several optimizers, manual optimization): the one whose parameter groups hold the block's
            weights.
        params: ``{kernel weight name: (module parameters, index)}`` from :func:`param_index_map`: ``index`` is
            the weight's elements as positions in the concatenation of the flattened parameters.
        steps: ``{id(parameter): Adam's step count}`` read already (:func:`adam_steps`, one host read for every
            block), or None: read here, one host read for the block.

    Supported: ``SGD`` without Nesterov and without dampening (plain or heavy-ball), ``Adam`` and ``AdamW``
    without ``amsgrad`` (after their first step, when ``exp_avg_sq`` exists). For the others no ratio is logged
    (a wrong one would be worse than none); the reason says which. Under FSDP2 the parameters and ``exp_avg_sq``
    are sharded ``DTensor`` s: the map holds their full shapes, and the second moments the block reads are
    all-gathered here (every rank calls this for the same blocks in the same order).
    """
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    plist = list(dict.fromkeys(id(p) for ps, _ in params.values() for p in ps))
    found = [(o, _param_groups(o)) for o in (getattr(o, "optimizer", o) for o in optimizers)]
    opt, groups = next(((o, g) for o, g in found if plist and all(i in g for i in plist)), (None, {}))
    if opt is None:
        if sum(any(i in g for i in plist) for _, g in found) > 1:
            return None, "its weights are split between optimizers"
        where = "the optimizer's" if len(found) == 1 else f"any of the {len(found)} optimizers'"
        return None, f"some of its weights are not in {where} parameter groups"
    used = [groups[i] for i in plist]
    keys = ("lr", "momentum", "betas", "dampening", "nesterov", "amsgrad")
    first = {k: used[0].get(k) for k in keys}
    if any({k: g.get(k) for k in keys} != first for g in used[1:]):
        return None, "its weights are in parameter groups with different learning rates or momenta"
    lr = float(first["lr"] if not isinstance(first["lr"], Tensor) else first["lr"].item())
    if lr < 0 or not math.isfinite(lr):
        return None, f"its learning rate is {lr}"
    name = type(opt).__name__
    if isinstance(opt, torch.optim.SGD):
        if first["nesterov"] or first["dampening"]:
            return None, "SGD with Nesterov momentum or dampening has no ratio here (plain or heavy-ball SGD only)"
        beta = float(first["momentum"] or 0.0)
        return StabilityRule("sgd", lr, beta, (2 + 2 * beta) / lr if lr > 0 else math.inf), None
    if isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        if first["amsgrad"]:
            return None, "Adam with amsgrad has no ratio here"
        beta1, beta2 = (float(b) for b in first["betas"])
        eps = float(used[0]["eps"])
        precondition = {}
        # the step counts in one host read (a device tensor under fused or capturable Adam: one sync each)
        if steps is None:
            steps = adam_steps(opt, [ps for ps, _ in params.values()])
        for weight, (ps, index) in params.items():
            step = steps.get(id(ps[0]), 0.0) if ps else 0.0
            states = [opt.state.get(p, {}) for p in ps]
            if any("exp_avg_sq" not in s for s in states) or step < 1:
                return None, NO_STATE_YET
            flat = torch.cat([_full(s["exp_avg_sq"]).detach().reshape(-1).float() for s in states])
            v_hat = flat[index.to(flat.device)] / (1 - beta2**step)
            P = v_hat.sqrt() + eps
            if eps <= 0 and bool((P <= 0).any()):  # a coordinate that never had a gradient: its smallest positive P
                positive = P[P > 0]
                P = P.clamp_min(float(positive.min()) if positive.numel() else 1.0)
            precondition[weight] = P
        threshold = (2 + 2 * beta1) / ((1 - beta1) * lr) if lr > 0 else math.inf  # lr = 0 (warm-up): ratio 0
        return StabilityRule("adam", lr, beta1, threshold, precondition), None
    return None, f"{name} is not supported for stability ratios (SGD, Adam and AdamW are)"


def adam_steps(optimizer: Any, params: Iterable[list[Tensor]]) -> dict[int, float]:
    """``{id(p): step}`` of the first parameter ``p`` of each list in ``params`` that has state in ``optimizer``: its
    ``state["step"]`` (0 without one), every tensor read in one host read per device."""
    opt = getattr(optimizer, "optimizer", optimizer)
    firsts = list({id(ps[0]): ps[0] for ps in params if ps and ps[0] in opt.state}.values())
    values = _host_floats([opt.state[p].get("step", 0) for p in firsts])
    return dict(zip((id(p) for p in firsts), values, strict=True))


def _host_floats(values: list[Any]) -> list[float]:
    """``values`` (numbers and one-element tensors) as floats: one host read per device for the tensors.

    Example:
        >>> _host_floats([1, torch.tensor(2.0), torch.tensor([3])])
        [1.0, 2.0, 3.0]
    """
    out = [float(v) if not isinstance(v, Tensor) else 0.0 for v in values]
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, Tensor):
            by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        for i, x in zip(idx, torch.stack([values[i].reshape(()) for i in idx]).tolist(), strict=True):
            out[i] = float(x)
    return out


def param_index_map(
    spec: Any, weights: Iterable[str] = PRECONDITIONED, adapters: Mapping[str, AdapterSite] | None = None
) -> dict[str, tuple[list[Tensor], Tensor]]:
    """Where each element of a block's weights (as its adapter reads them) lives in the module parameters.

    The adapter reads weights by indexing (transposes, head splits, fused-QKV slices). Reading them once with
    every parameter's values replaced by their positions ``0, 1, ...`` (in float64, exact) gives that map, for
    any adapter, without knowing its layout: optimizer state (Adam's ``exp_avg_sq``) indexed by it is in the
    kernel's layout. A weight with low-rank updates (LoRA) is not a re-indexing of parameters (it is read through
    :func:`~curvwatch.adapters.projections.tracing`) and has no entry; the updates' factors do, as ``"lora/<name>"``.

    Args:
        spec: A :class:`~curvwatch.adapters.BlockSpec`.
        weights: The weight names wanted (those of the adapter's ``read_params`` found among them are mapped); a dotted
            name reads an entry of a dict parameter (``"qk_norm.weight_q"``).
        adapters: The block's low-rank adapters (:func:`~curvwatch.adapters.updates.block_adapters`): each gets the
            entry ``"lora/<name>"``, its parameters' positions of ``[vec A, vec B]`` (``(size,)``).

    Returns:
        ``{name: (parameters, index)}``: ``parameters`` the module parameters the weight reads (in order),
        ``index`` a ``LongTensor`` of the weight's shape into their concatenated flattened values.

    Raises:
        ValueError: If a weight is not a pure re-indexing of the parameters (its positions are not whole numbers
            in range), e.g. an adapter that scales a weight.
        UnsupportedWrapperError: For a projection whose weight is not a frozen weight plus low-rank updates (DoRA).
    """
    owner = spec.layer_module if spec.layer_module is not None else spec.module
    params = list(dict.fromkeys(p for p in owner.parameters()))
    sizes = [p.numel() for p in params]
    positions, offset = {}, 0
    for p, n in zip(params, sizes, strict=True):
        positions[id(p)] = torch.arange(offset, offset + n, dtype=torch.float64, device=p.device).reshape(p.shape)
        offset += n
    # the positions stand in for the parameters as module attributes; the parameters themselves are not touched
    # (assigning .data of another dtype would reset their gradient accumulators, and DDP's hooks on them)
    swapped = []
    try:
        for module in owner.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in positions:
                    module._parameters[name] = positions[id(p)]
                    swapped.append((module, name, p))
        with torch.no_grad(), tracing() as traced:
            read = spec.adapter.read_params(spec)
            found = {k: _read_weight(read, k).detach().clone() for k in weights
                     if isinstance(_read_weight(read, k), Tensor)}  # fmt: skip
            found = {k: pos for k, pos in found.items() if not (pos.numel() and bool(pos.max() >= TRACE_STRIDE))}
            projections = [projection for projection, _, _ in traced]
            for name, site in (adapters or {}).items():  # the factors as read, the parameters' positions standing in
                here = dataclasses.replace(site, params=tuple(positions.get(id(p), p) for p in site.params))
                u = here.update_of(projections)
                if u is not None:
                    found[ADAPTER_PREFIX + name] = torch.cat([u.A.reshape(-1), u.B.reshape(-1)]).clone()
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
    out = {}
    starts = torch.tensor([0, *sizes]).cumsum(0)  # (n_params + 1,) where each parameter's positions begin
    for name, pos in found.items():
        idx = pos.round().long()
        if pos.dtype != torch.float64 or not torch.equal(idx.double(), pos) or idx.min() < 0 or idx.max() >= offset:
            raise ValueError(
                f"{spec.name}: the adapter's {name} is not a re-indexing of the module parameters (it computes "
                "with them), so the optimizer state cannot be mapped onto it."
            )
        flat = idx.reshape(-1).cpu()
        which = torch.bucketize(flat, starts[1:], right=True)  # the parameter of each element
        used = which.unique()  # sorted
        new_starts = torch.zeros(len(params), dtype=torch.long)
        new_starts[used] = torch.tensor([0, *[sizes[i] for i in used.tolist()]]).cumsum(0)[:-1]
        local = flat - starts[which] + new_starts[which]  # position in the concatenation of the used ones
        out[name] = ([params[i] for i in used.tolist()], local.reshape(idx.shape))
    return out


def param_positions(params: list[Tensor], index: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """``(parameter, elements, positions)`` for each of ``params`` holding some of a weight's elements.

    Args:
        params, index: One entry of :func:`param_index_map` (``index`` into the concatenated flattened ``params``).

    Returns:
        ``elements``: which entries of ``index.reshape(-1)`` the parameter holds; ``positions``: where they are in its
        flattened values (both ``LongTensor``, on the CPU).
    """
    flat = index.reshape(-1)
    starts = torch.tensor([0, *[p.numel() for p in params]]).cumsum(0)
    which = torch.bucketize(flat, starts[1:], right=True)  # the parameter of each element
    out = []
    for j, p in enumerate(params):
        elements = (which == j).nonzero().reshape(-1)
        if elements.numel():
            out.append((p, elements, flat[elements] - starts[j]))
    return out


def stability_keys(result: Mapping[str, Any], rule: StabilityRule) -> dict[str, Tensor | float]:
    """``stability/XX[/h{i}]`` = sharpness / threshold for each sharpness key of one block's result, and
    ``stability/lora/<name>`` for each of its adapters'; a rule of the adapters (``rule.adapters``) reads theirs only.

    SGD reads ``sharpness/...``, Adam ``precond_sharpness/...`` (the sharpness of ``P^-1/2 H P^-1/2``).

    Example:
        >>> rule = StabilityRule("sgd", lr=0.1, beta=0.0, threshold=20.0)
        >>> stability_keys({"sharpness/QQ/h0": 30.0, "ggn/QQ/h0": 29.0}, rule)
        {'stability/QQ/h0': 1.5}
        >>> lora = StabilityRule("sgd", lr=0.1, beta=0.0, threshold=20.0, adapters=True)
        >>> stability_keys({"sharpness/QQ/h0": 30.0, "sharpness/lora/q_proj": 10.0}, lora)
        {'stability/lora/q_proj': 0.5}
    """
    source = "precond_sharpness/" if rule.optimizer == "adam" else "sharpness/"
    wanted = source + ADAPTER_PREFIX if rule.adapters else source
    return {
        "stability/" + key[len(source) :]: value / rule.threshold
        for key, value in result.items()
        if key.startswith(wanted)
    }
