"""Hazards that grow with the number of ranks, around the training loop (issue 32): the async
checkpoint's gloo group made at start, not at the first save mid-run; old checkpoints pruned after
the save's closing barrier, not while the other ranks wait in it. (Each rank verifying only its
share at resume: tests/test_resume_verify.py; downstream evaluation: tests/test_downstream.py and
tests/test_lm_eval_model.py.)"""

import json
import logging

import pytest
import torch
from torch import nn

from lingua import checkpoint
from lingua.checkpoint import CheckpointArgs, integrity
from tests.conftest import run_torchrun, tiny_args


@pytest.mark.distributed
def test_the_async_checkpoint_group_exists_before_the_first_step(corpus, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    args = tiny_args(corpus, tmp_path / "run", "distributed.dp_shard=2",
                     "checkpoint.async_save=true", "checkpoint.every=2", steps=4)
    run_torchrun(2, "tests.workers.scale_async_group_worker", [str(out), *args], timeout=180)
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["made"] and seen["again"], seen   # made once, reused by the first save


def test_the_async_checkpoint_group_is_made_only_where_it_is_used(monkeypatch):
    def no_group():
        raise AssertionError("the async checkpoint group was made")

    monkeypatch.setattr(checkpoint, "_async_group", no_group)
    checkpoint.prepare_async_saves(CheckpointArgs(async_save=False), world_size=8)
    checkpoint.prepare_async_saves(CheckpointArgs(async_save=True), world_size=1)


def tiny_save(dump, step: int, keep: int = 1, in_use=None):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return checkpoint.save(dump, step, [model], [optimizer], {"step": step}, "steps: 1\n",
                           rank=0, world_size=1, keep=keep, in_use=in_use)


def test_old_checkpoints_are_pruned_after_the_closing_barrier(tmp_path, monkeypatch):
    order = []
    barrier, prune = checkpoint._barrier, checkpoint.prune

    def recording_barrier(world_size):
        order.append("barrier")
        barrier(world_size)

    def recording_prune(root, keep, in_use=None, newest=None):
        order.append(("prune", newest.name))
        prune(root, keep, in_use, newest)

    tiny_save(tmp_path, 1)
    monkeypatch.setattr(checkpoint, "_barrier", recording_barrier)
    monkeypatch.setattr(checkpoint, "prune", recording_prune)
    final = tiny_save(tmp_path, 2)
    assert order == ["barrier", ("prune", "2")]
    assert checkpoint.list_complete(tmp_path) == [final]


def test_a_failing_prune_never_stops_the_run(tmp_path, monkeypatch, caplog):
    tiny_save(tmp_path, 1)

    def in_use(step):
        raise OSError(116, "Stale file handle")

    with caplog.at_level(logging.WARNING):
        final = tiny_save(tmp_path, 2, in_use=in_use)
    assert checkpoint.list_complete(tmp_path)[-1] == final
    assert "could not prune old checkpoints" in caplog.text and "Stale file handle" in caplog.text


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path, monkeypatch):
    """Not even when its stat fails for a moment (it would be set aside as damaged), nor when
    newer ones exist (after a rollback); in-use ones stay too."""
    for step in (1, 2, 3):
        tiny_save(tmp_path, step, keep=0)
    root = checkpoint.checkpoints_dir(tmp_path)
    monkeypatch.setattr(integrity, "verify", lambda ckpt, checksums=True: None)
    integrity.prune(root, keep=1, in_use=lambda step: step == 1, newest=root / "2")
    assert sorted(p.name for p in root.iterdir()) == ["1", "2", "3"]
    monkeypatch.setattr(integrity, "verify", lambda ckpt, checksums=True: "stat failed")
    integrity.prune(root, keep=1, newest=root / "2")
    assert sorted(p.name for p in root.iterdir()) == ["1.damaged", "2", "3.damaged"]
