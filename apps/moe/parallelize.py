"""How the MoE model is parallelized: tensor and expert parallelism here, then
lingua.parallel.parallelize's generic rest (context parallel, AC, compile, FSDP) as for apps/llama
(this file's tensor-parallel lines were forked from lingua/models/llama/parallelize.py), with the
experts inside each block's FSDP unit.

Tensor parallelism: LLaMA's plan for the embeddings, norms, output, attention and the dense
layers; each MoE layer sees the whole sequence and runs unsharded on
every tp rank. Why not shard the experts over tp: expert parallelism (distributed.ep) already
splits them, across the data-parallel ranks, at the cost of one all-to-all instead of tp's
collectives in every expert matmul. The MoE input is all-gathered over the sequence, every tp rank
computes the same routing and experts (so their gradients are complete and identical, and need no
tp reduction), and the output is cut back into this rank's sequence shard. That is what
lingua.parallel.tensor_parallel.ReplicatedCompute declares, so the trainer's coverage check
(lingua.parallel.coverage) knows these plain parameters are meant to stay plain under tp.
"""

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lingua.errors import ConfigError
from lingua.float8 import default_filter
from lingua.model.moe import moe_layers
from lingua.models.llama.parallelize import attention_plan
from lingua.parallel.distributed import DistEnv, DistributedArgs
from lingua.parallel.expert_parallel import apply_ep, apply_global_counts, ep_meshes
from lingua.parallel.parallelize import apply_cp_ac_compile_fsdp, uses_loss_parallel
from lingua.parallel.tensor_parallel import ReplicatedCompute, apply_tp
from lingua.parallel.tp_plan import decoder_root_plan, gathered_input, validate_decoder_tp

__all__ = ["float8_filter", "parallelize_moe", "tp_plans", "uses_loss_parallel", "validate_tp"]


def float8_filter(fqn: str, module: nn.Module) -> bool:
    """distributed.float8's choice of Linears: the default's, less the router's gate (its
    logits pick the experts; torchtitan keeps it in high precision too). The routed experts
    pass it: their grouped matmuls run in float8 (lingua.float8.moe)."""
    return default_filter(fqn, module) and not fqn.endswith("router.gate")


def validate_tp(model_args, tp: int, seq_len: int | None = None) -> None:
    """Before any process group: the decoder shell's checks and this plan's (whole attention heads
    per rank); raises ConfigError naming the fix."""
    n_heads, n_kv = model_args.n_heads, model_args.n_kv_heads or model_args.n_heads
    for key, heads in (("n_heads", n_heads), ("n_kv_heads", n_kv)):
        if tp > 1 and heads % tp:
            raise ConfigError(
                f"model.{key}={heads} is not divisible by distributed.tp={tp}: tensor parallelism "
                f"gives each rank whole attention heads (n_heads={n_heads}, n_kv_heads={n_kv}). "
                f"Use a tp that divides both, or change model.{key}.")
    validate_decoder_tp(model_args, tp, seq_len)


def block_plan(model: nn.Module, is_moe: bool) -> dict:
    """A block's TP plan: sequence-parallel norms, LLaMA's attention plan (by head); then the dense
    SwiGLU sharded alike, or the MoE replicated."""
    plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            **attention_plan(model)}
    if is_moe:
        # ReplicatedCompute: Shard(1) in -> whole sequence, Replicate -> Shard(1) out.
        return {**plan, "moe": ReplicatedCompute()}
    return {**plan, "feed_forward": gathered_input(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}


def tp_plans(model: nn.Module, loss_parallel: bool) -> tuple:
    """(root_plan, dense_block_plan, moe_block_plan) for tensor_parallel.apply_tp."""
    return (decoder_root_plan(model, loss_parallel), block_plan(model, False),
            block_plan(model, True))


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
    return apply_cp_ac_compile_fsdp(model, env, args, expert_units=expert_units)
