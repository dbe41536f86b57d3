"""Process groups, the parallel layout (ParallelDims + one named DeviceMesh) and data parallelism.

One process (`python -m apps.llama.train`) needs no process group at all; several processes get
their rank variables from torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) or, in a Slurm
job step (srun, or a job stool submitted), from Slurm's task variables. Every degree
of the layout lives in ParallelDims; the mesh has a named dimension for every degree, size 1
included (build_mesh), and the rest of the code asks it for the sub-meshes it needs (data loading
over dp, FSDP over dp_replicate x dp_shard x cp).
"""

import contextlib
import datetime
import logging
import os
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
            f"slurm.tasks_per_node), or set "
            f"distributed.dp_shard=-1 to take what the world size leaves.")
    return ParallelDims(dp_replicate=args.dp_replicate, dp_shard=dp_shard, cp=args.cp,
                        tp=args.tp, pp=args.pp, world_size=world_size)


def validate_args(args: DistributedArgs) -> None:
    if args.model_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"distributed.model_dtype={args.model_dtype!r} is not supported: use "
                          f"fp32 or bf16.")
    if args.backend not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"distributed.backend={args.backend!r}: use auto, gloo or nccl.")
    if args.backend == "nccl" and job_device_type() != "cuda":
        raise ConfigError("distributed.backend=nccl needs CUDA, and none is available here. "
                          "Use distributed.backend=auto (gloo on CPU).")
    if args.ac not in AC_MODES:
        raise ConfigError(f"distributed.ac={args.ac!r} is unknown: use one of "
                          f"{', '.join(AC_MODES)} (layer checkpoints every "
                          f"distributed.ac_every-th block, op saves matmul outputs and recomputes "
                          f"the rest).")
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
    """The device the run will train on. Usually this machine's; stool validates a config on a
    login node for a job that runs elsewhere and says which device that job gets
    (JOB_DEVICE_VAR)."""
    return os.environ.get(JOB_DEVICE_VAR) or ("cuda" if torch.cuda.is_available() else "cpu")


JOB_DEVICE_VAR = "LINGUA_JOB_DEVICE"


def slurm_step_vars() -> dict:
    """torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) for a process in a Slurm job step, read through submitit's job environment;
    empty outside a step of several tasks.

    Only a step (srun, which is how stool's jobs start their tasks) counts: a batch script's own
    shell sees the job's SLURM_NTASKS but is a single process, so SLURM_STEP_NUM_TASKS decides.
    The port is derived from the job id, so every task of the job picks the same one and two jobs
    sharing a node do not collide.
    """
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if tasks <= 1:
        return {}
    from submitit.slurm.slurm import SlurmJobEnvironment, _parse_node_list

    job = SlurmJobEnvironment()
    job_id = int(os.environ.get("SLURM_JOB_ID", "0"))
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0]
    # The step's first node hosts rank 0; submitit's hostnames read the job's nodelist, whose
    # first node is not in a step that runs on part of the job (srun -N1 in a 2-node job).
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    master = _parse_node_list(nodelist)[0] if nodelist else job.hostname
    return {"RANK": str(job.global_rank), "WORLD_SIZE": str(tasks),
            "LOCAL_RANK": str(job.local_rank), "LOCAL_WORLD_SIZE": per_node,
            "MASTER_ADDR": master,
            "MASTER_PORT": os.environ.get("MASTER_PORT", str(20000 + job_id % 20000))}


