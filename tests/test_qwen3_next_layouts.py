"""apps.qwen3_next in every layout it plans (apps/qwen3_next/parallelize.py), against one process.

A tiny hybrid: 4 layers, 3 Gated DeltaNet to 1 gated full attention (layer 3), each on an MoE of 4
experts top-2 with a sigmoid-gated shared expert; Gated DeltaNet key heads 2 serving value heads
4, so tp=2 gives each rank one key head with its two value heads. Each layout is one torchrun of
3 steps, compared with tests/equivalence.py (losses, gradient norms and routing metrics at every
step, final parameters) with ONE shared single-process reference. No balancing loss: its
statistics are per micro-batch, so with it on a pipeline's micro-batches would not equal the
reference's whole batch (apps/moe's tests cover the balancing losses across layouts). pp=2 puts
layers 0-1 (Gated DeltaNet) on one stage and 2-3 (Gated DeltaNet, full attention) on the other.
"""

import shutil

import pytest

from apps.qwen3_next import train
from lingua.errors import ConfigError
from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import (
    assert_equivalent,
    assert_resumed,
    assert_same_checksums,
    assert_same_rows,
    final_checkpoint,
    model_checksums,
    read_rows,
)

STEPS = 3
HYBRID = ["model.n_layers=4", "model.full_attention_every=4", "model.head_dim=16",
          "model.linear_key_heads=2", "model.linear_value_heads=4",
          "model.linear_key_head_dim=16", "model.linear_value_head_dim=16", "model.n_experts=4",
          "model.top_k=2", "model.expert_hidden_dim=32", "model.shared_expert_hidden_dim=32",
          "model.aux_loss_coef=0", "model.z_loss_coef=0"]
ROUTING = {"moe/": 1e-4}


def qwen3_next_args(corpus, dump, *extra):
    return ["config=debug", *tiny_args(corpus, dump, *HYBRID, "checkpoint.every=2",
                                       "checkpoint.keep=0", *extra, steps=STEPS)]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("qwen3_next_reference") / "run"
    train.main(qwen3_next_args(corpus, dump, "data.batch_size=8"))
    return dump


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,layout", [
    (2, ["distributed.dp_shard=2", "data.batch_size=4"]),
    (2, ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=8"]),
    (2, ["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=8",
         "distributed.pp_microbatches=2"]),
    (2, ["distributed.ep=2", "distributed.dp_shard=2", "data.batch_size=4"]),
    (4, ["distributed.dp_shard=2", "distributed.tp=2", "distributed.ep=2", "data.batch_size=4"]),
], ids=["fsdp2", "tp2", "pp2", "ep2", "fsdp2_tp2_ep2"])
def test_layout_matches_one_process(corpus, tmp_path, reference, nproc, layout):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.qwen3_next.train", qwen3_next_args(corpus, dump, *layout))
    assert_equivalent(dump, reference, prefixes=ROUTING)


def test_resume_is_exact(corpus, tmp_path, reference, capfd):
    """Resumed from the reference's step-2 checkpoint, step 3 is the reference's, bit for bit."""
    dump = tmp_path / "run"
    shutil.copytree(reference, dump)
    first = read_rows(dump)
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    capfd.readouterr()
    train.main(qwen3_next_args(corpus, dump, "data.batch_size=8"))
    assert_resumed(dump, "".join(capfd.readouterr()), 2, first)
    assert_same_rows(read_rows(dump), first, rtol=0, prefixes={"moe/": 0})
    assert_same_checksums(model_checksums(final_checkpoint(dump, STEPS)),
                          model_checksums(final_checkpoint(reference, STEPS)), rtol=0)


@pytest.mark.parametrize("override,world,needles", [
    ("distributed.cp=2", 2, ["distributed.cp=2", "chunk state", "distributed.dp_shard"]),
    ("distributed.tp=4", 4, ["model.linear_key_heads=2", "distributed.tp=4"]),
])
def test_layouts_without_a_plan_are_refused(corpus, tmp_path, monkeypatch, override, world,
                                            needles):
    """At config time, before any process group: cp (the recurrence runs along the whole
    sequence) and a tp that would split a Gated DeltaNet key head."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as err:
        train.load_config(qwen3_next_args(corpus, tmp_path / "x", override,
                                          "distributed.dp_shard=1", "model.n_heads=4",
                                          "model.n_kv_heads=4"))
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert not (tmp_path / "x").exists()
