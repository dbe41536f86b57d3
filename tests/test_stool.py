"""stool without a cluster: validation before submission, the dry-run batch script, sweeps,
dump-dir reuse, quoting; and the stop-on-signal path of the trainer under torchrun and alone.
The same code against a real Slurm is in test_slurm.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lingua import distributed, stool
from lingua.errors import ConfigError
from tests.conftest import REPO, free_port, read_metrics, run_python, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows


def run_stool(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "lingua.stool", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_prints_the_batch_script_and_writes_nothing(corpus, tmp_path):
    dump = tmp_path / "dry"
    proc = run_stool("apps.llama.train", *tiny_args(corpus, dump, "distributed.dp_shard=4"),
                     "slurm.dry_run=true", "slurm.nodes=2", "slurm.tasks_per_node=2",
                     "slurm.partition=gpu", "slurm.time=90", "slurm.signal_delay_s=300",
                     "slurm.mem=64G", "slurm.qos=high", "slurm.account=lab",
                     "slurm.constraint=a100", "slurm.exclude='node[1-3]'", "slurm.cpus_per_task=4",
                     env_extra={"WANDB_API_KEY": "secret-value-123"})
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --partition=gpu",
                 "#SBATCH --time=90", "#SBATCH --signal=USR2@300", "#SBATCH --mem=64G",
                 "#SBATCH --qos=high", "#SBATCH --account=lab", "#SBATCH --constraint=a100",
                 "#SBATCH --exclude='node[1-3]'", "#SBATCH --cpus-per-task=4",
                 "#SBATCH --requeue", f"cd {dump / 'code'}", "srun --unbuffered",
                 "submitit.core._submit", "# dry run: nothing written, nothing submitted"):
        assert line in script, f"{line!r} missing from:\n{script}"
    assert "--gpus-per-node" not in script  # CPU job: no GPU request
    assert "secret-value-123" not in script
    assert not dump.exists()


def test_without_slurm_a_dry_run_works_and_a_submission_is_a_clear_error(corpus, tmp_path):
    """A laptop or a login node without Slurm's commands: the dry run still prints the script
    (submitit's executor refuses to start without srun), a real submission names the problem."""
    import shutil as sh

    bare = tmp_path / "bin"   # PATH with python but no srun/sbatch/sinfo
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    if sh.which("git"):
        (bare / "git").symlink_to(sh.which("git"))
    dump = tmp_path / "noslurm"
    no_slurm = {"PATH": str(bare)}
    proc = run_stool("apps.llama.train", *tiny_args(corpus, dump), "slurm.dry_run=true",
                     env_extra=no_slurm)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=1" in proc.stdout and "dry run: nothing written" in proc.stdout
    proc = run_stool("apps.llama.train", *tiny_args(corpus, dump), env_extra=no_slurm)
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not dump.exists()


def test_bad_config_fails_before_anything_is_queued(corpus, tmp_path):
    dump = tmp_path / "bad"
    proc = run_stool("apps.llama.train", *tiny_args(corpus, dump), "optim.lrr=1")
    assert proc.returncode == 2 and "optim.lrr" in proc.stderr
    # The layout is checked for the job's world size (2 tasks), not this process's (1).
    proc = run_stool("apps.llama.train", *tiny_args(corpus, dump, "distributed.tp=2",
                                                    "distributed.dp_shard=2"),
                     "slurm.tasks_per_node=2", "slurm.dry_run=true")
    assert proc.returncode == 2 and "but 2 processes" in proc.stderr, proc.stderr
    proc = run_stool("apps.llama.train", *tiny_args(corpus, dump, "distributed.dp_shard=2"),
                     "slurm.tasks_per_node=2", "slurm.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    proc = run_stool("apps.nope.train", "slurm.dry_run=true")
    assert proc.returncode == 2 and "apps.nope.train" in proc.stderr
    proc = run_stool()
    assert proc.returncode == 2 and "usage: stool" in proc.stderr
    assert not dump.exists()


@pytest.mark.parametrize("override, message", [
    ("slurm.mem=lots", "slurm.mem='lots'"),
    ("slurm.signal_delay_s=600", "slurm.signal_delay_s=600"),
    ("slurm.nodes=0", "slurm.nodes=0"),
    ("slurm.gpus_per_node=2", "slurm.tasks_per_node=4 is more than slurm.gpus_per_node=2"),
])
def test_bad_slurm_values_are_named(override, message):
    from apps.llama import train

    args = train.load_config(["slurm.time=10", "slurm.tasks_per_node=4", override], check=False)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        stool.validate_slurm_args(args.slurm)


def test_gpu_job_is_validated_for_cuda_on_a_cpu_login_node(corpus, tmp_path):
    # nccl is refused for a CPU job, accepted for a job that asks for GPUs.
    args = tiny_args(corpus, tmp_path / "gpu", "distributed.backend=nccl", "distributed.dp_shard=8")
    proc = run_stool("apps.llama.train", *args, "slurm.tasks_per_node=8", "slurm.dry_run=true")
    assert proc.returncode == 2 and "nccl needs CUDA" in proc.stderr
    proc = run_stool("apps.llama.train", *args, "slurm.tasks_per_node=8",
                     "slurm.gpus_per_node=8", "slurm.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --gpus-per-node=8" in proc.stdout


def test_sweep_plan_names_one_dump_dir_per_combination(corpus, tmp_path):
    from apps.llama import train

    base = tmp_path / "sweep"
    subs = stool.plan(train, [*tiny_args(corpus, base), "optim.lr=1e-3,3e-3", "seed=1,2"],
                      multirun=True)
    names = [s.dump_dir.relative_to(base).as_posix() for s in subs]
    assert names == ["optim.lr=0.001,seed=1", "optim.lr=0.001,seed=2",
                     "optim.lr=0.003,seed=1", "optim.lr=0.003,seed=2"]
    assert [(s.args.optim.lr, s.args.seed) for s in subs] == [
        (1e-3, 1), (1e-3, 2), (3e-3, 1), (3e-3, 2)]
    # Without --multirun a sweep is a mistake Hydra names.
    with pytest.raises(ConfigError):
        stool.plan(train, [*tiny_args(corpus, base), "optim.lr=1e-3,3e-3"], multirun=False)


def test_values_with_quotes_spaces_and_semicolons_survive(corpus, tmp_path, monkeypatch):
    from apps.llama import train

    monkeypatch.chdir(tmp_path)
    odd = """it's "odd"; rm -rf / $(x) \\ end"""
    subs = stool.plan(train, [*tiny_args(corpus, "relative dir/run"),
                              "logging.name=" + stool.hydra_quote(odd)], multirun=False)
    [sub] = subs
    assert sub.args.logging.name == odd
    assert sub.dump_dir == tmp_path / "relative dir" / "run"  # made absolute for the job
    # What the job composes from the pickled overrides is the same config.
    again = train.load_config(sub.overrides, check=False)
    assert again.logging.name == odd and Path(again.dump_dir) == sub.dump_dir


def test_reusing_a_dump_dir_with_another_config_is_refused(corpus, tmp_path):
    from apps.llama import train
    from lingua import config

    dump = tmp_path / "used"
    [sub] = stool.plan(train, tiny_args(corpus, dump), multirun=False)
    config.dump(sub.args, dump / "config.yaml")
    stool.check_dump_dir(sub)  # same config: resubmitting resumes, allowed
    [same_but_slurm] = stool.plan(train, [*tiny_args(corpus, dump), "slurm.time=5"], False)
    stool.check_dump_dir(same_but_slurm)  # only slurm.* differs: allowed
    [other] = stool.plan(train, [*tiny_args(corpus, dump), "optim.lr=1e-2"], multirun=False)
    with pytest.raises(ConfigError, match=r"optim.lr \(0.003 -> 0.01\).*slurm.reuse_dump_dir=true"):
        stool.check_dump_dir(other)
    [forced] = stool.plan(train, [*tiny_args(corpus, dump), "optim.lr=1e-2",
                                  "slurm.reuse_dump_dir=true"], multirun=False)
    stool.check_dump_dir(forced)
    assert OmegaConf.load(dump / "config.yaml").optim.lr == 3e-3  # nothing was overwritten


def test_code_snapshot_holds_the_tracked_code(tmp_path):
    dest = tmp_path / "code"
    n = stool.snapshot_code(dest)
    assert n > 20
    for rel in ("lingua/stool.py", "apps/llama/train.py", "configs/llama/debug.yaml",
                "pyproject.toml"):
        assert (dest / rel).read_bytes() == (REPO / rel).read_bytes()
    assert not (dest / ".venv").exists() and not list(dest.rglob("__pycache__"))
    stool.snapshot_code(dest)  # a resubmission replaces it whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code"]


def test_rank_variables_come_from_a_slurm_step(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x2)")
    monkeypatch.setenv("SLURM_PROCID", "11")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setenv("SLURM_NODEID", "1")
    got = distributed.slurm_step_vars()
    assert got == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 4242 % 20000)}
    # A batch script's own shell is one process, whatever the job's task count.
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert distributed.slurm_step_vars() == {}
    # torchrun's variables win over Slurm's (srun ... torchrun ...).
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.world_size_from_env() == 2


def _wait_for_rows(dump: Path, n: int, proc: subprocess.Popen, hang_guard_s: float = 900) -> None:
    # The guard only ends a hung run (steps take well under a second); it is no speed check.
    deadline = time.time() + hang_guard_s
    while not ((dump / "metrics.jsonl").is_file() and len(read_metrics(dump)) >= n):
        assert proc.poll() is None, proc.communicate()
        if time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no {n} logged steps after {hang_guard_s} s: the run hangs")
        time.sleep(0.2)


@pytest.mark.distributed
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(corpus, tmp_path):
    """SIGUSR2 reaches rank 1 only: both ranks agree, save one checkpoint and stop (exit 3); the
    same command then resumes there and ends with the losses of an uninterrupted run."""
    steps = 40
    dump = tmp_path / "signalled"
    args = tiny_args(corpus, dump, "distributed.dp_shard=2", "checkpoint.keep=0", steps=steps)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "apps.llama.train",
           *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    _wait_for_rows(dump, 3, proc)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                             text=True).stdout.split()
    assert len(workers) == 2
    rank1 = [pid for pid in workers
             if "RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
             .split("\0")]
    os.kill(int(rank1[0]), signal.SIGUSR2)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out  # stopped early is not success
    assert "stopped by a signal after step" in out and "run the same command again" in out
    saved = [int(p.name) for p in (dump / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and 3 <= saved[0] < steps, out
    first = read_rows(dump)

    env_resume = dict(env)
    proc = subprocess.run(cmd[:4] + [f"--master-port={free_port()}"] + cmd[5:], cwd=REPO,
                          env=env_resume, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_resumed(dump, proc.stdout + proc.stderr, saved[0], first)
    ref = tmp_path / "reference"
    run_python("apps.llama.train", tiny_args(corpus, ref, "data.batch_size=16", steps=steps))
    assert_equivalent(dump, ref)  # 2 ranks vs 1 process: same batch, sums in another order


def test_sigterm_saves_and_exits_with_the_stopped_code(corpus, tmp_path):
    dump = tmp_path / "term"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen([sys.executable, "-m", "apps.llama.train",
                             *tiny_args(corpus, dump, steps=1000)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_rows(dump, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    [saved] = [int(p.name) for p in (dump / "checkpoints").iterdir() if p.name.isdigit()]
    assert [row["step"] for row in read_metrics(dump)][-1] == saved
