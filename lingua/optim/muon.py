"""Muon (torch.optim.Muon's update) for the blocks' matrices (each expert one; not embeddings nor
`output`), AdamW for the rest, in one optimizer for plain tensors and DTensors (FSDP2, TP, EP).
Experts are stored [in, out] and read transposed (NS(M^T) = NS(M)^T).
Sharding: only Newton-Schulz needs whole matrices. Those of one shape and placement are stacked N
at a time (N: the ranks sharding them) and all-to-all'd so each rank orthogonalises one whole
matrix, then sent back: 1/N of the work of all-gathering everywhere. FSDP2 x TP's _StridedShard is
read as a Shard (NS commutes with row reordering); uneven rows take torch's route via Replicate."""

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

# torch's own Newton-Schulz and lr adjustment, which torch.optim.Muon (the reference) runs.
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

from lingua.errors import ConfigError
from lingua.optim.adamw import local_bytes, param_groups
from lingua.optim.adamw import state_bytes as adamw_state_bytes
from lingua.optim.spec import OptimizerSpec

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
ADJUST_LR_FNS = ("original", "match_rms_adamw")
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class MuonArgs:
    """optim.muon.*, as torch.optim.Muon names them; weight decay and schedule are optim.*'s."""
    # Muon's peak lr: null = optim.lr, which suits match_rms_adamw; with original use about 0.02.
    lr: Optional[float] = None
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5                       # Newton-Schulz iterations
    adjust_lr_fn: str = "match_rms_adamw"   # match_rms_adamw | original
    # Newton-Schulz in bf16 (torch.optim.Muon's) or fp32 (for CPUs that emulate bf16).
    ns_dtype: str = "bf16"


def validate(optim_args) -> None:
    args = optim_args.muon
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise ConfigError(f"optim.muon.lr={args.lr} must be a positive finite number (e.g. "
                          f"optim.muon.lr=0.02 with optim.muon.adjust_lr_fn=original), or null "
                          f"to use optim.lr.")
    if not 0 <= args.momentum < 1:
        raise ConfigError(f"optim.muon.momentum={args.momentum} must lie in [0, 1), e.g. "
                          f"optim.muon.momentum=0.95.")
    if not 1 <= args.ns_steps <= 99:
        raise ConfigError(f"optim.muon.ns_steps={args.ns_steps} must lie in [1, 99] "
                          f"(Newton-Schulz iterations; 5 is the usual).")
    if args.adjust_lr_fn not in ADJUST_LR_FNS:
        raise ConfigError(f"optim.muon.adjust_lr_fn={args.adjust_lr_fn!r} is unknown: use "
                          f"match_rms_adamw (Muon's update at AdamW's RMS: optim.lr carries "
                          f"over) or original (Keller Jordan's sqrt(max(1, out/in)) scaling: set "
                          f"optim.muon.lr to about 0.02).")
    if args.ns_dtype not in NS_DTYPES:
        raise ConfigError(f"optim.muon.ns_dtype={args.ns_dtype!r} is unknown: use bf16 "
                          f"(torch.optim.Muon's) or fp32 (for a CPU without avx512_bf16/amx).")


def newton_schulz(update: torch.Tensor, coefficients, steps: int, eps: float,
                  dtype: str) -> torch.Tensor:
    """torch's own function in bf16, or the same iteration in fp32 (CPUs that emulate bf16)."""
    if dtype == "bf16":
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    a, b, c = coefficients
    x = update.float()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def split_params(model: nn.Module) -> tuple[list, list]:
    """([(name, param)] for Muon, [(name, param)] for AdamW) of a model or pipeline part."""
    output = getattr(model, "output", None)
    muon, adamw, seen = [], [], set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{name}" if module_name else name
            hidden = (param.ndim >= 2 and not isinstance(module, nn.Embedding)
                      and module is not output)
            (muon if hidden else adamw).append((full, param))
    return muon, adamw


def matrix_shape(param: torch.Tensor) -> tuple[int, int]:
    """(out, in) for the lr adjustment: nn.Linear stores [out, in], stacked experts [E, in, out]."""
    if param.ndim == 2:
        return param.shape[0], param.shape[1]
    if param.ndim == 3:
        return param.shape[2], param.shape[1]
    raise ValueError(f"Muon updates matrices and stacked [experts, in, out] matrices, not a "
                     f"{param.ndim}-d tensor of shape {tuple(param.shape)}")


