"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention with a recurrent state) and gated full
attention, 3:1, on a sparse MoE with a gated shared expert, in lingua's decoder shell
(lingua/model/decoder.py, whose contract this keeps). A fork of apps/moe: what it changes is here.

Layer i is full attention when (i + 1) % full_attention_every == 0, else Gated DeltaNet
(transformers' layer_types / full_attention_interval). Every layer's FFN is the MoE.

Gated DeltaNet (Yang et al. 2024), per value head with state S [dk, dv]:
    S_t = a_t S_{t-1} + beta_t k_t (v_t - a_t S_{t-1}^T k_t)^T,   o_t = S_t^T q_t
with a_t = exp(g_t), g_t = -exp(A_log) * softplus(a_proj(x) + dt_bias), beta_t = sigmoid(b_proj(x)),
q, k after a short causal depthwise convolution + SiLU, l2-normalised (q also scaled by dk^-0.5);
several value heads share one key head (grouped). The output is RMSNorm(o) * silu(z), then
out_proj. Training computes it chunk by chunk (`chunk_gated_delta_rule`, the WY/UT form: within a
chunk the delta-rule updates are one triangular solve); decoding step by step
(`recurrent_gated_delta_rule`), the convolution's last inputs and S kept in KVCache.states.

Gated attention: q_proj gives each head its query and a gate (in that order, per head), the
output is attention * sigmoid(gate); QK-norm; RoPE on the first partial_rotary_factor of each
head's channels only; grouped-query heads.

Norms: the block norms, the final norm and QK-norm are zero-centred (weight w applied as 1 + w,
stored as w, initialised 0) as in transformers' Qwen3NextRMSNorm; the DeltaNet's gated output norm
is a plain RMSNorm (weight applied as is, initialised 1).
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
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
    head_dim,
    rope_cos_sin,
    rope_inv_freq,
    validate_transformer_args,
)
from lingua.model.moe import (
    EXPERT_IMPLS,
    MoE,
    balance_loss_sum,
    check_grouped_alignment,
    moe_layers,
)

CHUNK = 64                  # the chunked delta rule's block length (fla's too)
LINEAR_KERNELS = ("torch", "fla")


@dataclass
class Qwen3NextArgs(TransformerArgs):
    # Layer pattern: every full_attention_every-th layer is full attention, the rest Gated DeltaNet
    full_attention_every: int = 4
    # Full attention (n_heads, n_kv_heads, head_dim are TransformerArgs')
    partial_rotary_factor: float = 0.25
    # Gated DeltaNet
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel: int = 4
    linear_kernel: str = "torch"      # torch (chunked, any device) | fla (flash-linear-attention)
    # MoE: softmax top-k, renormalised with norm_topk; a shared expert behind a sigmoid gate
    n_experts: int = 8
    top_k: int = 2
    expert_hidden_dim: int = 64
    shared_expert_hidden_dim: int = 64   # 0: no shared expert
    norm_topk: bool = True
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    expert_impl: str = "grouped"      # grouped | loop


def layer_is_full(args: Qwen3NextArgs, layer_id: int) -> bool:
    return (layer_id + 1) % args.full_attention_every == 0


def rotary_dim(args: Qwen3NextArgs) -> int:
    return int(head_dim(args) * args.partial_rotary_factor)


