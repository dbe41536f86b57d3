"""Process groups each rank joins for the training mesh: lingua's (lingua/parallel/groups.py: one
group per distinct set of ranks, carrying the default group's timeout) against torch's own
init_device_mesh + _flatten (the baseline: one group per dimension and per flattened view), built
on torch's fake process group at a cluster's world size. Each NCCL group is a communicator with
its own GPU buffers and set-up time, on every rank.

    python benchmarks/mesh_groups.py [--layout 512:dp_replicate=4,dp_shard=16,tp=8 ...]

Counted on rank 0 (every rank joins as many); prints both counts, their ratio and the build time
of each, with the CPU model. Both meshes are checked to give every dimension the same ranks.
"""

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpu import cpu_description  # noqa: E402

from lingua.parallel import groups  # noqa: E402
from lingua.parallel.distributed import FLATTENED, MESH_DIMS  # noqa: E402

LAYOUTS = ["8:dp_shard=8", "64:dp_shard=8,tp=8", "512:dp_replicate=4,dp_shard=16,tp=8",
           "1024:pp=4,dp_shard=16,cp=2,tp=8"]


def parse(layout: str):
    world, degrees = layout.split(":")
    sizes = dict.fromkeys(MESH_DIMS, 1)
    for item in degrees.split(","):
        name, value = item.split("=")
        if name not in sizes:
            raise SystemExit(f"--layout {layout}: {name} is not one of {', '.join(MESH_DIMS)}")
        sizes[name] = int(value)
    return int(world), sizes


def groups_joined() -> int:
    return len(dist.distributed_c10d._world.pg_names)


def build(side: str, sizes: dict):
    """(groups rank 0 joined, seconds, {dimension: its ranks}) for one side's mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    before, started = groups_joined(), time.perf_counter()
    if side == "torch":
        root = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
        flat = {name: root[parts]._flatten(name) for name, parts in FLATTENED.items()}
    else:
        root = groups.root_mesh("cpu", sizes)
        flat = {name: groups.flatten(root, parts, name) for name, parts in FLATTENED.items()}
    seconds = time.perf_counter() - started
    meshes = {**{name: root[name] for name in sizes}, **flat}
    ranks = {name: sorted(dist.get_process_group_ranks(m.get_group())) for name, m in
             meshes.items()}
    return groups_joined() - before, seconds, ranks


def main(argv=None) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", action="append", help=f"world:dim=size,...; default {LAYOUTS}")
    layouts = parser.parse_args(argv).layout or LAYOUTS
    print(f"# {cpu_description()}")
    print(f"{'layout':40} {'torch groups':>12} {'lingua groups':>13} {'ratio':>6} "
          f"{'torch s':>8} {'lingua s':>8}")
    for layout in layouts:
        world, sizes = parse(layout)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            theirs, their_s, their_ranks = build("torch", sizes)
            ours, our_s, our_ranks = build("lingua", sizes)
        finally:
            dist.destroy_process_group()
        if their_ranks != our_ranks:
            raise SystemExit(f"{layout}: the meshes differ: {their_ranks} vs {our_ranks}")
        print(f"{layout:40} {theirs:>12} {ours:>13} {theirs / max(ours, 1):>6.2f} "
              f"{their_s:>8.3f} {our_s:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
