"""checkpoint.async_save: a periodic checkpoint is copied to CPU memory at its step and written
while the next steps run, and stays complete or invisible, as a synchronous one.

The writes are slowed down or made to fail by a hook on DCP's FileSystemWriter.write_data (what
writes the shards), installed by these tests in their own process, or by this module run as the
train command (`python -m tests.test_async_checkpoint <overrides>`, the hook described by the
LINGUA_TEST_WRITER variable) in each torchrun rank. The project's code is unchanged.
"""

import errno
import json
import os
import signal
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest
import torch

from apps.llama import train
from lingua import checkpoint
from lingua.checkpoint import integrity
from lingua.errors import ConfigError, RunError
from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows

HOOK_VAR = "LINGUA_TEST_WRITER"


# --- the writer hook ------------------------------------------------------------------------

def rows_logged(dump) -> int:
    """Complete lines of metrics.jsonl (rank 0 writes it; any rank can read it)."""
    path = Path(dump) / "metrics.jsonl"
    return path.read_text().count("\n") if path.is_file() else 0


def install_writer_hook(spec: dict, setattr_=setattr) -> list:
    """Hook the shard writes of checkpoint `spec["step"]` (on every rank, or on `spec["rank"]`):
      kind "fail": raise ENOSPC, as a full disk does;
      kind "slow": hold the write until metrics.jsonl has `until_row` rows (at most `timeout` s),
        then, optionally, send this process SIGTERM ("then": "sigterm") and sleep `sleep` s.
    What the slow writer saw is appended to the returned list and, with `report`, written to
    <report>/rank<r>.json."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data
    rank = int(os.environ.get("RANK", "0"))
    seen = []

    def write_data(self, plan, planner):
        tmp = Path(self.path)
        step = int(tmp.name.split(".tmp-")[0])
        if step == spec["step"] and spec.get("rank", rank) == rank:
            if spec["kind"] == "fail":
                raise OSError(errno.ENOSPC, "No space left on device")
            dump = tmp.parent.parent
            deadline = time.time() + spec.get("timeout", 120)
            while rows_logged(dump) < spec["until_row"] and time.time() < deadline:
                time.sleep(0.02)
            seen.append({"rank": rank, "rows": rows_logged(dump), "tmp_exists": tmp.is_dir(),
                         "final_exists": (tmp.parent / str(step)).exists(),
                         "main_thread": threading.current_thread() is threading.main_thread()})
            if "report" in spec:
                Path(spec["report"], f"rank{rank}.json").write_text(json.dumps(seen[-1]))
            if spec.get("then") == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(spec.get("sleep", 0))
        return real(self, plan, planner)

    setattr_(FileSystemWriter, "write_data", write_data)
    return seen


def run_hooked(nproc: int, args: list, spec: dict, check: bool = True):
    """torchrun of the train command with the writer hook in every rank."""
    os.environ[HOOK_VAR] = json.dumps(spec)
    try:
        return run_torchrun(nproc, "tests.test_async_checkpoint", args, check=check)
    finally:
        del os.environ[HOOK_VAR]


# --- comparing checkpoints ------------------------------------------------------------------

def checkpoint_contents(ckpt) -> dict:
    """Every entry of a DCP checkpoint (model and optimizer tensors, and the optimizer's other
    values), read in this process, and every rank's train state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(ckpt)).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             if isinstance(meta, TensorStorageMetadata) else None
             for key, meta in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": as intended
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    for path in sorted(Path(ckpt).glob("train_state_rank*.pt")):
        state[path.name] = torch.load(path, weights_only=True)
    return state


