"""The process groups behind the device mesh: each carries the default group's timeout
(distributed.timeout_s), and a dimension whose ranks another already covers reuses its group
(the size-1 dimensions share one)."""

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


def root_mesh(device_type: str, sizes: dict):
    """init_device_mesh(device_type, sizes.values(), mesh_dim_names=sizes) with its groups made
    by `_make_groups`: the size-1 dimensions share one group instead of one each."""
    from torch.distributed.device_mesh import DeviceMesh

    with torch.device("cpu"):
        ranks = torch.arange(dist.get_world_size(), dtype=torch.int).view(*sizes.values())
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(sizes), _init_backend=False)
    mesh._setup_world_group_and_device()   # what _init_backend=True does first
    _make_groups(mesh, tuple(sizes.values()))
    return mesh


def flatten(root, parts: tuple, name: str):
    """root[parts]._flatten(name), with its group made by `_make_groups` (so, e.g., dp =
    dp_replicate x dp_shard with dp_replicate=1 is dp_shard's group under another name)."""
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    layout = _MeshLayout([root[parts]._layout.collapse()])
    mesh = DeviceMesh(root.device_type, _layout=layout, _rank_map=root._rank_map,
                      mesh_dim_names=(name,), _root_mesh=root, _init_backend=False)
    _make_groups(mesh, (layout.numel(),))
    root._flatten_mapping[name] = mesh   # as _flatten records it
    return mesh


def unflatten(source, sizes: tuple, names: tuple):
    """source._unflatten(0, sizes, names) for a 1-D mesh `source`, with its groups made by
    `_make_groups`: a dimension of size 1 or equal to `source` makes none."""
    from torch.distributed.device_mesh import DeviceMesh

    # A copy without groups: _unflatten then makes none itself.
    bare = DeviceMesh(source.device_type, _layout=source._layout, _rank_map=source._rank_map,
                      mesh_dim_names=source.mesh_dim_names, _root_mesh=source._get_root_mesh(),
                      _init_backend=False)
    mesh = bare._unflatten(0, sizes, names)
    _make_groups(mesh, sizes)
    return mesh


def _make_groups(mesh, sizes: tuple) -> None:
    """Give `mesh` (built with _init_backend=False) one process group per dimension, as torch's
    DeviceMesh._init_process_groups does, except that a dimension splitting the ranks exactly as
    one of the same root mesh already does takes that one's group: all size-1 dimensions share
    one group of each rank alone, a flattened or unflattened dimension over the same ranks as
    another reuses its group. Collective: the choice depends on the layouts only, so every rank
    makes the same groups in the same order.

    torch has no public way to choose a mesh dimension's group; this builds the mesh as torch's
    own slicing does (DeviceMesh._create_sub_mesh: _init_backend=False, then the group names)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import _resolve_process_group

    root = mesh._get_root_mesh()
    known = _known_groups(root)
    options = subgroup_options()
    names = []
    for layout, dim_name, size in zip(mesh._layout, mesh.mesh_dim_names, sizes):
        key = _partition(layout, root._rank_map)
        if key not in known:
            known[key] = DeviceMesh._init_one_process_group(layout, root._rank_map, dim_name,
                                                            override(size, options))
            root._pg_registry[known[key]] = _resolve_process_group(known[key])
        names.append(known[key])
    mesh._dim_group_names = names


def _known_groups(root) -> dict:
    """{partition: group name} of the groups of `root`'s dimensions and flattened views, kept
    on the root (which torch may have built itself, as tests/ep_worker.py does)."""
    known = root.__dict__.get("_groups_by_partition")
    if known is None:
        known = root.__dict__["_groups_by_partition"] = {}
        for mesh in (root, *root._flatten_mapping.values()):
            for layout, name in zip(mesh._layout, getattr(mesh, "_dim_group_names", ())):
                known.setdefault(_partition(layout, root._rank_map), name)
    return known


def _partition(layout, rank_map) -> tuple:
    """The groups of ranks one mesh dimension's layout splits the ranks into, each in mesh
    order."""
    from torch.distributed._mesh_layout import _MeshLayout

    ranks = _MeshLayout([layout]).remap_to_tensor(rank_map).reshape(-1, layout.numel())
    return tuple(sorted(tuple(group) for group in ranks.tolist()))


def created() -> int:
    """How many process groups this rank belongs to (the default one included): one
    communicator each on NCCL, one set of connections each on gloo."""
    return len(dist.distributed_c10d._world.pg_map)
