"""The step's tally: what every rank must decide alike (finite norm, loss spike, stop signal,
checkpoint written) comes from ONE all-reduce, read on the host once (each read waits for the GPU).

Summed over every rank: TP peers hold copies of the same loss sum and count and earlier pipeline
stages add zeros, so sum / count is the global mean either way; the norm is global already, so its
sum divided by the world size is the norm itself, exactly (in fp64).
"""

import math

import torch
import torch.distributed as dist

from lingua.parallel.distributed import DistEnv


def over_ranks(env: DistEnv, loss_pair, grad_norm: torch.Tensor, counts: dict) -> dict:
    """The same floats on every rank; loss_pair None without the loss; NaN with no token."""
    names = list(counts)
    packed = torch.zeros(3 + len(names), dtype=torch.float64, device=grad_norm.device)
    if loss_pair is not None:
        packed[0], packed[1] = loss_pair   # each a device tensor or a host number: no copy
    packed[2] = grad_norm.detach()
    for i, name in enumerate(names):
        packed[3 + i] = float(counts[name])   # a fill with the host number: no copy either
    if env.world_size > 1:
        dist.all_reduce(packed)
    values = read_on_host(packed)
    total, count, norm = values[:3]
    return {"loss": total / count if count else math.nan, "grad_norm": norm / env.world_size,
            **dict(zip(names, values[3:]))}


def read_on_host(packed: torch.Tensor) -> list:
    """The step's one host read (the GPU tests allow this one sync, and no other)."""
    return packed.tolist()
