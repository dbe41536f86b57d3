"""stool against a real Slurm: the one-node cluster of `bash setup/slurm_local.sh start`.

`bash setup/test.sh` starts it (installing Debian's packages where it can) and then these tests
must run; elsewhere they are skipped with the reason. Each test submits real jobs with stool and
compares what they wrote with a torchrun run of the same config.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import launcher
from tests.conftest import REPO, read_metrics, run_torchrun, slurm_is_up, tiny_args
from tests.equivalence import assert_equivalent, final_checkpoint, model_checksums, resumed_line

NO_SLURM = slurm_is_up()
# setup/test.sh sets LINGUA_REQUIRE_SLURM after starting Slurm: there a missing Slurm fails the
# tests (below) instead of skipping them.
REQUIRED = os.environ.get("LINGUA_REQUIRE_SLURM") == "1"
pytestmark = [pytest.mark.slurm, pytest.mark.slow,
              pytest.mark.skipif(bool(NO_SLURM) and not REQUIRED, reason=NO_SLURM or "-")]


@pytest.fixture(scope="module", autouse=True)
def slurm():
    reason = slurm_is_up()
    if reason:
        pytest.fail(reason)


def stool(*args: str, env_extra=None, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m lingua.launch.stool args`, forked warm (tests/launcher.py): what it submits
    is a fresh job all the same."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = launcher.launch("lingua.launch.stool", list(args), 0, env, REPO, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"stool failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def job_ids(stool_output: str) -> list:
    return re.findall(r"submitted job (\S+):", stool_output)


def job_field(job_id: str, name: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                         text=True).stdout
    match = re.search(rf"\b{name}=(\S+)", out)
    return match.group(1) if match else ""


def node_is_idle() -> bool:
    states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True,
                            text=True).stdout.split()
    return bool(states) and all(state.startswith("idle") for state in states)


def release_if_requeued(job_id: str) -> None:
    """Slurm holds a requeued job for about two minutes (its BeginTime); a test need not wait,
    but must let the previous run leave the node first, and start the next one in a later second
    than the end of the previous: slurmd revoked the job's credentials then, with a time in whole
    seconds, and refuses a launch credential that is not newer ("Killing non-startable batch job:
    Job credential revoked", exit 1)."""
    if (job_field(job_id, "JobState") == "PENDING" and job_field(job_id, "Reason") == "BeginTime"
            and node_is_idle()):
        time.sleep(1)   # the revocation came before the node was idle: now a second has passed
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_for(job_id: str, timeout: float = 300, logs: Path = None) -> str:
    """Wait until the job has finished (releasing it when it is requeued); its final state."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_field(job_id, "JobState")
        if state in FINISHED:
            return state
        release_if_requeued(job_id)
        time.sleep(1)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not finish in {timeout}s:\n{dump_logs(logs)}")


def dump_logs(folder) -> str:
    if folder is None or not Path(folder).is_dir():
        return ""
    logs = sorted(Path(folder).glob("*_log.*"))
    return "\n".join(f"== {p}\n{p.read_text()[-3000:]}" for p in logs)


def accounting_on() -> bool:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    return bool(re.search(r"^AccountingStorageType\s*=\s*accounting_storage/slurmdbd", out, re.M))


def sacct_states(job_id: str, *flags: str, timeout: float = 30, expect=()) -> dict:
    """{job id: state} as sacct reports it once every job of job_id (and each of `expect`) has a
    final state (slurmctld sends the records to slurmdbd a moment after each job ends, so an
    array's tasks may appear one at a time)."""
    deadline = time.time() + timeout
    while True:
        proc = subprocess.run(["sacct", *flags, "-j", job_id, "-X", "-n", "-P", "-o",
                               "JobID,State"], capture_output=True, text=True)
        states = dict(line.split("|", 1) for line in proc.stdout.splitlines() if "|" in line)
        if (states and set(expect) <= set(states)
                and all(v not in ("PENDING", "RUNNING", "REQUEUED") for v in states.values())
                or time.time() > deadline):
            assert proc.returncode == 0, proc.stderr
            return states
        time.sleep(0.5)


def check_sacct(job_id: str, stool_output: str, array_tasks: int = 0) -> None:
    """sacct works on the local cluster, as users expect, and stool says to use it. Without
    accounting (LINGUA_SLURM_ACCOUNTING=0 or no MariaDB) stool names scontrol instead."""
    base = job_id.split("_")[0]
    if not accounting_on():
        assert os.environ.get("LINGUA_SLURM_ACCOUNTING") == "0" or not REQUIRED, (
            "setup/slurm_local.sh start set up no accounting: sacct fails (see its output)")
        assert f"scontrol show job {base}" in stool_output, stool_output
        return
    assert f"sacct -j {base}" in stool_output, stool_output
    want = ({f"{base}_{i}": "COMPLETED" for i in range(array_tasks)} if array_tasks
            else {base: "COMPLETED"})
    assert sacct_states(base, expect=want) == want


def losses(dump_dir) -> dict:
    return {row["step"]: row["loss"] for row in read_metrics(dump_dir)}


def slurm_args(dump_dir, corpus, *extra, steps):
    return [*tiny_args(corpus, dump_dir, *extra, steps=steps), "slurm.cpus_per_task=1",
            "slurm.time=10", "slurm.partition=debug"]


def test_two_task_job_matches_torchrun_and_keeps_values_and_secrets(corpus, tmp_path):
    # A dump_dir with a space and a config value with quotes, ';' and a $(...) that a shell would
    # run: both must reach the job intact and unexecuted.
    dump = tmp_path / "runs with space" / "two"
    name = """it's "a b";c $(touch PWNED)"""
    name_override = "logging.name='" + name.replace("\\", "\\\\").replace("'", "\\'") + "'"
    secret = "lingua-test-secret-7f3a"
    proc = stool("apps.llama.train", *slurm_args(dump, corpus, "distributed.dp_shard=2",
                                                 name_override, steps=4),
                 "slurm.tasks_per_node=2", env_extra={"WANDB_API_KEY": secret})
    [job] = job_ids(proc.stdout)
    assert str(dump) in proc.stdout and "_log.out" in proc.stdout
    assert wait_for(job, logs=dump / "slurm") == "COMPLETED", dump_logs(dump / "slurm")
    check_sacct(job, proc.stdout)
    # The job completion log is written with or without accounting (sacct --completion).
    assert sacct_states(job, "--completion") == {job: "COMPLETED"}

    ref = tmp_path / "torchrun"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, ref, "distributed.dp_shard=2", steps=4))
    assert sorted(losses(dump)) == [1, 2, 3, 4]
    assert_equivalent(dump, ref, rtol=0)  # same sequences, same world size: bit-identical

    # The same module under a plain `srun` takes its ranks from Slurm as well.
    plain = tmp_path / "srun"
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc_srun = subprocess.run(["srun", "-n", "2", "-p", "debug", sys.executable, "-m",
                                "apps.llama.train",
                                *tiny_args(corpus, plain, "distributed.dp_shard=2", steps=4)],
                               cwd=REPO, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True,
                               text=True, timeout=300)
    assert proc_srun.returncode == 0, proc_srun.stdout[-3000:] + proc_srun.stderr[-3000:]
    assert_equivalent(plain, ref, rtol=0)

    out = "\n".join(p.read_text() for p in (dump / "slurm").glob("*_log.out"))
    assert "rank 0 of 2" in out and "rank 1 of 2" in out
    # What sbatch ran: srun ends the step when a task fails, takes the CPUs per task from
    # SRUN_CPUS_PER_TASK (this Debian Slurm is 22.05, whose srun ignores the job's), no wckey.
    script = (dump / "slurm" / f"{job}_submission.sh").read_text()
    assert "--kill-on-bad-exit=1" in script and "--wckey" not in script, script
    assert "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}" in script, script
    assert f"from {dump / 'code' / 'apps' / 'llama'}" in out  # ran from the snapshot
    assert (dump / "code" / "lingua" / "launch" / "stool.py").is_file()
    from omegaconf import OmegaConf
    assert OmegaConf.load(dump / "config.yaml").logging.name == name
    assert not list(REPO.glob("PWNED")) and not list(dump.rglob("PWNED"))
    # The secret reached the job through Slurm's environment only, never a file of ours.
    for path in dump.rglob("*"):
        if path.is_file() and "code" not in path.relative_to(dump).parts:
            assert secret.encode() not in path.read_bytes(), f"secret written to {path}"


