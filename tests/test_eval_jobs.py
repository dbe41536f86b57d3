"""eval.mode=async (lingua/launch/eval_jobs.py): a Slurm job per evaluated checkpoint, against the
real local Slurm of `bash setup/slurm_local.sh start` (tests marked slurm; skipped with the reason
where it cannot run, failing where setup/test.sh started it). The checks of the config, of the
retry decision, of pruning and of a submission without Slurm need no cluster.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lingua import checkpoint
from lingua.checkpoint import integrity
from lingua.errors import ConfigError
from lingua.launch import eval_jobs
from tests.conftest import REPO, read_metrics, run_python, slurm_is_up, tiny_args

NO_SLURM = slurm_is_up()
REQUIRED = os.environ.get("LINGUA_REQUIRE_SLURM") == "1"
slurm = pytest.mark.skipif(bool(NO_SLURM) and not REQUIRED, reason=NO_SLURM or "-")
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
TASK = "lingua_continuation"
ACC = f"eval/{TASK}/acc"
SECRET = "lingua-eval-secret-4b1d"


def async_args(corpus, dump, *extra, steps=4):
    """A tiny LLaMA whose checkpoints of steps 2, 4, ... are evaluated by Slurm jobs."""
    return tiny_args(corpus, dump, "model.max_seq_len=512", "eval.mode=async",
                     f"eval.tasks=[{TASK}]", "eval.limit=8", "eval.every=2", "checkpoint.every=2",
                     "eval.slurm.partition=debug", "eval.slurm.time=10",
                     "eval.slurm.cpus_per_task=1", *extra, steps=steps)


def load_args(overrides):
    from apps.llama import train

    return train.load_config(overrides, check=False)


def train(args, check=True, bypass_check=False, env_extra=None) -> subprocess.CompletedProcess:
    """apps.llama.train in its own process; bypass_check skips eval_jobs.check_async, so that a
    submission can fail at the evaluation step as it would on a cluster that changed meanwhile."""
    env = dict(os.environ, PYTHONPATH=str(REPO), **OFFLINE, **(env_extra or {}))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    code = ("from lingua.launch import eval_jobs; "
            + ("eval_jobs.check_async = lambda args: None; " if bypass_check else "")
            + "from apps.llama import train; from lingua.launch import run; "
            "run.exit_cli(train.main)")
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    if check and proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def job_field(job_id: str, name: str) -> str:
    from tests.test_slurm import job_field as field

    return field(job_id, name)


def wait_for(job_id: str, logs: Path, timeout: float = 240) -> str:
    """The job's final state; a requeued job (held by Slurm for ~2 minutes) is released."""
    from tests.test_slurm import wait_for as wait

    return wait(job_id, timeout=timeout, logs=logs)


def job_log(dump, step: int) -> str:
    folder = eval_jobs.step_dir(dump, step) / "slurm"
    return "\n".join(f"== {p.name}\n{p.read_text()}" for p in sorted(folder.glob("*_log.*")))


