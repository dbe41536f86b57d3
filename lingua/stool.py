"""stool: submit any app's training run to Slurm in one command, through submitit.

    stool apps.llama.train config=llama_8b dump_dir=/checkpoints/me/8b \\
        slurm.nodes=8 slurm.gpus_per_node=8 slurm.partition=learn    # 8 tasks a node, one per GPU
    stool apps.llama.train slurm.dry_run=true ...           # print the batch script, submit nothing
    stool apps.llama.train --multirun optim.lr=1e-3,3e-3    # one job per value, as one job array
    python -m lingua.stool ...                              # the same without the console script

Before anything is written or queued, the config is composed and validated exactly as the job will
(the app module's `load_config`), for the job's world size (`slurm.nodes` x `slurm.tasks_per_node`)
and device, so a typo fails in a second instead of after hours in the queue. Then stool:
  1. copies the code (git's tracked files and untracked files git does not ignore) to
     `<dump_dir>/code`; the job runs from there, so editing the checkout changes neither queued
     nor requeued jobs;
  2. writes `<dump_dir>/config.yaml`;
  3. submits through submitit: one task per process (on GPU jobs one per GPU), ranks from Slurm,
     `--signal=USR2@<delay>` before the time limit (the job checkpoints and requeues itself:
     lingua/preemption.py), `srun --kill-on-bad-exit=1`;
  4. prints the job id, the dump dir and the log paths.

Config values never pass through a shell: the overrides reach the job pickled, and the batch
script holds only quoted paths. The environment reaches the job through Slurm (sbatch exports it),
never through a file of ours, so secrets such as WANDB_API_KEY are not written to the dump dir.
"""

import contextlib
import importlib
import itertools
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from lingua.errors import ConfigError

logger = logging.getLogger("stool")


@dataclass
class SlurmArgs:
    """The `slurm.*` group: read by stool when submitting (max_requeues also by the job)."""
    nodes: int = 1
    # Processes per node, each driving one GPU. 0: one per GPU on GPU jobs, 1 on CPU jobs (a
    # default of 1 left 7 of 8 GPUs idle without a word). stool fills it in before validating.
    tasks_per_node: int = 0
    gpus_per_node: int = 0
    # 0: GPU_JOB_CPUS per task on GPU jobs (the cluster default is often 1 CPU a task, which
    # starves data loading and the Python process), the cluster's default on CPU jobs.
    cpus_per_task: int = 0
    mem: Optional[str] = None           # per node, Slurm's syntax ("64G"; "0" = all of it)
    partition: Optional[str] = None
    qos: Optional[str] = None
    account: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None       # nodes to avoid, e.g. "node[01-03]"
    # Slurm's workload characterization key. Empty: no --wckey (Slurm uses your default one);
    # submitit alone would send --wckey=submitit, which clusters that enforce wckeys refuse.
    wckey: str = ""
    time: int = 1440                    # minutes
    signal_delay_s: int = 120           # USR2 this long before the limit: checkpoint, requeue
    max_requeues: int = 5               # time-limit requeues before the job gives up
    job_name: Optional[str] = None      # default: the dump_dir's name
    dry_run: bool = False               # print the batch script, write and submit nothing
    reuse_dump_dir: bool = False        # allow a dump_dir whose config.yaml holds another config


MEM = re.compile(r"^\d+[KMGT]?$")
WCKEY = re.compile(r"^[A-Za-z0-9._+-]+$")
# CPUs per task a GPU job asks for when slurm.cpus_per_task is left at 0: enough for the Python
# process and a few loader threads, and what nearly every GPU node has per GPU (8-GPU nodes have
# 64 to 224 CPUs). Lower it, or raise it, with slurm.cpus_per_task.
GPU_JOB_CPUS = 8


def slurm_defaults(s: SlurmArgs) -> List[str]:
    """Overrides that fill in the slurm.* values left at 0 ("stool picks"), so that the world size
    stool validates with, config.yaml and the config the job composes all hold the real numbers."""
    fills = []
    if s.tasks_per_node == 0:
        fills.append(f"slurm.tasks_per_node={max(s.gpus_per_node, 1)}")
    if s.cpus_per_task == 0 and s.gpus_per_node > 0:
        fills.append(f"slurm.cpus_per_task={GPU_JOB_CPUS}")
    return fills


