"""The Qwen options of the shared LLaMA model in every parallel layout, against one process.

Qwen3's shape: a head width that is not dim / n_heads (24 here: 4 heads x 24 = 96 != dim 64)
and an RMSNorm over each head's q and k (model.qk_norm). Under tensor parallelism q_norm and
k_norm see only the rank's heads (attention_plan), under context parallelism the rank's tokens,
under a pipeline the stage's layers. Qwen2's q/k/v biases are sharded with their columns under
tp. Each layout is one torchrun of 3 steps of the 2-layer tiny model, compared with
tests/equivalence.py (losses and gradient norms at every step, final parameters).

Tied embeddings (Qwen3-0.6B, Qwen2.5-0.5B) are refused with pp > 1 and tp > 1 at start
(tests/test_pipeline.py, tests/test_tensor_parallel.py); these shapes are untied, as Qwen3-8B.
"""

import pytest

from apps.llama import train
from tests.conftest import run_torchrun, tiny_args
from tests.equivalence import (
    assert_equivalent,
    assert_same_checksums,
    assert_same_rows,
    final_checkpoint,
    model_checksums,
    read_rows,
)

pytestmark = pytest.mark.distributed
STEPS = 3
QWEN3 = ["model.family=qwen3", "model.qk_norm=true", "model.head_dim=24"]
QWEN2 = ["model.family=qwen2", "model.qkv_bias=true"]


def reference_run(corpus, dump, shape):
    train.main(tiny_args(corpus, dump, "data.batch_size=8", *shape, steps=STEPS))
    return dump


@pytest.fixture(scope="module")
def qwen3_reference(corpus, tmp_path_factory):
    return reference_run(corpus, tmp_path_factory.mktemp("qwen3") / "run", QWEN3)


def check_layout(corpus, tmp_path, reference, shape, layout):
    dump = tmp_path / "run"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, dump, *shape, *layout, steps=STEPS))
    assert_equivalent(dump, reference)


@pytest.mark.parametrize("layout", [
    ["distributed.dp_shard=2", "data.batch_size=4"],
    ["distributed.tp=2", "distributed.dp_shard=1", "data.batch_size=8"],
    ["distributed.cp=2", "distributed.dp_shard=1", "data.batch_size=8"],
    ["distributed.pp=2", "distributed.dp_shard=1", "data.batch_size=8",
     "distributed.pp_microbatches=4"],
], ids=["fsdp2", "tp2", "cp2", "pp2"])
def test_qwen3_shape_matches_one_process(corpus, tmp_path, qwen3_reference, layout):
    check_layout(corpus, tmp_path, qwen3_reference, QWEN3, layout)


def test_qwen2_biases_under_tp2_match_one_process(corpus, tmp_path):
    """The k bias is held to 1e-3, everything else to equivalence.RTOL: attention ignores a shift
    shared by all keys, so only RoPE's rotation leaves the k bias a gradient, a sum over tokens
    whose terms cancel to ~1% of their size (4-10x more than q's), and AdamW divides that small
    sum by its own size: the layout's different order of sums moves it by ~5e-5 after 3 steps.
    A bias sharded apart from its columns, or its gradient missing a reduction, moves it by far
    more, and moves q's and v's biases too."""
    reference = reference_run(corpus, tmp_path / "one", QWEN2)
    dump = tmp_path / "run"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, dump, *QWEN2, "distributed.tp=2",
                                                  "distributed.dp_shard=1", "data.batch_size=8",
                                                  steps=STEPS))
    assert_same_rows(read_rows(dump), read_rows(reference))
    got, want = (model_checksums(final_checkpoint(d, STEPS)) for d in (dump, reference))
    k_bias = {n for n in want if n.endswith("attention.wk.bias")}
    assert len(k_bias) == 2, sorted(want)   # both layers' k biases trained and saved
    assert_same_checksums({n: got[n] for n in k_bias}, {n: want[n] for n in k_bias}, rtol=1e-3)
    assert_same_checksums({n: s for n, s in got.items() if n not in k_bias},
                          {n: s for n, s in want.items() if n not in k_bias})
