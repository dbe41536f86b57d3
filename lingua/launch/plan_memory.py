"""What one rank of a planned run holds (see lingua.launch.plan): the run built on torch's fake
process group at its world size, its local shards read off, and the activation estimate added."""

import contextlib
import dataclasses
import logging
import warnings
from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist
from torch import nn

from lingua import float8
from lingua.launch.plan_activations import (
    block_activation_bytes,
    chunks_in_flight,
    lora_activation_bytes,
    output_activation_bytes,
)
from lingua.model.moe import moe_layers
from lingua.optim import OPTIMIZERS
from lingua.parallel import distributed, groups
from lingua.parallel.distributed import DistEnv
from lingua.train import build


@dataclass
class RankPlan:
    """What one rank holds, in bytes (lingua.launch.plan's docstring says what each counts)."""
    rank: int
    pp_rank: int
    stages: List[int]
    layers: List[int]
    n_params: int            # local elements of its parameters
    n_trainable: int         # of those, the ones that train (all but LoRA's frozen base)
    params: int
    grads: int
    optim: int
    buffers: int
    fsdp: int
    autocast: int
    activations: int
    offloaded: int = 0       # params + grads + optimizer state in host memory (cpu_offload)
    process_groups: int = 1  # groups it joins, the default one included
    optim_workspace: int = 0  # the optimizer step's (Muon's Newton-Schulz), after activations
    float8: int = 0          # float8 casts of one block's converted weights, and their scales

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optim + self.buffers + self.fsdp + self.autocast
                + self.activations + self.float8)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """torch's fake backend (collectives return at once): enough to build on meta tensors."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("lingua.launch.plan builds on its own fake process group, but this "
                           "process already has one: run the planner in a process of its own.")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def quiet():
    """The apply_* functions log each step at INFO; a plan builds many ranks."""
    before = logging.root.manager.disable
    logging.disable(max(before, logging.INFO))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


_quiet = quiet   # tests/test_parallel_coverage.py's name for it


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _gathered_numel(p: torch.Tensor) -> int:
    """Elements of a parameter once FSDP has all-gathered it: its local shard times the degree
    of every sharded mesh dimension that is not tp or ep (those stay sharded in compute)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.numel()
    try:  # FSDP over a TP or EP shard of the same dim: not a Shard subclass in torch 2.13
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        _StridedShard = ()
    factor = 1
    names = p.device_mesh.mesh_dim_names or ()
    for i, placement in enumerate(p.placements):
        name = names[i] if i < len(names) else ""
        sharded = placement.is_shard() or isinstance(placement, _StridedShard)
        if sharded and name not in ("tp", "ep"):
            factor *= p.device_mesh.size(i)
    return p.to_local().numel() * factor


def _unit_params(unit: nn.Module) -> list:
    """The parameters one FSDP unit gathers: its own, not those of FSDP units inside it."""
    from torch.distributed.fsdp import FSDPModule

    out = []

    def walk(module, top):
        if not top and isinstance(module, FSDPModule):
            return
        out.extend(module.parameters(recurse=False))
        for child in module.children():
            walk(child, False)

    walk(unit, True)
    return out


