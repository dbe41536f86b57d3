"""Evaluate a checkpoint on downstream tasks, the same for every app:

    python -m apps.<app>.eval <dump_dir or dump_dir/checkpoints/STEP> [key=value ...]
    torchrun --nproc-per-node N -m apps.<app>.eval <...> distributed.dp_shard=N [...]

A dump_dir means its newest complete checkpoint. The run's config comes from the checkpoint; the
command line may change the evaluation (`eval.tasks=[lingua_continuation] eval.limit=100 ...`),
the layout (`distributed.*`: DCP reshards the checkpoint to it, without pipeline or context
parallelism), logging, slurm and data.tokenizer, not the model. Everything is checked before the
model is built; results go to <dump_dir>/evals/<step>/results.json and metrics.jsonl, and tasks
that step already has results for are not run again. Rank 0 says on stderr how far it is
(logging.quiet=true silences it). The jobs of eval.mode=async run this too.
"""

import os
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lingua import checkpoint, config
from lingua.checkpoint import hf
from lingua.data.tokenizer import build_tokenizer
from lingua.errors import ConfigError
from lingua.eval import downstream, evaluation
from lingua.model import lora, weights
from lingua.observe import metrics
from lingua.parallel import distributed
from lingua.train import build

# What an evaluation may change of the run's config (the model is the checkpoint's); the
# tokenizer's path, for a run whose tokenizer file has moved.
CHANGEABLE = ("eval", "distributed", "logging", "slurm", "data.tokenizer")


def run_config(schema, ckpt: Path, overrides: Sequence[str]):
    """The checkpoint's config with the command line's changes, as the app's schema."""
    saved = config.migrate(checkpoint.read_run_config(ckpt))
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+")
        if "=" not in override or not any(key == c or key.startswith(c + ".") for c in CHANGEABLE):
            raise ConfigError(
                f"`{override}`: an evaluation takes key=value overrides of "
                f"{', '.join(k + '.*' for k in CHANGEABLE)} only (the model is the "
                f"checkpoint's). For example eval.tasks=[lingua_continuation] eval.limit=100 "
                f"distributed.dp_shard=2.")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), saved,
                                 OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(f"Bad override among {list(overrides)}: {str(err).splitlines()[0]}. "
                          f"Check the key's spelling against the run's config.yaml "
                          f"({ckpt / 'config.yaml'}).") from None


def check_eval_args(args, where: str, progress: downstream.Progress) -> None:
    """Before any work: tasks named and known, a layout an evaluation runs on."""
    evaluation.validate_args(args.eval)
    if not args.eval.tasks:
        raise ConfigError(f"{where}: no task to evaluate. Name some, e.g. "
                          f"eval.tasks=[lingua_continuation] (the shipped offline task) or "
                          f"eval.tasks=[hellaswag,arc_easy].")
    downstream.check_layout(args.distributed, where)
    distributed.validate_args(args.distributed)
    progress.say("indexing lm-eval's tasks (every task's YAML: seconds to minutes)")
    downstream.check_task_names(args.eval.tasks, args.eval.include_path)


def evaluate_checkpoint(app, schema, argv: Optional[Sequence[str]] = None) -> int:
    """The `python -m apps.<app>.eval` command (module docstring); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    ckpt = checkpoint.resolve(argv[0], in_run=True)   # <dump_dir>/checkpoints/<step>
    dump_dir, step = ckpt.parent.parent, int(ckpt.name)
    args = run_config(schema, ckpt, argv[1:])
    distributed.adopt_launcher_vars()    # RANK inside a Slurm step too, before the group exists
    quiet = args.logging.quiet or os.environ.get("RANK", "0") != "0"   # rank 0 says how far it is
    progress = downstream.Progress(None if quiet else sys.stderr)
    app.validate_model(args)
    check_eval_args(args, "python -m apps.<app>.eval", progress)
    todo = downstream.missing_tasks(dump_dir, step, args.eval.tasks)
    if not todo:
        print(f"step {step} already has results for {args.eval.tasks}: "
              f"{downstream.results_path(dump_dir, step).resolve()}")
        return 0
    progress.say(f"step {step} of {dump_dir}: loading the data of {', '.join(todo)}")
    # The data now: a task that cannot be fetched stops us here.
    downstream.load_tasks(todo, args.eval.include_path)
    tokenizer = build_tokenizer(args.data.tokenizer)

    env = distributed.init(args.distributed)
    metrics.setup_logging(env.rank)
    checkpoint.verified(ckpt, env.rank, env.world_size)
    progress.say(f"loading the model from {ckpt}")
    model = build_model(app, args, env, ckpt)
    args.eval.tasks = todo
    results = downstream.evaluate_tasks(
        model, tokenizer, env, args.eval, args.model.max_seq_len, todo,
        autocast=lambda: build.mixed_precision(args, env, [model]), progress=progress)
    if env.is_main:
        record(dump_dir, step, results, args, ckpt, env, todo)
    distributed.destroy()
    return 0


def build_model(app, args, env, ckpt: Path):
    """The whole model sharded for this layout, with the checkpoint's weights."""
    parts, _ = build.parallelized_parts_on_meta(args, env, app)
    param_device = distributed.param_device(args.distributed, env.device)
    for part in parts:
        weights.materialize(part, env.device, args.seed, param_device)
    base = checkpoint.verified_base(ckpt)
    if base is not None:   # a LoRA checkpoint holds the adapters: the frozen base comes first
        args.checkpoint.init_from = base
        weights.load_full_state(parts, hf.load_init_from(args, app, env), env.device,
                                keep=lora.is_adapter)
    checkpoint.load_model(ckpt, parts)
    return parts[0]


def record(dump_dir: Path, step: int, results: dict, args, ckpt: Path, env,
           tasks: List[str]) -> None:
    """Rank 0: results.json, a metrics.jsonl row, wandb, and a summary on stdout."""
    meta = {"checkpoint": str(ckpt.resolve()), "world_size": env.world_size,
            "layout": str(env.dims), "limit": args.eval.limit, "num_fewshot": args.eval.num_fewshot}
    downstream.write_results(dump_dir, step, results, meta)
    flat = downstream.flat_metrics(results, tasks)
    downstream.append_metrics_row(dump_dir, {"step": step, **flat})
    log_wandb(dump_dir, step, flat, args)
    for key, value in sorted(flat.items()):
        print(f"step {step} {key} {value:.4f}", flush=True)
    print(f"results: {downstream.results_path(dump_dir, step).resolve()}", flush=True)


def log_wandb(dump_dir: Path, step: int, flat: dict, args) -> None:
    """An evaluation job's wandb run: one per evaluated step, grouped with the training run
    (its id), with the trained step as the x axis of eval/* (jobs may finish out of order)."""
    if not args.logging.wandb:
        return
    import wandb

    run_id = metrics.wandb_id(dump_dir)
    run = wandb.init(project=args.logging.wandb_project, entity=args.logging.wandb_entity,
                     mode=args.logging.wandb_mode, dir=str(dump_dir), group=run_id,
                     job_type="eval", id=f"{run_id}-eval-{step}", resume="allow",
                     name=f"{args.logging.name or dump_dir.name}-eval-{step}")
    run.define_metric("trained_step")
    run.define_metric("eval/*", step_metric="trained_step")
    run.log({"trained_step": step, **flat})
    run.finish()
