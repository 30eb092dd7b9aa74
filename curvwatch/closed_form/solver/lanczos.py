"""Batched Lanczos iteration for the largest-magnitude eigenvalue of symmetric matrix-free operators."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

from .choices import for_device
from .stopping import verdict

__all__ = [
    "LOCKSTEP",
    "RELOOK",
    "RESTART_CHUNKS",
    "SECOND_LOOK_SEED",
    "WARM_NOISE",
    "LanczosRun",
    "Rounds",
    "SharedRunError",
    "lanczos_max_abs",
    "merge_runs",
    "mergeable",
    "solve",
    "solve_groups",
    "split_results",
    "start_vectors",
    "to_host",
]

#: Norm of the noise mixed into a warm start, relative to the start vector's norm. A warm start is the last
#: evaluation's Ritz vector: near an eigenvector of the operator as it was. With little noise the Krylov space stays
#: near the few directions that vector drifted into, and an indefinite norm whose other end has grown since stops
#: "converged" on the old end. With noise of the start vector's own norm the other directions weigh what they weigh in
#: a cold start, up to 1/sqrt(2), while the old vector keeps half its weight (tests/test_lanczos.py: a perturbed
#: operator whose other end is 1.5 against 1 is found from the old top vector).
WARM_NOISE = 1.0

#: No test on one Krylov space rules out an eigenvalue it has not reached yet: a direction the start (or, warm, the
#: noise mixed into last time's top vector) holds at ~1/sqrt(n) of its weight grows too slowly to show before the Ritz
#: values at a close eigenvalue stand still (on the FFN's ``W1W1`` blocks of trained models, about one norm in 10,000
#: stopped 1-5% low so, the Ritz value next to theta 7-22% below it). A member whose theta has another Ritz value that
#: could decide within :data:`RELOOK` of it when it passes the test therefore takes a second look: once the run's first
#: looks have all ended, a Lanczos run from an independent start (seeded ``seed + SECOND_LOOK_SEED``) on the operator
#: with the first look's Ritz vector projected out (up to ``max_iter`` more products, the other members stopped) to
#: the same test; the larger of the two looks is the norm, known to the better residual where they agree to ``tol``.
#: Where the first look found the second eigenvalue, the second one holds nothing close for the top to hide behind (two
#: independent starts both landed on a second eigenvalue 1.3% below the top once in 117,608 norms of recorded training
#: states); where it found the top, the second look finds the next eigenvalue (or the top again where it is
#: repeated). (An offset in the low 32 bits: the CPU generator keeps only those of a seed, so ``seed + 2**32`` would
#: draw the first look's start again.)
SECOND_LOOK_SEED = 0x9E3779B9
#: The members that take the second look (:data:`SECOND_LOOK_SEED`): theta's gap to the nearest Ritz value that could
#: decide (:attr:`~.stopping.Verdict.gap`) is at most this fraction of ``|theta|`` when they pass the test.
RELOOK = 0.2
#: A thick restart's kept Ritz vectors (half the basis) are made this many slices of a run's members at a time: the
#: temporary is then an eighth of the basis, not half (a run merged from several, :func:`merge_runs`, restarts all of
#: them at once: at GPT-2-small width the FFN's own and sampled rows are 680 MiB). Every member is its own bmm row: the
#: same numbers.
RESTART_CHUNKS = 4


def to_host(t: torch.Tensor) -> np.ndarray:
    """The solver's one device-to-host read per stopping test: ``t`` as a float64 numpy array (a sync off the CPU)."""
    return t.detach().to(device="cpu", dtype=torch.float64).numpy()


