"""The process groups behind the device mesh: each carries the default group's timeout
(distributed.timeout_s), and a dimension whose ranks another already covers reuses its group."""

import copy
import datetime
from typing import Optional

import torch
import torch.distributed as dist


def _world_backends() -> dict:
    """{name: backend} of the default group, e.g. nccl and gloo for "cuda:nccl,cpu:gloo"."""
    world = dist.group.WORLD
    backends = (world._get_backend(torch.device(d)) for d in world._device_types)
    return {backend.name(): backend for backend in backends}


def world_timeout() -> Optional[datetime.timedelta]:
    """The default group's timeout (what init_process_group was given), or None on a backend
    that keeps none (the planner's fake one)."""
    world = dist.group.WORLD
    for device in world._device_types:
        timeout = getattr(getattr(world._get_backend(device), "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def subgroup_options():
    """Backend options for a mesh sub-group that carry the default group's timeout.

    torch creates sub-groups with timeout=None, i.e. the backend's default (NCCL 10 min, gloo
    30 min), unless the mesh's backend_override passes options: DeviceMesh then hands
    `options._timeout` to split_group / new_group. NCCL's options are the default group's, copied,
    as split_group does when given none; gloo's cannot be copied, and only their timeout is read.
    None where a backend is neither (fake): torch's own defaults then, as before. Sub-groups
    have the default group's backends, whatever device type the mesh is built for."""
    backends = _world_backends()
    if not set(backends) <= {"nccl", "gloo"}:
        return None
    if "nccl" in backends:   # one options object serves every backend of a group: gloo's reads
        return copy.deepcopy(backends["nccl"].options)   # nothing from it but the timeout
    options = dist.ProcessGroupGloo._Options()
    options._timeout = backends["gloo"].options._timeout
    return options


def override(size: int, options) -> tuple:
    """The (backend, options) pair for one mesh dimension of `size` ranks. A world-wide dimension
    gets none: DeviceMesh then reuses the default group (which has the timeout already) instead
    of making a copy of it; except on a machine with CUDA under gloo, where it makes one anyway
    (DeviceMesh._init_one_process_group), which must then get the options."""
    world_wide = size == dist.get_world_size()
    if options is None or (world_wide and not (torch.cuda.is_available()
                                               and dist.get_backend() == "gloo")):
        return (None, None)
    return (None, options)


def alias(source, name: str):
    """A 1-D mesh named `name` over the ranks and the process group of the 1-D mesh `source`,
    with no new group: a flattened dimension whose other parts have size 1 (dp = dp_replicate x
    dp_shard with dp_replicate=1) holds the same ranks, in the same order, as `source`.

    torch has no public way to give a second name to a group; this builds the mesh as its own
    slicing does (DeviceMesh._create_sub_mesh: _init_backend=False, then the group's name)."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(source.device_type, _layout=source._layout, _rank_map=source._rank_map,
                      mesh_dim_names=(name,), _root_mesh=source._get_root_mesh(),
                      _init_backend=False)
    mesh._dim_group_names = list(source._dim_group_names)
    return mesh


def created() -> int:
    """How many process groups this rank belongs to (the default one included): one
    communicator each on NCCL, one set of connections each on gloo."""
    return len(dist.distributed_c10d._world.pg_map)
