"""stool without a cluster: validation before submission, the dry-run batch script, sweeps,
dump-dir reuse, quoting; and the stop-on-signal path of the trainer under torchrun and alone.
The same code against a real Slurm is in test_slurm.py."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lingua.errors import ConfigError
from lingua.launch import slurm, stool
from lingua.parallel import distributed
from tests import launcher
from tests.conftest import REPO, free_port, read_metrics, run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows

# What stool's checks see of "the cluster" here: a made-up one, whatever Slurm this machine runs
# (the local one has 2 CPUs and no GPUs; test_slurm.py checks against it). The GRES and memory
# strings are as real sinfo prints them on big clusters. The default partition is gpu.
FAKE_SINFO = """gpu001|gpu*|224|2000000|gpu:h100:8(S:0-1)
gpu002|gpu*|224|2000000|gpu:h100:8(S:0-1)
cpu01|cpu|64|257000|(null)
cpu02|cpu|64|257000+|(null)
"""


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory) -> Path:
    """A folder with a `sinfo` that prints FAKE_SINFO, and one that fails, for PATH."""
    root = tmp_path_factory.mktemp("fake_slurm")
    for name, body in (("bin", f"cat <<'EOF'\n{FAKE_SINFO}EOF\n"),
                       ("broken", "echo 'sinfo: error: Unable to contact slurm controller' >&2\n"
                                  "exit 1\n")):
        (root / name).mkdir()
        (root / name / "sinfo").write_text("#!/bin/sh\n" + body)
        (root / name / "sinfo").chmod(0o755)
    return root


@pytest.fixture(autouse=True)
def _fake_cluster(fake_bin, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_bin / 'bin'}{os.pathsep}{os.environ['PATH']}")


def run_stool(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    env.pop("WORLD_SIZE", None)
    return launcher.launch("lingua.launch.stool", list(args), 0, env, REPO, timeout=120)


@pytest.mark.slow
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
                 # srun of Slurm 22.05-23.02 does not take --cpus-per-task from the job.
                 "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-4}",
                 "submitit.core._submit", "# dry run: nothing written, nothing submitted",
                 "# resources checked against `sinfo`",
                 "# plan at 4 processes (cpu)", "dp_shard=4", "fits"):
        assert line in script, f"{line!r} missing from:\n{script}"
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    assert " --kill-on-bad-exit=1 " in srun  # one crashed rank ends the job, no NCCL-timeout hang
    assert "--gpus-per-node" not in script  # CPU job: no GPU request
    assert "--wckey" not in script  # submitit's --wckey=submitit, refused where wckeys are enforced
    assert "secret-value-123" not in script
    assert not dump.exists()


def _sbatch_lines(script: str) -> dict:
    return dict(line[len("#SBATCH --"):].split("=", 1) for line in script.splitlines()
                if line.startswith("#SBATCH --") and "=" in line)


@pytest.mark.slow
def test_a_gpu_job_gets_one_task_per_gpu_and_cpus_for_each(corpus, tmp_path):
    """slurm.gpus_per_node=8 alone: 8 tasks a node (not 1 with 7 GPUs idle), validated as a world
    of nodes x 8, and 8 CPUs a task (not the cluster default, often 1)."""
    args = tiny_args(corpus, tmp_path / "gpu", "distributed.backend=nccl")
    proc = run_stool("apps.llama.train", *args, "distributed.dp_shard=16", "slurm.nodes=2",
                     "slurm.gpus_per_node=8", "slurm.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    sbatch = _sbatch_lines(proc.stdout)
    assert (sbatch["nodes"], sbatch["gpus-per-node"], sbatch["ntasks-per-node"],
            sbatch["cpus-per-task"]) == ("2", "8", "8", str(slurm.GPU_JOB_CPUS)), proc.stdout
    srun_cpus = f"export SRUN_CPUS_PER_TASK=${{SLURM_CPUS_PER_TASK:-{slurm.GPU_JOB_CPUS}}}"
    assert srun_cpus in proc.stdout
    # The values stool picked reach the job with the other overrides (and its config.yaml).
    [would_run] = [line for line in proc.stdout.splitlines() if line.startswith("# would run:")]
    assert would_run.endswith(f"slurm.tasks_per_node=8 slurm.cpus_per_task={slurm.GPU_JOB_CPUS}")
    # The layout is checked for the 16 processes the defaults give, not for 2 x 1.
    proc = run_stool("apps.llama.train", *args, "distributed.dp_shard=2", "slurm.nodes=2",
                     "slurm.gpus_per_node=8", "slurm.dry_run=true")
    assert proc.returncode == 2 and "but 16 processes" in proc.stderr, proc.stderr


def _script(overrides: list, tmp_path: Path) -> str:
    """The batch script for these overrides, in-process (what the dry run prints)."""
    from apps.llama import train

    [sub] = stool.plan(train, overrides, multirun=False)
    executor = slurm.make_executor(sub.args.slurm, tmp_path / "slurm", tmp_path / "code", "t")
    return stool.batch_script(executor, 1)


def test_given_slurm_values_win_and_a_cpu_job_keeps_one_task(corpus, tmp_path):
    args = tiny_args(corpus, tmp_path / "run", "distributed.backend=nccl", "distributed.dp_shard=4")
    script = _script([*args, "slurm.gpus_per_node=4", "slurm.cpus_per_task=12",
                      "slurm.wckey=proj-7", "slurm.dry_run=true"], tmp_path)
    sbatch = _sbatch_lines(script)
    assert (sbatch["ntasks-per-node"], sbatch["cpus-per-task"], sbatch["wckey"]) == (
        "4", "12", "proj-7"), script
    script = _script([*tiny_args(corpus, tmp_path / "cpu"), "slurm.dry_run=true"], tmp_path)
    sbatch = _sbatch_lines(script)
    assert sbatch["ntasks-per-node"] == "1" and "cpus-per-task" not in sbatch, script
    assert "SRUN_CPUS_PER_TASK" not in script and "--wckey" not in script
    # The job's device is the one it asked for, whatever LINGUA_JOB_DEVICE the submitter had.
    assert "\nexport LINGUA_JOB_DEVICE=cpu\n" in script and "unset LINGUA_JOB_DEVICE" not in script
    gpu_script = _script([*args, "slurm.gpus_per_node=4", "slurm.dry_run=true"], tmp_path)
    assert "\nunset LINGUA_JOB_DEVICE\n" in gpu_script and "LINGUA_JOB_DEVICE=" not in gpu_script
    # A bad value is named as given, before stool fills in its defaults.
    from apps.llama import train

    with pytest.raises(ConfigError, match="slurm.tasks_per_node=-2 must not be negative"):
        stool.plan(train, [*tiny_args(corpus, tmp_path / "x"), "slurm.tasks_per_node=-2",
                           "slurm.gpus_per_node=2"], multirun=False)


@pytest.mark.slow
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


@pytest.mark.slow
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
    ("slurm.gpus_per_node=8", "gpus_per_node=8 leaves 4 GPU.* idle.*Leave slurm.tasks_per_node "
                              "out.*slurm.gpus_per_node=4"),
    ("slurm.cpus_per_task=-1", "slurm.cpus_per_task=-1 must not be negative"),
    ("slurm.wckey='my key'", "slurm.wckey='my key' is not a wckey name"),
])
def test_bad_slurm_values_are_named(override, message):
    from apps.llama import train

    args = train.load_config(["slurm.time=10", "slurm.tasks_per_node=4", override], check=False)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        slurm.validate_slurm_args(args.slurm)


@pytest.mark.parametrize("gres, gpus", [
    ("(null)", 0), ("", 0), ("gpu:8", 8), ("gpu:h100:8(S:0-1)", 8), ("gpu:4(IDX:0-3)", 4),
    ("gpu:a100:4,gpu:v100:2", 6), ("gpu:h100:8(S:0,1),nvme:1", 8), ("mps:100,gpu:2", 2),
    ("nvme:2", 0), ("gpu", 1), ("gpu:tesla", 1), ("gpu:h100:eight", None), ("gpu:1K", 1024),
])
def test_sinfo_gres_strings_are_read_defensively(gres, gpus):
    assert slurm.parse_gpus(gres) == gpus


def test_sinfo_node_lines_are_read_defensively():
    nodes = slurm.parse_sinfo_nodes(
        "n1|gpu*|224|2000000|gpu:h100:8(S:0-1)\n"
        "n2|gpu*|64+|257000+|gpu:h100:x:y\n"     # unknown values: never a reason to refuse
        "sinfo: some site notice\n\n"
        "n3|cpu|N/A|1|(null)\n")
    assert [(n.name, n.partition, n.cpus, n.mem_mb, n.gpus) for n in nodes] == [
        ("n1", "gpu*", 224, 2000000, 8), ("n2", "gpu*", None, None, None),
        ("n3", "cpu", None, 1, 0)]
    assert [slurm.mem_request_mb(m) for m in ("64G", "500", "1T", "512K", "0", None)] == [
        65536, 500, 1024 ** 2, 1, None, None]


def _slurm(**values) -> "slurm.SlurmArgs":
    return slurm.SlurmArgs(**{"tasks_per_node": 1, **values})


def test_a_job_no_node_can_hold_is_refused_with_what_the_nodes_have():
    nodes = slurm.parse_sinfo_nodes("n1|debug*|2|7000|(null)\n")
    with pytest.raises(ConfigError) as err:
        slurm.check_resources(_slurm(tasks_per_node=3), nodes=nodes)
    assert ("slurm.tasks_per_node=3 asks for 3 CPUs a node (one a task), but the nodes of "
            "partition 'debug' have at most 2 CPUs") in str(err.value)
    assert "PartitionConfig" in str(err.value) and "\n" not in str(err.value)
    cases = [
        (_slurm(tasks_per_node=2, cpus_per_task=2),
         "slurm.tasks_per_node=2 x slurm.cpus_per_task=2 asks for 4 CPUs a node, but the nodes "
         "of partition 'debug' have at most 2 CPUs"),
        (_slurm(nodes=2), "slurm.nodes=2 asks for more nodes than partition 'debug' has (1)"),
        (_slurm(mem="8G"), "slurm.mem=8G asks for 8192 MB a node, but the nodes of partition "
                           "'debug' have at most 7000 MB of memory"),
        (_slurm(gpus_per_node=1), "slurm.gpus_per_node=1 asks for 1 GPU a node, but the nodes "
                                  "of partition 'debug' have at most 0 GPUs"),
    ]
    for settings, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            slurm.check_resources(settings, nodes=nodes)
    for fits in (_slurm(tasks_per_node=2), _slurm(mem="7000"), _slurm(mem="0"), _slurm()):
        assert slurm.check_resources(fits, nodes=nodes)


def test_resources_are_checked_per_partition_and_node():
    nodes = slurm.parse_sinfo_nodes(FAKE_SINFO + "big|cpu|256|64000|(null)\n")
    # Enough CPUs on one cpu node and enough memory on others, but not both on two of them.
    with pytest.raises(ConfigError, match=re.escape(
            "slurm.nodes=2 asks for 2 nodes that each hold the job's share (slurm.tasks_per_node"
            "=128 asks for 128 CPUs a node (one a task), slurm.mem=100G asks for 102400 MB a "
            "node), but only 0 of the 3 nodes of partition 'cpu' do")):
        slurm.check_resources(_slurm(partition="cpu", nodes=2, tasks_per_node=128, mem="100G"),
                              nodes=nodes)
    assert slurm.check_resources(_slurm(partition="cpu", tasks_per_node=256), nodes=nodes)
    # 257000+ is "at least": a request above it is left to Slurm, not refused, on that node.
    assert slurm.check_resources(_slurm(partition="cpu", mem="300000"), nodes=nodes)
    with pytest.raises(ConfigError, match="but only 1 of the 3 nodes of partition 'cpu' do"):
        slurm.check_resources(_slurm(partition="cpu", nodes=2, mem="300000"), nodes=nodes)
    # No partition: the default one (gpu*); several: one that holds the job is enough.
    assert slurm.check_resources(_slurm(nodes=2, gpus_per_node=8, tasks_per_node=8), nodes=nodes)
    with pytest.raises(ConfigError, match="partition 'gpu' have at most 224 CPUs"):
        slurm.check_resources(_slurm(tasks_per_node=256), nodes=nodes)
    assert slurm.check_resources(_slurm(partition="gpu,cpu", tasks_per_node=256), nodes=nodes)
    with pytest.raises(ConfigError, match="slurm.partition='gpu,nope' does not exist"):
        slurm.check_resources(_slurm(partition="gpu,nope"), nodes=nodes)
    # Values stool picked itself are named, so the user knows which keys to set.
    with pytest.raises(ConfigError, match=re.escape(
            "stool chose slurm.tasks_per_node=8, slurm.cpus_per_task=32 itself")):
        slurm.check_resources(_slurm(gpus_per_node=8, tasks_per_node=8, cpus_per_task=32),
                              ["slurm.tasks_per_node=8", "slurm.cpus_per_task=32"], nodes=nodes)


@pytest.mark.slow
def test_a_dry_run_checks_resources_where_sinfo_answers(corpus, tmp_path, fake_bin):
    args = [*tiny_args(corpus, tmp_path / "big"), "slurm.partition=cpu", "slurm.dry_run=true"]
    proc = run_stool("apps.llama.train", *args, "slurm.tasks_per_node=65")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert ("slurm.tasks_per_node=65 asks for 65 CPUs a node (one a task), but the nodes of "
            "partition 'cpu' have at most 64 CPUs (from `sinfo`)") in proc.stderr, proc.stderr
    assert "#SBATCH" not in proc.stdout
    # sinfo there but failing (controller down): the dry run says it did not check.
    proc = run_stool("apps.llama.train", *args, "slurm.tasks_per_node=65",
                     env_extra={"PATH": f"{fake_bin / 'broken'}{os.pathsep}{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    assert "# resources not checked: `sinfo` is missing here or did not answer" in proc.stdout


def test_the_would_run_line_is_the_command_as_typed(corpus, tmp_path, monkeypatch, capsys):
    """Relative paths made absolute are shown as a person types them: shell quoting only where a
    shell needs it (a space), no Hydra quoting where Hydra needs none; pasted into bash, the line
    gives back the argv the job gets."""
    from apps.llama import train

    given = [f"data.root={corpus}", "data.prepare_embedded=false", "slurm.dry_run=true"]
    monkeypatch.chdir(tmp_path)   # relative paths are taken from where stool runs
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def would_run(dump_override: str) -> str:
        assert stool.submit("apps.llama.train", [dump_override, *given]) == []   # dry run
        [line] = [ln for ln in capsys.readouterr().out.splitlines()
                  if ln.startswith("# would run: ")]
        return line[len("# would run: "):]

    head, typed = "python -m apps.llama.train", " ".join(given[:-1])   # no slurm.dry_run=true
    assert would_run("dump_dir=runs/plain") == (
        f"{head} dump_dir=runs/plain {typed} dump_dir={tmp_path}/runs/plain "
        f"slurm.tasks_per_node=1")
    spaced = would_run("dump_dir=runs/my run")
    assert spaced == (f"{head} 'dump_dir=runs/my run' {typed} "
                      f"'dump_dir={tmp_path}/runs/my run' slurm.tasks_per_node=1")
    # Pasted into a shell: the job's argv, which composes the same dump_dir.
    odd = "runs/it's, odd $HOME"
    for rel, line in (("runs/my run", spaced),
                      (odd, would_run(stool.path_override("dump_dir", odd)))):
        [sub] = stool.plan(train, [stool.path_override("dump_dir", rel), *given], False)
        words = subprocess.run(["bash", "-c", 'printf "%s\\n" ' + line], capture_output=True,
                               text=True, check=True).stdout.split("\n")[:-1]
        assert words == ["python", "-m", "apps.llama.train", *stool.job_overrides(sub)], line
        assert Path(train.load_config(words[3:], check=False).dump_dir) == tmp_path / rel


@pytest.mark.parametrize("path", ["/data/plain-path_1.x", "/data/with space", "/d/a,b", "/d/it's",
                                  '/d/q"uote', "/d/$HOME", "/d/${x}", "/d/x=y", "/d/ñ",
                                  "/d/a\\b", "/d/trailing ", "/d/[1]", "null", "10", "run/1"])
def test_path_overrides_survive_hydra_and_the_shell(path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = stool.path_override("dump_dir", path)
    assert OverridesParser.create().parse_override(override).value() == path
    assert ("'" in override) == (stool.PLAIN_PATH.match(path) is None)   # quoted only if needed
    typed = stool.shell_join(["x", override])
    words = subprocess.run(["bash", "-c", 'printf "%s\\n" ' + typed], capture_output=True,
                           text=True, check=True).stdout.split("\n")[:-1]
    assert words == ["x", override], typed


@pytest.mark.slow
def test_gpu_job_is_validated_for_cuda_on_a_cpu_login_node(corpus, tmp_path):
    # nccl is refused for a CPU job, accepted for a job that asks for GPUs.
    args = tiny_args(corpus, tmp_path / "gpu", "distributed.backend=nccl", "distributed.dp_shard=8")
    proc = run_stool("apps.llama.train", *args, "slurm.tasks_per_node=8", "slurm.dry_run=true")
    assert proc.returncode == 2 and "nccl needs CUDA" in proc.stderr
    proc = run_stool("apps.llama.train", *args, "slurm.tasks_per_node=8",
                     "slurm.gpus_per_node=8", "slurm.dry_run=true")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --gpus-per-node=8" in proc.stdout


@pytest.mark.slow
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
    # One job array has one set of sbatch values: sweeping them would silently use the first.
    with pytest.raises(ConfigError, match=r"slurm.time differs between its runs \(10, 20\)"):
        stool.plan(train, [*tiny_args(corpus, base), "slurm.time=10,20"], multirun=True)
    # max_requeues is read by each job itself: it may differ.
    subs = stool.plan(train, [*tiny_args(corpus, base), "slurm.max_requeues=1,2"], multirun=True)
    assert [s.args.slurm.max_requeues for s in subs] == [1, 2]


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
    [moved] = stool.plan(train, [*tiny_args(corpus, dump), "fault_tolerance.lighthouse=h:1"], False)
    stool.check_dump_dir(moved)  # each run's own lighthouse address (a group's job writes it)
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
    for rel in ("lingua/launch/stool.py", "apps/llama/train.py", "configs/llama/debug.yaml",
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
    monkeypatch.delenv("SLURM_STEP_NODELIST", raising=False)
    got = distributed.slurm_step_vars()
    assert got == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 4242 % 20000)}
    # A step on part of the job's nodes (srun -N2 -r1 in a 3-node job): rank 0 is on the step's
    # first node, not the job's.
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[06-08]")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[07-08]")
    assert distributed.slurm_step_vars()["MASTER_ADDR"] == "gpu07"
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu-a17,gpu-b[02-03]")
    assert distributed.slurm_step_vars()["MASTER_ADDR"] == "gpu-a17"
    # A batch script's own shell is one process, whatever the job's task count.
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    assert distributed.slurm_step_vars() == {}
    # torchrun's variables win over Slurm's (srun ... torchrun ...).
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "16")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.world_size_from_env() == 2


@pytest.mark.slow
@pytest.mark.parametrize("rank, returned, exit_code", [
    ("0", 3, 3),   # rank 0 reports the stop (and requeues first)
    ("1", 3, 0),   # the others leave quietly: under srun --kill-on-bad-exit their 3 would end
                   # the step while rank 0 is still requeueing the job
    ("1", 0, 0),
    ("1", 1, 1),   # a failure is a failure on any rank: it ends the job at once
])
def test_a_stool_job_exits_with_rank_zero_code_after_a_clean_stop(tmp_path, rank, returned,
                                                                   exit_code):
    (tmp_path / "fake_app.py").write_text(f"def main(argv):\n    return {returned}\n")
    code = ("import sys; from lingua.launch import stool; "
            "stool.TrainJob('fake_app', [])(); sys.exit(99)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]), RANK=rank,
               WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == exit_code, proc.stdout + proc.stderr


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
    # Against the same 2-rank run uninterrupted: bit-identical. (Against one process, 40 steps
    # let summation-order differences grow past 1e-5; layouts vs one process are tested in
    # test_distributed.py over 5 steps.)
    ref = tmp_path / "reference"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, ref, "distributed.dp_shard=2",
                                                  "checkpoint.keep=0", steps=steps))
    assert_equivalent(dump, ref, rtol=0)


@pytest.mark.slow
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


def test_a_dry_run_names_every_problem_at_once(tmp_path, monkeypatch):
    """One try names each problem it can find with its fix (a missing data.root included), not
    one problem per try."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError) as err:
        stool.submit("apps.llama.train", ["data.root=missing", "optim.lr=-1", "steps=0",
                                          "data.seq_len=2048", "slurm.dry_run=true"])
    message = str(err.value)
    assert message.startswith("4 problems with this configuration, each with its fix:"), message
    for problem in ("steps=0 must be positive", f"data.root={tmp_path}/missing does not exist",
                    "optim.lr=-1.0 must be", "data.seq_len=2048 is longer than model.max_seq_len"):
        assert problem in message, message
    assert not (tmp_path / "runs").exists()