def validate_slurm_args(s: SlurmArgs) -> None:
    for name in ("nodes", "time"):
        if getattr(s, name) < 1:
            raise ConfigError(f"slurm.{name}={getattr(s, name)} must be at least 1.")
    for name in ("tasks_per_node", "gpus_per_node", "cpus_per_task", "signal_delay_s",
                 "max_requeues"):
        if getattr(s, name) < 0:
            raise ConfigError(f"slurm.{name}={getattr(s, name)} must not be negative.")
    if s.signal_delay_s >= s.time * 60:
        raise ConfigError(f"slurm.signal_delay_s={s.signal_delay_s} is not shorter than "
                          f"slurm.time={s.time} minutes: the job would be told to stop as it "
                          f"starts. Lower slurm.signal_delay_s or raise slurm.time.")
    if s.mem is not None and not MEM.match(str(s.mem)):
        raise ConfigError(f"slurm.mem={s.mem!r} is not Slurm's memory syntax: give a number with "
                          f"an optional K/M/G/T suffix, e.g. slurm.mem=64G (0 asks for all of a "
                          f"node's memory).")
    if s.wckey and not WCKEY.match(str(s.wckey)):
        raise ConfigError(f"slurm.wckey={s.wckey!r} is not a wckey name: give one word of "
                          f"letters, digits, '.', '_', '+' or '-' (`sacctmgr show user $USER "
                          f"withwckeys` lists yours), or leave slurm.wckey out to use your "
                          f"default wckey.")
    if s.gpus_per_node and s.tasks_per_node > s.gpus_per_node:
        raise ConfigError(f"slurm.tasks_per_node={s.tasks_per_node} is more than "
                          f"slurm.gpus_per_node={s.gpus_per_node}: each process drives one GPU. "
                          f"Set slurm.tasks_per_node to the number of GPUs per node, or leave it "
                          f"out (one task per GPU).")
    if s.gpus_per_node and 0 < s.tasks_per_node < s.gpus_per_node:
        idle = s.gpus_per_node - s.tasks_per_node
        raise ConfigError(f"slurm.tasks_per_node={s.tasks_per_node} with "
                          f"slurm.gpus_per_node={s.gpus_per_node} leaves {idle} GPU(s) of each "
                          f"node idle: each process drives one GPU (cuda:LOCAL_RANK). Leave "
                          f"slurm.tasks_per_node out (one task per GPU), or ask for "
                          f"slurm.gpus_per_node={s.tasks_per_node}.")


# ---------------------------------------------------------------------------------------------
# Inside the job


class TrainJob:
    """What each Slurm task runs (submitit pickles it): the app's main() with the overrides."""

    def __init__(self, module: str, overrides: List[str]):
        self.module = module
        self.overrides = list(overrides)

    def __call__(self) -> int:
        from lingua import distributed, preemption

        # Before anything slow: from here on USR2/TERM mean "save at the next step, then stop";
        # this replaces submitit's handler, which would checkpoint on rank 0 alone.
        preemption.SIGNALS.listen()
        distributed.adopt_launcher_vars()
        app = importlib.import_module(self.module)
        print(f"stool job: {self.module} from {Path(app.__file__).resolve().parent}, rank "
              f"{os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')}, "
              f"requeues so far {preemption.requeues_so_far()}", flush=True)
        from lingua.errors import RunError

        try:
            code = app.main(self.overrides)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            code = 2
        except RunError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            code = 1
        from lingua.trainer import EXIT_STOPPED

        if code == EXIT_STOPPED and os.environ.get("RANK", "0") != "0":
            # Stopped on a signal with everything saved. The tasks run under srun
            # --kill-on-bad-exit=1, where any non-zero exit ends the whole step at once: this
            # rank's 3 could kill rank 0 before it has requeued the job. Rank 0 reports the stop
            # (srun's exit code is the highest of its tasks': 3).
            code = 0
        # As exit_cli does (distributed.exit_process says why). submitit's result file is not
        # needed: the run directory is the record.
        distributed.exit_process(code)


