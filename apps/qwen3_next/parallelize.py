"""How the Qwen3-Next model is parallelized, for now: data parallelism (FSDP2 / HSDP, one unit
per block, the experts inside each block's) with activation checkpointing and compile, through
lingua.parallel.parallelize's generic rest, as apps/moe's after its own plans. Tensor, expert and
pipeline parallelism are not planned yet and are refused before any process group; context
parallelism is refused for good: the Gated DeltaNet's recurrence and convolution run along the
whole sequence, which no rank holds under cp.
"""

from torch import nn

from lingua.errors import ConfigError
from lingua.float8 import default_filter
from lingua.parallel.distributed import DistEnv, DistributedArgs
from lingua.parallel.expert_parallel import apply_global_counts
from lingua.parallel.parallelize import apply_cp_ac_compile_fsdp

__all__ = ["float8_filter", "parallelize_qwen3_next", "validate_layout"]


def float8_filter(fqn: str, module: nn.Module) -> bool:
    """distributed.float8's choice of Linears: the default's, less the routers' and the gates'
    (tiny outputs that decide the routing, the shared expert's weight and the decay rates)."""
    return default_filter(fqn, module) and not fqn.endswith(
        ("router.gate", "shared_expert_gate", "linear_attention.wa", "linear_attention.wb"))


def validate_layout(args: DistributedArgs) -> None:
    """Refuse the layouts this app has no plan for (module docstring), naming the fix."""
    if args.cp > 1:
        raise ConfigError(
            f"distributed.cp={args.cp}: apps.qwen3_next cannot run context parallelism: its Gated "
            "DeltaNet layers carry a recurrent state (and a causal convolution) from each token "
            "to the next across the whole sequence, so a rank holding one shard of it would need "
            "every earlier shard's final state first. Use distributed.cp=1 (shorter "
            "data.seq_len, or activation checkpointing: distributed.ac).")
    for key in ("tp", "ep", "pp"):
        if getattr(args, key) > 1:
            raise ConfigError(
                f"distributed.{key}={getattr(args, key)}: apps.qwen3_next has no "
                f"{dict(tp='tensor', ep='expert', pp='pipeline')[key]}-parallel plan yet. Train "
                "with data parallelism only (distributed.dp_shard / dp_replicate) and "
                f"distributed.{key}=1.")


def parallelize_qwen3_next(model: nn.Module, env: DistEnv, args: DistributedArgs) -> nn.Module:
    validate_layout(args)
    # Balancing sees the global micro-batch: router counts summed over the data-parallel ranks.
    apply_global_counts(model, env)
    return apply_cp_ac_compile_fsdp(model, env, args)
