"""What an app tells the shared trainer about its model (`App`), and the checks that need it."""

from dataclasses import dataclass
from typing import Callable, Optional

from lingua import config
from lingua.data.tokenizer import build_tokenizer
from lingua.model import loss as loss_module
from lingua.parallel import distributed
from lingua.parallel.parallelize import uses_loss_parallel


@dataclass
class App:
    """What an app tells the shared trainer about its model."""
    model_class: Callable                         # model_class(args.model), on any device
    parallelize: Callable                         # (part, env, distributed args) -> part
    validate_model: Callable                      # (train args) -> None, raises ConfigError
    # (distributed args) -> bool: whether the loss takes vocabulary-sharded logits
    loss_parallel: Callable = uses_loss_parallel
    load_hf: Optional[Callable] = None            # (path, dtype) -> (model, model args);
                                                  # dtype None keeps the files' dtype
    flops_per_token: Optional[Callable] = None    # (train args) -> float; default: 6N + attention
    # (train args, env) -> the app's hooks (lingua/hooks.py), called before the core's:
    # what the app does around a step (apps/moe: routing sums, the expert-bias update, metrics)
    hooks: Callable = lambda args, env: []
    # (fqn, module) -> True to train that Linear in float8 (distributed.float8); None:
    # lingua.float8.default_filter
    float8_filter: Optional[Callable] = None
    # (model on the meta device, train args) -> None: changes the model in place before the
    # pipeline split and any parallelism (apps/sft: LoRA adapters, the base frozen)
    transform_model: Optional[Callable] = None
    # The planner's count of what one block's attention keeps per token (lingua.launch.
    # plan_activations.gqa_attention_bytes' arguments); None: lingua's grouped-query attention
    attention_activations: Optional[Callable] = None
    # The loss seam (lingua/model/loss.py): how the model's output becomes the summed loss, and what
    # else the forward and the loss take, made from the whole batch before any sharding.
    loss: Callable = loss_module.cross_entropy    # (output, target) -> LossOutput
    # (tokens, labels) -> (kwargs, target)
    batch_inputs: Callable = loss_module.default_batch_inputs


def device_type() -> str:
    return distributed.job_device_type()


def check_vocab(args) -> None:
    """The tokenizer file loads, and the model's vocabulary holds its tokens."""
    vocab = build_tokenizer(args.data.tokenizer).vocab_size
    config.require(vocab <= args.model.vocab_size,
                   f"The tokenizer ({args.data.tokenizer.kind}) has {vocab} tokens but "
                   f"model.vocab_size={args.model.vocab_size}. Set model.vocab_size={vocab} or "
                   f"more.")
