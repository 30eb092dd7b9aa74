"""The evaluation engine: captured blocks in, named numbers out, with the monitor's budgets and fault policy.

* :mod:`~curvwatch.engine.core`: :class:`Engine`, the evaluation of one step's captured blocks (windows evaluated
  together, warm starts, the memory budget and out-of-memory back-off, non-finite inputs, per-block faults);
* :mod:`~curvwatch.engine.kernel`: the one place a kernel is called (:func:`evaluate_block`);
* :mod:`~curvwatch.engine.memory`: what an evaluation allocates (the estimates behind the budget and the windows).
"""

from curvwatch.engine.core import MONITOR_LANCZOS, NONFINITE, BlockError, Engine, Evaluation, signal_plan
from curvwatch.engine.kernel import evaluate_block, kernel_inputs
from curvwatch.engine.memory import basis_bytes, evaluation_bytes, vectors_held

__all__ = [
    "MONITOR_LANCZOS",
    "NONFINITE",
    "BlockError",
    "Engine",
    "Evaluation",
    "basis_bytes",
    "evaluate_block",
    "evaluation_bytes",
    "kernel_inputs",
    "signal_plan",
    "vectors_held",
]
