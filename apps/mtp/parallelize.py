"""How the MTP model is parallelized: LLaMA's plans (this file was forked from
apps/llama/parallelize.py) plus the MTP modules': each is an FSDP unit, its block takes the
blocks' TP plan, and its norms, projection and embedding run sequence-parallel like the
residual stream they extend.

The model file knows nothing of this; a fork that adds or renames weights changes the plans here
(which modules are FSDP units, how each block's layers are tensor-parallel) and keeps the rest.
A parameter a plan leaves out of a layout's gradient reductions is refused at start with the plan
line to add (lingua/parallel/coverage.py). Order matters and follows torchtitan: tensor parallel,
context parallel, activation checkpointing, compile, then FSDP (which must see the final module
structure).
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from lingua.errors import ConfigError
from lingua.parallel.context_parallel import apply_cp
from lingua.parallel.distributed import (
    DistEnv,
    DistributedArgs,
    apply_ac,
    apply_compile,
    apply_fsdp,
)
from lingua.parallel.tensor_parallel import apply_tp
from lingua.parallel.tp_plan import decoder_root_plan, validate_decoder_tp


def validate_tp(model_args, tp: int, seq_len: int | None = None) -> None:
    """Before any process group: the decoder shell's checks and this plan's (whole heads per
    rank); raises ConfigError naming the fix."""
    validate_decoder_tp(model_args, tp, seq_len)
    if tp == 1:
        return
    n_heads = model_args.n_heads
    n_kv = model_args.n_kv_heads or n_heads
    if n_heads % tp:
        raise ConfigError(
            f"model.n_heads={n_heads} is not divisible by distributed.tp={tp}: tensor parallelism "
            f"gives each rank whole attention heads. Use a tp that divides {n_heads}, or change "
            "model.n_heads.")
    if n_kv % tp:
        raise ConfigError(
            f"model.n_kv_heads={n_kv} is not divisible by distributed.tp={tp}: each rank holds "
            f"n_kv_heads / tp key/value heads (grouped-query attention). Use a tp that divides "
            f"{n_kv}, or raise model.n_kv_heads to a multiple of {tp} that divides "
            f"model.n_heads={n_heads}.")


def attention_tp_plan() -> dict:
    """Megatron-style TP with sequence parallelism for the attention half of a block.

    The block's residual stream is Shard(1) over the sequence: the norm runs on S/tp tokens, the
    attention input is all-gathered to the whole sequence (Replicate), q/k/v are column-sharded
    (each rank owns whole heads), and wo is row-sharded and reduce-scatters back to Shard(1).
    Only the first positional input of `attention` is laid out; rope, mask and cache are keyword
    arguments every rank holds whole, and the per-head math needs no change.
    """
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                        desired_input_layouts=(Replicate(),),
                                        use_local_output=True),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def feed_forward_tp_plan() -> dict:
    """The SwiGLU half of a block: gathered input, w1/w3 column-sharded, w2 row-sharded."""
    return {
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                           desired_input_layouts=(Replicate(),),
                                           use_local_output=True),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def tp_plans(model: nn.Module, loss_parallel: bool) -> tuple[dict, dict]:
    """(root_plan, block_plan) for lingua.parallel.tensor_parallel.apply_tp; `model` is the
    Transformer or one pipeline part of it."""
    root = decoder_root_plan(model, loss_parallel)
    if model.mtp is not None:  # the last pipeline stage, or no pipeline
        # The embedding of t_{i+k} enters the Shard(1) residual stream as the main one does;
        # norms and the 2 dim -> dim projection act on each token alone, so they run on this
        # rank's sequence shard with replicated weights (gradients summed over tp by DTensor).
        root["mtp_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1),
                                                 use_local_output=False)
        for k in model.mtp:
            for name in ("hidden_norm", "embed_norm", "proj"):
                root[f"mtp.{k}.{name}"] = SequenceParallel()
    return root, {**attention_tp_plan(), **feed_forward_tp_plan()}


def blocks(model: nn.Module) -> list:
    """The transformer blocks this part holds: its layers, then the MTP modules' blocks."""
    return [*model.layers.values(), *(m.block for m in (model.mtp or {}).values())]


def uses_loss_parallel(args: DistributedArgs) -> bool:
    # Vocabulary-sharded logits are DTensors; pipeline stages pass plain tensors, so with pp > 1
    # the last stage gathers the logits instead.
    return args.loss_parallel and args.tp > 1 and args.pp == 1


def parallelize_mtp(model: nn.Module, env: DistEnv, args: DistributedArgs) -> nn.Module:
    if args.tp > 1:
        root_plan, block_plan = tp_plans(model, uses_loss_parallel(args))
        apply_tp(model, env.mesh["tp"], root_plan, block_plan, blocks(model), args.async_tp)
    if args.cp > 1:
        apply_cp(model, env.mesh["cp"], args.cp_backend)
    apply_ac(model.layers, args.ac, args.ac_every)
    if args.compile:
        apply_compile(model.layers, args.compile_backend)
    # One FSDP unit per transformer block and per MTP module: its parameters are gathered just
    # before it runs.
    apply_fsdp(model, [*model.layers.values(), *(model.mtp or {}).values()], env, args)
    return model
