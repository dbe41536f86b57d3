"""Every parallel layout against the single-process run with the same global batch.

A 4-layer tiny model, fp32, 5 steps; the global batch is 8 sequences in every run. Each layout
must give the reference's loss and gradient norm at every step, its validation loss and its final
parameters (tests/equivalence.py); each also runs with activation checkpointing on.
"""

import shutil

import pytest

from apps.llama import train
from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows

pytestmark = pytest.mark.distributed
STEPS = 5
FOUR_LAYERS = ["model.n_layers=4"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("reference") / "run"
    train.main(tiny_args(corpus, dump, "data.batch_size=8", *FOUR_LAYERS, steps=STEPS))
    return dump


def check_layout(corpus, tmp_path, reference, nproc, layout, ac):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.llama.train",
                 tiny_args(corpus, dump, *FOUR_LAYERS, *layout, f"distributed.ac={ac}",
                           steps=STEPS))
    assert "val_loss" in read_rows(reference)[-1]
    assert_equivalent(dump, reference)


PP = ["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=8",
      "distributed.pp_microbatches=4"]
SCHEDULES = {
    "GPipe": [], "1F1B": [],
    "Interleaved1F1B": ["distributed.pp_virtual_stages=2"],
    "LoopedBFS": ["distributed.pp_virtual_stages=2"],
    "InterleavedZeroBubble": ["distributed.pp_virtual_stages=2"],
    "ZBVZeroBubble": ["distributed.pp_virtual_stages=2"],
    "DualPipeV": ["distributed.pp_virtual_stages=2"],
}


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_pipeline_schedules(corpus, tmp_path, reference, schedule, ac):
    check_layout(corpus, tmp_path, reference, 2,
                 PP + [f"distributed.pp_schedule={schedule}", *SCHEDULES[schedule]], ac)


@pytest.mark.parametrize("ac", ["none", "op"])
def test_pipeline_with_fsdp(corpus, tmp_path, reference, ac):
    check_layout(corpus, tmp_path, reference, 4,
                 ["distributed.pp=2", "distributed.dp_shard=2", "data.batch_size=4",
                  "distributed.pp_microbatches=2"], ac)


@pytest.mark.parametrize("ac", ["none", "layer"])
def test_fsdp_and_hsdp_with_ac(corpus, tmp_path, reference, ac):
    check_layout(corpus, tmp_path, reference, 4,
                 ["distributed.dp_replicate=2", "distributed.dp_shard=2", "data.batch_size=2"], ac)


def resume_on_another_layout(corpus, tmp_path, reference, layout):
    """Save at step 3 under dp_shard=4, continue under `layout` from there: what one process
    computes, with steps 1-3 not run again."""
    dump = tmp_path / "run"
    args = tiny_args(corpus, dump, *FOUR_LAYERS, "checkpoint.every=3", "checkpoint.keep=0",
                     steps=STEPS)
    run_torchrun(4, "apps.llama.train", args + ["distributed.dp_shard=4", "data.batch_size=2"])
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    proc = run_torchrun(4, "apps.llama.train", args + layout)
    assert_resumed(dump, proc.stdout + proc.stderr, 3, first)
    assert_equivalent(dump, reference)


def test_resharding_from_fsdp4_to_pipeline_x_fsdp(corpus, tmp_path, reference):
    resume_on_another_layout(corpus, tmp_path, reference,
                             ["distributed.pp=2", "distributed.dp_shard=2", "data.batch_size=4",
                              "distributed.pp_microbatches=2"])


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
    (4, ["distributed.tp=2", "distributed.dp_shard=2", "data.batch_size=4"]),
    (8, ["distributed.tp=2", "distributed.dp_shard=2", "distributed.pp=2", "data.batch_size=4",
         "distributed.pp_microbatches=2"]),
], ids=["tp2", "fsdp2_tp2", "fsdp2_tp2_pp2"])
def test_tensor_parallel_layouts(corpus, tmp_path, reference, nproc, layout, ac):
    check_layout(corpus, tmp_path, reference, nproc, layout, ac)


def test_resharding_from_fsdp4_to_fsdp_x_tp(corpus, tmp_path, reference):
    resume_on_another_layout(corpus, tmp_path, reference,
                             ["distributed.tp=2", "distributed.dp_shard=2", "data.batch_size=4"])


@pytest.mark.parametrize("ac", ["none", "op"])
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.cp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
    (4, ["distributed.cp=2", "distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
    (8, ["distributed.cp=2", "distributed.tp=2", "distributed.dp_shard=2", "data.batch_size=4"]),
], ids=["cp2", "cp2_tp2", "fsdp2_cp2_tp2"])
def test_context_parallel_layouts(corpus, tmp_path, reference, nproc, layout, ac):
    check_layout(corpus, tmp_path, reference, nproc, layout, ac)


def test_context_parallel_with_document_masking(corpus, tmp_path):
    """Block-causal attention (no attention across documents) under cp=2 against one process."""
    one = tmp_path / "one"
    train.main(tiny_args(corpus, one, "data.batch_size=8", "model.attn_mask=block_causal", steps=3))
    two = tmp_path / "two"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, two, "data.batch_size=8",
                                                  "distributed.cp=2", "distributed.dp_shard=1",
                                                  "model.attn_mask=block_causal", steps=3))
    assert_equivalent(two, one)


@pytest.mark.parametrize("ac", ["full"])
def test_fsdp4_with_ac(corpus, tmp_path, reference, ac):
    check_layout(corpus, tmp_path, reference, 4, ["distributed.dp_shard=4", "data.batch_size=2"],
                 ac)


def test_compile_composes_with_fsdp(corpus, tmp_path, reference):
    check_layout(corpus, tmp_path, reference, 2,
                 ["distributed.dp_shard=2", "data.batch_size=4", "distributed.compile=true"],
                 "none")


def test_compile_composes_with_pipelining(corpus, tmp_path, reference):
    """Compiled blocks on both stages and the compiled loss on the last (called by the schedule;
    torch's shape-inference call stays eager). Micro-batches of 4 sequences, as each rank's batch
    in test_compile_composes_with_fsdp: the same block and loss graphs, so inductor's cache serves
    this test what that one compiled (most of either test's time is inductor's C++ compile)."""
    layout = ["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=8",
              "distributed.pp_microbatches=2", "distributed.pp_schedule=1F1B",
              "distributed.compile=true"]
    check_layout(corpus, tmp_path, reference, 2, layout, "none")
