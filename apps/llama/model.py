"""The LLaMA model: a plain nn.Module with no distributed code (parallelism is applied from outside).

Pipeline parallelism deletes entries of `layers` and sets `tok_embeddings`, `norm` and `output` to
None on the stages that do not own them: a stage without `tok_embeddings` takes hidden states as
input, and a stage without `output` returns hidden states. Tied embeddings (output reuses
tok_embeddings.weight, `output` is None) only make sense when one stage holds both ends.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lingua.errors import ConfigError
from lingua.transformer import (
    Attention, TransformerArgs, validate_transformer_args, FeedForward, KVCache, RMSNorm, check_attn_backend, ffn_hidden_dim,
    make_attn_mask, rope_cos_sin, rope_inv_freq,
)


@dataclass
class LlamaArgs(TransformerArgs):
    """LLaMA needs nothing beyond the shared decoder shape (lingua.transformer.TransformerArgs)."""


def validate_model_args(args: LlamaArgs) -> None:
    validate_transformer_args(args)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: LlamaArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads or args.n_heads, args.attn_backend)
        self.feed_forward = FeedForward(args.dim, ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier))
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None):
        x = x + self.attention(self.attention_norm(x), rope, mask, cache, str(self.layer_id))
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float):
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv, self.feed_forward.w1, self.feed_forward.w3):
            nn.init.normal_(lin.weight, std=std)
        # Residual-branch outputs start smaller so the residual stream's variance does not grow with depth.
        for lin in (self.attention.wo, self.feed_forward.w2):
            nn.init.normal_(lin.weight, std=out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        validate_model_args(args)
        if args.attn_backend == "xformers":  # fail at construction, not deep inside forward
            check_attn_backend("xformers", "cuda" if torch.cuda.is_available() else "cpu")
        self.args = args
        self.attn_backend = args.attn_backend  # fixed at construction, like the blocks' backend
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Not persistent: derived from args, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()  # a no-op on the meta device; call again after to_empty

    def init_rope(self, device=None):
        a = self.args
        inv_freq = rope_inv_freq(a.dim // a.n_heads, a.rope_theta, a.rope_scaling, a.rope_scale_factor,
                                 a.rope_low_freq_factor, a.rope_high_freq_factor, a.rope_original_max_seq_len)
        device = device if device is not None else self.rope_cos.device
        if torch.device(device).type == "meta":
            self.rope_cos = torch.empty(a.max_seq_len, a.dim // a.n_heads, device="meta")
            self.rope_sin = torch.empty_like(self.rope_cos)
        else:
            self.rope_cos, self.rope_sin = rope_cos_sin(inv_freq, a.max_seq_len, device)

    @torch.no_grad()
    def init_weights(self, buffer_device=None):
        """(Re)initialize every parameter and the RoPE tables, e.g. after `to_empty`."""
        self.init_rope(buffer_device)
        a = self.args
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=a.init_std)
        for block in self.layers.values():
            depth = 2 * (block.layer_id + 1) if a.depth_init else 2 * a.n_layers
            block.init_weights(a.init_std, a.init_std / math.sqrt(depth))
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, std=a.init_std)

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [b, s] (or hidden states [b, s, dim] on a later pipeline stage) -> logits [b, s, vocab].

        doc_ids [b, s]: a token attends only to earlier tokens of its own document. `cache` is for
        incremental decoding only (apps/llama/generate.py). `positions` [s]: the tokens' positions
        in the full sequence when they are not 0..s-1 (a context-parallel shard).
        """
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        seq_len = h.shape[1]
        start = 0 if cache is None else cache.pos
        if start + seq_len > self.rope_cos.shape[0]:
            raise ConfigError(f"sequence of {start + seq_len} tokens exceeds model.max_seq_len="
                              f"{self.args.max_seq_len}; raise model.max_seq_len.")
        if positions is not None:
            rope = (self.rope_cos[positions], self.rope_sin[positions])
        else:
            rope = (self.rope_cos[start:start + seq_len], self.rope_sin[start:start + seq_len])
        if cache is None:
            mask = make_attn_mask(self.attn_backend, doc_ids, seq_len, h.device)
        else:
            mask = cache.attn_mask(seq_len)
        for layer in self.layers.values():
            h = layer(h, rope, mask, cache)
        if cache is not None:
            cache.pos += seq_len
        if self.output is not None:
            return self.output(self.norm(h))
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.norm is not None:
            return F.linear(self.norm(h), self.tok_embeddings.weight)
        return h  # a pipeline stage before the last one
