"""Transformer pieces apps build their blocks from: RMSNorm, RoPE, CoreAttention (sdpa / flex /
xformers), a KV cache, SwiGLU, TransformerArgs. No distributed code: tensor parallelism shards
Linears from outside, so apps read head counts from the tensors (`view(b, s, -1, head_dim)`).
RoPE rotates the two *halves* of each head (HF's layout, not Meta's interleaved complex pairs):
HF checkpoints load without permuting q/k rows, and cos/sin stay real tensors."""

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from lingua.errors import ConfigError
from lingua.model.masks import AttentionMask

ATTN_BACKENDS = ("sdpa", "flex", "xformers")

# True in a pipeline's first-step shape inference: forward counters (MoE routing, probes) skip it.
_INFERRING_SHAPES = False


def inferring_shapes() -> bool:
    return _INFERRING_SHAPES


def set_inferring_shapes(value: bool) -> None:
    global _INFERRING_SHAPES
    _INFERRING_SHAPES = value


@dataclass
class TransformerArgs:
    """The shape of a LLaMA-style decoder; apps extend it (apps/moe adds the experts)."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: Optional[int] = None      # None -> n_heads (grouped-query attention when smaller)
    head_dim: Optional[int] = None        # None -> dim / n_heads (Qwen3 and Mistral Nemo set it)
    vocab_size: int = 258                 # bytes tokenizer: 256 bytes + BOS(256) + EOS(257)
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: bool = False            # Llama 3.1 frequency scaling
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    attn_backend: str = "sdpa"            # sdpa | flex | xformers
    attn_mask: str = "causal"             # causal | block_causal (no attention across documents)
    init_std: float = 0.02
    depth_init: bool = True               # scale output-projection init by depth


def validate_transformer_args(args: TransformerArgs) -> None:
    """Cheap checks, before any process group or allocation; raises ConfigError."""
    for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(args, name)} must be a positive integer.")
    if args.n_kv_heads is not None and args.n_kv_heads <= 0:
        raise ConfigError(f"model.n_kv_heads={args.n_kv_heads} must be positive (or null for "
                          "n_heads).")
    if args.init_std <= 0 or args.norm_eps <= 0 or args.rope_theta <= 0:
        raise ConfigError("model.init_std, model.norm_eps and model.rope_theta must be positive.")
    if args.head_dim is None and args.dim % args.n_heads:
        raise ConfigError(f"model.dim={args.dim} is not divisible by model.n_heads={args.n_heads}: "
                          "each head gets dim / n_heads channels. Pick n_heads dividing dim (e.g. "
                          "dim=256 with n_heads=8), or set model.head_dim.")
    n_kv = args.n_kv_heads or args.n_heads
    if args.n_heads % n_kv:
        raise ConfigError(f"model.n_heads={args.n_heads} is not divisible by model.n_kv_heads="
                          f"{n_kv}: in grouped-query attention each key/value head serves the same "
                          f"number of query heads. Set n_kv_heads to a divisor of {args.n_heads}.")
    if head_dim(args) <= 0 or head_dim(args) % 2:
        raise ConfigError(f"The head width ({head_dim(args)}: model.head_dim, or model.dim / "
                          "model.n_heads when unset) must be positive and even: RoPE rotates "
                          "channel pairs. Change head_dim, dim or n_heads.")
    if args.attn_backend not in ATTN_BACKENDS:
        raise ConfigError(f"model.attn_backend={args.attn_backend!r} is not one of "
                          f"{', '.join(ATTN_BACKENDS)}.")
    if args.attn_mask not in ("causal", "block_causal"):
        raise ConfigError(f"model.attn_mask={args.attn_mask!r} is not one of causal, block_causal.")
    if args.rope_scaling and args.rope_high_freq_factor <= args.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor={args.rope_high_freq_factor} must exceed "
                          f"model.rope_low_freq_factor={args.rope_low_freq_factor} (Llama 3.1 "
                          "uses 4 and 1).")


def head_dim(args: TransformerArgs) -> int:
    """Each attention head's width: model.head_dim, else dim / n_heads (Meta's LLaMA)."""
    return args.head_dim or args.dim // args.n_heads


def _eager_plain(*tensors) -> bool:
    """Take the hand-written autograd path (RMSNorm, RoPE)? Only for plain tensors in eager mode:
    inductor fuses the composite better, and a DTensor needs its ops one by one for sharding."""
    return not torch.compiler.is_compiling() and not any(isinstance(t, DTensor) for t in tensors)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm with a written-out backward: half the memory passes (the cost on CPU)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xf * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.x_dtype = x.dtype
        return xhat.type_as(x) * weight

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        dweight = (grad * xhat.to(ctx.x_dtype)).sum(tuple(range(grad.ndim - 1))).to(weight.dtype)
        gw = (grad * weight).to(xhat.dtype)
        # d/dx of x * rstd(x): rstd * (gw - xhat * mean(gw * xhat))
        mean = torch.linalg.vecdot(gw, xhat).unsqueeze(-1) / xhat.shape[-1]
        dx = torch.addcmul(gw, xhat, mean, value=-1).mul_(rstd)
        return dx.to(ctx.x_dtype), dweight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32: bf16 mean-of-squares loses too much precision.
        if _eager_plain(x, self.weight):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rope_inv_freq(head_dim: int, theta: float, scaling: bool = False, scale_factor: float = 8.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_seq_len: int = 8192) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp64. With `scaling` (Llama 3.1), long wavelengths
    are stretched by `scale_factor`, short ones kept, and those between interpolated."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    smooth = ((original_max_seq_len / wavelen - low_freq_factor)
              / (high_freq_factor - low_freq_factor))
    smoothed = (1 - smooth) * inv_freq / scale_factor + smooth * inv_freq
    out = torch.where(wavelen > low_freq_wavelen, inv_freq / scale_factor, smoothed)
    return torch.where(wavelen < high_freq_wavelen, inv_freq, out)


def rope_cos_sin(inv_freq: torch.Tensor, max_seq_len: int, device=None,
                 dtype=torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_seq_len, head_dim] in the rotate_half layout. Angles are formed in
    fp64 and rounded once: an fp32 pos * freq is off by ~1e-3 rad near position 1e5."""
    inv_freq = inv_freq.to(device=device, dtype=torch.float64)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class _RopeFunction(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin, half by half, with the backward written out (the rotation
    by minus the angle): only the tables are saved, and a third of the memory passes go."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        xf = x.to(torch.promote_types(x.dtype, cos.dtype))
        half = x.shape[-1] // 2
        out = xf * cos
        out[..., :half].addcmul_(xf[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(xf[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        gf = grad.to(cos.dtype)
        half = grad.shape[-1] // 2
        dx = gf * cos
        dx[..., :half].addcmul_(gf[..., half:], sin[..., half:])
        dx[..., half:].addcmul_(gf[..., :half], sin[..., :half], value=-1)
        return dx.to(ctx.x_dtype), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d]; cos/sin [s, d]. In (at least) fp32 so bf16 runs keep exact positions."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    if _eager_plain(x, cos, sin):
        return _RopeFunction.apply(x, cos, sin)
    xf = x.to(torch.promote_types(x.dtype, cos.dtype))
    return (xf * cos + _rotate_half(xf) * sin).type_as(x)


def rope_tables(args: "TransformerArgs", device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The model's cos, sin tables [max_seq_len, head_dim] from its args (empty on meta)."""
    width = head_dim(args)
    if device is not None and torch.device(device).type == "meta":
        cos = torch.empty(args.max_seq_len, width, device="meta")
        return cos, torch.empty_like(cos)
    inv_freq = rope_inv_freq(width, args.rope_theta, args.rope_scaling, args.rope_scale_factor,
                             args.rope_low_freq_factor, args.rope_high_freq_factor,
                             args.rope_original_max_seq_len)
    return rope_cos_sin(inv_freq, args.max_seq_len, device)


def repeat_kv(k: torch.Tensor, v: torch.Tensor, n_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Repeat k/v [b, s, kv_heads, d] to n_heads: kv head j serves query heads j*n_rep.. (as HF)."""
    n_rep = n_heads // k.shape[2]
    if n_rep == 1:
        return k, v
    return k.repeat_interleave(n_rep, dim=2), v.repeat_interleave(n_rep, dim=2)


_FLEX_CPU_TRAINING = ("model.attn_backend=flex cannot train on CPU: torch's flex_attention has "
                      "no CPU backward (it runs forward-only there, e.g. for evaluation). Use "
                      "model.attn_backend=sdpa on CPU; it applies the same document masking.")


def check_attn_backend(name: str, device_type: str, training: bool = True) -> None:
    """Raise ConfigError if `name` cannot run on `device_type` ("cpu", "cuda")."""
    if name not in ATTN_BACKENDS:
        raise ConfigError(f"model.attn_backend={name!r} is not a known attention backend. "
                          f"Use one of {', '.join(ATTN_BACKENDS)}.")
    if name == "flex" and device_type == "cpu" and training:
        raise ConfigError(_FLEX_CPU_TRAINING)
    if name != "xformers":
        return
    if device_type != "cuda":
        raise ConfigError(f"model.attn_backend=xformers needs a CUDA device, but this run is on "
                          f"{device_type!r}: xformers has no CPU attention kernel. Use "
                          "model.attn_backend=sdpa on CPU.")
    try:
        import xformers.ops  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"model.attn_backend=xformers but xformers cannot be imported ({e}). "
                          "Install it with `pip install -e .[gpu]`, or use "
                          "model.attn_backend=sdpa.") from e


@functools.lru_cache(maxsize=32)
def _block_mask(spec: AttentionMask, seq_len: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: spec.allowed(q, k), None, None, seq_len, seq_len,
                             device=device)


def check_xformers_mask(spec: AttentionMask, sinks: bool = False) -> None:
    """Raise ConfigError for what xformers' attention biases cannot express."""
    if not spec.causal or spec.sink_tokens or sinks:
        raise ConfigError(f"model.attn_backend=xformers cannot apply the model's attention mask "
                          f"({spec}{', learned sinks' if sinks else ''}): its biases cover causal, "
                          "document-causal and sliding-window attention only. Use "
                          "model.attn_backend=flex (or sdpa), which apply any mask.")


def make_attn_mask(backend: str, doc_ids: Optional[torch.Tensor], seq_len: int,
                   device: torch.device, spec: AttentionMask = AttentionMask()):
    """The mask `attention` needs, built once per forward from the model's `spec`, within
    documents when `doc_ids` [b, s] is given: None (causal sdpa), a boolean [b or 1, 1, s, s]
    mask, a flex BlockMask, or an xformers attention bias."""
    if backend == "sdpa":
        if doc_ids is None and spec.plain_causal:
            return None
        pos = torch.arange(seq_len, device=device)
        return spec.dense(pos, pos, doc_ids)
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        if doc_ids is None:
            return _block_mask(spec, seq_len, str(device))

        def mask_mod(b, h, q, k):
            return spec.allowed(q, k, doc_ids[b, q], doc_ids[b, k])

        return create_block_mask(mask_mod, doc_ids.shape[0], None, seq_len, seq_len,
                                 device=str(device))
    if backend == "xformers":
        check_attn_backend("xformers", torch.device(device).type)
        check_xformers_mask(spec)
        from xformers.ops import fmha

        if doc_ids is None:
            return (fmha.attn_bias.LowerTriangularMask() if spec.window is None else
                    fmha.attn_bias.LowerTriangularFromBottomRightLocalAttentionMask(spec.window))
        # A block-diagonal mask over the flattened batch: runs of equal doc id in each row.
        starts = torch.ones_like(doc_ids, dtype=torch.bool)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        idx = torch.nonzero(starts.flatten()).flatten()
        ends = torch.cat([idx[1:], idx.new_tensor([doc_ids.numel()])])
        bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens((ends - idx).tolist())
        return bias if spec.window is None else bias.make_local_attention(spec.window)
    check_attn_backend(backend, torch.device(device).type)  # raises for an unknown name


def softmax_attention(q, k, v, mask=None, scale: Optional[float] = None, sinks=None,
                      causal: bool = False) -> torch.Tensor:
    """sdpa on q, k, v [b, h, s, d] (mask: boolean, True = attend); with `sinks` [h] written out,
    as sdpa returns no log-sum-exp, and k, v must have q's heads."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              enable_gqa=k.shape[1] != q.shape[1], scale=scale)
    dtype = torch.promote_types(q.dtype, torch.float32)   # the softmax in at least fp32
    scores = (q @ k.transpose(-1, -2)).to(dtype) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ v.to(dtype)).to(v.dtype)
    return with_sinks(out, scores.logsumexp(dim=-1), sinks)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's sinks (a learned per-head logit in the softmax denominator), exactly from the
    sink-free output and lse [b, h, s]: out * Z / (Z + e^sink) = out * sigmoid(lse - sink)."""
    return out * torch.sigmoid(lse - sinks.view(1, -1, 1)).unsqueeze(-1).to(out.dtype)


_compiled_flex = None


def _flex_attention(q, k, v, block_mask, scale=None, sinks=None):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    global _compiled_flex
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise ConfigError(_FLEX_CPU_TRAINING)
    if q.device.type == "cuda" and _compiled_flex is None:
        # the fused kernel needs compile; eager materializes the scores (fine for CPU evaluation)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    with warnings.catch_warnings():  # "use torch.compile" advice is moot for CPU evaluation
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = (_compiled_flex if q.device.type == "cuda" else flex_attention)(
            q, k, v, block_mask=block_mask, scale=scale,
            return_aux=None if sinks is None else AuxRequest(lse=True))
    return out if sinks is None else with_sinks(out[0], out[1].lse, sinks)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str,
              mask=None, scale: Optional[float] = None, sinks=None) -> torch.Tensor:
    """q [b, s, h, d], k [b, s, h_kv, d], v [b, s, h_kv, d_v] -> [b, s, h, d_v]; scores scaled by
    `scale` (None: 1/sqrt(d)); `sinks` [h]: learned attention sinks (`with_sinks`). Only sdpa
    without sinks takes fewer k/v heads than q (enable_gqa); the rest take them repeated."""
    if backend == "xformers":
        from xformers.ops import memory_efficient_attention

        if sinks is not None:
            check_xformers_mask(AttentionMask(), sinks=True)

        if not isinstance(mask, torch.Tensor) and type(mask).__name__.startswith("BlockDiagonal"):
            b, s = q.shape[:2]
            flat = lambda t: t.reshape(1, b * s, *t.shape[2:])  # noqa: E731
            out = memory_efficient_attention(flat(q), flat(k), flat(v), attn_bias=mask,
                                             scale=scale)
            return out.view(*q.shape[:3], v.shape[-1])
        return memory_efficient_attention(q, k, v, attn_bias=mask, scale=scale)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if backend == "flex":
        out = _flex_attention(q, k, v, mask, scale, sinks)
    else:
        out = softmax_attention(q, k, v, mask, scale, sinks, causal=mask is None)
    return out.transpose(1, 2)


class KVCache:
    """Keys/values seen so far per attention layer (keyed like `layers`), allocated at its first
    update shaped like what it caches (under TP only the layer knows its heads; MLA caches its
    latent). A recurrent layer keeps its state in the dict `states[key]` (apps/qwen3_next)."""

    def __init__(self, layer_keys, batch: int, max_len: int):
        self.kv: Dict[str, Optional[Tuple[torch.Tensor, torch.Tensor]]] = dict.fromkeys(layer_keys)
        self.states: Dict[str, dict] = {key: {} for key in self.kv}
        self.batch, self.max_len = batch, max_len
        self.pos = 0  # positions already cached; the next token's absolute position

    def update(self, key: str, k: torch.Tensor,
               v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.kv[key] is None:
            self.kv[key] = tuple(t.new_zeros(t.shape[0], self.max_len, *t.shape[2:])
                                 for t in (k, v))
        ck, cv = self.kv[key]
        end = self.pos + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions; {end} were asked for.")
        ck[:, self.pos:end] = k
        cv[:, self.pos:end] = v
        return ck[:, :end], cv[:, :end]

    def attn_mask(self, seq_len: int, device=None,
                  spec: AttentionMask = AttentionMask()) -> Optional[torch.Tensor]:
        """Boolean [1, 1, seq_len, pos + seq_len] mask: new queries against all keys."""
        if seq_len == 1 and spec.window is None:
            return None  # a single new token sees everything cached: no mask needed
        q_pos = self.pos + torch.arange(seq_len, device=device)
        return spec.dense(q_pos, torch.arange(self.pos + seq_len, device=device))


class CoreAttention(nn.Module):
    """softmax(QK^T)V: every app's attention calls its kernel through this module (the model
    contract); context parallelism replaces it by type, the probe hooks it. Takes q [b, s, h, d]
    and k, v [b, s, h_kv, d] after RoPE, and the decoder's mask; repeats k/v to h heads unless the
    kernel groups them (`grouped_kv_ok`). Decoding (KV cache) runs sdpa on any backend. `scale`:
    None is 1/sqrt(d); v's head size may differ from q's; `sinks` [h]: this rank's heads' sinks."""

    def __init__(self, backend: str = "sdpa", scale: Optional[float] = None):
        super().__init__()
        self.backend, self.scale = backend, scale

    def forward(self, q, k, v, mask=None, decoding: bool = False, sinks=None):
        grouped = sinks is None and (decoding or grouped_kv_ok(self, q, mask))
        if k.shape[2] != q.shape[2] and not grouped:
            k, v = repeat_kv(k, v, q.shape[2])
        if decoding:   # the cache's mask; None: one new token sees every cached key
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return softmax_attention(q, k, v, mask, self.scale, sinks).transpose(1, 2)
        return attention(q, k, v, self.backend, mask, self.scale, sinks)


def grouped_kv_ok(core: nn.Module, q: torch.Tensor, mask=None) -> bool:
    """May `core` hand sdpa fewer k/v heads than q (enable_gqa)? Only plain unmasked sdpa on CPU:
    CUDA sdpa groups heads in its flash kernel only, else falls back to the slow math kernel."""
    return (q.device.type == "cpu" and mask is None and isinstance(core, CoreAttention)
            and core.backend == "sdpa")


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float] = None) -> int:
    """Meta llama's SwiGLU width: 2/3 of 4*dim, optionally scaled, rounded up to `multiple_of`."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down (output projection)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
