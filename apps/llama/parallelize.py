"""How the LLaMA model is parallelized: the app's plans, applied with lingua's generic functions.

The model file knows nothing of this; a fork with a new architecture changes the plans here
(which modules are FSDP units, how layers are tensor-parallel) and keeps the rest.
Order matters and follows torchtitan: tensor parallel, context parallel, activation
checkpointing, compile, then FSDP (which must see the final module structure).
"""

from torch import nn

from lingua.tp_plan import decoder_tp_plans
from lingua.context_parallel import apply_cp
from lingua.distributed import DistEnv, DistributedArgs, apply_ac, apply_compile, apply_fsdp
from lingua.tensor_parallel import apply_tp


def uses_loss_parallel(args: DistributedArgs) -> bool:
    # Vocabulary-sharded logits are DTensors; pipeline stages pass plain tensors, so with pp > 1
    # the last stage gathers the logits instead.
    return args.loss_parallel and args.tp > 1 and args.pp == 1


def parallelize_llama(model: nn.Module, env: DistEnv, args: DistributedArgs) -> nn.Module:
    if args.tp > 1:
        root_plan, block_plan = decoder_tp_plans(model, uses_loss_parallel(args))
        apply_tp(model, env.mesh["tp"], root_plan, block_plan, model.layers.values(), args.async_tp)
    if args.cp > 1:
        apply_cp(model, env.mesh["cp"], args.cp_backend)
    apply_ac(model.layers, args.ac, args.ac_every)
    if args.compile:
        apply_compile(model.layers, args.compile_backend)
    # One FSDP unit per transformer block: its parameters are gathered just before it runs.
    apply_fsdp(model, list(model.layers.values()), env, args)
    return model
