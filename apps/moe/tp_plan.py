"""Tensor parallelism for the MoE decoder: LLaMA's plan for attention, norms, embeddings, output
and the dense layers; each MoE layer sees the whole sequence and runs unsharded on every tp rank.

Why not shard the experts over tp: expert parallelism (distributed.ep) already splits them,
across the data-parallel ranks, at the cost of one all-to-all instead of tp's collectives in every
expert matmul. Here the MoE input is all-gathered over the sequence, every tp rank computes the
same routing and experts (so their gradients are complete and identical, and need no tp
reduction), and the output is cut back into this rank's sequence shard. That is what
lingua.tensor_parallel.ReplicatedCompute declares, so the trainer's coverage check
(lingua.coverage) knows these plain parameters are meant to stay plain under tp.
"""

from torch import nn

from lingua.tensor_parallel import ReplicatedCompute
from lingua.tp_plan import decoder_tp_plans


def moe_tp_plans(model: nn.Module, loss_parallel: bool) -> tuple:
    """(root_plan, dense_block_plan, moe_block_plan) for lingua.tensor_parallel.apply_tp."""
    root, dense = decoder_tp_plans(model, loss_parallel)
    moe = {k: v for k, v in dense.items() if not k.startswith("feed_forward")}
    moe["moe"] = ReplicatedCompute()   # Shard(1) in -> whole sequence, Replicate -> Shard(1) out
    return root, dense, moe
