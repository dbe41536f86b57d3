"""Data-parallel layouts on gloo against the single-process run with the same global batch.

Global batch = 8 sequences in every run: 1 process x 8, or N ranks x 8/N (x grad_accum).
"""

import json
import shutil

import pytest

from apps.llama import train
from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import assert_equivalent, assert_resumed, read_rows

pytestmark = pytest.mark.distributed
STEPS = 5


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("reference") / "run"
    train.main(tiny_args(corpus, dump, "data.batch_size=8", steps=STEPS))
    return dump


@pytest.mark.parametrize("nproc,layout,batch_size", [
    (2, ["distributed.dp_shard=2"], 4),
    (4, ["distributed.dp_shard=4"], 2),
    (2, ["distributed.dp_replicate=2", "distributed.dp_shard=1"], 4),
    (4, ["distributed.dp_replicate=2", "distributed.dp_shard=2"], 2),
], ids=["fsdp2", "fsdp4", "replicate2", "hsdp2x2"])
def test_layout_matches_single_process(corpus, tmp_path, reference, nproc, layout, batch_size):
    dump = tmp_path / "run"
    run_torchrun(nproc, "apps.llama.train",
                 tiny_args(corpus, dump, f"data.batch_size={batch_size}", *layout, steps=STEPS))
    assert_equivalent(dump, reference)


def test_checkpoint_from_two_shards_resumes_in_one_process(corpus, tmp_path, reference, capfd):
    dump = tmp_path / "run"
    args = tiny_args(corpus, dump, "checkpoint.every=3", "checkpoint.keep=0", steps=STEPS)
    run_torchrun(2, "apps.llama.train", args + ["data.batch_size=4", "distributed.dp_shard=2"])
    first = read_rows(dump)
    # Keep only the step-3 checkpoint (saved with dp_shard=2) and continue in one process.
    shutil.rmtree(dump / "checkpoints" / str(STEPS))
    capfd.readouterr()
    train.main(args + ["data.batch_size=8"])
    assert_resumed(dump, "".join(capfd.readouterr()), 3, first)
    assert_equivalent(dump, reference)


def test_bf16_fsdp_tracks_the_bf16_single_process_run(corpus, tmp_path):
    """bf16 compute (fp32 master weights, fp32 reduce) sharded vs autocast in one process: the
    rounding differs, so the match is loose, but a wrong reduction would be far off (a gradient
    2x too large moves the gradient norm by 100%). tests/test_dtypes.py shows both compute in
    bf16."""
    one = tmp_path / "one"
    train.main(tiny_args(corpus, one, "data.batch_size=8", "distributed.model_dtype=bf16",
                         steps=STEPS))
    two = tmp_path / "two"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, two, "data.batch_size=4",
                                                  "distributed.dp_shard=2",
                                                  "distributed.model_dtype=bf16", steps=STEPS))
    assert_equivalent(two, one, rtol=2e-2)


def test_sharding_over_4_ranks_cuts_per_rank_state_to_under_30_percent_of_replication(
        corpus, tmp_path):
    per_layout = {}
    for name, layout in {"replicate": ["distributed.dp_replicate=4", "distributed.dp_shard=1"],
                         "shard": ["distributed.dp_shard=4"]}.items():
        out = tmp_path / f"{name}.json"
        run_torchrun(4, "tests.workers.memory_worker",
                     [str(out), *tiny_args(corpus, tmp_path / name, "data.batch_size=2", *layout)])
        per_layout[name] = json.loads(out.read_text())
    for kind in ("params", "grads", "optim"):
        replicated = max(rank[kind] for rank in per_layout["replicate"])
        sharded = max(rank[kind] for rank in per_layout["shard"])
        assert replicated > 0 and sharded <= 0.3 * replicated, (kind, sharded, replicated)


def test_zero2_style_resharding_keeps_the_losses(corpus, tmp_path, reference):
    dump = tmp_path / "run"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, dump, "data.batch_size=4",
                                                  "distributed.dp_shard=2",
                                                  "distributed.reshard_after_forward=false",
                                                  steps=STEPS))
    assert_equivalent(dump, reference)
