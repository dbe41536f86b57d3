"""DeepSeek-V3: multi-head latent attention (MLA) on a fine-grained mixture of experts, with
optional multi-token prediction, in lingua's decoder shell (lingua/model/decoder.py, whose
contract this keeps). Forked from apps/moe (the block) and apps/mtp (the MTP modules): a fork
copies what it changes.

MLA (DeepSeek-V2, section 2.1): queries come from x directly (`wq`) or through a low-rank
latent (`wq_a` -> RMSNorm -> `wq_b`, q_lora_rank); keys and values from one latent c_kv of
kv_lora_rank channels (`wkv_a` -> RMSNorm -> `wkv_b`), plus a rope key of qk_rope_head_dim
channels shared by all heads. Each head's query/key is [nope part (qk_nope_head_dim); rope part],
its value v_head_dim wide. Decoding caches c_kv and the rope key only (`KVCache`), the point of
MLA, and decompresses them for the heads at every step.

The MoE layers (after n_dense_layers dense ones) route by sigmoid scores with the aux-loss-free
selection bias and group-limited top-k (lingua.model.moe.Router), shared experts beside.

YaRN (rope_scale_factor with yarn=true) stretches RoPE's long wavelengths for long-context
fine-tuning; its attention-scale correction goes into the cos/sin tables and the softmax scale,
as DeepSeek-V3 does.

Multi-token prediction (mtp_depth D, DeepSeek-V3 section 2.2): module k takes the previous
depth's hidden state h and the embedding of token t_{i+k}, computes eh_proj([enorm(emb);
hnorm(h)]), runs one block and predicts t_{i+k+1} through its own final norm and the main
output projection. Each module has its own embedding (DeepSeek-V3's checkpoint stores one per
module), so everything it uses sits on the last pipeline stage.
"""

import math
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
    rope_cos_sin,
    validate_transformer_args,
)
from lingua.model.moe import (
    EXPERT_IMPLS,
    MoE,
    active_params_per_token,
    balance_loss_sum,
    check_grouped_alignment,
    check_groups,
    moe_layers,
)

LATENT_NORM_EPS = 1e-6   # DeepSeek's q/kv latent RMSNorms use their own eps, not norm_eps


@dataclass
class DeepSeekArgs(TransformerArgs):
    # MLA
    q_lora_rank: Optional[int] = None   # None: queries straight from x (DeepSeek-V2-Lite)
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # FFNs: dense layers first, then MoE layers
    dense_hidden_dim: int = 0         # 0: ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier)
    n_dense_layers: int = 1           # first_k_dense_replace
    n_experts: int = 8
    top_k: int = 2
    n_shared_experts: int = 1
    expert_hidden_dim: int = 64
    n_groups: int = 1                 # group-limited routing: n_group / topk_group
    topk_groups: int = 1
    norm_topk: bool = True
    route_scale: float = 1.0          # routed_scaling_factor
    bias_update_rate: float = 0.001   # aux-loss-free balancing (DeepSeek-V3's gamma; 0 = off)
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_impl: str = "grouped"      # grouped | loop
    # YaRN (rope_scale_factor and rope_original_max_seq_len are TransformerArgs')
    yarn: bool = False
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # Multi-token prediction
    mtp_depth: int = 0                # D extra tokens predicted (0: none)
    mtp_loss_weight: float = 0.3      # lambda: weight of the mean of the D MTP losses


def dense_hidden(args: DeepSeekArgs) -> int:
    return args.dense_hidden_dim or ffn_hidden_dim(args.dim, args.multiple_of,
                                                   args.ffn_dim_multiplier)


