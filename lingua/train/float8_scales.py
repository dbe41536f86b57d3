"""The per-step half of float8 training (lingua/parallel/float8.py): under the tensorwise recipe
FSDP2 all-gathers the weights in float8, with scales torchao computes for all of them at once
(one all-reduce of their amaxes) after the weights changed."""

from lingua.parallel import float8
from lingua.train.hooks import Hook


class Float8ScalesHook(Hook):
    """Recompute the float8 all-gather scales before each step's forwards: after the last
    update, a resume or a rollback alike (the weights are final by then)."""

    def __init__(self, args, env):
        # Not under cpu_offload: FSDP copies each CPU shard to the GPU before the all-gather,
        # and torchao's weight wrapper drops a precomputed scale in a copy (its _to_copy
        # rewraps the data alone), so the all-gather computes its own scale anyway.
        self.enabled = (float8.uses_fsdp_float8_all_gather(args.distributed, env.dims,
                                                           env.device.type)
                        and not args.distributed.cpu_offload)

    def before_step(self, run, step: int) -> None:
        if self.enabled:
            float8.precompute_fsdp_scales(run.parts)
