"""What an app tells the shared trainer (`App`, found by `load_app`); the checks that need it."""

from dataclasses import dataclass, replace
from typing import Callable, Optional

from lingua import config
from lingua.data.tokenizer import build_tokenizer
from lingua.errors import ConfigError
from lingua.model import loss as loss_module
from lingua.model.layers import ffn_hidden_dim, head_dim
from lingua.parallel import distributed
from lingua.parallel.parallelize import uses_loss_parallel


@dataclass
class BlockShape:
    """What one block is made of, for the planner's count of what it keeps for backward
    (lingua/launch/plan_activations.py: the core's rule for AC, autocast, TP and CP)."""
    dim: int
    n_heads: int
    head_dim: int              # a query's (and key's) width per head
    value_head_dim: int
    n_kv_heads: int            # key/value heads as projected (grouped-query: fewer than n_heads)
    ffn_hidden: int            # the dense FFN's hidden width
    expert_hidden: int = 0     # an MoE block's experts: hidden width, count, routed to, shared
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    # Latent attention (MLA; 0: none): the q and kv latents' widths (whole on every TP rank, each
    # head's k and v decompressed from the kv one) and the shared rope key's.
    q_latent: int = 0
    kv_latent: int = 0
    rope_head_dim: int = 0
    # Gated DeltaNet (linear attention, apps/qwen3_next; 0: none): key and value heads, their
    # widths, and the chunk its delta rule is computed in. gated: Qwen3-Next's extras (norms
    # that keep their fp32 input, a sigmoid output gate after QK-norm, a gated shared expert).
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    chunk: int = 64
    gated: bool = False


def default_block_shape(a) -> BlockShape:
    """lingua's blocks (lingua/models/llama): grouped-query attention, Meta's SwiGLU width."""
    head = head_dim(a)
    return BlockShape(a.dim, a.n_heads, head, head, a.n_kv_heads or a.n_heads,
                      ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier))


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
    block_shape: Callable = default_block_shape   # (model args) -> BlockShape or {layer: shape}
    check_init_from: Optional[Callable] = None    # (train args): apps/sft's, a plan's warning
    load_config: Optional[Callable] = None        # (argv, check) -> args; load_app fills it
    # The loss seam (lingua/model/loss.py): how the model's output becomes the summed loss, and what
    # else the forward and the loss take, made from the whole batch before any sharding.
    loss: Callable = loss_module.cross_entropy    # (output, target) -> LossOutput
    # (tokens, labels) -> (kwargs, target)
    batch_inputs: Callable = loss_module.default_batch_inputs


def load_app(module_name: str) -> App:
    """The App of a train module (`apps.llama.train`: its `APP`), with its load_config."""
    module = config.import_app(module_name)   # checks it has load_config and main
    app = getattr(module, "APP", None)
    if not isinstance(app, App):
        raise ConfigError(f"{module_name} has no APP (a lingua.train.app.App), which says what "
                          f"lingua needs of its model: define one as apps/llama/train.py does.")
    return replace(app, load_config=app.load_config or module.load_config)


def device_type() -> str:
    return distributed.job_device_type()


def check_vocab(args) -> None:
    """The tokenizer file loads, and the model's vocabulary holds its tokens."""
    tok, init_from = args.data.tokenizer, args.checkpoint.init_from
    vocab = build_tokenizer(tok).vocab_size
    # With init_from the embedding is the checkpoint's: model.vocab_size cannot grow there.
    fix = (f"The embedding is checkpoint.init_from={init_from}'s (its config.json's "
           f"vocab_size): use the tokenizer that model was trained with" if init_from else
           f"A tokenizer's vocabulary is not read into the model: set model.vocab_size={vocab} "
           f"or more")
    config.require(vocab <= args.model.vocab_size,
                   f"The tokenizer ({tok.kind}{f' {tok.path}' if tok.path else ''}) has {vocab} "
                   f"tokens but model.vocab_size={args.model.vocab_size}: its ids would run past "
                   f"the embedding. {fix}.")