def adopt_launcher_vars() -> None:
    """Make torchrun's variables describe this process, whoever launched it: torchrun already set
    them; in a Slurm step they are filled in from Slurm; alone, nothing is needed."""
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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank reads (shared by its cp, tp and pp peers)."""
        return 0 if self.mesh is None else self.mesh["dp"].get_local_rank()

    def size(self, name: str) -> int:
        return 1 if self.mesh is None else self.mesh[name].size()

    def local_rank_in(self, name: str) -> int:
        return 0 if self.mesh is None else self.mesh[name].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dims.dp


def _device(local_rank: int) -> torch.device:
    """This process's device: the local rank's GPU among those it can see, else the CPU.

    Modulo the visible count because a launcher may give each task its own GPU (Slurm's
    `srun --gpus-per-task=1`, or a CUDA_VISIBLE_DEVICES per task): the task then sees one device,
    cuda:0, while LOCAL_RANK still counts the tasks on the node (3 for the fourth). Where every
    task sees all of the node's GPUs (torchrun, stool's gpus_per_node) it is the local rank.

    LINGUA_JOB_DEVICE=cpu keeps a run on the CPU of a GPU machine (the test suite's CPU
    references do this; so can a researcher debugging on a GPU node), as job_device_type says.
    """
    if job_device_type() == "cuda" and torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def process_group_backend(args: DistributedArgs, device_type: str) -> str:
    """The backend string for init_process_group.

    NCCL only moves CUDA tensors. With cpu_offload, FSDP2 keeps sharded gradients (and the
    optimizer's update) on the CPU, so the gradient norm's reduction (optim.clip_grad_norm), the
    probe's statistics of gradients and weights then communicate CPU tensors ("No backend type
    associated with device type cpu" on NCCL alone): the group needs a CPU backend too. torch
    picks the backend by the tensor's device, and mesh sub-groups inherit both (new_group copies
    the default group's backend string; split_group splits every per-device backend)."""
    backend = args.backend if args.backend != "auto" else (
        "nccl" if device_type == "cuda" else "gloo")
    if backend == "nccl" and args.cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return backend


def param_device(args: DistributedArgs, device: torch.device) -> torch.device:
    """Where parameters are materialised after sharding (to_empty): the CPU under cpu_offload,
    since FSDP2's CPUOffloadPolicy refuses sharded parameters on the GPU ("FSDP parameters should
    be materialized on CPU when enabling CPU offloading"); buffers (RoPE tables) still belong on
    `device`, e.g. `init_weights(buffer_device=device)`."""
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
    which exist) plus the flattened views the rest needs:
      dp          = dp_replicate x dp_shard       ranks that read different batches
      dp_shard_cp = dp_shard x cp                 ranks that shard parameters (FSDP)
      dp_cp       = dp_replicate x dp_shard x cp  ranks whose loss and token counts add up
    Every group carries the default group's timeout (groups.subgroup_options), and each distinct
    set of ranks gets one group (groups._make_groups): the size-1 dimensions share one, and with
    tp=2 on 4 ranks all three views are dp_shard's group under their own names."""
    sizes = dict(zip(MESH_DIMS, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)))
    root = groups.root_mesh(device_type, sizes)
    flat = {name: groups.flatten(root, parts, name) for name, parts in FLATTENED.items()}
    return Mesh(root, flat)


FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


