"""How the kernels compute: the Hessian parts, the Lanczos settings of the iterative norms and their warm starts.

The Hessian of a block splits into ``H = H_o + H_f`` (docs: "The Gauss-Newton / functional split"): the
Gauss-Newton part ``"outer"``, the ``"functional"`` part and their sum ``"hessian"``. :data:`PARTS` names them,
in the order every kernel reports them; a kernel's ``parts=`` argument picks the ones its iterative norms compute.

Every kernel of :mod:`curvwatch.closed_form` that finds a norm by Lanczos (attention, FFN, the whole block)
takes one ``lanczos=`` argument instead of a tail of keywords. The defaults are bounded: at most
``max_iter = 100`` Hessian products and ``max_basis = 16`` Lanczos vectors held per norm (thick restarts beyond),
so a call with the defaults runs in bounded memory and time at the sizes people train (the basis of an FFN norm
is ``d d_ff`` numbers per vector), and warns when a norm stops at ``max_iter`` before reaching ``tol``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["EXACT", "PARTS", "Lanczos", "LanczosWarning", "WarmStart", "check_parts", "inputs_checked"]

#: The parts of a block Hessian ``H = H_o + H_f``: the Gauss-Newton (outer) part, the functional part, their sum.
PARTS = ("outer", "functional", "hessian")


def check_parts(parts: str | Sequence[str]) -> tuple[str, ...]:
    """A ``parts`` argument validated, in the canonical order of :data:`PARTS`.

    Raises:
        ValueError: If it is empty or names something other than ``"outer"``, ``"functional"``, ``"hessian"``.

    Example:
        >>> check_parts(["hessian", "outer"])
        ('outer', 'hessian')
    """
    parts = (parts,) if isinstance(parts, str) else tuple(parts)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"Invalid parts={parts!r}. Choose a non-empty subset of {PARTS}.")
    return tuple(p for p in PARTS if p in parts)


#: Set while a caller that has already checked every input for NaN/Inf (the monitor's engine, in one host read for all
#: blocks) runs the kernels: they then skip their own checks, a device sync per call.
INPUTS_CHECKED = contextvars.ContextVar("curvwatch_inputs_checked", default=False)


@contextlib.contextmanager
def inputs_checked() -> Iterator[None]:
    """Within this context the kernels trust that their inputs are finite (the caller checked them)."""
    token = INPUTS_CHECKED.set(True)
    try:
        yield
    finally:
        INPUTS_CHECKED.reset(token)


class LanczosWarning(UserWarning):
    """A Lanczos norm stopped at ``max_iter`` with a relative residual above ``tol``."""


class WarmStart:
    """Lanczos start vectors kept between calls, one entry per norm (pair and parts).

    Pass the same object to successive calls on the same block (the monitor keeps one per block): each norm
    starts from the Ritz vectors of the previous call, which converges in a few steps when the weights moved
    little. Vectors whose shape no longer fits (another batch size, another pair set) are ignored.

    Example:
        >>> warm = WarmStart()
        >>> warm.put(("QQ", ("hessian",)), torch.ones(1, 2, 3))
        >>> warm.get(("QQ", ("hessian",)), (1, 2, 3), torch.float64, "cpu").dtype, len(warm)
        (torch.float64, 1)
        >>> warm.get(("QQ", ("hessian",)), (1, 2, 4), torch.float64, "cpu") is None
        True
    """

    def __init__(self) -> None:
        self._vectors: dict[Hashable, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._vectors)

    def get(
        self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor | None:
        """The stored start vectors for ``key`` in ``dtype`` on ``device`` if their shape is ``shape``, else None.

        Non-finite entries become 0 (Lanczos mixes noise into a zero start); no host-device sync checks them.
        """
        v0 = self._vectors.get(key)
        if v0 is None or tuple(v0.shape) != tuple(shape):
            return None
        return torch.nan_to_num(v0.to(dtype=dtype, device=device), nan=0.0, posinf=0.0, neginf=0.0)

    #: The stored vectors' dtype. A warm start is a direction, to which the solver adds noise of its own norm
    #: (:data:`~curvwatch.closed_form.solver.lanczos.WARM_NOISE`): three digits are plenty, and the store is held on
    #: the model's device for the whole run (GPT-2-small width: about 20 MiB per layer, ~0.25 GiB for 12 layers).
    dtype = torch.bfloat16

    def put(self, key: Hashable, vectors: torch.Tensor) -> None:
        """Store the Ritz vectors of the norm ``key`` (detached; floating ones in :attr:`dtype` where that is
        smaller; a copy where they are part of a larger tensor, e.g. a run's members merged with others', so that the
        store holds only its own)."""
        v = vectors.detach()
        if v.is_floating_point() and v.element_size() > self.dtype.itemsize:
            v = v.to(self.dtype)
        elif v.untyped_storage().nbytes() > v.numel() * v.element_size():
            v = v.clone()
        self._vectors[key] = v

    def clear(self) -> None:
        """Forget every stored vector (the next calls start cold)."""
        self._vectors.clear()


@dataclass(frozen=True)
class Lanczos:
    """Settings of the Lanczos spectral norms.

    Args:
        tol: Relative residual at which a norm counts as converged (some eigenvalue then lies within ``tol`` of
            it, relative); ``0`` runs every norm to ``max_iter``.
        max_iter: Most Lanczos steps (Hessian products) per norm; ``None``: the block size (exact in exact
            arithmetic, only for small blocks). A norm whose top Ritz value had a close one below it when it
            converged takes a second look, of up to as many steps, from an independent start on the operator with
            the first look's direction projected out (:data:`~.solver.lanczos.RELOOK`).
        max_basis: Most Lanczos vectors held per norm (``>= 4``); ``None``: ``max_iter``. A norm that needs more
            steps restarts thickly (same accuracy, a few more products), so memory is bounded whatever
            ``max_iter``.
        warm_start: A :class:`WarmStart` kept between calls, or ``None`` for cold starts.
        warn: Warn (:class:`LanczosWarning`) when a norm stops at ``max_iter`` above ``tol``. The monitor turns
            this off and reports convergence through its own keys instead.
        solve_bytes: Most bytes of Lanczos bases one kernel call holds at once so that its runs share their stopping
            tests (one host read per round of tests for all of them, a sync on a GPU); runs beyond it are solved one
            after the other. ``None``: :data:`~.solver.plan.SOLVE_BYTES` (1 GiB). The monitor passes each block's
            own estimate of its bases (:func:`~curvwatch.engine.memory.basis_bytes`, which its memory windows
            already count), at least that.
        seed: Seed of the start vectors' random part (the whole of a cold start, the noise mixed into a warm start).
            The monitor's engine passes its count of evaluations, checkpointed with it: successive evaluations and a
            resumed run draw independent starts. With one seed for every call a draw nearly orthogonal to a block's
            top eigenvector recurs at every evaluation for as long as that eigenvector stays, cold or warm (the
            noise a warm start carries is the same vector each time). A second look draws with ``seed +``
            :data:`~.solver.lanczos.SECOND_LOOK_SEED`.
        second_look: Whether a norm whose top Ritz value had another within :data:`~.solver.lanczos.RELOOK` of it
            when it converged takes a second look (see ``max_iter``). The real-loss keys'
            solves run without it: they estimate from a few sampled output gradients, with a relative uncertainty
            (``sharpness_spread``) larger than the 1-5% a second look finds.

    Example:
        >>> Lanczos().max_iter, Lanczos(tol=1e-6).tol, EXACT.max_iter is None
        (100, 1e-06, True)
        >>> Lanczos(max_basis=2)
        Traceback (most recent call last):
        ...
        ValueError: Invalid max_basis=2. Must be an int >= 4 (Lanczos vectors held per norm), or None ...
    """

    tol: float = 1e-3
    max_iter: int | None = 100
    max_basis: int | None = 16
    warm_start: WarmStart | None = None
    warn: bool = True
    solve_bytes: int | None = None
    seed: int = 0
    second_look: bool = True

    def __post_init__(self) -> None:
        tol = self.tol
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 <= tol < 1:
            raise ValueError(f"Invalid tol={tol!r}. Must be a number in [0, 1), e.g. 1e-3.")
        if self.max_iter is not None and (
            isinstance(self.max_iter, bool) or not isinstance(self.max_iter, int) or self.max_iter < 1
        ):
            raise ValueError(f"Invalid max_iter={self.max_iter!r}. Must be an int >= 1, or None for the block size.")
        if self.max_basis is not None and (
            isinstance(self.max_basis, bool) or not isinstance(self.max_basis, int) or self.max_basis < 4
        ):
            raise ValueError(
                f"Invalid max_basis={self.max_basis!r}. Must be an int >= 4 (Lanczos vectors held per norm), or None "
                "to hold up to max_iter."
            )
        if self.solve_bytes is not None and (
            isinstance(self.solve_bytes, bool) or not isinstance(self.solve_bytes, int) or self.solve_bytes < 0
        ):
            raise ValueError(
                f"Invalid solve_bytes={self.solve_bytes!r}. Must be an int >= 0 (bytes of Lanczos bases held at once), "
                "or None for the default (1 GiB)."
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"Invalid seed={self.seed!r}. Must be an int >= 0.")
        if not isinstance(self.second_look, bool):
            raise ValueError(f"Invalid second_look={self.second_look!r}. Must be True or False.")
        if self.warm_start is not None and not isinstance(self.warm_start, WarmStart):
            raise ValueError(
                f"Invalid warm_start={self.warm_start!r}. Must be a curvwatch.closed_form.WarmStart or None."
            )

    def replace(self, **changes) -> Lanczos:
        """A copy with some fields changed, e.g. ``lanczos.replace(max_basis=8)``."""
        return dataclasses.replace(self, **changes)

    def warn_unconverged(self, out: Mapping[str, torch.Tensor], where: str) -> None:
        """Warn once per call if some norm of ``out`` (keys ``residual/...``) stopped above ``tol``.

        One host-device sync, only when ``warn`` is set and ``tol > 0``.
        """
        if not self.warn or self.tol == 0:
            return
        keys = [k for k in out if k.startswith("residual/")]
        if not keys:
            return
        values = torch.stack([out[k].reshape(()).to("cpu", torch.float64) for k in keys]).tolist()
        bad = [(k[len("residual/") :], v) for k, v in zip(keys, values, strict=True) if not v <= self.tol]
        if bad:
            key, worst = max(bad, key=lambda kv: kv[1] if math.isfinite(kv[1]) else math.inf)
            warnings.warn(
                f"{where}: {len(bad)} of {len(keys)} Lanczos norms stopped at max_iter={self.max_iter} above "
                f"tol={self.tol:g} (worst relative residual {worst:.2g}, {key!r}); such a norm may read low by up "
                "to about that fraction. Pass lanczos=Lanczos(max_iter=...) with more steps, a larger tol, or "
                "warn=False to accept them.",
                LanczosWarning,
                stacklevel=3,
            )


#: Run every norm to the block size without restarts: exact up to round-off. Small blocks only (tests, docs).
EXACT = Lanczos(tol=0.0, max_iter=None, max_basis=None, warn=False)
