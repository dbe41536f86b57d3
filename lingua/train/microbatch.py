"""A step's data as the model takes it: this rank's share of a micro-batch (sequence_shard, with
context parallelism's cut), one forward and loss (forward_loss), and the step's summed losses
(StepLoss)."""

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lingua.model import loss as loss_module
from lingua.parallel import distributed
from lingua.parallel.context_parallel import cp_batch
from lingua.parallel.distributed import DistEnv
from lingua.train.app import App


def doc_ids_of(batch, args):
    # Document ids cost a mask per forward: pass them only when the model masks by document.
    return batch.doc_ids if args.model.attn_mask == "block_causal" else None


@dataclass
class MicroBatch:
    """This rank's share of one micro-batch, as the model and the app's loss take it."""
    tokens: torch.Tensor
    target: torch.Tensor            # labels, or what the app's batch_inputs made
    doc_ids: Optional[torch.Tensor]
    positions: Optional[torch.Tensor]   # global positions of a context-parallel shard
    model_kwargs: dict              # the app's extra forward inputs [b, s, ...]


@contextlib.contextmanager
def sequence_shard(parts, batch, args, env: DistEnv, app: Optional[App] = None):
    """This rank's MicroBatch of a data micro-batch. The app's extra inputs and target are made
    from the whole sequence first (a target may look ahead across the cut). With context
    parallelism each rank keeps a head and a tail chunk of the sequence, and the attention
    context (global positions, document ids) is set for the forward and backward inside."""
    tokens, labels = batch.tokens.to(env.device), batch.labels.to(env.device)
    model_kwargs, target = ({}, labels) if app is None else app.batch_inputs(tokens, labels)
    doc_ids = doc_ids_of(batch, args)
    doc_ids = None if doc_ids is None else doc_ids.to(env.device)
    if args.distributed.cp == 1:
        yield MicroBatch(tokens, target, doc_ids, None, model_kwargs)
        return
    with cp_batch(parts, tokens, None, doc_ids) as local:
        def mine(t):
            return t.index_select(1, local.positions)
        # The CP attention masks by document itself, from the full-sequence ids it was given.
        yield MicroBatch(local.tokens, mine(target), None, local.positions,
                         {k: mine(v) for k, v in model_kwargs.items()})


def forward_loss(loss: Callable, model, mb: MicroBatch) -> "loss_module.LossOutput":
    """One micro-batch through a whole (unpipelined) model, then the loss (Run.loss)."""
    output = model(mb.tokens, doc_ids=mb.doc_ids, positions=mb.positions, **mb.model_kwargs)
    return loss(output, mb.target)


class StepLoss:
    """The step's loss and the app's loss metrics, summed over micro-batches (detached, fp64)
    until logged: `loss` is the sum of logged_sum (the cross-entropy) over the sum of tokens,
    over every micro-batch and every rank holding distinct tokens (data and context parallel,
    the last pipeline stage), and so is each metric's sum / count."""

    def __init__(self, device):
        self.device = device
        self.sums: dict = {}

    def add(self, out: "loss_module.LossOutput") -> None:
        logged = out.loss_sum if out.logged_sum is None else out.logged_sum
        values = {"loss": (logged, out.tokens), **out.metrics}
        for name, (total, count) in values.items():
            pair = torch.stack([torch.as_tensor(total, device=self.device).detach().double(),
                                torch.as_tensor(count, device=self.device).double()])
            self.sums[name] = self.sums[name] + pair if name in self.sums else pair

    def reduced(self, env: DistEnv, has_loss: bool) -> dict:
        """{name: sum / count} over the ranks; every rank calls it (collectives)."""
        names = sorted(self.sums)
        if env.dims.pp > 1:  # only the last stage computes losses: it tells the others the names
            everyone = [None] * env.mesh["pp"].size()
            torch.distributed.all_gather_object(everyone, names if has_loss else None,
                                                group=env.mesh["pp"].get_group())
            names = next(n for n in everyone if n is not None)
        zeros = torch.zeros(2, dtype=torch.float64, device=self.device)
        stacked = torch.stack([self.sums.get(name, zeros) for name in names])
        stacked = distributed.all_reduce_sum(stacked, env)
        return {name: (total / count).item() for name, (total, count) in zip(names, stacked)}
