"""eval.mode=async: each evaluation step's checkpoint is evaluated by its own Slurm job (files
under evals/<step>/: docs/evaluation.md) and training never waits for it. Each task runs
`EvalJob`, a parent that runs the evaluation as a child and judges how it ended (`decide`): a
child killed outright (OOM) requeues the job, which skips finished tasks."""

import datetime
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, List, Optional

from lingua import checkpoint
from lingua.errors import ConfigError
from lingua.eval.evaluation import EvalArgs
from lingua.hooks import Hook
from lingua.launch import slurm
from lingua.launch.slurm import SlurmArgs
from lingua.train.loop import evaluates_at

logger = logging.getLogger("eval")

PENDING = "pending"
JOB_FILE = "job.json"
# The submitting training rank's launcher variables, which sbatch would export to the job's tasks
# (each would be the trainer's rank 0, on its rendezvous port): the tasks take theirs from Slurm.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                 "TORCHELASTIC_ERROR_FILE", "LINGUA_JOB_DEVICE")
EXIT_CONFIG = 2     # a ConfigError (lingua.launch.run.exit_cli): not retried


@dataclass
class RunEvalArgs(EvalArgs):
    """A training run's eval.*: EvalArgs, and eval.slurm.*, the resources of eval.mode=async."""
    slurm: SlurmArgs = field(default_factory=SlurmArgs)


def step_dir(dump_dir, step: int) -> Path:
    return Path(dump_dir) / "evals" / str(step)


def pending_marker(dump_dir, step: int) -> Path:
    """Exists while the evaluation job of `step` may still read its checkpoint."""
    return step_dir(dump_dir, step) / PENDING


def checkpoint_in_use(dump_dir) -> Callable[[int], bool]:
    """For pruning: a job that never runs keeps its checkpoint until evals/<step>/pending goes."""
    return lambda step: pending_marker(dump_dir, step).exists()


def job_slurm_args(s: slurm.SlurmArgs) -> slurm.SlurmArgs:
    """eval.slurm with the values left at 0 filled in as stool fills slurm.* (one task per GPU)."""
    filled = replace(s, dry_run=False)
    for fill in slurm.slurm_defaults(s):
        key, value = fill.split("=", 1)
        setattr(filled, key.split(".", 1)[1], int(value))
    return filled


def _eval_slurm_error(err: ConfigError) -> ConfigError:
    """stool's messages name slurm.*: here the keys are eval.slurm.*."""
    return ConfigError(re.sub(r"(?<![\w.])slurm\.", "eval.slurm.", str(err)))


def evaluated_steps_are_saved(args) -> Optional[str]:
    """None when every evaluation step saves a checkpoint, else what is wrong and the fix."""
    e, c = args.eval, args.checkpoint
    if e.every:
        if not c.every:
            return (f"eval.every={e.every} with checkpoint.every=0: no checkpoint is saved at the "
                    f"evaluation steps. Set checkpoint.every={e.every} (or a divisor of it)")
        if e.every % c.every:
            return (f"eval.every={e.every} is not a multiple of checkpoint.every={c.every}: steps "
                    f"such as {e.every} have no checkpoint to evaluate. Set eval.every to a "
                    f"multiple of {c.every} "
                    f"(e.g. eval.every={c.every * max(1, e.every // c.every)}) "
                    f"or checkpoint.every to a divisor of {e.every}")
    last_saved = c.save_final or (c.every and args.steps % c.every == 0)
    if e.at_end and not last_saved:
        return ("eval.at_end=true with checkpoint.save_final=false: the last step saves no "
                "checkpoint to evaluate. Set checkpoint.save_final=true, or eval.at_end=false")
    return None


def check_async(args) -> None:
    """Evaluation steps are checkpoint steps, eval.slurm.* is valid, and Slurm is here."""
    problem = evaluated_steps_are_saved(args)
    if problem:
        raise ConfigError(f"eval.mode=async evaluates the checkpoint of each evaluation step in "
                          f"its own job, but {problem}; or evaluate on the training ranks with "
                          f"eval.mode=inline.")
    s = job_slurm_args(args.eval.slurm)
    try:
        slurm.validate_slurm_args(s)
    except ConfigError as err:
        raise _eval_slurm_error(err) from None
    if shutil.which("sbatch") is None:
        raise ConfigError("eval.mode=async submits each evaluation as a Slurm job, and sbatch is "
                          "not on PATH here. Train where Slurm is (a cluster's login or compute "
                          "node, or `bash setup/slurm_local.sh start` for a local one), or "
                          "evaluate on the training ranks with eval.mode=inline.")
    if os.environ.get("RANK", "0") == "0":  # every rank validates; one asking sinfo is enough
        try:  # the partition exists and one of its nodes can hold the job, as stool checks
            slurm.check_resources(s)
        except ConfigError as err:
            raise _eval_slurm_error(err) from None


