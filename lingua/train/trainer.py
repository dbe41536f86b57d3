"""The training loop every app shares: an app describes its model (an `App`), this does the rest.

An app's train.py defines its config schema and its `App`, loads the config (schema + checks,
before any work) and calls `run(args, app)`, which reads top to bottom like a script:
    env = distributed.init(args.distributed)      # process group and mesh
    start_run(args, env)                          # logging, corpus on first use, config.yaml
    parts, stage_ids = build_model_parts(args, env, app)
    optimizers = optim.Optimizers(parts, ...)
    training = Run(args, env, app, parts, stage_ids, optimizers)   # data, pipeline
    training.resume()                             # newest intact checkpoint, if any
    training.train()                              # the loop: step, log, evaluate, checkpoint
What differs between apps (the model class, its parallelization plan, its checks, its loss and
extra inputs (lingua/model/loss.py), extra metrics or a per-step update such as MoE's expert bias)
comes in through `App`, so a fork copies only
what it changes and fixes to the loop reach every app.
"""

import contextlib
import gc
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from lingua import config, errors
from lingua.errors import ConfigError, RunError
from lingua.eval import downstream, eval_jobs, evaluation
from lingua.eval.evaluation import EvalArgs
from lingua.model import decoder, weights
from lingua.model import loss as loss_module
from lingua.model.transformer import check_attn_backend, inferring_shapes
from lingua.observe import metrics, profiling
from lingua.observe import probe as probe_module
from lingua.observe.metrics import LoggingArgs
from lingua.observe.probe import Probe, ProbeArgs
from lingua.observe.profiling import ProfilingArgs
from lingua.parallel import coverage, distributed, pipeline
from lingua.parallel.context_parallel import cp_batch, validate_cp
from lingua.parallel.distributed import DistEnv, DistributedArgs
from lingua.parallel.tensor_parallel import check_async_tp, loss_parallel_context
from lingua.train import checkpoint, data, optim, preemption, spikes
from lingua.train.checkpoint import CheckpointArgs
from lingua.train.data import DataArgs
from lingua.train.optim import OptimArgs
from lingua.train.slurm import SlurmArgs
from lingua.train.spikes import Spike, SpikeMonitor
from lingua.train.tokenizer import build_tokenizer

logger = logging.getLogger("train")



@dataclass
class BaseTrainArgs:
    """Everything but the model; an app's TrainArgs adds `model` with its own model args."""
    dump_dir: str = "runs/debug"
    steps: int = 100
    seed: int = 42
    # Automatic GC is off (its pauses land at random steps, and on one rank they stall all);
    # the young generations are collected every gc_every steps, all of them every gc_full_every
    # (a cycle that outlived two young collections is only freed by a full one). 0: never.
    gc_every: int = 50
    gc_full_every: int = 1000
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    eval: EvalArgs = field(default_factory=EvalArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    slurm: SlurmArgs = field(default_factory=SlurmArgs)    # read by stool; max_requeues by the job
    probe: ProbeArgs = field(default_factory=ProbeArgs)
    profiling: ProfilingArgs = field(default_factory=ProfilingArgs)


@dataclass
class App:
    """What an app tells the shared trainer about its model."""
    model_class: Callable                         # model_class(args.model), on any device
    parallelize: Callable                         # (part, env, distributed args) -> part
    validate_model: Callable                      # (train args) -> None, raises ConfigError
    loss_parallel: Callable                       # (distributed args) -> bool
    load_hf: Optional[Callable] = None            # (path, dtype) -> (model, model args);
                                                  # dtype None keeps the files' dtype
    flops_per_token: Optional[Callable] = None    # (train args) -> float; default: 6N + attention
    after_step: Optional[Callable] = None         # (parts, env) after each optimizer step
    start_step: Optional[Callable] = None         # (parts) before each step's forwards
    step_metrics: Optional[Callable] = None       # (parts, env) -> dict of extra logged values;
                                                  # every rank calls it on logging steps
    # The loss seam (lingua/model/loss.py): how the model's output becomes the summed loss, and what
    # else the forward and the loss take, made from the whole batch before any sharding.
    loss: Callable = loss_module.cross_entropy    # (output, target) -> LossOutput
    # (tokens, labels) -> (kwargs, target)
    batch_inputs: Callable = loss_module.default_batch_inputs


def device_type() -> str:
    return distributed.job_device_type()


def validate(args, app: App, data_files: bool = True) -> None:
    """Every check that needs no process group, device or write: runs before any work starts.
    data_files=False leaves out the corpus and tokenizer files (lingua.launch.plan plans without
    them and warns of them)."""
    config.check_positive(args, "", ["steps"])
    config.check_dump_dir(args.dump_dir)
    for key in ("gc_every", "gc_full_every"):
        config.require(getattr(args, key) >= 0, f"{key}={getattr(args, key)} must be 0 (never) "
                       f"or a number of steps.")
    app.validate_model(args)
    check_attn_backend(args.model.attn_backend, device_type())
    data.validate_data_args(args.data, files=data_files)
    if data_files:
        check_vocab(args)
    config.require(args.data.seq_len <= args.model.max_seq_len,
                   f"data.seq_len={args.data.seq_len} is longer than model.max_seq_len="
                   f"{args.model.max_seq_len}. Raise model.max_seq_len or shorten data.seq_len.")
    optim.validate_args(args.optim, args.steps)
    config.check_positive(args.logging, "logging", ["every"])
    for key in ("spike_factor", "spike_window"):   # moved: name the new key
        old = getattr(args.logging, key)
        config.require(old is None,
                       f"logging.{key} was moved to optim.{key} (with optim.spike=off|log|skip|"
                       f"rollback saying what a spike does: README, \"Loss spikes\"). Write "
                       + ("optim.spike=off" if key == "spike_factor" and old == 0 else
                          f"optim.{key}={old}") + " instead.")
    config.require(args.optim.spike != "rollback" or args.checkpoint.every > 0,
                   "optim.spike=rollback goes back to the newest checkpoint, but with "
                   "checkpoint.every=0 none is saved before the end. Set checkpoint.every=N (a "
                   "rollback replays up to N steps), or use optim.spike=skip.")
    distributed.validate_args(args.distributed)
    d = args.distributed
    if data_files:   # jsonl: a usable line for every data-parallel rank (reads a few lines)
        data.check_jsonl_lines(args.data, distributed.parallel_dims(
            d, distributed.world_size_from_env()).dp)
    pipeline.validate_pp(args.model.n_layers, d.pp, d.pp_virtual_stages, d.pp_schedule,
                         d.pp_microbatches, args.data.batch_size, args.model.tie_embeddings,
                         d.pp_split)
    validate_cp(args.data.seq_len, d.cp, d.tp, d.cp_backend, device_type(),
                args.model.attn_mask == "block_causal")
    check_async_tp(d.async_tp, device_type(), d.compile)
    checkpoint.validate_args(args.checkpoint)
    evaluation.validate_args(args.eval)
    if args.eval.tasks:   # downstream tasks: known names; a layout or Slurm they can run on
        downstream.check_task_names(args.eval.tasks, args.eval.include_path)
        if args.eval.mode == "inline":
            downstream.check_layout(args.distributed, "eval.tasks with eval.mode=inline")
        else:
            eval_jobs.check_async(args)
    probe_module.validate_args(args.probe)
    profiling.validate_args(args.profiling, args.steps)
    # Resuming is only exact with the same model and the same data stream.
    checkpoint.check_resume_compatible(args.dump_dir, config.to_dict(args),
                                       ("model", "seed", "data.format", "data.seq_len"))


def check_vocab(args) -> None:
    """The tokenizer file loads, and the model's vocabulary holds its tokens."""
    vocab = build_tokenizer(args.data.tokenizer).vocab_size
    config.require(vocab <= args.model.vocab_size,
                   f"The tokenizer ({args.data.tokenizer.kind}) has {vocab} tokens but "
                   f"model.vocab_size={args.model.vocab_size}. Set model.vocab_size={vocab} or "
                   f"more.")


def collect_garbage(step: int, young_every: int, full_every: int) -> Optional[int]:
    """The step's garbage collection, if any: the generation collected (None: none)."""
    if full_every > 0 and step % full_every == 0:
        gc.collect()
        return 2
    if young_every > 0 and step % young_every == 0:
        gc.collect(1)
        return 1
    return None


# The malloc settings keep_freed_memory makes; a user who set any of them keeps theirs.
USER_MALLOC_VARS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                    "MALLOC_TOP_PAD_")
USER_MALLOC_TUNABLES = ("glibc.malloc.mmap_max", "glibc.malloc.mmap_threshold",
                        "glibc.malloc.trim_threshold", "glibc.malloc.top_pad")