def validate_model_args(args: DeepSeekArgs) -> None:
    """Cheap checks before any allocation; raises ConfigError naming the fix."""
    validate_transformer_args(args)
    if args.n_kv_heads not in (None, args.n_heads):
        raise ConfigError(f"model.n_kv_heads={args.n_kv_heads}: MLA has no grouped key/value "
                          "heads (every head decompresses its own from the latent). Remove it.")
    if args.head_dim is not None:
        raise ConfigError(f"model.head_dim={args.head_dim}: MLA's head widths are "
                          "model.qk_nope_head_dim, qk_rope_head_dim and v_head_dim. Remove it.")
    if args.rope_scaling:
        raise ConfigError("model.rope_scaling=true is Llama 3.1's RoPE scaling; DeepSeek uses "
                          "YaRN: set model.yarn=true with model.rope_scale_factor and "
                          "model.rope_original_max_seq_len.")
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "n_experts", "top_k",
                 "expert_hidden_dim"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(args, name)} must be positive.")
    if args.qk_rope_head_dim <= 0 or args.qk_rope_head_dim % 2:
        raise ConfigError(f"model.qk_rope_head_dim={args.qk_rope_head_dim} must be positive and "
                          "even: RoPE rotates pairs of channels.")
    if args.q_lora_rank is not None and args.q_lora_rank <= 0:
        raise ConfigError(f"model.q_lora_rank={args.q_lora_rank} must be positive, or null for "
                          "queries without a latent.")
    if not 0 <= args.n_dense_layers <= args.n_layers:
        raise ConfigError(f"model.n_dense_layers={args.n_dense_layers} must be between 0 and "
                          f"model.n_layers={args.n_layers}.")
    if args.top_k > args.n_experts:
        raise ConfigError(f"model.top_k={args.top_k} is more than model.n_experts="
                          f"{args.n_experts}: each token picks top_k distinct experts.")
    check_groups(args.n_experts, args.top_k, args.n_groups, args.topk_groups)
    if args.expert_impl not in EXPERT_IMPLS:
        raise ConfigError(f"model.expert_impl={args.expert_impl!r} is not one of "
                          f"{', '.join(EXPERT_IMPLS)}.")
    for name in ("n_shared_experts", "bias_update_rate", "aux_loss_coef", "z_loss_coef",
                 "mtp_depth", "mtp_loss_weight"):
        if getattr(args, name) < 0:
            raise ConfigError(f"model.{name}={getattr(args, name)} must be >= 0 (0 turns it off).")
    if args.yarn and (args.rope_scale_factor < 1 or args.rope_original_max_seq_len <= 0):
        raise ConfigError(f"model.yarn=true needs model.rope_scale_factor >= 1 (got "
                          f"{args.rope_scale_factor}) and a positive model."
                          f"rope_original_max_seq_len (got {args.rope_original_max_seq_len}).")
    if args.expert_impl == "grouped":
        check_grouped_alignment(args.dim, args.expert_hidden_dim)


