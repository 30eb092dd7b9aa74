"""Several evaluations whose Lanczos solves meet: one host read per stopping test for all of them.

A block's closed form calls :func:`~.lanczos.solve` somewhere deep inside its kernel (the
attention's ``QQ``/``KK`` norms, the FFN's ``W1W1``, ...), and every stopping test of a solve is a host read of device
values (a sync on a GPU). Evaluated one after the other, a model's blocks pay one read per test *per block*.
:class:`Lockstep` runs the evaluations of several blocks as cooperative threads instead: each runs until its kernel
calls ``solve``, then parks with its runs. The runs of all parked evaluations advance together
(:class:`~.lanczos.Rounds`: one product per run per round, the stopping tests of all of them in
one read); an evaluation whose runs ended goes on at once, until it parks again (its new runs join the next round) or
ends.

The evaluations meet in their exact pieces too: a kernel that calls :func:`gathered` parks with its request, and when
every evaluation has parked, the requests of the same function and shapes (every layer's, in a model whose blocks
repeat) are answered by **one** call on their inputs stacked along a new leading dimension: the dispatched operators
of one call for all of them. A Lanczos run built by such a call (:func:`made_together`) serves every request that
met: one product and one step per round for all layers' operators.

Exactly one thread runs at any time (the others wait on semaphores), so nothing here is concurrent: the kernels need
no locks, and an exception raised by a run's product (out of memory, say) is raised in the evaluation that owns the
run, where its own handlers see it. The numbers are those of the evaluations run one after the other (the same
products and start vectors), except that a run joining between two stopping tests has its first test after fewer
steps, so it may stop a few products earlier or later, within its tolerance. Threads rather than generators because
the kernels' call chains (engine -> adapter -> kernel -> ``spectral_norms`` -> ``solve``) stay plain functions.

Thread-local state does not follow a thread: each evaluation runs in a copy of the caller's ``contextvars`` context and
inside ``setup()`` (the engine passes ``torch.no_grad`` and, on CUDA, the caller's device and stream). The threads
are kept between evaluations (:class:`_Carrier`, parked on a semaphore; a thread's start cost more than the terms-only
evaluation of a small block).

Example:
    >>> import torch
    >>> from curvwatch.closed_form.solver.lanczos import lanczos_max_abs, start_vectors
    >>> def norm(scale):
    ...     M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=torch.float64)) * scale
    ...     return float(lanczos_max_abs(lambda v: v @ M, start_vectors((), 3, M.dtype, M.device))[0])
    >>> [round(r, 6) for r, _ in Lockstep().run([lambda: norm(1.0), lambda: norm(2.0)])]
    [5.0, 10.0]
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from .lanczos import LOCKSTEP, LanczosRun, Rounds, solve

__all__ = ["GATHER_BYTES", "Lockstep", "Shared", "gathered", "made_together"]

#: A gathered call (:func:`gathered`) stacks the inputs of at most this many bytes (or one request's, if larger): the
#: evaluations of a window hold their captured tensors anyway, the stacked copy and the function's temporaries come on
#: top.
GATHER_BYTES = 256 * 2**20

#: Inside a :class:`Lockstep` evaluation: the function :func:`gathered` hands its request to.
GATHER: ContextVar[Callable[..., Any] | None] = ContextVar("curvwatch_gather", default=None)


def gathered(fn: Callable[..., Any], *tensors: torch.Tensor, take: Callable[[Any, int], Any] | None = None,
             **settings: Hashable) -> Any:  # fmt: skip
    """``fn(*tensors, **settings)``; inside a :class:`Lockstep` evaluation, one call for the parked evaluations' asks.

    The blocks of a model repeat: every layer's evaluation calls the same functions on tensors of the same shapes, and
    on a GPU each call of a small function costs its dispatched operators, whatever the tensors' sizes. Inside a
    :class:`Lockstep`, the requests of all evaluations with the same ``fn``, ``settings`` and input shapes, dtypes and
    devices are answered by one call of ``fn`` on the inputs stacked along a new leading dimension (at most
    :data:`GATHER_BYTES` of them at a time), and each evaluation gets its part.

    Args:
        fn: A function of tensors that accepts any leading batch dimensions: ``fn(*stacked)`` with every input
            ``(m, *shape)`` returns the ``m`` answers stacked along dimension 0 (a tensor, or a tuple or list of them).
            A module-level function (requests meet by its identity).
        tensors: Its inputs.
        settings: ``fn``'s other arguments (hashable: requests meet only with equal settings).
        take: ``take(result, i)`` is request ``i``'s part of a stacked call's ``result``. Default: index ``i`` of every
            tensor, and a lone request is ``fn(*tensors)`` (``fn`` handles inputs with or without the leading
            dimension). With ``take``, ``fn`` always gets the leading dimension (a lone request's inputs get one of
            size 1) and every request's answer is ``take(result, i)``: e.g. one object for all, such as a Lanczos run
            of every request's operators, and the request's index in it.

    Returns:
        ``fn(*tensors, **settings)`` (``take(fn(*stacked, **settings), i)`` for request ``i`` of a stacked call, the
        same values up to round-off).
    """
    meet = GATHER.get()
    if meet is None:
        return _alone(fn, tensors, settings, take)
    return meet(fn, tensors, settings, take)


@dataclass
class Shared:
    """A request's part of a Lanczos run that the requests of a :class:`Lockstep` share (:func:`made_together`): the
    ``run`` (not solved yet) and the request's index ``i`` in its batch. Solve the run (alone, or with other runs in
    one :func:`~.lanczos.solve`), then read the part from :meth:`solved`."""

    run: LanczosRun
    i: int
    fn: Callable[..., LanczosRun]
    tensors: tuple[torch.Tensor, ...]
    settings: dict[str, Hashable]

    def solved(self) -> tuple[LanczosRun, int]:
        """``(run, i)`` once the run was solved; if its product raised (its ``error``, a
        :class:`~.lanczos.SharedRunError`), this request's part solved again alone, so that an
        error reaches only the evaluation whose own product raises it (as one at a time)."""
        if self.run.error is None:
            return self.run, self.i
        run, i = _alone(self.fn, self.tensors, self.settings, _member)
        solve([run])
        return run, i


def made_together(fn: Callable[..., LanczosRun], *tensors: torch.Tensor, **settings: Hashable) -> Shared:
    """The Lanczos run ``fn(*stacked, **settings)`` of every request that meets (:func:`gathered` with a leading
    dimension, one run whose batch starts with it), made but not solved: the caller solves it, with runs of its own if
    it likes (their stopping tests then share host reads), and reads its part from :meth:`Shared.solved`."""
    run, i = gathered(fn, *tensors, take=_member, **settings)
    run.holders = run.batch_shape[0]  # (one per request that met: a run of several is merged into no solve's own)
    return Shared(run, i, fn, tensors, settings)


def _member(run: Any, i: int) -> tuple[Any, int]:
    """Request ``i``'s part of a stacked call whose result serves every request (a shared run): the result and ``i``."""
    return run, i


