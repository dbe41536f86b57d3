"""The device mesh's process groups: each has the default group's timeout (distributed.timeout_s),
and a dimension whose ranks another already covers reuses its group (size-1 ones share one)."""

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
    """The default group's timeout, or None on a backend that keeps none (the planner's fake)."""
    world = dist.group.WORLD
    for device in world._device_types:
        timeout = getattr(getattr(world._get_backend(device), "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def subgroup_options():
    """A sub-group's backend options, with the default group's timeout (else the backend's):
    NCCL's copied from the default group; gloo's timeout only; None for others (fake)."""
    backends = _world_backends()
    if not set(backends) <= {"nccl", "gloo"}:
        return None
    if "nccl" in backends:   # one options object serves every backend of a group: gloo's reads
        return copy.deepcopy(backends["nccl"].options)   # nothing from it but the timeout
    options = dist.ProcessGroupGloo._Options()
    options._timeout = backends["gloo"].options._timeout
    return options


def override(size: int, options) -> tuple:
    """(backend, options) for a mesh dimension of `size` ranks; none world-wide (DeviceMesh reuses
    the default group), except gloo on a CUDA machine, where DeviceMesh makes one anyway."""
    world_wide = size == dist.get_world_size()
    cuda_gloo = torch.cuda.is_available() and dist.get_backend() == "gloo"
    return (None, None if world_wide and not cuda_gloo else options)


def root_mesh(device_type: str, sizes: dict):
    """init_device_mesh(device_type, sizes.values(), mesh_dim_names=sizes), via _make_groups."""
    from torch.distributed.device_mesh import DeviceMesh

    with torch.device("cpu"):
        ranks = torch.arange(dist.get_world_size(), dtype=torch.int).view(*sizes.values())
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=tuple(sizes), _init_backend=False)
    mesh._setup_world_group_and_device()   # what _init_backend=True does first
    _make_groups(mesh, tuple(sizes.values()))
    return mesh


def flatten(root, parts: tuple, name: str):
    """root[parts]._flatten(name), its group by `_make_groups`."""
    from torch.distributed._mesh_layout import _MeshLayout
    from torch.distributed.device_mesh import DeviceMesh

    layout = _MeshLayout([root[parts]._layout.collapse()])
    mesh = DeviceMesh(root.device_type, _layout=layout, _rank_map=root._rank_map,
                      mesh_dim_names=(name,), _root_mesh=root, _init_backend=False)
    _make_groups(mesh, (layout.numel(),))
    root._flatten_mapping[name] = mesh   # as _flatten records it
    return mesh


def unflatten(source, sizes: tuple, names: tuple):
    """source._unflatten(0, sizes, names) for a 1-D mesh `source`, groups by `_make_groups`."""
    from torch.distributed.device_mesh import DeviceMesh

    # A copy without groups: _unflatten then makes none itself.
    bare = DeviceMesh(source.device_type, _layout=source._layout, _rank_map=source._rank_map,
                      mesh_dim_names=source.mesh_dim_names, _root_mesh=source._get_root_mesh(),
                      _init_backend=False)
    mesh = bare._unflatten(0, sizes, names)
    _make_groups(mesh, sizes)
    return mesh


def _make_groups(mesh, sizes: tuple) -> None:
    """One process group per dimension, reused by a dimension splitting the ranks as another of
    the root mesh does (torch has no public way to choose a dimension's group, and makes more)."""
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
    """{partition: group name} of `root`'s dims and flattened views, kept on it (torch's too)."""
    known = root.__dict__.get("_groups_by_partition")
    if known is None:
        known = root.__dict__["_groups_by_partition"] = {}
        for mesh in (root, *root._flatten_mapping.values()):
            for layout, name in zip(mesh._layout, getattr(mesh, "_dim_group_names", ())):
                known.setdefault(_partition(layout, root._rank_map), name)
    return known


def _partition(layout, rank_map) -> tuple:
    """The groups of ranks one mesh dimension's layout splits the ranks into, in mesh order."""
    from torch.distributed._mesh_layout import _MeshLayout

    ranks = _MeshLayout([layout]).remap_to_tensor(rank_map).reshape(-1, layout.numel())
    return tuple(sorted(tuple(group) for group in ranks.tolist()))


def created() -> int:
    """How many process groups this rank belongs to, the default one included."""
    return len(dist.distributed_c10d._world.pg_map)