class Mesh:
    """The root DeviceMesh plus the flattened meshes `_flatten` returned, indexed by name like a
    DeviceMesh: `mesh["tp"]`, `mesh["dp_shard_cp"]`, `mesh[("dp_replicate", "dp_shard_cp")]`.

    Why not the root mesh alone: slicing a flattened dim from the root mesh (root["dp"]) warns
    "Slicing a flattened dim from root mesh will be deprecated" at every call in torch 2.13
    (DeviceMesh._get_slice_mesh_layout), a lookup torch is removing; it asks callers to keep the
    flattened meshes themselves. A slice that mixes both kinds is built with
    DeviceMesh._concatenate (one root, so FSDP's HSDP and DTensor accept it), as
    lingua/parallel/expert_parallel.py builds its expert mesh.
    Everything else (get_group, size, mesh, ...) is the root mesh's."""

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
    """End a process that used gloo collectives: flush, then leave without interpreter teardown.

    Why: gloo's worker threads (ProcessGroupGloo::runLoop) can drop the last reference to a
    finished collective's output tensor a moment after the main thread moved on. If that moment
    falls inside interpreter finalization, the thread cannot take the GIL, Python ends it, and
    libstdc++ aborts the process ("terminate called without an active exception", exit -6).
    destroy_process_group() does not join those threads. Seen in CI and here in about one 4-rank
    run in ten on 2 cores, always after all work was done and written; a core dump shows the
    thread in ~AsyncAllgatherCoalescedWork -> THPVariable_clear -> take_gil -> pthread_exit.
    torch has no fix (an atexit destroy was proposed and abandoned: pytorch/pytorch#179291), so
    callers that have finished and saved everything leave with os._exit.
    """
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def all_reduce_sum(value: torch.Tensor, env: DistEnv, dims=("dp_cp", "pp")) -> torch.Tensor:
    """Sum over the named mesh dimensions (default: every rank that holds a distinct part of the
    loss; tensor-parallel ranks hold copies, so they are left out)."""
    if env.world_size > 1:
        for name in dims:
            if env.mesh[name].size() > 1:
                dist.all_reduce(value, op=dist.ReduceOp.SUM, group=env.mesh[name].get_group())
    return value


def apply_fsdp(model: nn.Module, blocks, env: DistEnv, args: DistributedArgs,
               own_mesh_units=()) -> nn.Module:
    """FSDP2 per block and at the root over dp_shard x cp (HSDP when dp_replicate > 1 too).
    `own_mesh_units`: (module, mesh) pairs sharded first over their own mesh (expert-parallel
    experts, which are already split over the ep ranks, shard over the rest).

    Gradients are reduced as a SUM: the trainer already divides the loss by the global batch's
    token count, so averaging over ranks here would divide twice.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if env.world_size == 1 or env.dims.dp_replicate * env.dims.fsdp == 1:
        return model  # no data-parallel ranks (one process, or only tp/pp): nothing to shard

    if env.dims.dp_replicate > 1:
        dp_mesh = env.mesh[("dp_replicate", "dp_shard_cp")]
    else:
        dp_mesh = env.mesh["dp_shard_cp"]
    compute = torch.bfloat16 if args.model_dtype == "bf16" else torch.float32
    # cast_forward_inputs=False: FSDP would otherwise cast every floating input of each unit to
    # bf16, and blocks receive the RoPE cos/sin tables as inputs, so multi-rank runs would rotate
    # in bf16 while one process (autocast) rotates in fp32. The hidden states need no cast: the
    # bf16 embedding already produces them in bf16.
    options = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=compute,
                                                                reduce_dtype=torch.float32,
                                                                cast_forward_inputs=False),
                   offload_policy=CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy())
    for module, mesh in own_mesh_units:
        fully_shard(module, reshard_after_forward=args.reshard_after_forward,
                    **dict(options, mesh=mesh))
    for block in blocks:
        fully_shard(block, reshard_after_forward=args.reshard_after_forward, **options)
    # The root's params (embeddings, final norm, output) are needed right after the last block's
    # backward, so keeping them gathered after forward saves one all-gather per step.
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


# Ops whose outputs selective (op-level) checkpointing keeps: the expensive ones. Everything else
# (norms, activations, RoPE, adds) is recomputed in backward, which is cheap next to a matmul.
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
    """Activation checkpointing of transformer blocks, in place (parameter names unchanged:
    the wrapper's state-dict hooks strip its prefix).

    full: every block recomputes its forward in backward; layer: every `every`-th block (by
    layer id, so a pipeline stage keeps the same choice as the whole model); op: every block, but
    matmul and attention outputs are kept and only cheap ops are recomputed.
    """
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
    """torch.compile each block in place (Module.compile keeps parameter names unchanged).
    Blocks are identical, so they share one compiled graph."""
    for block in layers.values():
        block.compile(backend=backend)
    logger.info("compiled %d transformer blocks with torch.compile (backend %s)", len(layers),
                backend)


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
