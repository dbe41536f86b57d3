"""Tensor (+ sequence) and loss parallelism from the app's two plans of ParallelStyles, keyed by
FQNs under the model root and under a block. Loss parallel: the cross-entropy runs on vocab-sharded
logits (Shard(-1)); its forward AND backward must run inside `loss_parallel_context(True)`."""

import contextlib
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput
from torch.distributed.tensor.parallel.style import ParallelStyle

from lingua.errors import ConfigError
from lingua.float8 import float8_tp_plan
from lingua.model.lora import LoRALinear
from lingua.parallel.lora_tp import lora_tp_plan, refusal

logger = logging.getLogger(__name__)


def check_async_tp(enabled: bool, device_type: str, compile: bool) -> None:
    """Raise ConfigError unless async TP can take effect: it needs CUDA and torch.compile."""
    if not enabled:
        return
    if device_type != "cuda":
        raise ConfigError(
            f"distributed.async_tp=true needs CUDA, but this run is on {device_type!r}: async "
            "tensor parallelism overlaps communication through CUDA symmetric memory, which CPU "
            "(gloo) has no equivalent of. Remove distributed.async_tp (plain TP works on CPU).")
    if not compile:
        raise ConfigError(
            "distributed.async_tp=true needs distributed.compile=true: async tensor parallelism is "
            "a torch.compile (inductor) pass that rewrites the compiled blocks, so without compile "
            "it would silently do nothing. Set distributed.compile=true or remove "
            "distributed.async_tp.")


def _check_plan(module: nn.Module, plan: dict, where: str) -> None:
    """Fail on a plan key naming no submodule: torch warns and skips it (silently replicated)."""
    for fqn in plan:
        try:
            module.get_submodule(fqn)
        except AttributeError:
            raise ValueError(f"tensor-parallel plan key {fqn!r} names no submodule of the {where} "
                             f"({type(module).__name__}); fix the app's TP plan.") from None


def apply_tp(model: nn.Module, tp_mesh, root_plan: dict, block_plan: dict, blocks,
             async_tp: bool = False) -> nn.Module:
    """Shard `model` over `tp_mesh` in place: `root_plan` on it, `block_plan` on each block."""
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs a 1-D mesh (e.g. mesh['tp']), got {tp_mesh.ndim} dims")
    blocks = list(blocks)
    if async_tp:
        check_async_tp(True, tp_mesh.device_type, compile=True)  # the caller checked compile
    _check_plan(model, root_plan, "model")
    for block in blocks:
        _check_plan(block, block_plan, "block")
    root_plan, block_plans = lora_tp_plans(model, root_plan, block_plan, blocks)
    root_plan = float8_tp_plan(model, root_plan, tp_mesh.device_type)
    block_plans = [float8_tp_plan(block, plan, tp_mesh.device_type)
                   for block, plan in zip(blocks, block_plans)]
    # torch's SequenceParallel makes new Parameters trainable: refreeze (e.g. LoRA's base model).
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    for block, plan in zip(blocks, block_plans):
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(model, tp_mesh, root_plan)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    if async_tp:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        # inductor's overlap of all-gather/reduce-scatter with matmuls needs symmetric memory.
        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("applied tensor parallel over %d ranks: root %s; %d blocks %s; async TP %s",
                tp_mesh.size(), _describe(root_plan), len(blocks),
                _describe(block_plans[0] if block_plans else block_plan),
                "on (takes effect under torch.compile)" if async_tp else "off")
    return model


REPLICATED_MARK = "_lingua_replicated_over_tp"


class ReplicatedCompute(PrepareModuleInputOutput):
    """A ParallelStyle for a module that every tp rank runs whole on its all-gathered inputs, its
    output cut back to `output_layouts`. Its parameters stay plain and need no tp reduction: every
    rank sees the same full input and output gradient (lingua.parallel.coverage knows)."""

    def __init__(self, input_layouts=(Shard(1),), output_layouts=(Shard(1),)):
        super().__init__(
            input_layouts=input_layouts,
            desired_input_layouts=tuple(None if p is None else Replicate() for p in input_layouts),
            use_local_input=True, output_layouts=tuple(Replicate() for _ in output_layouts),
            desired_output_layouts=output_layouts, use_local_output=False)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        setattr(module, REPLICATED_MARK, True)
        return super()._apply(module, device_mesh)


class ComputedWhole(ParallelStyle):
    """For a module in a block half that every tp rank runs whole on the half's gathered input,
    before head-sharded projections (MLA's latent projections, norms): plain parameters, whole and
    equal gradients once what follows returns whole ones (ColwiseParallel's input does)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        setattr(module, REPLICATED_MARK, True)
        return module


class SumGradOverTP(ParallelStyle):
    """For an output every tp rank computes whole but uses in part (MLA's rope key, for all heads
    while a rank holds some): identity forward, gradient summed over tp in backward (Megatron's
    "f": to_local(grad_placements=Partial)), so what came before gets every head's gradient."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def hook(_module, _inputs, out):
            return DTensor.from_local(out, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
        module.register_forward_hook(hook)
        return module


def lora_tp_plans(model: nn.Module, root_plan: dict, block_plan: dict, blocks) -> tuple:
    """(root plan, [each block's plan]) with the LoRA styles swapped in, refusing a LoRALinear
    the plans leave out (outside a ReplicatedCompute) or shard another way. No process group."""
    blocks, covered = list(blocks), set()
    for root, plan in [(model, root_plan)] + [(block, block_plan) for block in blocks]:
        for fqn, style in plan.items():
            target = root.get_submodule(fqn)
            inside = target.modules() if isinstance(style, ReplicatedCompute) else [target]
            covered.update(id(m) for m in inside)
    left = [name for name, m in model.named_modules()
            if isinstance(m, LoRALinear) and id(m) not in covered]
    if left:
        shown = ", ".join(f"'{n}'" for n in left[:4]) + (f" and {len(left) - 4} more"
                                                         if len(left) > 4 else "")
        raise refusal(f"LoRA layer(s) {shown} are in no tensor-parallel plan (the root plan, or "
                      f"the block plan for a layer inside a block)")
    names = {id(m): name for name, m in model.named_modules()}
    return lora_tp_plan(model, root_plan), [
        lora_tp_plan(block, block_plan, f"{names.get(id(block), '<block>')}.")
        for block in blocks]


def _describe(plan: dict) -> str:
    return "{" + ", ".join(f"{k or '<root>'}: {type(v).__name__}" for k, v in plan.items()) + "}"


def loss_parallel_context(enabled: bool):
    """torch's loss_parallel() when enabled (forward and backward both go inside), else a no-op."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