def job_overrides(args, world_size: int) -> List[str]:
    """Evaluate inline with the run's eval settings, FSDP over all the job's tasks."""
    e = args.eval
    values = {"mode": "inline", "tasks": list(e.tasks), "limit": e.limit,
              "batch_size": e.batch_size, "num_fewshot": e.num_fewshot,
              "max_gen_tokens": e.max_gen_tokens, "add_bos": e.add_bos,
              "include_path": e.include_path, "log_samples": e.log_samples}
    # JSON is YAML, which is how eval_cli reads a dotlist value ("null", "[\"a\", \"b\"]").
    return [f"eval.{key}={json.dumps(value)}" for key, value in values.items()] + [
        f"distributed.dp_shard={world_size}", "distributed.dp_replicate=1", "distributed.tp=1",
        "distributed.pp=1", "distributed.cp=1", "distributed.ep=1", "distributed.pp_split=[]",
        "distributed.pp_virtual_stages=1"]


def hand_command(app_package: str, ckpt_dir, tasks: List[str]) -> str:
    task_list = "[" + ",".join(tasks) + "]"
    return (f"python -m {app_package}.eval {shlex.quote(str(ckpt_dir))} "
            f"{shlex.quote(f'eval.tasks={task_list}')}")


def code_dir(dump_dir) -> Path:
    """Where the job runs from: stool's snapshot of the run's code, else this checkout."""
    from lingua.config import REPO_ROOT

    snapshot = Path(dump_dir) / "code"
    return snapshot if (snapshot / "lingua").is_dir() else REPO_ROOT