def assert_same(got, want, where="") -> None:
    assert type(got) is type(want), f"{where}: {type(got).__name__} vs {type(want).__name__}"
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{where}: keys {sorted(got)} vs {sorted(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} vs {len(want)} items"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: tensors differ"
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def assert_same_checkpoints(dump, reference, steps) -> None:
    for step in steps:
        ckpt = Path(dump) / "checkpoints" / str(step)
        ref = Path(reference) / "checkpoints" / str(step)
        assert integrity.verify(ckpt) is None, integrity.verify(ckpt)
        got, want = checkpoint_contents(ckpt), checkpoint_contents(ref)
        assert any(k.startswith("optim.") for k in want) and "train_state_rank0.pt" in want
        assert got["train_state_rank0.pt"]["step"] == step
        # Python's `random` is saved and restored but never seeded (training draws nothing
        # from it): its state differs between two processes, whatever saved them.
        for contents in (got, want):
            for name in [k for k in contents if k.startswith("train_state_rank")]:
                contents[name]["rng"].pop("python")
        assert_same(got, want, f"checkpoint {step}")


def tmp_dirs(dump) -> list:
    return sorted(p.name for p in (Path(dump) / "checkpoints").iterdir() if ".tmp-" in p.name)


ASYNC = "checkpoint.async_save=true"


# --- one process ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sync_reference(corpus, tmp_path_factory):
    """Synchronous saves at steps 3 and 6 of a 6-step run."""
    dump = tmp_path_factory.mktemp("sync") / "run"
    train.main(tiny_args(corpus, dump, "checkpoint.every=3", "checkpoint.keep=0", steps=6))
    return dump


@pytest.mark.slow
def test_the_write_overlaps_the_next_steps_and_equals_a_synchronous_save(
        corpus, tmp_path, monkeypatch, sync_reference, capfd):
    dump = tmp_path / "async"
    args = tiny_args(corpus, dump, ASYNC, "checkpoint.every=3", "checkpoint.keep=0", steps=6)
    # Step 3's shards are written only once step 5 was logged: a save that held up training
    # would never see that row (the writer gives up after 60 s and the test fails).
    seen = install_writer_hook({"kind": "slow", "step": 3, "until_row": 5, "timeout": 60},
                               monkeypatch.setattr)
    assert train.main(args) == 0
    assert len(seen) == 1 and seen[0]["rows"] >= 5, seen
    assert seen[0]["tmp_exists"] and not seen[0]["final_exists"] and not seen[0]["main_thread"]
    assert tmp_dirs(dump) == []
    # Same bytes of state as the synchronous save at the same steps (the copy was taken at step
    # 3, before steps 4 and 5 changed the weights), and the same run.
    assert_same_checkpoints(dump, sync_reference, [3, 6])
    assert_equivalent(dump, sync_reference, rtol=0)

    # Resume from the asynchronously written checkpoint.
    monkeypatch.undo()
    first = read_rows(dump)
    for path in (dump / "checkpoints" / "6").iterdir():
        path.unlink()
    (dump / "checkpoints" / "6").rmdir()
    capfd.readouterr()
    assert train.main(args) == 0
    assert_resumed(dump, "".join(capfd.readouterr()), 3, first)
    assert_equivalent(dump, sync_reference, rtol=0)


def test_finish_waits_for_every_write_and_frees_the_copy(tmp_path, monkeypatch):
    """PendingSave.finish(block=False) makes nothing visible while the write is running (one
    process: this rank's write is every rank's); the copy of the state taken at the save is what
    is written, and it is freed after the write (with automatic garbage collection off, as in
    the training loop)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    real_write, real_stage = FileSystemWriter.write_data, StateDictStager.stage
    go, copies = threading.Event(), []

    def held_write(self, plan, planner):
        assert go.wait(60), "never released"
        return real_write(self, plan, planner)

    def stage(self, state_dict, *args, **kwargs):
        staged = real_stage(self, state_dict, *args, **kwargs)
        copies.extend(weakref.ref(t) for t in staged["model"].values())
        return staged

    monkeypatch.setattr(FileSystemWriter, "write_data", held_write)
    monkeypatch.setattr(StateDictStager, "stage", stage)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    gc_was_enabled = __import__("gc").isenabled()
    __import__("gc").disable()
    try:
        pending = checkpoint.save_async(tmp_path, 1, [model], [optimizer], {"step": 1},
                                        "steps: 1\n", 0, 1, keep=0)
        assert copies, "the state was not copied by DCP's stager"
        with torch.no_grad():   # the next optimizer step
            for p in model.parameters():
                p.add_(1.0)
        assert pending.finish(block=False, all_written=pending.written_here()) is None
        assert checkpoint.list_complete(tmp_path) == [] and len(tmp_dirs(tmp_path)) == 1
        go.set()
        deadline = time.time() + 60
        while pending.finish(block=False, all_written=pending.written_here()) is None:
            assert time.time() < deadline, "the write never finished"
            time.sleep(0.01)
        final = tmp_path / "checkpoints" / "1"
        assert checkpoint.list_complete(tmp_path) == [final] and tmp_dirs(tmp_path) == []
        assert integrity.verify(final) is None
        saved = checkpoint_contents(final)
        assert_same({k: saved[f"model.{k}"] for k in at_save}, at_save, "model")
        assert saved["train_state_rank0.pt"]["step"] == 1
        del pending
        assert [c for c in copies if c() is not None] == [], "the staged copy was not freed"
    finally:
        if gc_was_enabled:
            __import__("gc").enable()


def test_a_failed_write_removes_the_directory_and_keeps_the_previous_checkpoint(tmp_path,
                                                                             monkeypatch):
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    previous = checkpoint.save(tmp_path, 1, [model], [optimizer], {"step": 1}, "steps: 2\n", 0, 1,
                               keep=0)
    install_writer_hook({"kind": "fail", "step": 2}, monkeypatch.setattr)
    pending = checkpoint.save_async(tmp_path, 2, [model], [optimizer], {"step": 2}, "steps: 2\n",
                                    0, 1, keep=0)
    with pytest.raises(RunError) as failed:
        pending.finish(block=True)
    assert str(failed.value).startswith(
        f"Could not write checkpoint {tmp_path / 'checkpoints' / '2'}: [Errno 28] No space left "
        f"on device. Nothing of it was kept; the previous checkpoint {previous} is intact.")
    assert tmp_dirs(tmp_path) == [] and checkpoint.list_complete(tmp_path) == [previous]
    assert integrity.verify(previous) is None


def test_the_end_of_training_waits_for_the_write(corpus, tmp_path, monkeypatch):
    """No final save: the run's last step boundary waits for step 2's write, still running."""
    dump = tmp_path / "end"
    seen = install_writer_hook({"kind": "slow", "step": 2, "until_row": 3, "sleep": 1.0},
                               monkeypatch.setattr)
    assert train.main(tiny_args(corpus, dump, ASYNC, "checkpoint.every=2",
                                "checkpoint.save_final=false", steps=3)) == 0
    assert len(seen) == 1 and seen[0]["rows"] == 3 and not seen[0]["final_exists"]
    assert [p.name for p in checkpoint.list_complete(dump)] == ["2"] and tmp_dirs(dump) == []
    assert integrity.verify(dump / "checkpoints" / "2") is None


def test_a_signal_stop_waits_for_the_write_then_saves(corpus, tmp_path, monkeypatch):
    """SIGTERM while step 2's checkpoint is being written: the run stops at the next step
    boundary with step 2's checkpoint finished and one of the step it stopped at."""
    dump = tmp_path / "signal"
    install_writer_hook({"kind": "slow", "step": 2, "until_row": 3, "then": "sigterm",
                         "sleep": 0.5}, monkeypatch.setattr)
    args = tiny_args(corpus, dump, ASYNC, "checkpoint.every=2", "checkpoint.keep=0", steps=20)
    assert train.main(args) == 3   # preemption.EXIT_STOPPED
    last = read_rows(dump)[-1]["step"]
    saved = [int(p.name) for p in checkpoint.list_complete(dump)]
    assert 3 <= last < 20 and saved == sorted({2, last}), (last, saved)
    assert tmp_dirs(dump) == []
    for step in saved:
        ckpt = dump / "checkpoints" / str(step)
        assert integrity.verify(ckpt) is None
        assert torch.load(ckpt / "train_state_rank0.pt", weights_only=True)["step"] == step


def test_config(corpus, tmp_path):
    """The key is checkpoint.async_save: DESIGN.md's `checkpoint.async` is a Python keyword, which
    no dataclass field can be named. That spelling is refused with a hint naming the key, or, where
    lingua.config maps it, means the same key; a bad value is refused."""
    assert checkpoint.CheckpointArgs().async_save is False
    dump = tmp_path / "run"

    def load(*extra):
        return train.load_config(tiny_args(corpus, dump, *extra, steps=2))

    assert load().checkpoint.async_save is False
    assert load(ASYNC).checkpoint.async_save is True
    try:
        loaded = load("checkpoint.async=true")
    except ConfigError as err:
        assert "checkpoint.async_save" in str(err), str(err)
    else:
        assert loaded.checkpoint.async_save is True
    with pytest.raises(ConfigError, match="async_save"):
        load("checkpoint.async_save=sometimes")
    assert not dump.exists()


# --- two ranks ------------------------------------------------------------------------------

TWO = ["distributed.dp_shard=2", "checkpoint.every=2", "checkpoint.keep=0"]


@pytest.fixture(scope="module")
def two_rank_reference(corpus, tmp_path_factory):
    """Two ranks (FSDP), synchronous saves at steps 2, 4 and 6."""
    dump = tmp_path_factory.mktemp("sync2") / "run"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, dump, *TWO, steps=6))
    return dump