def user_malloc_setting() -> Optional[str]:
    """The user's own setting of what keep_freed_memory tunes (a MALLOC_*_ variable or a
    glibc.malloc tunable in GLIBC_TUNABLES), or None."""
    import os

    for key in USER_MALLOC_VARS:
        if key in os.environ:
            return key
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for name in USER_MALLOC_TUNABLES:
        if name in tunables:
            return f"GLIBC_TUNABLES={tunables}"
    return None


def keep_freed_memory() -> bool:
    """CPU training: let glibc's malloc keep freed blocks for reuse, as CUDA's caching allocator
    does on GPU. By default glibc maps large blocks (above 128 KiB, a threshold it raises up to
    32 MiB as it goes) afresh and unmaps them when freed; every step frees and reallocates the
    same activations, so the kernel zeroes their pages again at each first touch. With a real
    vocabulary the logits and their gradient (hundreds of MB each) are such blocks, and the
    kernel's page-fault path takes a large share of a step (see BENCHMARKS.md, "LLaMA training
    step on CPU vs Hugging Face transformers", "Then: page faults"). So: no mmap for any size
    (M_MMAP_MAX=0, blocks come from the heap and go back to it) and no trimming of the heap's
    top (M_TRIM_THRESHOLD=-1), both as mallopt(3) documents them.
    What it costs: the process keeps the memory it freed (release_freed_memory gives back what
    setup used once), and a long-lived block in the middle of the heap can keep a freed one
    beside it from merging, so the resident peak can be higher than with mmap (see
    BENCHMARKS.md, same section: it stays level over a long run). To keep glibc's default, set
    one of the knobs user_malloc_setting looks for, e.g. MALLOC_TOP_PAD_=131072 (mallopt(3)'s
    default). It holds for the main thread's arena, where training allocates (CPU autograd runs
    on the calling thread); other threads' arenas still map blocks over 64 MiB. Process-wide, and
    it stays after run() returns (a caller that trains in-process, as the tests do, keeps it).
    Returns False, and changes nothing, where the C library has no mallopt or the user set one
    of these knobs (user_malloc_setting)."""
    import ctypes

    if user_malloc_setting():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0) and mallopt(m_trim_threshold, -1))


def release_freed_memory() -> None:
    """Give the OS back the heap memory free at this moment (glibc's malloc_trim): called once
    setup is done, so that transient copies made while building, initialising and resuming the
    model do not stay resident for the whole run under keep_freed_memory's no-trim setting."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


TESTED_TORCH = "2.13"   # pyproject.toml's pin: the version the suite runs on


def torch_version_warning(version: str) -> Optional[str]:
    """What to say when the run's torch is not the tested one (None when it is): clusters often
    carry another build, and torch.distributed's private paths change between versions."""
    if version.split("+")[0].rsplit(".", 1)[0] == TESTED_TORCH:
        return None
    return (f"torch {version} is not the version lingua is tested with ({TESTED_TORCH}.x, "
            "pyproject.toml). Under torch 2.11 the one-GPU runbook passes, but the "
            "InterleavedZeroBubble, ZBVZeroBubble and DualPipeV pipeline schedules fail (on gloo; "
            "NCCL untried). "
            f"Install torch=={TESTED_TORCH}.0 where you can.")


def start_run(args, env: DistEnv) -> None:
    """Logging, the embedded corpus on first use, and the run's config.yaml."""
    metrics.setup_logging(env.rank)
    if env.is_main and (untested := torch_version_warning(torch.__version__)):
        logger.warning(untested)
    if env.device.type == "cpu":
        if (user := user_malloc_setting()) is None:
            keep_freed_memory()
        elif env.is_main:
            logger.info(f"malloc: left as set by {user} (the trainer would keep freed blocks "
                        "for reuse on CPU; lingua.train.trainer.keep_freed_memory)")
    preemption.SIGNALS.listen()
    if args.data.prepare_embedded:
        if env.local_rank == 0:
            data.ensure_embedded_corpus(args.data.root)
        distributed.barrier(env)
    if args.eval.tasks and args.eval.mode == "inline":
        # A task whose data cannot be read stops us here.
        downstream.load_tasks(args.eval.tasks, args.eval.include_path)
    if env.is_main:
        Path(args.dump_dir).mkdir(parents=True, exist_ok=True)
        config.dump(args, Path(args.dump_dir) / "config.yaml")


