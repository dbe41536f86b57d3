"""LLaMA with sliding-window attention and learned attention sinks (as gpt-oss), forked from
lingua/models/llama/model.py.

- Sliding window: every layer's query sees the `window` latest positions, itself included
  (gpt-oss alternates windowed and full layers; here all are windowed). The model says so once,
  in `mask_spec` (lingua/model/masks.py), and every attention backend, the KV cache and context
  parallelism build their masks from it. `sink_tokens` keeps the row's first positions visible
  besides (StreamingLLM's sink tokens).
- Learned sinks: a logit per head added to each query's softmax denominator, a key every query
  sees that has no value, so a head may attend to (almost) nothing. CoreAttention takes them
  (`sinks=`) and applies them exactly on every backend it runs.

What a fork of this file keeps is lingua/model/decoder.py's contract (checked at start).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lingua.errors import ConfigError
from lingua.model.decoder import Decoder
from lingua.model.layers import (
    CoreAttention,
    FeedForward,
    KVCache,
    RMSNorm,
    TransformerArgs,
    apply_rope,
    check_xformers_mask,
    ffn_hidden_dim,
    validate_transformer_args,
)
from lingua.model.masks import AttentionMask


@dataclass
class SWAArgs(TransformerArgs):
    """LLaMA's decoder shape plus what this fork's attention sees."""

    window: Optional[int] = 128   # positions each query sees, itself included; null: all before
    sink_tokens: int = 0          # first positions of the row every query also sees (with a window)
    sinks: bool = True            # a learned attention-sink logit per head


def mask_of(args: SWAArgs) -> AttentionMask:
    return AttentionMask(window=args.window, sink_tokens=args.sink_tokens)


def validate_model_args(args: SWAArgs) -> None:
    validate_transformer_args(args)
    if args.window is not None and args.window < 1:
        raise ConfigError(f"model.window={args.window}: a query sees at least itself. Use a "
                          "window of 1 or more positions, or null for full causal attention.")
    if args.sink_tokens < 0 or (args.sink_tokens and args.window is None):
        raise ConfigError(f"model.sink_tokens={args.sink_tokens} needs model.window set and must "
                          "be >= 0: without a window every query already sees the first tokens.")
    if args.attn_backend == "xformers":
        check_xformers_mask(mask_of(args), sinks=args.sinks)


class Sinks(nn.Module):
    """The learned sink logits [n_heads]; a module of its own so that the TP plan can shard them
    by head (parallelize.py)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


class Attention(nn.Module):
    """Grouped-query attention with RoPE, a sliding window (the model's mask) and learned sinks.
    Parameter names mirror Meta's llama (wq/wk/wv/wo); parallelize.py shards them by head."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, backend: str = "sdpa",
                 sinks: bool = True, head_dim: Optional[int] = None):
        super().__init__()
        self.head_dim = head_dim or dim // n_heads
        self.core = CoreAttention(backend)
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.sinks = Sinks(n_heads) if sinks else None

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None, cache_key: str = ""):
        # Head counts come from the tensors: under tensor parallelism this rank holds some heads.
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(cache_key, k, v)
        sinks = None if self.sinks is None else self.sinks()
        out = self.core(q, k, v, mask, decoding=cache is not None, sinks=sinks)
        return self.wo(out.reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: SWAArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads or args.n_heads,
                                   args.attn_backend, args.sinks, args.head_dim)
        hidden_dim = ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.feed_forward = FeedForward(args.dim, hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None):
        # Only x is positional: the TP plan lays out the first input. layer_id is read only when
        # decoding: compile guards on it, compiling each block apart (past 8, silently eager).
        cache_key = "" if cache is None else str(self.layer_id)
        x = x + self.attention(self.attention_norm(x), rope=rope, mask=mask, cache=cache,
                               cache_key=cache_key)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float):
        attn, ffn = self.attention, self.feed_forward
        for lin in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
            nn.init.normal_(lin.weight, std=std)
        # Residual-branch outputs start smaller: the residual stream's variance stays flat in depth.
        for lin in (attn.wo, ffn.w2):
            nn.init.normal_(lin.weight, std=out_std)
        if attn.sinks is not None:   # a sink starts as heavy as one key with a zero score
            nn.init.zeros_(attn.sinks.weight)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(Decoder):
    """lingua's decoder shell around windowed TransformerBlocks; the window is the model's mask."""

    def __init__(self, args: SWAArgs):
        validate_model_args(args)
        super().__init__(args)
        self.mask_spec = mask_of(args)

    def make_layer(self, layer_id: int, args: SWAArgs) -> nn.Module:
        return TransformerBlock(layer_id, args)