def lanczos_max_abs(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    *,
    tol: float = 1e-6,
    max_iter: int | None = None,
    max_basis: int | None = None,
    both_ends: torch.Tensor | np.ndarray | bool = True,
    pass_live: bool = False,
    info: dict | None = None,
    algebraic: bool = False,
    seed: int = 0,
    second_look: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Largest eigenvalue magnitude ``|λ|`` (``algebraic``: largest eigenvalue) of a batch of symmetric operators.

    Runs Lanczos, matrix-free, with full re-orthogonalisation on every operator of the batch at once. A batch member
    stops contributing once its largest-magnitude Ritz value ``theta`` has residual ``|beta_j s_j| <= tol |theta|``
    (for a symmetric operator an eigenvalue lies within that residual) and, where ``both_ends``, the Ritz
    value ``theta_o`` at the other end of the spectrum has too or cannot overtake it
    (``|theta_o| + 10 r_o <= |theta|``), so an indefinite operator does not stop on the wrong end, and these
    extreme Ritz values moved by at most ``STABLE tol |theta|`` over the last :data:`~.stopping.STABLE_STEPS` steps
    (:func:`~.stopping.drift`); where the top is crowded (another Ritz value within :data:`~.stopping.CROWDED` of
    theta) its close neighbour must meet the residual test too and the window is :data:`~.stopping.CROWDED_STEPS`
    steps. Or when its Krylov space is exhausted (then the answer is exact up to round-off). The test is
    :func:`~.stopping.verdict`. A residual test alone cannot
    see an eigenvalue the Krylov space has not reached yet (a start nearly orthogonal to its eigenvector, a crowded
    top): the drift test gives such a direction the steps in which, once the others are found, it grows by its gap to
    the rest; no test on one Krylov space rules it out, so a member whose top was crowded when it passed takes a second
    look from an independent start and keeps the larger (:data:`SECOND_LOOK_SEED`).

    Args:
        matvec: maps ``(*batch_shape, n)`` to ``(*batch_shape, n)``; member ``b`` applies operator ``b``.
        start: ``(*batch_shape, n)`` unit start vectors, one per operator of the batch (:func:`start_vectors`: seeded
            Gaussian, or a warm start plus noise); their shape gives the batch and the dimension ``n``, their dtype
            and device the working ones.
        tol: relative residual tolerance on the extreme Ritz value. ``0`` runs to ``max_iter``.
        max_iter: most Lanczos steps, i.e. products (default and upper limit: ``n``), per look: a member's second
            look (:data:`SECOND_LOOK_SEED`) takes up to as many more.
        max_basis: most basis vectors held per member (``>= 4``; default ``max_iter``: none is ever dropped).
            Memory is then ``~1.5 max_basis`` vectors whatever ``max_iter``: when the basis is full the run
            restarts thickly (Wu & Simon 2000), keeping the Ritz vectors of the ``max_basis // 4`` lowest and
            highest Ritz values and the residual direction, and goes on until it converges or ``max_iter``
            products were spent.
        both_ends: bool, or a ``batch_shape`` bool array or tensor; False where the spectrum is known to be one-sided
            (a Gauss-Newton block, PSD) or symmetric about zero (the ``[[0, B], [B^T, 0]]`` embedding of an
            off-diagonal block), where the largest-magnitude end alone decides.
        pass_live: call ``matvec(v, live)`` instead, ``live`` a host (numpy) bool array of shape ``batch_shape``: the
            members still iterating. The others have zero vectors and their output rows must be zero (exactly
            what a linear ``matvec`` returns), so ``matvec`` may skip computing them. Reading ``live`` costs no
            extra host-device sync: the stopping test reads it anyway.
        info: optional dict; receives ``"rel_residual"`` (shape ``batch_shape``): ``|beta_j s_j| / |theta|`` of
            the returned Ritz value when its member stopped (with a crowded top the larger of theta's and its
            neighbour's; where its Ritz values still moved, their drift / :data:`~.stopping.STABLE` when larger; at
            least the working precision). Some eigenvalue lies within that fraction of the norm; it is ``<= tol`` where
            the member converged and larger where ``max_iter`` cut it short (the norm may then read low: Ritz values
            never exceed the largest ``|λ|``).
        algebraic: follow the largest Ritz value ``theta`` (not the largest in magnitude) and return it with
            its sign: the largest algebraic eigenvalue, e.g. of an indefinite Hessian whose most negative
            eigenvalue is the largest in magnitude. The same stopping test on ``theta`` alone (``both_ends`` is
            ignored: the other end cannot overtake the top one; Ritz values never exceed it); every step
            re-orthogonalises twice.
        seed: the seed of the second look's start vectors is ``seed + SECOND_LOOK_SEED`` (pass the seed ``start``
            was drawn with, :func:`start_vectors`, so that the two looks are independent draws).
        second_look: whether a member whose top Ritz value had a close one when it converged takes the second look
            (:data:`RELOOK`); ``False`` for an estimate whose own uncertainty is larger than what the look can find
            (the real-loss keys: ``second_look`` of :class:`~..settings.Lanczos`).

    Returns:
        ``(norm, vec)``: ``norm`` of shape ``batch_shape`` is the largest ``|λ|`` found (the largest
        eigenvalue with ``algebraic``); ``vec`` of shape ``(*batch_shape, n)`` is its Ritz vector (a good warm
        start for the next call).

    Example:
        >>> M = torch.diag(torch.tensor([3.0, -5.0, 1.0], dtype=torch.float64))
        >>> val, _ = lanczos_max_abs(lambda v: v @ M, start_vectors((), 3, torch.float64, "cpu"))
        >>> round(float(val), 6)
        5.0
    """
    run = LanczosRun(matvec, start, tol=tol, max_iter=max_iter, max_basis=max_basis, both_ends=both_ends,
                     pass_live=pass_live, algebraic=algebraic, seed=seed, second_look=second_look)  # fmt: skip
    solve([run])
    if info is not None:
        info["rel_residual"] = run.rel_residual
    return run.norm, run.ritz


#: Inside a :class:`~.lockstep.Lockstep` evaluation: the function :func:`solve` hands its runs
#: to, to be solved together with the other evaluations' runs.
LOCKSTEP: ContextVar[Callable[[Sequence[LanczosRun]], None] | None] = ContextVar("curvwatch_lockstep", default=None)


def solve(runs: Sequence[LanczosRun]) -> None:
    """Advance several independent Lanczos runs in lockstep until each has stopped.

    Every run takes one product per round; the runs whose stopping test is due read their small projected matrices
    in **one** device-to-host copy (:func:`to_host`) for all of them, so the host waits on the device once per test
    round, however many runs (pairs, parts, blocks) there are. The runs then hold their results
    (:attr:`LanczosRun.norm`, :attr:`~LanczosRun.ritz`, :attr:`~LanczosRun.rel_residual`). Inside a
    :class:`~.lockstep.Lockstep` evaluation the runs are solved together with the other
    evaluations' runs.
    """
    meet = LOCKSTEP.get()
    if meet is not None:
        meet(runs)
        return
    (error,) = solve_groups([runs])
    if error is not None:
        raise error


def solve_groups(groups: Sequence[Sequence[LanczosRun]]) -> list[Exception | None]:
    """:func:`solve` for the runs of every group at once; an exception raised by a run (its product, say out of
    memory) stops that run's group alone and is returned in its place (``None`` for the groups that finished)."""
    rounds = Rounds()
    for g, runs in enumerate(groups):
        rounds.add(g, runs)
    errors: list[Exception | None] = [None] * len(groups)
    while rounds.groups:
        for g, error in rounds.round():
            errors[g] = error
    return errors