def _fsdp_bytes(parts, e: int, reshard_after_forward: bool, float8_gathers: bool = False) -> int:
    """What FSDP's all-gathers hold: the root's weights and two blocks' (one ahead) in the
    forward, or every block's without resharding; in backward the root's and one block's, and
    one block's fp32 gradients for its reduce-scatter. A weight gathered in float8
    (distributed.float8=tensorwise) takes 1 byte an element instead of e."""
    from torch.distributed.fsdp import FSDPModule

    in_float8 = {id(module.weight) for part in parts for module in part.modules()
                 if float8_gathers and type(module).__name__ == "Float8Linear"}

    def gathered(params) -> tuple:
        """(bytes gathered, elements and bytes of the unsharded gradients of the trainable)."""
        sizes = [(_gathered_numel(p), 1 if id(p) in in_float8 else e, p.requires_grad)
                 for p in params]
        return (sum(n * b for n, b, _ in sizes), sum(n for n, _, g in sizes if g),
                sum(n * e for n, _, g in sizes if g))

    root, root_grads, blocks = 0, 0, []
    for part in parts:
        if not isinstance(part, FSDPModule):
            continue
        weights, _, grads = gathered(_unit_params(part))
        root, root_grads = root + weights, root_grads + grads
        for block in part.layers.values():
            units = [m for m in block.modules() if isinstance(m, FSDPModule)]
            blocks.append(gathered([p for u in units for p in _unit_params(u)]))
    if not blocks and not root:
        return 0
    largest = max((b for b, _, _ in blocks), default=0)
    in_flight = 2 * largest if reshard_after_forward else sum(b for b, _, _ in blocks)
    grad_numel, grad_bytes = max(((n, b) for _, n, b in blocks), default=(0, 0),
                                 key=lambda nb: nb[1])
    return (root + in_flight) + (root_grads + grad_bytes) + 4 * grad_numel


def _float8_cast_bytes(parts) -> int:
    """The float8 copies torchao makes of one block's converted weights while it runs (weight
    and transpose, 1 byte an element each) and their fp32 scales; plus, for every block, the
    bf16 copy of its float8 experts' weights torchao's grouped GEMM keeps for backward."""
    per_block, kept = [0], 0
    for part in parts:
        for block in getattr(part, "layers", {}).values():
            total = 0
            for module in block.modules():
                if type(module).__name__ == "Float8Linear":
                    rows, cols = module.out_features, module.in_features   # (whole weight)
                    scaling = module.config.cast_config_weight.scaling_granularity
                    scales = (rows + cols) if "AXISWISE" in str(scaling) else 2
                    total += 2 * _gathered_numel(module.weight) + 4 * scales
                elif getattr(module, "grouped_mm", None) is not None:   # float8 experts
                    numel = sum(_gathered_numel(w) for w in (module.w1, module.w2, module.w3))
                    total += 2 * numel
                    kept += 2 * numel
            per_block.append(total)
    return max(per_block) + kept


def _build_parts(args, app, dims, rank: int, world_size: int):
    """This rank's parallelised model parts on meta, and its stage ids: the trainer's own build,
    without what needs a GPU and changes no shard (compile, async TP, CPU offload)."""
    build_args = dataclasses.replace(args, distributed=dataclasses.replace(
        args.distributed, compile=False, async_tp=False, cpu_offload=False))
    mesh = distributed.build_mesh(dims, "cpu") if world_size > 1 else None
    env = DistEnv(rank=rank, local_rank=0, world_size=world_size, device=torch.device("cpu"),
                  dims=dims, mesh=mesh)
    return build.parallelized_parts_on_meta(build_args, env, app)


def rank_plan(args, app, dims, rank: int, n_mb: int, microbatch: int,
              device_type: str = "cuda") -> tuple:
    """(RankPlan, micro-batches in flight) of one rank, built on the fake process group."""
    world = dims.world_size
    group = fake_process_group(rank, world) if world > 1 else contextlib.nullcontext()
    with quiet(), group:
        parts, stage_ids = _build_parts(args, app, dims, rank, world)
        # Built on the CPU, where gloo cannot move float8: count the job's float8 gathers.
        float8_gathers = float8.uses_fsdp_float8_all_gather(args.distributed, dims, device_type)
        one, flight = _measure(args, app, dims, rank, parts, stage_ids, n_mb, microbatch,
                               float8_gathers)
        if world > 1:   # the trainer's groups, built by the trainer's own code just now
            one.process_groups = groups.created() + int(args.checkpoint.async_save)
        one.float8 = _float8_cast_bytes(parts)
        return one, flight


