"""The loss seam: how an app turns its model's output into the loss the trainer minimises.

An app gives the trainer (lingua.trainer.App):
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

from lingua.tensor_parallel import token_loss_sum

Number = Union[torch.Tensor, float, int]


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
    parallelism) against labels [b, s]: the default loss of every app."""
    return LossOutput(token_loss_sum(output, labels), labels.numel())


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
