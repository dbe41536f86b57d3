"""Process groups, the parallel layout (ParallelDims + one named DeviceMesh) and data parallelism.

One process (`python -m apps.llama.train`) needs no process group at all; several processes get
their rank variables from torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). Every degree
of the layout lives in ParallelDims; the mesh has a named dimension for each degree above 1, and
the rest of the code asks it for the sub-meshes it needs (data loading over dp, FSDP over
dp_replicate x dp_shard).
"""

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lingua.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class DistributedArgs:
    dp_replicate: int = 1           # replicas (HSDP's outer dimension; plain DDP when dp_shard=1)
    dp_shard: int = -1              # FSDP shards; -1 takes whatever the world size leaves
    model_dtype: str = "fp32"       # fp32 | bf16 compute; master weights and optimizer stay fp32
    reshard_after_forward: bool = True   # ZeRO-3 style; False keeps params gathered until backward
    backend: str = "auto"           # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    timeout_s: int = 600            # collective timeout: a lost rank ends the run instead of hanging


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard


def parallel_dims(args: DistributedArgs, world_size: int) -> ParallelDims:
    """Resolve -1 and check that the degrees multiply to the world size."""
    if args.dp_replicate < 1:
        raise ConfigError(f"distributed.dp_replicate={args.dp_replicate} must be at least 1.")
    dp_shard = args.dp_shard
    if dp_shard == -1:
        if world_size % args.dp_replicate:
            raise ConfigError(
                f"distributed.dp_replicate={args.dp_replicate} does not divide the world size "
                f"{world_size}, so distributed.dp_shard=-1 cannot take the rest. Use a "
                f"dp_replicate that divides {world_size}, or launch a multiple of it.")
        dp_shard = world_size // args.dp_replicate
    if dp_shard < 1:
        raise ConfigError(f"distributed.dp_shard={args.dp_shard} must be -1 (take what is left) "
                          f"or at least 1.")
    if args.dp_replicate * dp_shard != world_size:
        raise ConfigError(
            f"The parallel degrees do not match the world size: distributed.dp_replicate="
            f"{args.dp_replicate} x distributed.dp_shard={dp_shard} = "
            f"{args.dp_replicate * dp_shard}, but {world_size} processes were launched. Launch "
            f"{args.dp_replicate * dp_shard} processes (torchrun --nproc-per-node), or set "
            f"distributed.dp_shard=-1 to take what the world size leaves.")
    return ParallelDims(dp_replicate=args.dp_replicate, dp_shard=dp_shard, world_size=world_size)


def validate_args(args: DistributedArgs) -> None:
    if args.model_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"distributed.model_dtype={args.model_dtype!r} is not supported: use "
                          f"fp32 or bf16.")
    if args.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"distributed.backend={args.backend!r}: use auto, gloo or nccl.")
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("distributed.backend=nccl needs CUDA, and none is available here. "
                          "Use distributed.backend=auto (gloo on CPU).")
    # World size is known before any process group exists (torchrun sets WORLD_SIZE).
    parallel_dims(args, world_size_from_env())


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dims: ParallelDims
    mesh: Optional[object]   # DeviceMesh when world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        # Data-parallel rank over (dp_replicate, dp_shard); equals rank while dp is the only degree.
        return self.rank if self.mesh is None else self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init(args: DistributedArgs) -> DistEnv:
    """Start the process group (when launched with several processes) and build the mesh."""
    world_size = world_size_from_env()
    dims = parallel_dims(args, world_size)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(local_rank)
    mesh = None
    if world_size > 1:
        backend = args.backend if args.backend != "auto" else (
            "nccl" if device.type == "cuda" else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(
                seconds=args.timeout_s), device_id=device if device.type == "cuda" else None)
        mesh = build_mesh(dims, device.type)
    logger.info("distributed: rank %d/%d on %s, layout %s", rank, world_size, device, dims)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device,
                   dims=dims, mesh=mesh)


def build_mesh(dims: ParallelDims, device_type: str):
    """One named mesh; 'dp' is the flattened data-parallel dimension used for loading and loss."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    return mesh


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def all_reduce_sum(value: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.world_size > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def broadcast_object(obj, env: DistEnv):
    if env.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def apply_fsdp(model: nn.Module, blocks, env: DistEnv, args: DistributedArgs) -> nn.Module:
    """FSDP2 per block and at the root over the (dp_replicate, dp_shard) mesh (HSDP when both > 1).

    Gradients are reduced as a SUM: the trainer already divides the loss by the global batch's
    token count, so averaging over ranks here would divide twice.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    dp_mesh = env.mesh[("dp_replicate", "dp_shard")]
    if env.dims.dp_replicate == 1:
        dp_mesh = env.mesh["dp_shard"]
    compute = torch.bfloat16 if args.model_dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=args.reshard_after_forward)
    # The root's params (embeddings, final norm, output) are needed right after the last block's
    # backward, so keeping them gathered after forward saves one all-gather per step.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # the setting is per FSDP unit, not inherited
            module.set_gradient_divide_factor(1.0)
            # A divide factor makes FSDP use a pre-multiplied sum that gloo lacks; plain SUM it is.
            module.set_force_sum_reduction_for_comms(True)
    logger.info("applied FSDP2 over %s (%s compute, fp32 reduce, reshard_after_forward=%s)",
                dp_mesh.mesh_dim_names, args.model_dtype, args.reshard_after_forward)
    return model