# ---------------------------------------------------------------------------------------------
# YaRN RoPE (Peng et al. 2023, as DeepSeek-V3 configures it)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# Written here: torch has no YaRN, and the model does not import transformers (whose
# rope_init "yarn" is what tests/test_deepseek.py's parity runs against).
def yarn_inv_freq(args: DeepSeekArgs) -> torch.Tensor:
    """Inverse frequencies [rope_dim // 2] (fp64): the high-frequency channels (more than
    beta_fast turns over the original context) keep theirs, the low-frequency ones (fewer than
    beta_slow) are divided by the factor, a linear ramp between."""
    dim, base, factor = args.qk_rope_head_dim, args.rope_theta, args.rope_scale_factor
    extrapolated = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if not args.yarn:
        return extrapolated

    def channel(turns: float) -> float:   # the channel that turns `turns` times over the context
        return dim * math.log(args.rope_original_max_seq_len / (turns * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(channel(args.yarn_beta_fast)), 0)
    high = min(math.ceil(channel(args.yarn_beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3))
    keep = 1 - ramp.clamp(0, 1)
    return extrapolated / factor * (1 - keep) + extrapolated * keep


def rope_tables(args: DeepSeekArgs, device=None):
    """cos, sin [max_seq_len, qk_rope_head_dim]; under YaRN scaled by its attention factor."""
    if device is not None and torch.device(device).type == "meta":
        cos = torch.empty(args.max_seq_len, args.qk_rope_head_dim, device="meta")
        return cos, torch.empty_like(cos)
    cos, sin = rope_cos_sin(yarn_inv_freq(args), args.max_seq_len, device, torch.float64)
    factor = 1.0
    if args.yarn:
        f = args.rope_scale_factor
        factor = _yarn_mscale(f) if not (args.yarn_mscale and args.yarn_mscale_all_dim) else (
            _yarn_mscale(f, args.yarn_mscale) / _yarn_mscale(f, args.yarn_mscale_all_dim))
    return (cos * factor).float(), (sin * factor).float()


def softmax_scale(args: DeepSeekArgs) -> float:
    """1/sqrt(query/key head size), times YaRN's mscale(factor, mscale_all_dim)^2."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    if args.yarn and args.yarn_mscale_all_dim:
        scale *= _yarn_mscale(args.rope_scale_factor, args.yarn_mscale_all_dim) ** 2
    return scale


# ---------------------------------------------------------------------------------------------
# Blocks


class MLA(nn.Module):
    """Multi-head latent attention (module docstring). Head counts come from the tensors: under
    tensor parallelism this rank holds some heads of wq / wq_b, wkv_b and wo."""

    def __init__(self, args: DeepSeekArgs):
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = (args.qk_nope_head_dim, args.qk_rope_head_dim,
                                                args.v_head_dim)
        self.kv_rank = args.kv_lora_rank
        q_out = args.n_heads * (self.nope + self.rope_dim)
        if args.q_lora_rank is None:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(args.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, args.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        # The rope key every head shares, as a module: tensor parallelism (apps/deepseek/
        # parallelize.py) sums its gradient over the ranks' heads here.
        self.shared_key = nn.Identity()
        self.core = CoreAttention(args.attn_backend, softmax_scale(args))

    def query_inputs(self):
        """The Linears q is computed by: (wq,) or (wq_a, wq_b)."""
        return (self.wq,) if hasattr(self, "wq") else (self.wq_a, self.wq_b)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None, cache_key: str = ""):
        b, s, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(b, s, -1, self.nope + self.rope_dim).split(
            [self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_norm(latent).unsqueeze(2)                     # [b, s, 1, kv_rank]
        k_rope = self.shared_key(apply_rope(k_rope.unsqueeze(2), *rope))  # [b, s, 1, rope_dim]
        if cache is not None:   # the small cache: latent and rope key, not per-head k/v
            latent, k_rope = cache.update(cache_key, latent, k_rope)
        t = latent.shape[1]
        kv = self.wkv_b(latent.squeeze(2)).view(b, t, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, *rope)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = self.core(q, k, v, mask, decoding=cache is not None)
        return self.wo(out.reshape(b, s, -1))

    def init_weights(self, std: float, out_std: float):
        for lin in (*self.query_inputs(), self.wkv_a, self.wkv_b):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
        self.kv_norm.reset_parameters()
        if hasattr(self, "q_norm"):
            self.q_norm.reset_parameters()


class Block(nn.Module):
    """MLA, then a dense SwiGLU (the first n_dense_layers blocks) or the MoE."""

    def __init__(self, layer_id: int, args: DeepSeekArgs):
        super().__init__()
        self.layer_id, self.is_moe = layer_id, layer_id >= args.n_dense_layers
        self.attention = MLA(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if self.is_moe:
            self.moe = MoE(args.dim, args.expert_hidden_dim, args.n_experts, args.top_k,
                           args.n_shared_experts, score_func="sigmoid", norm_topk=args.norm_topk,
                           route_scale=args.route_scale, expert_impl=args.expert_impl,
                           aux_loss_coef=args.aux_loss_coef, z_loss_coef=args.z_loss_coef,
                           n_groups=args.n_groups, topk_groups=args.topk_groups)
        else:
            self.feed_forward = FeedForward(args.dim, dense_hidden(args))

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None):
        # layer_id only when decoding: torch.compile guards on the integers it reads, and would
        # compile each block separately (past its limit of 8, silently eager) if read in training.
        cache_key = "" if cache is None else str(self.layer_id)
        h = x + self.attention(self.attention_norm(x), rope=rope, mask=mask, cache=cache,
                               cache_key=cache_key)
        return h + (self.moe if self.is_moe else self.feed_forward)(self.ffn_norm(h))

    def init_weights(self, std: float, out_std: float):
        """Inputs-side matrices normal(std); residual outputs (wo, w2) normal(out_std); router
        gate normal(std); selection bias 0."""
        self.attention.init_weights(std, out_std)
        ffns = [self.feed_forward] if not self.is_moe else [self.moe.experts] + (
            [self.moe.shared_experts] if self.moe.shared_experts is not None else [])
        ins = [getattr(f.w1, "weight", f.w1) for f in ffns]
        ins += [getattr(f.w3, "weight", f.w3) for f in ffns]
        outs = [getattr(f.w2, "weight", f.w2) for f in ffns]
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


class MTPModule(nn.Module):
    """One depth of multi-token prediction (module docstring)."""

    def __init__(self, layer_id: int, args: DeepSeekArgs):
        super().__init__()
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = nn.Linear(2 * args.dim, args.dim, bias=False)
        self.block = Block(layer_id, args)
        self.head_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, h, tokens, rope, mask=None):
        """-> (this depth's hidden states, their final norm for the shared output projection).
        The norm runs here, inside the module's forward, where FSDP has its weights gathered."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed(tokens)), self.hnorm(h)], dim=-1))
        h = self.block(x, rope, mask)
        return h, self.head_norm(h)

    def init_weights(self, std: float, out_std: float):
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.eh_proj.weight, std=std)
        for norm in (self.enorm, self.hnorm, self.head_norm):
            norm.reset_parameters()
        self.block.init_weights(std, out_std)


class Transformer(Decoder):
    """lingua's decoder shell around DeepSeek blocks, plus the MTP modules."""

    # The MTP modules run after the main model, beside the output projection they share.
    last_stage_modules = Decoder.last_stage_modules + ("mtp",)
    # What a pipeline stage returns beside its hidden states, and the next stage takes by keyword.
    stage_outputs = ("balance_loss",)

    def __init__(self, args: DeepSeekArgs):
        validate_model_args(args)
        super().__init__(args)
        self.balancing = args.aux_loss_coef > 0 or args.z_loss_coef > 0
        # Keyed "0".."D-1"; their blocks take layer ids after the main ones (as in the HF files).
        self.mtp = nn.ModuleDict({str(k): MTPModule(args.n_layers + k, args)
                                  for k in range(args.mtp_depth)}) if args.mtp_depth else None
        if self.mtp is not None and not self.tok_embeddings.weight.is_meta:
            self.init_weights()  # the shell's call ran before these existed

    def make_layer(self, layer_id: int, args: DeepSeekArgs) -> nn.Module:
        return Block(layer_id, args)

    def init_rope(self, device=None) -> None:
        device = device if device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_tables(self.args, device)

    @torch.no_grad()
    def init_weights(self, buffer_device=None):
        super().init_weights(buffer_device)
        a = self.args
        for k, module in (getattr(self, "mtp", None) or {}).items():
            depth = 2 * (a.n_layers + int(k) + 1) if a.depth_init else 2 * a.n_layers
            module.init_weights(a.init_std, a.init_std / depth ** 0.5)

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None,
                future_tokens: Optional[torch.Tensor] = None,
                balance_loss: Optional[torch.Tensor] = None):
        """The shell's forward. With `future_tokens` [b, s, D] (t_{i+k} at [:, i, k-1], from
        apps/deepseek/train.py's batch_inputs) the last stage returns the main and the D MTP
        logits stacked, [1 + D, b, s, vocab]. In training with balancing losses on it returns
        (output, balance_loss [1]), as apps/moe's model does."""
        h, rope, mask = self.trunk(tokens, doc_ids, cache, positions)
        out = self.head(h)
        if self.output is not None and future_tokens is not None and self.mtp is not None:
            logits = [out]
            for k, module in enumerate(self.mtp.values()):
                h, normed = module(h, future_tokens[..., k], rope, mask)
                logits.append(self.output(normed))
            out = torch.stack(logits)
        if not (self.training and self.balancing):
            return out
        total = balance_loss_sum(moe_layers(self), out.device)
        return out, (total if balance_loss is None else total + balance_loss)


def flops_per_token(args: DeepSeekArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per active matmul parameter (top_k of each layer's routed
    experts; the MTP modules' blocks and projections, and the output projection once more per
    MTP depth, which reuses it), plus attention's scores and weighted sum in every block, MTP's
    included: 2 x n_heads x (qk head + v head) x seq_len forward, x 3 with backward (the causal
    half not discounted, as for lingua's other models)."""
    with torch.device("meta"):
        model = Transformer(args)
    active = active_params_per_token(model) + args.mtp_depth * args.vocab_size * args.dim
    head = args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim
    blocks = args.n_layers + args.mtp_depth
    return 6.0 * active + 6.0 * blocks * args.n_heads * head * seq_len
