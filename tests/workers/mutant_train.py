"""`python -m apps.llama.train` with one deliberate bug, for tests/test_catches.py only.

The bug is named by LINGUA_TEST_MUTATION, which nothing but this launcher reads: the project's
code is unchanged, and the bug is patched in here, in the worker process, before training starts.
Each bug is one a parallel trainer really gets wrong; the equivalence and resume checks of
tests/equivalence.py must report every one of them.
"""

import os
import sys

import torch

from apps.llama import train
from lingua import checkpoint, optim
from lingua.launch import run
from lingua.train import loop, microbatch

MUTATION_VAR = "LINGUA_TEST_MUTATION"


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; the gradient flowing back is multiplied by `factor`."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _scale_gradients(factor: float, only_rank=None) -> None:
    """Scale this rank's gradients before FSDP reduces them (the loss stays as logged)."""
    real = microbatch.forward_loss
    rank = int(os.environ.get("RANK", "0"))

    def forward_loss(*args, **kwargs):
        out = real(*args, **kwargs)
        if only_rank in (None, rank):
            out.loss_sum = _ScaleGradient.apply(out.loss_sum, factor)
        return out

    microbatch.forward_loss = forward_loss


def _drop_last_update_on_rank1() -> None:
    """Rank 1 skips its optimizer step after the last step: its shard keeps the old values.
    Every logged loss and gradient norm comes before that update, so only the final parameters
    can show it."""
    real = optim.Optimizers.step
    calls = {"n": 0}
    steps = int(next(a for a in sys.argv if a.startswith("steps=")).split("=")[1])

    def step(self):
        calls["n"] += 1
        if os.environ.get("RANK") == "1" and calls["n"] == steps:
            return
        real(self)

    optim.Optimizers.step = step


def _resume_without_model() -> None:
    """Resume reads the optimizer state, data position and schedule from the checkpoint, but not
    the weights (the model entry is left out of what DCP loads)."""
    real = checkpoint._dcp_load

    def dcp_load(state, ckpt_dir):
        real({key: value for key, value in state.items() if key != "model"}, ckpt_dir)

    checkpoint._dcp_load = dcp_load


def _resume_from_scratch() -> None:
    """The checkpoint is silently ignored: the run starts again at step 0 (the metrics file is
    rewritten with the same losses, CPU runs being deterministic)."""
    loop.Run._load_newest = lambda self: 0


MUTATIONS = {
    "rank1_gradients_x1.001": lambda: _scale_gradients(1.001, only_rank=1),
    "gradients_halved": lambda: _scale_gradients(0.5),   # a second division by dp_shard=2
    "last_update_lost_on_rank1": _drop_last_update_on_rank1,
    "resume_without_model": _resume_without_model,
    "resume_from_scratch": _resume_from_scratch,
}


if __name__ == "__main__":
    name = os.environ.get(MUTATION_VAR, "")
    if name:
        MUTATIONS[name]()
    run.exit_cli(lambda: train.main(sys.argv[1:]))
