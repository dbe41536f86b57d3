"""The LLaMA model: its blocks (attention, SwiGLU) inside lingua's decoder shell. A plain nn.Module
with no distributed code: parallelize.py beside it shards it from outside, by these module names.
A fork keeps the contract in lingua/model/decoder.py's docstring (checked at start, naming what
is missing): subclass Decoder, give layers `init_weights(std, out_std)`, attend by CoreAttention."""

from dataclasses import dataclass
from typing import Optional

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
    ffn_hidden_dim,
    head_dim,
    validate_transformer_args,
)
from lingua.model.masks import AttentionMask

# The Hugging Face families this architecture is (model.family names the one export writes).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class AttentionArgs(TransformerArgs):
    """The shared decoder shape plus what the open families change in its attention."""
    qk_norm: bool = False          # Qwen3: RMSNorm over each head's q and k, before RoPE
    qkv_bias: bool = False         # Qwen2/2.5: biases on the q, k and v projections
    window: Optional[int] = None   # Mistral's sliding window (positions seen, self included)


@dataclass
class LlamaArgs(AttentionArgs):
    family: str = "llama"          # llama | mistral | qwen2 | qwen3: the model_type export writes


def validate_attention_args(args: AttentionArgs) -> None:
    validate_transformer_args(args)
    if args.window is not None and args.window < 1:
        raise ConfigError(f"model.window={args.window}: a query sees at least itself. Use a "
                          "window of 1 or more positions, or null for full causal attention.")


def validate_model_args(args: LlamaArgs) -> None:
    validate_attention_args(args)   # a fork's new model options are checked here
    if args.family not in FAMILIES:
        raise ConfigError(f"model.family={args.family!r} is not one of {', '.join(FAMILIES)}: "
                          "it names the Hugging Face architecture the export writes.")


class Attention(nn.Module):
    """Grouped-query attention with RoPE. Parameter names mirror Meta's llama (wq/wk/wv/wo), which
    hf.py beside this file maps to Hugging Face's and parallelize.py shards by head."""

    def __init__(self, args: AttentionArgs):
        super().__init__()
        n_heads, n_kv_heads = args.n_heads, args.n_kv_heads or args.n_heads
        self.head_dim = head_dim(args)
        self.core = CoreAttention(args.attn_backend)
        self.wq = nn.Linear(args.dim, n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x, rope, mask=None, cache: KVCache | None = None, cache_key: str = ""):
        # Head counts come from the tensors: under tensor parallelism this rank holds some heads.
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:   # over each head's channels: a rank's whole heads suffice
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(cache_key, k, v)
        out = self.core(q, k, v, mask, decoding=cache is not None)
        return self.wo(out.reshape(b, s, -1))

    def init_extras(self):
        """Biases from zero, QK-norms from one. The block draws the matrices, in the order LLaMA
        always has (a seed gives the weights it gave before these options)."""
        for lin in (self.wq, self.wk, self.wv):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        hidden_dim = ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.feed_forward = FeedForward(args.dim, hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, rope, mask=None, cache: KVCache | None = None):
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
        attn.init_extras()
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(Decoder):
    """LLaMA: lingua's decoder shell (which checks its args) around TransformerBlocks."""

    def __init__(self, args: LlamaArgs):
        validate_model_args(args)
        super().__init__(args)
        if args.window is not None:   # Mistral's: every layer sees the `window` latest positions
            self.mask_spec = AttentionMask(window=args.window)

    def make_layer(self, layer_id: int, args: LlamaArgs) -> nn.Module:
        return TransformerBlock(layer_id, args)
