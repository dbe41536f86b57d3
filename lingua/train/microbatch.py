"""A step's data as the model takes it: this rank's share of a micro-batch, one forward and loss,
and the step's summed losses."""

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
    """Extra inputs and target come from the whole sequence (a target may look across cp's cut)."""
    tokens, labels = to_device(batch.tokens, env.device), to_device(batch.labels, env.device)
    model_kwargs, target = ({}, labels) if app is None else app.batch_inputs(tokens, labels)
    doc_ids = doc_ids_of(batch, args)
    doc_ids = None if doc_ids is None else to_device(doc_ids, env.device)
    if args.distributed.cp == 1:
        yield MicroBatch(tokens, target, doc_ids, None, model_kwargs)
        return
    with cp_batch(parts, tokens, None, doc_ids) as local:
        def this_ranks_chunks(t):
            return t.index_select(1, local.positions)
        # The CP attention masks by document itself, from the full-sequence ids it was given.
        yield MicroBatch(local.tokens, this_ranks_chunks(target), None, local.positions,
                         {k: this_ranks_chunks(v) for k, v in model_kwargs.items()})


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on the device. To a GPU through pinned memory and without waiting: a copy
    from pageable memory waits until the GPU has finished everything queued before it."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def forward_loss(loss: Callable, model, mb: MicroBatch) -> "loss_module.LossOutput":
    """One micro-batch through a whole (unpipelined) model, then the loss (Run.loss)."""
    output = model(mb.tokens, doc_ids=mb.doc_ids, positions=mb.positions, **mb.model_kwargs)
    return loss(output, mb.target)


class StepLoss:
    """The step's losses, summed over micro-batches (detached, fp64) until logged. A host number
    the loss gave (a token count) stays one: copying it to the GPU per micro-batch would wait for
    the GPU each time."""

    def __init__(self, device):
        self.device = device
        self.sums: dict = {}   # name -> (sum, count), each a device tensor or a host number

    def add(self, out: "loss_module.LossOutput") -> None:
        logged = out.loss_sum if out.logged_sum is None else out.logged_sum
        values = {"loss": (logged, out.tokens), **out.metrics}
        for name, pair in values.items():
            pair = tuple(v.detach().double() if torch.is_tensor(v) else float(v) for v in pair)
            old = self.sums.get(name)
            self.sums[name] = pair if old is None else (old[0] + pair[0], old[1] + pair[1])

    def reduced(self, env: DistEnv, has_loss: bool) -> dict:
        """{name: sum / count} over the ranks; every rank calls it (collectives)."""
        names = sorted(self.sums)
        if env.dims.pp > 1:  # only the last stage computes losses: it tells the others the names
            everyone = [None] * env.mesh["pp"].size()
            torch.distributed.all_gather_object(everyone, names if has_loss else None,
                                                group=env.mesh["pp"].get_group())
            names = next(n for n in everyone if n is not None)
        stacked = torch.zeros(len(names), 2, dtype=torch.float64, device=self.device)
        for i, name in enumerate(names):
            if name in self.sums:
                stacked[i, 0], stacked[i, 1] = self.sums[name]
        stacked = distributed.all_reduce_sum(stacked, env)
        return dict(zip(names, (stacked[:, 0] / stacked[:, 1]).tolist()))
