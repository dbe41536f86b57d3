"""How the DeepSeek model is parallelized: tensor and expert parallelism here, then
lingua.parallel.parallelize's generic rest (context parallel, AC, compile, FSDP with one unit per
block and per MTP module, the experts inside each block's unit), as apps/moe's.

Tensor parallelism, per block half (sequence parallel between blocks, as every app):
- MLA is sharded by head. The projections whose outputs are per head are split column-wise:
  the query (wq, or wq_b after the query latent) and wkv_b (each head's key nope part and
  value from the kv latent); wo row-wise back to the residual stream's sequence shard.
- The latent projections and their norms (wq_a, q_norm, wkv_a, kv_norm) stay whole on every
  rank (ComputedWhole): their outputs are rank-sized (q_lora_rank, kv_lora_rank + rope), small
  next to the heads', and every head reads all of them, so splitting them would need a gather
  back before wq_b / wkv_b. Their gradients come back whole through the column-wise
  projections' input, except the rope key's, which every head reads but each rank only for its
  heads: SumGradOverTP sums it over tp at `shared_key`.
- The dense FFNs as LLaMA's; the MoE whole on every tp rank (ReplicatedCompute), split by expert
  parallelism instead (apps/moe/parallelize.py says why).
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lingua.float8 import default_filter
from lingua.model.moe import moe_layers
from lingua.parallel.distributed import DistEnv, DistributedArgs
from lingua.parallel.expert_parallel import apply_ep, apply_global_counts, ep_meshes
from lingua.parallel.parallelize import apply_cp_ac_compile_fsdp, uses_loss_parallel
from lingua.parallel.tensor_parallel import (
    ComputedWhole,
    ReplicatedCompute,
    SumGradOverTP,
    apply_tp,
)
from lingua.parallel.tp_plan import decoder_root_plan, gathered_input, validate_whole_heads

__all__ = ["float8_filter", "parallelize_deepseek", "tp_plans", "validate_tp"]
validate_tp = validate_whole_heads   # the query and wkv_b are sharded by head


def float8_filter(fqn: str, module: nn.Module) -> bool:
    """distributed.float8's choice of Linears: the default's, less the router's gate (its
    logits pick the experts)."""
    return default_filter(fqn, module) and not fqn.endswith("router.gate")


def block_plan(block: nn.Module) -> dict:
    """One block's TP plan (module docstring); `block` says which query path and FFN it has."""
    attn = block.attention
    whole = [n for n in ("wq_a", "q_norm", "wkv_a", "kv_norm") if hasattr(attn, n)]
    plan = {
        "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
        "attention": gathered_input(),
        **{f"attention.{n}": ComputedWhole() for n in whole},
        "attention.shared_key": SumGradOverTP(),
        "attention.wq" if hasattr(attn, "wq") else "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    if block.is_moe:
        return {**plan, "moe": ReplicatedCompute()}
    return {**plan, "feed_forward": gathered_input(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}


def tp_plans(model: nn.Module, loss_parallel: bool) -> dict:
    """The root plan: the decoder shell's, plus the MTP modules' embedding, norms and projection
    on the residual stream's sequence shard (as apps/mtp's)."""
    root = decoder_root_plan(model, loss_parallel)
    for k in model.mtp or {}:
        root[f"mtp.{k}.embed"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1), use_local_output=False)
        for name in ("enorm", "hnorm", "eh_proj", "head_norm"):
            root[f"mtp.{k}.{name}"] = SequenceParallel()
    return root


def blocks(model: nn.Module) -> list:
    """The transformer blocks this part holds: its layers, then the MTP modules' blocks."""
    return [*model.layers.values(), *(m.block for m in (model.mtp or {}).values())]


def parallelize_deepseek(model: nn.Module, env: DistEnv, args: DistributedArgs) -> nn.Module:
    if args.tp > 1:
        root = tp_plans(model, uses_loss_parallel(args))
        groups = {}   # blocks with the same plan keys go through apply_tp together
        for block in blocks(model):
            plan = block_plan(block)
            groups.setdefault(tuple(plan), (plan, []))[1].append(block)
        for i, (plan, members) in enumerate(groups.values()):
            apply_tp(model, env.mesh["tp"], root if i == len(groups) - 1 else {}, plan, members,
                     args.async_tp)
    # Balancing sees the global micro-batch: router counts summed over the data/context ranks.
    apply_global_counts(model, env)
    expert_units = []
    if args.ep > 1:
        ep_mesh, expert_fsdp_mesh = ep_meshes(env.mesh, args.ep)
        apply_ep(model, ep_mesh)
        expert_units = [(moe.experts, expert_fsdp_mesh) for moe in moe_layers(model)]
    return apply_cp_ac_compile_fsdp(model, env, args, extra_fsdp_units=list(
        (model.mtp or {}).values()), expert_units=expert_units)