def build_model_parts(args, env: DistEnv, app: App) -> tuple:
    """The parts of the model this rank holds (one, or its pipeline stages), parallelized and
    with weights: from a Hugging Face directory or freshly initialised from the seed.

    The same path on every device and layout: the model is built on the meta device, split into
    this rank's pipeline stages and sharded, and only then gets storage on env.device (so no
    rank ever holds the whole model) and its weights. A fresh init draws each tensor whole from
    its own stream seeded by (seed, name) and keeps this rank's slice (lingua.model.weights): every
    layout starts from the same weights as one process, and no two layers start alike.
    """
    torch.manual_seed(args.seed)
    hf_state = load_init_from(args, app, env) if args.checkpoint.init_from else None
    parts, stage_ids = parallelized_parts_on_meta(args, env, app)
    param_device = distributed.param_device(args.distributed, env.device)
    for part in parts:
        weights.materialize(part, env.device, args.seed, param_device)
    if args.checkpoint.init_from:
        weights.load_full_state(parts, hf_state, env.device)
        del hf_state
    weights.check_placement(parts, env.device, param_device)
    n_params = sum(p.numel() for part in parts for p in part.parameters())
    # The device is named so a launch that gave tasks the wrong GPU (or none) shows at once.
    logger.info("model: %.2fM parameters on this rank's %d part(s), on %s (%s compute)",
                n_params / 1e6, len(parts), env.device, args.distributed.model_dtype)
    return parts, stage_ids


def parallelized_parts_on_meta(args, env: DistEnv, app: App) -> tuple:
    """(parts, stage ids): this rank's pipeline stages of the model built on the meta device,
    parallelized by the app's plan and checked for parameters the plan leaves out of a gradient
    reduction; no storage yet. The trainer and the planner (lingua.launch.plan) both build this
    way."""
    with torch.device("meta"):
        model = app.model_class(args.model)
    # What the loop, pipeline and context parallelism rely on (lingua/model/decoder.py), named if
    # missing.
    decoder.check_model_contract(model, app.model_class.__module__.replace(".", "/") + ".py",
                                 context_parallel=args.distributed.cp > 1)
    stage_ids, parts = [0], [model]
    if env.dims.pp > 1:
        d = args.distributed
        stage_ids = pipeline.stage_ids_of_rank(env.local_rank_in("pp"), d.pp, d.pp_virtual_stages,
                                               d.pp_schedule)
        n_stages = d.pp * d.pp_virtual_stages
        layers = pipeline.stage_layer_ids(args.model.n_layers, n_stages, d.pp_split)
        parts = [pipeline.split_model(model, layers[s], s == 0, s == n_stages - 1)
                 for s in stage_ids]
        del model
    parts = [app.parallelize(part, env, args.distributed) for part in parts]
    # A parameter the app's plan left out of a reduction would train silently wrong: refuse.
    coverage.check_parallel_coverage(parts, env, args.distributed.ep)
    return parts, stage_ids


def load_init_from(args, app: App, env: DistEnv):
    """Rank 0's state of the Hugging Face model in checkpoint.init_from (None on other ranks),
    after every rank checked that it is the model of model.*.

    Only rank 0 reads the directory, in the files' dtype: safetensors maps the files into memory,
    so a tensor is read from disk when it is sent (lingua.model.weights.load_full_state), and no
    rank holds a second copy of the model.
    """
    path = args.checkpoint.init_from
    hf_model, outcome = None, None
    if env.rank == 0:
        try:
            hf_model, outcome = _read_hf(app, path)
        except Exception as err:  # every rank must stop, not wait for weights that never come
            outcome = err
    if env.world_size > 1:
        shared = outcome if not isinstance(outcome, BaseException) else (
            type(outcome).__name__, str(outcome), isinstance(outcome, ConfigError))
        shared = weights.broadcast_object(shared)
        if env.rank == 0 and isinstance(outcome, BaseException):
            raise outcome
        if isinstance(shared, tuple):
            kind, message, is_config = shared
            raise (ConfigError if is_config else RunError)(
                message if is_config else f"rank 0 could not read {path}: {kind}: {message}")
        outcome = shared
    elif isinstance(outcome, BaseException):
        raise outcome
    hf_args = outcome
    # Only what fixes the weights' shapes and meaning must agree; backends, masks and init
    # settings are the run's own choice.
    runtime = {"attn_backend", "attn_mask", "init_std", "depth_init", "max_seq_len"}
    ours, theirs = config.to_dict(args.model), config.to_dict(hf_args)
    differing = {k: (ours[k], theirs.get(k)) for k in ours
                 if k not in runtime and ours[k] != theirs.get(k)}
    config.require(not differing,
                   f"checkpoint.init_from={args.checkpoint.init_from} holds a model that differs "
                   f"from model.* in (ours, theirs): {differing}. Set those model.* keys to "
                   f"the checkpoint's values.")
    return hf_model.state_dict() if hf_model is not None else None


def _read_hf(app: App, path):
    """(model, model args) from the app's load_hf in the files' dtype: no conversion, so the
    tensors stay memory-mapped."""
    return app.load_hf(path, dtype=None)


def mixed_precision(args, env: DistEnv, parts: list):
    """Where distributed.model_dtype=bf16 needs autocast: bf16 compute, fp32 master weights.

    FSDP2, where the app applied it (data- or context-parallel ranks: apply_fsdp), already casts
    the parameters to bf16 for compute and reduces gradients in fp32 (its MixedPrecisionPolicy).
    Every other layout (one process, tp only, pp only, tp x pp) has nothing that casts, and would
    silently compute in fp32: autocast casts the matmuls' inputs there (FSDP layouts keep their
    all-bf16 compute; autocast keeps the residual stream and norms in fp32). Parameters,
    gradients and optimizer state stay fp32 either way (tests/test_dtypes.py checks every layout).
    """
    from torch.distributed.fsdp import FSDPModule

    if args.distributed.model_dtype != "bf16" or all(isinstance(p, FSDPModule) for p in parts):
        return contextlib.nullcontext()
    return torch.autocast(env.device.type, dtype=torch.bfloat16)


def doc_ids_of(batch, args):
    # Document ids cost a mask per forward: pass them only when the model masks by document.
    return batch.doc_ids if args.model.attn_mask == "block_causal" else None


@dataclass
class MicroBatch:
    """This rank's share of one micro-batch, as the model and the app's loss take it."""
    tokens: torch.Tensor
    target: torch.Tensor            # labels, or what the app's batch_inputs made
    doc_ids: Optional[torch.Tensor]
    positions: Optional[torch.Tensor]   # global positions of a context-parallel shard
    model_kwargs: dict              # the app's extra forward inputs [b, s, ...]


@contextlib.contextmanager
def sequence_shard(parts, batch, args, env: DistEnv, app: Optional[App] = None):
    """This rank's MicroBatch of a data micro-batch. The app's extra inputs and target are made
    from the whole sequence first (a target may look ahead across the cut). With context
    parallelism each rank keeps a head and a tail chunk of the sequence, and the attention
    context (global positions, document ids) is set for the forward and backward inside."""
    tokens, labels = batch.tokens.to(env.device), batch.labels.to(env.device)
    model_kwargs, target = ({}, labels) if app is None else app.batch_inputs(tokens, labels)
    doc_ids = doc_ids_of(batch, args)
    doc_ids = None if doc_ids is None else doc_ids.to(env.device)
    if args.distributed.cp == 1:
        yield MicroBatch(tokens, target, doc_ids, None, model_kwargs)
        return
    with cp_batch(parts, tokens, None, doc_ids) as local:
        def mine(t):
            return t.index_select(1, local.positions)
        # The CP attention masks by document itself, from the full-sequence ids it was given.
        yield MicroBatch(local.tokens, mine(target), None, local.positions,
                         {k: mine(v) for k, v in model_kwargs.items()})


