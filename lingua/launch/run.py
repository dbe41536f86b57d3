"""A whole training run: the schema every app's TrainArgs extends, its checks before any work
(validate), the hooks around the loop and `run`; what differs between apps comes through `App`
(lingua/train/app.py). At the top layer: the schema and hooks include evaluation's."""

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lingua import checkpoint, config, data, errors, optim
from lingua.checkpoint import CheckpointArgs
from lingua.data import DataArgs
from lingua.errors import ConfigError, RunError
from lingua.eval import downstream, evaluation
from lingua.float8 import Float8ScalesHook
from lingua.hooks import Hooks
from lingua.launch import eval_jobs
from lingua.launch.host_memory import GarbageCollection, release_freed_memory
from lingua.launch.process import start_process, write_config
from lingua.launch.slurm import SlurmArgs
from lingua.model.layers import check_attn_backend
from lingua.observe import probe as probe_module
from lingua.observe import profiling
from lingua.observe.metrics import LoggingArgs
from lingua.observe.probe import ProbeArgs, ProbeHook
from lingua.observe.profiling import ProfilerHook, ProfilingArgs
from lingua.optim import OptimArgs, spikes
from lingua.optim.spikes import SpikeArgs, SpikeHook
from lingua.parallel import distributed, fault_tolerance, pipeline
from lingua.parallel.context_parallel import validate_cp
from lingua.parallel.distributed import DistEnv, DistributedArgs
from lingua.parallel.fault_tolerance import FaultToleranceArgs, FaultToleranceHook
from lingua.parallel.tensor_parallel import check_async_tp
from lingua.train import dump_lock, preemption
from lingua.train.app import App, check_vocab, device_type
from lingua.train.build import build_model_parts
from lingua.train.loop import Run
from lingua.train.preemption import StopHook
from lingua.train.saving import where_to_resume


