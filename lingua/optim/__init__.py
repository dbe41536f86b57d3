"""The optimizers (OPTIMIZERS, a file each with its OptimizerSpec), optim.*, the lr schedules."""

import math
from dataclasses import dataclass, field, make_dataclass
from functools import partial

import torch

from lingua.errors import ConfigError
from lingua.optim import adamw, muon

SCHEDULES = ("constant", "linear", "cosine", "wsd")
OPTIMIZERS = {"adamw": adamw.SPEC, "muon": muon.SPEC}


@dataclass
class SharedOptimArgs:
    name: str = "adamw"             # a key of OPTIMIZERS: adamw, or muon (muon.py: which weights)
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0               # max global grad norm, once per optimizer step; <= 0 disables
    scheduler: str = "cosine"       # constant | linear | cosine | wsd (warmup-stable-decay)
    warmup: int = 100               # linear warmup steps (all schedules)
    lr_min_ratio: float = 0.1       # final lr / peak lr for linear, cosine and wsd
    decay_fraction: float = 0.2     # wsd: the last fraction of steps decays linearly
    fused: bool = True              # fused AdamW kernel where the device has one
    # NaN/Inf grad norm: "skip" the update (nonfinite_steps) or "stop", saving the state before.
    nonfinite: str = "stop"


# `optim.*`: the shared settings, then each optimizer's own section (optim.muon.*) from OPTIMIZERS.
OptimArgs = make_dataclass("OptimArgs", [(name, spec.args, field(default_factory=spec.args))
                                         for name, spec in OPTIMIZERS.items() if spec.args],
                           bases=(SharedOptimArgs,), namespace={"__module__": __name__})


def validate_args(args: OptimArgs, steps: int) -> None:
    if args.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={args.name!r} is unknown: use one of "
                          f"{', '.join(OPTIMIZERS)} (muon: Muon for the transformer blocks' "
                          f"matrices, AdamW for the rest).")
    for spec in OPTIMIZERS.values():   # unused sections too: a bad value never waits for its run
        spec.validate(args)
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ConfigError(f"optim.lr={args.lr} must be a positive finite number, e.g. "
                          f"optim.lr=3e-4.")
    if args.scheduler not in SCHEDULES:
        raise ConfigError(f"optim.scheduler={args.scheduler!r} is unknown: use one of "
                          f"{', '.join(SCHEDULES)}.")
    if not (0 <= args.beta1 < 1 and 0 <= args.beta2 < 1):
        raise ConfigError(f"optim.beta1={args.beta1} and optim.beta2={args.beta2} must lie in "
                          f"[0, 1).")
    if not 0 <= args.lr_min_ratio <= 1:
        raise ConfigError(f"optim.lr_min_ratio={args.lr_min_ratio} must lie in [0, 1].")
    if not 0 < args.decay_fraction <= 1:
        raise ConfigError(f"optim.decay_fraction={args.decay_fraction} must lie in (0, 1].")
    if args.nonfinite not in ("skip", "stop"):
        raise ConfigError(f"optim.nonfinite={args.nonfinite!r}: use skip (drop a step whose "
                          f"gradients are NaN/Inf and go on) or stop (save and stop).")
    for key in ("warmup", "weight_decay"):
        if getattr(args, key) < 0:
            raise ConfigError(f"optim.{key}={getattr(args, key)} must be 0 or more.")


def lr_factor(step: int, args: OptimArgs, total_steps: int) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based)."""
    if step < args.warmup:
        return (step + 1) / (args.warmup + 1)
    if args.scheduler == "constant":
        return 1.0
    lo = args.lr_min_ratio
    if args.scheduler == "wsd":
        decay_steps = max(1, int(round(args.decay_fraction * total_steps)))
        decay_start = max(args.warmup, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        return 1.0 - (1.0 - lo) * progress
    progress = min(1.0, (step - args.warmup) / max(1, total_steps - args.warmup))
    if args.scheduler == "linear":
        return 1.0 - (1.0 - lo) * progress
    return lo + (1.0 - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Optimizers:
    """Each model part's optimizer + lr schedule, stepped together (state keyed by its names)."""

    def __init__(self, parts: list, args: OptimArgs, total_steps: int, device: torch.device):
        fused = args.fused and device.type in ("cuda", "cpu")
        self.optimizers = [OPTIMIZERS[args.name].build(part, args, fused) for part in parts]
        schedule = partial(lr_factor, args=args, total_steps=total_steps)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.optimizers]

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]

    def step(self) -> None:
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    def skip(self) -> None:
        """A step without an update (non-finite gradients): the lr schedule still advances."""
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    def scheduler_state(self) -> dict:
        # Only the position: torch's scheduler state records the groups, which depend on the layout.
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_scheduler_state(self, state: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.last_epoch = state["last_epoch"]
            lrs = [base * fn(scheduler.last_epoch)
                   for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
            scheduler._last_lr = lrs


def clip_grad_norm(parts: list, max_norm: float, pp_group=None) -> torch.Tensor:
    """Global gradient norm over every shard and stage (returned), clipped to max_norm when > 0."""
    params = [p for part in parts for p in part.parameters() if p.grad is not None]
    # Gradients on different meshes cannot share a foreach kernel: norms per group, then combined.
    groups = {}
    for p in params:
        key = (p.grad.device_mesh, p.grad.placements) if hasattr(p.grad, "device_mesh") else None
        groups.setdefault(key, []).append(p)
    squared = (torch.zeros((), dtype=torch.float32, device=params[0].grad.device) if params
               else torch.zeros(()))
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if hasattr(norm, "full_tensor"):  # a partial DTensor: reduce over its mesh
            norm = norm.full_tensor()
        squared = squared + norm.float().pow(2)
    if pp_group is not None:  # each pipeline stage holds different parameters: add the squares
        torch.distributed.all_reduce(squared, group=pp_group)
    norm = squared.sqrt()
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm
