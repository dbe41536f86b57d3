"""Float8 training with torchao (`distributed.float8`): the Linears an app's filter picks become
`Float8Linear`s (high-precision master weights, as checkpoints and the optimizer see). CUDA needs
bf16 and torch.compile; the CPU (the tests) runs emulated matmuls, high-precision collectives."""

import dataclasses
import importlib.util
import logging
import re
import sys
from typing import Callable

import torch
from torch import nn

from lingua.errors import ConfigError
from lingua.float8 import moe as float8_moe
from lingua.hooks import Hook
from lingua.model.moe import GroupedExperts

logger = logging.getLogger(__name__)

RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")


def validate_float8(args, device_type: str) -> None:
    """Raise ConfigError for a float8 setting (`args`: DistributedArgs) that cannot train."""
    recipe = args.float8
    if recipe not in RECIPES:
        raise ConfigError(f"distributed.float8={recipe!r} is unknown: use one of "
                          f"{', '.join(RECIPES)} (torchao's float8 training recipes).")
    if recipe == "none":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"distributed.float8={recipe} needs torchao, which is not installed: "
                          "pip install torchao==0.18.0 (or the project's [gpu] extra), or set "
                          "distributed.float8=none.")
    if device_type == "cuda" and args.model_dtype != "bf16":
        raise ConfigError(f"distributed.float8={recipe} needs distributed.model_dtype=bf16 on "
                          "CUDA: torchao quantizes bf16 activations and its scaled matmuls output "
                          "bf16. Set distributed.model_dtype=bf16, or distributed.float8=none.")
    if device_type == "cuda" and not args.compile:
        raise ConfigError(f"distributed.float8={recipe} needs distributed.compile=true on CUDA: "
                          "without torch.compile fusing the casts into the matmuls, float8 is "
                          "slower than bf16. Set distributed.compile=true, or "
                          "distributed.float8=none.")
    if args.tp > 1 and recipe != "tensorwise":
        raise ConfigError(f"distributed.float8={recipe} with distributed.tp={args.tp} is not "
                          "supported: torchao's float8 tensor-parallel styles assume one scale "
                          "per tensor. Use distributed.float8=tensorwise with tp, or "
                          "distributed.tp=1.")


def default_filter(fqn: str, module: nn.Module) -> bool:
    """A Linear but `output` (logits need precision) with features multiples of 16 (the kernels'
    rule), or MoE experts the float8 grouped GEMM can run."""
    if isinstance(module, nn.Linear):
        return (fqn.split(".")[-1] != "output"
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)
    return float8_moe.converts_experts(module)


def compress_names(names: list) -> str:
    """'layers.0.attention.wq', 'layers.1.attention.wq' -> 'layers.*.attention.wq'."""
    return ", ".join(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names))


def moves_float8(device_type: str) -> bool:
    """Whether collectives can carry float8 tensors: NCCL does, gloo (CPU) has no float8 type."""
    return device_type == "cuda"


def uses_fsdp_float8_all_gather(args, dims, device_type: str) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8: tensorwise, where FSDP shards."""
    return (args.float8 == "tensorwise" and dims.dp_replicate * dims.fsdp > 1
            and moves_float8(device_type))


def apply_float8(model: nn.Module, recipe: str, convert: Callable = default_filter,
                 fsdp_float8_all_gather: bool = False, emulate: bool = False) -> list:
    """In place (names and values unchanged), before TP, AC, compile and FSDP; returns the names."""
    if recipe == "none":
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    converted = []

    def pick(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or not convert(fqn, module):
            return False
        converted.append(fqn)
        return True

    convert_to_float8_training(model, config=config, module_filter_fn=pick)
    logger.info("float8 (%s%s%s): converted %d linear layers: %s", recipe,
                ", float8 FSDP all-gather" if fsdp_float8_all_gather else "",
                ", emulated matmuls" if emulate else "", len(converted),
                compress_names(converted) or "none")
    experts, kept = [], {}   # kept: why -> the experts it keeps in high precision
    for fqn, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            why = float8_moe.why_not(module) or (
                None if convert(fqn, module) else "the app's float8 filter leaves them")
            if why is None:
                float8_moe.convert_experts(module, emulate)
                experts.append(fqn)
            else:
                kept.setdefault(why, []).append(fqn)
    if experts:
        logger.info("float8: the MoE experts (%s) use float8 rowwise grouped GEMMs%s",
                    compress_names(experts), " (emulated)" if emulate else "")
    for why, fqns in kept.items():
        logger.info("float8: the MoE experts (%s) stay in high precision: %s",
                    compress_names(fqns), why)
    return converted + experts


def _is_float8(module: nn.Module, tensorwise_only: bool = True) -> bool:
    # torchao not imported yet: nothing was converted (and a run without float8 needs no torchao).
    linear = sys.modules.get("torchao.float8.float8_linear")
    if linear is None or not isinstance(module, linear.Float8Linear):
        return False
    from torchao.float8.config import ScalingGranularity

    return not tensorwise_only or all(
        c.scaling_granularity == ScalingGranularity.TENSORWISE
        for c in (module.config.cast_config_input, module.config.cast_config_grad_output))


def float8_tp_plan(module: nn.Module, plan: dict, device_type: str) -> dict:
    """`plan` with float8 styles on Float8Linears and inputs (cast once, gathered in float8)."""
    from torch.distributed.tensor import parallel as tp

    if not moves_float8(device_type) or not any(
            _is_float8(m, tensorwise_only=False) for m in module.modules()):
        return plan
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    swap = {tp.ColwiseParallel: Float8ColwiseParallel, tp.RowwiseParallel: Float8RowwiseParallel}
    out = dict(plan)
    for fqn, style in plan.items():
        target = module.get_submodule(fqn)
        if type(style) in swap and _is_float8(target):
            out[fqn] = _copy_style(style, swap[type(style)])
        elif type(style) is tp.PrepareModuleInput and _feeds_only_float8(target, fqn, plan):
            out[fqn] = _copy_style(style, PrepareFloat8ModuleInput)
    return out


def _feeds_only_float8(target: nn.Module, fqn: str, plan: dict) -> bool:
    # The once-cast float8 input must reach only tensorwise Float8Linears the plan shards colwise.
    from torch.distributed.tensor import parallel as tp

    prefix = f"{fqn}." if fqn else ""
    styles = [(m, type(plan.get(prefix + n))) for n, m in target.named_modules()
              if isinstance(m, nn.Linear)]
    return any(s is tp.ColwiseParallel for _, s in styles) and all(
        _is_float8(m) and s in (tp.ColwiseParallel, tp.RowwiseParallel) for m, s in styles)


def _copy_style(style, cls):
    """A `cls` style with `style`'s layouts (its constructor takes the same keywords)."""
    new = cls.__new__(cls)
    new.__dict__.update(style.__dict__)
    if cls.__name__ == "PrepareFloat8ModuleInput":
        new.float8_dtype, new.linear_mm_config = torch.float8_e4m3fn, None
        new.fwd_config_submodule_fqn = None
    return new


class Float8ScalesHook(Hook):
    """Recompute float8 FSDP all-gather scales (all amaxes, one all-reduce) before each step."""

    def __init__(self, args, env):
        # Not under cpu_offload: FSDP's copy of a CPU shard to the GPU drops precomputed scales.
        self.enabled = (uses_fsdp_float8_all_gather(args.distributed, env.dims, env.device.type)
                        and not args.distributed.cpu_offload)

    def before_step(self, view, step: int) -> None:
        if self.enabled:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            for part in view.parts:
                precompute_float8_dynamic_scale_for_fsdp(part)
