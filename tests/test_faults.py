"""Faults: damaged checkpoints, a disk that is full or read-only, non-finite values, a rank that
dies. Each test damages or kills something real and checks that nothing already saved is lost
and that the run goes on (or stops) as docs/training.md's "When things go wrong" describes."""

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apps.llama import train
from lingua import checkpoint
from lingua.checkpoint import integrity
from lingua.errors import RunError
from tests.conftest import REPO, free_port, read_metrics, run_python, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows


def losses(dump) -> dict:
    return {row["step"]: row["loss"] for row in read_metrics(dump)}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """An uninterrupted 6-step run to compare every recovered run with (its run directory)."""
    dump = tmp_path_factory.mktemp("reference") / "run"
    run_python("apps.llama.train", tiny_args(corpus, dump, steps=6))
    return dump


def two_checkpoints(corpus, dump):
    run_python("apps.llama.train", tiny_args(corpus, dump, "checkpoint.every=2",
                                             "checkpoint.keep=0", steps=4))
    return dump / "checkpoints" / "2", dump / "checkpoints" / "4"


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_shard", "flipped_byte_in_shard", "no_metadata",
                                    "no_manifest", "no_train_state"])
def test_resume_skips_a_damaged_checkpoint_for_the_one_before(corpus, tmp_path, reference, damage):
    dump = tmp_path / damage
    older, newer = two_checkpoints(corpus, dump)
    {"truncated_shard": lambda: truncate(newer / "__0_0.distcp"),
     "flipped_byte_in_shard": lambda: flip_a_byte(newer / "__0_0.distcp"),
     "no_metadata": lambda: (newer / ".metadata").unlink(),
     "no_manifest": lambda: (newer / integrity.MANIFEST).unlink(),
     "no_train_state": lambda: (newer / "train_state_rank0.pt").unlink()}[damage]()
    assert integrity.verify(newer) is not None
    assert integrity.verify(older) is None

    first = read_rows(dump)
    proc = run_python("apps.llama.train", tiny_args(corpus, dump, "checkpoint.every=2",
                                                    "checkpoint.keep=0", steps=6))
    log = proc.stdout + proc.stderr
    assert f"skipping damaged checkpoint {newer}" in log, log[-3000:]
    assert_resumed(dump, log, 2, first)  # from the older one; steps 3 and 4 ran again
    assert_equivalent(dump, reference, rtol=0)


@pytest.mark.slow
def test_an_explicitly_requested_damaged_checkpoint_is_an_error(corpus, tmp_path):
    _, newer = two_checkpoints(corpus, tmp_path / "run")
    flip_a_byte(newer / "__0_0.distcp")
    proc = run_python("apps.llama.hf", ["export", str(newer), str(tmp_path / "hf")], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"Checkpoint {newer} is damaged" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "hf").exists()


def _mount(*args) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    assert proc.returncode == 0, f"mount {' '.join(args)} failed as root: {proc.stderr.strip()}"


