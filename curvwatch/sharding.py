"""Sharded training: which strategies the monitor runs under, and reading one block's weights as full tensors.

Under data parallelism (a single device, ``strategy="ddp"``) every rank holds every weight, and the capture
snapshots each block's weights in the forward pass. Under FSDP a rank holds a shard of each weight outside the
forward; the block inputs and output gradients the monitor captures are not sharded (each rank has its own
batch's). So the capture keeps no weights there, and the engine reads each block's weights as full tensors only
while it evaluates that block (:attr:`curvwatch.capture.CapturedBlock.params_fn`), then frees them: the extra
memory is about one block's weights plus its evaluation.

The real-loss keys (:mod:`curvwatch.realloss`) run extra backward passes from the logits: under FSDP2 they run as
any backward does (FSDP2's hooks gather each layer's weights for its backward); under FSDP1 they cannot
(:func:`real_loss_support`).

Reading full weights is a collective (an all-gather over the ranks that hold the shards), so every rank reads
every block, in the same order, whatever happens to it locally; the engine does so (:meth:`curvwatch.engine.Engine
.evaluate`). The readers assume that an adapter's ``read_params`` runs the same tensor operations on every rank
(they depend on the model's structure only), so any collective they trigger matches across ranks.

:data:`STRATEGIES` says, by strategy class name, how the monitor runs under each sharding strategy Lightning has;
``docs/strategies.md`` explains the choices.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from torch import Tensor, nn

from curvwatch.adapters import BlockSpec

__all__ = ["STRATEGIES", "ParamReader", "full_params", "param_reader", "real_loss_support", "summoned_params"]

#: Reads one block's closed-form keyword arguments (``adapter.read_params``) with full, detached weights.
ParamReader = Callable[[BlockSpec], dict[str, Any]]

_USE_INSTEAD = (
    "Use strategy='ddp' (or a single device), ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) "
    "with fully_shard applied in configure_model (FSDP2), or FSDPStrategy (FSDP1), or remove the CurvatureMonitor "
    "callback."
)


def _materialize(params: dict[str, Any], copy: bool) -> dict[str, Any]:
    """``params`` with every ``DTensor`` gathered into a full tensor (nested dicts too) and every tensor detached.

    The gathers happen in the (insertion) order of ``params``, the same on every rank.
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    for k, v in params.items():
        if isinstance(v, DTensor):
            out[k] = v.full_tensor().detach()
        elif isinstance(v, Tensor):
            out[k] = v.detach().clone() if copy else v.detach()
        elif isinstance(v, dict):
            out[k] = _materialize(v, copy)
        else:
            out[k] = v
    return out


def full_params(spec: BlockSpec) -> dict[str, Any]:
    """One block's weights under FSDP2 (``fully_shard``): each ``DTensor`` gathered with ``full_tensor()``.

    Outside the forward FSDP2 leaves every parameter a ``DTensor`` sharded on dim 0 across the data-parallel ranks;
    ``full_tensor()`` all-gathers it (a collective). Plain tensors (a parameter FSDP2 does not manage, or one it
    left unsharded) are returned detached, without a copy: the monitor evaluates before the optimizer step.

    Args:
        spec: The block.

    Returns:
        ``spec.adapter.read_params(spec)`` with full, detached tensors.

    Raises:
        UnsupportedBlockError: As ``read_params`` does.
    """
    return _materialize(spec.adapter.read_params(spec), copy=False)


#: Why the real-loss keys are off under FSDP1 (:func:`real_loss_support`).
FSDP1_REAL_LOSS = (
    "FSDPStrategy (FSDP1): it unshards each unit for one backward per forward and reshards it when a backward "
    "ends, so after the first sampled backward pass the training's own backward finds the weights freed (it fails "
    "with 'setStorage: ... out of bounds for storage of size 0'); use FSDP2 (ModelParallelStrategy with "
    "fully_shard) for the real-loss keys under sharding"
)


def summoned_params(root: Callable[[], nn.Module]) -> ParamReader:
    """A reader of one block's weights under FSDP1 (``FullyShardedDataParallel``), through ``summon_full_params``.

    For a block of layer ``M`` it unshards, with ``writeback=False``, the innermost FSDP unit around ``M`` (its own
    flat parameter only, ``recurse=False``) and every FSDP unit inside ``M``, reads the block's weights, copies
    them and reshards: the extra memory is one FSDP unit (typically one Transformer layer under a per-layer wrap
    policy) plus the block's copies. Works with ``use_orig_params`` True and False.

    Args:
        root: Returns the FSDP-wrapped root module at evaluation time (Lightning wraps the model after ``setup``).

    Returns:
        A function ``spec -> read_params(spec)`` with full, detached copies of the weights.
    """
    units: dict[int, list[tuple[nn.Module, bool]]] = {}  # id(layer) -> [(FSDP unit, recurse)]

    def read(spec: BlockSpec) -> dict[str, Any]:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        layer = spec.layer_module
        if id(layer) not in units:
            units[id(layer)] = _units_around(root(), layer)
        with ExitStack() as stack:
            for unit, recurse in units[id(layer)]:
                stack.enter_context(FSDP.summon_full_params(unit, recurse=recurse, writeback=False))
            return _materialize(spec.adapter.read_params(spec), copy=True)  # the unsharded views go on exit

    read.real_loss_off = FSDP1_REAL_LOSS  # type: ignore[attr-defined]  # read by real_loss_support
    return read