def forward_loss(loss: Callable, model, mb: MicroBatch) -> "loss_module.LossOutput":
    """One micro-batch through a whole (unpipelined) model, then the loss (Run.loss)."""
    output = model(mb.tokens, doc_ids=mb.doc_ids, positions=mb.positions, **mb.model_kwargs)
    return loss(output, mb.target)


def eval_loss_sum(model, mb: MicroBatch) -> torch.Tensor:
    """Validation: the next-token cross-entropy of the model's output on the tokens alone
    (sequence_shard without an app: the target is the labels)."""
    return evaluation.token_loss_sum(model(mb.tokens, doc_ids=mb.doc_ids, positions=mb.positions),
                                     mb.target)


class StepLoss:
    """The step's loss and the app's loss metrics, summed over micro-batches (detached, fp64)
    until logged: `loss` is the sum of logged_sum (the cross-entropy) over the sum of tokens,
    over every micro-batch and every rank holding distinct tokens (data and context parallel,
    the last pipeline stage), and so is each metric's sum / count."""

    def __init__(self, device):
        self.device = device
        self.sums: dict = {}

    def add(self, out: "loss_module.LossOutput") -> None:
        logged = out.loss_sum if out.logged_sum is None else out.logged_sum
        values = {"loss": (logged, out.tokens), **out.metrics}
        for name, (total, count) in values.items():
            pair = torch.stack([torch.as_tensor(total, device=self.device).detach().double(),
                                torch.as_tensor(count, device=self.device).double()])
            self.sums[name] = self.sums[name] + pair if name in self.sums else pair

    def reduced(self, env: DistEnv, has_loss: bool) -> dict:
        """{name: sum / count} over the ranks; every rank calls it (collectives)."""
        names = sorted(self.sums)
        if env.dims.pp > 1:  # only the last stage computes losses: it tells the others the names
            everyone = [None] * env.mesh["pp"].size()
            torch.distributed.all_gather_object(everyone, names if has_loss else None,
                                                group=env.mesh["pp"].get_group())
            names = next(n for n in everyone if n is not None)
        zeros = torch.zeros(2, dtype=torch.float64, device=self.device)
        stacked = torch.stack([self.sums.get(name, zeros) for name in names])
        stacked = distributed.all_reduce_sum(stacked, env)
        return {name: (total / count).item() for name, (total, count) in zip(names, stacked)}


