"""How the LLaMA model is parallelized: the app's plans, applied with lingua's generic functions.

The model file knows nothing of this; a fork with a new architecture changes the plan here
(which modules are FSDP units) and keeps the rest.
"""

from torch import nn

from lingua.distributed import DistEnv, DistributedArgs, apply_fsdp


def parallelize_llama(model: nn.Module, env: DistEnv, args: DistributedArgs) -> nn.Module:
    if env.world_size == 1:
        return model  # one process: nothing to shard, and plain modules are fastest
    # One FSDP unit per transformer block: its parameters are gathered just before it runs.
    return apply_fsdp(model, list(model.layers.values()), env, args)
