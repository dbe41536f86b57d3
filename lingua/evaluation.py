"""Validation loss and perplexity on a fixed held-out set, the same for every parallel layout."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lingua.distributed import DistEnv, all_reduce_sum
from lingua.errors import ConfigError


@dataclass
class EvalArgs:
    every: int = 0                  # validation every N steps (0: only at the end)
    at_end: bool = True             # validation after the last step


def validate_args(args: EvalArgs) -> None:
    if args.every < 0:
        raise ConfigError(f"eval.every={args.every} must be 0 (only at the end) or positive.")


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32 (the caller divides by the global token count)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


@torch.no_grad()
def evaluate(model, batches, env: DistEnv, forward) -> dict:
    """Mean validation loss over all ranks' tokens; `forward(model, batch)` returns logits."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)
    for batch in batches:
        logits = forward(model, batch)
        totals[0] += token_loss_sum(logits, batch.labels.to(env.device)).double()
        totals[1] += batch.labels.numel()
    all_reduce_sum(totals, env)
    model.train(was_training)
    loss = (totals[0] / totals[1]).item()
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0))}
