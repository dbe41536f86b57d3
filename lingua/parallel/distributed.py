"""Process groups, the parallel layout (ParallelDims + one named DeviceMesh) and data parallelism.
Rank variables come from torchrun or, in a Slurm job step, from Slurm's."""

import contextlib
import datetime
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from lingua.errors import ConfigError
from lingua.float8 import validate_float8
from lingua.parallel import groups

logger = logging.getLogger(__name__)


@dataclass
class DistributedArgs:
    dp_replicate: int = 1           # replicas (HSDP's outer dimension; plain DDP when dp_shard=1)
    dp_shard: int = -1              # FSDP shards; -1 takes whatever the world size leaves
    tp: int = 1                     # tensor (+ sequence) parallel degree
    pp: int = 1                     # pipeline stages across ranks
    cp: int = 1                     # context parallel degree (sequence sharded across ranks)
    ep: int = 1                     # expert parallel degree (MoE apps; borrows dp_shard x cp ranks)
    pp_schedule: str = "1F1B"       # GPipe | 1F1B | Interleaved1F1B | ... (pipeline.py)
    pp_microbatches: int = 0        # micro-batches per pipeline step; 0 = one per stage
    pp_virtual_stages: int = 1      # stages per pipeline rank (>1 for interleaved schedules)
    pp_split: List[int] = field(default_factory=list)  # first layer of stages 1..n-1; [] = even
    cp_backend: str = "allgather"   # allgather (portable: CPU and CUDA) | ring (torch's, CUDA)
    ac: str = "none"                # activation checkpointing: none | full | layer | op
    ac_every: int = 1               # ac=layer: checkpoint every N-th block
    compile: bool = False           # torch.compile each block, and the loss (not loss_parallel)
    compile_backend: str = "inductor"  # a torch.compile backend (torch._dynamo.list_backends())
    async_tp: bool = False          # overlap TP communication with compute (CUDA + compile)
    loss_parallel: bool = True      # tp > 1 (and pp = 1): cross-entropy on vocab-sharded logits
    model_dtype: str = "fp32"       # fp32 | bf16 compute; master weights and optimizer stay fp32
    float8: str = "none"            # none | tensorwise | rowwise | rowwise_with_gw_hp (float8.py)
    reshard_after_forward: bool = True   # ZeRO-3 style; False keeps params gathered until backward
    cpu_offload: bool = False       # keep sharded parameters, gradients and optimizer state on CPU
    backend: str = "auto"           # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    timeout_s: int = 600            # collective timeout: a lost rank ends the run, no hang


