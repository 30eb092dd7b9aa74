"""curvwatch: closed-form, per-block Hessian monitoring for Transformers."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names and the submodule that defines each. Imported lazily so that `import curvwatch`
# stays cheap (no Lightning import) for users of the closed forms alone.
_LAZY = {
    # closed forms and ground truths
    "closed_form": "curvwatch.closed_form",
    "reference": "curvwatch.reference",
    # the Lightning callback
    "CurvatureMonitor": "curvwatch.callback",
    "CurvatureWarning": "curvwatch.alerts",
    "CurvatureNotice": "curvwatch.alerts",
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
    # the Lightning callback
    "CurvatureMonitor",
    "CurvatureWarning",
    "CurvatureNotice",
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
