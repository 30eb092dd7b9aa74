"""The solver's per-device choices: what it spends on a GPU to save host syncs and dispatches, and not on a CPU.

On a GPU an evaluation of many small tensors waits on every host read of a device value (a sync) and on every
dispatched operator, not on arithmetic; on a CPU a read costs nothing and the arithmetic is the whole cost. The solver
makes five choices by that (the first the same on both for now, see :data:`CPU`): how often the Lanczos stopping test
reads the projected matrices, how the basis buffer is allocated, whether diagonal block pairs of one shape share one
product, whether the engine evaluates consecutive blocks in lockstep threads, and how the exact spectral norms find
their Gram matrices' largest eigenvalues. :func:`for_device` gives them for a
device: :data:`GPU` off the host, :data:`CPU` on it. (Both Gram-Schmidt passes run at every step on every device: see
:meth:`~.lanczos.LanczosRun.step`.)

Operator and sync counts measured on the CPU (``tests/test_dispatch.py``, ``benchmarks/bench_dispatch.py``) must be
those of a GPU: they run inside :func:`forced` with :data:`GPU`, which makes every device take the GPU choices.

Example:
    >>> for_device("cpu") == CPU, for_device("cuda") == GPU
    (True, True)
    >>> with forced(GPU):
    ...     for_device("cpu").stack_pairs
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

__all__ = ["CPU", "GPU", "SolverChoices", "for_device", "forced"]


@dataclass(frozen=True)
class SolverChoices:
    """The solver's choices for one kind of device.

    Attributes:
        check_every: Lanczos steps between two stopping tests (and at a restart and the last step). A test reads the
            run's alphas and betas on the host: a sync off the CPU. A member that converged between two tests takes up
            to ``check_every - 1`` more products (which only sharpen its Ritz value).
        grow_basis: The basis buffer starts at 8 vectors and doubles (a GPU allocation is memory at once); otherwise
            it has room for every vector from the start (``torch.empty`` on the host touches only the pages written,
            and no growth copies the basis).
        stack_pairs: Diagonal block pairs of one shape (attention's ``QQ`` and ``KK``) share one product
            (:func:`~.operator.stacked_matvec`: one product's dispatches for both, each row computing every block's
            tangent); otherwise each pair has its own product, with the arithmetic of its block alone.
        lockstep: The engine evaluates consecutive blocks in lockstep threads (:class:`~.lockstep.Lockstep`: their
            stopping tests share one host read, their exact pieces gathered calls); otherwise one block after the other.
        top_by_squaring: The exact spectral norms' largest Gram eigenvalues (:func:`~.linalg.gram_lambda_max`) by
            repeated squaring (:func:`~.linalg.top_by_squaring`: matmuls, no sync, at most ``SQUARING_TOL`` low);
            otherwise by ``eigvalsh`` (exact to round-off, and faster on the host: 36 vs 38 ms for 432 Grams of 64
            rows, 85 vs 298 ms for 12 of 512, one thread).
    """

    check_every: int
    grow_basis: bool
    stack_pairs: bool
    lockstep: bool
    top_by_squaring: bool

    def __post_init__(self) -> None:
        if isinstance(self.check_every, bool) or not isinstance(self.check_every, int) or self.check_every < 1:
            raise ValueError(f"Invalid check_every={self.check_every!r}. Must be an int >= 1.")


#: Off the host: few syncs and few dispatches, at some arithmetic.
GPU = SolverChoices(check_every=4, grow_basis=True, stack_pairs=True, lockstep=True, top_by_squaring=True)
#: On the host: the least arithmetic (a read of a value and a dispatch cost microseconds). The stopping test stays every
#: 4 steps all the same: which norms the stopping rule reports converged depends on the steps the tests fall on
#: (``benchmarks/bench_convergence.py --quick`` replayed with one seed, ``tests/test_bench_convergence.py``: with a test
#: every step, or every 3, one norm is reported converged 4.7% low, ``layer0/attn/outer/QQ/h3`` at step 20; every 2
#: or 4 steps none), so the host tests when a GPU does and reports what a GPU reports.
CPU = SolverChoices(check_every=4, grow_basis=False, stack_pairs=False, lockstep=False, top_by_squaring=False)

#: Set by :func:`forced`: the choices every device takes, or ``None`` for each device its own. A context variable, so
#: the lockstep threads (each runs in a copy of its caller's context) see it too.
_FORCED: ContextVar[SolverChoices | None] = ContextVar("curvwatch_solver_choices", default=None)


def for_device(device: torch.device | str) -> SolverChoices:
    """The choices for tensors on ``device``: :data:`CPU` on the host, :data:`GPU` elsewhere, unless :func:`forced`."""
    chosen = _FORCED.get()
    if chosen is not None:
        return chosen
    return CPU if torch.device(device).type == "cpu" else GPU


@contextlib.contextmanager
def forced(chosen: SolverChoices) -> Iterator[SolverChoices]:
    """Every device takes ``chosen`` inside the block (e.g. :data:`GPU` on a CPU, to count what a GPU dispatches and
    reads)."""
    if not isinstance(chosen, SolverChoices):
        raise TypeError(f"Invalid chosen={chosen!r}. Must be a SolverChoices, e.g. solver.choices.GPU.")
    token = _FORCED.set(chosen)
    try:
        yield chosen
    finally:
        _FORCED.reset(token)