AC_MODES = ("none", "full", "layer", "op")


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    world_size: int

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches a step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks that shard parameters (context-parallel ranks shard them too)."""
        return self.dp_shard * self.cp


def parallel_dims(args: DistributedArgs, world_size: int) -> ParallelDims:
    """Resolve dp_shard=-1 and check that the degrees multiply to the world size."""
    for name in ("dp_replicate", "tp", "pp", "cp"):
        if getattr(args, name) < 1:
            raise ConfigError(f"distributed.{name}={getattr(args, name)} must be at least 1.")
    others = args.dp_replicate * args.cp * args.tp * args.pp
    dp_shard = args.dp_shard
    if dp_shard == -1:
        if world_size % others:
            raise ConfigError(
                f"dp_replicate x cp x tp x pp = {args.dp_replicate} x {args.cp} x {args.tp} x "
                f"{args.pp} = {others} does not divide the world size {world_size}, so "
                f"distributed.dp_shard=-1 cannot take the rest. Launch a multiple of {others} "
                f"processes or change the degrees.")
        dp_shard = world_size // others
    if dp_shard < 1:
        raise ConfigError(f"distributed.dp_shard={args.dp_shard} must be -1 (take what is left) "
                          f"or at least 1.")
    if others * dp_shard != world_size:
        raise ConfigError(
            f"The parallel degrees do not match the world size: dp_replicate={args.dp_replicate} "
            f"x dp_shard={dp_shard} x cp={args.cp} x tp={args.tp} x pp={args.pp} = "
            f"{others * dp_shard}, but {world_size} processes were launched. Launch "
            f"{others * dp_shard} processes (torchrun --nproc-per-node; with stool, slurm.nodes x "
            f"slurm.tasks_per_node), or set distributed.dp_shard=-1 to take what the world size "
            f"leaves.")
    return ParallelDims(dp_replicate=args.dp_replicate, dp_shard=dp_shard, cp=args.cp,
                        tp=args.tp, pp=args.pp, world_size=world_size)


def validate_args(args: DistributedArgs) -> None:
    if args.model_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"distributed.model_dtype={args.model_dtype!r}: use fp32 or bf16.")
    if args.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"distributed.backend={args.backend!r}: use auto, gloo or nccl.")
    if args.backend == "nccl" and job_device_type() != "cuda":
        raise ConfigError("distributed.backend=nccl needs CUDA, and none is available here. "
                          "Use distributed.backend=auto (gloo on CPU).")
    if args.ac not in AC_MODES:
        raise ConfigError(f"distributed.ac={args.ac!r} is unknown: use one of {', '.join(AC_MODES)}"
                          f" (layer checkpoints every distributed.ac_every-th block, op saves "
                          f"matmul outputs and recomputes the rest).")
    if args.cpu_offload and job_device_type() != "cuda":
        raise ConfigError("distributed.cpu_offload=true moves sharded state from GPU to CPU "
                          "memory; this run has no GPU, so everything is in CPU memory already. "
                          "Remove distributed.cpu_offload.")
    if args.compile:
        from torch._dynamo import list_backends

        known = list_backends(exclude_tags=())
        if args.compile_backend not in known:
            known = [b for b in known if "TESTING" not in b and "minifier" not in b]
            raise ConfigError(f"distributed.compile_backend={args.compile_backend!r} is not a "
                              f"torch.compile backend installed here (known: {', '.join(known)}). "
                              f"Use distributed.compile_backend=inductor, install the backend's "
                              f"package, or turn compile off (distributed.compile=false).")
    if args.ac_every < 1:
        raise ConfigError(f"distributed.ac_every={args.ac_every} must be at least 1.")
    validate_float8(args, job_device_type())
    # World size is known before any process group exists (torchrun sets WORLD_SIZE).
    dims = parallel_dims(args, world_size_from_env())
    if args.cpu_offload and dims.dp_replicate * dims.fsdp == 1:
        raise ConfigError(
            "distributed.cpu_offload=true offloads through FSDP, and this layout shards nothing "
            f"(dp_replicate x dp_shard x cp = {dims.dp_replicate} x {dims.dp_shard} x {dims.cp} "
            "= 1), so the parameters would silently stay on the GPU. Launch more processes for "
            "data parallelism (distributed.dp_shard), or remove distributed.cpu_offload.")


def job_device_type() -> str:
    """JOB_DEVICE_VAR when set (stool validating on a login node for a job elsewhere), else ours."""
    return os.environ.get(JOB_DEVICE_VAR) or ("cuda" if torch.cuda.is_available() else "cpu")


JOB_DEVICE_VAR = "LINGUA_JOB_DEVICE"


def slurm_step_vars() -> dict:
    """torchrun's variables for a process in a Slurm job step of several tasks, else {}."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if tasks <= 1:
        return {}
    from submitit.slurm.slurm import SlurmJobEnvironment, _parse_node_list

    job = SlurmJobEnvironment()
    job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]
    # Rank 0 is on the step's first node, not the job's (srun -N1 in a 2-node job).
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    master = _parse_node_list(nodelist)[0] if nodelist else job.hostname
    return {"RANK": str(job.global_rank), "WORLD_SIZE": str(tasks),
            "LOCAL_RANK": str(job.local_rank), "LOCAL_WORLD_SIZE": per_node,
            "MASTER_ADDR": master,
            "MASTER_PORT": os.environ.get("MASTER_PORT", str(20000 + job_id % 20000))}


