"""Several evaluations whose Lanczos solves meet: one host read per stopping test for all of them.

A block's closed form calls :func:`~curvwatch.closed_form._lanczos.solve` somewhere deep inside its kernel (the
attention's ``QQ``/``KK`` norms, the FFN's ``W1W1``, ...), and every stopping test of a solve is a host read of device
values (a sync on a GPU). Evaluated one after the other, a model's blocks pay one read per test *per block*.
:class:`Lockstep` runs the evaluations of several blocks as cooperative threads instead: each runs until its kernel
calls ``solve``, then parks with its runs. The runs of all parked evaluations advance together
(:class:`~curvwatch.closed_form._lanczos.Rounds`: one product per run per round, the stopping tests of all of them in
one read); an evaluation whose runs ended goes on at once, until it parks again (its new runs join the next round) or
ends.

Exactly one thread runs at any time (the others wait on semaphores), so nothing here is concurrent: the kernels need
no locks, and an exception raised by a run's product (out of memory, say) is raised in the evaluation that owns the
run, where its own handlers see it. The numbers are those of the evaluations run one after the other (the same
products and start vectors), except that a run joining between two stopping tests has its first test after fewer
steps, so it may stop a few products earlier or later, within its tolerance. Threads rather than generators because
the kernels' call chains (engine -> adapter -> kernel -> ``spectral_norms`` -> ``solve``) stay plain functions.

Thread-local state does not follow a thread: each evaluation runs in a copy of the caller's ``contextvars`` context and
inside ``setup()`` (the engine passes ``torch.no_grad`` and, on CUDA, the caller's device and stream).

Example:
    >>> import torch
    >>> from curvwatch.closed_form._lanczos import lanczos_max_abs
    >>> def norm(scale):
    ...     M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=torch.float64)) * scale
    ...     return float(lanczos_max_abs(lambda v: v @ M, (), 3, dtype=M.dtype, device=M.device)[0])
    >>> [round(r, 6) for r, _ in Lockstep().run([lambda: norm(1.0), lambda: norm(2.0)])]
    [5.0, 10.0]
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._lanczos import LOCKSTEP, Rounds

__all__ = ["Lockstep"]


class _Abandoned(Exception):
    """Raised in a parked evaluation when the caller of :meth:`Lockstep.run` stopped (an error of its own)."""


class _Worker:
    """One evaluation as a thread that runs only while the caller waits for it (:meth:`resume`)."""

    def __init__(self, fn: Callable[[], Any], setup: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.fn, self.setup = fn, setup
        self.result: Any = None
        self.error: BaseException | None = None
        self.runs: list | None = None  # the runs it parked on, until they are solved
        self.reply: BaseException | None = None  # raised in the evaluation when it goes on
        self.done = False
        self._go, self._parked = threading.Semaphore(0), threading.Semaphore(0)
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self._main,), daemon=True)

    def _main(self) -> None:
        self._go.acquire()
        LOCKSTEP.set(self.meet)  # in this thread's own copy of the context
        try:
            with self.setup():
                self.result = self.fn()
        except BaseException as err:  # handed to the caller, who decides
            self.error = err
        finally:
            self.fn = None  # a kept error's traceback reaches this frame: it must not hold the evaluation's inputs
            self.done = True
            self._parked.release()

    def meet(self, runs: Sequence) -> None:
        """In the evaluation's thread: park until ``runs`` were solved with the other evaluations' runs."""
        self.runs = list(runs)
        self._parked.release()
        self._go.acquire()
        error, self.reply = self.reply, None
        if error is not None:
            raise error

    def resume(self) -> None:
        """In the caller's thread: let the evaluation run until it parks on a solve or ends."""
        self._go.release()
        self._parked.acquire()


class Lockstep:
    """Run evaluations whose Lanczos solves meet (see the module docstring).

    Args:
        setup: Context manager entered around each evaluation in its thread (thread-local state such as
            ``torch.no_grad``); default none.
    """

    def __init__(self, setup: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
        self.setup = setup or contextlib.nullcontext
        self.rounds = 0  # rounds of products of the last run (for tests and benchmarks)

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[tuple[Any, BaseException | None]]:
        """Call every function of ``fns``, their solves in lockstep; ``[(result, exception or None)]`` in order."""
        workers = [_Worker(fn, self.setup) for fn in fns]
        rounds = Rounds()

        def go_on(i: int) -> None:  # evaluation i runs until it parks (its runs join the next round) or ends
            workers[i].resume()
            if workers[i].runs is not None:
                rounds.add(i, workers[i].runs)

        try:
            for i, w in enumerate(workers):
                w.thread.start()
                go_on(i)
            # every round: one product per live run, the due stopping tests in one read; an evaluation whose runs
            # ended goes on at once
            while rounds.groups:
                for i, error in rounds.round():
                    workers[i].runs, workers[i].reply = None, error
                    go_on(i)
            self.rounds = rounds.clock
        finally:  # after an error of the caller's own (KeyboardInterrupt) too: unwind every parked evaluation
            for w in workers:
                if w.thread.is_alive() and w.runs is not None:
                    w.runs, w.reply = None, _Abandoned("the caller of Lockstep.run stopped")
                    w.resume()
            for w in workers:
                if w.thread.ident is not None:
                    w.thread.join()
        return [(w.result, w.error) for w in workers]
