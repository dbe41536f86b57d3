"""How the MTP model is parallelized: LLaMA's plans (this file was forked from
lingua/models/llama/parallelize.py) plus the MTP modules': each is an FSDP unit, its block takes the
blocks' TP plan, and its norms, projection and embedding run sequence-parallel like the
residual stream they extend.

lingua.parallel.parallelize applies the plans in torchtitan's order. A parameter a plan leaves out
of a layout's gradient reductions is refused at start with the plan line to add
(lingua/parallel/coverage.py).
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lingua.parallel.parallelize import parallelize_decoder, uses_loss_parallel
from lingua.parallel.tp_plan import decoder_root_plan, gathered_input, validate_whole_heads

__all__ = ["parallelize_mtp", "tp_plans", "uses_loss_parallel", "validate_tp"]
validate_tp = validate_whole_heads   # q/k/v are sharded by head: each rank holds whole heads


def block_tp_plan() -> dict:
    """LLaMA's block plan, Megatron-style with sequence parallelism: each half's input is
    all-gathered, q/k/v and w1/w3 are column-sharded (whole heads per rank), wo and w2
    row-sharded back to the residual stream's sequence shard."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": gathered_input(),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gathered_input(),
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
    return root, block_tp_plan()


def blocks(model: nn.Module) -> list:
    """The transformer blocks this part holds: its layers, then the MTP modules' blocks."""
    return [*model.layers.values(), *(m.block for m in (model.mtp or {}).values())]


def parallelize_mtp(model: nn.Module, env, args) -> nn.Module:
    # One FSDP unit per transformer block and per MTP module.
    return parallelize_decoder(model, env, args, tp_plans, tp_blocks=blocks(model),
                               extra_fsdp_units=list((model.mtp or {}).values()))
