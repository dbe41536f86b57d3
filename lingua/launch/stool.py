"""stool: submit any app's training run to Slurm in one command, through submitit (docs/slurm.md).
The config is validated as the job will see it (its world size and device): a typo fails in a
second, not after hours in the queue. The job runs from a code snapshot in `<dump_dir>/code`:
editing the checkout changes no queued or requeued job. Config values never pass through a shell
(they reach the job pickled), the environment goes through sbatch, never a file (no secrets)."""

import contextlib
import dataclasses
import functools
import importlib
import itertools
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from lingua import config
from lingua.config import REPO_ROOT
from lingua.errors import ConfigError, RunError
from lingua.launch.slurm import check_resources, make_executor, slurm_defaults, validate_slurm_args
from lingua.train import preemption

STOP_GRACE_S = 5     # how long rank 0 of a stopped multi-rank job waits for its peers to exit


class TrainJob:
    """What each Slurm task runs (submitit pickles it): the app's main() with the overrides."""

    def __init__(self, module: str, overrides: List[str], lighthouse: Optional[tuple] = None):
        self.module = module
        self.overrides = list(overrides)
        self.lighthouse = lighthouse   # (address file, wait s) of stool's lighthouse job, or None

    def __call__(self) -> int:
        # Before importing torch: Slurm's USR2 may come during start-up, where submitit's handler
        # (replaced here) would end rank 0 with 1. From here on USR2/TERM mean "save, then stop".
        preemption.SIGNALS.listen()
        from lingua.parallel import distributed

        distributed.adopt_launcher_vars()
        app = importlib.import_module(self.module)
        if self.lighthouse:   # the address stool's lighthouse job writes ('' is refused by name)
            from lingua.parallel.fault_tolerance import read_address

            address = hydra_quote(read_address(*self.lighthouse))
            self.overrides.append(f"fault_tolerance.lighthouse={address}")
        print(f"stool job: {self.module} from {Path(app.__file__).resolve().parent}, rank "
              f"{os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')}, "
              f"requeues so far {preemption.requeues_so_far()}", flush=True)
        try:
            code = app.main(self.overrides)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            code = 2
        except RunError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            code = 1
        if code == preemption.EXIT_STOPPED and os.environ.get("RANK", "0") != "0":
            # Stopped and saved. Under srun --kill-on-bad-exit=1 this rank's 3 could kill rank 0
            # before it has requeued the job: rank 0 alone reports the stop.
            code = 0
        elif (code == preemption.EXIT_STOPPED and preemption.SIGNALS.job_ends
              and int(os.environ.get("WORLD_SIZE", "1")) > 1):
            # Rank 0's 3 is the job's exit code: leaving while a peer still tears down, srun
            # would kill that peer and report 1. So rank 0 leaves last.
            wait_for_peers(STOP_GRACE_S)
        distributed.exit_process(code)   # as exit_cli does; submitit's result file is not needed


def wait_for_peers(limit_s: float) -> None:
    """Until this node's other tasks have exited, at most limit_s (other nodes' cannot be seen
    from here, so then the whole)."""
    parent = os.getppid()
    children = Path(f"/proc/{parent}/task/{parent}/children")
    one_node = os.environ.get("SLURM_NNODES", "1") == "1" and children.is_file()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if one_node and children.read_text().split() == [str(os.getpid())]:
            return
        time.sleep(0.1)


@dataclass
class Submission:
    overrides: List[str]
    args: object
    dump_dir: Path
    filled: List[str] = field(default_factory=list)    # the slurm.* values stool picked


def hydra_quote(value) -> str:
    """A value as one quoted Hydra override token, whatever characters it holds. Hydra's escapes:
    \\' is a quote, and only backslashes before a quote or the closing quote are doubled."""
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, str(value))
    return "'" + text.replace("'", "\\'") + "'"


# A path Hydra reads as itself unquoted: words of these characters with a '/' among them (so not
# `null`, `true` or a number), inner spaces allowed. Anything else is quoted.
PLAIN_PATH = re.compile(r"^(?=.*/)[A-Za-z0-9_./-]+(?: +[A-Za-z0-9_./-]+)*$")


def path_override(key: str, path) -> str:
    """`key=path` as Hydra reads it, quoted only where Hydra needs it (the user sees it)."""
    text = str(path)
    return f"{key}={text if PLAIN_PATH.match(text) else hydra_quote(text)}"


