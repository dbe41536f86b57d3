"""Expert parallelism (EP) for lingua.model.moe: each EP rank holds n_experts / ep of every MoE
layer's routed experts and processes, for every rank of its EP group, the tokens routed to them.

What changes (`apply_ep`): each `GroupedExperts` module (the `MoE.experts` swap point) keeps its
parameters `w1`, `w3`, `w2` under the same names, now DTensors with placement Shard(0) over the EP
mesh (so DCP checkpoints reshard between layouts), and its forward becomes the dispatch below.
Routing, sorting and combining stay in `MoE.forward`, which never knows EP is on.

How counts and tokens travel, for one MoE layer on EP rank r of ep ranks (El = n_experts / ep
experts per rank; rank j holds global experts j*El .. (j+1)*El - 1):
  1. counts [n_experts] (this rank's rows per global expert) viewed as [ep, El]: an even
     all_to_all_single of the counts gives recv [ep, El] = rows each source rank sends for each of
     this rank's local experts.
  2. Rows, already grouped by global expert and therefore by destination rank, go out with the
     autograd-aware all_to_all_single (uneven splits: send = counts summed per destination rank,
     receive = recv summed per source rank). They arrive grouped by (source rank, local expert).
  3. A stable permutation regroups them by (local expert, source rank); the module's own compute
     (grouped mm or loop) runs on the local weight shards with counts recv.sum(0).
  4. The inverse permutation and the inverse all-to-all (splits swapped) bring every result row
     back to the rank and position it came from. Backward runs the same exchanges in reverse.

Gradients. An expert weight's gradient on an EP rank is its partial sum over the tokens that rank
processed, i.e. over the tokens of the whole EP group routed to its experts. The data-parallel
ranks that hold the same experts (same EP rank, different EP group) must then sum it further: the
trainer gives FSDP (divide factor 1, as for every other parameter) a DIFFERENT mesh for the expert
modules than for the rest of the model. See `ep_meshes`.

Where the EP ranks come from (as torchtitan): EP borrows its ranks from the dp_shard x cp ranks
(the "dp_shard_cp" dimension that FSDP shards over), which all hold distinct tokens. With
D = dp_shard * cp, "dp_shard_cp" is unflattened into ("dp_shard_mod_ep" = D / ep, "ep" = ep),
with "ep" the inner (contiguous) part:
  * EP all-to-alls run over "ep";
  * FSDP of the expert modules runs over ("dp_replicate", "dp_shard_mod_ep") -- the ranks of
    dp_shard_cp that have the same EP rank (hence hold the same expert shard), plus the
    replicas -- instead of ("dp_replicate", "dp_shard_cp") for everything else. Both meshes must
    come from the trainer's one root mesh (FSDP2 concatenates the FSDP and EP meshes), which
    `ep_meshes` guarantees by unflattening the root mesh's "dp_shard_cp".
Summed over "ep" (by the token exchange) and then over "dp_replicate" x "dp_shard_mod_ep" (by FSDP),
every expert gradient is the sum over all dp x cp ranks, as for the other parameters.
Non-expert parameters (router, attention, shared experts) are untouched by EP.

FSDP's default Shard(0) on top of EP's Shard(0) works (FSDP2 records a _StridedShard; tested).
Not covered: tensor parallelism inside the experts (EP x TP), EP over ranks other than
dp_shard x cp.
"""

import inspect
import logging

import torch
import torch.distributed as dist
from torch import nn

from lingua.errors import ConfigError
from lingua.parallel import groups

logger = logging.getLogger(__name__)

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def apply_global_counts(model: nn.Module, env) -> None:
    """Router token counts of every MoE layer summed over the ranks that hold distinct tokens
    (data and context parallel), so balancing (the aux loss's expert fractions, the expert-bias
    update) sees the global micro-batch, as one process would (lingua/model/moe.py)."""
    from lingua.model.moe import moe_layers
    from lingua.parallel.distributed import all_reduce_sum

    def reduce_over_data_ranks(t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, env, dims=("dp_cp",))

    for layer in moe_layers(model):
        layer.count_reducer = reduce_over_data_ranks