class Run:
    """One training run's state: model parts, optimizers, data, pipeline, logging, position."""

    def __init__(self, args, env: DistEnv, app: App, parts: list, stage_ids: list,
                 optimizers: optim.Optimizers):
        self.args, self.env, self.app = args, env, app
        self.parts, self.optimizers = parts, optimizers
        self.dump_dir = Path(args.dump_dir)
        self.loss_parallel = app.loss_parallel(args.distributed)
        d = args.distributed
        self.loss = loss_module.for_training(app.loss, d.compile, d.compile_backend,
                                             self.loss_parallel)
        self.train_loader = data.build_train_loader(args.data, env.dp_rank, env.dp_size, args.seed)
        self.val_batches = data.build_val_batches(args.data, env.dp_rank, env.dp_size)
        self.global_batch = args.data.batch_size * env.dp_size * args.data.grad_accum
        self.global_tokens = self.global_batch * args.data.seq_len
        self.pipe = self._build_pipeline(stage_ids)
        self.phases = profiling.PhaseTimer(env.device)   # fwd_s, bwd_s, optim_s in metrics
        self.step_loss = StepLoss(env.device)   # the current step's losses (train_step)
        self.nonfinite_steps = 0  # steps skipped for NaN/Inf gradients (optim.nonfinite=skip)
        self.spikes = SpikeMonitor(args.optim, env.is_main)   # optim.spike (lingua/train/spikes.py)
        # next_step() calls so far, the data batches skipped by rollbacks included: a rollback's
        # skip range is in these numbers, the same on every layout (the global batch of a call
        # does not depend on it), while the jsonl loader has no global index of its own.
        self.batches_consumed = 0
        self.tokenizer = None     # built for the first downstream evaluation
        self.step = 0             # steps done; resume() moves it to the newest checkpoint's
        self.pending_save: Optional[checkpoint.PendingSave] = None  # checkpoint.async_save's write

    def _build_pipeline(self, stage_ids):
        d = self.args.distributed
        if d.pp == 1:
            return None

        def loss_fn(output, target):  # called by the schedule on the last stage, per micro-batch
            if inferring_shapes():   # torch's extra first call, on empty tensors: eager,
                return self.app.loss(output, target).loss_sum / self.global_tokens  # no compile
            out = self.loss(output, target)
            self.step_loss.add(out)
            return out.loss_sum / self.global_tokens

        n_microbatches = (d.pp_microbatches
                          or pipeline.default_microbatches(d.pp, d.pp_virtual_stages))
        return pipeline.build_schedule(self.parts, stage_ids, d.pp * d.pp_virtual_stages,
                                       self.env.mesh["pp"], self.env.device, d.pp_schedule,
                                       n_microbatches, loss_fn)

    def resume(self) -> int:
        """Load the newest intact checkpoint of dump_dir, if any (weights, optimizer, data
        position, scheduler, spike statistics); returns the step the run continues from (0: a
        fresh run). The data ranges of every rollback so far are read back from spikes.jsonl
        too: one made after the newest checkpoint is in no checkpoint's train state."""
        self.step = self._load_newest()
        self._read_spike_records()
        return self.step

    def _load_newest(self) -> int:
        # Every rank checks the sizes of all files and the checksums of its share of them, and
        # the ranks agree, so all resume from the same intact checkpoint without one rank reading
        # all of it (hundreds of GB) while the others wait under the collective timeout. Damaged
        # ones are moved aside, so that checkpoint.keep never deletes an intact one for them.
        resume_from = checkpoint.newest_verified(self.dump_dir, self.env.rank, self.env.world_size,
                                                 set_aside=True)
        if resume_from is None:
            return 0
        state = checkpoint.load(resume_from, self.parts, self.optimizers.optimizers,
                                self.env.rank, self.env.world_size)
        self._restore_train_state(state)
        return state["step"]

    def _restore_train_state(self, state: dict, keep_records: bool = False) -> None:
        self.train_loader.load_state_dict(state["data"])
        self.optimizers.load_scheduler_state(state["scheduler"])
        self.nonfinite_steps = state.get("nonfinite_steps", 0)
        # A checkpoint from before spike handling has neither: no batch had been skipped.
        self.batches_consumed = state.get("batches_consumed", state["step"])
        self.spikes.load_state_dict(state.get("spikes", {}), keep_records)

    def _read_spike_records(self) -> None:
        """Rank 0 reads spikes.jsonl and tells the others (or its error: none may wait alone)."""
        outcome = [None]
        if self.env.is_main:
            try:
                outcome = [spikes.read_records(self.dump_dir)]
            except RunError as err:
                outcome = [str(err)]
        if self.env.world_size > 1:
            torch.distributed.broadcast_object_list(outcome, src=0)
        if isinstance(outcome[0], str):
            raise RunError(outcome[0])
        self.spikes.merge_records(outcome[0])

    def train_step(self, micro_batches) -> None:
        """Forward/backward over this rank's micro-batches; their losses add up in
        self.step_loss. Each micro-batch's summed loss is divided by the global batch's token
        count (and gradients are summed over ranks), so the gradient is that of the mean loss
        over the global batch, whatever the layout."""
        args, env = self.args, self.env
        with loss_parallel_context(self.loss_parallel):
            for batch in micro_batches:
                with sequence_shard(self.parts, batch, args, env, self.app) as mb:
                    if self.pipe is not None:
                        # The schedule interleaves micro-batches' forwards and backwards (and
                        # the stages' sends), so only their sum can be timed: fwd_bwd_s.
                        # For the same reason autocast (where needed) covers the backwards too.
                        # Harmless: backward ops run in the dtypes their forwards saved (checked
                        # on the LLaMA model: the same gradients, bit for bit, as outside it).
                        # The schedule calls the app's loss (loss_fn above) on the last stage.
                        with self.phases.phase("fwd_bwd"), mixed_precision(args, env, self.parts):
                            self.pipe.step(mb.tokens, mb.target, mb.doc_ids, mb.model_kwargs)
                        continue
                    with self.phases.phase("fwd"), mixed_precision(args, env, self.parts):
                        out = forward_loss(self.loss, self.parts[0], mb)
                    with self.phases.phase("bwd"):
                        (out.loss_sum / self.global_tokens).backward()
                    self.step_loss.add(out)

    def validation_loss(self) -> dict:
        args, env = self.args, self.env

        def batch_loss(batch):
            with sequence_shard(self.parts, batch, args, env) as mb:
                with mixed_precision(args, env, self.parts):
                    if self.pipe is not None:
                        return self.pipe.eval_loss(mb.tokens, mb.target, mb.doc_ids,
                                                   loss_fn=evaluation.token_loss_sum)
                    return eval_loss_sum(self.parts[0], mb)

        with loss_parallel_context(self.loss_parallel):
            return evaluation.evaluate(self.parts, self.val_batches, env, batch_loss)

    def evaluates_at(self, step: int) -> bool:
        """Validation (and downstream tasks) after this step?"""
        e = self.args.eval
        return bool((e.every and step % e.every == 0) or (step == self.args.steps and e.at_end))

    def downstream_metrics(self) -> dict:
        """eval.tasks on the training ranks at this step (eval.mode=inline), as eval/<task>/<metric>
        values for the step's row. Tasks the step already has results for (a resumed run going
        over the step again) are read back, not run again."""
        args, env = self.args, self.env
        # Every rank must run the same tasks: rank 0 reads what is already there.
        todo = [downstream.missing_tasks(self.dump_dir, self.step, args.eval.tasks)]
        if env.world_size > 1:
            torch.distributed.broadcast_object_list(todo, src=0)
        todo = todo[0]
        if todo:
            if self.tokenizer is None:
                self.tokenizer = build_tokenizer(args.data.tokenizer)
            results = downstream.evaluate_tasks(
                self.parts[0], self.tokenizer, env, args.eval, args.model.max_seq_len, todo,
                autocast=lambda: mixed_precision(args, env, self.parts))
            if env.is_main:
                downstream.write_results(self.dump_dir, self.step, results,
                                         {"inline": True, "layout": str(env.dims),
                                          "limit": args.eval.limit,
                                          "num_fewshot": args.eval.num_fewshot})
        if not env.is_main:
            return {}
        return downstream.flat_metrics(downstream.read_results(self.dump_dir, self.step),
                                       args.eval.tasks)

    def _flops_per_token(self) -> float:
        if self.app.flops_per_token is not None:
            return self.app.flops_per_token(self.args)
        m = self.args.model
        with torch.device("meta"):  # FLOPs of the whole model, whatever this rank holds
            return metrics.flops_per_token(self.app.model_class(m), m.n_layers, m.dim,
                                           self.args.data.seq_len, m.tie_embeddings)

    def _save(self, config_yaml: str, before: Optional[tuple] = None, wait: bool = True) -> None:
        """`before`: (data state, batches consumed) to save instead of the current ones. With
        checkpoint.async_save and wait=False (a periodic save) only the copy to CPU memory
        happens now; the files are written while the next steps run, and a later step boundary
        makes the checkpoint visible (_finish_save). A save still being written is finished
        first, so at most one is in flight."""
        args, env = self.args, self.env
        self._finish_save(block=True)
        data_state, batches = before if before is not None else (
            self.train_loader.state_dict(), self.batches_consumed)
        train_state = {"step": self.step, "data": data_state,
                       "scheduler": self.optimizers.scheduler_state(),
                       "nonfinite_steps": self.nonfinite_steps, "batches_consumed": batches,
                       "spikes": self.spikes.state_dict()}
        in_use = eval_jobs.checkpoint_in_use(self.dump_dir)
        if args.checkpoint.async_save and not wait:
            self.pending_save = checkpoint.save_async(
                self.dump_dir, self.step, self.parts, self.optimizers.optimizers, train_state,
                config_yaml, env.rank, env.world_size, args.checkpoint.keep, in_use, env.device)
            return
        checkpoint.save(self.dump_dir, self.step, self.parts, self.optimizers.optimizers,
                        train_state, config_yaml, env.rank, env.world_size, args.checkpoint.keep,
                        in_use)

    def _finish_save(self, block: bool) -> None:
        """checkpoint.async_save: make the checkpoint being written visible once every rank's
        write is done (block: wait for it). Every rank calls this at the same step boundaries
        (a collective while a save is in flight); a write that failed on any rank raises
        RunError on every rank, with the previous checkpoint still the newest."""
        if self.pending_save is None:
            return
        if self.pending_save.finish(block) is not None:
            step, self.pending_save = self.pending_save.step, None
            self._after_save(step)

    def _after_save(self, step: int) -> None:
        """A periodic checkpoint is complete: eval.mode=async evaluates it in a job of its own."""
        args, env = self.args, self.env
        if args.eval.tasks and args.eval.mode == "async" and self.evaluates_at(step) \
                and env.is_main:   # a job evaluates the checkpoint; training goes on
            eval_jobs.submit(args, self.app.model_class.__module__.rsplit(".", 1)[0], step,
                             checkpoint.checkpoints_dir(self.dump_dir) / str(step))

    def _skipped_data(self) -> dict:
        """Bad data lines skipped so far, in total and by reason, summed over the data-parallel
        ranks (each reads its own lines; cp/tp/pp peers read the same ones)."""
        reasons = self.train_loader.skipped_by_reason
        counts = torch.tensor([float(self.train_loader.skipped_lines),
                               *map(float, reasons.values())],
                              dtype=torch.float64, device=self.env.device)
        counts = distributed.all_reduce_sum(counts, self.env, dims=("dp",))
        return {"skipped_lines": int(counts[0]),
                **{f"skipped_{reason}": int(n) for reason, n in zip(reasons, counts[1:].tolist())}}

    def _stop_on_nonfinite(self, grad_norm, data_before: dict, config_yaml: str) -> None:
        """optim.nonfinite=stop: nothing was updated yet, so the weights and optimizer state are
        those after the previous step; save them with the data position before this step (the
        same state a checkpoint at the previous step holds) and stop."""
        for optimizer in self.optimizers.optimizers:
            optimizer.zero_grad(set_to_none=True)
        saved = "nothing was saved (no step had run)"
        if self.step > 0:
            self._save(config_yaml, before=data_before)
            saved = (f"the state after step {self.step} is saved in "
                     f"{checkpoint.newest(self.dump_dir)}")
        raise RunError(
            f"Step {self.step + 1}: the gradient norm is {grad_norm.item()} (NaN or Inf), so the "
            f"update was not applied and the run stopped (optim.nonfinite=stop); {saved}. Look "
            f"at the last rows of metrics.jsonl and, with probe.every=1 from a resumed run, at "
            f"which module's activations blew up; then lower optim.lr, raise optim.warmup, train "
            f"in fp32 (distributed.model_dtype=fp32), or set optim.nonfinite=skip to drop such "
            f"steps, and run the same command to resume.")

    def train(self) -> bool:
        """Train up to args.steps; False when a signal stopped it early (after saving).
        Automatic GC is off during the loop (collect_garbage runs it at fixed steps) and back to
        its previous state afterwards, however the loop ends: a caller (a test, a notebook) that
        runs main() in-process keeps its collector."""
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._train()
        finally:
            preemption.SIGNALS.stop_listening()
            if gc_was_enabled:
                gc.enable()

    def _train(self) -> bool:
        loop = self._open_loop()
        while self.step < self.args.steps:
            loop.profiler.step_begin(self.step + 1)
            # Where the data stood before this step: a step that must be undone (non-finite
            # gradients with optim.nonfinite=stop) is saved as if it never ran.
            data_before = (self.train_loader.state_dict(), self.batches_consumed) \
                if self.args.optim.nonfinite == "stop" else None
            self.phases.start_step(timed=self._logs_at(self.step + 1))
            t0 = time.perf_counter()
            with torch.profiler.record_function("data"):
                micro_batches = self._next_batches()
            t_data = time.perf_counter() - t0
            probing = self._start_probe(loop)
            self.step_loss = StepLoss(self.env.device)   # this step's losses only
            self.train_step(micro_batches)
            if probing:  # weights and gradients as the optimizer will see them, before clipping
                loop.probe.stop()
                loop.probe_alerts += loop.probe.finish_step(self.step + 1, loop.log.wandb_run)
            grad_norm, lr, spike = self._optimizer_step(loop, data_before)
            if spike is not None and self._roll_back(loop, spike, micro_batches):
                loop.profiler.step_end(spike.step)
                continue   # from the checkpoint's step, with the spike's batches to be skipped
            self.step += 1
            collect_garbage(self.step, self.args.gc_every, self.args.gc_full_every)
            loop.window.add(time.perf_counter() - t0, t_data, self.global_tokens,
                            self.phases.step_seconds())
            loop.profiler.step_end(self.step)
            if self._logs_at(self.step):
                self._log_row(loop, grad_norm, lr)
            if self._save_or_stop(loop):
                break
        self._close_loop(loop)
        return self.step == self.args.steps

    def _open_loop(self) -> "_Loop":
        """What the loop keeps between steps: logger, timers, probe, profiler, signals."""
        args, env = self.args, self.env
        flops_per_token = self._flops_per_token()
        # Measured now, once for the run, on this model's shapes (or the GPU's data sheet):
        # every row's MFU is divided by it. Rank 0 writes peak.json.
        peak = metrics.run_peak(env.device, args.distributed.model_dtype, self.parts,
                                args.data.batch_size * args.data.seq_len, self.step,
                                self.dump_dir if env.is_main else None)
        logger.info("training steps %d -> %d, global batch %d x %d tokens", self.step, args.steps,
                    self.global_batch, args.data.seq_len)
        if not args.probe.every and self.spikes.on and env.is_main:
            # A probe made at a spike (Run._spike_probe) comes after the resume: the lines of
            # the steps about to run again must go now, as Probe does when probe.every is set.
            metrics.drop_rows_after(self.dump_dir / "probe" / "probe.jsonl", self.step)
        return _Loop(
            log=metrics.MetricLogger(self.dump_dir, args.logging, config.to_dict(args), env.is_main,
                                     self.step),
            config_yaml=config.to_yaml(args), window=metrics.Window(),
            flops_per_token=flops_per_token, peak=peak,
            pp_group=env.mesh["pp"].get_group() if env.dims.pp > 1 else None,
            signals=preemption.SIGNALS.catch_interrupts(self._where_to_resume),
            probe=(Probe(args.probe, self.parts, env, self.dump_dir, self.step)
                   if args.probe.every else None),
            profiler=profiling.StepProfiler(args.profiling, self.dump_dir, env.rank, env.device,
                                            flops_per_token * self.global_tokens / env.world_size,
                                            peak))

    def _logs_at(self, step: int) -> bool:
        return step % self.args.logging.every == 0 or step == self.args.steps

    def _start_probe(self, loop: "_Loop") -> bool:
        """Hooks for this step's forward passes if the probe samples it, or if the step before
        was a spike (optim.spike=log|skip): then it is probed in full whatever probe.every says,
        so that the probe's plots show the spike beside the regular probe steps."""
        probing = loop.probe is not None and loop.probe.active(self.step + 1)
        if self.spikes.probe_next:
            self.spikes.probe_next, probing = False, True
            self._spike_probe(loop)
        if probing:
            loop.probe.start()
        if self.app.start_step is not None:
            self.app.start_step(self.parts)
        return probing

    def _next_batches(self) -> list:
        """This step's micro-batches: the next data batch no rollback said to skip. A skipped
        batch is read and thrown away, so the loader's position stays its own business."""
        while True:
            micro_batches = self.train_loader.next_step()
            self.batches_consumed += 1
            record = self.spikes.skips_batch(self.batches_consumed)
            if record is None:
                return micro_batches
            if self.env.is_main:
                logger.info("data batch %d skipped (range %d..%d, from the loss spike at step "
                            "%s)", self.batches_consumed, *record["skip"], record.get("step", "?"))

    def _optimizer_step(self, loop: "_Loop", data_before):
        """Clip, then update; or skip the update (optim.nonfinite=skip on a non-finite gradient
        norm, optim.spike=skip on a spike); or stop (optim.nonfinite=stop). Returns (pre-clip
        gradient norm, the learning rate this step used, the spike to roll back from: with
        optim.spike=rollback nothing is applied here, Run._roll_back decides)."""
        args, env = self.args, self.env
        with self.phases.phase("optim"):
            grad_norm = optim.clip_grad_norm(self.parts, args.optim.clip, loop.pp_group)
            lr = self.optimizers.lr
            if not bool(torch.isfinite(grad_norm)):  # the norm is global: every rank agrees
                if args.optim.nonfinite != "skip":
                    self._stop_on_nonfinite(grad_norm, data_before, loop.config_yaml)
                self.optimizers.skip()
                self.nonfinite_steps += 1
                if env.is_main:
                    logger.warning("step %d: gradient norm is %s; update skipped "
                                   "(optim.nonfinite=skip), %d such steps so far",
                                   self.step + 1, grad_norm.item(), self.nonfinite_steps)
                return grad_norm, lr, None
            values = self._spike_values(grad_norm) if self.spikes.on else None
            spike = None if values is None else self.spikes.check(self.step + 1, values)
            if spike is not None:
                self.spikes.since_row = True
                if args.optim.spike == "rollback":
                    return grad_norm, lr, spike
                self.spikes.probe_next = True
                if args.optim.spike == "skip":
                    self.optimizers.skip()
                    self.spikes.skipped(spike)
                    return grad_norm, lr, None
                self.spikes.logged(spike)
            self.optimizers.step()
            if self.app.after_step is not None:
                self.app.after_step(self.parts, env)
            if values is not None:
                self.spikes.accept(values)
        return grad_norm, lr, None

    def _spike_values(self, grad_norm: torch.Tensor) -> dict:
        """The step's loss over the global batch and its gradient norm, the same numbers on
        every rank: one all-reduce of (loss sum, token count, norm) per step.

        Over all ranks, not only those holding distinct losses (data/context-parallel ranks,
        the last pipeline stage): tensor-parallel peers hold copies of the same (sum, count)
        and earlier stages add zeros, so sum / count is the global mean either way, and one
        collective on the default group costs less than one per mesh dimension. The norm is
        global already; summing it and dividing by the world size leaves no rank its own copy
        to decide on. Every rank then updates the same windows and takes the same decision."""
        packed = torch.zeros(3, dtype=torch.float64, device=self.env.device)
        pair = self.step_loss.sums.get("loss")
        if pair is not None:
            packed[:2] = pair
        packed[2] = grad_norm.detach().double()
        if self.env.world_size > 1:
            torch.distributed.all_reduce(packed)
        total, count, norm = packed.tolist()
        return {"loss": total / count if count else math.nan,
                "grad_norm": norm / self.env.world_size}

    def _roll_back(self, loop: "_Loop", spike: Spike, micro_batches) -> bool:
        """optim.spike=rollback at the spiking step: record the data batches to skip (in
        spikes.jsonl first, so that a crash cannot lose them), run the spiking batch again with
        the probe on, and reload the newest intact checkpoint on every rank, as resume does.
        Returns False, having skipped the update instead, when no checkpoint from before the
        spike exists yet: stopping a run in its first checkpoint.every steps for a spike would
        cost more than the spike, and skipping is the closest thing that needs no checkpoint."""
        env = self.env
        for optimizer in self.optimizers.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self._finish_save(block=True)   # the checkpoint being written is the newest one
        target = checkpoint.newest_verified(self.dump_dir, env.rank, env.world_size,
                                            set_aside=True)
        if target is None or int(target.name) >= spike.step:
            self.optimizers.skip()
            self.spikes.probe_next = True
            self.spikes.skipped(spike, "optim.spike=rollback, but no checkpoint was saved "
                                       "before it yet")
            return False
        back_to = int(target.name)
        record = self.spikes.record_rollback(spike, self.batches_consumed, back_to, str(target))
        if env.is_main:
            spikes.append_record(self.dump_dir, record)
            logger.warning("%s spike at step %d: %.4g is above the threshold %.4g (%s); rolling "
                           "back to %s and skipping data batches %d..%d (rollback %d, recorded "
                           "in %s)", spike.on, spike.step, spike.value, spike.threshold,
                           spike.why, target, *record["skip"], len(self.spikes.rollbacks),
                           spikes.records_path(self.dump_dir))
        self._probe_spiking_batch(loop, spike.step, micro_batches, back_to)
        state = checkpoint.load(target, self.parts, self.optimizers.optimizers, env.rank,
                                env.world_size)
        self._restore_train_state(state, keep_records=True)
        self.step = state["step"]
        self.spikes.since_row = True  # the next row (the checkpoint's next step) says so
        loop.log.rewind(self.step)   # steps after the checkpoint run again: their rows go
        loop.window.reset()
        return True

    def _probe_spiking_batch(self, loop: "_Loop", step: int, micro_batches, back_to: int) -> None:
        """The spiking batch again, forward and backward on the weights that produced the spike,
        with the probe on; recorded as step `step`, its gradients thrown away. The probe's lines
        after the checkpoint go first: those steps run again and will write their own."""
        probe = self._spike_probe(loop)
        if self.env.is_main:
            metrics.drop_rows_after(probe.path, back_to)
        probe.start()
        if self.app.start_step is not None:
            self.app.start_step(self.parts)
        self.step_loss = StepLoss(self.env.device)
        self.train_step(micro_batches)
        probe.stop()
        loop.probe_alerts += probe.finish_step(step, loop.log.wandb_run)
        for optimizer in self.optimizers.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def _spike_probe(self, loop: "_Loop") -> Probe:
        """The probe, made on first use when probe.every=0 (it has no hooks until started)."""
        if loop.probe is None:
            loop.probe = Probe(self.args.probe, self.parts, self.env, self.dump_dir, self.step)
            if self.env.is_main:
                loop.probe.dir.mkdir(parents=True, exist_ok=True)
        return loop.probe

    def _log_row(self, loop: "_Loop", grad_norm, lr) -> None:
        """The metrics.jsonl row of this step (every rank joins its collectives)."""
        args, env = self.args, self.env
        tokens_per_s = loop.window.tokens_per_s()
        losses = self.step_loss.reduced(env, self.pipe is None or self.pipe.has_last)
        row = {"step": self.step, "loss": losses.pop("loss"), "lr": lr,
               "grad_norm": grad_norm.item(), "tokens_per_s": tokens_per_s,
               **metrics.mfu_fields(loop.flops_per_token * tokens_per_s / env.world_size,
                                    loop.peak),
               "data_s": loop.window.data_s(), "step_s": loop.window.step_s(),
               **loop.window.phase_s(), "peak_mem_gib": metrics.peak_memory_gib(env.device),
               "nonfinite_steps": self.nonfinite_steps, **self._skipped_data(),
               "eta_s": loop.window.eta_s(args.steps - self.step)}
        if self.spikes.on or self.spikes.rollbacks:
            # loss_spike: a spike since the previous row (whatever was done about it)
            row["loss_spike"], self.spikes.since_row = int(self.spikes.since_row), False
            row.update(self.spikes.metrics(skipped_batches=self.batches_consumed - self.step))
        row.update(losses)    # the app's loss metrics (LossOutput.metrics)
        if self.app.step_metrics is not None:
            row.update(self.app.step_metrics(self.parts, env))
        if loop.probe is not None:
            row["probe_alerts"], loop.probe_alerts = loop.probe_alerts, 0
        if self.evaluates_at(self.step):
            row.update(self.validation_loss())
            if args.eval.tasks and args.eval.mode == "inline":
                row.update(self.downstream_metrics())
        loop.window.reset()
        loop.log.log(row)
        if env.is_main:
            logger.info(metrics.format_line(row, args.steps))

    def _save_or_stop(self, loop: "_Loop") -> bool:
        """Checkpoint when due; on an agreed signal (time limit, preemption) save if not saved
        and return True to stop, requeueing the Slurm job when asked. With checkpoint.async_save
        a periodic save is written while the next steps run: a later step boundary finishes it
        once every rank's write is done, and the next save, the last step and a stop wait for
        it (the same boundaries on every rank: each check is a collective)."""
        args, env = self.args, self.env
        last = self.step == args.steps
        saved = (args.checkpoint.every and self.step % args.checkpoint.every == 0) or (
            last and args.checkpoint.save_final)
        if saved:   # the last step's save is written before the run ends
            self._save(loop.config_yaml, wait=last)
            if self.pending_save is None:
                self._after_save(self.step)
        else:       # a save in flight (checkpoint.async_save) is finished once written
            self._finish_save(block=last)
        action = loop.signals.agreed(env.world_size, env.device)
        if action == preemption.NONE or last:
            return False
        if not saved:
            self._save(loop.config_yaml)
        self._finish_save(block=True)   # stop with the checkpoint written
        if env.is_main:   # one line for the job: where the run is and how to go on
            how = "interrupted (Ctrl-C)" if loop.signals.interrupted else "stopped by a signal"
            logger.warning("%s after step %d; %s", how, self.step, self._where_to_resume())
            if action == preemption.REQUEUE:
                preemption.requeue_job(args.slurm.max_requeues)
        return True

    def _where_to_resume(self) -> str:
        newest = checkpoint.newest(self.dump_dir)
        if newest is None:
            return (f"no checkpoint saved yet; to start over, run again: "
                    f"{preemption.resume_command()}")
        return f"checkpoint {newest} saved; to resume, run again: {preemption.resume_command()}"

    def _close_loop(self, loop: "_Loop") -> None:
        loop.profiler.close()
        if loop.probe is not None and self.env.is_main and loop.log.wandb_run is not None:
            loop.probe.log_plots(loop.log.wandb_run)
        loop.log.close()
        if self.env.is_main and self.step == self.args.steps:
            logger.info("done: run directory %s (config.yaml, metrics.jsonl, checkpoints/)",
                        self.dump_dir.resolve())