def _alone(fn: Callable[..., Any], tensors: Sequence[torch.Tensor], settings: dict, take) -> Any:
    """The answer of one request called by itself (see :func:`gathered`'s ``take``)."""
    if take is None:
        return fn(*tensors, **settings)
    return take(fn(*(t.unsqueeze(0) for t in tensors), **settings), 0)


def _take(result: Any, i: int) -> Any:
    """Request ``i``'s part of a stacked result: index ``i`` of every tensor in it."""
    if isinstance(result, (tuple, list)):
        return type(result)(_take(r, i) for r in result)
    return result[i]


def _answer_requests(requests: list) -> list[tuple[Any, BaseException | None]]:
    """``[(answer, error or None)]`` of gathered requests ``(fn, tensors, settings, take)`` that meet: one stacked call
    per chunk of at most :data:`GATHER_BYTES` of inputs. A stacked call that raises (out of memory, say) is retried one
    request at a time, so that an error reaches only the evaluations whose own call raises it."""
    fn, _, settings, take = requests[0]
    size = sum(t.numel() * t.element_size() for t in requests[0][1])
    per = max(1, GATHER_BYTES // max(size, 1))
    out: list[tuple[Any, BaseException | None]] = []
    for start in range(0, len(requests), per):
        chunk = requests[start : start + per]
        if len(chunk) > 1:
            try:
                stacked = [torch.stack(ts) for ts in zip(*(r[1] for r in chunk), strict=True)]
                result = fn(*stacked, **settings)
                del stacked
                out += [((take or _take)(result, i), None) for i in range(len(chunk))]
                continue
            except Exception:  # one at a time below: the error is the evaluation's own, if it is anybody's
                pass
        for r in chunk:
            try:
                out.append((_alone(fn, r[1], settings, r[3]), None))
            except Exception as err:
                out.append((None, err))
    return out


class _Abandoned(Exception):
    """Raised in a parked evaluation when the caller of :meth:`Lockstep.run` stopped (an error of its own)."""


class _Carrier:
    """A daemon thread that runs one evaluation at a time (:class:`_Worker`), parked in :data:`_IDLE` between them.

    Starting a thread costs far more than a join or a hand-over between two parked threads, a noticeable share of a
    terms-only evaluation of a small model: so the threads are kept between evaluations.
    """

    def __init__(self) -> None:
        self.job: _Worker | None = None
        self.wake = threading.Semaphore(0)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="curvwatch-lockstep")
        self.thread.start()

    def _loop(self) -> None:
        while True:
            self.wake.acquire()
            job, self.job = self.job, None
            if job is None:  # (retired: the idle pool was full)
                return
            job.context.run(job._main)
            del job  # a parked carrier holds no evaluation (its result, its context)