def test_requeued_job_resumes_with_the_same_losses(corpus, tmp_path):
    dump, steps = tmp_path / "requeued", 30
    proc = stool("apps.llama.train", *slurm_args(dump, corpus, "distributed.dp_shard=2",
                                                 "checkpoint.every=1000", "checkpoint.keep=0",
                                                 steps=steps),
                 "slurm.tasks_per_node=2")
    [job] = job_ids(proc.stdout)
    deadline = time.time() + 180
    while not ((dump / "metrics.jsonl").is_file() and len(read_metrics(dump)) >= 5):
        assert time.time() < deadline, dump_logs(dump / "slurm")
        assert job_field(job, "JobState") not in FINISHED, dump_logs(dump / "slurm")
        time.sleep(0.5)
    subprocess.run(["scontrol", "requeue", job], check=True)  # what a preemption does
    assert wait_for(job, logs=dump / "slurm") == "COMPLETED", dump_logs(dump / "slurm")
    assert job_field(job, "Restarts") == "1"

    # SIGTERM made every rank save at the next step boundary; the requeued job resumed there.
    saved = sorted(int(p.name) for p in (dump / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 2 and 5 <= saved[0] < steps and saved[1] == steps, saved
    out = "\n".join(p.read_text() for p in (dump / "slurm").glob("*_0_log.out"))
    # The second run started where the first saved; steps before that ran once, in the first.
    assert resumed_line(dump, saved[0]) in out, out[-3000:]
    assert f"training steps {saved[0]} -> {steps}" in out
    assert out.count(f"training steps 0 -> {steps}") == 1, out[-3000:]
    assert "requeues so far 1" in out

    ref = tmp_path / "reference"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, ref, "distributed.dp_shard=2",
                                                  steps=steps))
    got = read_metrics(dump)
    assert [row["step"] for row in got] == list(range(1, steps + 1))  # none lost, none repeated
    assert_equivalent(dump, ref, rtol=0)