class MuonAdamW(torch.optim.AdamW):
    """One optimizer of AdamW and Muon (`group["muon"]`) groups: one lr schedule, DCP saves both."""

    def __init__(self, adamw_groups: list, muon_groups: list, *, lr: float, betas, eps: float,
                 fused, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str = "match_rms_adamw", ns_dtype: str = "bf16"):
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn={adjust_lr_fn!r}: use one of {ADJUST_LR_FNS}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype={ns_dtype!r}: use one of {tuple(NS_DTYPES)}")
        if not 0 < ns_steps < 100:  # torch's Newton-Schulz refuses 100 or more
            raise ValueError(f"ns_steps={ns_steps} must lie in [1, 99]")
        groups = [dict(g, muon=False) for g in adamw_groups]
        for g in muon_groups:
            for p in g["params"]:
                matrix_shape(p)  # refuses what is not a matrix or a stack of them
            groups.append(dict(g, muon=True, momentum=momentum, nesterov=nesterov,
                               ns_steps=ns_steps, ns_coefficients=NS_COEFFICIENTS, ns_eps=EPS,
                               adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype))
        super().__init__(groups, lr=lr, betas=betas, eps=eps, fused=fused)

    def __setstate__(self, state):
        # Adam's __setstate__ (load_state_dict) expects a "step" in every state: AdamW groups only.
        groups = state["param_groups"]
        super().__setstate__(dict(state, param_groups=[g for g in groups if not g.get("muon")]))
        self.param_groups = groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g["muon"]]
        try:
            super().step()
        finally:
            self.param_groups = groups
        for group in groups:
            if group["muon"]:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        momentum, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        lr = lr.item() if torch.is_tensor(lr) else lr
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(
                    p.grad, memory_format=torch.preserve_format)
            buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)

        def ns(matrix):
            return newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"],
                                 group["ns_eps"], group["ns_dtype"])

        dtype = NS_DTYPES[group["ns_dtype"]]
        for p, ortho in zip(params, orthogonalize(params, updates, ns, dtype)):
            local = _local(p)
            local.mul_(1 - lr * wd)
            local.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], matrix_shape(p)))


def _local(t: torch.Tensor) -> torch.Tensor:
    # Under no_grad to_local() is the DTensor's own storage: in-place ops update the shard.
    return t.to_local() if isinstance(t, DTensor) else t


def orthogonalize(params: list, updates: list, ns, dtype=torch.bfloat16) -> list:
    """This rank's shard of ns(whole update) per parameter; collective over sharded ones' meshes."""
    out = [None] * len(params)
    buckets = {}
    for i, (p, u) in enumerate(zip(params, updates)):
        if not isinstance(p, DTensor) or _holds_whole_matrices(p):
            out[i] = _ns_each(u, ns)
        elif p.ndim == 3:   # experts sharded inside their matrices: the stack is given
            out[i] = _ns_on_owners(u.to(dtype), p.device_mesh, p.placements, tuple(p.shape), ns)
        else:
            key = (p.device_mesh, tuple(p.placements), tuple(p.shape))
            buckets.setdefault(key, []).append(i)
    for (mesh, placements, shape), indices in buckets.items():
        n = math.prod(size for size, pl in zip(mesh.shape, placements)
                      if not isinstance(pl, Replicate))
        for start in range(0, len(indices), n):
            chunk = indices[start:start + n]
            # In NS's dtype before sending: NS casts its input first, so the result is the same.
            stack = torch.stack([updates[i].to(dtype) for i in chunk])
            done = _ns_on_owners(stack, mesh, [_shifted(pl) for pl in placements],
                                 (len(chunk), *shape), ns)
            for j, i in enumerate(chunk):
                out[i] = done[j]
    return out


def _holds_whole_matrices(p: DTensor) -> bool:
    """Nothing is split but (stacked experts) the expert dim; from placements: ranks agree."""
    for size, pl in zip(p.device_mesh.shape, p.placements):
        if size == 1 or isinstance(pl, Replicate):
            continue
        if p.ndim == 3 and isinstance(pl, (Shard, _StridedShard)) and pl.dim == 0:
            continue
        return False
    return True


def _ns_each(u: torch.Tensor, ns) -> torch.Tensor:
    if u.ndim == 2:
        return ns(u)
    if u.shape[0] == 0:
        return u
    return torch.stack([ns(m) for m in u])


def _shifted(pl):
    if isinstance(pl, _StridedShard):
        return _StridedShard(pl.dim + 1, split_factor=pl.split_factor)
    if isinstance(pl, Shard):
        return Shard(pl.dim + 1)
    if isinstance(pl, Replicate):
        return pl
    raise ValueError(f"Muon cannot orthogonalise a matrix placed {pl}")


def _ns_on_owners(local_stack: torch.Tensor, mesh, placements, shape: tuple, ns) -> torch.Tensor:
    """Each stacked matrix is orthogonalised whole on one sharding rank and comes back sharded."""
    plain = _plain_shards(tuple(mesh.shape), tuple(placements), tuple(shape))
    if plain is not None:
        return _ns_by_all_to_all(local_stack, mesh, plain, shape, ns)
    # Uneven strided shards, or experts split along the stack too: torch's own route.
    stride = _contiguous_stride(shape)
    owned = [pl if isinstance(pl, Replicate) else Shard(0) for pl in placements]
    stack = DTensor.from_local(local_stack, mesh, placements, run_check=False, shape=shape,
                               stride=stride)
    mine = stack.redistribute(mesh, owned).to_local()
    done = DTensor.from_local(_ns_each(mine, ns), mesh, owned, run_check=False, shape=shape,
                              stride=stride)
    return done.redistribute(mesh, placements).to_local()