def real_loss_support(read_params: ParamReader | None) -> str | None:
    """Why the sampled backward passes of the real-loss keys (:mod:`curvwatch.realloss`) cannot run with this
    reader of the weights, or ``None`` when they can.

    Under FSDP2 (:func:`full_params`) they can: each pass runs FSDP2's backward hooks as any backward does (each
    layer's weights all-gathered for its backward, resharded after), without touching a parameter gradient, so
    every rank must run the same passes (:func:`curvwatch.realloss.sampling.sample_outputs` agrees on that first).
    Under FSDP1 (:func:`summoned_params`) they cannot (:data:`FSDP1_REAL_LOSS`).

    Example:
        >>> real_loss_support(None) is None and real_loss_support(full_params) is None
        True
        >>> real_loss_support(summoned_params(lambda: None))[:20]
        'FSDPStrategy (FSDP1)'
    """
    return getattr(read_params, "real_loss_off", None)


def _units_around(root: nn.Module, layer: nn.Module) -> list[tuple[nn.Module, bool]]:
    """``[(unit, recurse)]``: the innermost FSDP1 unit around ``layer`` (its own flat parameter: ``recurse=False``),
    then the outermost units inside ``layer``, each with everything below it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def owner(module: nn.Module, unit: nn.Module | None) -> tuple[bool, nn.Module | None]:
        unit = module if isinstance(module, FSDP) else unit
        if module is layer:
            return True, unit
        for child in module.children():
            found, inner = owner(child, unit)
            if found:
                return True, inner
        return False, None

    def inside(module: nn.Module):
        for child in module.children():
            if isinstance(child, FSDP):
                yield child
            else:
                yield from inside(child)

    found, unit = owner(root, None)
    if not found:
        raise RuntimeError(f"{type(layer).__name__} is not inside the FSDP-wrapped model {type(root).__name__}")
    return ([(unit, False)] if unit is not None else []) + [(u, True) for u in inside(layer)]


def _model_parallel(strategy: Any) -> ParamReader:
    """``ModelParallelStrategy``: FSDP2 alone (``tensor_parallel_size=1``) is supported; tensor parallel is not."""
    tp = getattr(strategy, "_tensor_parallel_size", "auto")  # resolved from "auto" before the callbacks' setup
    if tp != 1:
        raise ValueError(
            f"CurvatureMonitor does not support strategy={type(strategy).__name__}: it shards parameters by tensor "
            f"parallelism (tensor_parallel_size={tp!r}; 'auto' means all devices of a node). Under tensor "
            "parallelism the attention and MLP of a layer run on local slices of their heads and hidden units "
            "(the module's head count is the local one), which the closed forms, written for the whole block, do "
            f"not model yet. {_USE_INSTEAD}"
        )
    return full_params


def _fsdp1(strategy: Any) -> ParamReader:
    """``FSDPStrategy`` (FSDP1): the weights through ``summon_full_params`` on the wrapped model (``use_orig_params``
    False or True)."""
    return summoned_params(lambda: strategy.model)


#: How the monitor runs under each sharding strategy, by class name (matched along the strategy's MRO): a function
#: of the strategy that returns the :data:`ParamReader` (or raises ``ValueError`` with the reason), or the reason
#: the strategy is refused. Strategies not listed (single device, DDP) snapshot the weights in the forward pass.
#: ``FSDPStrategy`` (FSDP1) is checked on a GPU by ``benchmarks/gpu_fsdp_check.sh`` and on 2 CPU processes under
#: Lightning (``tests/test_sharded.py``).
STRATEGIES: dict[str, Callable[[Any], ParamReader] | str] = {
    "ModelParallelStrategy": _model_parallel,
    "FSDPStrategy": _fsdp1,
    "DeepSpeedStrategy": (
        "it shards parameters (ZeRO stage 3; stages 1-2 shard optimizer states and gradients), and curvwatch has "
        "no DeepSpeed reader yet: Lightning runs DeepSpeed on CUDA only, and deepspeed on CPU compiles its "
        "communication op at start-up, so it could not be tested without a GPU"
    ),
    "XLAFSDPStrategy": "it shards parameters on XLA devices (TPUs), where curvwatch has never been run",
}


def param_reader(strategy: Any, model: nn.Module) -> ParamReader | None:
    """How the capture reads the weights under ``strategy``: ``None`` (snapshot in the forward) or a reader.

    Args:
        strategy: ``trainer.strategy``.
        model: The LightningModule (checked for parameters already sharded by hand).

    Raises:
        ValueError: If the strategy is refused (the message says why and what to use instead), or the model's
            parameters are ``DTensor`` s under a strategy that does not shard them.

    Example:
        >>> param_reader(type("DDPStrategy", (), {})(), nn.Linear(2, 2)) is None  # snapshot in the forward
        True
        >>> param_reader(type("ModelParallelStrategy", (), {"_tensor_parallel_size": 1})(), nn.Linear(2, 2)).__name__
        'full_params'
        >>> param_reader(type("DeepSpeedStrategy", (), {})(), nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        ValueError: CurvatureMonitor does not support strategy=DeepSpeedStrategy: it shards parameters (ZeRO ...
    """
    for cls in type(strategy).__mro__:
        entry = STRATEGIES.get(cls.__name__)
        if isinstance(entry, str):
            raise ValueError(
                f"CurvatureMonitor does not support strategy={type(strategy).__name__}: {entry}. {_USE_INSTEAD}"
            )
        if entry is not None:
            return entry(strategy)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError(
            f"CurvatureMonitor found DTensor parameters (fully_shard or tensor parallel applied by hand) under "
            f"strategy={type(strategy).__name__}, which does not shard them. {_USE_INSTEAD}"
        )
    return None
