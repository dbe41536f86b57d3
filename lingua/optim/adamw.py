"""AdamW (torch's, fused where the device has one) with weight-decay groups: optim.name=adamw, and
Muon's optimizer for the rest. Its settings are optim.lr, beta1, beta2, eps and weight_decay."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lingua.optim.spec import OptimizerSpec


def param_groups(model, weight_decay: float) -> list:
    """Decay matrices, not vectors (norm gains, biases). Parameters on different meshes (or none)
    go into separate groups: a fused kernel takes one kind per call."""
    groups = {}
    for param in (model.parameters() if isinstance(model, nn.Module) else model):
        if param.requires_grad:
            decay = param.ndim >= 2
            mesh = getattr(param, "device_mesh", None)
            key = (decay, None if mesh is None else mesh.mesh_dim_names)
            groups.setdefault(key, {"params": [], "weight_decay": weight_decay if decay else 0.0})
            groups[key]["params"].append(param)
    return sorted(groups.values(), key=lambda g: -g["weight_decay"])


def build(part: nn.Module, args, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(part, args.weight_decay), lr=args.lr,
                             betas=(args.beta1, args.beta2), eps=args.eps, fused=fused)


def local_bytes(params) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in params)


def state_bytes(parts, args) -> tuple:
    """Two moments (exp_avg, exp_avg_sq) of each trainable local shard, in its dtype."""
    return 2 * local_bytes(p for part in parts for p in part.parameters() if p.requires_grad), 0


SPEC = OptimizerSpec(build=build, state_bytes=state_bytes, label="AdamW moments (2 x fp32{only})")
