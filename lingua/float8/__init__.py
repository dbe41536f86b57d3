"""Float8 training with torchao (`distributed.float8`): the linear layers an app's filter picks
become torchao `Float8Linear`s, which quantize input, weight and output gradient to float8 for
their three matmuls and keep high-precision (fp32 master) weights, so checkpoints, HF export and
the optimizer never see float8.

The order is torchtitan's: conversion first (on the meta device, per pipeline part: lingua.train.
build), then tensor parallelism, where `float8_tp_plan` swaps the app's Colwise / Rowwise /
PrepareModuleInput styles for torchao's float8 ones with the same layouts (so the TP all-gathers
move float8), then AC, compile and FSDP2, whose all-gather of the weights is in float8 under the
tensorwise recipe (`precompute_fsdp_scales` computes all weights' scales in one all-reduce per
step). Recipes are torchao's (`Float8LinearConfig.from_recipe_name`): tensorwise (one scale per
tensor, the fastest), rowwise (a scale per row, more accurate), rowwise_with_gw_hp (rowwise,
with the weight gradient's matmul in high precision).

On CUDA it needs bf16 and torch.compile, without which float8 is slower than bf16. On CPU it runs
eagerly with torchao's emulated matmuls (apply_float8's `emulate`), and the collectives stay in
high precision (gloo has no float8 type: `moves_float8`): that is what the tests train. The
per-step scale hook is Float8ScalesHook (below). The MoE experts' grouped matmuls go through
lingua.float8.moe. torchao is imported where used.
"""

import logging
import re
import sys
from typing import Callable

from torch import nn

from lingua.errors import ConfigError
from lingua.float8 import moe as float8_moe
from lingua.hooks import Hook
from lingua.model.moe import GroupedExperts

logger = logging.getLogger(__name__)

RECIPES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")


def validate_float8(args, device_type: str) -> None:
    """Raise ConfigError (naming the fix) for a float8 setting that cannot train as asked.
    `args` is the run's DistributedArgs."""
    recipe = args.float8
    if recipe not in RECIPES:
        raise ConfigError(f"distributed.float8={recipe!r} is unknown: use one of "
                          f"{', '.join(RECIPES)} (torchao's float8 training recipes).")
    if recipe == "none":
        return
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(f"distributed.float8={recipe} needs torchao, which is not installed: "
                          "pip install torchao==0.18.0 (or the project's [gpu] extra), or set "
                          "distributed.float8=none.")
    if device_type == "cuda" and args.model_dtype != "bf16":
        raise ConfigError(
            f"distributed.float8={recipe} needs distributed.model_dtype=bf16 on CUDA: torchao "
            "quantizes bf16 activations and its scaled matmuls output bf16. Set "
            "distributed.model_dtype=bf16, or distributed.float8=none.")
    if device_type == "cuda" and not args.compile:
        raise ConfigError(
            f"distributed.float8={recipe} needs distributed.compile=true on CUDA: without "
            "torch.compile fusing the casts into the matmuls, float8 is slower than bf16. Set "
            "distributed.compile=true, or distributed.float8=none.")
    if args.tp > 1 and recipe != "tensorwise":
        raise ConfigError(
            f"distributed.float8={recipe} with distributed.tp={args.tp} is not supported: "
            "torchao's float8 tensor-parallel styles assume one scale per tensor. Use "
            "distributed.float8=tensorwise with tp, or distributed.tp=1.")


def default_filter(fqn: str, module: nn.Module) -> bool:
    """True converts `module` (named `fqn` in the model): a Linear other than the output
    projection (`output`, the decoder shell's name: the logits need the precision, and
    torchtitan leaves it too) whose in and out features are multiples of 16, as the float8
    matmul kernels require; or MoE grouped experts the float8 grouped GEMM can run."""
    if isinstance(module, nn.Linear):
        return (fqn.split(".")[-1] != "output"
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)
    return float8_moe.converts_experts(module)


def compress_names(names: list) -> str:
    """'layers.0.attention.wq', 'layers.1.attention.wq' -> 'layers.*.attention.wq'."""
    patterns = dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names)
    return ", ".join(patterns)


def moves_float8(device_type: str) -> bool:
    """Whether collectives can carry float8 tensors: NCCL does; gloo (CPU) has no float8 type
    ("Invalid scalar type"), so there the weights and activations cross ranks in high precision
    and only the matmuls are float8."""
    return device_type == "cuda"