def validate_ep(n_experts: int, ep: int, dp_shard: int, cp: int = 1) -> None:
    """ConfigError unless ep >= 1 divides both the experts and the dp_shard x cp ranks EP
    borrows."""
    if ep < 1:
        raise ConfigError(f"distributed.ep={ep} must be at least 1 (1 = no expert parallelism).")
    if n_experts % ep:
        raise ConfigError(
            f"distributed.ep={ep} does not divide model.n_experts={n_experts}: every "
            f"expert-parallel rank must hold the same number of experts. Pick ep among the "
            f"divisors of {n_experts} "
            f"(e.g. {_largest_common_divisor(n_experts, dp_shard * cp, ep)}) or change "
            f"model.n_experts."
        )
    if (dp_shard * cp) % ep:
        raise ConfigError(
            f"distributed.ep={ep} does not divide dp_shard x cp = {dp_shard} x {cp} = "
            f"{dp_shard * cp}: expert parallelism borrows its ranks from the data-parallel shard "
            f"and context-parallel ranks. Pick ep dividing {dp_shard * cp} (e.g. "
            f"{_largest_common_divisor(n_experts, dp_shard * cp, ep)}) or raise dp_shard / cp."
        )


def _largest_common_divisor(a: int, b: int, at_most: int) -> int:
    return max(d for d in range(1, max(at_most, 1) + 1) if a % d == 0 and b % d == 0)


def ep_meshes(mesh, ep: int):
    """(ep_mesh, expert_fsdp_mesh) from the trainer's root mesh (dims "pp", "dp_replicate",
    "dp_shard", "cp", "tp" and flattened "dp_shard_cp").

    ep_mesh: 1D, the ep contiguous ranks of "dp_shard_cp" (pass it to `apply_ep`).
    expert_fsdp_mesh: the mesh to give `fully_shard` for each MoE's `experts` module:
    ("dp_replicate", "dp_shard_mod_ep") -- 2D (HSDP) when dp_replicate > 1, else 1D
    "dp_shard_mod_ep". Collective the first time for a mesh (every rank must call it): its groups
    (none for a dimension whose ranks another group has) are made once per mesh and ep, and kept
    on the mesh, so pipeline parts share them."""
    cache = mesh.__dict__.setdefault("_ep_meshes", {})
    if ep not in cache:
        cache[ep] = _split_for_ep(mesh, ep)
    return cache[ep]