def validate_model_args(args: Qwen3NextArgs) -> None:
    """Cheap checks before any allocation; raises ConfigError naming the fix."""
    validate_transformer_args(args)
    for name in ("full_attention_every", "linear_key_heads", "linear_value_heads",
                 "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel",
                 "n_experts", "top_k", "expert_hidden_dim"):
        if getattr(args, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(args, name)} must be positive.")
    if args.linear_value_heads % args.linear_key_heads:
        raise ConfigError(
            f"model.linear_value_heads={args.linear_value_heads} is not a multiple of "
            f"model.linear_key_heads={args.linear_key_heads}: each key head serves the same "
            "number of value heads in the Gated DeltaNet. Make the value heads a multiple of the "
            "key heads.")
    rot = rotary_dim(args)
    if not 0 < args.partial_rotary_factor <= 1 or rot <= 0 or rot % 2:
        raise ConfigError(
            f"model.partial_rotary_factor={args.partial_rotary_factor} with head width "
            f"{head_dim(args)} rotates {rot} channels; RoPE needs a positive even number of them. "
            "Use a factor in (0, 1] giving an even count (Qwen3-Next: 0.25 of 256).")
    if args.rope_scaling:
        raise ConfigError("model.rope_scaling=true (Llama 3.1's) is not implemented for "
                          "Qwen3-Next's partial RoPE. Set model.rope_scaling=false.")
    if args.linear_kernel not in LINEAR_KERNELS:
        raise ConfigError(f"model.linear_kernel={args.linear_kernel!r} is not one of "
                          f"{', '.join(LINEAR_KERNELS)}.")
    if args.attn_mask != "causal":
        raise ConfigError(
            f"model.attn_mask={args.attn_mask}: the Gated DeltaNet layers carry their state (and "
            "their convolution) across the whole sequence, so they cannot keep documents apart "
            "yet. Use model.attn_mask=causal.")
    if args.top_k > args.n_experts:
        raise ConfigError(f"model.top_k={args.top_k} is more than model.n_experts="
                          f"{args.n_experts}: each token picks top_k distinct experts.")
    if args.expert_impl not in EXPERT_IMPLS:
        raise ConfigError(f"model.expert_impl={args.expert_impl!r} is not one of "
                          f"{', '.join(EXPERT_IMPLS)}.")
    for name in ("shared_expert_hidden_dim", "aux_loss_coef", "z_loss_coef"):
        if getattr(args, name) < 0:
            raise ConfigError(f"model.{name}={getattr(args, name)} must be >= 0 (0 turns it off).")
    if args.expert_impl == "grouped":
        check_grouped_alignment(args.dim, args.expert_hidden_dim)


class CentredRMSNorm(RMSNorm):
    """Qwen3-Next's RMSNorm: the weight is stored as w and applied as (1 + w), in fp32 before the
    cast back (transformers' order), so a decayed weight pulls the scale towards 1."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps)
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)

    def reset_parameters(self):
        nn.init.zeros_(self.weight)


# ---------------------------------------------------------------------------------------------
# The gated delta rule


def _prepare(q, k, v, g, beta):
    """[b, s, heads, d] inputs -> fp32 [b, heads, s, d] (g, beta [b, heads, s]) with q, k
    l2-normalised (q also scaled by dk^-0.5) and repeated to the value heads (key head h serves
    value heads h*r .. h*r + r - 1)."""
    rep = v.shape[2] // k.shape[2]
    q, k = (t.float() for t in (q, k))
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    return q, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def chunk_gated_delta_rule(q, k, v, g, beta, state: Optional[torch.Tensor] = None,
                           chunk: int = CHUNK):
    """The gated delta rule over a whole sequence, a chunk at a time. q, k [b, s, hk, dk],
    v [b, s, hv, dv], g (log decay, <= 0) and beta [b, s, hv]; state [b, hv, dk, dv] or None.
    Returns (o [b, s, hv, dv] in v's dtype, final state fp32).

    Within a chunk, with G_i the decay from the chunk's start to position i and S0 the state
    before it, the state after i is G_i S0 + sum_{j<=i} (G_i/G_j) k_j u_j^T, where the written
    values u solve the unit lower-triangular system
        u_i + beta_i sum_{j<i} (G_i/G_j)(k_i.k_j) u_j = beta_i (v_i - G_i S0^T k_i),
    so one triangular solve replaces the chunk's sequential updates (the WY/UT form). fp32
    inside; the chunks run in sequence, each from the state the one before left."""
    out_dtype, (b, s) = v.dtype, v.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    hv, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    pad = -s % chunk   # zero k, v, beta and g leave the state as it is
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (s + pad) // chunk
    q, k, v = (t.reshape(b, hv, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(b, hv, n, chunk), beta.reshape(b, hv, n, chunk)
    cum = g.cumsum(-1)                                            # log G_i
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # log(G_i / G_j) = g_{j+1} + ... + g_i for j <= i, summed as such: cum_i - cum_j would lose
    # the digits of a short segment to cum's magnitude (hundreds, with fast-decaying heads)
    seg = g[..., :, None].expand(*g.shape, chunk).masked_fill(~causal.tril(-1), 0).cumsum(-2)
    ratio = seg.masked_fill(~causal, float("-inf")).exp()          # 0 above the diagonal
    # T = I + strictly lower [beta_i (G_i/G_j) k_i.k_j]
    system = ((k @ k.transpose(-1, -2)) * ratio * beta[..., None]).tril(-1)
    system = system + torch.eye(chunk, device=q.device)
    # u = W_v - W_k S0 with W_v = T^-1 beta v and W_k = T^-1 (beta G k)
    w_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False)
    w_k = torch.linalg.solve_triangular(system, k * (beta * cum.exp())[..., None], upper=False)
    scores = (q @ k.transpose(-1, -2)) * ratio                    # (G_i/G_j) q_i.k_j, j <= i
    q_decayed = q * cum.exp()[..., None]                           # G_i q_i reads S0
    k_to_end = k * seg[..., -1, :].exp()[..., None]                # G_C/G_j k_j writes the state
    chunk_decay = cum[..., -1].exp()[..., None, None]
    S = q.new_zeros(b, hv, dk, dv) if state is None else state.float()
    outs = []
    for c in range(n):
        u = w_v[:, :, c] - w_k[:, :, c] @ S
        outs.append(q_decayed[:, :, c] @ S + scores[:, :, c] @ u)
        S = S * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(b, hv, n * chunk, dv)[:, :, :s]
    return o.transpose(1, 2).to(out_dtype), S


def recurrent_gated_delta_rule(q, k, v, g, beta, state: Optional[torch.Tensor] = None):
    """The same rule one token at a time (decoding; the chunked form's reference). Arguments and
    returns as chunk_gated_delta_rule's."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, hv, s, dv = v.shape
    S = q.new_zeros(b, hv, k.shape[-1], dv) if state is None else state.float()
    outs = []
    for t in range(s):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        delta = (v[:, :, t] - (kt.unsqueeze(-1) * S).sum(-2)) * beta[:, :, t, None]
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-1) * S).sum(-2))
    return torch.stack(outs, dim=1).to(out_dtype), S


