"""Tables of the benchmark result files (``benchmarks/results/*.json``) for the docs' ``benchmark`` directive."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass
class Rendered:
    tables: list[tuple[list[str], list[list[str]]]]
    provenance: str


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def render(name: str, view: str = "default") -> Rendered:
    raise KeyError(f"no view {view!r} of {name}")