def uses_fsdp_float8_all_gather(args, dims, device_type: str) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8: tensorwise only (torchao's
    float8 weight wrapper has one scale per tensor), only where FSDP shards (apply_fsdp), and
    only where the collectives move float8."""
    return (args.float8 == "tensorwise" and dims.dp_replicate * dims.fsdp > 1
            and moves_float8(device_type))


def apply_float8(model: nn.Module, recipe: str, convert: Callable = default_filter,
                 fsdp_float8_all_gather: bool = False, emulate: bool = False) -> list:
    """Swap the Linears `convert(fqn, module)` picks for torchao Float8Linears of `recipe`, and
    make the MoE grouped experts it picks compute in float8 (lingua.float8.moe), in
    place (parameter names and values unchanged); return their names. Call it before TP, AC,
    compile and FSDP. `emulate` (the trainer's choice off CUDA) multiplies the float8 values in
    fp32 (torchao's emulation) instead of torch._scaled_mm, whose CPU kernel is a slow reference
    one (~0.03 GFLOP/s here): the same quantized operands and scales, the same fp32
    accumulation, so the same numbers up to summation order."""
    if recipe == "none":
        return []
    import dataclasses

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
    """`plan` (a TP plan keyed by FQNs under `module`) with torchao's float8 styles where they
    apply, layouts kept: ColwiseParallel / RowwiseParallel on a Float8Linear become
    Float8ColwiseParallel / Float8RowwiseParallel (their inputs and output gradients are
    redistributed in float8), and a PrepareModuleInput whose module's Linears are all float8 and
    sharded by the plan becomes PrepareFloat8ModuleInput (the input is cast once, then all-gathered
    in float8). Unchanged when nothing under `module` was converted or the collectives cannot
    move float8 (moves_float8): the Float8Linears then take high-precision DTensors."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    if not moves_float8(device_type) or not any(
            _is_float8(m, tensorwise_only=False) for m in module.modules()):
        return plan
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    swap = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    out = dict(plan)
    for fqn, style in plan.items():
        target = module.get_submodule(fqn)
        if type(style) in swap and _is_float8(target):
            out[fqn] = _copy_style(style, swap[type(style)])
        elif type(style) is PrepareModuleInput and _feeds_only_float8(target, fqn, plan):
            out[fqn] = _copy_style(style, PrepareFloat8ModuleInput)
    return out


def _feeds_only_float8(target: nn.Module, fqn: str, plan: dict) -> bool:
    # The input, cast to float8 once, must reach only float8 Linears: every Linear under the
    # module is a (tensorwise) Float8Linear the plan shards, the input's readers column-wise
    # (as torchtitan plans attention and feed-forward). A plain Linear would get a float8 tensor.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    prefix = f"{fqn}." if fqn else ""
    styles = [(m, type(plan.get(prefix + n))) for n, m in target.named_modules()
              if isinstance(m, nn.Linear)]
    return any(s is ColwiseParallel for _, s in styles) and all(
        _is_float8(m) and s in (ColwiseParallel, RowwiseParallel) for m, s in styles)


def _copy_style(style, cls):
    """A `cls` style with `style`'s layouts (its constructor takes the same keywords)."""
    new = cls.__new__(cls)
    new.__dict__.update(style.__dict__)
    if cls.__name__ == "PrepareFloat8ModuleInput":
        import torch

        new.float8_dtype, new.linear_mm_config = torch.float8_e4m3fn, None
        new.fwd_config_submodule_fqn = None
    return new


def precompute_fsdp_scales(parts: list) -> None:
    """torchao's per-step scale computation for float8 FSDP all-gathers: every converted
    weight's amax in one all-reduce, instead of one per weight in each all-gather. Call it
    after the optimizer changed the weights (or they were loaded), before the next forward."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)


# The per-step half: under the tensorwise recipe FSDP2 all-gathers the weights in float8, with
# scales torchao computes for all of them at once (one all-reduce of their amaxes).
class Float8ScalesHook(Hook):
    """Recompute the float8 all-gather scales before each step's forwards: after the last
    update, a resume or a rollback alike (the weights are final by then)."""

    def __init__(self, args, env):
        # Not under cpu_offload: FSDP copies each CPU shard to the GPU before the all-gather,
        # and torchao's weight wrapper drops a precomputed scale in a copy (its _to_copy
        # rewraps the data alone), so the all-gather computes its own scale anyway.
        self.enabled = (uses_fsdp_float8_all_gather(args.distributed, env.dims, env.device.type)
                        and not args.distributed.cpu_offload)

    def before_step(self, run, step: int) -> None:
        if self.enabled:
            precompute_fsdp_scales(run.parts)