# ---------------------------------------------------------------------------------------------
# Submitting


@dataclass
class Submission:
    """One job (or one task of a job array): its overrides, validated args and dump dir."""
    overrides: List[str]
    args: object
    dump_dir: Path
    filled: List[str] = field(default_factory=list)    # the slurm.* values stool picked


def hydra_quote(value) -> str:
    """A value as one quoted Hydra override token, whatever characters it holds. Hydra's escapes:
    \\' is a quote, and only backslashes before a quote or the closing quote are doubled."""
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, str(value))
    return "'" + text.replace("'", "\\'") + "'"


@contextlib.contextmanager
def job_view(world_size: int, device: str):
    """Validate as the job will see things: its world size and device, not this login node's."""
    from lingua.distributed import JOB_DEVICE_VAR

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


def import_app(module: str):
    # A console script does not put the checkout on sys.path; a forked app (apps/myarch) may not
    # be installed: look where stool is run from, then in the checkout lingua comes from.
    from lingua.config import REPO_ROOT

    for path in (str(REPO_ROOT), os.getcwd()):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        app = importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ConfigError(f"Cannot import the app module {module!r} ({err}). Give a train "
                          f"module as for `python -m`, e.g. `stool apps.llama.train ...`, from "
                          f"the repository root.") from None
    if not (hasattr(app, "load_config") and hasattr(app, "main")):
        raise ConfigError(f"{module} is not a lingua train module: it needs load_config(argv) "
                          f"and main(argv) (see apps/llama/train.py). Give e.g. apps.llama.train.")
    return app


def sweep_overrides(overrides: List[str]) -> tuple:
    """Hydra's sweep syntax (`optim.lr=1e-3,3e-3`, `range(...)`, `choice(...)`) to one override
    list per combination (the cartesian product, in Hydra's order), and the swept positions."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # Hydra raises its own OverrideParseException
        raise ConfigError(f"Cannot parse the overrides for --multirun: {err}") from None
    choices, swept = [], []
    for i, override in enumerate(parsed):
        key = override.get_key_element()
        if override.is_sweep_override():
            swept.append(i)
            choices.append([f"{key}={v}" for v in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(combo) for combo in itertools.product(*choices)], swept


def run_name(sweep_part: List[str]) -> str:
    """A directory name from a combination's swept overrides: `optim.lr=0.001,seed=1`."""
    text = ",".join(sweep_part)
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text)[:200] or "run"


PATH_KEYS = ("dump_dir", "data.root", "data.tokenizer.path", "checkpoint.init_from")


def _get(args, dotted: str):
    for part in dotted.split("."):
        args = getattr(args, part)
    return args


def absolute_paths(args) -> List[str]:
    """Overrides that make the config's relative paths absolute: the job runs from the snapshot
    (`<dump_dir>/code`), not from where stool was called."""
    fixes = []
    for key in PATH_KEYS:
        value = _get(args, key)
        if value and not Path(value).is_absolute():
            fixes.append(f"{key}={hydra_quote(Path(value).resolve())}")
    return fixes


def compose(app, overrides: List[str]):
    """The validated args for these overrides, checked for the job's world size and device.
    slurm.* values left at 0 must be filled in first (`slurm_defaults`; `plan` does it)."""
    raw = app.load_config(overrides, check=False)
    validate_slurm_args(raw.slurm)
    if raw.slurm.tasks_per_node == 0:
        raise ValueError("compose() needs slurm_defaults() applied first")
    world = raw.slurm.nodes * raw.slurm.tasks_per_node
    with job_view(world, "cuda" if raw.slurm.gpus_per_node else "cpu"):
        return app.load_config(overrides)


