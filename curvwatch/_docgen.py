"""Generated parts of ``docs/design.md``: the public signatures and the table of block kinds, from the code.

``python -m curvwatch._docgen`` rewrites them in place; ``tests/test_docs.py`` fails when the docs drift.
"""

from __future__ import annotations

import inspect
import re

__all__ = ["render_design", "signatures", "kinds_table"]

_PUBLIC = (
    "curvwatch.closed_form:self_attention",
    "curvwatch.closed_form:multi_head_attention",
    "curvwatch.closed_form:layernorm",
    "curvwatch.closed_form:rmsnorm",
    "curvwatch.closed_form:ffn",
    "curvwatch.closed_form:gated_ffn",
    "curvwatch.closed_form:transformer_block",
    "curvwatch.closed_form:Lanczos",
    "curvwatch.adapters:find_blocks",
    "curvwatch.adapters:register_adapter",
    "curvwatch.kinds:register_kind",
    "curvwatch.engine:Engine",
    "curvwatch.schedule:Schedule",
    "curvwatch.monitor:Monitor",
    "curvwatch.config:Cadence",
    "curvwatch.config:Evaluation",
    "curvwatch.config:Warnings",
    "curvwatch.config:Sharpness",
    "curvwatch.callback:CurvatureMonitor",
    "curvwatch.hf_trainer:CurvatureCallback",
)


def signatures() -> str:
    """One ``name(signature)`` line per public object, as Python would print it."""
    import importlib

    lines = []
    for entry in _PUBLIC:
        module, name = entry.split(":")
        obj = getattr(importlib.import_module(module), name)
        sig = str(inspect.signature(obj)).replace("'", '"')
        lines.append(f"{name}{sig}")
    return "```python\n" + "\n".join(lines) + "\n```"


def kinds_table() -> str:
    """The registered block kinds: name, closed form, pairs (exact ones marked), key prefix, what it is."""
    from curvwatch.kinds import KINDS

    rows = ["| kind | closed form | pairs (exact*) | prefix | what |", "| --- | --- | --- | --- | --- |"]
    for kind in KINDS.values():
        pairs = ", ".join(p + ("*" if p in kind.exact_pairs else "") for p in kind.pairs) or "-"
        fn = kind.closed_form if isinstance(kind.closed_form, str) else kind.closed_form.__name__
        rows.append(f"| `{kind.name}` | `{fn}` | {pairs} | `{kind.prefix}/` | {kind.doc} |")
    return "\n".join(rows)


def render_design(text: str) -> str:
    """``text`` with its ``<!-- gen:signatures -->`` and ``<!-- gen:kinds -->`` sections regenerated."""
    parts = {"signatures": signatures(), "kinds": kinds_table()}
    for name, body in parts.items():
        pattern = re.compile(rf"(<!-- gen:{name} -->\n).*?(<!-- /gen -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"docs/design.md has no <!-- gen:{name} --> ... <!-- /gen --> section")
        text = pattern.sub(lambda m, body=body: f"{m.group(1)}{body}\n{m.group(2)}", text)
    return text


if __name__ == "__main__":  # python -m curvwatch._docgen [docs/design.md]
    import pathlib
    import sys

    path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "docs/design.md")
    path.write_text(render_design(path.read_text()))
    print(f"wrote the generated sections of {path}")