@functools.lru_cache
def _plain_shards(mesh_shape: tuple, placements: tuple, shape: tuple):
    """Each _StridedShard read as a Shard (NS(P M) = P NS(M): the same rows come back); None
    where the stack dim is split, or where some rank's shard would change shape."""
    if any(not isinstance(pl, Replicate) and pl.dim == 0 for pl in placements):
        return None
    plain = tuple(Shard(pl.dim) if isinstance(pl, _StridedShard) else pl for pl in placements)
    if plain != placements:
        ranges = [range(1) if isinstance(pl, Replicate) else range(size)
                  for size, pl in zip(mesh_shape, placements)]
        for coord in itertools.product(*ranges):
            strided = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord),
                                                             placements, skip_offset=True)
            if strided != _compute_local_shape_and_global_offset(
                    shape, mesh_shape, list(coord), plain, skip_offset=True):
                return None
    return plain


def _ns_by_all_to_all(local_stack: torch.Tensor, mesh, placements, shape: tuple,
                      ns) -> torch.Tensor:
    """The stack, zero-padded to q N matrices, viewed [s_1, ..., s_j, q, m, n]; each sharding mesh
    dim moves its shard to its own stack dim in turn (at once would go through Replicate)."""
    dims = [i for i, pl in enumerate(placements) if isinstance(pl, Shard)]
    sizes = [mesh.size(i) for i in dims]
    k, n = shape[0], math.prod(sizes)
    q = -(-k // n)
    if q * n > k:
        local_stack = torch.cat([local_stack,
                                 local_stack.new_zeros(q * n - k, *local_stack.shape[1:])])
    view = (*sizes, q, *shape[1:])
    source = [Shard(pl.dim + len(dims)) if isinstance(pl, Shard) else pl for pl in placements]
    stack = DTensor.from_local(local_stack.reshape(*sizes, q, *local_stack.shape[1:]), mesh,
                               source, run_check=False, shape=view, stride=_contiguous_stride(view))
    current = list(source)
    for j in reversed(range(len(dims))):
        current[dims[j]] = Shard(j)
        stack = stack.redistribute(mesh, current)
    mine = stack.to_local()          # [1, ..., 1, q, m, n]: q whole matrices
    done = _ns_each(mine.reshape(q, *shape[1:]), ns).view(mine.shape)
    done = DTensor.from_local(done, mesh, current, run_check=False, shape=view,
                              stride=_contiguous_stride(view))
    for i in dims:
        current[i] = source[i]
        done = done.redistribute(mesh, current)
    return done.to_local().reshape(q * n, *local_stack.shape[1:])[:k]


def _contiguous_stride(shape: tuple) -> tuple:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def muon_flops(params: list, steps: int = 5) -> float:
    """Per NS step X X^T (2 m^2 n), B = bA + cA^2 (2 m^3) and B X (2 m^2 n), with m <= n."""
    total = 0.0
    for p in params:
        out_dim, in_dim = matrix_shape(p)
        m, n = min(out_dim, in_dim), max(out_dim, in_dim)
        count = p.shape[0] if p.ndim == 3 else 1
        total += count * steps * (4 * m * m * n + 2 * m ** 3)
    return total


def build(part: nn.Module, optim_args, fused: bool) -> torch.optim.Optimizer:
    args = optim_args.muon
    muon, rest = split_params(part)
    muon_lr = optim_args.lr if args.lr is None else args.lr
    # One Muon group per mesh, like the AdamW groups (adamw.param_groups): weight decay on all.
    muon_groups = [dict(g, lr=muon_lr)
                   for g in param_groups([p for _, p in muon], optim_args.weight_decay)]
    return MuonAdamW(param_groups([p for _, p in rest], optim_args.weight_decay), muon_groups,
                     lr=optim_args.lr, betas=(optim_args.beta1, optim_args.beta2),
                     eps=optim_args.eps, fused=fused, momentum=args.momentum,
                     nesterov=args.nesterov, ns_steps=args.ns_steps,
                     adjust_lr_fn=args.adjust_lr_fn, ns_dtype=args.ns_dtype)


def state_bytes(parts, optim_args) -> tuple:
    """Newton-Schulz's workspace: about 6 of the largest matrix."""
    muon = [p for part in parts for _, p in split_params(part)[0]]
    largest = max((math.prod(matrix_shape(p)) for p in muon), default=0)
    ns_bytes = torch.empty((), dtype=NS_DTYPES[optim_args.muon.ns_dtype]).element_size()
    return adamw_state_bytes(parts, optim_args)[0] - local_bytes(muon), 6 * largest * ns_bytes


SPEC = OptimizerSpec(build=build, state_bytes=state_bytes, args=MuonArgs, validate=validate,
                     label="optimizer state (Muon 1x, AdamW 2x{only})",
                     workspace_label="Muon's Newton-Schulz")