def plan(app, overrides: List[str], multirun: bool) -> List[Submission]:
    """Every job to submit, all validated before anything is written."""
    combos, swept = sweep_overrides(overrides) if multirun else ([list(overrides)], [])
    swept_keys = {combos[0][i].split("=", 1)[0] for i in swept}
    name_runs = len(combos) > 1 and "dump_dir" not in swept_keys
    if name_runs:  # each combination gets <dump_dir>/<its swept values>
        base = app.load_config([o for i, o in enumerate(overrides) if i not in swept],
                               check=False)
    submissions = []
    for combo in combos:
        combo = list(combo)
        if name_runs:
            named = [combo[i] for i in swept]
            combo.append(f"dump_dir={hydra_quote(Path(base.dump_dir) / run_name(named))}")
        raw = app.load_config(combo, check=False)
        validate_slurm_args(raw.slurm)
        filled = slurm_defaults(raw.slurm)
        combo += absolute_paths(raw) + filled
        args = compose(app, combo)
        submissions.append(Submission(combo, args, Path(args.dump_dir), filled))
    dirs = [s.dump_dir for s in submissions]
    if len(set(dirs)) != len(dirs):
        raise ConfigError("Two jobs of this sweep would share a dump_dir: sweep dump_dir with as "
                          "many values as the other keys, or leave it out and let stool name "
                          "each run after its values.")
    from lingua import config

    # One executor submits the whole array, so its slurm.* values are the first run's; only the
    # keys each run reads for itself (the job reads max_requeues) may differ.
    per_run = ("max_requeues", "reuse_dump_dir")
    first = config.to_dict(submissions[0].args)["slurm"]
    for sub in submissions[1:]:
        other = config.to_dict(sub.args)["slurm"]
        differ = sorted(k for k in first if k not in per_run and first[k] != other[k])
        if differ:
            raise ConfigError(f"A sweep is submitted as one job array, with one set of slurm.* "
                              f"values, but slurm.{differ[0]} differs between its runs "
                              f"({first[differ[0]]!r}, {other[differ[0]]!r}). Sweep only "
                              f"non-slurm keys, and run stool once per slurm.* setting.")
    return submissions


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def check_dump_dir(sub: Submission) -> None:
    """Refuse a dump_dir that already holds another run's config (unless slurm.reuse_dump_dir)."""
    from omegaconf import OmegaConf

    from lingua import config

    existing = sub.dump_dir / "config.yaml"
    if not existing.is_file() or sub.args.slurm.reuse_dump_dir:
        return
    try:
        old = OmegaConf.to_container(OmegaConf.load(existing), resolve=True)
    except Exception as err:
        raise ConfigError(f"{existing} cannot be read ({err}). Use another dump_dir, or pass "
                          f"slurm.reuse_dump_dir=true to replace it.") from None
    old, new = _flat(old), _flat(config.to_dict(sub.args))
    differ = sorted(k for k in set(old) | set(new)
                    if not k.startswith("slurm.") and old.get(k, "<absent>") != new.get(k, "<absent>"))
    if differ:
        shown = ", ".join(f"{k} ({old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r})"
                          for k in differ[:8])
        raise ConfigError(f"dump_dir {sub.dump_dir} holds a run with another config: {shown}"
                          f"{' ...' if len(differ) > 8 else ''}. A job there would resume or "
                          f"overwrite that run. Use a new dump_dir, or pass "
                          f"slurm.reuse_dump_dir=true if replacing its config is what you mean.")


def check_partition(partition: Optional[str]) -> None:
    """An unknown partition fails here, with the cluster's list, not as a bare sbatch error."""
    if partition is None or shutil.which("sinfo") is None:
        return
    result = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        return  # sbatch will say what is wrong
    known = sorted(set(result.stdout.split()))
    if partition not in known:
        raise ConfigError(f"slurm.partition={partition!r} does not exist on this cluster. Its "
                          f"partitions are: {', '.join(known) or 'none'} (from `sinfo`). Pick one "
                          f"of them, or leave slurm.partition out for the default.")