def _block_bytes(block, shape, mode: str, e: int, tp: int, fp32_residual: bool,
                 cp: int = 1) -> float:
    """Activation bytes a token that one block keeps, its LoRA adapters' included."""
    moe = bool(moe_layers(block))
    return (block_activation_bytes(shape, moe, mode, e, tp, fp32_residual, cp=cp)
            + lora_activation_bytes(block, shape, moe, mode, e, tp, fp32_residual))


def _measure(args, app, dims, rank, parts, stage_ids, n_mb, microbatch,
             float8_gathers: bool = False) -> tuple:
    from torch.distributed.fsdp import FSDPModule

    d, m = args.distributed, args.model
    params = [p for part in parts for p in part.parameters()]
    locals_ = [_local(p) for p in params]
    n_local = sum(t.numel() for t in locals_)
    param_bytes = sum(t.nbytes for t in locals_)
    buffer_bytes = sum(_local(b).nbytes for part in parts for b in part.buffers())
    e = 2 if d.model_dtype == "bf16" else 4
    fsdp_applied = all(isinstance(p, FSDPModule) for p in parts)
    fsdp = _fsdp_bytes(parts, e, d.reshard_after_forward, float8_gathers) if fsdp_applied else 0
    autocast, fp32_residual = 0, d.model_dtype == "bf16" and not fsdp_applied
    if fp32_residual:   # autocast's bf16 copy of each matmul weight, kept for backward
        autocast = sum(2 * t.numel() for p, t in zip(params, locals_) if t.dim() >= 2)
        if not getattr(m, "tie_embeddings", False):   # a lookup, not a matmul: no copy
            autocast -= sum(2 * _local(part.tok_embeddings.weight).numel() for part in parts
                            if getattr(part, "tok_embeddings", None) is not None)
    # Activations: the layers of each stage this rank holds.
    pp_rank = rank // (dims.world_size // dims.pp)
    tokens = microbatch * args.data.seq_len / dims.cp
    per_mb, worst_block, layer_ids, shapes = 0.0, 0.0, [], app.block_shape(m)
    for part in parts:
        for name, block in part.layers.items():
            layer_ids.append(int(name))
            shape = shapes[int(name)] if isinstance(shapes, dict) else shapes
            mode = d.ac if d.ac != "layer" else ("none" if int(name) % d.ac_every else "full")
            per_mb += _block_bytes(block, shape, mode, e, dims.tp, fp32_residual, dims.cp)
            worst_block = max(worst_block, _block_bytes(block, shape, "none", e, dims.tp,
                                                        fp32_residual))
    flight = chunks_in_flight(d.pp_schedule, dims.pp, d.pp_virtual_stages, n_mb, pp_rank)
    act = per_mb * flight
    if d.ac != "none":
        act += worst_block                    # one block recomputed in backward
    if any(getattr(part, "output", None) is not None or
           (getattr(m, "tie_embeddings", False) and getattr(part, "norm", None) is not None)
           for part in parts):
        act += output_activation_bytes(m, e, dims.tp, app.loss_parallel(d), fp32_residual)
    activations = int(act * tokens)
    trainable = [t for p, t in zip(params, locals_) if p.requires_grad]
    grads = sum(t.nbytes for t in trainable)
    optim, workspace = OPTIMIZERS[args.optim.name].state_bytes(parts, args.optim)
    offloaded = 0
    if d.cpu_offload:   # the optimizer steps in host memory: its workspace is there too
        offloaded, param_bytes, grads, optim, workspace = param_bytes + grads + optim, 0, 0, 0, 0
    return RankPlan(rank=rank, pp_rank=pp_rank, stages=list(stage_ids), layers=layer_ids,
                    n_params=n_local, n_trainable=sum(t.numel() for t in trainable),
                    params=param_bytes, grads=grads, optim=optim,
                    buffers=buffer_bytes, fsdp=fsdp, autocast=autocast, activations=activations,
                    offloaded=offloaded, optim_workspace=workspace), flight
