"""The step's tally: what every rank must decide alike once the gradients are complete (is the
norm finite, is the step a loss spike, did any rank get a stop signal, has every rank written its
part of a checkpoint) comes from ONE all-reduce of a few numbers, read on the host once.

Each read of a GPU value on the host waits for the GPU's queue to drain, and the next collective
cannot be queued before it: one read a step instead of one per feature keeps the GPU fed. The
numbers are the step's loss sum and token count, the gradient norm, and each hook's counts (its
after_backward returns, lingua/hooks.py), summed over every rank of the default group:
tensor-parallel peers hold copies of the same loss sum and count and earlier pipeline stages add
zeros, so sum / count is the global mean either way; the norm is global already, so its sum
over the ranks divided by the world size is the norm itself, exactly (a fp32 value times a rank
count is exact in fp64).
"""

import math

import torch
import torch.distributed as dist

from lingua.parallel.distributed import DistEnv


def over_ranks(env: DistEnv, loss_pair, grad_norm: torch.Tensor, counts: dict) -> dict:
    """{"loss", "grad_norm", **counts summed over the ranks}, the same floats on every rank.
    loss_pair: this rank's (loss sum, token count) of the step, or None (a rank without the
    loss: an earlier pipeline stage); the loss is NaN where no rank has a token. counts: host
    numbers under the same names, in the same order, on every rank."""
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
