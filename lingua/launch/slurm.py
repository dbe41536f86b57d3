"""Slurm job settings (`slurm.*`), the check against the nodes `sinfo` reports (a job that cannot
fit is refused before it is queued), and the submitit executor."""

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from lingua.errors import ConfigError


@dataclass
class SlurmArgs:
    """The `slurm.*` group: read by stool when submitting (max_requeues also by the job)."""
    nodes: int = 1
    # Processes per node, each driving one GPU. 0: one per GPU on GPU jobs, 1 on CPU jobs.
    tasks_per_node: int = 0
    gpus_per_node: int = 0
    # 0: GPU_JOB_CPUS per task on GPU jobs (the cluster default is often 1 CPU a task, which
    # starves data loading), the cluster's default on CPU jobs.
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
# CPUs per task of a GPU job with slurm.cpus_per_task=0: the Python process and a few loader
# threads, and what nearly every GPU node has per GPU.
GPU_JOB_CPUS = 8


def slurm_defaults(s: SlurmArgs) -> List[str]:
    """Fill in the slurm.* values left at 0, so config.yaml holds the real numbers."""
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


@dataclass
class Node:
    """One node of one partition as `sinfo` lists it; None: unknown (never a reason to refuse)."""
    name: str
    partition: str
    cpus: Optional[int]
    mem_mb: Optional[int]
    gpus: Optional[int]


# `sinfo -N`: one line per node and partition; %P marks the default partition with '*'.
SINFO_NODES = ["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G"]


def parse_count(text: str) -> Optional[int]:
    """A plain number from sinfo, else unknown ("64+" is sinfo's "at least")."""
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
    """GPUs per node from sinfo's GRES: `gpu:a100:4,gpu:v100:2(S:0-1)` -> 6; None if unreadable."""
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
    """A line that is not five fields is skipped (a site's sinfo wrapper may add notes)."""
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
    """slurm.mem in MB; None when unset, or 0 (all of a node's memory)."""
    if mem is None or not MEM.match(str(mem)):
        return None
    text = str(mem)
    unit = text[-1] if text[-1] in "KMGT" else "M"
    number = int(text.rstrip("KMGT"))
    mb = {"K": number / 1024, "M": number, "G": number * 1024, "T": number * 1024 ** 2}[unit]
    return -(-int(mb * 1024) // 1024) or None   # rounded up; 0 -> None


def cluster_nodes() -> Optional[List[Node]]:
    """None where sinfo is missing or fails: then sbatch has the last word."""
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
    """Refuse a job no node of its partition can hold: Slurm would let it pend forever (reason
    PartitionConfig). Returns whether sinfo was there to check against."""
    nodes = cluster_nodes() if nodes is None else nodes
    if nodes is None:
        return False
    by_name, default = _partitions(nodes)
    if s.partition is not None and any(p not in by_name for p in str(s.partition).split(",")):
        raise ConfigError(f"slurm.partition={s.partition!r} does not exist on this cluster. Its "
                          f"partitions are: {', '.join(sorted(by_name)) or 'none'} (from `sinfo`). "
                          f"Pick one of them, or leave slurm.partition out for the default.")
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


def make_executor(slurm: SlurmArgs, folder: Path, code_dir: Path, job_name: str):
    import submitit

    executor_class = submitit.SlurmExecutor
    if slurm.dry_run:   # submitit refuses to build an executor where srun is missing
        class ScriptOnlyExecutor(submitit.SlurmExecutor):
            @classmethod
            def affinity(cls) -> int:
                return 1

        executor_class = ScriptOnlyExecutor
    executor = executor_class(folder=folder, python=shlex.quote(sys.executable))
    extra = {"requeue": True}
    if slurm.mem is not None:
        extra["mem"] = str(slurm.mem)   # as given: submitit's own mem option converts from GB
    from lingua.parallel.distributed import JOB_DEVICE_VAR

    setup = [f"cd {shlex.quote(str(code_dir))}", f"export PYTHONPATH={shlex.quote(str(code_dir))}",
             # The device stool validated for, whatever LINGUA_JOB_DEVICE sbatch exports.
             f"unset {JOB_DEVICE_VAR}" if slurm.gpus_per_node else f"export {JOB_DEVICE_VAR}=cpu"]
    params = dict(job_name=job_name, nodes=slurm.nodes, ntasks_per_node=slurm.tasks_per_node,
                  time=slurm.time, signal_delay_s=slurm.signal_delay_s, setup=setup,
                  additional_parameters=extra,
                  # submitit writes --wckey=submitit unless told otherwise; None writes no line.
                  wckey=slurm.wckey or None,
                  # One crashed rank ends the step now, not after the NCCL timeout (TrainJob
                  # exits 0 on a clean stop for this).
                  srun_args=["--kill-on-bad-exit=1"])
    if slurm.gpus_per_node:
        params["gpus_per_node"] = slurm.gpus_per_node
    if slurm.cpus_per_task:
        params["cpus_per_task"] = slurm.cpus_per_task
        # Slurm 22.05 to 23.02: srun does not take --cpus-per-task from the job (one CPU a
        # task) but reads SRUN_CPUS_PER_TASK; other versions ignore it.
        setup.append(f"export SRUN_CPUS_PER_TASK=${{SLURM_CPUS_PER_TASK:-{slurm.cpus_per_task}}}")
    for name in ("partition", "qos", "account", "constraint", "exclude"):
        if getattr(slurm, name) is not None:
            params[name] = str(getattr(slurm, name))
    executor.update_parameters(**params)
    return executor

