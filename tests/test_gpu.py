"""CUDA paths: run on a GPU machine (`bash setup/test.sh -m gpu`); skipped where there is no GPU."""

import pytest
import torch

from apps.llama import train
from tests.conftest import read_metrics, run_torchrun, tiny_args
from tests.equivalence import assert_equivalent

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_bf16_compile_on_one_gpu_trains_and_reports_mfu(corpus, tmp_path):
    dump = tmp_path / "run"
    train.main(tiny_args(corpus, dump, "distributed.model_dtype=bf16", "distributed.compile=true",
                         steps=20))
    rows = read_metrics(dump)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert 0 < rows[-1]["mfu"] < 1 and rows[-1]["peak_mem_gib"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_on_two_gpus_matches_one_gpu(corpus, tmp_path):
    one = tmp_path / "one"
    train.main(tiny_args(corpus, one, "data.batch_size=8", steps=5))
    two = tmp_path / "two"
    run_torchrun(2, "apps.llama.train", tiny_args(corpus, two, "data.batch_size=4",
                                                  "distributed.dp_shard=2", steps=5))
    # TF32 is off by default for matmuls, but NCCL's reduction order differs from one GPU's.
    assert_equivalent(two, one, rtol=1e-4)