def adopt_launcher_vars() -> None:
    """Make torchrun's variables describe this process: set by torchrun, else from Slurm."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    os.environ.update(slurm_step_vars())


def world_size_from_env() -> int:
    adopt_launcher_vars()
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    dims: ParallelDims
    mesh: Optional[object]   # DeviceMesh when world_size > 1
    # fault_tolerance's replica groups: this group's dp ranks read part data_group of data_groups
    data_groups: int = 1
    data_group: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank reads (shared by its cp, tp and pp peers)."""
        rank = 0 if self.mesh is None else self.mesh["dp"].get_local_rank()
        return self.data_group * self.dims.dp + rank

    def size(self, name: str) -> int:
        return 1 if self.mesh is None else self.mesh[name].size()

    def local_rank_in(self, name: str) -> int:
        return 0 if self.mesh is None else self.mesh[name].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.data_groups * self.dims.dp


def _device(local_rank: int) -> torch.device:
    """The local rank's GPU modulo those visible (a task given its own GPU sees only cuda:0)."""
    if job_device_type() == "cuda" and torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def process_group_backend(args: DistributedArgs, device_type: str) -> str:
    """cpu_offload: the grad norm and the probe reduce CPU tensors (NCCL cannot): add gloo."""
    backend = args.backend if args.backend != "auto" else (
        "nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and args.cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return backend


def param_device(args: DistributedArgs, device: torch.device) -> torch.device:
    """The CPU under cpu_offload (FSDP2's CPUOffloadPolicy needs it); buffers stay on `device`."""
    return torch.device("cpu") if args.cpu_offload else device


def init(args: DistributedArgs) -> DistEnv:
    """Start the process group (when launched with several processes) and build the mesh."""
    world_size = world_size_from_env()  # also adopts Slurm's variables inside a job step
    dims = parallel_dims(args, world_size)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(local_rank)
    mesh = None
    if world_size > 1:
        backend = process_group_backend(args, device.type)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(
                seconds=args.timeout_s), device_id=device if device.type == "cuda" else None)
        mesh = build_mesh(dims, device.type)
    logger.info("distributed: rank %d/%d on %s, layout %s", rank, world_size, device, dims)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=device,
                   dims=dims, mesh=mesh)


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(dims: ParallelDims, device_type: str):
    """One named mesh over all degrees (size-1 dimensions included, so code never branches on
    which exist) plus flattened views: dp (different batches), dp_shard_cp (FSDP shards), dp_cp
    (ranks whose loss and token counts add up)."""
    sizes = dict(zip(MESH_DIMS, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)))
    root = groups.root_mesh(device_type, sizes)
    flat = {name: groups.flatten(root, parts, name) for name, parts in FLATTENED.items()}
    return Mesh(root, flat)


FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