#: Parked carriers, reused by the next evaluations (at most LOCKSTEP_IDLE kept); emptied in a forked child, where the
#: threads do not exist.
_IDLE: list[_Carrier] = []
_IDLE_LOCK = threading.Lock()
LOCKSTEP_IDLE = 64
os.register_at_fork(after_in_child=_IDLE.clear)


def _carrier() -> _Carrier:
    with _IDLE_LOCK:
        if _IDLE:
            return _IDLE.pop()
    return _Carrier()


def _park(carrier: _Carrier) -> None:
    with _IDLE_LOCK:
        if len(_IDLE) < LOCKSTEP_IDLE:
            _IDLE.append(carrier)
            return
    carrier.wake.release()  # (no job: its loop returns)


class _Worker:
    """One evaluation on a carrier thread that runs only while the caller waits for it (:meth:`resume`)."""

    def __init__(self, fn: Callable[[], Any], setup: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.fn, self.setup = fn, setup
        self.result: Any = None
        self.error: BaseException | None = None
        self.runs: list | None = None  # the runs it parked on, until they are solved
        self.request: tuple | None = None  # the gathered call it parked on, until it is answered
        self.answer: Any = None  # returned by that call
        self.reply: BaseException | None = None  # raised in the evaluation when it goes on
        self.done = False
        self.started = False
        self.context = contextvars.copy_context()  # the caller's, copied: the evaluation runs in it
        self._go, self._parked = threading.Semaphore(0), threading.Semaphore(0)
        self._carrier: _Carrier | None = None

    def start(self) -> None:
        """Hand the evaluation to a carrier thread (it waits for :meth:`resume`)."""
        self._carrier = _carrier()
        self._carrier.job = self
        self.started = True
        self._carrier.wake.release()

    def _main(self) -> None:
        self._go.acquire()
        LOCKSTEP.set(self.meet)  # in this evaluation's own copy of the context
        GATHER.set(self.gather)
        try:
            with self.setup():
                self.result = self.fn()
        except BaseException as err:  # handed to the caller, who decides
            self.error = err
        finally:
            self.fn = None  # a kept error's traceback reaches this frame: it must not hold the evaluation's inputs
            self.done = True
            carrier, self._carrier = self._carrier, None
            _park(carrier)  # (before the caller goes on: its next evaluation may take this carrier)
            self._parked.release()

    def meet(self, runs: Sequence) -> None:
        """In the evaluation's thread: park until ``runs`` were solved with the other evaluations' runs."""
        self.runs = list(runs)
        self._parked.release()
        self._go.acquire()
        error, self.reply = self.reply, None
        if error is not None:
            raise error

    def gather(self, fn, tensors, settings, take) -> Any:
        """In the evaluation's thread: park until the gathered call of ``fn`` was answered (:func:`gathered`)."""
        self.request = (fn, tensors, settings, take)
        self._parked.release()
        self._go.acquire()
        error, answer, self.reply, self.answer = self.reply, self.answer, None, None
        if error is not None:
            raise error
        return answer

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
        asking: list[int] = []  # evaluations parked on a gathered call

        def go_on(i: int) -> None:  # evaluation i runs until it parks (its runs join the next round) or ends
            workers[i].resume()
            if workers[i].runs is not None:
                rounds.add(i, workers[i].runs)
            elif workers[i].request is not None:
                asking.append(i)

        try:
            for i, w in enumerate(workers):
                w.start()
                go_on(i)
            # gathered calls first (every evaluation that will make the same request has parked on it: they run the
            # same code), then rounds: one product per live run, the due stopping tests in one read; an evaluation
            # whose runs ended goes on at once
            while rounds.groups or asking:
                if asking:
                    self._answer([workers[i] for i in asking])
                    waiting, asking[:] = list(asking), []
                    for i in waiting:
                        go_on(i)
                    continue
                for i, error in rounds.round():
                    workers[i].runs, workers[i].reply = None, error
                    go_on(i)
            self.rounds = rounds.clock
        finally:  # after an error of the caller's own (KeyboardInterrupt) too: unwind every parked evaluation (each
            # then ends, and its carrier is parked again)
            for w in workers:
                if w.started and not w.done and (w.runs is not None or w.request is not None):
                    w.runs = w.request = None
                    w.reply = _Abandoned("the caller of Lockstep.run stopped")
                    w.resume()
        return [(w.result, w.error) for w in workers]

    @staticmethod
    def _answer(workers: list[_Worker]) -> None:
        """Answer the gathered calls of parked ``workers``: requests that meet (same function, settings, input shapes,
        dtypes and devices) in stacked calls (:func:`_answer_requests`)."""
        groups: dict[tuple, list[_Worker]] = {}
        for w in workers:
            fn, tensors, settings, _ = w.request
            sig = tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)
            groups.setdefault((fn, tuple(sorted(settings.items())), sig), []).append(w)
        for group in groups.values():
            for w, (answer, error) in zip(group, _answer_requests([w.request for w in group]), strict=True):
                w.request, w.answer, w.reply = None, answer, error