def snapshot_code(dest: Path) -> int:
    """Copy the checkout's code into dest (replacing an older snapshot); returns the file count.
    The copy is made beside dest and renamed into place, so a job never sees half a snapshot."""
    from lingua.config import REPO_ROOT

    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True)
    if listed.returncode == 0:
        files = [f for f in listed.stdout.decode().split("\0") if f]
    else:  # not a git checkout (an unpacked release): the package, apps and configs
        files = [str(p.relative_to(REPO_ROOT)) for top in ("lingua", "apps", "configs", "setup")
                 for p in (REPO_ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    tmp = dest.with_name(f".{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
    count = 0
    for rel in files:
        src = REPO_ROOT / rel
        if not src.is_file():  # deleted in the working tree but still tracked
            continue
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        count += 1
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, dest)
    return count


def make_executor(slurm: SlurmArgs, folder: Path, code_dir: Path, job_name: str):
    import submitit

    executor_class = submitit.SlurmExecutor
    if slurm.dry_run:
        # submitit refuses to build an executor where srun is missing, but a dry run only prints
        # the batch script, which a laptop or a login node without Slurm can do.
        class ScriptOnlyExecutor(submitit.SlurmExecutor):
            @classmethod
            def affinity(cls) -> int:
                return 1

        executor_class = ScriptOnlyExecutor
    executor = executor_class(folder=folder, python=shlex.quote(sys.executable))
    extra = {"requeue": True}
    if slurm.mem is not None:
        extra["mem"] = str(slurm.mem)   # as given: submitit's own mem option converts from GB
    setup = [f"cd {shlex.quote(str(code_dir))}", f"export PYTHONPATH={shlex.quote(str(code_dir))}"]
    params = dict(job_name=job_name, nodes=slurm.nodes, ntasks_per_node=slurm.tasks_per_node,
                  time=slurm.time, signal_delay_s=slurm.signal_delay_s, setup=setup,
                  additional_parameters=extra,
                  # submitit writes --wckey=submitit unless told otherwise; None writes no line.
                  wckey=slurm.wckey or None,
                  # One crashed rank ends the step now, not after the NCCL timeout with the
                  # others blocked in a collective (TrainJob exits 0 on a clean stop for this).
                  srun_args=["--kill-on-bad-exit=1"])
    if slurm.gpus_per_node:
        params["gpus_per_node"] = slurm.gpus_per_node
    if slurm.cpus_per_task:
        params["cpus_per_task"] = slurm.cpus_per_task
        # Slurm 22.05 to 23.02: srun no longer takes --cpus-per-task from the job, so each task
        # would get one CPU. SRUN_CPUS_PER_TASK is what srun reads there; others ignore it.
        setup.append(f"export SRUN_CPUS_PER_TASK=${{SLURM_CPUS_PER_TASK:-{slurm.cpus_per_task}}}")
    for name in ("partition", "qos", "account", "constraint", "exclude"):
        if getattr(slurm, name) is not None:
            params[name] = str(getattr(slurm, name))
    executor.update_parameters(**params)
    return executor


def batch_script(executor, array_size: int) -> str:
    """The sbatch script submitit will write (submitit has no public call for it)."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = dict(executor.parameters)
    if array_size > 1:
        params["map_count"] = array_size
    return _make_sbatch_string(command=executor._submitit_command_str, folder=executor.folder,
                               **params)


def log_paths(job, n_tasks: int) -> List[str]:
    paths = [str(job.paths.stdout), str(job.paths.stderr)]
    if n_tasks > 1:  # one pair per task: <job>_<rank>_log.out
        paths.append(str(job.paths.stdout).replace(f"_{job.paths.task_id}_log", "_<rank>_log"))
    return paths


def dry_run_plan(module: str, sub, sweep: bool) -> str:
    """lingua.plan's per-rank memory and time for the job, as comment lines of the dry run: the
    model built and parallelised at the job's world size on the fake process group."""
    from lingua import plan as planner

    s = sub.args.slurm
    world = s.nodes * s.tasks_per_node
    device = "cuda" if s.gpus_per_node else "cpu"
    try:
        text = planner.report_text(module, sub.overrides, world, device_type=device)
    except Exception as err:  # the plan informs; the config itself was validated above
        text = f"the plan could not be made: {type(err).__name__}: {err}"
    header = f"plan at {world} processes ({device})" + (", first run of the sweep" if sweep else "")
    return "\n".join(f"# {line}".rstrip() for line in [header, *text.splitlines()])


def submit(module: str, overrides: List[str], multirun: bool = False) -> list:
    """Validate, snapshot, write config.yaml and submit; returns the submitit jobs ([] on dry run)."""
    from lingua import config

    app = import_app(module)
    submissions = plan(app, overrides, multirun)
    first = submissions[0].args
    slurm = first.slurm
    sweep = len(submissions) > 1
    root = submissions[0].dump_dir.parent if sweep else submissions[0].dump_dir
    code_dir, folder = root / "code", root / "slurm"
    job_name = slurm.job_name or root.name or "lingua"
    if not slurm.dry_run and shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on PATH: stool submits to Slurm. Run on a cluster's login "
                          "node, start a local one with `bash setup/slurm_local.sh start`, or train "
                          "without Slurm: `torchrun --nproc-per-node N -m " + module + " ...`.")
    executor = make_executor(slurm, folder, code_dir, job_name)
    if slurm.dry_run:
        print(batch_script(executor, len(submissions)))
        for sub in submissions:
            print(f"# would run: {module} {' '.join(shlex.quote(o) for o in sub.overrides)}")
            print(f"#   dump dir: {sub.dump_dir}")
        print(dry_run_plan(module, submissions[0], sweep))
        print("# dry run: nothing written, nothing submitted")
        return []
    check_partition(slurm.partition)
    for sub in submissions:
        check_dump_dir(sub)

    n_files = snapshot_code(_mkdir(code_dir))
    for sub in submissions:
        config.dump(sub.args, sub.dump_dir / "config.yaml")
    from submitit.core.utils import FailedJobError

    try:
        with executor.batch() if sweep else contextlib.nullcontext():
            jobs = [executor.submit(TrainJob(module, sub.overrides)) for sub in submissions]
    except FailedJobError as err:
        chosen = submissions[0].filled if slurm.gpus_per_node else []  # CPU jobs: 1 task, as ever
        hint = (f" stool chose {', '.join(chosen)} (slurm.* left at 0); if the nodes have fewer "
                f"CPUs or GPUs, set those keys." if chosen else "")
        raise ConfigError(f"Slurm refused the job: {str(err).strip()}\nCheck the slurm.* values "
                          f"(partition, account, qos, time, resources) against `sinfo` and your "
                          f"cluster's limits.{hint} The dump dir holds the config and the code "
                          f"snapshot; nothing else was changed.") from None
    n_tasks = slurm.nodes * slurm.tasks_per_node
    print(f"code snapshot: {code_dir} ({n_files} files)")
    for job, sub in zip(jobs, submissions):
        print(f"submitted job {job.job_id}: {module}, {n_tasks} task(s) on {slurm.nodes} node(s)")
        print(f"  dump dir: {sub.dump_dir}")
        for path in log_paths(job, n_tasks):
            print(f"  log: {path}")
    return jobs


def _mkdir(code_dir: Path) -> Path:
    code_dir.parent.mkdir(parents=True, exist_ok=True)
    return code_dir


def parse_cli(argv: List[str]) -> tuple:
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("-") or "=" in argv[0]:
        raise ConfigError("usage: stool <app train module> [--multirun] [key=value ...], e.g. "
                          "`stool apps.llama.train config=llama_1b slurm.nodes=2 "
                          "slurm.gpus_per_node=8` (one task per GPU). See the README, "
                          "'Running on Slurm'.")
    module, rest = argv[0], argv[1:]
    multirun = any(a in ("--multirun", "-m") for a in rest)
    return module, [a for a in rest if a not in ("--multirun", "-m")], multirun


def cli(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        module, overrides, multirun = parse_cli(sys.argv[1:] if argv is None else argv)
        submit(module, overrides, multirun)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
