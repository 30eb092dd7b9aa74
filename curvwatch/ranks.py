"""Cross-rank agreement: every rank takes the same decisions and logs the same numbers.

Under data parallelism each rank evaluates its own batch. Before anything is logged the ranks agree: a failure
flag is all-reduced (a failure on any rank skips the evaluation on all ranks, so none hangs), the key sets are
compared through their count and a checksum, then every number is combined by the reduction its row in the key
table (:mod:`curvwatch.keys`) gives: the mean for norms, ratios and terms, the max (min) for extremes such as
``ln/inv_var_max`` (``ln/var_min_over_eps``). A key a rank has no value for (NaN: a real-loss key too uncertain
on that rank's batch, ``closed_form.solver.debiasing.SPREAD_LIMIT``) is left out of that key's reduction; no value on
any rank stays NaN, for the caller to drop. Every rank calls these functions at the same step, failed or not, so the
collectives always match. On one process they return their input unchanged.
"""

from __future__ import annotations

import zlib

import torch

from curvwatch.keys import reduce_op

__all__ = ["Ranks"]


class Ranks:
    """The process group of a run, seen by the monitor.

    Args:
        world_size: Number of ranks (``trainer.world_size``).
        device: Device of the collectives (the model's: NCCL needs CUDA tensors, gloo takes CPU ones).

    Example:
        >>> Ranks(1, torch.device("cpu")).sync({("layer0/attn", "hessian/QQ/h0"): 2.0}, failed=False)
        ({('layer0/attn', 'hessian/QQ/h0'): 2.0}, False)
    """

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = int(world_size)
        self.device = device

    @property
    def active(self) -> bool:
        """Whether there are other ranks to agree with (an initialised process group of size > 1)."""
        dist = torch.distributed
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise max over ranks of a float64 tensor (a copy on one process)."""
        if not self.active:
            return values.clone()
        values = values.to(self.device)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        return values

    def sync(self, flat: dict[tuple[str, str], float], failed: bool) -> tuple[dict[tuple[str, str], float], bool]:
        """All-reduce the failure flag and the numbers: ``(reduced numbers, any rank failed)``.

        Args:
            flat: ``{(block, relative key): value}`` of this rank's evaluation.
            failed: Whether this rank's evaluation failed.

        Returns:
            The reduced numbers (``{}`` when any rank failed or the key sets differ) and whether to skip.
        """
        if not self.active:
            return flat, False
        keys = sorted(flat) if not failed else []
        checksum = float(zlib.crc32("\n".join(f"{b}/{k}" for b, k in keys).encode()))
        flags = self.max(torch.tensor([float(failed), len(keys), -len(keys), checksum, -checksum], dtype=torch.float64))
        agreed = flags[1] == -flags[2] and flags[3] == -flags[4]
        if flags[0] > 0 or not agreed:
            return {}, True
        dist = torch.distributed
        device = self.device
        ops = [reduce_op(k) for _, k in keys]
        values = torch.tensor([flat[k] for k in keys], dtype=torch.float64, device=device)
        # a NaN is "no value on this rank" (logbook.flatten(keep_no_data=True)): the other ranks' values decide, and a
        # key no rank has a value for stays NaN (dropped after)
        valid = ~torch.isnan(values)
        is_mean = torch.tensor([op == "mean" for op in ops], device=device)
        sums = torch.stack([torch.where(is_mean & valid, values, 0.0), valid.to(torch.float64)])  # (2, keys)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        sign = torch.tensor([-1.0 if op == "min" else 1.0 for op in ops], dtype=torch.float64, device=device)
        extreme = torch.where(valid, values * sign, -torch.inf)
        dist.all_reduce(extreme, op=dist.ReduceOp.MAX)
        counts = sums[1]
        out = torch.where(is_mean, sums[0] / counts, extreme * sign)
        out = torch.where(counts > 0, out, torch.nan)
        return dict(zip(keys, out.tolist(), strict=True)), False
