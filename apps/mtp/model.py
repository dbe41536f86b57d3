"""LLaMA with multi-token prediction (DeepSeek-V3, section 2.2), forked from apps/llama.

Besides the next token, D extra modules predict tokens t+2 .. t+1+D, sequentially: MTP module k
takes the previous depth's hidden state at position i (the main model's last layer for k = 1)
and the embedding of token t_{i+k}, normalises both (RMSNorm), concatenates and projects them
back to dim, runs one transformer block, and predicts t_{i+k+1} through the main model's output
head (final norm + output projection, shared). The loss is the next-token cross-entropy plus
mtp_loss_weight / D times the sum of the D depths' cross-entropies (apps/mtp/train.py).
Generation and validation use the main head only: called without `future_tokens`, forward is
LLaMA's.

One difference from DeepSeek-V3: the MTP modules embed t_{i+k} with an embedding table of their
own (`mtp_embeddings`) instead of the input one, so that everything they use sits on the last
pipeline stage beside the head they share (the input embedding lives on the first).

What a fork of this file keeps (the contract of lingua/model/decoder.py, checked at start with an
error naming what is missing): subclass `Decoder` (or keep its forward(tokens, doc_ids=None,
cache=None, positions=None), `layers` ModuleDict keyed "0".."n-1", `tok_embeddings` / `norm` /
`output` and `init_weights(buffer_device=None)`); each layer's `init_weights(std, out_std)`;
attention through `lingua.model.layers.CoreAttention`. Everything else (new weights, other
blocks) is the fork's.
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
    ffn_hidden_dim,
    validate_transformer_args,
)


@dataclass
class MTPArgs(TransformerArgs):
    """LLaMA's decoder shape plus the multi-token prediction modules'."""

    mtp_depth: int = 1                # D: extra tokens predicted, one sequential module each
    mtp_loss_weight: float = 0.3      # lambda: weight of the mean of the D MTP losses


def validate_model_args(args: MTPArgs) -> None:
    validate_transformer_args(args)
    if args.mtp_depth < 1:
        raise ConfigError(f"model.mtp_depth={args.mtp_depth}: multi-token prediction needs at "
                          "least one extra module (1 predicts t+2). Use apps.llama for none.")
    if args.mtp_loss_weight < 0:
        raise ConfigError(f"model.mtp_loss_weight={args.mtp_loss_weight} must be >= 0.")


class Attention(nn.Module):
    """Grouped-query attention with RoPE. Parameter names mirror Meta's llama (wq/wk/wv/wo), which
    apps/mtp/hf.py maps to Hugging Face's and apps/mtp/parallelize.py shards by head."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, backend: str = "sdpa",
                 head_dim: Optional[int] = None):
        super().__init__()
        self.head_dim = head_dim or dim // n_heads
        self.core = CoreAttention(backend)
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None, cache_key: str = ""):
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
    def __init__(self, layer_id: int, args: MTPArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads or args.n_heads,
                                   args.attn_backend, args.head_dim)
        hidden_dim = ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)
        self.feed_forward = FeedForward(args.dim, hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None):
        # Only x is positional: the tensor-parallel plan lays out the first input and passes the
        # keyword ones (plain tensors and objects every rank holds whole) through.
        # layer_id only when decoding: torch.compile guards on the integers it reads, and would
        # compile each block separately (past its limit of 8, silently eager) if read in training.
        cache_key = "" if cache is None else str(self.layer_id)
        x = x + self.attention(self.attention_norm(x), rope=rope, mask=mask, cache=cache,
                               cache_key=cache_key)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, std: float, out_std: float):
        attn, ffn = self.attention, self.feed_forward
        for lin in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):
            nn.init.normal_(lin.weight, std=std)
        # Residual-branch outputs start smaller so the residual stream's variance does not grow
        # with depth.
        for lin in (self.attention.wo, self.feed_forward.w2):
            nn.init.normal_(lin.weight, std=out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class MTPModule(nn.Module):
    """One depth of multi-token prediction: [norm(h); norm(emb)] -> proj (2 dim -> dim) -> block."""

    def __init__(self, layer_id: int, args: MTPArgs):
        super().__init__()
        self.hidden_norm = RMSNorm(args.dim, args.norm_eps)
        self.embed_norm = RMSNorm(args.dim, args.norm_eps)
        self.proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = TransformerBlock(layer_id, args)

    def forward(self, h, emb, rope, mask=None):
        x = self.proj(torch.cat([self.hidden_norm(h), self.embed_norm(emb)], dim=-1))
        return self.block(x, rope, mask)

    def init_weights(self, std: float, out_std: float):
        nn.init.normal_(self.proj.weight, std=std)
        self.hidden_norm.reset_parameters()
        self.embed_norm.reset_parameters()
        self.block.init_weights(std, out_std)


class Transformer(Decoder):
    """LLaMA (lingua's decoder shell around TransformerBlocks) plus the MTP modules."""

    # The MTP modules and their embedding run after the main model, beside the head they share.
    last_stage_modules = Decoder.last_stage_modules + ("mtp", "mtp_embeddings")

    def __init__(self, args: MTPArgs):
        validate_model_args(args)
        super().__init__(args)
        self.mtp_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Keyed "0".."D-1" (depth k = key + 1); their blocks take layer ids after the main ones.
        self.mtp = nn.ModuleDict({str(k): MTPModule(args.n_layers + k, args)
                                  for k in range(args.mtp_depth)})
        self.init_weights()  # the shell's call ran before these existed

    def make_layer(self, layer_id: int, args: MTPArgs) -> nn.Module:
        return TransformerBlock(layer_id, args)

    @torch.no_grad()
    def init_weights(self, buffer_device=None):
        super().init_weights(buffer_device)
        a = self.args
        if getattr(self, "mtp_embeddings", None) is not None:
            nn.init.normal_(self.mtp_embeddings.weight, std=a.init_std)
        for k, module in (getattr(self, "mtp", None) or {}).items():
            depth = 2 * (a.n_layers + int(k) + 1) if a.depth_init else 2 * a.n_layers
            module.init_weights(a.init_std, a.init_std / depth ** 0.5)

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None,
                future_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """LLaMA's forward; with `future_tokens` [b, s, D] (token t_{i+k} at [:, i, k-1], from
        apps/mtp/train.py's batch_inputs) the last stage returns the main and the D MTP logits
        stacked, [1 + D, b, s, vocab]."""
        h, rope, mask = self.trunk(tokens, doc_ids, cache, positions)
        if self.output is None or future_tokens is None:
            return self.head(h)   # hidden states on an earlier stage; else the main logits
        logits = [self.head(h)]
        for k, module in enumerate(self.mtp.values()):
            h = module(h, self.mtp_embeddings(future_tokens[..., k]), rope, mask)
            logits.append(self.head(h))
        return torch.stack(logits)
