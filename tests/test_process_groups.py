"""Every process group of the mesh, expert parallelism and the async checkpoint carries
distributed.timeout_s, and a group is made once for each distinct set of ranks a layout needs
(tests/workers/groups_worker.py on 4 gloo ranks)."""

import json

import pytest
import torch

from tests.conftest import run_torchrun

pytestmark = pytest.mark.distributed

# Groups each rank joins per layout (4 ranks): one per root mesh dimension, the size-1 ones
# included (torch's init_device_mesh makes them), but none for a world-wide dimension (the default
# group) and none for a flattened view whose ranks another group already has. torch's defaults
# made 8, 8, 6, 7, 6 and 4 (plus 2 EP groups on every ep_meshes call).
MESH_GROUPS = {"dp_shard2_tp2": 5, "pp2_cp2": 5, "hsdp2x2": 5, "replicate2_cp2": 5,
               "dp_shard2_cp2": 5, "dp_shard4_ep2": 4, "dp_shard2_tp2_ep2": 5,
               "replicate2_shard2_ep2": 5}
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
        for layout in ("dp_shard4_ep2", "dp_shard2_tp2_ep2", "replicate2_shard2_ep2"):
            assert result[layout]["ep"] == 2 and result[layout]["ep_again"] == 0, (rank, layout)