def test_time_limit_checkpoints_and_requeues(corpus, tmp_path):
    # slurm.time=1 minute with USR2 59 s before it: slurmctld looks at time limits every 30 s,
    # so USR2 comes at its first look from 1 s after the job started, 1 to 31 s in (while a task
    # may still be starting: tests/test_slurm_timelimit.py), and the time limit would end the
    # run 29 s or more after it. The first run saves and requeues; the second, resumed, gets
    # USR2 from scancel as soon as it resumed (or Slurm's, if that comes first), finds its
    # requeue budget (1) spent and stops, saved.
    # Two ranks under srun --kill-on-bad-exit: rank 1 must not end the step (and rank 0 with it)
    # before rank 0 has requeued the job, and the job's exit code is still rank 0's 3.
    dump = tmp_path / "timelimit"
    proc = stool("apps.llama.train", *tiny_args(corpus, dump, "checkpoint.keep=0",
                                                "distributed.dp_shard=2", steps=100000),
                 "slurm.time=1", "slurm.signal_delay_s=59", "slurm.max_requeues=1",
                 "slurm.cpus_per_task=1", "slurm.tasks_per_node=2")
    [job] = job_ids(proc.stdout)
    try:
        deadline = time.time() + 300
        while "resumed from" not in dump_logs(dump / "slurm"):   # the second run is training
            assert job_field(job, "JobState") not in FINISHED, dump_logs(dump / "slurm")
            assert time.time() < deadline, dump_logs(dump / "slurm")
            release_if_requeued(job)
            time.sleep(0.5)
        subprocess.run(["scancel", "--signal=USR2", job])   # the job may have stopped already
        state = wait_for(job, timeout=400, logs=dump / "slurm")
    finally:   # not left to requeue itself and hold the node for the next test
        if job_field(job, "JobState") not in FINISHED:
            subprocess.run(["scancel", job])
    logs = dump_logs(dump / "slurm")
    assert job_field(job, "Restarts") == "1", logs
    assert state == "FAILED" and job_field(job, "ExitCode") == "3:0", logs  # stopped, not finished
    saved = sorted(int(p.name) for p in (dump / "checkpoints").iterdir() if p.name.isdigit())
    assert len(saved) == 2 and 0 < saved[0] < saved[1], (saved, logs)
    out = "\n".join(p.read_text() for p in (dump / "slurm").glob("*_0_log.out"))
    assert "got SIGUSR2" in logs and "requeued job" in out and "not requeueing" in out, out
    # srun saw no failed task: a clean stop does not make it cancel the step under rank 0.
    assert "task 1: Exited with exit code" not in logs, logs
    # The requeued run resumed from the first run's checkpoint and did not start over.
    assert resumed_line(dump, saved[0]) in out and out.count("training steps 0 -> ") == 1, out
    assert [row["step"] for row in read_metrics(dump)] == list(range(1, saved[1] + 1))


