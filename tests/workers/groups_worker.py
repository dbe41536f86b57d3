"""The process groups behind the mesh on 4 gloo ranks, for tests/test_process_groups.py.

`torchrun --nproc-per-node 4 -m tests.workers.groups_worker OUT_DIR TIMEOUT_S`: starts the
process group through `distributed.init` with distributed.timeout_s=TIMEOUT_S, builds the mesh of
each layout in LAYOUTS (and ep_meshes where it has ep, twice), the async checkpoint's group, and
writes OUT_DIR/rank<r>.json: per layout, the groups this rank joined while building it, how many
distinct ones its named dimensions have, and the timeout (seconds) of every group it holds, by
name.
"""

import json
import sys
from pathlib import Path

from lingua import checkpoint
from lingua.parallel import distributed, groups
from lingua.parallel.distributed import DistributedArgs
from lingua.parallel.expert_parallel import ep_meshes

# name: (DistributedArgs overrides, ep)
LAYOUTS = {
    "dp_shard2_tp2": (dict(tp=2), 1),
    "pp2_cp2": (dict(pp=2, cp=2), 1),
    "hsdp2x2": (dict(dp_replicate=2), 1),
    "replicate2_cp2": (dict(dp_replicate=2, cp=2), 1),
    "dp_shard2_cp2": (dict(cp=2), 1),
    "dp_shard4_ep2": (dict(), 2),
    "dp_shard2_tp2_ep2": (dict(tp=2), 2),
    "replicate2_shard2_ep2": (dict(dp_replicate=2), 2),
}
NAMES = distributed.MESH_DIMS + tuple(distributed.FLATTENED)


def timeout_s(group) -> float:
    return group._get_backend(distributed.torch.device("cpu")).options._timeout.total_seconds()


def measure(overrides: dict, ep: int, timeout: int) -> dict:
    args = DistributedArgs(timeout_s=timeout, **overrides)
    before = groups.created()
    mesh = distributed.build_mesh(distributed.parallel_dims(args, 4), "cpu")
    result = {"mesh": groups.created() - before}
    timeouts = {name: timeout_s(mesh[name].get_group()) for name in NAMES}
    # The groups behind the named dimensions, other than the default one (made before).
    names = {mesh[name].get_group().group_name for name in NAMES}
    result["distinct"] = len(names - {distributed.dist.group.WORLD.group_name})
    if ep > 1:
        before = groups.created()
        ep_mesh, fsdp_mesh = ep_meshes(mesh, ep)
        result["ep"] = groups.created() - before
        before = groups.created()
        assert ep_meshes(mesh, ep) == (ep_mesh, fsdp_mesh)   # a second pipeline part
        result["ep_again"] = groups.created() - before
        timeouts["ep"] = timeout_s(ep_mesh.get_group())
        timeouts.update({f"expert_fsdp.{name}": timeout_s(fsdp_mesh.get_group(name))
                         for name in fsdp_mesh.mesh_dim_names})
    result["timeouts"] = timeouts
    return result


def main(out_dir: Path, timeout: int) -> None:
    env = distributed.init(DistributedArgs(tp=2, timeout_s=timeout))
    results = {"world": timeout_s(distributed.dist.group.WORLD)}
    results.update({name: measure(overrides, ep, timeout)
                    for name, (overrides, ep) in LAYOUTS.items()})
    results["async_checkpoint"] = timeout_s(checkpoint._async_group())
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(results, indent=1))
    distributed.barrier(env)
    distributed.exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
