"""Tensor parallelism for LoRA layers (lingua/model/lora.py): the adapters follow their base
Linear's sharding, so that the low-rank update lands on the same output layout as x W^T.

    ColwiseParallel  W [out, in] Shard(0): lora_a [r, in] Replicate, lora_b [out, r] Shard(0).
                     x A^T is whole on every rank; its product with this rank's rows of B gives
                     this rank's output columns, as x W^T does.
    RowwiseParallel  W Shard(1): lora_a Shard(1), lora_b Replicate. x's shard times A's columns
                     is a partial sum of x A^T; times B it stays partial (Partial), like x W^T,
                     and the style's output redistribution reduces both together.

torch's own styles give every parameter of the Linear the weight's placement (ColwiseParallel
would shard lora_a over its rank dimension) or replicate what they do not know (RowwiseParallel
would replicate lora_a), which DTensor then fixes with extra collectives each step. So
`lora_tp_plan` swaps torch's two styles for the subclasses below where the planned module is a
LoRALinear (layouts kept), as lingua/float8/__init__.py swaps in torchao's float8 styles, and
refuses a LoRALinear that the plan shards some other way; apply_tp also refuses one the plan
leaves out (lingua.parallel.tensor_parallel.lora_tp_plans, which needs no process group).
"""

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from lingua.errors import ConfigError
from lingua.model.lora import LoRALinear


def _distribute(module: nn.Module, mesh, placements: dict, src_data_rank) -> None:
    """Each of `module`'s own parameters as a DTensor with placements[name]."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class LoRAColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a LoRALinear: weight, bias and lora_b Shard(0), lora_a Replicate."""

    PLACEMENTS = {"weight": Shard(0), "bias": Shard(0), "lora_a": Replicate(),
                  "lora_b": Shard(0)}

    def _partition_linear_fn(self, name, module, device_mesh):
        # distribute_module calls this for every submodule (the dropout too): only the layer.
        if isinstance(module, LoRALinear):
            _distribute(module, device_mesh, self.PLACEMENTS, self.src_data_rank)


class LoRARowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a LoRALinear: weight and lora_a Shard(1), bias and lora_b
    Replicate (the update's output is Partial, reduced with the base's)."""

    PLACEMENTS = {"weight": Shard(1), "bias": Replicate(), "lora_a": Shard(1),
                  "lora_b": Replicate()}

    def _partition_linear_fn(self, name, module, device_mesh):
        if isinstance(module, LoRALinear):
            _distribute(module, device_mesh, self.PLACEMENTS, self.src_data_rank)


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
