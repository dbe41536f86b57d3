"""The collectives of one training step, counted on 2 gloo ranks under FSDP2
(tests/workers/step_collectives.py): a step that neither logs nor saves issues FSDP's all-gathers
and reduce-scatters, the gradient norm's all-reduce, and ONE all-reduce more, the step's
tally (lingua/train/tally.py), which carries the loss-spike check (spikes.policy=log, the
default), the ranks' stop signals and whether an asynchronous checkpoint write is done. Before
the tally those were an all-reduce each (2 a step, 3 while a write was pending), and each
read its result on the host."""

import json

import pytest

from tests.conftest import run_torchrun, tiny_args

pytestmark = pytest.mark.distributed

FSDP = {"_allgather_base_", "_reduce_scatter_base_"}   # parameters gathered, gradients reduced


@pytest.fixture(scope="module")
def per_step(corpus, tmp_path_factory):
    dump = tmp_path_factory.mktemp("collectives")
    # Steps 1 and 3 neither log nor save; step 2 starts an asynchronous save, written while
    # step 3 runs; step 5 logs (validation included) and saves.
    run_torchrun(2, "tests.workers.step_collectives", tiny_args(
        corpus, dump, "distributed.dp_shard=2", "logging.every=5", "checkpoint.every=2",
        "checkpoint.async_save=true", "spikes.policy=log"))
    return [json.loads((dump / f"collectives_rank{r}.json").read_text()) for r in range(2)]


def test_a_plain_step_has_one_all_reduce_beyond_the_gradient_norms(per_step):
    for rank, steps in enumerate(per_step):
        for step in ("1", "3"):   # step 3 runs while step 2's checkpoint is being written
            counts = steps[step]
            others = {op: n for op, n in counts.items() if op not in FSDP}
            # all_reduce: the norm of the sharded gradients (DTensor's); allreduce_: the
            # tally.
            assert others == {"all_reduce": 1, "allreduce_": 1}, (rank, step, counts)
        assert steps["1"] == steps["3"], rank


def test_logging_and_saving_steps_add_their_own(per_step):
    # Not a limit, a check that the counter sees what those steps do: the checkpoint's
    # agreement (broadcast of its directory, gathers of errors and manifests) and the logged
    # row's reductions, every logging.every and checkpoint.every steps.
    for steps in per_step:
        assert steps["2"].get("broadcast_", 0) >= 1
        assert steps["5"]["allreduce_"] > 1