class SharedRunError(RuntimeError):
    """The :attr:`~LanczosRun.error` of a run that several evaluations hold (one run for the requests of several
    evaluations, :func:`~.lockstep.gathered`) when that run's product raised (the error is its
    ``__cause__``). The run is dead; each evaluation solves its own part again alone
    (:meth:`~.lockstep.Shared.solved`), so that an error reaches only the evaluation whose own
    product raises it."""


def _shared_error(err: Exception) -> SharedRunError:
    shared = SharedRunError(f"a Lanczos run shared by several evaluations raised {type(err).__name__}: {err}")
    shared.__cause__ = err
    return shared


class Rounds:
    """Groups of Lanczos runs advanced together, one product per run per round, that may join at any round.

    The stopping tests of every run fall on the same rounds (every ``check_every`` of the clock, the device's choice,
    :mod:`~.choices`, whenever the run joined), so that they share one host read; a run that joins between two of them
    has its first test after fewer steps (a test on the host is cheap, a read is a sync).
    """

    def __init__(self) -> None:
        self.groups: dict[Any, list] = {}  # key -> [runs, error]
        self.clock = 0

    def add(self, key: Any, runs: Sequence[LanczosRun]) -> None:
        """A group of runs joins at the next round."""
        for r in runs:
            if not r.done and r.j == 0:
                r.phase = self.clock % r.choices.check_every
        self.groups[key] = [list(runs), None]

    def round(self) -> list[tuple[Any, Exception | None]]:
        """One product of every live run, the due stopping tests in one host read; returns the groups that ended
        (every run done, or one raised: ``(key, exception or None)``), which leave. A run that several groups hold
        (one run for the requests of several evaluations, see :func:`~.lockstep.gathered`)
        advances once per round; an error it raises ends that run alone (its :attr:`~LanczosRun.error`, a
        :class:`SharedRunError`): the groups holding it go on with their other runs, and each holder solves its own
        part again (:meth:`~.lockstep.Shared.solved`)."""
        owners: dict[int, tuple[LanczosRun, list]] = {}  # id(run) -> (run, keys of the groups holding it)
        for key, (runs, _) in self.groups.items():
            for r in runs:
                if not r.done:
                    owners.setdefault(id(r), (r, []))[1].append(key)

        def attempt(keys: list, run: LanczosRun, fn, *args) -> bool:  # whether it ran (a holder has no error yet)
            live = [key for key in keys if self.groups[key][1] is None]
            if live:
                try:
                    fn(*args)
                except Exception as err:
                    if len(keys) == 1:
                        self.groups[live[0]][1] = err
                    else:  # several holders: the run ends alone, each holder solves its own part again
                        run.fail(_shared_error(err))
            return bool(live) and run.error is None

        stepped = [(keys, r) for r, keys in owners.values() if attempt(keys, r, r.step)]
        due = [(keys, r) for keys, r in stepped if r.due and any(self.groups[k][1] is None for k in keys)]
        if due:
            parts = [r.host_parts() for _, r in due]
            flat = [p.reshape(-1) for p in parts]
            host = to_host(torch.cat(flat) if len(flat) > 1 else flat[0])
            ends = np.cumsum([p.numel() for p in parts])[:-1]
            for (keys, r), part in zip(due, np.split(host, ends), strict=True):
                attempt(keys, r, r.check, part.reshape(r.host_shape))
        if owners:
            self.clock += 1
        ended = [(key, error) for key, (runs, error) in self.groups.items()
                 if error is not None or all(r.done for r in runs)]  # fmt: skip
        for key, _ in ended:
            del self.groups[key]
        return ended


