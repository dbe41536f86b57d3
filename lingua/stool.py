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
  4. prints the job id, the dump dir, the log paths and how to follow the job (squeue, sacct).

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
import time
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
    # Processes per node, each driving one GPU. 0: one per GPU on GPU jobs, 1 on CPU jobs (so a
    # GPU job never leaves GPUs idle by default). stool fills it in before validating.
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
STOP_GRACE_S = 5     # how long rank 0 of a stopped multi-rank job waits for its peers to exit


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
        from lingua import preemption

        # Before anything slow (importing torch takes seconds): from here on USR2/TERM mean "save
        # at the next step, then stop". Slurm sends USR2 up to 30 s earlier than asked, so it may
        # come during start-up, where submitit's handler (replaced here) ends rank 0 with 1.
        preemption.SIGNALS.listen()
        from lingua import distributed

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
        if code == preemption.EXIT_STOPPED and os.environ.get("RANK", "0") != "0":
            # Stopped on a signal with everything saved. The tasks run under srun
            # --kill-on-bad-exit=1, where any non-zero exit ends the whole step at once: this
            # rank's 3 could kill rank 0 before it has requeued the job. Rank 0 reports the stop
            # (srun's exit code is the highest of its tasks': 3).
            code = 0
        elif code == preemption.EXIT_STOPPED and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # And rank 0 leaves last: had it exited 3 while a peer was still tearing down, srun
            # would kill that peer ("forcing job termination") and report 1, not 3, as the job's
            # exit code. The ranks left the trainer together (a barrier); give them a moment.
            time.sleep(STOP_GRACE_S)
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


# A path Hydra reads as itself unquoted: words of these characters with a '/' among them (so not
# `null`, `true` or a number), inner spaces allowed (Hydra strips only leading and trailing ones).
# Anything else (',', '=', '$', quotes, brackets, non-ASCII) is quoted, so it is not read as a
# sweep, an interpolation or a grammar error.
PLAIN_PATH = re.compile(r"^(?=.*/)[A-Za-z0-9_./-]+(?: +[A-Za-z0-9_./-]+)*$")


def path_override(key: str, path) -> str:
    """`key=path` as Hydra reads it, quoted only where Hydra needs it: the override is shown to
    the user (the dry run's `would run` line), where a quoted plain path reads as a second layer
    of quoting around the shell's."""
    text = str(path)
    return f"{key}={text if PLAIN_PATH.match(text) else hydra_quote(text)}"


# Characters a shell expands inside double quotes ('!' too, in an interactive bash).
DOUBLE_QUOTE_SPECIAL = re.compile(r'["$`\\!]')


def shell_join(argv: List[str]) -> str:
    """argv as a person would type it into a shell: bare where that is safe, else in single
    quotes, or in double quotes when the word holds a single quote (Hydra's quoted values) and
    nothing a shell expands there; shlex.quote's '"'"' only where neither will do."""
    words = []
    for arg in argv:
        quoted = shlex.quote(arg)
        if "'" in arg and not DOUBLE_QUOTE_SPECIAL.search(arg):
            quoted = f'"{arg}"'
        words.append(quoted)
    return " ".join(words)


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
            fixes.append(path_override(key, Path(value).resolve()))
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
    differ = sorted(k for k in set(old) | set(new) if not k.startswith("slurm.")
                    and old.get(k, "<absent>") != new.get(k, "<absent>"))
    if differ:
        shown = ", ".join(f"{k} ({old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r})"
                          for k in differ[:8])
        raise ConfigError(f"dump_dir {sub.dump_dir} holds a run with another config: {shown}"
                          f"{' ...' if len(differ) > 8 else ''}. A job there would resume or "
                          f"overwrite that run. Use a new dump_dir, or pass "
                          f"slurm.reuse_dump_dir=true if replacing its config is what you mean.")


@dataclass
class Node:
    """One node of one partition as `sinfo` lists it; None where the value could not be read
    (such a value is never the reason for refusing a job)."""
    name: str
    partition: str
    cpus: Optional[int]
    mem_mb: Optional[int]
    gpus: Optional[int]


# `sinfo -N`: one line per node and partition; %P marks the default partition with '*'.
SINFO_NODES = ["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"]


def parse_count(text: str) -> Optional[int]:
    """A CPU count or a memory size (MB) from sinfo. "64+" (sinfo's "at least", for groups of
    unequal nodes) and anything else but a plain number is unknown."""
    text = text.strip()
    return int(text) if text.isdigit() else None


def split_gres(gres: str) -> List[str]:
    """`gpu:h100:8(S:0,1),nvme:1` -> its items: commas inside parentheses do not split."""
    items, depth, word = [], 0, ""
    for char in gres:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(word)
            word = ""
        else:
            word += char
    return [item.strip() for item in [*items, word] if item.strip()]


GRES_SCALE = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


