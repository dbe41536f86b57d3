"""LoRA (Hu et al., 2021): a frozen Linear plus a trainable low-rank update, y = x W^T + s x A^T
B^T, s = alpha / rank; B starts at zero (the base model's outputs until the first update).
`apply_lora(model, args)` converts on meta, before parallelism, each Linear whose last name is in
`args.targets`, and freezes the rest. It stays an nn.Linear named as before (`...wq.weight`: TP
plans and HF key maps find it) with `...wq.lora_a` [rank, in] and `...wq.lora_b` [out, rank],
laid out like their weight under TP (lingua/parallel/lora_tp.py)."""

import logging
import math
from dataclasses import dataclass, field
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from lingua.errors import ConfigError

logger = logging.getLogger(__name__)

ADAPTER_NAMES = ("lora_a", "lora_b")


@dataclass
class LoRAArgs:
    rank: int = 0                   # 0: full fine-tuning (no adapters, every weight trains)
    alpha: float = 16.0             # the update is scaled by alpha / rank
    dropout: float = 0.0            # on the adapter's input only
    targets: List[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo"])


class LoRALinear(nn.Linear):
    """An nn.Linear with a low-rank adapter, around an existing Linear's weight (meta works)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)   # not nn.Linear.__init__: that would allocate a new weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, rank, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + self.scale * update

    def init_adapter(self) -> None:
        """A as nn.Linear initialises its weight (PEFT's default), B zero."""
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def is_adapter(name: str) -> bool:
    """True for an adapter tensor's state-dict name (never in a pretrained checkpoint)."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def validate_args(args: LoRAArgs) -> None:
    if args.rank < 0:
        raise ConfigError(f"lora.rank={args.rank} must be 0 (full fine-tuning) or positive.")
    if args.rank and not args.targets:
        raise ConfigError("lora.targets is empty: name the linear layers to adapt, e.g. "
                          "lora.targets=[wq,wk,wv,wo], or set lora.rank=0 for full fine-tuning.")
    if args.alpha <= 0:
        raise ConfigError(f"lora.alpha={args.alpha} must be positive.")
    if not 0 <= args.dropout < 1:
        raise ConfigError(f"lora.dropout={args.dropout} must be in [0, 1).")


def linear_names(model: nn.Module) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def check_targets(model: nn.Module, args: LoRAArgs) -> None:
    """Every target names a Linear no wider than min(in, out) at this rank, else ConfigError."""
    if not args.rank:
        return
    linears = linear_names(model)
    known = sorted({name.rsplit(".", 1)[-1] for name in linears})
    unknown = [t for t in args.targets if t not in known]
    if unknown:
        raise ConfigError(f"lora.targets names {unknown}, which the model has no Linear layer "
                          f"called. Its Linear layers are named {known}: pick targets from those.")
    for name, m in linears.items():
        smaller = min(m.in_features, m.out_features)
        if name.rsplit(".", 1)[-1] in args.targets and args.rank > smaller:
            raise ConfigError(f"lora.rank={args.rank} is larger than layer {name} "
                              f"({m.in_features} -> {m.out_features}): a rank above "
                              f"min(in, out) = {smaller} adds parameters and no "
                              f"expressiveness. Lower lora.rank.")


def apply_lora(model: nn.Module, args: LoRAArgs) -> List[str]:
    """Convert the targeted Linears in place, freeze the rest; their names (LoRA rank 0: none)."""
    if not args.rank:
        return []
    check_targets(model, args)
    converted = []
    for name, m in list(linear_names(model).items()):
        if name.rsplit(".", 1)[-1] not in args.targets:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(m, args.rank, args.alpha, args.dropout))
        converted.append(name)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    shown = ", ".join(sorted({_pattern(n) for n in converted}))
    line = (f"lora: rank {args.rank}, alpha {args.alpha:g} on {len(converted)} layers ({shown}); "
            f"every other weight frozen")
    if line not in _logged:   # the trainer converts a model for FLOPs too: say it once
        _logged.add(line)
        logger.info(line)
    return converted


_logged: set = set()


def _pattern(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


@torch.no_grad()
def merged(weight, lora_a, lora_b, scale: float) -> torch.Tensor:
    """W + s B A in fp32, cast back to the weight's dtype (plain, unsharded tensors)."""
    return (weight.float() + scale * (lora_b.float() @ lora_a.float())).to(weight.dtype)