@dataclass
class _Loop:
    """Run._train's state between steps."""
    log: metrics.MetricLogger
    config_yaml: str
    window: metrics.Window
    flops_per_token: float
    peak: metrics.Peak
    pp_group: object
    signals: object
    probe: Optional[Probe]
    profiler: profiling.StepProfiler
    probe_alerts: int = 0


def run(args, app: App) -> int:
    """Train `app` with checked `args` from start (or the newest checkpoint) to args.steps:
    0 when done, EXIT_STOPPED (3) when a signal stopped it after saving (EXIT_INTERRUPTED, 130,
    when that signal was a Ctrl-C; both in lingua.train.preemption). Every app's main calls it, so
    the flow is written once (the module docstring)."""
    env = distributed.init(args.distributed)
    start_run(args, env)
    parts, stage_ids = build_model_parts(args, env, app)
    optimizers = optim.Optimizers(parts, args.optim, args.steps, env.device)
    training = Run(args, env, app, parts, stage_ids, optimizers)
    training.resume()                 # from the newest intact checkpoint of dump_dir, if any
    if env.device.type == "cpu":
        release_freed_memory()        # setup's transient copies (see keep_freed_memory)
    completed = training.train()
    if not completed:
        # Stopped by a signal, everything saved: every rank leaves from here together, so that
        # under srun rank 0 (the one that exits non-zero, see lingua.launch.stool) can leave last.
        distributed.barrier(env)
    distributed.destroy()
    if completed:
        return 0
    return (preemption.EXIT_INTERRUPTED if preemption.SIGNALS.interrupted
            else preemption.EXIT_STOPPED)