# Characters a shell expands inside double quotes ('!' too, in an interactive bash).
DOUBLE_QUOTE_SPECIAL = re.compile(r'["$`\\!]')


def shell_join(argv: List[str]) -> str:
    """argv as a person would type it: double quotes around Hydra's quoted values where a shell
    expands nothing there; shlex.quote's '"'"' only where neither will do."""
    return " ".join(f'"{arg}"' if "'" in arg and not DOUBLE_QUOTE_SPECIAL.search(arg)
                    else shlex.quote(arg) for arg in argv)


def sweep_overrides(overrides: List[str]) -> tuple:
    """One override list per combination of Hydra's sweep syntax, and the swept positions."""
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


def absolute_paths(args) -> List[str]:
    """Relative paths made absolute: the job runs from the snapshot, not from where stool was."""
    fixes = []
    for key in PATH_KEYS:
        value = functools.reduce(getattr, key.split("."), args)
        if value and not Path(value).is_absolute():
            fixes.append(path_override(key, Path(value).resolve()))
    return fixes


def compose(app, overrides: List[str]):
    """Validated for the job's world size and device; needs `slurm_defaults` applied first."""
    # Not at the top: a job unpickles this module and must listen for signals before torch loads.
    from lingua.parallel import distributed

    raw = app.load_config(overrides, check=False)
    validate_slurm_args(raw.slurm)
    if raw.slurm.tasks_per_node == 0:
        raise ValueError("compose() needs slurm_defaults() applied first")
    world = raw.slurm.nodes * raw.slurm.tasks_per_node
    with distributed.job_view(world, "cuda" if raw.slurm.gpus_per_node else "cpu"):
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
        if name_runs:
            named = [combo[i] for i in swept]
            combo.append(path_override("dump_dir", Path(base.dump_dir) / run_name(named)))
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

    existing = sub.dump_dir / "config.yaml"
    if not existing.is_file() or sub.args.slurm.reuse_dump_dir:
        return
    try:
        old = OmegaConf.to_container(OmegaConf.load(existing), resolve=True)
    except Exception as err:
        raise ConfigError(f"{existing} cannot be read ({err}). Use another dump_dir, or pass "
                          f"slurm.reuse_dump_dir=true to replace it.") from None
    old, new = _flat(old), _flat(config.to_dict(sub.args))
    # The lighthouse address is each run's own (a group's job writes it into config.yaml).
    differ = sorted(k for k in set(old) | set(new) if not k.startswith("slurm.")
                    and k != "fault_tolerance.lighthouse"
                    and old.get(k, "<absent>") != new.get(k, "<absent>"))
    if differ:
        shown = ", ".join(f"{k} ({old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r})"
                          for k in differ[:8])
        raise ConfigError(f"dump_dir {sub.dump_dir} holds a run with another config: {shown}"
                          f"{' ...' if len(differ) > 8 else ''}. A job there would resume or "
                          f"overwrite that run. Use a new dump_dir, or pass "
                          f"slurm.reuse_dump_dir=true if replacing its config is what you mean.")


def snapshot_code(dest: Path) -> int:
    """Made beside dest and renamed into place, so a job never sees half a snapshot."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO_ROOT, capture_output=True)
    if listed.returncode == 0:
        files = [f for f in listed.stdout.decode().split("\0") if f]
    else:  # not a git checkout (an unpacked release): the package, apps and configs
        files = [str(p.relative_to(REPO_ROOT)) for top in ("lingua", "apps", "configs", "setup")
                 for p in (REPO_ROOT / top).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts]
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
    old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
    if dest.exists():
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
    return count


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


def accounting_enabled() -> Optional[bool]:
    """Whether this cluster keeps finished jobs for sacct (None: cannot tell)."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"^AccountingStorageType\s*=\s*(\S+)", out, re.M)
    return None if match is None else match.group(1) != "accounting_storage/none"


def status_hint(job_ids: List[str]) -> str:
    """sacct where the cluster has accounting; without, Slurm forgets a job after MinJobAge."""
    ids = ",".join(dict.fromkeys(str(j).split("_")[0] for j in job_ids))  # an array: its id
    if accounting_enabled() is False:
        return (f"  follow it: squeue -j {ids}; scontrol show job {ids} (this cluster has no "
                f"accounting, so no sacct: Slurm forgets a finished job after MinJobAge, and the "
                f"dump dir with its slurm/ logs is the record)")
    return f"  follow it: squeue -j {ids} (queued, running); sacct -j {ids} (also once it ended)"


