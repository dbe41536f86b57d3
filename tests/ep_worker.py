"""Worker for tests/test_expert_parallel.py: run under torchrun with N ranks. Usage:
ep_worker.py OUT_JSON MODE, MODE "ep" (pure EP: ep = N, each rank has its own tokens) or "fsdp"
(N = 4: ep = 2 inside dp_shard = 4, expert modules FSDP-sharded over dp_shard_mod_ep, the rest
over dp_shard, through `ep_meshes`).

Every rank builds the same MoE layer (same seed) and every rank's tokens, runs the single-process
reference (all ranks' tokens through the full experts; loss = sum over ranks of per-rank losses),
then the EP run on its own tokens, and writes relative errors (rank 0 gathers them) as JSON.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lingua.model.moe import MoE
from lingua.parallel.distributed import exit_process
from lingua.parallel.expert_parallel import apply_ep, ep_meshes

DIM, HIDDEN, E, TOP_K = 32, 48, 8, 2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if b.norm() == 0:
        return a.norm().item()
    return ((a - b).norm() / b.norm()).item()


def rank_tokens(case: str, world: int):
    """Different tokens per rank (as data parallel), uneven counts; 'empty': the last rank has
    none."""
    g = torch.Generator().manual_seed(7)
    sizes = [5 + 4 * r for r in range(world)]
    if case == "empty":
        sizes[-1] = 0
    xs = [torch.randn(n, DIM, generator=g) for n in sizes]
    targets = [torch.randn(n, DIM, generator=g) for n in sizes]
    return xs, targets


def rank_bias(case: str, r: int, ep: int) -> torch.Tensor:
    """'skip': no rank routes to the experts of EP rank 0 (it receives no tokens at all), and each
    rank also avoids one more expert of its own choosing (zero tokens from some ranks only)."""
    bias = torch.zeros(E)
    if case == "skip":
        bias[: E // ep] = -1e4
        bias[E // ep + r % (E - E // ep)] = -1e4
    return bias


def build(case: str) -> MoE:
    torch.manual_seed(0)
    impl = "grouped" if case == "grouped" else "loop"
    moe = MoE(DIM, HIDDEN, E, TOP_K, n_shared_experts=1, expert_impl=impl)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def loss_of(y, target):
    return (y * target).sum()


def reference(moe, xs, targets, case, ep):
    outs = []
    for r, (x, t) in enumerate(zip(xs, targets)):
        moe.router.expert_bias.copy_(rank_bias(case, r, ep))
        y = moe(x)
        loss_of(y, t).backward()
        outs.append(y.detach())
    return outs, {n: p.grad for n, p in moe.named_parameters()}


def full_grad(p):
    g = p.grad
    return g.full_tensor() if isinstance(g, DTensor) else g


@torch.no_grad()
def received_per_ep_rank(moe, xs, case, ep):
    """Assignments each EP rank receives (over all ranks' tokens): proves 'skip' starves EP
    rank 0."""
    counts = torch.zeros(E, dtype=torch.long)
    for r, x in enumerate(xs):
        chosen = torch.topk(moe.router(x)[2] + rank_bias(case, r, ep), TOP_K)[1]
        counts += torch.bincount(chosen.reshape(-1), minlength=E)
    return counts.reshape(ep, E // ep).sum(1).tolist()


def run_case(case: str, mode: str, rank: int, world: int, ckpt_dir=None) -> dict:
    ep = world if mode == "ep" else 2
    xs, targets = rank_tokens(case, world)
    moe = build(case)
    ref_out, ref_grads = reference(copy.deepcopy(moe), xs, targets, case, ep)
    names_before = [n for n, _ in moe.named_parameters()]
    received = received_per_ep_rank(moe, xs, case, ep)
    if mode == "ep":
        ep_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        fsdp_mesh = None
    else:
        mesh = init_device_mesh("cpu", (1, 1, world, 1, 1),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"))
        mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
        ep_mesh, fsdp_mesh = ep_meshes(mesh, ep)
    ep_rank = ep_mesh.get_local_rank()
    apply_ep(moe, ep_mesh)
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        fully_shard(moe.experts, mesh=fsdp_mesh)
        fully_shard(moe, mesh=mesh["dp_shard_cp"])
        for m in moe.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
    moe.router.expert_bias.copy_(rank_bias(case, rank, ep))
    y = moe(xs[rank])
    loss_of(y, targets[rank]).backward()

    y = y.detach()
    res = {"out": rel(y, ref_out[rank]) if y.numel() else float(y.abs().sum()),
           "names_same": [n for n, _ in moe.named_parameters()] == names_before}
    n_local = E // ep
    expert, other = {}, {}
    for n, p in moe.named_parameters():
        if n.startswith("experts."):
            res.setdefault("placements", str(p.placements))
            if fsdp_mesh is None:
                local = p.grad.to_local()  # pure EP: each expert lives on exactly one rank
                expert[n] = rel(local, ref_grads[n][ep_rank * n_local:(ep_rank + 1) * n_local])
            else:
                expert[n] = rel(full_grad(p), ref_grads[n])
        else:
            g = full_grad(p)
            if fsdp_mesh is None:
                g = g.clone()
                dist.all_reduce(g)  # what FSDP's gradient sum over the data-parallel ranks does
            other[n] = rel(g, ref_grads[n])
    res["expert_grads"], res["other_grads"] = expert, other
    res["received_per_ep_rank"] = received
    if ckpt_dir is not None:  # the test loads it into an unsharded layer (DCP reshards)
        import torch.distributed.checkpoint as dcp

        dcp.save(moe.state_dict(), checkpoint_id=ckpt_dir)
    if mode == "ep":
        w = moe.experts.w1
        res["shard_ok"] = (isinstance(w, DTensor) and w.placements == (Shard(0),)
                           and tuple(w.to_local().shape) == (n_local, DIM, HIDDEN)
                           and tuple(w.shape) == (E, DIM, HIDDEN))
    return res


def main():
    out, mode = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = ["uneven", "grouped", "skip", "empty"] if mode == "ep" else ["uneven", "skip"]
    results = {}
    for case in cases:
        try:
            ckpt = os.path.join(os.path.dirname(out), f"ckpt_{mode}") if case == "uneven" else None
            results[case] = run_case(case, mode, rank, world, ckpt)
        except Exception as e:  # noqa: BLE001 -- report instead of hanging the other ranks' collectives
            import traceback

            results[case] = {"error": traceback.format_exc()}
            print(f"rank {rank} {case}: {e!r}", file=sys.stderr, flush=True)
            break
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    exit_process(0)  # results are written; gloo can abort interpreter teardown (it says why)


if __name__ == "__main__":
    main()