def _fla_rule(q, k, v, g, beta, state, keep_state: bool):
    """flash-linear-attention's Triton kernel (model.linear_kernel=fla, CUDA), chunk_gated_delta_
    rule's contract; the final state only when `keep_state` (decoding's prefill)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    o, final = fla_chunk(q, k, v, g=g.float(), beta=beta, initial_state=state,
                         output_final_state=keep_state, use_qk_l2norm_in_kernel=True)
    return o, final


# ---------------------------------------------------------------------------------------------
# Token mixers


class GatedDeltaNet(nn.Module):
    """The linear-attention layer (module docstring). Projections stay separate Linears and the
    short convolution separate depthwise convs for q, k and v, each laid out head by head, so a
    tensor-parallel plan can split every one of them by head; apps/qwen3_next/hf.py fuses and
    reorders them into transformers' in_proj_qkvz / in_proj_ba / conv1d."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__()
        self.dk, self.dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.kernel = args.linear_kernel
        key, value, heads = (args.linear_key_heads * self.dk, args.linear_value_heads * self.dv,
                             args.linear_value_heads)
        self.wq = nn.Linear(args.dim, key, bias=False)
        self.wk = nn.Linear(args.dim, key, bias=False)
        self.wv = nn.Linear(args.dim, value, bias=False)
        self.wz = nn.Linear(args.dim, value, bias=False)   # the output gate
        self.wb = nn.Linear(args.dim, heads, bias=False)   # beta, the write strength
        self.wa = nn.Linear(args.dim, heads, bias=False)   # the decay's input
        conv = lambda ch: nn.Conv1d(ch, ch, args.linear_conv_kernel, groups=ch, bias=False)  # noqa
        self.q_conv, self.k_conv, self.v_conv = conv(key), conv(key), conv(value)
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.norm = RMSNorm(self.dv, args.norm_eps)
        self.out_proj = nn.Linear(value, args.dim, bias=False)

    def _conv(self, conv: nn.Conv1d, x, states: Optional[dict], name: str):
        """Causal depthwise convolution + SiLU over x [b, s, ch]; when decoding, the last
        kernel - 1 inputs of the calls before stand in for the zero padding, and are kept."""
        x = x.transpose(1, 2)
        width = conv.kernel_size[0] - 1
        if states is None:
            past = x.new_zeros(*x.shape[:2], width)
        else:
            past = states.get(name)
            past = x.new_zeros(*x.shape[:2], width) if past is None else past
            states[name] = torch.cat([past, x], dim=-1)[..., x.shape[-1]:]
        return F.silu(conv(torch.cat([past, x], dim=-1))).transpose(1, 2)

    def forward(self, x, cache: Optional[KVCache] = None, cache_key: str = ""):
        b, s, _ = x.shape
        states = cache.states[cache_key] if cache is not None else None
        q = self._conv(self.q_conv, self.wq(x), states, "q_conv").view(b, s, -1, self.dk)
        k = self._conv(self.k_conv, self.wk(x), states, "k_conv").view(b, s, -1, self.dk)
        v = self._conv(self.v_conv, self.wv(x), states, "v_conv").view(b, s, -1, self.dv)
        beta = self.wb(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.wa(x).float() + self.dt_bias.float())
        state = states.get("recurrent") if states is not None else None
        if states is not None and s == 1:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
        elif self.kernel == "fla" and x.is_cuda:
            o, state = _fla_rule(q, k, v, g, beta, state, keep_state=states is not None)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, state)
        if states is not None:
            states["recurrent"] = state
        z = self.wz(x).view(b, s, -1, self.dv)
        o = (self.norm(o.float()) * F.silu(z.float())).to(x.dtype)
        return self.out_proj(o.reshape(b, s, -1))

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float):
        for lin in (self.wq, self.wk, self.wv, self.wz, self.wb, self.wa):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.out_proj.weight, std=out_std)
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            conv.reset_parameters()
        # transformers' initialisation: per-head decay rates exp(A_log) spread over [0.01, 16],
        # drawn in place so the parameter's own random stream (lingua.model.weights) draws them
        self.A_log.uniform_(0.01, 16).log_()
        nn.init.ones_(self.dt_bias)
        self.norm.reset_parameters()


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate per channel, QK-norm and partial RoPE."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__()
        n_heads, n_kv = args.n_heads, args.n_kv_heads or args.n_heads
        self.head_dim, self.rot = head_dim(args), rotary_dim(args)
        # per head: [query (head_dim); gate (head_dim)], transformers' order
        self.wq = nn.Linear(args.dim, n_heads * self.head_dim * 2, bias=False)
        self.wk = nn.Linear(args.dim, n_kv * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, n_kv * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = CentredRMSNorm(self.head_dim, args.norm_eps)
        self.k_norm = CentredRMSNorm(self.head_dim, args.norm_eps)
        self.core = CoreAttention(args.attn_backend)

    def _rope(self, x, rope):
        return torch.cat([apply_rope(x[..., :self.rot], *rope), x[..., self.rot:]], dim=-1)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None, cache_key: str = ""):
        b, s, _ = x.shape
        q, gate = self.wq(x).view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = self._rope(self.q_norm(q), rope), self._rope(self.k_norm(k), rope)
        if cache is not None:
            k, v = cache.update(cache_key, k, v)
        out = self.core(q, k, v, mask, decoding=cache is not None)
        return self.wo((out * torch.sigmoid(gate)).reshape(b, s, -1))

    def init_weights(self, std: float, out_std: float):
        for lin in (self.wq, self.wk, self.wv):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


