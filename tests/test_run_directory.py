"""One run per dump_dir (lingua/train/dump_lock.py): a second run is refused on every rank and
writes nothing; a killed run's lock and unfinished saves are cleared at the next start; a start
refused while loading weights leaves no dump_dir behind. And setup/test.sh starts the local Slurm
only for a selection that can hold slurm tests."""

import json
import os
import socket
import threading

import pytest
import torch

from apps.llama import train
from lingua.errors import ConfigError
from lingua.train import dump_lock
from tests.conftest import load_setup_script, read_metrics, run_torchrun, tiny_args


def hold(dump) -> int:
    """The lock as a first run holds it: through the trainer's own function, in this process."""
    dump.mkdir(parents=True, exist_ok=True)
    return dump_lock.acquire(dump)


def test_a_second_run_on_a_held_dump_dir_is_refused_and_writes_nothing(corpus, tmp_path):
    dump = tmp_path / "run"
    fd = hold(dump)
    holder = f"process {os.getpid()} on host {socket.gethostname()}"
    with pytest.raises(ConfigError, match=f"is in use by another run: {holder} .*another dump_dir"):
        train.main(tiny_args(corpus, dump, steps=1))
    assert sorted(os.listdir(dump)) == [".lock"]   # the holder's, untouched
    assert json.loads((dump / ".lock").read_text())["pid"] == os.getpid()
    os.close(fd)   # the first run ends (the OS drops its flock, as at exit)
    assert train.main(tiny_args(corpus, dump, steps=1)) == 0
    assert len(read_metrics(dump)) == 1
    # Let go when main() returns, in the same process: the resume tests run main() twice.
    assert not (dump / ".lock").exists()
    assert train.main(tiny_args(corpus, dump, steps=2)) == 0
    assert [r["step"] for r in read_metrics(dump)] == [1, 2]


def test_a_requeued_slurm_job_waits_for_its_previous_instance(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    previous = hold(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4343")   # another job is refused at once
    with pytest.raises(ConfigError, match=r"\(Slurm job 4242, since"):
        dump_lock.acquire(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")   # the same job, requeued: waits for it to end
    threading.Timer(1.5, os.close, [previous]).start()
    os.close(dump_lock.acquire(tmp_path))
    monkeypatch.setattr(dump_lock, "REQUEUE_WAIT_S", 0.5)
    previous = hold(tmp_path)   # ... for REQUEUE_WAIT_S, then it is refused
    with pytest.raises(ConfigError, match="is in use by another run"):
        dump_lock.acquire(tmp_path)
    os.close(previous)


@pytest.mark.distributed
def test_every_rank_of_a_refused_run_stops(corpus, tmp_path):
    dump = tmp_path / "run"
    fd = hold(dump)
    proc = run_torchrun(2, "apps.llama.train", tiny_args(corpus, dump, "distributed.dp_shard=2",
                                                         "data.batch_size=4", steps=1),
                        timeout=120, check=False)
    os.close(fd)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "is in use by another run" in out, out[-3000:]
    assert sorted(os.listdir(dump)) == [".lock"]


def test_a_killed_runs_lock_and_unfinished_save_are_cleared_at_the_next_start(corpus, tmp_path,
                                                                               capfd):
    dump = tmp_path / "run"
    assert train.main(tiny_args(corpus, dump, "checkpoint.every=2", steps=2)) == 0
    complete = {p: p.read_bytes() for p in (dump / "checkpoints" / "2").iterdir()}
    # What kill -9 during the save of step 4 leaves: its lock record and a half-written save.
    (dump / ".lock").write_text(json.dumps({"pid": 2 ** 22 + 1, "host": socket.gethostname()}))
    partial = dump / "checkpoints" / "4.tmp-0badc0de"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x" * 300_000)
    capfd.readouterr()
    assert train.main(tiny_args(corpus, dump, "checkpoint.every=2", steps=3)) == 0
    err = "".join(capfd.readouterr())
    assert f"took over {dump / '.lock'} from process {2 ** 22 + 1} on host" in err, err[-3000:]
    assert f"removed {partial} (0.3 MB), a save its run was stopped in" in err, err[-3000:]
    assert not partial.exists() and not (dump / ".lock").exists()
    assert {p: p.read_bytes() for p in (dump / "checkpoints" / "2").iterdir()} == complete
    assert [r["step"] for r in read_metrics(dump)] == [1, 2, 3]


def test_weights_of_another_shape_are_refused_with_nothing_written(corpus, tmp_path):
    from safetensors.torch import load_file, save_file

    from lingua.models.llama.hf import save_hf
    from lingua.models.llama.model import Transformer

    cfg = train.config.load("llama", train.TrainArgs, tiny_args(corpus, tmp_path / "x"))
    hf = tmp_path / "hf"
    save_hf(Transformer(cfg.model), cfg.model, hf)
    (weights,) = hf.glob("*.safetensors")
    state = load_file(weights)
    state["model.norm.weight"] = torch.ones(cfg.model.dim // 2)
    save_file(state, weights, metadata={"format": "pt"})
    dump = tmp_path / "new" / "run"
    with pytest.raises(ConfigError, match=r"model.norm.weight .* of shape \(32,\) but config.json "
                                          r"implies \(64,\)"):
        train.main(tiny_args(corpus, dump, f"checkpoint.init_from={hf}", steps=1))
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv, starts", [
    ([], True), (["-m", "not slow"], False), (["-m", "slurm"], True), (["-mnot slow"], False),
    (["-m", "not slurm and not gpu"], False), (["-m", "gpu"], False), (["-m", "slow"], True),
    (["-m", "not gpu"], True), (["-m", "slurm", "-m", "not slow"], False),
    (["-k", "hf", "tests/test_hf.py"], True), (["-m", "((broken"], True),
])
def test_the_quick_tier_leaves_slurm_alone(argv, starts):
    assert load_setup_script("slurm_wanted").wanted(argv) is starts