def job_overrides(sub) -> List[str]:
    """The overrides the job would get: the dry run's own switch left out."""
    return [o for o in sub.overrides if o.lstrip("+").split("=", 1)[0] != "slurm.dry_run"]


def dry_run_plan(module: str, sub, sweep: bool) -> str:
    """lingua.launch.plan's per-rank memory and time, as comment lines of the dry run."""
    from lingua.launch import plan as planner

    s = sub.args.slurm
    world = s.nodes * s.tasks_per_node
    device = "cuda" if s.gpus_per_node else "cpu"
    try:
        text = planner.report_text(module, sub.overrides, world, device_type=device)
    except Exception as err:  # the plan informs; the config itself was validated above
        text = f"the plan could not be made: {type(err).__name__}: {err}"
    header = f"plan at {world} processes ({device})" + (", first run of the sweep" if sweep else "")
    return "\n".join(f"# {line}".rstrip() for line in [header, *text.splitlines()])


def plan_run(app, overrides: List[str], multirun: bool) -> tuple:
    """(jobs, run directory or None): with fault_tolerance.enabled, one job per replica group g,
    in <dump_dir>/group_<g>, each validated with its group_id."""
    submissions = plan(app, overrides, multirun)
    ft = [f for f in (getattr(s.args, "fault_tolerance", None) for s in submissions)
          if f is not None and f.enabled]
    if not ft:
        return submissions, None
    if multirun:
        raise ConfigError("stool --multirun with fault_tolerance.enabled=true is not supported "
                          "(each run would need its own lighthouse and replica groups): submit "
                          "one stool command per value.")
    if any(o.lstrip("+").split("=", 1)[0] == "fault_tolerance.group_id" for o in overrides):
        raise ConfigError("fault_tolerance.group_id is given, but stool submits every replica "
                          "group itself (group g as a job of its own, in <dump_dir>/group_<g>) "
                          "and assigns the ids. Leave fault_tolerance.group_id out.")
    root = submissions[0].dump_dir.resolve()
    return [plan(app, [*overrides, f"fault_tolerance.group_id={g}",
                       path_override("dump_dir", root / f"group_{g}")], False)[0]
            for g in range(ft[0].replica_groups)], root


def lighthouse_executor(slurm, folder: Path, code_dir: Path, job_name: str):
    """One CPU, little memory, the groups' time with all their requeues (it ends when they do)."""
    alone = dataclasses.replace(slurm, nodes=1, tasks_per_node=1, gpus_per_node=0,
                                cpus_per_task=1, mem="1G",
                                time=slurm.time * (slurm.max_requeues + 1))
    return make_executor(alone, folder, code_dir, f"{job_name}-lighthouse")


def start_after(executor, job_id: str) -> None:
    extra = dict(executor.parameters["additional_parameters"], dependency=f"after:{job_id}")
    executor.update_parameters(additional_parameters=extra)


def submit_jobs(module: str, submissions: list, executor, lighthouse, root: Path) -> list:
    """The lighthouse job first where stool runs one (the groups start after it), then the
    runs; what was queued is cancelled if Slurm refuses a job."""
    from submitit.core.utils import FailedJobError

    args, jobs = submissions[0].args, []
    try:
        if lighthouse is not None:
            for name in ("lighthouse", "lighthouse_jobs"):   # a previous submission's
                (root / name).unlink(missing_ok=True)
            from lingua.parallel.fault_tolerance import serve_lighthouse

            jobs.append(lighthouse.submit(serve_lighthouse, args.fault_tolerance.min_replicas,
                                          root))
            start_after(executor, jobs[0].job_id)
        found = (root / "lighthouse", args.fault_tolerance.quorum_timeout_s) if lighthouse else None
        with executor.batch() if len(submissions) > 1 else contextlib.nullcontext():
            jobs += [executor.submit(TrainJob(module, sub.overrides, found))
                     for sub in submissions]
    except FailedJobError as err:
        for job in jobs:
            job.cancel(check=False)
        chosen = submissions[0].filled if args.slurm.gpus_per_node else []  # CPU jobs: 1 task
        hint = (f" stool chose {', '.join(chosen)} (slurm.* left at 0); if the nodes have fewer "
                f"CPUs or GPUs, set those keys." if chosen else "")
        raise ConfigError(f"Slurm refused the job: {str(err).strip()}\nCheck the slurm.* values "
                          f"(partition, account, qos, time, resources) against `sinfo` and your "
                          f"cluster's limits.{hint} The dump dir holds the config and the code "
                          f"snapshot; nothing else was changed.") from None
    if lighthouse is not None:   # the lighthouse serves while these are queued
        ids = root / ".lighthouse_jobs.tmp"
        ids.write_text(",".join(dict.fromkeys(str(j.job_id).split("_")[0] for j in jobs[1:])))
        os.replace(ids, root / "lighthouse_jobs")
    return jobs