# ---------------------------------------------------------------------------------------------
# MoE with a gated shared expert, and the block


class SharedGateMoE(MoE):
    """lingua's MoE (softmax top-k, renormalised, no capacity) plus Qwen's shared expert, scaled
    per token by sigmoid(shared_expert_gate(x)). The shared expert's width is its own (not a
    multiple of the routed experts'), so it is not MoE's ungated `shared_experts`."""

    def __init__(self, args: Qwen3NextArgs):
        super().__init__(args.dim, args.expert_hidden_dim, args.n_experts, args.top_k,
                         score_func="softmax", norm_topk=args.norm_topk,
                         expert_impl=args.expert_impl, aux_loss_coef=args.aux_loss_coef,
                         z_loss_coef=args.z_loss_coef)
        hidden = args.shared_expert_hidden_dim
        self.shared_expert = FeedForward(args.dim, hidden) if hidden else None
        self.shared_expert_gate = nn.Linear(args.dim, 1, bias=False) if hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Block(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3NextArgs):
        super().__init__()
        self.layer_id, self.is_full = layer_id, layer_is_full(args, layer_id)
        if self.is_full:
            self.attention = GatedAttention(args)
        else:
            self.linear_attention = GatedDeltaNet(args)
        self.attention_norm = CentredRMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = CentredRMSNorm(args.dim, args.norm_eps)
        self.moe = SharedGateMoE(args)

    def forward(self, x, rope, mask=None, cache: Optional[KVCache] = None):
        # layer_id only when decoding: torch.compile guards on the integers it reads.
        cache_key = "" if cache is None else str(self.layer_id)
        h = self.attention_norm(x)
        if self.is_full:
            h = self.attention(h, rope=rope, mask=mask, cache=cache, cache_key=cache_key)
        else:
            h = self.linear_attention(h, cache=cache, cache_key=cache_key)
        h = x + h
        return h + self.moe(self.ffn_norm(h))

    def init_weights(self, std: float, out_std: float):
        """Input-side matrices normal(std), residual outputs normal(out_std) (shrunk with depth);
        router and shared-expert gate normal(std); norms as their own reset says."""
        (self.attention if self.is_full else self.linear_attention).init_weights(std, out_std)
        moe = self.moe
        ffns = [moe.experts] + ([moe.shared_expert] if moe.shared_expert is not None else [])
        ins = [getattr(f.w1, "weight", f.w1) for f in ffns]
        ins += [getattr(f.w3, "weight", f.w3) for f in ffns]
        ins.append(moe.router.gate.weight)
        if moe.shared_expert_gate is not None:
            ins.append(moe.shared_expert_gate.weight)
        for w in ins:
            nn.init.normal_(w, std=std)
        for f in ffns:
            nn.init.normal_(getattr(f.w2, "weight", f.w2), std=out_std)
        moe.router.expert_bias.zero_()
        moe.step_counts = None
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


