"""Cross-rank reduction (:class:`curvwatch.ranks.Ranks`) on two CPU processes (gloo)."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from curvwatch.logbook import drop_no_data
from curvwatch.ranks import Ranks


def _worker(rank: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        nan = math.nan
        # the same keys on both ranks; a NaN real-loss key is "no value on this rank" (too uncertain there)
        flat = {
            ("b", "hessian/QQ"): [1.0, 3.0][rank],  # mean
            ("b", "sharpness/W2W2"): [nan, 4.0][rank],  # mean over the rank with a value
            ("b", "sharpness/VV"): [nan, nan][rank],  # no value anywhere
            ("b", "ln/inv_var_max"): [5.0, 7.0][rank],  # max
            ("b", "stability/W2W2"): [2.0, nan][rank],
        }
        reduced, skip = Ranks(2, torch.device("cpu")).sync(flat, failed=False)
        out[rank] = (drop_no_data(reduced), skip)
    finally:
        dist.destroy_process_group()


def test_a_key_without_value_on_one_rank_is_reduced_over_the_others(tmp_path):
    """Both ranks log the same keys: the mean of a key one rank has no value for is the other rank's value, a key no
    rank has a value for is dropped, and the evaluation is not skipped (it was when the key sets differed)."""
    init = f"file://{os.path.join(tmp_path, 'store')}"
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(init, out), nprocs=2, join=True)
        results = dict(out)
    for rank in (0, 1):
        reduced, skip = results[rank]
        assert not skip
        assert reduced == {
            ("b", "hessian/QQ"): 2.0,
            ("b", "sharpness/W2W2"): 4.0,
            ("b", "ln/inv_var_max"): 7.0,
            ("b", "stability/W2W2"): 2.0,
        }, reduced