def parse_gpus(gres: str) -> Optional[int]:
    """GPUs per node from sinfo's GRES (%G): `(null)` -> 0, `gpu:8`, `gpu:h100:8(S:0-1)`,
    `gpu:a100:4,gpu:v100:2` -> 6; None when a gpu entry's count cannot be read."""
    gres = gres.strip()
    if gres in ("", "(null)", "N/A", "none"):
        return 0
    total = 0
    for item in split_gres(gres):
        fields = re.sub(r"\(.*?\)", "", item).split(":")   # drop (S:0-1), (IDX:...)
        if fields[0].strip() != "gpu":
            continue
        count = re.fullmatch(r"(\d+)([KMG]?)", fields[-1].strip()) if len(fields) > 1 else None
        if count:
            total += int(count.group(1)) * GRES_SCALE[count.group(2)]
        elif len(fields) <= 2:  # `gpu` or `gpu:<type>`: one GPU
            total += 1
        else:
            return None
    return total


def parse_sinfo_nodes(text: str) -> List[Node]:
    """`sinfo -N -o '%N|%P|%c|%m|%G'` lines to Nodes; a line that is not five fields is skipped
    (a site's sinfo wrapper may add notes)."""
    nodes = []
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) != 5 or not fields[0].strip():
            continue
        name, partition, cpus, mem, gres = fields
        nodes.append(Node(name.strip(), partition.strip(), parse_count(cpus), parse_count(mem),
                          parse_gpus(gres)))
    return nodes