class Mesh:
    """The root DeviceMesh plus its flattened meshes (torch deprecates slicing those from the
    root), indexed like a DeviceMesh: `mesh[("dp_replicate", "dp_shard_cp")]`."""

    def __init__(self, root, flat: dict):
        self.root, self.flat, self._slices = root, flat, {}

    def __getitem__(self, names):
        key = (names,) if isinstance(names, str) else tuple(names)
        if key not in self._slices:
            self._slices[key] = self._slice(key)
        return self._slices[key]

    def _slice(self, key: tuple):
        if not any(name in self.flat for name in key):
            return self.root[key]
        if len(key) == 1:
            return self.flat[key[0]]
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh._concatenate([self[name] for name in key])

    def __getattr__(self, name):
        if name in ("root", "flat", "_slices"):   # not set yet (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.root, name)

    def __repr__(self) -> str:
        return f"Mesh({self.root!r}, flattened {sorted(self.flat)})"


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """Flush, then os._exit: in interpreter teardown a gloo thread may free a tensor and abort
    ("terminate called without an active exception"; pytorch/pytorch#179291)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def all_reduce_sum(value: torch.Tensor, env: DistEnv, dims=("dp_cp", "pp")) -> torch.Tensor:
    """Sum over the named mesh dimensions (default: all but tp, whose ranks hold copies)."""
    if env.world_size > 1:
        for name in dims:
            if env.mesh[name].size() > 1:
                dist.all_reduce(value, op=dist.ReduceOp.SUM, group=env.mesh[name].get_group())
    return value


def apply_fsdp(model: nn.Module, blocks, env: DistEnv, args: DistributedArgs,
               own_mesh_units=()) -> nn.Module:
    """FSDP2 per block and at the root (HSDP when dp_replicate > 1), after `own_mesh_units`'
    (module, mesh) pairs. Gradients are reduced as a SUM: the loss is already a global mean."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if env.world_size == 1 or env.dims.dp_replicate * env.dims.fsdp == 1:
        return model  # no data-parallel ranks (one process, or only tp/pp): nothing to shard

    dp_mesh = env.mesh[("dp_replicate", "dp_shard_cp") if env.dims.dp_replicate > 1
                       else "dp_shard_cp"]
    compute = torch.bfloat16 if args.model_dtype == "bf16" else torch.float32
    # cast_forward_inputs=False: the RoPE tables blocks receive stay fp32, as in one process.
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    options = dict(mesh=dp_mesh, mp_policy=mp,
                   offload_policy=CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy())
    for module, mesh in own_mesh_units:
        fully_shard(module, reshard_after_forward=args.reshard_after_forward,
                    **dict(options, mesh=mesh))
    for block in blocks:
        fully_shard(block, reshard_after_forward=args.reshard_after_forward, **options)
    # The root's params are needed right after the last block's backward: keep them gathered.
    fully_shard(model, reshard_after_forward=False, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # the setting is per FSDP unit, not inherited
            module.set_gradient_divide_factor(1.0)
            # A divide factor makes FSDP use a pre-multiplied sum that gloo lacks; plain SUM it is.
            module.set_force_sum_reduction_for_comms(True)
    logger.info("applied FSDP2 over %s (%s compute, fp32 reduce, reshard_after_forward=%s%s)",
                dp_mesh.mesh_dim_names, args.model_dtype, args.reshard_after_forward,
                ", CPU offload" if args.cpu_offload else "")
    return model


# Op-level checkpointing keeps these ops' outputs; the rest (norms, RoPE, adds) is cheap to redo.
_SAVE_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    # Context parallelism's key/value all-gather: recomputing it would repeat the communication.
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def _save_matmuls_policy():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_ac(layers: nn.ModuleDict, mode: str, every: int = 1) -> None:
    """In place. full: every block; layer: every `every`-th; op: all, keeping matmul outputs."""
    if mode == "none":
        return
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    wrapped = []
    for name, block in layers.items():
        if mode == "layer" and int(name) % every:
            continue
        if mode == "op":
            fn = partial(checkpoint, use_reentrant=False, context_fn=_save_matmuls_policy)
            layers[name] = checkpoint_wrapper(block, checkpoint_fn=fn)
        else:
            layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        wrapped.append(name)
    logger.info("applied activation checkpointing (%s) to blocks %s", mode, ",".join(wrapped))


def apply_compile(layers: nn.ModuleDict, backend: str = "inductor") -> None:
    """In place (Module.compile keeps parameter names); identical blocks share one graph."""
    for block in layers.values():
        block.compile(backend=backend)
    logger.info("compiled %d transformer blocks (backend %s)", len(layers), backend)


@contextlib.contextmanager
def job_view(world_size: int, device: str):
    """Validate as the job will see things: its world size and device, not this login node's."""
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", JOB_DEVICE_VAR)}
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ[JOB_DEVICE_VAR] = device
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
