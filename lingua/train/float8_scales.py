"""The per-step half of float8 training (lingua/parallel/float8.py): under the tensorwise recipe
FSDP2 all-gathers the weights in float8, with scales torchao computes for all of them at once
(one all-reduce of their amaxes) after the weights changed."""

from lingua.parallel import float8
from lingua.train.hooks import Hook


class Float8ScalesHook(Hook):
    """Recompute the float8 all-gather scales before each step's forwards: after the last
    update, a resume or a rollback alike (the weights are final by then)."""

    def __init__(self, args, env):
        self.enabled = float8.uses_fsdp_float8_all_gather(args.distributed, env.dims,
                                                                env.device.type)

    def before_forward(self, run, step: int) -> None:
        if self.enabled:
            float8.precompute_fsdp_scales(run.parts)
