"""Validation loss and perplexity on a fixed held-out set, the same for every parallel layout."""

import math
from dataclasses import dataclass

import torch

from lingua.distributed import DistEnv, all_reduce_sum
from lingua.errors import ConfigError
from lingua.tensor_parallel import token_loss_sum  # noqa: F401  (the loss every caller uses)


@dataclass
class EvalArgs:
    every: int = 0                  # validation every N steps (0: only at the end)
    at_end: bool = True             # validation after the last step


def validate_args(args: EvalArgs) -> None:
    if args.every < 0:
        raise ConfigError(f"eval.every={args.every} must be 0 (only at the end) or positive.")


@torch.no_grad()
def evaluate(parts, batches, env: DistEnv, batch_loss) -> dict:
    """Mean validation loss over the global validation set.

    `batch_loss(batch)` returns the summed token loss of this rank's share of the batch, or None
    on ranks that do not compute the loss (pipeline stages before the last). The token count
    comes from the data-parallel ranks only: context, tensor and pipeline peers share a batch.
    """
    was_training = [part.training for part in parts]
    for part in parts:
        part.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    tokens = torch.zeros((), dtype=torch.float64, device=env.device)
    for batch in batches:
        loss = batch_loss(batch)
        if loss is not None:
            loss_sum += loss.double()
        tokens += batch.labels.numel()
    all_reduce_sum(loss_sum, env)
    all_reduce_sum(tokens, env, dims=("dp",))
    for part, mode in zip(parts, was_training):
        part.train(mode)
    loss = (loss_sum / tokens).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