def exit_cli(main: Callable) -> None:
    """Run an app's main() as a command: a ConfigError prints its paragraph and exits 2, a
    RunError exits 1; both without a traceback, printed once for the job and handed to torchrun
    as the failure it reports (lingua.errors.report). A Ctrl-C outside the training loop (which
    saves and stops by itself) is one line and exit code 130. A run that ended (finished,
    stopped or failed with a RunError) leaves through distributed.exit_process."""
    import signal
    import sys

    def report(err):
        # torchrun stops the other workers with SIGTERM as soon as one exits: a rank that is
        # saying why it failed finishes saying it (milliseconds), then leaves by itself.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        errors.report(f"error: {err}")

    try:
        code = main()
    except ConfigError as err:
        report(err)
        # Most config errors come before any process group; a plan refused after it started
        # (lingua.parallel.coverage) leaves gloo threads that can abort a normal interpreter exit.
        if torch.distributed.is_initialized():
            distributed.exit_process(2)
        sys.exit(2)
    except RunError as err:
        report(err)
        code = 1
    except KeyboardInterrupt:
        # Config, model build, data preparation, resume: nothing is half-written (checkpoints
        # are complete or invisible), so there is nothing to save and nothing to clean up.
        if preemption.is_rank0():
            print(f"\nlingua: interrupted (Ctrl-C) outside the training loop; nothing more was "
                  f"saved. To go on, run again: {preemption.resume_command()}", file=sys.stderr,
                  flush=True)
        code = preemption.EXIT_INTERRUPTED
    except Exception as err:
        errors.record_crash(err)   # torchrun's summary shows this traceback, not a link
        raise
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # leaving now: a late Ctrl-C is no traceback
    distributed.exit_process(code)