FT = ["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2",
      "fault_tolerance.min_replicas=2"]


def _fake_sbatch(tmp_path, monkeypatch) -> Path:
    """An sbatch that keeps each script as <job id>.sh (ids from 100) and answers as Slurm does."""
    bin_dir, kept = tmp_path / "sbatch_bin", tmp_path / "submitted"
    bin_dir.mkdir()
    kept.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\nid=$((100 + $(ls {kept} | wc -l)))\n'
                                    f'cp "$1" {kept}/$id.sh\necho "Submitted batch job $id"\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return kept


def test_a_fault_tolerant_run_is_a_lighthouse_job_and_one_job_per_group(corpus, tmp_path,
                                                                        monkeypatch, capsys):
    import pickle

    dump, kept = tmp_path / "ft", _fake_sbatch(tmp_path, monkeypatch)
    args = [*tiny_args(corpus, dump, *FT), "slurm.time=30", "slurm.max_requeues=3"]
    assert stool.submit("apps.llama.train", [*args, "slurm.dry_run=true"]) == []
    dry = capsys.readouterr().out
    assert not dump.exists() and not list(kept.iterdir())
    lighthouse, groups = dry.split("# the lighthouse job, above")
    light = _sbatch_lines(lighthouse)   # one CPU, for the groups' whole time with requeues
    assert (light["job-name"], light["ntasks-per-node"], light["cpus-per-task"], light["mem"],
            light["time"]) == ("ft-lighthouse", "1", "1", "1G", "120"), lighthouse
    assert "dependency" not in light and "array" not in light
    group = _sbatch_lines(groups)
    assert group["dependency"] == "'after:<lighthouse job id>'", groups
    assert group["array"].startswith("0-1"), groups
    for g in range(2):
        [line] = [ln for ln in groups.splitlines()
                  if ln.startswith("# would run:") and f"group_id={g}" in ln]
        assert f"dump_dir={dump / f'group_{g}'}" in line, line

    jobs = stool.submit("apps.llama.train", args)
    out = capsys.readouterr().out
    assert [j.job_id for j in jobs] == ["100", "101_0", "101_1"], out
    assert "submitted job 100: the lighthouse of 2 replica groups" in out
    assert "scancel 100 101 101" in out and "submitted job 101_1" in out
    assert "--dependency=after:100" in (kept / "101.sh").read_text()
    assert "--dependency" not in (kept / "100.sh").read_text()
    assert (dump / "lighthouse_jobs").read_text() == "101"   # what the lighthouse job polls
    for g in range(2):
        saved = OmegaConf.load(dump / f"group_{g}" / "config.yaml")
        assert saved.fault_tolerance.group_id == g and saved.dump_dir == str(dump / f"group_{g}")
        with open(dump / "slurm" / f"101_{g}_submitted.pkl", "rb") as f:
            job = pickle.load(f).function
        assert job.lighthouse == (dump / "lighthouse", 60) and f"fault_tolerance.group_id={g}" in \
            job.overrides
    with open(dump / "slurm" / "100_submitted.pkl", "rb") as f:
        served = pickle.load(f)
    assert served.function.__name__ == "serve_lighthouse" and served.args == (2, dump)


def test_a_given_lighthouse_gets_no_lighthouse_job_and_refusals(corpus, tmp_path, capsys):
    from apps.llama import train

    dump = tmp_path / "given"
    args = [*tiny_args(corpus, dump, *FT), "slurm.dry_run=true"]
    stool.submit("apps.llama.train", [*args, "fault_tolerance.lighthouse=http://lh:29510"])
    dry = capsys.readouterr().out
    assert "lighthouse job" not in dry and "--dependency" not in dry and "--array=0-1" in dry
    with pytest.raises(ConfigError, match="stool assigns the ids|assigns the ids"):
        stool.plan_run(train, [*args, "fault_tolerance.group_id=1"], multirun=False)
    with pytest.raises(ConfigError, match="--multirun with fault_tolerance.enabled=true"):
        stool.plan_run(train, [*args, "optim.lr=1e-3,3e-3"], multirun=True)
    # A group validates with its own id: a layout fault tolerance refuses is refused up front.
    with pytest.raises(ConfigError, match="distributed.pp=2"):
        stool.plan_run(train, [*args, "distributed.pp=2", "slurm.tasks_per_node=2"], False)