def mem_request_mb(mem: Optional[str]) -> Optional[int]:
    """slurm.mem in MB (Slurm's default unit); None when it asks for nothing in particular
    (unset, or 0: all of a node's memory)."""
    if mem is None or not MEM.match(str(mem)):
        return None
    text = str(mem)
    unit = text[-1] if text[-1] in "KMGT" else "M"
    number = int(text.rstrip("KMGT"))
    mb = {"K": number / 1024, "M": number, "G": number * 1024, "T": number * 1024 ** 2}[unit]
    return -(-int(mb * 1024) // 1024) or None   # rounded up; 0 -> None


def cluster_nodes() -> Optional[List[Node]]:
    """The cluster's nodes per partition from sinfo; None where there is no sinfo, or it fails
    (the controller is down): then nothing is checked and sbatch has the last word."""
    if shutil.which("sinfo") is None:
        return None
    try:
        result = subprocess.run(SINFO_NODES, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return parse_sinfo_nodes(result.stdout)


def _partitions(nodes: List[Node]) -> tuple:
    """({partition: its nodes}, the default partition or None)."""
    by_name, default = {}, None
    for node in nodes:
        name = node.partition.rstrip("*")
        if node.partition.endswith("*"):
            default = name
        by_name.setdefault(name, []).append(node)
    return by_name, default


def check_partition(partition: Optional[str], nodes: Optional[List[Node]] = None) -> None:
    """An unknown partition fails here, with the cluster's list, not as a bare sbatch error."""
    if partition is None:
        return
    nodes = cluster_nodes() if nodes is None else nodes
    if nodes is None:
        return  # sbatch will say what is wrong
    known = sorted(_partitions(nodes)[0])
    unknown = [p for p in str(partition).split(",") if p not in known]
    if unknown:
        raise ConfigError(f"slurm.partition={partition!r} does not exist on this cluster. Its "
                          f"partitions are: {', '.join(known) or 'none'} (from `sinfo`). Pick one "
                          f"of them, or leave slurm.partition out for the default.")


def _most(values: list) -> Optional[int]:
    """The largest value, or None when any is unknown (an unknown node may be the big one)."""
    return None if not values or None in values else max(values)


def resource_problems(s: SlurmArgs, partition: str, nodes: List[Node]) -> List[str]:
    """What no node of this partition can hold, each naming the slurm.* keys, the request and
    what the nodes have; [] when the job fits (as far as sinfo tells)."""
    cpus_each = max(s.cpus_per_task, 1)   # 0: the cluster's default, one CPU a task
    need = {"cpus": s.tasks_per_node * cpus_each, "gpus": s.gpus_per_node,
            "mem_mb": mem_request_mb(s.mem)}
    cpus = f"{need['cpus']} CPU{'s' if need['cpus'] != 1 else ''} a node"
    asked = {
        "cpus": (f"slurm.tasks_per_node={s.tasks_per_node} x slurm.cpus_per_task={cpus_each} asks "
                 f"for {cpus}" if s.cpus_per_task else
                 f"slurm.tasks_per_node={s.tasks_per_node} asks for {cpus} (one a task)"),
        "gpus": (f"slurm.gpus_per_node={s.gpus_per_node} asks for {s.gpus_per_node} "
                 f"GPU{'s' if s.gpus_per_node != 1 else ''} a node"),
        "mem_mb": f"slurm.mem={s.mem} asks for {need['mem_mb']} MB a node",
    }
    units = {"cpus": "CPUs", "gpus": "GPUs", "mem_mb": "MB of memory"}
    problems = []
    for key, wanted in need.items():
        most = _most([getattr(n, key) for n in nodes])
        if wanted and most is not None and wanted > most:
            problems.append(f"{asked[key]}, but the nodes of partition '{partition}' have at most "
                            f"{most} {units[key]}")
    if problems:
        return problems

    def holds(node: Node) -> bool:
        return all(not wanted or getattr(node, key) is None or getattr(node, key) >= wanted
                   for key, wanted in need.items())

    total, able = len(nodes), sum(holds(n) for n in nodes)
    if s.nodes > total:
        problems.append(f"slurm.nodes={s.nodes} asks for more nodes than partition '{partition}' "
                        f"has ({total})")
    elif s.nodes > able:
        wanted = ", ".join(asked[k] for k, v in need.items() if v)
        problems.append(f"slurm.nodes={s.nodes} asks for {s.nodes} nodes that each hold the "
                        f"job's share ({wanted}), but only {able} of the {total} nodes of "
                        f"partition '{partition}' do")
    return problems


def check_resources(s: SlurmArgs, chosen: List[str] = (),
                    nodes: Optional[List[Node]] = None) -> bool:
    """Refuse, before anything is written or queued, a job that no node of its partition can
    hold: Slurm would queue it and it would pend forever (reason PartitionConfig). Also checks the
    partition exists. Returns whether sinfo was there to check against."""
    nodes = cluster_nodes() if nodes is None else nodes
    if nodes is None:
        return False
    check_partition(s.partition, nodes)
    by_name, default = _partitions(nodes)
    names = str(s.partition).split(",") if s.partition else [default] if default else []
    found = {name: resource_problems(s, name, by_name[name]) for name in names}
    if not found or any(not problems for problems in found.values()):
        return True   # a job may name several partitions: one that holds it is enough
    text = "; ".join(p for problems in found.values() for p in problems)
    hint = ""
    picked = [c for c in chosen if c.split("=", 1)[0] in text]
    if picked:
        hint = (f" stool chose {', '.join(picked)} itself (slurm.* left at 0): set those keys to "
                f"what the nodes have.")
    raise ConfigError(f"No node can hold this job: {text} (from `sinfo`). Slurm would queue it "
                      f"and it would wait forever (reason PartitionConfig). Ask for less per "
                      f"node (e.g. fewer slurm.tasks_per_node on more slurm.nodes), or pick a "
                      f"partition with bigger nodes (`sinfo -N -o '%P %N %c %m %G'` lists them)."
                      f"{hint}")


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
    from lingua.distributed import JOB_DEVICE_VAR

    setup = [f"cd {shlex.quote(str(code_dir))}", f"export PYTHONPATH={shlex.quote(str(code_dir))}",
             # The job trains on the device it asked Slurm for, which is what stool validated for:
             # sbatch passes on the submitting shell's environment, and a LINGUA_JOB_DEVICE=cpu
             # set there to debug would otherwise keep a GPU job on its CPUs (and a CPU job on a
             # node with visible GPUs would take them).
             f"unset {JOB_DEVICE_VAR}" if slurm.gpus_per_node else f"export {JOB_DEVICE_VAR}=cpu"]
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
    """How to follow the jobs: sacct where the cluster has accounting; where it has none, sacct
    fails ("accounting storage is disabled") and Slurm forgets a job MinJobAge after it ends."""
    ids = ",".join(dict.fromkeys(str(j).split("_")[0] for j in job_ids))  # an array: its id
    if accounting_enabled() is False:
        return (f"  follow it: squeue -j {ids}; scontrol show job {ids} (this cluster has no "
                f"accounting, so no sacct: Slurm forgets a finished job after MinJobAge, and the "
                f"dump dir with its slurm/ logs is the record)")
    return f"  follow it: squeue -j {ids} (queued, running); sacct -j {ids} (also once it ended)"


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
    """Validate, snapshot, write config.yaml and submit; returns the submitit jobs ([] on a dry
    run)."""
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
        raise ConfigError("sbatch is not on PATH: stool submits to Slurm. Run on a cluster's "
                          "login node, start a local one with `bash setup/slurm_local.sh start`, "
                          "or train without Slurm: `torchrun --nproc-per-node N -m " + module
                          + " ...`.")
    executor = make_executor(slurm, folder, code_dir, job_name)
    # Against the cluster's nodes, on a dry run too where sinfo answers.
    checked = check_resources(slurm, submissions[0].filled if slurm.gpus_per_node else [])
    if slurm.dry_run:
        print(batch_script(executor, len(submissions)))
        for sub in submissions:
            # As one would type it: pasted into a shell it runs the job's config here.
            print(f"# would run: {shell_join(['python', '-m', module, *sub.overrides])}")
            print(f"#   dump dir: {sub.dump_dir}")
        print(dry_run_plan(module, submissions[0], sweep))
        print("# resources checked against `sinfo`" if checked else
              "# resources not checked: `sinfo` is missing here or did not answer")
        print("# dry run: nothing written, nothing submitted")
        return []
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
    print(status_hint([job.job_id for job in jobs]))
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