@pytest.mark.distributed
def test_two_ranks_write_while_training_and_resume_exactly(corpus, tmp_path, two_rank_reference):
    dump, report = tmp_path / "async2", tmp_path / "report"
    report.mkdir()
    args = tiny_args(corpus, dump, *TWO, ASYNC, steps=6)
    run_hooked(2, args, {"kind": "slow", "step": 2, "until_row": 3, "timeout": 60,
                         "report": str(report)})
    for rank in (0, 1):
        seen = json.loads((report / f"rank{rank}.json").read_text())
        assert seen["rows"] >= 3 and seen["tmp_exists"] and not seen["final_exists"], seen
        assert not seen["main_thread"]
    assert tmp_dirs(dump) == []
    assert_same_checkpoints(dump, two_rank_reference, [2, 4, 6])
    assert_equivalent(dump, two_rank_reference, rtol=0)

    first = read_rows(dump)
    for step in (4, 6):
        for path in (dump / "checkpoints" / str(step)).iterdir():
            path.unlink()
        (dump / "checkpoints" / str(step)).rmdir()
    proc = run_torchrun(2, "apps.llama.train", args)
    assert_resumed(dump, proc.stdout + proc.stderr, 2, first)
    assert_equivalent(dump, two_rank_reference, rtol=0)


