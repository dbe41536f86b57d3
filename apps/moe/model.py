"""The MoE decoder: LLaMA's attention (lingua/models/llama/model.py's, with its Qwen options) and
mixture-of-experts FFNs (lingua.model.moe.MoE), in lingua's decoder shell (lingua/model/decoder.py,
whose contract this keeps). The first `n_dense_layers` blocks keep a dense SwiGLU `feed_forward`;
the others have a `moe`.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lingua.errors import ConfigError
from lingua.model.decoder import Decoder
from lingua.model.layers import FeedForward, KVCache, RMSNorm, ffn_hidden_dim, head_dim
from lingua.model.masks import AttentionMask
from lingua.model.moe import (
    EXPERT_IMPLS,
    SCORE_FUNCS,
    MoE,
    active_params_per_token,
    balance_loss_sum,
    check_grouped_alignment,
)
from lingua.models.llama.model import Attention, AttentionArgs, validate_attention_args


@dataclass
class MoEArgs(AttentionArgs):
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
    # 0 = dropless; else ceil(cf * tokens * top_k / n_experts) tokens per expert
    capacity_factor: float = 0.0
    expert_impl: str = "grouped"      # grouped | loop


def expert_hidden(args: MoEArgs) -> int:
    return args.expert_hidden_dim or ffn_hidden_dim(
        args.dim, args.multiple_of, args.ffn_dim_multiplier
    )


def validate_moe_args(args: MoEArgs) -> None:
    """The dense decoder's checks plus the experts'; raises ConfigError before any allocation."""
    validate_attention_args(args)
    if args.n_experts < 1 or not 1 <= args.top_k <= args.n_experts:
        raise ConfigError(
            f"model.top_k={args.top_k} with model.n_experts={args.n_experts}: each token picks "
            "top_k distinct experts, so 1 <= top_k <= n_experts is needed. Lower top_k or add "
            "experts."
        )
    if not 0 <= args.n_dense_layers <= args.n_layers:
        raise ConfigError(f"model.n_dense_layers={args.n_dense_layers} must be between 0 and "
                          f"model.n_layers={args.n_layers}.")
    if args.score_func not in SCORE_FUNCS:
        raise ConfigError(f"model.score_func={args.score_func!r} is not one of "
                          f"{', '.join(SCORE_FUNCS)}.")
    if args.expert_impl not in EXPERT_IMPLS:
        raise ConfigError(f"model.expert_impl={args.expert_impl!r} is not one of "
                          f"{', '.join(EXPERT_IMPLS)}.")
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
        self.attention = Attention(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if self.is_moe:
            self.moe = MoE(args.dim, expert_hidden(args), args.n_experts, args.top_k,
                           args.n_shared_experts, args.score_func, args.norm_topk,
                           args.route_scale, args.capacity_factor, args.expert_impl,
                           args.aux_loss_coef, args.z_loss_coef)
        else:
            hidden = ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier)
            self.feed_forward = FeedForward(args.dim, hidden)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None):
        # layer_id only when decoding: torch.compile guards on the integers it reads, and would
        # compile each block separately (past its limit of 8, silently eager) if read in training.
        cache_key = "" if cache is None else str(self.layer_id)
        h = x + self.attention(self.attention_norm(x), rope=rope, mask=mask, cache=cache,
                               cache_key=cache_key)
        return h + (self.moe if self.is_moe else self.feed_forward)(self.ffn_norm(h))

    def init_weights(self, std: float, out_std: float):
        """Inputs-side matrices normal(std); residual outputs (wo, w2) normal(out_std), shrunk with
        depth so the residual stream's variance does not grow; router gate normal(std); bias 0."""
        att = self.attention
        ffns = [self.feed_forward] if not self.is_moe else [self.moe.experts] + (
            [self.moe.shared_experts] if self.moe.shared_experts is not None else [])
        ins = [att.wq.weight, att.wk.weight, att.wv.weight]
        ins += [getattr(f.w1, "weight", f.w1) for f in ffns]
        ins += [getattr(f.w3, "weight", f.w3) for f in ffns]
        outs = [att.wo.weight] + [getattr(f.w2, "weight", f.w2) for f in ffns]
        att.init_extras()   # q/k/v biases 0, QK-norms 1
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


class Transformer(Decoder):
    """lingua's decoder shell around MoEBlocks."""

    def __init__(self, args: MoEArgs):
        validate_moe_args(args)
        super().__init__(args)
        if args.window is not None:   # Mixtral's sliding window, as LLaMA's (Mistral's)
            self.mask_spec = AttentionMask(window=args.window)
        self.balancing = args.aux_loss_coef > 0 or args.z_loss_coef > 0

    def make_layer(self, layer_id: int, args: MoEArgs) -> nn.Module:
        return MoEBlock(layer_id, args)

    # What a pipeline stage returns beside its hidden states, and the next stage takes by keyword.
    stage_outputs = ("balance_loss",)

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None,
                balance_loss: Optional[torch.Tensor] = None):
        """The shell's forward; in training with balancing losses on (aux_loss_coef or
        z_loss_coef > 0) it returns (output, balance_loss [1]): the MoE layers' losses summed
        over this part's tokens, plus `balance_loss` from the pipeline stage before (see
        stage_outputs). apps/moe/train.py's loss adds it to the cross-entropy."""
        h, _, _ = self.trunk(tokens, doc_ids, cache, positions)
        out = self.head(h)
        if not (self.training and self.balancing):
            return out
        total = balance_loss_sum([b.moe for b in self.layers.values() if b.is_moe], out.device)
        return out, (total if balance_loss is None else total + balance_loss)


def flops_per_token(args: MoEArgs, seq_len: int) -> float:
    """Training FLOPs per token counting active parameters only (see
    lingua.model.moe.active_params_per_token): 6 per active matmul parameter plus attention's
    12 * n_layers * attention width * seq_len."""
    with torch.device("meta"):
        model = Transformer(args)
    active = active_params_per_token(model)
    if args.tie_embeddings:
        active += model.tok_embeddings.weight.numel()
    return 6.0 * active + 12.0 * args.n_layers * args.n_heads * head_dim(args) * seq_len
