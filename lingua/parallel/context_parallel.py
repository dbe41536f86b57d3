"""Context parallelism (CP): each rank of the cp group holds a slice of every sequence. Backends:
"allgather" (CPU and CUDA, any mask; Llama 3's) all-gathers the whole sequence's K/V, masked
by the model's rule at global positions; "ring" (CUDA, plain causal) is torch's
`context_parallel`. Causal: rank r holds chunks r and 2*cp-1-r of 2*cp (load balance). Forward AND
backward run inside `cp_batch` (recomputed attention and ring backward need its context)."""

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from lingua.errors import ConfigError
from lingua.model.layers import CoreAttention, repeat_kv, softmax_attention
from lingua.model.masks import AttentionMask

logger = logging.getLogger(__name__)

CP_BACKENDS = ("allgather", "ring")


def shard_positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Global positions held by `cp_rank`, in local order: chunk r then chunk 2*cp-1-r of 2*cp."""
    if seq_len % (2 * cp_size):
        raise ConfigError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp_size}; "
                          "pick data.seq_len as a multiple of it.")
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])


def shard_sequence(t: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    return t.index_select(dim, shard_positions(t.shape[dim], cp_rank, cp_size, t.device))


def _check_backend(backend: str) -> None:
    if backend not in CP_BACKENDS:
        raise ConfigError(f"distributed.cp_backend={backend!r} is not one of "
                          f"{', '.join(CP_BACKENDS)}.")


def validate_cp(seq_len: int, cp: int, tp: int = 1, backend: str = "allgather",
                device_type: Optional[str] = None, doc_masking: bool = False) -> None:
    """Raise ConfigError for a context-parallel setup that cannot run; call before any work."""
    _check_backend(backend)
    if cp <= 1:
        return
    step = 2 * cp * tp
    if seq_len % step:
        raise ConfigError(
            f"data.seq_len={seq_len} is not divisible by 2 x cp x tp = 2 x {cp} x {tp} = {step}: "
            "context parallelism cuts each sequence into 2*cp load-balanced chunks and sequence "
            f"parallelism splits each rank's part again by tp. Use a multiple of {step}, e.g. "
            f"data.seq_len={max(step, seq_len // step * step)}, or change distributed.cp.")
    if backend != "ring":
        return
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type != "cuda":
        raise ConfigError(
            f"distributed.cp_backend=ring needs CUDA, but this run is on {device_type!r}: torch's "
            "ring attention has no CPU kernel sharding rule. Use distributed.cp_backend=allgather.")
    if doc_masking:   # torch's ring SDPA raises "attn_bias is not supported yet" for any mask
        raise ConfigError(
            "model.attn_mask=block_causal with distributed.cp_backend=ring: torch's ring attention "
            "supports only plain causal attention, not document masks. Use "
            "distributed.cp_backend=allgather (any mask) or model.attn_mask=causal.")


RING_MASK_ONLY = ("distributed.cp_backend=ring cannot apply {what}: torch's ring attention masks "
                  "plain causal attention only. Use distributed.cp_backend=allgather, which "
                  "applies the model's mask and sinks.")


class CPContext:
    """Set by `cp_batch` before the forward, cleared after the backward."""

    def __init__(self, mesh, backend: str, spec: AttentionMask = AttentionMask()):
        self.mesh, self.group, self.backend, self.spec = mesh, mesh.get_group(), backend, spec
        self.rank, self.size = mesh.get_local_rank(), mesh.size()
        self.positions: Optional[torch.Tensor] = None   # [s_local] global positions of local tokens
        self.gather_order: Optional[torch.Tensor] = None  # puts all-gathered K/V in position order
        self.mask: Optional[torch.Tensor] = None        # [b or 1, 1, s_local, S] bool

    @property
    def active(self) -> bool:
        return self.positions is not None

    def set(self, positions: torch.Tensor, seq_len: int, doc_ids: Optional[torch.Tensor]) -> None:
        self.positions = positions
        if self.backend == "ring":
            return  # torch's ring attention masks causally by itself
        device = positions.device
        # all_gather concatenates the ranks' shards in rank order.
        gathered = torch.cat([shard_positions(seq_len, r, self.size, device)
                              for r in range(self.size)])
        self.gather_order = torch.argsort(gathered)
        self.mask = self.spec.dense(positions, torch.arange(seq_len, device=device), doc_ids)

    def clear(self) -> None:
        self.positions = self.gather_order = self.mask = None

    def require(self) -> "CPContext":
        if not self.active:
            raise RuntimeError("context-parallel attention was called outside `cp_batch`: wrap the "
                               "forward and the backward of each micro-batch in "
                               "`with lingua.parallel.context_parallel.cp_batch(...)`.")
        return self


class _CPAttention(nn.Module):
    def __init__(self, ctx: CPContext, scale: Optional[float] = None):
        super().__init__()
        self.ctx, self.scale = ctx, scale   # the replaced CoreAttention's score scale


class AllGatherKVAttention(_CPAttention):
    """Local queries against the whole sequence's keys/values; backward reduce-scatters."""

    def forward(self, q, k, v, mask=None, decoding: bool = False, sinks=None):  # never decoding
        # The model's `mask` treats the shard as a whole sequence: the context's mask is global.
        ctx = self.ctx.require()
        # K/V come with their own (grouped-query) heads: gather those, repeat after the gather.
        # Joined on the last dim (one collective for both): v's head size may differ (MLA).
        kv = self._gather(torch.cat([k, v], dim=-1), ctx)
        k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
        k, v = repeat_kv(k, v, q.shape[2])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = softmax_attention(q, k, v, ctx.mask.to(q.device), self.scale, sinks)
        return out.transpose(1, 2)

    @staticmethod
    def _gather(kv: torch.Tensor, ctx: CPContext):
        """kv [b, s_local, h, d] -> [b, S, h, d] in global position order."""
        from torch.distributed._functional_collectives import all_gather_single

        seq_first = kv.movedim(1, 0).contiguous()                 # gather along dim 0
        full = all_gather_single(seq_first, 0, ctx.group)
        return full.index_select(0, ctx.gather_order).movedim(0, 1)


