"""The LLaMA model: its blocks (attention, SwiGLU) inside lingua's decoder shell. A plain nn.Module
with no distributed code: parallelize.py beside it shards it from outside, by these module names.
A fork keeps the contract in lingua/model/decoder.py's docstring (checked at start, naming what
is missing): subclass Decoder, give layers `init_weights(std, out_std)`, attend by CoreAttention."""

from dataclasses import dataclass

from torch import nn

from lingua.model.decoder import Decoder
from lingua.model.layers import (
    CoreAttention,
    FeedForward,
    KVCache,
    RMSNorm,
    TransformerArgs,
    apply_rope,
    ffn_hidden_dim,
    validate_transformer_args,
)


@dataclass
class LlamaArgs(TransformerArgs):
    """LLaMA needs nothing beyond the shared decoder shape (lingua.model.layers.TransformerArgs)."""


def validate_model_args(args: LlamaArgs) -> None:
    validate_transformer_args(args)   # a fork's new model options are checked here


class Attention(nn.Module):
    """Grouped-query attention with RoPE. Parameter names mirror Meta's llama (wq/wk/wv/wo), which
    hf.py beside this file maps to Hugging Face's and parallelize.py shards by head."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, backend: str = "sdpa"):
        super().__init__()
        self.head_dim = dim // n_heads
        self.core = CoreAttention(backend)
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, rope, mask=None, cache: KVCache | None = None, cache_key: str = ""):
        # Head counts come from the tensors: under tensor parallelism this rank holds some heads.
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(cache_key, k, v)
        out = self.core(q, k, v, mask, decoding=cache is not None)
        return self.wo(out.reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads or args.n_heads,
                                   args.attn_backend)
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
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(Decoder):
    """LLaMA: lingua's decoder shell (which checks its args) around TransformerBlocks."""

    def make_layer(self, layer_id: int, args: LlamaArgs) -> nn.Module:
        return TransformerBlock(layer_id, args)
