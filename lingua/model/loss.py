"""The loss seam: how an app turns its model's output into the loss the trainer minimises. An app
gives the trainer (lingua.train.app.App) `loss(output, target) -> LossOutput` (default
`cross_entropy`) and `batch_inputs(tokens, labels) -> (model_kwargs, target)` (default ({}, labels):
the model's extra keyword tensors [b, s, ...] and the loss's target). The trainer shards both with
the tokens, calls the loss on the last stage and back-propagates `loss_sum / global batch tokens`,
so every layout has the same gradient: a loss returns a SUM over tokens, never a mean. The logged
`loss` (LossOutput.logged_sum) is the next-token cross-entropy in every app, so apps compare."""

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

Number = Union[torch.Tensor, float, int]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """In fp32. `logits` may be a DTensor sharded over the vocabulary (call inside
    `loss_parallel_context(True)`); the sum then comes back as a plain tensor."""
    if torch.compiler.is_compiling() and not hasattr(logits, "full_tensor"):
        return _CompiledCrossEntropySum.apply(logits.flatten(0, 1), labels.flatten())
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    if hasattr(loss, "full_tensor"):  # DTensor, Replicate over tp: no communication
        loss = loss.full_tensor()
    return loss


IGNORE_INDEX = -100  # F.cross_entropy's default: a target that counts for nothing


class _CompiledCrossEntropySum(torch.autograd.Function):
    """F.cross_entropy(logits.float(), labels, reduction="sum") for torch.compile, written out so
    inductor compiles its backward in one pass over the logits on CPU, not a traced one-hot."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = logits.float()
        logsumexp = torch.logsumexp(x, dim=1)
        counted = labels != IGNORE_INDEX
        target = torch.where(counted, labels, 0).unsqueeze(1)
        target_logit = x.gather(1, target).squeeze(1)
        ctx.save_for_backward(logits, logsumexp, target, counted)
        # where, not a product with the mask: an ignored row may hold -inf or NaN logits (a fork
        # masking part of the vocabulary), which F.cross_entropy leaves out of the sum.
        return torch.where(counted, logsumexp - target_logit, 0.0).sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        logits, logsumexp, target, counted = ctx.saved_tensors
        counted, logsumexp = counted.unsqueeze(1), logsumexp.unsqueeze(1)
        softmax = torch.exp(logits.float() - logsumexp) * grad_loss
        grad = torch.where(counted, softmax, 0.0).to(logits.dtype)
        at_target = (torch.exp(logits.gather(1, target).float() - logsumexp) - 1) * grad_loss
        at_target = torch.where(counted, at_target, 0.0)
        return grad.scatter(1, target, at_target.to(logits.dtype)), None


@dataclass
class LossOutput:
    loss_sum: torch.Tensor                 # summed over tokens; what backward goes through
    tokens: Number                         # how many targets loss_sum summed over
    # Extra values to log: name -> (sum, count), logged as sum / count over micro-batches, ranks.
    metrics: Dict[str, Tuple[Number, Number]] = field(default_factory=dict)
    # The next-token cross-entropy metrics' `loss` logs (None: loss_sum is; MoE, MTP add terms).
    logged_sum: Optional[torch.Tensor] = None


def cross_entropy(output: torch.Tensor, labels: torch.Tensor) -> LossOutput:
    """Every app's default loss. IGNORE_INDEX labels count for nothing, in the sum and count."""
    return LossOutput(token_loss_sum(output, labels), (labels != IGNORE_INDEX).sum())


def default_batch_inputs(tokens: torch.Tensor, labels: torch.Tensor) -> tuple:
    return {}, labels


def for_training(loss: Callable, compile: bool, backend: str, loss_parallel: bool) -> Callable:
    """Compiled under distributed.compile (fuses away fp32 log-probs); eager under loss parallel."""
    if not compile or loss_parallel:
        return loss
    return torch.compile(loss, backend=backend)

