"""The MoE decoder: LLaMA's attention blocks with mixture-of-experts FFNs (lingua.moe.MoE).

The first `n_dense_layers` blocks keep a dense SwiGLU `feed_forward`; the others have a `moe`.
Same contracts as apps/llama/model.py: forward(tokens, doc_ids, cache, positions), layers keyed
"0".."n-1" so pipeline stages can drop them, init_weights(buffer_device) after `to_empty`, and a
stage without tok_embeddings / output takes / returns hidden states.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lingua.errors import ConfigError
from lingua.moe import EXPERT_IMPLS, SCORE_FUNCS, MoE, active_params_per_token, check_grouped_alignment
from lingua.transformer import (
    Attention, FeedForward, KVCache, RMSNorm, TransformerArgs, check_attn_backend, ffn_hidden_dim,
    make_attn_mask, rope_cos_sin, rope_inv_freq, validate_transformer_args,
)


@dataclass
class MoEArgs(TransformerArgs):
    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 0
    expert_hidden_dim: int = 0        # 0: the dense layers' ffn_hidden_dim(dim, multiple_of, ...)
    n_dense_layers: int = 0           # the first N blocks use a dense SwiGLU FFN
    score_func: str = "softmax"       # softmax | sigmoid
    norm_topk: bool = False           # renormalise the top-k weights to sum to 1
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0        # Switch/GShard load-balancing loss
    z_loss_coef: float = 0.0          # router z-loss
    bias_update_rate: float = 0.0     # DeepSeek-V3 aux-loss-free balancing (0 = off)
    capacity_factor: float = 0.0      # 0 = dropless; else ceil(cf * tokens * top_k / n_experts) per expert
    expert_impl: str = "grouped"      # grouped | loop


def expert_hidden(args: MoEArgs) -> int:
    return args.expert_hidden_dim or ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)


def validate_moe_args(args: MoEArgs) -> None:
    """The dense decoder's checks plus the experts'; raises ConfigError before any allocation."""
    validate_transformer_args(args)
    if args.n_experts < 1 or not 1 <= args.top_k <= args.n_experts:
        raise ConfigError(
            f"model.top_k={args.top_k} with model.n_experts={args.n_experts}: each token picks top_k "
            "distinct experts, so 1 <= top_k <= n_experts is needed. Lower top_k or add experts."
        )
    if not 0 <= args.n_dense_layers <= args.n_layers:
        raise ConfigError(f"model.n_dense_layers={args.n_dense_layers} must be between 0 and "
                          f"model.n_layers={args.n_layers}.")
    if args.score_func not in SCORE_FUNCS:
        raise ConfigError(f"model.score_func={args.score_func!r} is not one of {', '.join(SCORE_FUNCS)}.")
    if args.expert_impl not in EXPERT_IMPLS:
        raise ConfigError(f"model.expert_impl={args.expert_impl!r} is not one of {', '.join(EXPERT_IMPLS)}.")
    for name in ("capacity_factor", "n_shared_experts", "expert_hidden_dim", "aux_loss_coef",
                 "z_loss_coef", "bias_update_rate"):
        if getattr(args, name) < 0:
            raise ConfigError(f"model.{name}={getattr(args, name)} must be >= 0 (0 turns it off).")
    if args.expert_impl == "grouped":
        check_grouped_alignment(args.dim, expert_hidden(args))


class MoEBlock(nn.Module):
    def __init__(self, layer_id: int, args: MoEArgs):
        super().__init__()
        self.layer_id, self.is_moe = layer_id, layer_id >= args.n_dense_layers
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads or args.n_heads, args.attn_backend)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if self.is_moe:
            self.moe = MoE(args.dim, expert_hidden(args), args.n_experts, args.top_k, args.n_shared_experts,
                           args.score_func, args.norm_topk, args.route_scale, args.capacity_factor,
                           args.expert_impl, args.aux_loss_coef, args.z_loss_coef)
        else:
            hidden = ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)
            self.feed_forward = FeedForward(args.dim, hidden)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None):
        h = x + self.attention(self.attention_norm(x), rope, mask, cache, str(self.layer_id))
        return h + (self.moe if self.is_moe else self.feed_forward)(self.ffn_norm(h))

    def init_weights(self, std: float, out_std: float):
        """Inputs-side matrices normal(std); residual outputs (wo, w2) normal(out_std), shrunk with
        depth so the residual stream's variance does not grow; router gate normal(std); bias 0."""
        att = self.attention
        ffns = [self.feed_forward] if not self.is_moe else [self.moe.experts] + (
            [self.moe.shared_experts] if self.moe.shared_experts is not None else [])
        ins = [att.wq.weight, att.wk.weight, att.wv.weight] + [getattr(f.w1, "weight", f.w1) for f in ffns]
        ins += [getattr(f.w3, "weight", f.w3) for f in ffns]
        outs = [att.wo.weight] + [getattr(f.w2, "weight", f.w2) for f in ffns]
        if self.is_moe:
            ins.append(self.moe.router.gate.weight)
            self.moe.router.expert_bias.zero_()
            self.moe.step_counts = None
        for w in ins:
            nn.init.normal_(w, std=std)
        for w in outs:
            nn.init.normal_(w, std=out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: MoEArgs):
        super().__init__()
        validate_moe_args(args)
        if args.attn_backend == "xformers":
            check_attn_backend("xformers", "cuda" if torch.cuda.is_available() else "cpu")
        self.args, self.attn_backend = args, args.attn_backend
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, so not persistent: checkpoints hold learned weights only.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()  # a no-op on meta; call again after to_empty

    @torch.no_grad()
    def init_weights(self, buffer_device=None):
        a = self.args
        head_dim = a.dim // a.n_heads
        device = torch.device(buffer_device if buffer_device is not None else self.rope_cos.device)
        if device.type == "meta":
            self.rope_cos = torch.empty(a.max_seq_len, head_dim, device="meta")
            self.rope_sin = torch.empty_like(self.rope_cos)
        else:
            inv_freq = rope_inv_freq(head_dim, a.rope_theta, a.rope_scaling, a.rope_scale_factor,
                                     a.rope_low_freq_factor, a.rope_high_freq_factor, a.rope_original_max_seq_len)
            self.rope_cos, self.rope_sin = rope_cos_sin(inv_freq, a.max_seq_len, device)
        for module in (self.tok_embeddings, self.output):
            if module is not None:
                nn.init.normal_(module.weight, std=a.init_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        for block in self.layers.values():  # residual outputs shrink with depth, as in apps/llama
            depth = 2 * (block.layer_id + 1 if a.depth_init else a.n_layers)
            block.init_weights(a.init_std, a.init_std / math.sqrt(depth))

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [b, s] (hidden states [b, s, dim] on a later pipeline stage) -> logits [b, s, vocab].
        doc_ids [b, s] keeps attention inside documents; cache: decoding; positions: a CP shard's."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        s, start = h.shape[1], (cache.pos if cache is not None else 0)
        if start + s > self.rope_cos.shape[0]:
            raise ConfigError(f"sequence of {start + s} tokens exceeds model.max_seq_len="
                              f"{self.args.max_seq_len}; raise model.max_seq_len.")
        pos = positions if positions is not None else slice(start, start + s)
        rope = (self.rope_cos[pos], self.rope_sin[pos])
        mask = cache.attn_mask(s) if cache is not None else make_attn_mask(self.attn_backend, doc_ids, s, h.device)
        for layer in self.layers.values():
            h = layer(h, rope, mask, cache)
        if cache is not None:
            cache.pos += s
        if self.output is not None:
            return self.output(self.norm(h))
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.norm is not None:
            return nn.functional.linear(self.norm(h), self.tok_embeddings.weight)
        return h  # a pipeline stage before the last


def flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """Training FLOPs per token counting active parameters only (see lingua.moe.active_params_per_token):
    6 per active matmul parameter plus attention's 12 * n_layers * dim * seq_len."""
    with torch.device("meta"):
        model = Transformer(args)
    active = active_params_per_token(model) + (model.tok_embeddings.weight.numel() if args.tie_embeddings else 0)
    return 6.0 * active + 12.0 * args.n_layers * args.dim * seq_len
