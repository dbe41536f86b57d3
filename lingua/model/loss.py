"""The loss seam: how an app turns its model's output into the loss the trainer minimises.

An app gives the trainer (lingua.train.app.App):
  loss(output, target) -> LossOutput      default `cross_entropy`: next-token cross-entropy
  batch_inputs(tokens, labels) -> (model_kwargs, target)
                                          default: ({}, labels); what else the model's forward
                                          takes (keyword tensors [b, s, ...]) and what the loss
                                          compares the output with, both made from the whole
                                          batch before any sharding
The trainer shards `model_kwargs` and `target` with the tokens (context parallelism cuts the
sequence, pipeline parallelism the batch into micro-batches and gives the kwargs to every stage),
calls the loss on the model's output where the output is (the last pipeline stage), and
back-propagates `loss_sum / tokens of the global batch`: so each layout computes the gradient of
the same mean over the global batch. An app's loss therefore returns a SUM over tokens, never a
mean of its micro-batch. `loss` in metrics.jsonl is the next-token cross-entropy in every app
(LossOutput.logged_sum); the other terms of an objective are the app's metrics.

Validation (val_loss, val_ppl) is the plain next-token cross-entropy of the model's output when
called with the tokens alone, for every app, so runs of different apps compare.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

Number = Union[torch.Tensor, float, int]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in fp32 of logits [b, s, vocab] against labels [b, s].

    `logits` is a plain tensor, or a DTensor sharded over the vocabulary on a 1-D tp mesh
    (then call inside `loss_parallel_context(True)`). torch's loss_parallel supports
    reduction="sum" and `flatten(0, 1)` of a Shard(-1) DTensor (it stays sharded on the class
    dim); the sum comes back as a DTensor replicated over tp, which we turn into a plain tensor so
    the caller can divide it, all-reduce it over data-parallel ranks and backward through it.
    """
    if torch.compiler.is_compiling() and not hasattr(logits, "full_tensor"):
        return _CompiledCrossEntropySum.apply(logits.flatten(0, 1), labels.flatten())
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    if hasattr(loss, "full_tensor"):  # DTensor, Replicate over tp: no communication
        loss = loss.full_tensor()
    return loss


IGNORE_INDEX = -100  # F.cross_entropy's default: a target that counts for nothing


class _CompiledCrossEntropySum(torch.autograd.Function):
    """F.cross_entropy(logits.float(), labels, reduction="sum") for torch.compile, with the same
    values and gradient, written out so that inductor compiles its backward well on CPU. Traced
    from F.cross_entropy, the backward builds the one-hot target by comparing an int64 column
    index with each row's label at every logit, and sums that one-hot again in a pass of its own;
    here the gradient is softmax * g in one pass over the logits and the target's entry, computed
    in fp32 from its own logit, is written over it (measured by benchmarks/loss_cpu.py, recorded
    in BENCHMARKS.md). It keeps what the compiled F.cross_entropy
    keeps: the logits in their own dtype and one logsumexp per row. Only ever called while
    compiling (token_loss_sum)."""

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
    # Extra named values to log: name -> (sum, count), logged as the step's sum / count over
    # every micro-batch and rank (as `loss` is: sum of logged_sum / sum of tokens).
    metrics: Dict[str, Tuple[Number, Number]] = field(default_factory=dict)
    # What `loss` in metrics.jsonl reports: the next-token cross-entropy, so that runs of any
    # app compare. None: loss_sum (it is the cross-entropy). An objective with more terms (MoE
    # balancing, MTP depths) gives its cross-entropy here and logs the rest as metrics.
    logged_sum: Optional[torch.Tensor] = None


def cross_entropy(output: torch.Tensor, labels: torch.Tensor) -> LossOutput:
    """Summed next-token cross-entropy of logits [b, s, vocab] (vocabulary-sharded under loss
    parallelism) against labels [b, s]: the default loss of every app. Labels set to
    IGNORE_INDEX (chat data's prompts and padding) count for nothing, in the sum and the count."""
    return LossOutput(token_loss_sum(output, labels), (labels != IGNORE_INDEX).sum())


def default_batch_inputs(tokens: torch.Tensor, labels: torch.Tensor) -> tuple:
    return {}, labels


def for_training(loss: Callable, compile: bool, backend: str, loss_parallel: bool) -> Callable:
    """The app's loss as training calls it: under distributed.compile=true compiled too, as
    torchtitan compiles its loss beside the blocks. Eager cross-entropy of [tokens, vocab] logits
    makes their fp32 copy and keeps fp32 log-probabilities for backward; compiled, it reads the
    logits in their own dtype in one fused pass and keeps them with each row's logsumexp. With a
    real vocabulary that is a large share of a step (see BENCHMARKS.md, "LLaMA training step on
    CPU vs Hugging Face transformers": "With a real vocabulary, and the loss compiled").
    Left eager under loss parallelism, whose vocabulary-sharded DTensor logits and torch's
    loss_parallel context we do not trace. The apps' losses (llama, moe, mtp) each compile to one
    graph."""
    if not compile or loss_parallel:
        return loss
    return torch.compile(loss, backend=backend)