@pytest.mark.distributed
def test_a_write_failing_on_one_rank_stops_every_rank(corpus, tmp_path, two_rank_reference):
    """Rank 1 cannot write step 4's shards: both ranks stop at a step boundary after it (not
    later than step 6, the next save, which waits for it), with the synchronous save's message;
    step 2's checkpoint stays the newest, and the same command resumes from it."""
    dump = tmp_path / "failing"
    args = tiny_args(corpus, dump, *TWO, ASYNC, steps=6)
    proc = run_hooked(2, args, {"kind": "fail", "step": 4, "rank": 1}, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    ckpts = dump / "checkpoints"
    message = (f"error: Could not write checkpoint {ckpts / '4'}: [Errno 28] No space left on "
               f"device. Nothing of it was kept; the previous checkpoint {ckpts / '2'} is intact.")
    # Each rank raises it; the first to exit gets the other stopped (as torchrun does), which
    # may come before that one printed: one or two lines, never none.
    assert out.count(message) in (1, 2), out[-4000:]
    assert tmp_dirs(dump) == [] and checkpoint.newest(dump) == ckpts / "2"
    assert [p.name for p in checkpoint.list_complete(dump)] == ["2"]
    assert integrity.verify(ckpts / "2") is None
    logged = [r["step"] for r in read_rows(dump)]
    assert logged[-1] in (5, 6), logged   # stopped at a boundary after step 4, by step 6

    first = read_rows(dump)
    proc = run_torchrun(2, "apps.llama.train", args)
    assert_resumed(dump, proc.stdout + proc.stderr, 2, first)
    assert_equivalent(dump, two_rank_reference, rtol=0)


if __name__ == "__main__":
    # One rank of `python -m apps.llama.train` with the writer hook LINGUA_TEST_WRITER describes.
    from lingua.launch import run

    install_writer_hook(json.loads(os.environ[HOOK_VAR]))
    run.exit_cli(lambda: train.main(sys.argv[1:]))