def wait_for_line(dump, step: int, text: str, job_id: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        log = job_log(dump, step)
        if text in log:
            return log
        assert job_field(job_id, "JobState") in ("PENDING", "RUNNING"), log
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in the job's log after {timeout}s:\n{job_log(dump, step)}")


def results(dump, step: int) -> dict:
    return json.loads((eval_jobs.step_dir(dump, step) / "results.json").read_text())


def eval_rows(dump) -> list:
    return [row for row in read_metrics(dump) if ACC in row]


def saved_steps(dump) -> list:
    return sorted(int(p.name) for p in (Path(dump) / "checkpoints").iterdir() if p.name.isdigit())


def copy_run(src, dest) -> Path:
    """The run's config and checkpoints, without its evaluations."""
    dest.mkdir(parents=True)
    shutil.copy2(src / "config.yaml", dest / "config.yaml")
    shutil.copytree(src / "checkpoints", dest / "checkpoints")
    return dest


# ---------------------------------------------------------------------------------------------
# Against Slurm


@pytest.fixture(scope="module")
def async_run(corpus, tmp_path_factory):
    """One run (steps 1-4, evaluated at 2 and 4 by jobs, checkpoint.keep=1), trained locally;
    what was on disk when training returned, and the jobs' final states."""
    if NO_SLURM:
        pytest.fail(NO_SLURM)
    dump = tmp_path_factory.mktemp("async") / "run"
    proc = train(async_args(corpus, dump, "checkpoint.keep=1"), env_extra={"WANDB_API_KEY": SECRET})
    # Read at once: the job of the last step was submitted a moment before training returned.
    at_return = {step: (eval_jobs.step_dir(dump, step) / "results.json").exists()
                 for step in (2, 4)}
    steps_at_return = saved_steps(dump)
    markers_at_return = sorted(int(p.parent.name) for p in (dump / "evals").glob("*/pending"))
    jobs = {step: json.loads((eval_jobs.step_dir(dump, step) / "job.json").read_text())
            for step in (2, 4)}
    states = {step: wait_for(job["job_id"], eval_jobs.step_dir(dump, step) / "slurm")
              for step, job in jobs.items()}
    return dict(dump=dump, stdout=proc.stdout, at_return=at_return, jobs=jobs, states=states,
                steps_at_return=steps_at_return, markers_at_return=markers_at_return)


@pytest.mark.slurm
@pytest.mark.slow
@slurm
def test_async_jobs_evaluate_each_checkpoint_while_training_goes_on(async_run, tmp_path,
                                                                    monkeypatch):
    dump, jobs = async_run["dump"], async_run["jobs"]
    logs = {step: job_log(dump, step) for step in (2, 4)}
    assert async_run["states"] == {2: "COMPLETED", 4: "COMPLETED"}, logs
    # The training never waited: it returned before its last checkpoint had results.
    assert async_run["at_return"][4] is False
    for step in (2, 4):
        assert (f"step {step}: evaluation job {jobs[step]['job_id']} submitted"
                in async_run["stdout"])
        assert jobs[step]["step"] == step and jobs[step]["tasks"] == [TASK]
        assert jobs[step]["world_size"] == 1
        assert jobs[step]["logs"] == str(dump / "evals" / str(step) / "slurm")
        assert jobs[step]["checkpoint"] == str(dump / "checkpoints" / str(step))
        assert jobs[step]["by_hand"] == (f"python -m apps.llama.eval {dump}/checkpoints/{step} "
                                         f"'eval.tasks=[{TASK}]'")
        assert f"eval job: step {step}, rank 0 of 1, attempt 1 " in logs[step], logs[step]
    # The step-2 checkpoint outlived checkpoint.keep=1 while its job was pending: the job read
    # it (its results are there), then dropped the marker.
    assert async_run["steps_at_return"] == [2, 4]
    assert async_run["markers_at_return"] == [2, 4]
    assert not list((dump / "evals").glob("*/pending"))
    for step in (2, 4):
        got = results(dump, step)
        assert sorted(got["results"]) == [TASK]
        assert len(got["runs"]) == 1 and got["runs"][0]["tasks"] == [TASK], got["runs"]
        assert got["runs"][0]["world_size"] == 1 and got["runs"][0]["limit"] == 8
        assert got["runs"][0]["checkpoint"] == str(dump / "checkpoints" / str(step))
    rows = eval_rows(dump)
    assert sorted(row["step"] for row in rows) == [2, 4], rows
    for row in rows:
        assert row[ACC] == results(dump, row["step"])["results"][TASK]["acc,none"]
    # The environment reached the jobs through Slurm only, never through a file of ours.
    for path in (dump / "evals").rglob("*"):
        assert not (path.is_file() and SECRET.encode() in path.read_bytes()), path
    # The training's own rows are all there, once each, beside the jobs' rows.
    assert [row["step"] for row in read_metrics(dump) if "loss" in row] == [1, 2, 3, 4]

    # A direct evaluation of the same checkpoint in a copy of the run gives the same numbers.
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    copy = copy_run(dump, tmp_path / "copy")
    proc = run_python("apps.llama.eval", [str(copy / "checkpoints" / "4"), f"eval.tasks=[{TASK}]"])
    assert f"results: {copy / 'evals' / '4' / 'results.json'}" in proc.stdout
    assert results(copy, 4)["results"] == results(dump, 4)["results"]
    assert results(copy, 4)["runs"][0]["limit"] == 8   # the run's eval.limit, from the checkpoint


def submit_cases(async_run, corpus, tmp_path, monkeypatch, wanted) -> tuple:
    """Jobs on copies of the run, from a process with a launcher's variables (a training rank):
    the job's tasks still take their ranks and rendezvous from their own Slurm step.
    {name: (dump, step, max_requeues, tasks)} of `wanted`, and their job ids."""
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    for key, value in (("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "3"),
                       ("MASTER_ADDR", "nowhere.invalid"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    src = async_run["dump"]
    copies = {}
    def copy(name):
        if name not in copies:
            copies[name] = copy_run(src, tmp_path / name)
        return copies[name]
    every = {"requeued": lambda: (copy("requeued"), 4, 1, 1),
             "crashed": lambda: (copy("crashed"), 4, 1, 2),
             "exhausted": lambda: (copy("crashed"), 2, 0, 1)}   # dump, step, max_requeues, tasks
    cases = {name: every[name]() for name in wanted}
    jobs = {}
    for name, (dump, step, max_requeues, tasks) in cases.items():
        args = load_args(async_args(corpus, dump, "checkpoint.keep=1",
                                    f"eval.slurm.max_requeues={max_requeues}",
                                    f"eval.slurm.tasks_per_node={tasks}"))
        jobs[name] = eval_jobs.submit(args, "apps.llama", step, dump / "checkpoints" / str(step))
        assert jobs[name] is not None and eval_jobs.pending_marker(dump, step).exists()
    return src, cases, jobs


def assert_retried(src, cases, jobs, name) -> str:
    """The job `name` completed on its second attempt, every rank evaluated again, and the step's
    results were computed and written once; its log."""
    dump, step, _, tasks = cases[name]
    state = wait_for(jobs[name], eval_jobs.step_dir(dump, step) / "slurm")
    log = job_log(dump, step)
    assert state == "COMPLETED", log
    assert job_field(jobs[name], "Restarts") == "1", log
    for rank in range(tasks):
        assert f"eval job: step {step}, rank {rank} of {tasks}, attempt 2 " in log
    got = results(dump, step)
    assert len(got["runs"]) == 1, got["runs"]     # computed and written once
    assert got["runs"][0]["world_size"] == tasks
    assert got["results"] == results(src, step)["results"]
    assert [row["step"] for row in eval_rows(dump)] == [step]
    assert not eval_jobs.pending_marker(dump, step).exists()
    return log


@pytest.mark.slurm
@pytest.mark.slow
@slurm
def test_a_job_requeued_while_it_evaluates_evaluates_once(async_run, corpus, tmp_path,
                                                          monkeypatch):
    """One job requeued by Slurm while it evaluates (what preemption does) runs again and writes
    the results once; requeued again after it finished, it computes and writes nothing."""
    src, cases, jobs = submit_cases(async_run, corpus, tmp_path, monkeypatch, ["requeued"])
    try:
        requeued = cases["requeued"][0]
        wait_for_line(requeued, 4, "eval job: step 4, rank 0 of 1, attempt 1 ", jobs["requeued"])
        assert not (eval_jobs.step_dir(requeued, 4) / "results.json").exists()
        subprocess.run(["scontrol", "requeue", jobs["requeued"]], check=True)
        log = assert_retried(src, cases, jobs, "requeued")
        assert "got SIGTERM" in log and "exited with -15: stop" in log
        # Run once more after it finished (a finished job can be requeued): the step has its
        # results, so the job computes and writes nothing.
        subprocess.run(["scontrol", "requeue", jobs["requeued"]], check=True)
        assert wait_for(jobs["requeued"], eval_jobs.step_dir(requeued, 4) / "slurm") == \
            "COMPLETED"
        assert job_field(jobs["requeued"], "Restarts") == "2"
        again = job_log(requeued, 4)
        assert "eval job: step 4, rank 0 of 1, attempt 3 " in again, again
        assert f"step 4 already has results for ['{TASK}']" in again, again
        assert len(results(requeued, 4)["runs"]) == 1
        assert [row["step"] for row in eval_rows(requeued)] == [4]
    finally:  # none left queued or held when an assertion failed
        subprocess.run(["scancel", *jobs.values()], capture_output=True)


@pytest.mark.slurm
@pytest.mark.slow
@slurm
def test_killed_evaluations_are_retried_then_given_up(async_run, corpus, tmp_path, monkeypatch):
    """A 2-task job whose rank-1 evaluation process is killed (a crash: the OOM killer, say) is
    retried; one killed with no retry left is given up."""
    src, cases, jobs = submit_cases(async_run, corpus, tmp_path, monkeypatch,
                                    ["crashed", "exhausted"])
    try:
        # Each evaluation process is killed as soon as it started (they start as CPUs free up).
        to_kill, deadline = {"exhausted": "rank 0 of 1", "crashed": "rank 1 of 2"}, \
            time.time() + 120
        while to_kill:
            for name, rank in list(to_kill.items()):
                dump, step = cases[name][:2]
                started = re.search(rf"step {step}, {rank}, attempt 1 "
                                    rf"\(eval.slurm.max_requeues=\d\): process (\d+) runs",
                                    job_log(dump, step))
                if started:
                    os.kill(int(started.group(1)), signal.SIGKILL)
                    del to_kill[name]
            assert time.time() < deadline, {name: job_log(*cases[name][:2]) for name in to_kill}
            time.sleep(0.1)
        crashed_log = assert_retried(src, cases, jobs, "crashed")
        # The killed rank requeued the job, once; its peer's end (killed with the step) did not.
        assert "rank 1: the evaluation exited with -9: requeue" in crashed_log, crashed_log
        assert crashed_log.count(
            f"requeueing job {jobs['crashed']} (requeue 1 of at most 1)") == 1
        # No retry left: given up, the marker gone (the checkpoint may be pruned), the way by
        # hand said.
        crashed = cases["exhausted"][0]
        state = wait_for(jobs["exhausted"], eval_jobs.step_dir(crashed, 2) / "slurm")
        gave_up = job_log(crashed, 2)
        assert state == "FAILED", gave_up
        assert job_field(jobs["exhausted"], "Restarts") == "0"
        assert "exited with -9: give_up" in gave_up, gave_up
        assert ("giving up on step 2: exit code -9 after 0 requeue(s) (eval.slurm.max_requeues=0)"
                in gave_up), gave_up
        assert f"python -m apps.llama.eval {crashed}/checkpoints/2 'eval.tasks=[{TASK}]'" \
            in gave_up
        assert not eval_jobs.pending_marker(crashed, 2).exists()
        assert not (eval_jobs.step_dir(crashed, 2) / "results.json").exists()
    finally:  # none left queued or held when an assertion failed
        subprocess.run(["scancel", *jobs.values()], capture_output=True)


@pytest.mark.slurm
@slurm
def test_a_refused_submission_is_a_warning_and_training_finishes(corpus, tmp_path):
    if NO_SLURM:
        pytest.fail(NO_SLURM)
    dump = tmp_path / "refused"
    proc = train(async_args(corpus, dump, "eval.slurm.partition=nonexistent"), bypass_check=True)
    assert proc.returncode == 0
    for step in (2, 4):
        assert (f"the evaluation job of step {step} was not submitted (FailedJobError"
                in proc.stdout), proc.stdout[-3000:]
        assert (f"evaluate that checkpoint by hand: python -m apps.llama.eval "
                f"{dump}/checkpoints/{step} 'eval.tasks=[{TASK}]'") in proc.stdout
        assert not eval_jobs.step_dir(dump, step).joinpath("pending").exists()
        assert not eval_jobs.step_dir(dump, step).joinpath("job.json").exists()
    assert [row["step"] for row in read_metrics(dump)] == [1, 2, 3, 4]
    # Without the bypass the same config is refused before training, naming the partitions.
    with pytest.raises(ConfigError, match=r"eval.slurm.partition='nonexistent' does not exist.*"
                                          r"debug.*eval.slurm.partition out"):
        eval_jobs.check_async(load_args(async_args(corpus, dump,
                                                   "eval.slurm.partition=nonexistent")))
    # ... and so is a job no node of the partition can hold (it would pend forever).
    # One more than the node declares (setup/slurm_local.sh declares a CPU beyond the machine's).
    too_many = int(subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True,
                                  check=True).stdout.split()[0]) + 1
    with pytest.raises(ConfigError, match=rf"No node can hold this job: eval.slurm.tasks_per_node="
                                          rf"{too_many}"):
        eval_jobs.check_async(load_args(async_args(corpus, dump,
                                                   f"eval.slurm.tasks_per_node={too_many}")))


# ---------------------------------------------------------------------------------------------
# Without a cluster


@pytest.mark.slow
def test_without_slurm_the_submission_is_a_warning_and_training_finishes(corpus, tmp_path):
    dump = tmp_path / "noslurm"
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = train(async_args(corpus, dump), bypass_check=True, env_extra={"PATH": str(empty)})
    assert proc.returncode == 0
    for step in (2, 4):
        assert f"the evaluation job of step {step} was not submitted (RuntimeError" in proc.stdout
        assert (f"evaluate that checkpoint by hand: python -m apps.llama.eval "
                f"{dump}/checkpoints/{step} 'eval.tasks=[{TASK}]'") in proc.stdout
    assert not list(dump.glob("evals/*/pending")) and not list(dump.glob("evals/*/job.json"))
    assert [row["step"] for row in read_metrics(dump)] == [1, 2, 3, 4]
    assert saved_steps(dump) == [2, 4]


@pytest.mark.parametrize("extra, message", [
    (["checkpoint.every=0"], "eval.every=2 with checkpoint.every=0: no checkpoint is saved at the "
                             "evaluation steps. Set checkpoint.every=2 .*eval.mode=inline"),
    (["eval.every=3"], r"eval.every=3 is not a multiple of checkpoint.every=2.*eval.every=2\b.*"
                       r"checkpoint.every to a divisor of 3"),
    (["steps=5", "checkpoint.save_final=false"],
     "eval.at_end=true with checkpoint.save_final=false.*Set checkpoint.save_final=true, or "
     "eval.at_end=false"),
    (["eval.slurm.time=0"], r"eval.slurm.time=0 must be at least 1\.$"),
    (["eval.slurm.signal_delay_s=600", "eval.slurm.time=5"],
     "eval.slurm.signal_delay_s=600 is not shorter than eval.slurm.time=5 minutes.*Lower "
     "eval.slurm.signal_delay_s or raise eval.slurm.time"),
    (["eval.slurm.gpus_per_node=4", "eval.slurm.tasks_per_node=2"],
     "eval.slurm.tasks_per_node=2 with eval.slurm.gpus_per_node=4 leaves 2 GPU"),
])
def test_check_async_names_the_fix(corpus, tmp_path, extra, message):
    args = load_args(async_args(corpus, tmp_path / "x", *extra))
    with pytest.raises(ConfigError, match=message):
        eval_jobs.check_async(args)


def test_check_async_needs_sbatch_and_accepts_saved_steps(corpus, tmp_path, monkeypatch):
    # The last step is a checkpoint step without save_final when steps is a multiple of every.
    args = load_args(async_args(corpus, tmp_path / "x", "checkpoint.save_final=false"))
    assert eval_jobs.evaluated_steps_are_saved(args) is None
    args = load_args(async_args(corpus, tmp_path / "x", "eval.every=4", "eval.at_end=false"))
    assert eval_jobs.evaluated_steps_are_saved(args) is None
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="eval.mode=async submits each evaluation as a Slurm job, "
                                          "and sbatch is not on PATH.*eval.mode=inline"):
        eval_jobs.check_async(args)


@pytest.mark.slow
def test_the_trainer_refuses_async_steps_without_checkpoints(corpus, tmp_path):
    proc = train(async_args(corpus, tmp_path / "bad", "eval.every=3"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "eval.every=3 is not a multiple of checkpoint.every=2" in proc.stderr
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("code, signals, restarts, max_requeues, action", [
    (0, [], 0, 1, "done"),
    (0, [signal.SIGTERM], 0, 1, "done"),            # finished as the signal came
    (-15, [signal.SIGTERM], 0, 1, "stop"),          # requeued or cancelled by Slurm
    (1, [signal.SIGTERM], 5, 1, "stop"),
    (-12, [signal.SIGUSR2], 0, 1, "requeue"),       # time limit
    (-12, [signal.SIGUSR2], 1, 1, "give_up"),
    (1, [], 0, 1, "requeue"),                       # crash
    (-9, [], 2, 3, "requeue"),
    (1, [], 1, 1, "give_up"),
    (2, [], 0, 5, "give_up"),                       # ConfigError: the same again would fail
])
def test_what_a_task_does_after_its_evaluation(code, signals, restarts, max_requeues, action):
    assert eval_jobs.decide(code, signals, restarts, max_requeues) == action


def test_pruning_keeps_checkpoints_with_a_pending_evaluation(tmp_path):
    root = checkpoint.checkpoints_dir(tmp_path)
    for step in (1, 2, 3, 4):
        (root / str(step)).mkdir(parents=True)
        # intact (no manifest: damaged, set aside)
        integrity.write_manifest(root / str(step))
    (root / "5.tmp-abcd").mkdir()
    marker = eval_jobs.pending_marker(tmp_path, 2)
    marker.parent.mkdir(parents=True)
    marker.touch()
    (tmp_path / "evals" / "3").mkdir()      # results written, marker gone
    in_use = eval_jobs.checkpoint_in_use(tmp_path)
    integrity.prune(root, keep=1, in_use=in_use)
    assert sorted(p.name for p in root.iterdir()) == ["2", "4", "5.tmp-abcd"]
    marker.unlink()
    integrity.prune(root, keep=1, in_use=in_use)
    assert sorted(p.name for p in root.iterdir()) == ["4", "5.tmp-abcd"]
    integrity.prune(root, keep=0, in_use=in_use)         # keep all
    assert sorted(p.name for p in root.iterdir()) == ["4", "5.tmp-abcd"]


def test_job_layout_and_values(corpus, tmp_path):
    args = load_args(async_args(corpus, tmp_path / "x", "eval.slurm.nodes=2",
                                "eval.slurm.gpus_per_node=4", "eval.num_fewshot=3",
                                "eval.slurm.cpus_per_task=0", "distributed.tp=2"))
    s = eval_jobs.job_slurm_args(args.eval.slurm)
    assert (s.nodes, s.tasks_per_node, s.cpus_per_task) == (2, 4, 8)   # stool's fills
    assert args.eval.slurm.tasks_per_node == 0                          # the run's args untouched
    overrides = eval_jobs.job_overrides(args, 8)
    assert overrides == ['eval.mode="inline"', f'eval.tasks=["{TASK}"]', "eval.limit=8.0",
                         "eval.batch_size=8", "eval.num_fewshot=3", "eval.max_gen_tokens=256",
                         "eval.add_bos=true", "eval.include_path=null",
                         "eval.log_samples=false", "distributed.dp_shard=8",
                         "distributed.dp_replicate=1", "distributed.tp=1", "distributed.pp=1",
                         "distributed.cp=1", "distributed.ep=1", "distributed.pp_split=[]",
                         "distributed.pp_virtual_stages=1"]
    assert eval_jobs.code_dir(tmp_path / "x") == REPO            # no snapshot: this checkout
    (tmp_path / "x" / "code" / "lingua").mkdir(parents=True)
    assert eval_jobs.code_dir(tmp_path / "x") == tmp_path / "x" / "code"
