"""curvwatch: closed-form, per-block Hessian monitoring for Transformers."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# Public names and the submodule that defines each. Imported lazily so that `import curvwatch`
# stays cheap (no Lightning import) for users of the closed forms alone.
_LAZY = {
    # closed forms and ground truths
    "closed_form": "curvwatch.closed_form",
    "reference": "curvwatch.reference",
    # the monitor and its shells (Lightning, Hugging Face; a plain or Fabric loop drives Monitor itself)
    "Monitor": "curvwatch.monitor",
    "CurvatureMonitor": "curvwatch.callback",
    "CurvatureCallback": "curvwatch.hf_trainer",
    "hf_trainer": "curvwatch.hf_trainer",  # curvwatch.hf_trainer.CurvatureCallback after a plain `import curvwatch`
    "CurvatureWarning": "curvwatch.alerts",
    "CurvatureNotice": "curvwatch.alerts",
    # settings
    "Cadence": "curvwatch.config",
    "Evaluation": "curvwatch.config",
    "Warnings": "curvwatch.config",
    "Sharpness": "curvwatch.config",
    # model discovery
    "BlockSpec": "curvwatch.adapters",
    "find_blocks": "curvwatch.adapters",
    "register_adapter": "curvwatch.adapters",
    "LayerDescription": "curvwatch.adapters",
    "describe_layer": "curvwatch.adapters",
}

__all__ = [
    # closed forms and ground truths
    "closed_form",
    "reference",
    # the monitor and its shells
    "Monitor",
    "CurvatureMonitor",
    "CurvatureCallback",
    "CurvatureWarning",
    "CurvatureNotice",
    # settings
    "Cadence",
    "Evaluation",
    "Warnings",
    "Sharpness",
    # model discovery
    "BlockSpec",
    "find_blocks",
    "register_adapter",
    "LayerDescription",
    "describe_layer",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        value = module if _LAZY[name].endswith(name) else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'curvwatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
