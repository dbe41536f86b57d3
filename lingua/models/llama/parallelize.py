"""LLaMA's tensor-parallel plan, written against its module names; lingua.parallel.parallelize
applies it (torchtitan's order, one FSDP unit per block). A fork that adds a weight adds it here:
one left out is refused at start with the line to add (lingua/parallel/coverage.py)."""

from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lingua.parallel.parallelize import parallelize_decoder, uses_loss_parallel
from lingua.parallel.tp_plan import decoder_root_plan, gathered_input, validate_whole_heads

__all__ = ["attention_plan", "parallelize_llama", "tp_plans", "uses_loss_parallel", "validate_tp"]
validate_tp = validate_whole_heads   # q/k/v are sharded by head: each rank holds whole heads


def attention_plan(model) -> dict:
    """The attention's entries: q/k/v column-sharded by head (biases with them), wo row-wise. The
    QK-norm (Qwen3) normalises within a head, and each rank holds whole heads: its forward needs
    no reduction. Its weight is shared by all heads, so it is a replicated DTensor over the heads'
    dimension (SequenceParallel on dim 2), whose gradient DTensor sums across the tp ranks."""
    plan = {"attention": gathered_input(),
            **{f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
            "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    if model.args.qk_norm:
        plan.update({f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for n in ("q_norm", "k_norm")})
    return plan


def tp_plans(model, loss_parallel: bool) -> tuple[dict, dict]:
    """(the decoder shell's root plan, the block's), Megatron-style with sequence parallelism as
    lingua/parallel/tp_plan.py describes: q/k/v and w1/w3 column-sharded (whole heads per rank)."""
    return decoder_root_plan(model, loss_parallel), {
        "attention_norm": SequenceParallel(),
        **attention_plan(model),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gathered_input(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }


def parallelize_llama(model, env, args):
    return parallelize_decoder(model, env, args, tp_plans)
