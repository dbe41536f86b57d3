"""A model part's first weights, given after it was built on the meta device, split and sharded:
drawn from per-tensor seeded streams, or filled from rank 0's copy of a Hugging Face model.
In init_weights each random init draws the whole tensor from a generator seeded by (seed, its
checkpoint name) and a DTensor keeps its slice: the same numbers in every layout, no distributed
code in models. Not the global RNG: each pipeline stage would replay the same stream, and on CUDA
torch's OffsetBasedRNGTracker broadcasts rank 0's state."""

import hashlib
import logging
from typing import Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from lingua.errors import RunError

logger = logging.getLogger(__name__)

# Random initialisers that fill the tensor passed first (or `tensor=`) and take `generator=`.
RANDOM_INITS = frozenset({
    "normal_", "uniform_", "trunc_normal_", "kaiming_normal_", "kaiming_uniform_",
    "xavier_normal_", "xavier_uniform_", "orthogonal_", "sparse_",
    "bernoulli_", "random_", "exponential_", "geometric_", "log_normal_", "cauchy_",
})
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Without wrapper prefixes (checkpointing, compile): the name its checkpoint entry has."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def named_tensors(module: nn.Module) -> dict:
    """Canonical name -> parameter or buffer (non-persistent buffers included)."""
    out = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        out.setdefault(canonical_name(name), t)
    return out


def stream_seed(seed: int, name: str) -> int:
    """The seed of tensor `name`'s stream: a hash, so neighbouring names get unrelated streams."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class PerTensorStreams(TorchFunctionMode):
    """While active, `module`'s random inits draw whole tensors from their own generators."""

    def __init__(self, module: nn.Module, seed: int, device: torch.device):
        super().__init__()
        self.seed, self.device = seed, torch.device(device)
        self.names = {id(t): name for name, t in named_tensors(module).items()}
        self.generators = {}
        self.warned = False

    def _generator(self, name: str) -> torch.Generator:
        if name not in self.generators:  # a second op on the same tensor continues its stream
            self.generators[name] = torch.Generator(self.device).manual_seed(
                stream_seed(self.seed, name))
        return self.generators[name]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (getattr(func, "__name__", None) not in RANDOM_INITS
                or kwargs.get("generator") is not None):
            return func(*args, **kwargs)
        in_kwargs = not args
        target = kwargs.get("tensor") if in_kwargs else args[0]
        name = self.names.get(id(target))
        if name is None:
            if isinstance(target, torch.Tensor) and not self.warned:
                self.warned = True
                logger.warning("init_weights calls %s on a tensor that is neither a parameter "
                               "nor a buffer of the model: those numbers come from the global "
                               "RNG and differ between layouts", func.__name__)
            return func(*args, **kwargs)
        local = _local(target)
        if local.is_meta or self.device.type == "meta":
            return func(*args, **kwargs)  # nothing to fill
        whole = local is target and local.device == self.device
        full = (target if whole
                else torch.empty(target.shape, dtype=target.dtype, device=self.device))
        kwargs["generator"] = self._generator(name)
        if in_kwargs:
            kwargs["tensor"] = full
        else:
            args = (full,) + tuple(args[1:])
        out = func(*args, **kwargs)
        if whole:
            return out
        with torch.no_grad():
            local.copy_(_shard_of(full, target))
        return target


def _shard_of(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`target`'s local part of the whole tensor `full` (every rank holds the same `full`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor):
        return full
    return distribute_tensor(full, target.device_mesh, target.placements,
                             src_data_rank=None).to_local()  # None: slice locally, no collective


def materialize(part: nn.Module, device, seed: int, param_device=None) -> nn.Module:
    """Storage and first weights of a meta part (parameters on `param_device`, buffers `device`)."""
    device = torch.device(device)
    part.to_empty(device=torch.device(param_device) if param_device is not None else device)
    with torch.no_grad(), PerTensorStreams(part, seed, device):
        part.init_weights(buffer_device=device)
        # Modules a transform added (LoRA adapters) that the model's init_weights does not know.
        for module in part.modules():
            if hasattr(module, "init_adapter"):
                module.init_adapter()
    return part


def check_placement(parts, device, param_device=None) -> None:
    """A tensor not where the run computes would fail at the first forward, far from its cause."""
    device = torch.device(device)
    param_device = torch.device(param_device) if param_device is not None else device

    def same(a: torch.device, b: torch.device) -> bool:
        return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)

    wrong = []
    for part in parts:
        for kind, items, want in (("parameter", part.named_parameters(), param_device),
                                  ("buffer", part.named_buffers(), device)):
            for name, t in items:
                if not same(_local(t).device, want):
                    wrong.append(f"{kind} {canonical_name(name)} on {_local(t).device}")
    if wrong:
        raise RunError(f"after building the model, {len(wrong)} tensor(s) are not on {device} "
                       f"(parameters belong on {param_device}): {', '.join(wrong[:5])}")


def _world() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(obj, src: int = 0):
    """obj from rank `src` on every rank (itself where there is one process)."""
    if not _world():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def load_full_state(parts, state: Optional[Mapping[str, torch.Tensor]], device,
                    keep: Callable[[str], bool] = lambda name: False) -> None:
    """Fill every rank's parts from rank 0's `state` (None elsewhere) a tensor at a time: at most
    shards plus one full tensor per rank. keep(name) tensors may be absent (LoRA adapters)."""
    device = torch.device(device)
    world = _world()
    rank = dist.get_rank() if world else 0
    if rank == 0 and state is None:
        raise ValueError("load_full_state: rank 0 needs the state to send")
    specs = broadcast_object([(k, tuple(t.shape), t.dtype) for k, t in state.items()]
                             if rank == 0 else None)
    targets = {}
    for part in parts:
        persistent = set(part.state_dict().keys())  # canonical names: wrappers strip prefixes
        targets.update({k: t for k, t in named_tensors(part).items() if k in persistent})
    shapes = {k: shape for k, shape, _ in specs}
    missing = sorted(k for k in set(targets) - set(shapes) if not keep(k))
    wrong = [f"{k} {shapes[k]} vs {tuple(t.shape)}" for k, t in targets.items()
             if k in shapes and tuple(t.shape) != shapes[k]]
    problem = (f"the weights to load do not fit rank {rank}'s model part(s): missing "
               f"{missing[:4]} ({len(missing)}), shapes differing (theirs vs ours) "
               f"{wrong[:4]}." if missing or wrong else None)
    problems = [problem]
    if world:  # every rank stops, not only those missing something (the others would wait)
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    if any(problems):
        raise RunError(next(p for p in problems if p))
    with torch.no_grad():
        for key, shape, dtype in specs:
            target = targets.get(key)
            full = (state[key].detach().to(device).contiguous() if rank == 0
                    else torch.empty(shape, dtype=dtype, device=device))
            if world:
                dist.broadcast(full, src=0)
            if target is not None:
                _local(target).copy_(_shard_of(full, target))
            del full