class Transformer(Decoder):
    """lingua's decoder shell around Qwen3-Next blocks, with its zero-centred final norm and RoPE
    tables for the rotated channels only."""

    def __init__(self, args: Qwen3NextArgs):
        validate_model_args(args)
        super().__init__(args)
        self.norm = CentredRMSNorm(args.dim, args.norm_eps)   # the shell's is a plain RMSNorm
        self.balancing = args.aux_loss_coef > 0 or args.z_loss_coef > 0

    def make_layer(self, layer_id: int, args: Qwen3NextArgs) -> nn.Module:
        return Block(layer_id, args)

    def init_rope(self, device=None) -> None:
        """cos, sin [max_seq_len, rotary_dim]: partial RoPE's tables cover the rotated channels,
        with frequencies over that width (transformers' partial_rotary_factor)."""
        device = device if device is not None else self.rope_cos.device
        rot, a = rotary_dim(self.args), self.args
        if device is not None and torch.device(device).type == "meta":
            self.rope_cos = torch.empty(a.max_seq_len, rot, device="meta")
            self.rope_sin = torch.empty_like(self.rope_cos)
            return
        self.rope_cos, self.rope_sin = rope_cos_sin(rope_inv_freq(rot, a.rope_theta),
                                                    a.max_seq_len, device)

    # What a pipeline stage returns beside its hidden states, and the next stage takes by keyword.
    stage_outputs = ("balance_loss",)

    def forward(self, tokens: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None, positions: Optional[torch.Tensor] = None,
                balance_loss: Optional[torch.Tensor] = None):
        """The shell's forward; in training with balancing losses on it returns (output,
        balance_loss [1]), as apps/moe's model does."""
        h, _, _ = self.trunk(tokens, doc_ids, cache, positions)
        out = self.head(h)
        if not (self.training and self.balancing):
            return out
        total = balance_loss_sum(moe_layers(self), out.device)
        return out, (total if balance_loss is None else total + balance_loss)

