"""How the MoE model is parallelized: the same order and generic functions as apps/llama, with
the experts inside each block's FSDP unit."""

from torch import nn

from lingua.context_parallel import apply_cp
from lingua.distributed import DistEnv, DistributedArgs, apply_ac, apply_compile, apply_fsdp
from apps.moe.tp_plan import moe_tp_plans
from lingua.expert_parallel import apply_ep, ep_meshes
from lingua.tensor_parallel import apply_tp
from lingua.moe import moe_layers


def parallelize_moe(model: nn.Module, env: DistEnv, args: DistributedArgs) -> nn.Module:
    if args.tp > 1:
        root_plan, dense_plan, moe_plan = moe_tp_plans(model, uses_loss_parallel(args))
        blocks = list(model.layers.values())
        apply_tp(model, env.mesh["tp"], {}, dense_plan, [b for b in blocks if not b.is_moe])
        apply_tp(model, env.mesh["tp"], root_plan, moe_plan, [b for b in blocks if b.is_moe],
                 args.async_tp)
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


def uses_loss_parallel(args: DistributedArgs) -> bool:
    # As in apps/llama: vocabulary-sharded logits, except through pipeline stages.
    return args.loss_parallel and args.tp > 1 and args.pp == 1