def submit(args, app_package: str, step: int, ckpt_dir) -> Optional[str]:
    """Rank 0: the job id, or None. Never raises: training must not stop for an evaluation."""
    dump_dir, ckpt_dir = Path(args.dump_dir).resolve(), Path(ckpt_dir).resolve()
    tasks = list(args.eval.tasks)
    by_hand = hand_command(app_package, ckpt_dir, tasks)
    marker = pending_marker(dump_dir, step)
    try:
        from lingua.eval import downstream

        if not downstream.missing_tasks(dump_dir, step, tasks):
            logger.info("step %d already has results for %s: no evaluation job", step, tasks)
            return None
        s = job_slurm_args(args.eval.slurm)
        world = s.nodes * s.tasks_per_node
        folder = step_dir(dump_dir, step) / "slurm"
        folder.mkdir(parents=True, exist_ok=True)
        # Before sbatch: a job that starts at once must find the marker to remove.
        marker.touch()
        executor = slurm.make_executor(s, folder, code_dir(dump_dir),
                                       f"{s.job_name or dump_dir.name + '-eval'}-{step}")
        setup = list(executor.parameters.get("setup", []))
        executor.update_parameters(setup=setup + ["unset " + " ".join(LAUNCHER_VARS)])
        job = executor.submit(EvalJob(f"{app_package}.eval", str(ckpt_dir), step,
                                      job_overrides(args, world), s.max_requeues, by_hand))
    except Exception as err:  # sbatch missing or refusing, a full disk: training goes on
        marker.unlink(missing_ok=True)
        logger.warning("the evaluation job of step %d was not submitted (%s: %s). Training goes "
                       "on; evaluate that checkpoint by hand: %s", step, type(err).__name__,
                       " ".join(str(err).split())[:500], by_hand)
        return None
    submitted = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    record = {"step": step, "job_id": str(job.job_id), "submitted": submitted,
              "checkpoint": str(ckpt_dir), "tasks": tasks, "world_size": world,
              "logs": str(folder), "by_hand": by_hand}
    path = step_dir(dump_dir, step) / JOB_FILE
    tmp = path.with_name(f".{JOB_FILE}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        logger.warning("could not write %s: %s", path, err)
    logger.info("step %d: evaluation job %s submitted (%s); logs in %s", step, job.job_id,
                ", ".join(tasks), folder)
    return str(job.job_id)


def decide(code: int, signals: List[int], restarts: int, max_requeues: int) -> str:
    """"done", "stop" (SIGTERM: Slurm requeues or cancels the job), "requeue" or "give_up"."""
    if code == 0:
        return "done"
    if signal.SIGTERM in signals:
        return "stop"
    if code == EXIT_CONFIG and signal.SIGUSR2 not in signals:
        return "give_up"
    return "requeue" if restarts < max_requeues else "give_up"


class EvalJob:
    """Each task of an evaluation job: the evaluation as a child process, then `decide`."""

    def __init__(self, module: str, ckpt_dir: str, step: int, overrides: List[str],
                 max_requeues: int, by_hand: str):
        self.module, self.ckpt_dir, self.step = module, ckpt_dir, step
        self.overrides, self.max_requeues, self.by_hand = list(overrides), max_requeues, by_hand

    @property
    def dump_dir(self) -> Path:
        return Path(self.ckpt_dir).parent.parent

    def __call__(self) -> None:
        from lingua.parallel import distributed
        from lingua.train import preemption

        distributed.adopt_launcher_vars()
        rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        restarts = preemption.requeues_so_far()
        received: List[int] = []
        child = None

        def on_signal(signum, frame):  # replaces submitit's handlers (USR2 would requeue as-is)
            received.append(signum)
            os.write(2, f"eval job: got {signal.Signals(signum).name}, stopping the "
                        f"evaluation\n".encode())
            if child is not None:
                child.send_signal(signal.SIGTERM)

        for signum in (signal.SIGTERM, signal.SIGUSR2):
            signal.signal(signum, on_signal)
        command = [sys.executable, "-m", self.module, self.ckpt_dir, *self.overrides]
        child = subprocess.Popen(command)
        print(f"eval job: step {self.step}, rank {rank} of {world}, attempt {restarts + 1} "
              f"(eval.slurm.max_requeues={self.max_requeues}): process {child.pid} runs "
              f"{shlex.join(command[1:])}", flush=True)
        code = child.wait()
        action = decide(code, received, restarts, self.max_requeues)
        print(f"eval job: rank {rank}: the evaluation exited with {code}: {action}", flush=True)
        if action == "done":
            if rank == "0":
                pending_marker(self.dump_dir, self.step).unlink(missing_ok=True)
            distributed.exit_process(0)
        if action in ("requeue", "give_up") and self._first_to_act(restarts):
            if action == "requeue" and not self._requeue(restarts):
                action = "give_up"
            if action == "give_up":
                pending_marker(self.dump_dir, self.step).unlink(missing_ok=True)
                why = ("a configuration error" if code == EXIT_CONFIG else
                       f"exit code {code} after {restarts} requeue(s) (eval.slurm.max_requeues="
                       f"{self.max_requeues})")
                print(f"eval job: giving up on step {self.step}: {why}. Its checkpoint may now "
                      f"be pruned (checkpoint.keep). Evaluate it by hand: {self.by_hand}",
                      file=sys.stderr, flush=True)
        distributed.exit_process(preemption.EXIT_STOPPED if action == "stop"
                                 else (code if code > 0 else 1))

    def _first_to_act(self, restarts: int) -> bool:
        """Several tasks may fail together: one of them requeues (or gives up) for the job."""
        job_id = os.environ.get("SLURM_JOB_ID", "local")
        claim = step_dir(self.dump_dir, self.step) / "slurm" / f".decided-{job_id}-{restarts}"
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def _requeue(self, restarts: int) -> bool:
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            return False
        # Said first: the requeue ends this job's tasks, this process with them, at once.
        print(f"eval job: requeueing job {job_id} (requeue {restarts + 1} of at most "
              f"{self.max_requeues}); it evaluates step {self.step} again", flush=True)
        try:
            proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True,
                                  text=True, timeout=60)
            problem = proc.stderr.strip() if proc.returncode else None
        except (OSError, subprocess.SubprocessError) as err:  # no scontrol, a hung controller
            problem = f"{type(err).__name__}: {err}"
        if problem is not None:
            print(f"eval job: `scontrol requeue {job_id}` failed: {problem}", file=sys.stderr,
                  flush=True)
        return problem is None


class AsyncEvalHook(Hook):
    """eval.mode=async in the loop: a complete checkpoint of an evaluation step gets its job."""

    def __init__(self, args, app_package: str):
        self.args, self.app_package = args, app_package

    def after_save(self, view, step: int) -> None:
        e = self.args.eval
        if e.tasks and e.mode == "async" and evaluates_at(self.args, step) and view.env.is_main:
            # a job evaluates the checkpoint; training goes on
            submit(self.args, self.app_package, step,
                   checkpoint.checkpoints_dir(self.args.dump_dir) / str(step))
