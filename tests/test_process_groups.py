"""Every process group of the mesh, expert parallelism and the async checkpoint carries
distributed.timeout_s, and a group is made once for each distinct set of ranks a layout needs
(tests/workers/groups_worker.py on 4 gloo ranks)."""

import json

import pytest
import torch

from tests.conftest import run_torchrun

pytestmark = pytest.mark.distributed

# Groups each rank joins per layout (4 ranks): one per distinct way a root mesh dimension or
# flattened view splits the ranks, the size-1 ones sharing one group of each rank alone, and none
# for a world-wide dimension (the default group). torch's defaults made 8, 8, 6, 7, 6 and 4 (plus
# 2 EP groups on every ep_meshes call); one group per dimension (size-1 ones included) made 5, 5,
# 5, 5, 5 and 4.
MESH_GROUPS = {"dp_shard2_tp2": 3, "pp2_cp2": 3, "hsdp2x2": 3, "replicate2_cp2": 3,
               "dp_shard2_cp2": 3, "dp_shard4_ep2": 1, "dp_shard2_tp2_ep2": 3,
               "replicate2_shard2_ep2": 3}
# EP's groups: with ep = dp_shard x cp (2 here) "ep" is dp_shard_cp's group and "dp_shard_mod_ep"
# (size 1) the one each rank holds alone; only dp_shard=4, ep=2 needs two new ones.
EP_GROUPS = {"dp_shard4_ep2": 2, "dp_shard2_tp2_ep2": 0, "replicate2_shard2_ep2": 0}
# Layouts with a world-wide dimension or view: on a machine with CUDA, torch gives a gloo mesh a
# group of its own for it instead of the default one (seen on an H200, torch 2.11): one more.
WORLD_WIDE = {"hsdp2x2", "replicate2_cp2", "dp_shard2_cp2", "dp_shard4_ep2",
              "replicate2_shard2_ep2"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("groups")
    run_torchrun(4, "tests.workers.groups_worker", [str(out), "17"], timeout=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_every_group_carries_the_configured_timeout(results):
    for rank, result in enumerate(results):
        assert result["world"] == 17 and result["async_checkpoint"] == 17, rank
        for layout in MESH_GROUPS:
            timeouts = result[layout]["timeouts"]
            assert set(timeouts.values()) == {17}, (rank, layout, timeouts)
        ep = result["dp_shard2_tp2_ep2"]["timeouts"]
        assert "ep" in ep and "expert_fsdp.dp_shard_mod_ep" in ep
        assert "expert_fsdp.dp_replicate" in result["replicate2_shard2_ep2"]["timeouts"]


def test_each_distinct_group_is_made_once(results):
    for rank, result in enumerate(results):
        want = {layout: n + (layout in WORLD_WIDE and torch.cuda.is_available())
                for layout, n in MESH_GROUPS.items()}
        assert {layout: result[layout]["mesh"] for layout in MESH_GROUPS} == want, rank
        for layout in MESH_GROUPS:   # and no two of the mesh's groups have the same ranks
            assert result[layout]["mesh"] == result[layout]["distinct"], (rank, layout)
        for layout, n in EP_GROUPS.items():
            assert result[layout]["ep"] == n and result[layout]["ep_again"] == 0, (rank, layout)