def _split_for_ep(mesh, ep: int):
    from torch.distributed.device_mesh import DeviceMesh

    d = mesh["dp_shard_cp"].size()
    if d % ep:
        raise ConfigError(f"distributed.ep={ep} does not divide dp_shard x cp = {d}; see "
                          f"validate_ep.")
    # No new group where one has the same ranks: with ep = d, "ep" is dp_shard_cp's group and
    # "dp_shard_mod_ep" (size 1) the one each rank holds alone.
    split = groups.unflatten(mesh["dp_shard_cp"], (d // ep, ep), ("dp_shard_mod_ep", "ep"))
    fsdp_mesh = split["dp_shard_mod_ep"]
    if mesh["dp_replicate"].size() > 1:
        fsdp_mesh = DeviceMesh._concatenate([mesh["dp_replicate"], fsdp_mesh])
    return split["ep"], fsdp_mesh


def is_grouped_experts(module: nn.Module) -> bool:
    """Duck-typed (any module with lingua.model.moe.GroupedExperts' contract): stacked 3D w1/w3/w2
    parameters and forward(x_sorted, counts)."""
    weights = [getattr(module, n, None) for n in EXPERT_WEIGHTS]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
        return False
    return len(inspect.signature(type(module).forward).parameters) == 3  # self, x, counts


def apply_ep(model: nn.Module, ep_mesh) -> list[str]:
    """Shard every grouped-experts module's weights over `ep_mesh` (1D) along the expert dimension
    and make its forward expert-parallel. Every rank must hold the same full weights (same seed) or
    meta weights (initialised later through the DTensors). Returns the names of the modules."""
    from torch.distributed.tensor import DTensor, Shard

    if ep_mesh.ndim != 1:
        raise ValueError(f"apply_ep needs a 1D ep mesh, got {ep_mesh.ndim} dimensions")
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    done = []
    for name, module in model.named_modules():
        if not is_grouped_experts(module):
            continue
        n_experts = module.w1.shape[0]
        if n_experts % ep:
            raise ConfigError(f"distributed.ep={ep} does not divide the {n_experts} experts of "
                              f"{name}; see validate_ep.")
        n_local = n_experts // ep
        for w in EXPERT_WEIGHTS:
            p = getattr(module, w)
            if isinstance(p, DTensor):
                raise TypeError(f"{name}.{w} is already a DTensor: apply_ep must run before "
                                f"FSDP/TP")
            # Slice locally instead of scattering: every rank holds the same weights, and slicing
            # also works on the meta device.
            local = p.detach()[rank * n_local:(rank + 1) * n_local].clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False,
                                    shape=p.shape, stride=p.contiguous().stride())
            module.register_parameter(w, nn.Parameter(dt, requires_grad=p.requires_grad))
        _install_dispatch(module, ep_mesh)
        done.append(name)
    logger.info("Applied expert parallelism (ep=%d, %d experts per rank) to %d modules",
                ep, n_local if done else 0, len(done))
    return done


def _install_dispatch(module: nn.Module, ep_mesh) -> None:
    cls = type(module)  # captured before FSDP swaps in its subclass
    group = ep_mesh.get_group()
    ep = ep_mesh.size()

    def forward(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Read the weights at call time: FSDP swaps in its unsharded DTensors before forward.
        local_weights = {w: _to_local(getattr(module, w)) for w in EXPERT_WEIGHTS}
        # The module's own compute (grouped mm or loop) on a throwaway instance whose attributes
        # are the module's with the weights replaced by the local shards (the instance dict wins
        # over nn.Module's parameter lookup).
        view = object.__new__(cls)
        view.__dict__.update(module.__dict__, **local_weights)
        return ep_dispatch(x, counts, lambda xs, c: cls.forward(view, xs, c), ep, group)

    module.forward = forward


def _to_local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t  # to_local is differentiable


def ep_dispatch(x: torch.Tensor, counts: torch.Tensor, compute, ep: int, group) -> torch.Tensor:
    """x [T, dim] grouped by global expert, counts [n_experts] -> compute applied by the ranks
    that hold the experts, [T, dim] in x's order. compute(x_local, local_counts) runs this rank's
    experts on rows grouped by local expert."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    n_local = counts.numel() // ep
    send_counts = counts.reshape(ep, n_local).contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # One host sync for the split sizes (unavoidable: the collectives need them on the host).
    host = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    send_splits, recv_splits = host[0], host[1]
    x_recv = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group)
    perm, inv = _regroup(recv_counts, sum(recv_splits))
    y_local = compute(x_recv[perm], recv_counts.sum(0))
    return all_to_all_single_autograd(y_local[inv].contiguous(), send_splits, recv_splits, group)


def _regroup(recv_counts: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation taking rows ordered by (source rank, local expert) to (local expert, source
    rank), and its inverse. recv_counts [ep, n_local], summing to n_rows (given from the host:
    repeat_interleave would otherwise read the sum from the device)."""
    ep, n_local = recv_counts.shape
    device = recv_counts.device
    # Sort key of block (source i, expert l) = l * ep + i; the stable sort keeps row order inside.
    keys = (torch.arange(n_local, device=device) * ep
            + torch.arange(ep, device=device)[:, None]).reshape(-1)
    row_keys = torch.repeat_interleave(keys, recv_counts.reshape(-1), output_size=n_rows)
    perm = torch.argsort(row_keys, stable=True)
    return perm, torch.argsort(perm)