class RingAttention(_CPAttention):
    """Plain causal sdpa on the local shard; torch's `context_parallel` (entered by `cp_batch`)
    patches sdpa into ring attention over the cp group (CUDA flash / efficient kernels only)."""

    def forward(self, q, k, v, mask=None, decoding: bool = False, sinks=None):  # never decoding
        self.ctx.require()  # outside the context sdpa would silently attend within the shard only
        if sinks is not None:
            raise ConfigError(RING_MASK_ONLY.format(what="learned attention sinks"))
        k, v = repeat_kv(k, v, q.shape[2])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # Looked up at call time on purpose: torch's CP context replaces it.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(1, 2)


def _fill_positions(module, args, kwargs):
    ctx = module.cp_context
    if ctx.active and kwargs.get("positions") is None and len(args) < 4:
        kwargs["positions"] = ctx.positions
    return args, kwargs


def apply_cp(model: nn.Module, cp_mesh, backend: str = "allgather") -> nn.Module:
    """Replace every CoreAttention in `model` by the context-parallel version; in place."""
    _check_backend(backend)
    spec = getattr(model, "mask_spec", AttentionMask())
    if backend == "ring" and not spec.plain_causal:
        raise ConfigError(RING_MASK_ONLY.format(what=f"the model's mask {spec}"))
    ctx = CPContext(cp_mesh, backend, spec)
    if backend == "ring":
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        set_rotate_method("allgather")   # how the ring exchanges K/V shards
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, CoreAttention):
                cls = AllGatherKVAttention if backend == "allgather" else RingAttention
                setattr(module, child_name, cls(ctx, child.scale))
                replaced.append(f"{name}.{child_name}" if name else child_name)
    if not replaced:
        raise ValueError("apply_cp found no lingua.model.layers.CoreAttention module to replace.")
    model.cp_context = ctx
    model.register_forward_pre_hook(_fill_positions, with_kwargs=True)
    logger.info("applied context parallelism (%s, cp=%d) to %d attention modules: %s", backend,
                ctx.size, len(replaced), ", ".join(replaced))
    return model


@dataclass
class CPBatch:
    tokens: torch.Tensor       # [b, S/cp] this rank's tokens (or hidden states [b, S/cp, dim])
    labels: Optional[torch.Tensor]
    positions: torch.Tensor    # [S/cp] their global positions


@contextlib.contextmanager
def cp_batch(models: Union[nn.Module, Iterable[nn.Module]], tokens: torch.Tensor,
             labels: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None):
    """Shard one micro-batch for this rank and set the attention context of `models`."""
    parts = [models] if isinstance(models, nn.Module) else list(models)
    contexts = [m.cp_context for m in parts if hasattr(m, "cp_context")]
    if not contexts:
        raise ValueError("cp_batch: no model part has context parallelism applied (call apply_cp "
                         "first).")
    ctx = contexts[0]
    seq_len = tokens.shape[1]
    model_args = getattr(models if isinstance(models, nn.Module) else None, "args", None)
    max_len = getattr(model_args, "max_seq_len", None)
    if max_len is not None and seq_len > max_len:
        raise ConfigError(f"sequence of {seq_len} tokens exceeds model.max_seq_len={max_len}; "
                          "raise model.max_seq_len.")
    if ctx.backend == "ring" and doc_ids is not None:
        validate_cp(seq_len, ctx.size, backend="ring", device_type=tokens.device.type,
                    doc_masking=True)
    with contextlib.ExitStack() as stack:
        if ctx.backend == "ring":
            from torch.distributed.tensor.experimental import context_parallel

            # torch shards this by its (head-tail) balancer: its ring schedule must match.
            positions = torch.arange(seq_len, device=tokens.device)
            stack.enter_context(context_parallel(ctx.mesh, buffers=[positions], buffer_seq_dims=[0],
                                                 no_restore_buffers={positions}))
        else:
            positions = shard_positions(seq_len, ctx.rank, ctx.size, tokens.device)
        for c in contexts:
            c.set(positions, seq_len, doc_ids)
        stack.callback(lambda: [c.clear() for c in contexts])
        local_labels = None if labels is None else labels.index_select(1, positions)
        yield CPBatch(tokens.index_select(1, positions), local_labels, positions)