def test_a_fault_tolerant_run_is_a_lighthouse_job_and_a_job_per_group(corpus, tmp_path):
    """stool submits the lighthouse and one job per replica group; all run at once (the local
    node declares a CPU for the lighthouse), both groups train every step to the same weights,
    and the lighthouse job ends by itself once the groups' jobs have left the queue."""
    dump, steps = tmp_path / "ft", 3
    proc = stool("apps.llama.train", *slurm_args(
        dump, corpus, "data.batch_size=2", "eval.at_end=false", "fault_tolerance.enabled=true",
        "fault_tolerance.replica_groups=2", "fault_tolerance.min_replicas=2", steps=steps))
    lighthouse, *groups = job_ids(proc.stdout)
    assert len(groups) == 2 and f"scancel {lighthouse} " in proc.stdout, proc.stdout
    for job in groups:
        assert wait_for(job, timeout=120, logs=dump / "slurm") == "COMPLETED", \
            dump_logs(dump / "slurm")
    # Not cancelled, not timed out: it saw the groups leave the queue (it polls every 2 s).
    assert wait_for(lighthouse, timeout=30, logs=dump / "slurm") == "COMPLETED"
    served = (dump / "lighthouse").read_text()
    assert served.startswith("http://") and served in dump_logs(dump / "slurm")
    for g in range(2):
        assert [row["step"] for row in read_metrics(dump / f"group_{g}")] == [1, 2, 3]
    assert model_checksums(final_checkpoint(dump / "group_0", steps)) == \
        model_checksums(final_checkpoint(dump / "group_1", steps))