# A real full or read-only filesystem needs mount, so root (as in CI and setup/test.sh's Slurm).
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a small or "
                                                          "read-only filesystem")


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize("fault", ["full", "read_only"])
def test_a_failed_save_is_reported_and_keeps_the_previous_checkpoint(corpus, tmp_path, fault):
    """A real full (tmpfs) or read-only (bind mount) filesystem under the checkpoints."""
    dump = tmp_path / "run"
    ckpts = dump / "checkpoints"
    ckpts.mkdir(parents=True)
    _mount("-t", "tmpfs", "-o", "size=8m", "tmpfs", str(ckpts))
    try:
        run_python("apps.llama.train", tiny_args(corpus, dump, "checkpoint.every=2", steps=2))
        first = ckpts / "2"
        assert integrity.verify(first) is None
        if fault == "full":
            free = os.statvfs(ckpts).f_bavail * os.statvfs(ckpts).f_frsize
            (ckpts / "filler").write_bytes(b"\0" * (free - 64 * 1024))
        else:
            _mount("-o", "remount,ro", str(ckpts))
        proc = run_python("apps.llama.train", tiny_args(corpus, dump, "checkpoint.every=2",
                                                        steps=4), check=False)
        assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "Could not write checkpoint" in proc.stderr and "Traceback" not in proc.stderr
        assert f"the previous checkpoint {first} is intact" in proc.stderr
        assert integrity.verify(first) is None  # untouched, still loadable
        assert [p.name for p in ckpts.iterdir() if ".tmp-" in p.name] == []
        if fault == "full":
            (ckpts / "filler").unlink()
        else:
            _mount("-o", "remount,rw", str(ckpts))
        before = read_rows(dump)
        proc = run_python("apps.llama.train",
                          tiny_args(corpus, dump, "checkpoint.every=2", steps=4))
        assert_resumed(dump, proc.stdout + proc.stderr, 2, before)
        assert sorted(losses(dump)) == [1, 2, 3, 4]
    finally:
        subprocess.run(["umount", "-l", str(ckpts)])


@needs_root
@pytest.mark.distributed
def test_two_ranks_that_cannot_write_both_stop_without_hanging(corpus, tmp_path):
    """Every rank sees the failure (one all-gather of errors), so none waits in a collective."""
    from tests.conftest import run_torchrun

    dump = tmp_path / "two"
    args = tiny_args(corpus, dump, "distributed.dp_shard=2", "checkpoint.every=2", steps=2)
    run_torchrun(2, "apps.llama.train", args)
    ckpts = dump / "checkpoints"
    _mount("--bind", str(ckpts), str(ckpts))
    try:
        _mount("-o", "remount,ro,bind", str(ckpts))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        env.pop("WORLD_SIZE", None)
        # A hang would run into the timeout (the collective timeout is 600 s); no wall-clock
        # bound of our own, which a loaded machine could break.
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m",
                               "apps.llama.train", *args[:-1], "steps=4"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-3000:]
        # Printed once per distinct message (lingua.errors.report: a rank repeating another's
        # stays quiet; here rank 1's names rank 0's error, so both may print), and torchrun's
        # summary shows it as the root cause instead of a traceback.
        printed = [line for line in out.splitlines()
                   if line.startswith("error: Could not write checkpoint")]
        assert 1 <= len(printed) <= 2, out[-3000:]
        assert "traceback : error: Could not write checkpoint" in out.split("Root Cause")[-1]
        assert integrity.verify(ckpts / "2") is None
    finally:
        subprocess.run(["umount", "-l", str(ckpts)])


def poison_step(monkeypatch, bad_step: int, value: float):
    """Make the loss of one step NaN/Inf (or scaled), as a bad batch or an overflow would."""
    from lingua.train import microbatch

    real = microbatch.forward_loss
    calls = {"n": 0}

    def forward_loss(*args, **kwargs):
        calls["n"] += 1
        out = real(*args, **kwargs)
        if calls["n"] == bad_step:
            out.loss_sum = out.loss_sum * value
        return out

    monkeypatch.setattr(microbatch, "forward_loss", forward_loss)


def test_nonfinite_skip_drops_the_step_and_counts_it(corpus, tmp_path, monkeypatch, reference):
    dump = tmp_path / "skip"
    poison_step(monkeypatch, 3, float("nan"))
    train.main(tiny_args(corpus, dump, "optim.nonfinite=skip", steps=6))
    rows = {row["step"]: row for row in read_metrics(dump)}
    assert [rows[s]["nonfinite_steps"] for s in range(1, 7)] == [0, 0, 1, 1, 1, 1]
    assert rows[2]["loss"] == losses(reference)[2]
    assert all(math.isfinite(rows[s]["loss"]) for s in (4, 5, 6))  # the weights stayed finite
    assert math.isnan(rows[3]["loss"])
    assert integrity.verify(dump / "checkpoints" / "6") is None


