"""The generic half of an app's parallelize.py: torchtitan's order of applying the parallelisms to a
decoder (tensor, context, activation checkpointing, compile, then FSDP). The app supplies its
plans: the tensor-parallel plan of its blocks and which modules are FSDP units."""

from typing import Callable

from torch import nn

from lingua.parallel.context_parallel import apply_cp
from lingua.parallel.distributed import (
    DistEnv,
    DistributedArgs,
    apply_ac,
    apply_compile,
    apply_fsdp,
)
from lingua.parallel.tensor_parallel import apply_tp


def uses_loss_parallel(args: DistributedArgs) -> bool:
    # Vocabulary-sharded logits are DTensors, but stages pass plain tensors: pp > 1 gathers them.
    return args.loss_parallel and args.tp > 1 and args.pp == 1


def parallelize_decoder(model: nn.Module, env: DistEnv, args: DistributedArgs,
                        tp_plans: Callable, tp_blocks=None, extra_fsdp_units=()) -> nn.Module:
    """Parallelize `model` (the decoder, or a pipeline part) in place. `tp_plans(model,
    loss_parallel)` -> (root_plan, block_plan) under tp; the block plan goes to each `tp_blocks`."""
    if args.tp > 1:
        root_plan, block_plan = tp_plans(model, uses_loss_parallel(args))
        blocks = model.layers.values() if tp_blocks is None else tp_blocks
        apply_tp(model, env.mesh["tp"], root_plan, block_plan, blocks, args.async_tp)
    return apply_cp_ac_compile_fsdp(model, env, args, extra_fsdp_units)


def apply_cp_ac_compile_fsdp(model: nn.Module, env: DistEnv, args: DistributedArgs,
                             extra_fsdp_units=(), expert_units=()) -> nn.Module:
    """Everything after tensor (and expert) parallelism: CP, AC and compile of the blocks, then
    FSDP (which must see the final modules) with one unit per block and per `extra_fsdp_units`;
    `expert_units`: apply_fsdp's (module, mesh) pairs."""
    if args.cp > 1:
        apply_cp(model, env.mesh["cp"], args.cp_backend)
    apply_ac(model.layers, args.ac, args.ac_every)
    if args.compile:
        apply_compile(model.layers, args.compile_backend)
    # Read after apply_ac, which replaces each block in model.layers by its checkpoint wrapper.
    units = [*model.layers.values(), *extra_fsdp_units]
    apply_fsdp(model, units, env, args, expert_units)
    return model