def test_a_requeued_group_heals_from_the_other_and_both_end_equal(corpus, tmp_path):
    """`scontrol requeue` of one group (a preemption): it saves, is requeued on its own, resumes
    and heals from the group that went on (min_replicas=1); both then save equal weights at the
    same steps, and the survivor logs every step once. The run has steps to spare (it never has to
    outlast the restart): the test cancels both groups once it has what it checks."""
    dump, every = tmp_path / "ftrequeue", 5
    proc = stool("apps.llama.train", *slurm_args(
        dump, corpus, "data.batch_size=2", "eval.at_end=false", "fault_tolerance.enabled=true",
        "fault_tolerance.replica_groups=2", "fault_tolerance.quorum_timeout_s=20",
        f"checkpoint.every={every}", "checkpoint.keep=0", steps=100_000))
    lighthouse, survivor, victim = job_ids(proc.stdout)
    log = dump / "slurm" / f"{victim}_0_log.out"   # both of the victim's runs

    def rows(g):
        path = dump / f"group_{g}" / "metrics.jsonl"
        return read_metrics(path.parent) if path.is_file() else []

    def healed():   # in the requeued run (a group that starts late heals at once, too)
        text = log.read_text() if log.is_file() else ""
        return re.findall(r"group 1 heals from a live group: step (\d+)",
                          text.partition("requeues so far 1")[2])

    def wait(condition, what):
        deadline = time.time() + 120
        while not condition():
            assert time.time() < deadline, f"no {what}:\n{dump_logs(dump / 'slurm')}"
            assert job_field(survivor, "JobState") not in FINISHED, dump_logs(dump / "slurm")
            time.sleep(0.2)

    try:
        wait(lambda: len(rows(1)) >= 3, "3 steps")
        subprocess.run(["scontrol", "requeue", victim], check=True)
        wait(lambda: job_field(victim, "JobState") == "PENDING", "requeue")   # saved, stopped
        # Released once the survivor has gone on alone: back sooner, within the lighthouse's join
        # timeout, it would find the survivor waiting for it at its own step, with nothing to heal.
        stopped = max(row["step"] for row in rows(1))
        wait(lambda: len(rows(0)) >= stopped + 5, "steps of the survivor alone")
        time.sleep(1)   # a later second than the run's end (release_if_requeued says why)
        subprocess.run(["scontrol", "update", f"JobId={victim}", "StartTime=now"], check=True)
        wait(healed, "heal")
        common = (int(healed()[0]) // every + 2) * every   # saved by both after the heal
        wait(lambda: min(max((r["step"] for r in rows(g)), default=0) for g in (0, 1)) >= common,
             f"step {common} in both groups")
    finally:
        subprocess.run(["scancel", survivor, victim])
    assert wait_for(lighthouse, timeout=60, logs=dump / "slurm") == "COMPLETED"   # by itself
    assert job_field(victim, "Restarts") == "1" and "requeues so far 1" in log.read_text()
    steps_kept = [row["step"] for row in rows(0)]   # from 2 if it started late and healed
    assert steps_kept == list(range(steps_kept[0], steps_kept[-1] + 1)) and steps_kept[0] <= 2
    for step in (common - every, common):
        assert model_checksums(final_checkpoint(dump / "group_0", step)) == \
            model_checksums(final_checkpoint(dump / "group_1", step)), step


# tests.test_slurm doubles as a stool app for the next test (stool needs load_config and main; the
# job imports this module from its code snapshot): the llama config, and a main whose rank 1 fails
# at once while rank 0 waits, as a rank blocked in a collective on a dead peer would.
def load_config(argv, check=True):
    from apps.llama import train

    return train.load_config(argv, check)


def main(argv) -> int:
    if os.environ.get("RANK") == "1":
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(600)
    return 0


def test_a_crashed_rank_ends_the_job_at_once(corpus, tmp_path):
    """srun --kill-on-bad-exit=1: rank 1's failure ends rank 0 within Slurm's KillWait (5 s here)
    instead of leaving it blocked until the NCCL timeout or the time limit."""
    dump = tmp_path / "crash"
    proc = stool("tests.test_slurm", *slurm_args(dump, corpus, "distributed.dp_shard=2", steps=2),
                 "slurm.tasks_per_node=2")
    [job] = job_ids(proc.stdout)
    # Without --kill-on-bad-exit rank 0 would sleep its 600 s and wait_for would fail.
    assert wait_for(job, timeout=120, logs=dump / "slurm") == "FAILED", dump_logs(dump / "slurm")
    logs = dump_logs(dump / "slurm")
    assert "rank 1 fails on purpose" in logs, logs


def test_sweep_sends_a_job_array_with_one_dump_dir_per_value(corpus, tmp_path):
    base = tmp_path / "sweep"
    proc = stool("apps.llama.train", "--multirun", *tiny_args(corpus, base, steps=2),
                 "optim.lr=1e-3,3e-3", "slurm.cpus_per_task=1")
    jobs = job_ids(proc.stdout)
    assert len(jobs) == 2 and jobs[0].endswith("_0") and jobs[1].endswith("_1"), proc.stdout
    assert jobs[0].split("_")[0] == jobs[1].split("_")[0]  # one array
    for job in jobs:
        assert wait_for(job, logs=base / "slurm") == "COMPLETED", dump_logs(base / "slurm")
    check_sacct(jobs[0], proc.stdout, array_tasks=2)
    runs = {p.name: p for p in base.iterdir() if (p / "metrics.jsonl").is_file()}
    # Named after the swept value as Hydra parses it (1e-3 -> 0.001), as Hydra's sweeper does.
    assert sorted(runs) == ["optim.lr=0.001", "optim.lr=0.003"], sorted(runs)
    peak_lr = {name: max(row["lr"] for row in read_metrics(path)) for name, path in runs.items()}
    assert peak_lr["optim.lr=0.003"] == pytest.approx(3 * peak_lr["optim.lr=0.001"])
    assert (base / "code" / "lingua").is_dir()  # one snapshot for the array, at the sweep root


def test_a_job_slurm_refuses_gets_a_clear_error(corpus, tmp_path):
    dump = tmp_path / "toobig"
    proc = stool("apps.llama.train", *tiny_args(corpus, dump), "slurm.constraint=no_such_feature",
                 check=False)
    assert proc.returncode == 2
    assert "Slurm refused the job" in proc.stderr and "slurm.*" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def node_cpus() -> int:
    [cpus] = set(subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%c"],
                                capture_output=True, text=True, check=True).stdout.split())
    return int(cpus)