@dataclass
class BaseTrainArgs:
    """Everything but the model; an app's TrainArgs adds `model` with its own model args."""
    dump_dir: str = "runs/debug"
    steps: int = 100
    seed: int = 42
    # Young generations every gc_every steps, all every gc_full_every (0: never): GarbageCollection.
    gc_every: int = 50
    gc_full_every: int = 1000
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    spikes: SpikeArgs = field(default_factory=SpikeArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    eval: eval_jobs.RunEvalArgs = field(default_factory=eval_jobs.RunEvalArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    slurm: SlurmArgs = field(default_factory=SlurmArgs)    # read by stool; max_requeues by the job
    probe: ProbeArgs = field(default_factory=ProbeArgs)
    profiling: ProfilingArgs = field(default_factory=ProfilingArgs)
    fault_tolerance: FaultToleranceArgs = field(default_factory=FaultToleranceArgs)


def validate(args, app: App, data_files: bool = True) -> None:
    """Every check that needs no process group, device or write, before any work. data_files=False
    leaves out the corpus and tokenizer files (lingua.launch.plan warns of them)."""
    with config.every_problem() as check:   # every problem named in one try
        _checks(check, args, app, data_files)


def _checks(check, args, app: App, data_files: bool) -> None:
    require = functools.partial(check, config.require)
    check(config.pending_problems, args)   # the overrides config.load could not apply
    check(config.check_positive, args, "", ["steps"])
    check(config.check_dump_dir, args.dump_dir)
    for key in ("gc_every", "gc_full_every"):
        require(getattr(args, key) >= 0, f"{key}={getattr(args, key)} must be 0 (never) or a "
                f"number of steps.")
    check(app.validate_model, args)
    check(check_attn_backend, args.model.attn_backend, device_type())
    check(data.validate_data_args, args.data, files=data_files)
    if data_files:
        check(check_vocab, args)
    check(data.loader_class(args.data).check_model, args.data, args.model)   # chat: pack
    require(args.data.seq_len <= args.model.max_seq_len,
            f"data.seq_len={args.data.seq_len} is longer than model.max_seq_len="
            f"{args.model.max_seq_len}. Raise model.max_seq_len or shorten data.seq_len.")
    check(optim.validate_args, args.optim, args.steps)
    check(config.check_positive, args.logging, "logging", ["every"])
    check(spikes.validate_args, args.spikes)
    require(args.spikes.policy != "rollback" or args.checkpoint.every > 0,
            "spikes.policy=rollback goes back to the newest checkpoint, but with "
            "checkpoint.every=0 none is saved before the end. Set checkpoint.every=N (a rollback "
            "replays up to N steps), or use spikes.policy=skip.")
    check(distributed.validate_args, args.distributed)
    check(fault_tolerance.validate_args, args)
    d = args.distributed
    dims = check(distributed.parallel_dims, d, distributed.world_size_from_env())
    corpus = data_files and args.data.root and Path(args.data.root).is_dir()   # else: said above
    if dims is not None and corpus:   # jsonl: a usable line for every data-parallel rank
        check(data.loader_class(args.data).check_ranks, args.data, dims.dp)
    check(pipeline.validate_pp, args.model.n_layers, d.pp, d.pp_virtual_stages, d.pp_schedule,
          d.pp_microbatches, args.data.batch_size, args.model.tie_embeddings, d.pp_split)
    check(validate_cp, args.data.seq_len, d.cp, d.tp, d.cp_backend, device_type(),
          args.model.attn_mask == "block_causal")
    check(check_async_tp, d.async_tp, device_type(), d.compile)
    check(checkpoint.validate_args, args.checkpoint)
    check(evaluation.validate_args, args.eval)
    if args.eval.tasks:   # downstream tasks: known names; a layout or Slurm they can run on
        check(downstream.check_task_names, args.eval.tasks, args.eval.include_path)
        if args.eval.mode == "inline":
            check(downstream.check_layout, args.distributed, "eval.tasks with eval.mode=inline")
        else:
            check(eval_jobs.check_async, args)
    check(probe_module.validate_args, args.probe)
    check(profiling.validate_args, args.profiling, args.steps)
    # Resuming is only exact with the same model and the same data stream.
    newest = check(checkpoint.check_resume_compatible, args.dump_dir, config.to_dict(args),
                   ("model", "seed", "data.format", "data.seq_len"))
    if newest is not None:   # LoRA checkpoints hold the adapters: resume on the same base only
        check(checkpoint.verified_base, newest, args.checkpoint.init_from, "checkpoint.init_from")


def hooks(args, env: DistEnv, app: App) -> Hooks:
    """What runs around the loop, in the order each step calls it (lingua/hooks.py)."""
    return Hooks([
        FaultToleranceHook(args.fault_tolerance, env),   # first: the others see summed gradients
        *app.hooks(args, env),
        GarbageCollection(args.gc_every, args.gc_full_every),
        Float8ScalesHook(args, env),
        StopHook(args.slurm.max_requeues, lambda: where_to_resume(args.dump_dir)),
        SpikeHook(args, env),
        ProfilerHook(args),
        ProbeHook(args, spikes_on=args.spikes.policy != "off"),
        evaluation.ValidationHook(args, env),
        downstream.DownstreamHook(),
        # The app's package, whose eval module the jobs run: its TrainArgs is defined there.
        eval_jobs.AsyncEvalHook(args, type(args).__module__.rsplit(".", 1)[0]),
    ])


def run(args, app: App) -> int:
    """Train `app` with checked `args` (from the newest checkpoint, if any) to args.steps: 0 when
    done, else preemption.EXIT_STOPPED (3) or, after a Ctrl-C, EXIT_INTERRUPTED (130)."""
    env = fault_tolerance.join(args.fault_tolerance, distributed.init(args.distributed))
    start_process(args, env)
    with dump_lock.held(args.dump_dir, env):   # one run per dump_dir, before any write there
        return _run(args, app, env)


def _run(args, app: App, env: DistEnv) -> int:
    if args.eval.tasks and args.eval.mode == "inline":   # a task's data unreadable: stop now
        downstream.load_tasks(args.eval.tasks, args.eval.include_path)
    checkpoint.prepare_async_saves(args.checkpoint, env.world_size)   # fails now, not mid-run
    parts, stage_ids = build_model_parts(args, env, app)
    optimizers = optim.Optimizers(parts, args.optim, args.steps, env.device)
    training = Run(args, env, app, parts, stage_ids, optimizers, hooks(args, env, app),
                   eval_jobs.checkpoint_in_use(args.dump_dir))
    write_config(args, env)   # weights and data ready: a start refused before wrote nothing
    training.resume()                 # from the newest intact checkpoint of dump_dir, if any
    if env.device.type == "cpu":
        release_freed_memory()        # setup's transient copies (see keep_freed_memory)
    completed = training.train()
    if not completed:
        # Stopped and saved: the ranks leave together, rank 0 (non-zero under srun) last.
        distributed.barrier(env)
    distributed.destroy()
    if completed:
        return 0
    return (preemption.EXIT_INTERRUPTED if preemption.SIGNALS.interrupted
            else preemption.EXIT_STOPPED)


def exit_cli(main: Callable) -> None:
    """Run an app's main() as a command: a ConfigError exits 2, a RunError 1, both without a
    traceback (errors.report); a Ctrl-C outside the loop is one line and exit code 130."""
    import signal
    import sys

    def report(err):
        # torchrun SIGTERMs the others once one exits: this rank finishes saying why, then leaves.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        errors.report(f"error: {err}")

    try:
        code = main()
    except ConfigError as err:
        report(err)
        # A plan refused after the process group started leaves gloo threads that can abort exit.
        if torch.distributed.is_initialized():
            distributed.exit_process(2)
        sys.exit(2)
    except RunError as err:
        report(err)
        code = 1
    except KeyboardInterrupt:   # before the loop: nothing is half-written, nothing to save
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
