"""How the MoE model is parallelized: the same order and generic functions as apps/llama, with
the experts inside each block's FSDP unit.

Tensor parallelism: LLaMA's plan for the embeddings, norms, output, attention and the dense
layers (apps/llama/parallelize.py); each MoE layer sees the whole sequence and runs unsharded on
every tp rank. Why not shard the experts over tp: expert parallelism (distributed.ep) already
splits them, across the data-parallel ranks, at the cost of one all-to-all instead of tp's
collectives in every expert matmul. The MoE input is all-gathered over the sequence, every tp rank
computes the same routing and experts (so their gradients are complete and identical, and need no
tp reduction), and the output is cut back into this rank's sequence shard. That is what
lingua.parallel.tensor_parallel.ReplicatedCompute declares, so the trainer's coverage check
(lingua.parallel.coverage) knows these plain parameters are meant to stay plain under tp.
"""

from torch import nn

from apps.llama.parallelize import attention_tp_plan, feed_forward_tp_plan, uses_loss_parallel
from lingua.model.moe import moe_layers
from lingua.parallel.context_parallel import apply_cp
from lingua.parallel.distributed import (
    DistEnv,
    DistributedArgs,
    apply_ac,
    apply_compile,
    apply_fsdp,
)
from lingua.parallel.expert_parallel import apply_ep, apply_global_counts, ep_meshes
from lingua.parallel.tensor_parallel import ReplicatedCompute, apply_tp
from lingua.parallel.tp_plan import decoder_root_plan

__all__ = ["parallelize_moe", "tp_plans", "uses_loss_parallel"]


def tp_plans(model: nn.Module, loss_parallel: bool) -> tuple:
    """(root_plan, dense_block_plan, moe_block_plan) for tensor_parallel.apply_tp."""
    attention = attention_tp_plan()
    # ReplicatedCompute: Shard(1) in -> whole sequence, Replicate -> Shard(1) out.
    moe = {**attention, "ffn_norm": feed_forward_tp_plan()["ffn_norm"], "moe": ReplicatedCompute()}
    return decoder_root_plan(model, loss_parallel), {**attention, **feed_forward_tp_plan()}, moe


def parallelize_moe(model: nn.Module, env: DistEnv, args: DistributedArgs) -> nn.Module:
    if args.tp > 1:
        root_plan, dense_plan, moe_plan = tp_plans(model, uses_loss_parallel(args))
        blocks = list(model.layers.values())
        apply_tp(model, env.mesh["tp"], {}, dense_plan, [b for b in blocks if not b.is_moe])
        apply_tp(model, env.mesh["tp"], root_plan, moe_plan, [b for b in blocks if b.is_moe],
                 args.async_tp)
    # Balancing sees the global micro-batch: router counts summed over the data/context ranks.
    apply_global_counts(model, env)
    expert_units = []
    if args.ep > 1:
        # Experts split over ep ranks taken from dp_shard x cp; FSDP shards them over the rest.
        ep_mesh, expert_fsdp_mesh = ep_meshes(env.mesh, args.ep)
        apply_ep(model, ep_mesh)
        expert_units = [(moe.experts, expert_fsdp_mesh) for moe in moe_layers(model)]
    if args.cp > 1:
        apply_cp(model, env.mesh["cp"], args.cp_backend)
    apply_ac(model.layers, args.ac, args.ac_every)
    if args.compile:
        apply_compile(model.layers, args.compile_backend)
    apply_fsdp(model, list(model.layers.values()), env, args, expert_units)
    return model