def test_a_job_no_node_can_hold_is_refused_before_anything_is_written(corpus, tmp_path):
    """More tasks than the node has CPUs used to be queued and pend forever (PartitionConfig):
    stool refuses it before writing anything, naming the key, the request and what the nodes
    have."""
    dump, cpus = tmp_path / "toomany", node_cpus()
    # (The dry run makes the same check: tests/test_stool.py, against a made-up sinfo.)
    proc = stool("apps.llama.train", *tiny_args(corpus, dump), f"slurm.tasks_per_node={cpus + 1}",
                 f"distributed.dp_shard={cpus + 1}", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (f"slurm.tasks_per_node={cpus + 1} asks for {cpus + 1} CPUs a node (one a task), "
            f"but the nodes of partition 'debug' have at most {cpus} CPUs") in proc.stderr
    assert "Traceback" not in proc.stderr and "submitted job" not in proc.stdout
    # A GPU job on this GPU-less cluster: the error names the values stool chose itself.
    proc = stool("apps.llama.train", *tiny_args(corpus, dump, "distributed.backend=nccl"),
                 "slurm.gpus_per_node=1", check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("slurm.gpus_per_node=1 asks for 1 GPU a node, but the nodes of partition 'debug' "
            "have at most 0 GPUs") in proc.stderr, proc.stderr
    assert "stool chose slurm.tasks_per_node=1, slurm.cpus_per_task=8" in proc.stderr, proc.stderr
    squeue = subprocess.run(["squeue", "-h", "-n", "toomany"], capture_output=True, text=True)
    assert squeue.stdout.strip() == "" and not dump.exists()
    # The same check in-process against this cluster's sinfo (no stool start-up per case).
    from lingua.errors import ConfigError
    from lingua.launch.slurm import SlurmArgs, check_resources

    for args, message in [
        (SlurmArgs(nodes=2, tasks_per_node=1),
         "slurm.nodes=2 asks for more nodes than partition 'debug' has (1)"),
        (SlurmArgs(tasks_per_node=1, mem="64T"), "slurm.mem=64T asks for 67108864 MB a node"),
        (SlurmArgs(tasks_per_node=1, cpus_per_task=cpus + 1, partition="debug"),
         f"slurm.tasks_per_node=1 x slurm.cpus_per_task={cpus + 1} asks for {cpus + 1} CPUs"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_resources(args)
    assert check_resources(SlurmArgs(tasks_per_node=cpus, mem="100M"))  # what fits is fine


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity mask, or fewer under a cgroup CPU quota."""
    cpus = len(os.sched_getaffinity(0))
    v2, v1 = Path("/sys/fs/cgroup/cpu.max"), Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    quota = (v2.read_text().split() if v2.is_file() else
             [v1.read_text(), (v1.parent / "cpu.cfs_period_us").read_text()] if v1.is_file()
             else [])
    if len(quota) == 2 and quota[0].strip().isdigit():
        cpus = min(cpus, max(1, int(quota[0]) // int(quota[1])))
    return cpus


def test_starting_the_local_slurm_again_changes_nothing():
    """`start` is idempotent: with the config unchanged the daemons keep running (their jobs
    with them), and the config they run is the one written (accounting through slurmdbd). The
    node has the machine's CPUs and one for a lighthouse job, also when started from a shell
    with OMP_NUM_THREADS=1 (which `nproc` follows)."""
    as_root = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if as_root and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode != 0:
        pytest.skip("neither root nor passwordless sudo: cannot run setup/slurm_local.sh start")
    state = Path("/var/spool/lingua-slurm")
    if not (state / "slurmctld.pid").is_file():
        pytest.skip("this Slurm was not started by setup/slurm_local.sh")
    before = {name: (state / f"{name}.pid").read_text() for name in ("slurmctld", "slurmd")}
    start = ["bash", "setup/slurm_local.sh", "start"]
    proc = subprocess.run([*as_root, "env", "OMP_NUM_THREADS=1", *start], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        conf = Path("/etc/slurm/slurm.conf").read_text()
        # One CPU more, for a fault-tolerant run's lighthouse job (setup/slurm_local.sh).
        assert f" CPUs={usable_cpus() + 1} " in conf and node_cpus() == usable_cpus() + 1, conf
    finally:   # a node sized wrong would fail the other tests: give it back its size
        if node_cpus() != usable_cpus() + 1:
            subprocess.run([*as_root, "env", "-u", "OMP_NUM_THREADS", *start], cwd=REPO,
                           capture_output=True, timeout=300)
    assert {name: (state / f"{name}.pid").read_text() for name in before} == before
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True,
                            text=True).stdout
    assert re.search(r"JobCompType\s*=\s*jobcomp/filetxt", config), config
    if os.environ.get("LINGUA_SLURM_ACCOUNTING") != "0":
        assert "sacct works" in proc.stdout, proc.stdout + proc.stderr
        assert accounting_on()
        listed = subprocess.run(["sacct", "-n", "-X", "-S", "now-1hours"], capture_output=True,
                                text=True)
        assert listed.returncode == 0, listed.stderr


def test_unknown_partition_is_refused_before_anything_is_written(corpus, tmp_path):
    dump = tmp_path / "nopart"
    proc = stool("apps.llama.train", *tiny_args(corpus, dump), "slurm.partition=no_such_part",
                 check=False)
    assert proc.returncode == 2
    assert "slurm.partition='no_such_part' does not exist" in proc.stderr
    assert "debug" in proc.stderr  # the partitions that do exist
    assert not dump.exists()