class LanczosRun:
    """One batched Lanczos run (the arguments of :func:`lanczos_max_abs`) as a state machine driven by :func:`solve`.

    ``tol``, ``algebraic`` and ``second_look`` may also be host arrays of ``batch_shape``, one per member: the members
    of several runs merged into one (:func:`merge_runs`), each as in a run of its own.

    :meth:`step` does one product and its re-orthogonalisation on the device and never reads a device value;
    when :attr:`due`, :func:`solve` hands :meth:`check` the host copy of :meth:`host_parts` (alpha, beta and the
    restart couplings), which decides convergence on the host (:func:`verdict`), restarts, takes the second look of
    the members that need one (:data:`SECOND_LOOK_SEED`) or finishes. ``seed``: the seed ``start`` was drawn with.

    Attributes:
        done: whether the run has stopped (then ``norm``, ``ritz``, ``rel_residual`` or ``error`` hold its outcome).
        due: whether the stopping test must run (:meth:`check`) before the next :meth:`step`.
        norm: ``batch_shape``, the largest ``|λ|`` (the largest eigenvalue with ``algebraic``).
        ritz: ``(*batch_shape, n)``, its Ritz vector.
        rel_residual: ``batch_shape``, the relative residual of the returned Ritz value when its member stopped.
        error: ``None``, or why the run ended without them (a shared run whose product raised, :meth:`fail`).
    """

    #: How many evaluations hold the run (:func:`~.lockstep.made_together` sets it): a run held by
    #: several steps in every holder's solve, so no one solve may merge it into a run of its own (:func:`merge_runs`).
    holders = 1
    #: The runs merged into this one (:func:`merge_runs`): ``[(run, first member, end)]``; ``None`` for a run of its
    #: own.
    merged: list | None = None

    def __init__(self, matvec, start, *, tol=1e-6, max_iter=None, max_basis=None, both_ends=True, pass_live=False,
                 algebraic=False, seed=0, second_look=True):  # fmt: skip
        batch_shape, n, dtype, device = tuple(start.shape[:-1]), start.shape[-1], start.dtype, start.device
        self.matvec, self.batch_shape, self.n, self.dtype, self.device = matvec, batch_shape, n, dtype, device
        self.pass_live, self.seed = pass_live, int(seed)
        self.choices = for_device(device)  # the device's stopping-test cadence and basis allocation
        # the members that take a second look (a crowded top when they passed the stopping test), and the first look's
        # (theta, rel, ritz) while the second runs
        self.relook = np.zeros(batch_shape, dtype=bool)
        self.first: tuple | None = None
        self.found: torch.Tensor | None = None  # (b, 1, n): the first look's unit Ritz vector, while the second runs
        # tol and algebraic: one for every member, or a host array of batch_shape (runs merged by merge_runs)
        self.tol = (
            tol if np.isscalar(tol) else np.array(np.broadcast_to(np.asarray(tol, dtype=float), self.batch_shape))
        )
        self.alg_h = np.array(np.broadcast_to(np.asarray(algebraic, dtype=bool), self.batch_shape))
        self.look_h = np.array(np.broadcast_to(np.asarray(second_look, dtype=bool), self.batch_shape))
        self.algebraic = bool(self.alg_h.all())
        self.done, self.due = False, False
        self.error: Exception | None = None  # why a shared run ended without its results (:meth:`fail`)
        if n <= 0:
            self.done = True
            self.norm = self.rel_residual = torch.zeros(batch_shape, dtype=dtype, device=device)
            self.ritz = torch.zeros((*batch_shape, max(n, 0)), dtype=dtype, device=device)
            return
        # products at most; without restarts the basis spans the whole space after n of them (then it stops)
        k_max = n if max_iter is None else max(1, int(max_iter))
        cap = min(k_max, n) if max_basis is None else min(k_max, n, int(max_basis))  # basis vectors at most
        if cap >= min(k_max, n):  # room for every vector the run can make: no restarts
            k_max = min(k_max, n)
        elif cap < 4:
            raise ValueError(
                f"Invalid max_basis={max_basis!r}. Must be >= 4 (a restart keeps two Ritz vectors and needs room for "
                "more), or None for no limit."
            )
        self.k_max, self.cap = k_max, cap
        v = start
        # which members must resolve both ends, a host mask (no read of a device value); never an algebraic one
        both = both_ends.detach().to("cpu").numpy() if isinstance(both_ends, torch.Tensor) else np.asarray(both_ends)
        self.both_h = np.broadcast_to(both.astype(bool), self.batch_shape) & ~self.alg_h
        # Inside, the batch is flat: vectors are (b, 1, n) rows and the basis (b, size, n), so that every product of the
        # step is one torch.bmm/baddbmm (a matmul over several batch dimensions dispatches ~6 operators: expands,
        # reshapes, the bmm and a view). The basis grows one vector per step into a buffer: basis = buf[:, :size],
        # allocated by the device's choice (choices.grow_basis).
        self.b = math.prod(self.batch_shape)
        # the unit start vectors (*batch_shape, n), until the first step allocates the basis (a run made but not stepped
        # holds no basis: merge_runs takes the starts of several into one run)
        self.start: torch.Tensor | None = v
        self.buf = self.basis = self.v = None  # (b, capacity, n), its first size vectors, the current one: first step
        self.size = 1
        # T = tridiag(alphas, betas), plus after a thick restart the couplings ``arrow`` (b, 1, k) of the k kept Ritz
        # vectors with the first new vector (T is then an arrowhead followed by a tridiagonal tail); each alpha and
        # beta a (b, 1, 1) tensor
        self.alphas: list[torch.Tensor] = []
        self.betas: list[torch.Tensor] = []
        self.arrow: torch.Tensor | None = None
        self.restarted = False
        self.live = np.ones(self.batch_shape, dtype=bool)  # host mask of the members still iterating
        self.active = self.stopped = None  # (b, 1, 1) device masks of live and stopped members, once one stopped
        self.theta = np.zeros(self.batch_shape)
        self.rel = np.zeros(self.batch_shape)
        self.ritz = v
        self.j = 0
        self.phase = 0  # steps before this run's first: stopping tests fall on the rounds of a Rounds clock
        self.w = self.beta = None
        self.scale = self.inf = None  # max |alpha|, beta so far, (b, 1, 1); an infinity: at the first step
        self.breakdown = 10 * torch.finfo(dtype).eps  # beta below this times scale: the Krylov space is exhausted

    def fail(self, error: Exception) -> None:
        """End the run without results (a shared run whose product raised, see :class:`Rounds`)."""
        self.done, self.due, self.error = True, False, error

    # -- one step on the device ------------------------------------------------------------------------------------

    def step(self) -> None:
        """One product and its full re-orthogonalisation (two classical Gram-Schmidt passes, "twice is enough");
        sets :attr:`due` when the stopping test must run before the next step. About 20 dispatched operators besides
        the product's own, none reading a device value."""
        if self.buf is None:
            self._allocate()
        v = self.v.view(*self.batch_shape, self.n)
        w = self.matvec(v, self.live) if self.pass_live else self.matvec(v)
        w = w.reshape(self.b, 1, self.n)
        if self.found is not None:  # the second look runs on P H P, P projecting out what the first look found
            w, _ = _project_out(w, self.found, self.found.mT)
        # Two passes always ("twice is enough", Giraud et al. 2005), on every device: the second is needed where the
        # first cancelled most of w (its rounding errors, ~eps ||w_before||, are then large next to what is left; a
        # second pass only below 0.1 ||w_before|| lets them compound: a 60 x 60 operator with eigenvalues in [0.1, 3]
        # run past convergence returns 21.7-25.7 (46-90 with max_basis=16) instead of 3). Deciding that is a read of a
        # device value off the host; on the host, where it is free, Kahan and Parlett's test (1/sqrt(2)) asks for the
        # second pass at nearly every step of a batched run anyway (the first pass of a three-term recurrence cancels
        # most of w), so it would save little.
        # The first pass's coefficient on v (the basis's last vector) is alpha = w.v.
        basis_t = self.basis.mT  # (one transposed view for both passes)
        w, coeff = _project_out(w, self.basis, basis_t)
        alpha = coeff.narrow(2, self.size - 1, 1)
        self.alphas.append(alpha)
        w, _ = _project_out(w, self.basis, basis_t)
        self.w, self.beta = w, torch.linalg.vector_norm(w, dim=-1, keepdim=True)
        self.scale = torch.maximum(self.scale, torch.maximum(alpha.abs(), self.beta))
        last = self.j + 1 == self.k_max
        self.full = self.size == self.cap and not last  # no room for the next vector: restart (after the test)
        self.due = last or self.full or (self.j + 1 + self.phase) % self.choices.check_every == 0
        if not self.due:
            self._next()

    def _allocate(self) -> None:
        """The basis buffer, its first vector the start (8 vectors, doubled as needed, where the device's choice is
        ``grow_basis``; otherwise room for every vector: on the host the pages are touched as they are written), and the
        step's device scalars: a run made to be merged (:func:`merge_runs`) never dispatches them."""
        cap = min(self.cap, 8) if self.choices.grow_basis else self.cap
        self.buf = torch.empty((self.b, cap, self.n), dtype=self.dtype, device=self.device)
        self.buf[:, 0] = self.start.reshape(self.b, self.n)
        self.start = None
        self.basis = self.buf.narrow(1, 0, 1)
        self.v = self.basis  # the current vector, (b, 1, n): the basis's last
        self.scale = torch.zeros((self.b, 1, 1), dtype=self.dtype, device=self.device)
        self.inf = torch.full((), torch.inf, dtype=self.dtype, device=self.device)

    def host_parts(self) -> torch.Tensor:
        """``(b, 1, m)``: the alphas, the betas kept so far, the current beta (and the restart couplings), what the
        stopping test reads (in the order of :attr:`host_shape`: ``(*batch_shape, m)``)."""
        parts = [*self.alphas, *self.betas, self.beta]
        if self.arrow is not None:
            parts.append(self.arrow)
        return torch.cat(parts, -1)

    @property
    def host_shape(self) -> tuple[int, ...]:
        k = 0 if self.arrow is None else self.arrow.shape[-1]
        return (*self.batch_shape, 2 * len(self.alphas) + k)

    # -- the stopping test on the host -----------------------------------------------------------------------------

    def check(self, ab: np.ndarray) -> None:
        """Eigen-decompose every member's projected matrix (``ab``: the float64 host copy of :meth:`host_parts`, a
        numpy array), apply the stopping test (:func:`verdict`), freeze the members that passed it, and finish, take
        the second look (:data:`SECOND_LOOK_SEED`), restart or go on. All on the host but the Ritz vectors of the
        members that stop: nothing here reads a device value."""
        size, dtype, device = len(self.alphas), self.dtype, self.device
        beta_h = ab[..., 2 * size - 1]
        T = np.zeros((*ab.shape[:-1], size, size))
        diag = np.arange(size)
        T[..., diag, diag] = ab[..., :size]
        if size > 1:
            off = ab[..., size : 2 * size - 1]
            T[..., diag[:-1], diag[1:]] = off
            T[..., diag[1:], diag[:-1]] = off
        kept = 0
        if self.arrow is not None:  # the kept Ritz vectors 0..k-1 couple to vector k only
            arr = ab[..., 2 * size :]
            kept = arr.shape[-1]
            T[..., :kept, kept] = arr
            T[..., kept, :kept] = arr
        evals, evecs = np.linalg.eigh(T)  # ascending
        v = verdict(T, evals, evecs, beta_h, tol=self.tol, algebraic=self.alg_h, both=self.both_h, kept=kept,
                    breakdown=self.breakdown, eps=torch.finfo(dtype).eps,
                    spans=size >= self.n and self.arrow is None)  # fmt: skip
        live = self.live
        self.rel = np.where(live, v.rel, self.rel)
        self.theta = np.where(live, v.theta, self.theta)
        if self.first is None:  # a close Ritz value when the test passed: a second look (SECOND_LOOK_SEED)
            self.relook |= live & v.converged & ~v.exhausted & (v.gap <= RELOOK) & self.look_h
        self.live = live & ~(v.exhausted | v.converged)
        done = not self.live.any() or self.j + 1 == self.k_max
        # A member takes its Ritz vector when it stops, from the steps it took: its later steps are zero (alpha = beta
        # = 0; with a negative theta those zero Ritz values would outrank an algebraic member's at the end), and the
        # vector is then the same whatever other members share the run (merge_runs).
        take = live if done else live & ~self.live
        if take.any():
            # the Ritz vector of theta, (*b, 1, size) @ (*b, size, n)
            y = np.take_along_axis(evecs, v.index[..., None, None], -1)[..., 0]  # (*batch_shape, size)
            y = _to_device(y.reshape(self.b, 1, size), dtype, device)
            new = torch.bmm(y, self.basis).view(*self.batch_shape, self.n)
            self.ritz = new if take.all() else torch.where(_to_device(take[..., None], None, device), new, self.ritz)
        if done:
            if self.first is None and self.relook.any():
                self._second_look()
            else:
                self._finish()
            return
        if not np.array_equal(self.live, live):
            self._mask(self.live)
        if self.full:
            self._restart(evals, evecs, beta_h)
        self._next()

    def _mask(self, live: np.ndarray) -> None:
        """The device masks of the live and the stopped members."""
        mask = live.reshape(self.b, 1, 1)
        self.active, self.stopped = _to_device(mask, None, self.device), _to_device(~mask, None, self.device)

    def _second_look(self) -> None:
        """Start the second look of the members whose top was crowded when they passed the stopping test: a new Krylov
        space from an independent seeded start (:data:`SECOND_LOOK_SEED`) on the operator with the first look's Ritz
        vector projected out, up to ``max_iter`` more products, the other members stopped; :meth:`_finish` then keeps
        the larger of the two looks."""
        self.first = (self.theta.copy(), self.rel.copy(), self.ritz)
        n, dtype, device = self.n, self.dtype, self.device
        # each run merged into this one (merge_runs) draws its own members' starts, as it would solved alone
        start = (
            start_vectors(self.batch_shape, n, dtype, device, seed=self.seed + SECOND_LOOK_SEED)
            if self.merged is None
            else torch.cat([
                start_vectors(r.batch_shape, n, dtype, device, seed=r.seed + SECOND_LOOK_SEED).reshape(-1, n)
                for r, _, _ in self.merged
            ]).view(*self.batch_shape, n)
        )  # fmt: skip
        # On P H P, P = I - u u^T projecting out the direction u the first look found (its unit Ritz vector), from a
        # start without u: where u is the second eigenvector and the first start nearly missed the top one, nothing
        # close is left for the top to hide behind; where u is the top's, the look finds the next eigenvalue, below.
        # (u is projected out of every product, not only the start: u's round-off grown back by the products would
        # make a look whose top re-emerges from round-off.)
        self.found = _unit(self.ritz.reshape(self.b, 1, n))
        start, _ = _project_out(start.reshape(self.b, 1, n), self.found, self.found.mT)
        start = _unit(start).view(*self.batch_shape, n)  # unit, as every basis vector
        self.live = self.relook.copy()
        self.start = start * _to_device(self.live[..., None], dtype, device)  # stopped members: zero rows
        # the look's tests every check_every (the device's choice) of its own steps, whenever it starts: the same
        # steps in a run merged with others (merge_runs) as alone; on the rounds of the Rounds clock where the first
        # look ended on a regular test
        self.phase = 0
        self.j, self.size, self.alphas, self.betas, self.arrow, self.restarted = 0, 1, [], [], None, False
        self.buf = self.basis = self.v = self.w = None
        self._mask(self.live)

    def _restart(self, evals: np.ndarray, evecs: np.ndarray, beta_h: np.ndarray) -> None:
        """Thick restart: keep the Ritz vectors of the lowest and highest Ritz values (both ends of the spectrum, the
        members' theta among them) and continue from the residual direction. With H V = V T + w e^T,
        H y_i = theta_i y_i + (beta s_i) w / beta: the kept vectors couple to the next one only, through
        arrow_i = beta s_i (s_i the last entry of eigenvector i)."""
        size, dtype, device, b = len(self.alphas), self.dtype, self.device, self.b
        k_lo = max(1, self.cap // 4)
        keep = np.concatenate([np.arange(k_lo), np.arange(size - k_lo, size)])
        Y = evecs[..., keep].reshape(b, size, 2 * k_lo)  # host
        Yt = _to_device(Y, dtype, device).mT
        k = 2 * k_lo
        # the kept vectors (b, k, n), half the basis, a temporary: made RESTART_CHUNKS slices of the members at a time
        step = -(-b // RESTART_CHUNKS)
        for lo in range(0, b, step):
            self.buf[lo : lo + step, :k] = torch.bmm(Yt[lo : lo + step], self.basis[lo : lo + step])
        self.size = k
        self.basis = self.buf.narrow(1, 0, k)
        arrow = beta_h.reshape(b, 1) * Y[:, -1, :] * self.live.reshape(b, 1)  # (b, k); 0 for stopped members
        self.arrow = _to_device(arrow.reshape(b, 1, k), dtype, device)
        self.alphas = list(_to_device(evals[..., keep].reshape(b, 1, k), dtype, device).split(1, -1))
        # zero couplings between the kept vectors, and between the last of them and the next vector (that one, like
        # all of the kept vectors' couplings to it, is in arrow)
        self.betas = list(torch.zeros((b, 1, k), dtype=dtype, device=device).split(1, -1))
        self.restarted = True

    def _next(self) -> None:
        """The next Lanczos vector ``w / beta``, written straight into its basis slot; stopped members get zero."""
        beta = self.beta
        if self.restarted:
            self.restarted = False
        elif self.stopped is None:
            self.betas.append(beta)
        else:
            self.betas.append(beta * self.active)
        size = self.size
        if size + 1 > self.buf.shape[1]:
            grown = torch.empty((self.b, min(self.cap, 2 * self.buf.shape[1]), self.n), dtype=self.dtype,
                                device=self.device)  # fmt: skip
            grown[:, :size] = self.basis
            self.buf = grown
        v = self.buf.narrow(1, size, 1)
        # A breakdown (beta at round-off level of the operator's scale: the Krylov space is exhausted) gives a zero
        # vector (w / inf), as for a stopped member, not w / beta: w is round-off then, and on a tiny operator its norm
        # underflows (a collapsed LayerNorm's attention block in float32: beta = 0 for w != 0, and w / tiny gives
        # Ritz values of 4e7 for an operator of norm 2e-9, then inf and NaN in T between two stopping tests).
        # The stopping test then sees beta = 0: exhausted. (The where is on the batch-shaped betas and the division
        # in place: a torch.where over the vectors with a broadcast condition is ~10x slower on CPU at n = 590k.)
        denom = torch.where(beta > self.scale * self.breakdown, beta, self.inf)
        torch.div(self.w, denom, out=v)
        if self.stopped is not None:
            v.masked_fill_(self.stopped, 0.0)
        self.v = v
        self.size = size + 1
        self.basis = self.buf.narrow(1, 0, size + 1)
        self.w = None
        self.j += 1

    def _finish(self) -> None:
        self.done = True
        if self.first is not None:  # the larger of the two looks; agreeing to tol, known to the better residual
            theta1, rel1, ritz1 = self.first
            key1, key2 = (np.where(self.alg_h, t, np.abs(t)) for t in (theta1, self.theta))
            second = self.relook & (key2 > key1)
            agree = self.relook & (np.abs(key2 - key1) <= self.tol * np.abs(key1))
            self.rel = np.where(agree, np.minimum(rel1, self.rel), np.where(second, self.rel, rel1))
            self.theta = np.where(second, self.theta, theta1)
            if second.any():
                self.ritz = torch.where(_to_device(second[..., None], None, self.device), self.ritz, ritz1)
            else:
                self.ritz = ritz1
            self.first = self.found = None
        theta = _to_device(self.theta, self.dtype, self.device)
        self.rel_residual = _to_device(self.rel, self.dtype, self.device)
        self.norm = (
            theta
            if self.algebraic
            else theta.abs()
            if not self.alg_h.any()
            else torch.where(_to_device(self.alg_h, None, self.device), theta, theta.abs())
        )
        self.buf = self.basis = self.v = self.w = self.alphas = self.betas = self.arrow = self.start = None


def mergeable(run: LanczosRun) -> bool:
    """Whether :func:`merge_runs` may take ``run``: made, never stepped, not done, held by one evaluation."""
    return not run.done and run.start is not None and run.first is None and run.holders == 1


def merge_runs(runs: Sequence[LanczosRun]) -> LanczosRun:
    """One run of the members of several :func:`mergeable` runs whose vectors have one size, dtype and device and whose
    ``max_iter`` and ``max_basis`` agree: one Lanczos step (two Gram-Schmidt passes, the norm, the next vector: ~17
    dispatched operators) per step for all of them, one stopping test. Each member keeps its run's start vector,
    tolerance, ``algebraic``, second look and ends of the spectrum, and its product is its run's ``matvec`` on its
    rows; every member is its own recurrence, so the numbers are those of the runs solved apart, to the bit on CPU.
    Runs whose batches share their trailing dimensions (``(rows, H)`` of one ``H``) are rows of a ``(sum of rows, H)``
    run; others (the grouped-query attention's query view, ``H`` heads, and group view, ``G`` kv groups) members of a
    flat one. Solve the returned run, then :func:`split_results` hands each run its results."""
    first = runs[0]
    n, same = first.n, len({r.batch_shape[1:] for r in runs}) == 1

    def members(r: LanczosRun, a):  # a run's (*batch_shape, ...) array as the merged run's leading dimension
        return a if same else a.reshape(r.b, *a.shape[len(r.batch_shape) :])

    def joined(arrays: list, join):
        return join([members(r, a) for r, a in zip(runs, arrays, strict=True)])

    sizes = [r.batch_shape[0] if same else r.b for r in runs]
    bounds = np.cumsum([0, *sizes]).tolist()
    merged = list(zip(runs, bounds[:-1], bounds[1:], strict=True))

    def mv(u: torch.Tensor, live=None) -> torch.Tensor:
        out = []
        for r, lo, hi in merged:
            if live is not None and not live[lo:hi].any():  # a run whose members all stopped: zero rows, no product
                out.append(torch.zeros_like(u[lo:hi]))
                continue
            x = u[lo:hi] if same else u[lo:hi].view(*r.batch_shape, n)
            alive = None if live is None else live[lo:hi] if same else live[lo:hi].reshape(r.batch_shape)
            w = r.matvec(x, alive) if r.pass_live else r.matvec(x)
            out.append(w if same else w.reshape(hi - lo, n))
        return torch.cat(out)

    tols = [np.broadcast_to(np.asarray(r.tol, dtype=float), r.batch_shape) for r in runs]
    run = LanczosRun(
        mv,
        joined([r.start for r in runs], torch.cat),
        tol=joined(tols, np.concatenate),
        max_iter=first.k_max,
        max_basis=first.cap,
        pass_live=True,
        both_ends=joined([r.both_h for r in runs], np.concatenate),
        algebraic=joined([r.alg_h for r in runs], np.concatenate),
        seed=first.seed,
        second_look=joined([r.look_h for r in runs], np.concatenate),
    )
    for r in runs:
        r.start = r.ritz = None  # (the merged run holds the starts; a run's ritz is its start until it is solved)
    run.merged = merged
    return run


def split_results(run: LanczosRun) -> None:
    """Each run merged into ``run`` (:func:`merge_runs`), solved, gets its members' results as if solved alone
    (``norm``, ``rel_residual``, ``ritz``: views of ``run``'s, a warm-start store copies the vectors it keeps,
    :meth:`~..settings.WarmStart.put`; or ``error``); ``run``'s product (and what it holds) is released."""
    for r, lo, hi in run.merged:
        r.done, r.matvec = True, None
        if run.error is not None:
            r.error = run.error
            continue
        rows = len(run.batch_shape) == len(r.batch_shape)  # (its rows of a (rows, ...) run: shaped already)
        r.norm, r.rel_residual, r.ritz = (
            t[lo:hi] if rows else t[lo:hi].view(*r.batch_shape, *t.shape[1:])
            for t in (run.norm, run.rel_residual, run.ritz)
        )
    run.matvec = run.merged = None


def start_vectors(batch_shape: Sequence[int], n: int, dtype: torch.dtype, device: torch.device | str,
                  v0: torch.Tensor | None = None, seed: int = 0) -> torch.Tensor:  # fmt: skip
    """The unit start vectors ``(*batch_shape, n)`` of a :class:`LanczosRun`: random, drawn on the device (no host
    tensor copied over), or the direction of ``v0`` plus noise of its own norm (:data:`WARM_NOISE`; a zero ``v0``, an
    exactly-zero block last time, is then a cold start)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    noise = torch.randn((*batch_shape, n), generator=gen, dtype=dtype, device=device)
    tiny = torch.finfo(dtype).tiny
    if v0 is None:
        v = noise
    else:
        v = v0.to(dtype=dtype, device=device)
        v = _unit(v) + noise * (WARM_NOISE / noise.norm(dim=-1, keepdim=True).clamp_min(tiny))
    return _unit(v)


def _unit(v: torch.Tensor) -> torch.Tensor:
    """``v`` scaled to unit norm along its last dimension (a zero vector stays zero)."""
    return v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(v.dtype).tiny)


def _to_device(a: np.ndarray, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A small host array as a tensor on the solver's device (non-blocking: the host does not wait for the device)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(device=device, dtype=dtype, non_blocking=device.type != "cpu")


def _project_out(w: torch.Tensor, basis: torch.Tensor, basis_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One classical Gram-Schmidt pass: ``(w - c B, c)`` with ``c = w B^T``, for ``w`` ``(b, 1, n)``, a basis ``B``
    ``(b, j, n)`` and its transposed view ``basis_t`` = ``B.mT`` (made once for a step's two passes); two dispatched
    operators."""
    # w B^T as a row-vector product, not B w: several times faster on CPU (batched, n = 32768)
    coeff = torch.bmm(w, basis_t)  # (b, 1, j)
    return torch.baddbmm(w, coeff, basis, alpha=-1), coeff