def test_nonfinite_stop_saves_the_state_before_the_step_and_resumes(corpus, tmp_path, monkeypatch,
                                                                    reference, capfd):
    dump = tmp_path / "stop"
    poison_step(monkeypatch, 4, float("inf"))
    with pytest.raises(RunError,
                       match=r"Step 4: the gradient norm is (nan|inf).*state after step 3"):
        train.main(tiny_args(corpus, dump, steps=6))
    assert integrity.verify(dump / "checkpoints" / "3") is None
    monkeypatch.undo()
    first = read_rows(dump)
    assert [r["step"] for r in first] == [1, 2, 3]  # the bad step was not logged
    capfd.readouterr()
    train.main(tiny_args(corpus, dump, steps=6))  # resumes at step 3, reruns step 4's batch
    assert_resumed(dump, "".join(capfd.readouterr()), 3, first)
    assert_equivalent(dump, reference, rtol=0)


def test_a_loss_spike_is_logged_and_marked(corpus, tmp_path, monkeypatch, capfd):
    dump = tmp_path / "spike"
    poison_step(monkeypatch, 8, 10.0)
    train.main(tiny_args(corpus, dump, "spikes.window=5", steps=9))
    rows = {row["step"]: row for row in read_metrics(dump)}
    assert rows[8]["loss_spike"] == 1 and sum(r["loss_spike"] for r in rows.values()) == 1
    out, err = capfd.readouterr()
    assert "loss spike at step 8" in out + err


@pytest.mark.distributed
@pytest.mark.parametrize("nproc, layout", [
    (2, ["distributed.dp_shard=2", "data.batch_size=4"]),
    (4, ["distributed.dp_shard=2", "distributed.tp=2", "data.batch_size=4"]),
])
def test_a_killed_rank_stops_the_run_and_the_same_command_resumes(corpus, tmp_path, nproc,
                                                                  layout):
    """kill -9 of one rank mid-run: the others stop (no hang) with a message naming the lost rank,
    and running the same command again resumes from the newest complete checkpoint and ends with
    the losses of an uninterrupted run."""
    steps = 10
    dump = tmp_path / "killed"
    args = tiny_args(corpus, dump, *layout, "checkpoint.every=3", "checkpoint.keep=0",
                     "distributed.timeout_s=60", steps=steps)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("WORLD_SIZE", None)

    def torchrun():
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m",
                "apps.llama.train", *args]

    proc = subprocess.Popen(torchrun(), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        hang_guard = time.time() + 900  # ends a hung run; no speed check (a loaded CI is slower)
        while not ((dump / "metrics.jsonl").is_file() and len(read_metrics(dump)) >= 5):
            assert proc.poll() is None, "the run ended before a rank could be killed"
            assert time.time() < hang_guard, "5 steps not logged after 900 s: hung?"
            time.sleep(0.1)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        victim = [pid for pid in workers if f"RANK={nproc - 1}" in
                  Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")][0]
        os.kill(int(victim), 9)
        # Surviving ranks that hung would run into this timeout (their collective timeout is
        # 60 s, torchrun stops them at once); no tighter wall-clock bound.
        out, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert f"local_rank: {nproc - 1}" in out and "Signal 9" in out, out[-3000:]
    assert len(read_metrics(dump)) < steps  # it really was interrupted
    resume_at = int(checkpoint.newest(dump).name)
    first = read_rows(dump)

    # The same command again (its ranks forked warm: what is checked is the run's own resume).
    from tests.conftest import run_torchrun
    proc = run_torchrun(nproc, "apps.llama.train", args, timeout=300)
    assert_resumed(dump, proc.stdout + proc.stderr, resume_at, first)
    reference = tmp_path / "reference"
    run_torchrun(nproc, "apps.llama.train", tiny_args(corpus, reference, *layout, steps=steps))
    assert_equivalent(dump, reference, rtol=0)
