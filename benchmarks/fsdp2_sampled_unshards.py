"""How many FSDP2 all-gathers the real-loss keys' sampled backward passes add (docs/strategies.md).

    python benchmarks/fsdp2_sampled_unshards.py

The tiny 2-layer GPT, ``fully_shard`` on each layer and the root (3 FSDP units), on one process (gloo): counts
FSDP2's unshards that gather (``FSDPParamGroup.unshard`` on a sharded group; on one process FSDP2 skips the
communication itself, the count is what N processes would all-gather) in the forward, in
``Capture.sample_outputs`` with 0, 4 and 16 samples, and in the training's own backward.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from curvwatch.realloss import sample_outputs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from curvwatch import sharding
    from curvwatch.adapters import find_blocks
    from curvwatch.capture import Capture
    from curvwatch.models.gpt import GPT, GPTConfig

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    gathers = []
    unshard = FSDPParamGroup.unshard

    def counting(self, async_op: bool = False):
        if not self.is_unsharded and self._all_gather_result is None:  # would all-gather
            gathers.append(1)
        return unshard(self, async_op)

    FSDPParamGroup.unshard = counting
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, d_model=8, d_ff=16))
    idx = torch.randint(0, 11, (2, 8))
    mesh = init_device_mesh("cpu", (1,))
    for samples in (0, 4, 16):
        model = copy.deepcopy(base)
        specs = find_blocks(model)
        for layer in model.blocks:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with Capture(specs, max_tokens=16, read_params=sharding.full_params, logits_module=model.head) as capture:
            gathers.clear()
            loss = F.cross_entropy(model(idx).reshape(-1, 11), idx.reshape(-1))
            forward = len(gathers)
            gathers.clear()
            if samples:
                sample_outputs(capture, loss, samples, generator=torch.Generator().manual_seed(1))
            sampled = len(gathers)
            gathers.clear()
            loss.backward()
        print(
            f"samples {samples:2d}: unshards in the forward {forward}, sampled passes {sampled}, "
            f"backward {len(gathers)}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
