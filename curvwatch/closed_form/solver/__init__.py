"""The matrix-free solver under the closed forms: Lanczos runs, block operators, their plans and the sampled curvature.

A kernel of :mod:`curvwatch.closed_form` writes its Hessian as a :class:`BlockOperator` (closed-form products with
the outer and functional parts) and asks this package for norms:

* :mod:`~.choices`: the per-device choices (:class:`SolverChoices`: stopping-test cadence, basis allocation, stacked
  products, lockstep), and :func:`~.choices.forced` to take a GPU's on a CPU;
* :mod:`~.lanczos`: batched Lanczos (:class:`LanczosRun`, :func:`lanczos_max_abs`) and the solve that advances many
  runs with one host read per round of stopping tests (:func:`solve`);
* :mod:`~.stopping`: the stopping test on each run's projected matrix (:func:`~.stopping.verdict`: the residual, the
  drift of the deciding Ritz values, a crowded top, the other end of an indefinite spectrum);
* :mod:`~.lockstep`: several evaluations whose solves and exact pieces meet (:class:`Lockstep`, :func:`gathered`);
* :mod:`~.operator`: the operator interface and the symmetric matvecs of its blocks (:func:`pair_matvec`), dense
  blocks for tests;
* :mod:`~.plan`: runs planned, made and solved together (:func:`spectral_plan`, :func:`solve_planned`);
* :mod:`~.sampled`, :mod:`~.sampled_keys`, :mod:`~.gram`, :mod:`~.members`, :mod:`~.debiasing`: the Monte-Carlo output
  curvature of the real-loss keys, their plan, the exact Gram path, the members' products and the few-sample bias;
* :mod:`~.linalg`: small dense helpers (exact spectral norms, products with a shared factor).
"""

from .choices import SolverChoices
from .debiasing import SPREAD_LIMIT, debias, extrapolated_residual
from .gram import gram_columns, gram_eigen, gram_matrices
from .lanczos import LanczosRun, lanczos_max_abs, merge_runs, solve, start_vectors
from .linalg import gram_lambda_max, shared_times, spectral_norm_2d, times_shared
from .lockstep import Lockstep, Shared, gathered, made_together
from .members import member_shares, members_matvec
from .operator import BlockOperator, Embedding, ParamInfo, dense_blocks, head_keys, pair_matvec, stacked_matvec
from .plan import SOLVE_BYTES, Planned, full_norms, solve_planned, spectral_norms, spectral_plan
from .sampled import Preconditioned, SampledCurvature, check_output_samples, check_precondition, with_sampled
from .sampled_keys import sampled_norms, sampled_plan

__all__ = [
    # per-device choices
    "SolverChoices",
    # Lanczos
    "LanczosRun",
    "lanczos_max_abs",
    "start_vectors",
    "solve",
    "merge_runs",
    # evaluations in lockstep
    "Lockstep",
    "Shared",
    "gathered",
    "made_together",
    # block operators and their norms
    "BlockOperator",
    "ParamInfo",
    "Embedding",
    "pair_matvec",
    "stacked_matvec",
    "head_keys",
    "dense_blocks",
    "Planned",
    "SOLVE_BYTES",
    "spectral_plan",
    "spectral_norms",
    "full_norms",
    "solve_planned",
    # sampled output curvature (real-loss keys)
    "SampledCurvature",
    "Preconditioned",
    "with_sampled",
    "check_output_samples",
    "check_precondition",
    "sampled_plan",
    "sampled_norms",
    "gram_columns",
    "gram_matrices",
    "gram_eigen",
    "members_matvec",
    "member_shares",
    "debias",
    "extrapolated_residual",
    "SPREAD_LIMIT",
    # dense helpers
    "gram_lambda_max",
    "spectral_norm_2d",
    "shared_times",
    "times_shared",
]
