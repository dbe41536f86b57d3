"""Expert parallelism (EP): each EP rank holds n_experts / ep of every MoE layer's routed experts
(DTensors Shard(0): checkpoints reshard) and processes their tokens; `MoE.forward` never knows.
EP's ranks come from "dp_shard_cp" unflattened into ("dp_shard_mod_ep", "ep"); FSDP shards the
experts over ("dp_replicate", "dp_shard_mod_ep"), the ranks holding the same expert shard."""

import inspect
import logging

import torch
import torch.distributed as dist
from torch import nn

from lingua.errors import ConfigError
from lingua.hooks import UPDATE, Hook
from lingua.model.moe import (
    moe_layers,
    reset_routing,
    routing_metrics,
    update_expert_bias,
)
from lingua.parallel import groups
from lingua.parallel.distributed import all_reduce_sum

logger = logging.getLogger(__name__)

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def apply_global_counts(model: nn.Module, env) -> None:
    """MoE router counts summed over the dp and cp ranks (the global micro-batch)."""
    def reduce_over_data_ranks(t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(t, env, dims=("dp_cp",))

    for layer in moe_layers(model):
        layer.count_reducer = reduce_over_data_ranks


class RoutingHook(Hook):
    """An MoE app's hook: the expert-bias update (bias_update_rate) and logged routing metrics."""

    def __init__(self, bias_update_rate: float, n_experts: int):
        self.bias_update_rate, self.n_experts = bias_update_rate, n_experts

    def before_step(self, view, step: int) -> None:
        layers = [m for part in view.parts for m in moe_layers(part)]
        reset_routing(layers)
        # Only this step's tokens: a skipped or rolled-back step's counts must not carry over.
        for m in layers:
            m.step_counts = None

    def after_step(self, view, step: int) -> None:
        if self.bias_update_rate > 0 and view.decision == UPDATE:
            layers = [m for part in view.parts for m in moe_layers(part)]
            update_expert_bias(layers, self.bias_update_rate)

    def metrics(self, view, row: dict) -> None:
        """Over the whole step: every micro-batch, the global batch and every pipeline stage."""
        args, env = view.parts[0].args, view.env
        layers = {int(name): moe for part in view.parts
                  for name, block in part.layers.items() for moe in moe_layers(block)}
        values = routing_metrics(
            layers, args.n_layers, self.n_experts, device=env.device,
            reduce=lambda t: all_reduce_sum(t, env, dims=("dp_cp", "pp")))
        row.update({f"moe/{key}": value for key, value in values.items()})


def validate_ep(n_experts: int, ep: int, dp_shard: int, cp: int = 1) -> None:
    """ConfigError unless ep >= 1 divides both the experts and the dp_shard x cp ranks."""
    if ep < 1:
        raise ConfigError(f"distributed.ep={ep} must be at least 1 (1 = no expert parallelism).")
    d = dp_shard * cp
    example = max(k for k in range(1, ep + 1) if n_experts % k == 0 and d % k == 0)
    if n_experts % ep:
        raise ConfigError(
            f"distributed.ep={ep} does not divide model.n_experts={n_experts}: every "
            f"expert-parallel rank must hold the same number of experts. Pick ep among the "
            f"divisors of {n_experts} (e.g. {example}) or change model.n_experts.")
    if d % ep:
        raise ConfigError(
            f"distributed.ep={ep} does not divide dp_shard x cp = {dp_shard} x {cp} = {d}: expert "
            f"parallelism borrows its ranks from the data-parallel shard and context-parallel "
            f"ranks. Pick ep dividing {d} (e.g. {example}) or raise dp_shard / cp.")


def ep_meshes(mesh, ep: int):
    """(ep_mesh, expert_fsdp_mesh); collective the first time, then kept on the mesh."""
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
    """Duck-typed GroupedExperts: stacked 3D w1/w3/w2 parameters and forward(x_sorted, counts)."""
    weights = [getattr(module, n, None) for n in EXPERT_WEIGHTS]
    if not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
        return False
    return len(inspect.signature(type(module).forward).parameters) == 3  # self, x, counts


def apply_ep(model: nn.Module, ep_mesh) -> list[str]:
    """Returns the modules' names. Every rank must hold the same full weights, or meta ones."""
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
                raise TypeError(f"{name}.{w} is already a DTensor: run apply_ep before FSDP/TP")
            # Slice locally instead of scattering: also works on the meta device.
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
    from torch.distributed.tensor import DTensor

    cls = type(module)  # captured before FSDP swaps in its subclass
    group, ep = ep_mesh.get_group(), ep_mesh.size()

    def forward(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Read at call time: FSDP swaps in unsharded DTensors before forward (to_local has grads).
        weights = {w: getattr(module, w) for w in EXPERT_WEIGHTS}
        local_weights = {w: t.to_local() if isinstance(t, DTensor) else t
                         for w, t in weights.items()}
        # Its own compute on a throwaway instance whose dict (over nn.Module's) holds the shards.
        view = object.__new__(cls)
        view.__dict__.update(module.__dict__, **local_weights)
        return ep_dispatch(x, counts, lambda xs, c: cls.forward(view, xs, c), ep, group)

    module.forward = forward


def ep_dispatch(x: torch.Tensor, counts: torch.Tensor, compute, ep: int, group) -> torch.Tensor:
    """x [T, dim] grouped by global expert -> compute applied by the ranks that hold the experts,
    in x's order. The counts go first (even all-to-all), then the rows (uneven, autograd)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    n_local = counts.numel() // ep
    send_counts = counts.reshape(ep, n_local).contiguous()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # One host sync for the split sizes (unavoidable: the collectives need them on the host).
    send_splits, recv_splits = torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()
    x_recv = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group)
    perm, inv = _regroup(recv_counts, sum(recv_splits))
    y_local = compute(x_recv[perm], recv_counts.sum(0))
    return all_to_all_single_autograd(y_local[inv].contiguous(), send_splits, recv_splits, group)


def _regroup(recv_counts: torch.Tensor, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation taking rows ordered by (source rank, local expert) to (local expert, source
    rank), and its inverse. n_rows: recv_counts' sum, from the host (saves a device sync)."""
    ep, n_local = recv_counts.shape
    device = recv_counts.device
    # Sort key of block (source i, expert l) = l * ep + i; the stable sort keeps row order inside.
    keys = (torch.arange(n_local, device=device) * ep
            + torch.arange(ep, device=device)[:, None]).reshape(-1)
    row_keys = torch.repeat_interleave(keys, recv_counts.reshape(-1), output_size=n_rows)
    perm = torch.argsort(row_keys, stable=True)
    return perm, torch.argsort(perm)