def submit(module: str, overrides: List[str], multirun: bool = False) -> list:
    """Validate, snapshot, write config.yaml and submit; the submitit jobs ([] on a dry run)."""
    app = config.import_app(module)
    submissions, ft_root = plan_run(app, overrides, multirun)
    slurm = submissions[0].args.slurm
    sweep = len(submissions) > 1
    root = ft_root or (submissions[0].dump_dir.parent if sweep else submissions[0].dump_dir)
    code_dir, folder = root / "code", root / "slurm"
    job_name = slurm.job_name or root.name or "lingua"
    if not slurm.dry_run and shutil.which("sbatch") is None:
        raise ConfigError("sbatch is not on PATH: stool submits to Slurm. Run on a cluster's "
                          "login node, start a local one with `bash setup/slurm_local.sh start`, "
                          "or train without Slurm: `torchrun --nproc-per-node N -m " + module
                          + " ...`.")
    executor = make_executor(slurm, folder, code_dir, job_name)
    # A fault-tolerant run with no lighthouse given gets a lighthouse job of its own.
    lighthouse = (lighthouse_executor(slurm, folder, code_dir, job_name)
                  if ft_root and not submissions[0].args.fault_tolerance.lighthouse else None)
    # Against the cluster's nodes, on a dry run too where sinfo answers.
    checked = check_resources(slurm, submissions[0].filled if slurm.gpus_per_node else [])
    if slurm.dry_run:
        if lighthouse is not None:
            print(batch_script(lighthouse, 1))
            print("# the lighthouse job, above; the replica groups' jobs, below, start after it")
            start_after(executor, "<lighthouse job id>")
        print(batch_script(executor, len(submissions)))
        for sub in submissions:   # as typed in a shell, it runs the job's config here
            print(f"# would run: {shell_join(['python', '-m', module, *job_overrides(sub)])}")
            print(f"#   dump dir: {sub.dump_dir}")
        print(dry_run_plan(module, submissions[0], sweep))
        print("# resources checked against `sinfo`" if checked else
              "# resources not checked: `sinfo` is missing here or did not answer")
        print("# dry run: nothing written, nothing submitted")
        return []
    for sub in submissions:
        check_dump_dir(sub)

    code_dir.parent.mkdir(parents=True, exist_ok=True)
    n_files = snapshot_code(code_dir)
    for sub in submissions:
        config.dump(sub.args, sub.dump_dir / "config.yaml")
    jobs = submit_jobs(module, submissions, executor, lighthouse, root)
    n_tasks = slurm.nodes * slurm.tasks_per_node
    print(f"code snapshot: {code_dir} ({n_files} files)")
    if lighthouse is not None:
        print(f"submitted job {jobs[0].job_id}: the lighthouse of {len(submissions)} replica "
              f"groups, its address in {root / 'lighthouse'}")
    for job, sub in zip(jobs[len(jobs) - len(submissions):], submissions):
        print(f"submitted job {job.job_id}: {module}, {n_tasks} task(s) on {slurm.nodes} node(s)")
        print(f"  dump dir: {sub.dump_dir}")
        for path in log_paths(job, n_tasks):
            print(f"  log: {path}")
    print(status_hint([job.job_id for job in jobs]))
    if ft_root:
        print(f"  cancel the run: scancel {' '.join(str(j.job_id).split('_')[0] for j in jobs)}")
    return jobs


def parse_cli(argv: List[str]) -> tuple:
    if not argv or argv[0] in ("-h", "--help") or argv[0].startswith("-") or "=" in argv[0]:
        raise ConfigError("usage: stool <app train module> [--multirun] [key=value ...], e.g. "
                          "`stool apps.llama.train config=llama_1b slurm.nodes=2 "
                          "slurm.gpus_per_node=8` (one task per GPU). "
                          "See docs/slurm.md, 'Running on Slurm'.")
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
