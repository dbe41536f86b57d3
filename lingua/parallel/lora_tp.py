"""Tensor parallelism for LoRA: adapters follow their base Linear's sharding (no extra collective,
unlike torch's styles). Colwise: x A^T is whole on every rank, times this rank's rows of B.
Rowwise: x's shard times A's columns is a partial sum, reduced with the base's output."""

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lingua.errors import ConfigError
from lingua.model.lora import LoRALinear


class _LoRAPartition:
    """Each of a LoRALinear's own parameters as a DTensor with PLACEMENTS[name]."""

    def _partition_linear_fn(self, name, module, device_mesh):
        # distribute_module calls this for every submodule (the dropout too): only the layer.
        if not isinstance(module, LoRALinear):
            return
        for pname, param in list(module.named_parameters(recurse=False)):
            dist = distribute_tensor(param, device_mesh, [self.PLACEMENTS[pname]],
                                     src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))


class LoRAColwiseParallel(_LoRAPartition, ColwiseParallel):
    """ColwiseParallel for a LoRALinear: weight, bias and lora_b Shard(0), lora_a Replicate."""

    PLACEMENTS = {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)}


class LoRARowwiseParallel(_LoRAPartition, RowwiseParallel):
    """RowwiseParallel for a LoRALinear: weight and lora_a Shard(1), bias and lora_b Replicate."""

    PLACEMENTS = {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1),
                  "lora_b": Replicate()}


SWAP = {ColwiseParallel: LoRAColwiseParallel, RowwiseParallel: LoRARowwiseParallel}
LORA_STYLES = tuple(SWAP.values())


def _copy_style(style, cls):
    """A `cls` style with `style`'s layouts (same constructor keywords, same attributes)."""
    new = cls.__new__(cls)
    new.__dict__.update(style.__dict__)
    return new


def refusal(what: str) -> ConfigError:
    return ConfigError(
        f"{what}, so the adapters would not be split the way the base weight is and the "
        f"low-rank update would not add up with the base layer's output. Shard each such layer "
        f"in the app's TP plan (its parallelize.py) with ColwiseParallel(...) or "
        f"RowwiseParallel(...), whose layouts lingua gives the adapters "
        f"(lingua/parallel/lora_tp.py); or leave it out of lora.targets; or set "
        f"distributed.tp=1.")


def lora_tp_plan(module: nn.Module, plan: dict, where: str = "") -> dict:
    """`plan` (keyed by FQNs under `module`) with the LoRA styles on each LoRALinear it names;
    unchanged when `module` holds none. ConfigError for a LoRALinear planned with another style.
    `where`: `module`'s name in the model, for the message. Needs no process group."""
    out = dict(plan)
    for fqn, style in plan.items():
        target = module.get_submodule(fqn)
        if not isinstance(target, LoRALinear) or isinstance(style, LORA_STYLES):
            continue
        if type(style) not in SWAP:
            raise refusal(f"LoRA layer '{where}{fqn}' is planned with "
                          f"{type(style).__name__}, a style lingua cannot give adapters")
        out[fqn] = _copy_style(style, SWAP[type(style)])
    return out
