"""`python -m apps.llama.train` with loss spikes injected at chosen data batches, for
tests/test_spikes.py only (torchrun runs; in-process tests call `inject` with monkeypatch).

LINGUA_TEST_SPIKES="<batch>:<factor>[,<batch>:<factor>...]" multiplies the loss of those data
batches, and so their gradients, on every rank and micro-batch, as a bad batch would. Batches
are numbered as the trainer counts them (Run.batches_consumed: 1-based next_step() calls), not
by step: a rollback skips the bad batch, so the replay no longer meets it, while the probe's
re-run of the spiking batch (same batch number) meets it again, as a real bad batch would be.
The factor goes through the app's loss (App.loss), which both the plain and the pipelined
forward call, so every layout sees the same spike.
LINGUA_TEST_SPIKE_ROWS=N and LINGUA_TEST_SPIKE_RANKS=0,...: only the first N sequences of each
micro-batch, on those ranks, are scaled: a spike in one data-parallel rank's share of the global
batch, which a rank judging its own loss alone would not see (the LLaMA app's loss only).

LINGUA_TEST_SPIKE_MUTATION=rank1_decides_alone: rank 1 applies the update of a spike step that
the others skip (its decision differs from theirs), for the test that checks such a run is
caught. Only the update differs: a rank that also skipped the next step's probe would leave the
others waiting in its collectives.
Nothing but this launcher reads these variables: the project's code is unchanged.
"""

import os
import sys

import torch

from apps.llama import train
from lingua import optim
from lingua.launch import run
from lingua.train import loop

SPIKES_VAR = "LINGUA_TEST_SPIKES"
ROWS_VAR = "LINGUA_TEST_SPIKE_ROWS"
RANKS_VAR = "LINGUA_TEST_SPIKE_RANKS"
MUTATION_VAR = "LINGUA_TEST_SPIKE_MUTATION"


def spikes_env(batches: dict) -> str:
    """The LINGUA_TEST_SPIKES value for {batch: factor}."""
    return ",".join(f"{batch}:{factor}" for batch, factor in batches.items())


def inject(set_attr, batches: dict, app=None, rows=None, ranks=None) -> None:
    """Scale the loss of the data batches in `batches` ({batch number: factor}); with `rows`,
    only that of the first `rows` sequences of each micro-batch; with `ranks`, only on those
    ranks. `set_attr`: setattr, or monkeypatch.setattr in a test (undone after it)."""
    app = app or train.APP
    current = {"batch": 0}
    real_step, real_loss = loop.Run.train_step, app.loss
    if ranks is not None and int(os.environ.get("RANK", "0")) not in ranks:
        return

    def train_step(self, micro_batches):
        current["batch"] = self.batches_consumed   # the batch being trained (counted already)
        return real_step(self, micro_batches)

    # Not compiled under distributed.compile=true: the batch number it reads changes every step,
    # and torch.compile would recompile per batch until its limit.
    @torch.compiler.disable
    def loss(output, target):
        factor = batches.get(current["batch"])
        if factor is not None and rows is not None and rows < output.shape[0]:
            head = real_loss(output[:rows], target[:rows])
            tail = real_loss(output[rows:], target[rows:])
            head.loss_sum = head.loss_sum * factor + tail.loss_sum
            head.tokens = head.tokens + tail.tokens
            return head
        out = real_loss(output, target)
        if factor is not None:
            out.loss_sum = out.loss_sum * factor
            if out.logged_sum is not None:
                out.logged_sum = out.logged_sum * factor
        return out

    set_attr(loop.Run, "train_step", train_step)
    set_attr(app, "loss", loss)


def _rank1_decides_alone() -> None:
    if os.environ.get("RANK") == "1":
        optim.Optimizers.skip = optim.Optimizers.step


if __name__ == "__main__":
    spec = os.environ.get(SPIKES_VAR, "")
    if spec:
        rows, ranks = os.environ.get(ROWS_VAR), os.environ.get(RANKS_VAR)
        inject(setattr,
               {int(b): float(f) for b, f in (item.split(":") for item in spec.split(","))},
               rows=int(rows) if rows else None,
               ranks={int(r) for r in ranks.split(",")} if ranks else None)
    if os.environ.get(MUTATION_VAR) == "rank1_decides_alone":
        _rank1_decides_alone()
    run.exit_cli(lambda: train.main(sys.argv[1:]))
