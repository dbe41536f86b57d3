"""The planner's activation estimate (lingua.launch.plan): the bytes a block and the last stage's
output keep per token for backward, and the micro-batches a pipeline rank holds at once.

Korthikanti et al. 2022's accounting redone for this code (fp32 RMSNorm, GQA k, v repeated before
flash attention, SwiGLU, TP + sequence parallel, lingua.parallel.distributed's op-level
checkpointing); tests/test_plan.py checks it against real blocks' tensors. Assumed: a flash kernel,
balanced MoE routing, no CPU expert padding, no torch.compile fusion. Under tp, torch keeps the
all-gathered inputs of attention and FFN, and ac=op also wo's and w2's full-sequence partial sums,
so ac=op can keep MORE than ac=none; ac=full is the one that shrinks activations."""

from lingua.parallel import pipeline
from lingua.train.app import BlockShape


def block_activation_bytes(s: BlockShape, moe: bool, ac: str, e: int, tp: int = 1,
                           fp32_residual: bool = False, grouped_kv: bool = False,
                           cp: int = 1) -> float:
    """Bytes one block of shape `s` (App.block_shape) keeps per token of the sequence for its
    backward. e: bytes of the compute dtype; ac: none | op | full (layer is none or full per
    block). fp32_residual: autocast, where the residual stream and norms stay fp32 and every
    matmul keeps its own bf16 copy of its input. grouped_kv: k/v reach attention with their own
    heads (sdpa's GQA, on CPU only)."""
    h, f = s.dim, s.ffn_hidden
    t = tp
    gathered = t > 1   # TP + SP: attention / FFN / MoE inputs are all-gathered full sequences
    r = 4 if fp32_residual else e                           # residual stream, norm outputs
    ffn_in = 2 if fp32_residual else 1                      # kept copies of the FFN input
    if ac == "full":
        return r * h / t                                    # the block's input
    if ac not in ("none", "op"):
        raise ValueError(f"ac={ac!r}: use none, op or full (layer is a mix of none and full)")
    attn = attention_bytes(s, ac, e, t, fp32_residual, grouped_kv, cp)
    hs = s.expert_hidden * s.shared_experts
    # Qwen3-Next's: zero-centred norms keep their fp32 input too; the shared expert's gate keeps
    # its sigmoid and the expert's output (ac=op: the gate's matmul output)
    gated = (8 * h / t + (e * h + e if hs else 0) if ac == "none" else e) if s.gated else 0
    if ac == "none":
        out = 2 * _norm_bytes(h, r, t) / t + attn + gated   # the two norms; attention
        if not moe:
            return out + ffn_in * e * h + 4 * e * f / t     # FFN input(s); w1, silu, w3, product
        k, he = s.experts_per_token, s.expert_hidden
        # the router's fp32 input; per routed slot: gathered row, w1, silu, w3, product, and
        # the expert output gathered back to slot order (the combine's bmm input); router
        # scores / indices; shared experts (with their input).
        out += 4 * h + k * (2 * e * h + 4 * e * he) + 4 * s.experts + 28 * k
        # in fp32 the router's input is the norm output itself, which the shared experts keep
        shared_in = 0 if e == 4 and not fp32_residual else ffn_in * e * h
        return out + (shared_in + 4 * e * hs if hs else 0)
    # op: the input, and every matmul / attention / all-gather output (_SAVE_OPS of
    # lingua.parallel.distributed): the attention's, wo's output (under tp a full-sequence
    # partial sum before its reduce-scatter), the all-gathered inputs.
    out = r * h / t + attn + e * h + (r * h if gathered else 0) + gated
    if not moe:
        return out + 2 * e * f / t + e * h + (r * h if gathered else 0)   # w1 w3; w2; FFN in
    # router gate; the combine's bmm output (a matmul's, so kept; full sequence under tp, like
    # the MoE input); shared w1 w3 w2
    out += 4 * s.experts + e * h + (2 * e * hs + e * h if hs else 0)
    return out + (r * h if gathered else 0)                 # all-gathered MoE input


def attention_bytes(s: BlockShape, ac: str, e: int, tp: int, fp32_residual: bool,
                    grouped_kv: bool, cp: int = 1) -> float:
    """What attention keeps per token between the block's norm and wo. Grouped-query (ac none:
    its input copies, q, k, v, output, logsumexp; op: q, k, v, output, logsumexp). Latent (ac
    none: the input copies, each latent norm's fp32 input and its output, q and k, the
    decompressed k/v that v is a view of, output, logsumexp; op: every matmul's output, the
    attention's). Heads split over tp, latents whole; under cp > 1 the all-gathered k and v."""
    if s.linear_value_heads:
        return gated_deltanet_bytes(s, ac, e, tp)
    nh, dq, dv, t = s.n_heads, s.head_dim, s.value_head_dim, tp
    lse, hk, hv = 4 * nh, s.n_kv_heads * dq, s.n_kv_heads * dv
    # Qwen3-Next's gate (the query projection's other half) and QK-norm: ac=op, the gate; none,
    # each norm's fp32 input and normalised output and rsqrt, the gate's sigmoid and product (in
    # fp32 the query is a view of the projection, so the gate's half is kept with it)
    gate = e * nh * dq if ac == "op" else (4 * (nh + s.n_kv_heads) + 8 * (nh * dq + hk)
                                           + (2 * e + (4 if e == 4 else 0)) * nh * dq)
    gated = gate / t if s.gated else 0
    gathered_kv = e * (hk + hv) / t * cp if cp > 1 else 0
    if s.kv_latent:
        qr, kv, dr = s.q_latent, s.kv_latent, s.rope_head_dim
        decompressed = dq - dr + dv                          # the kv latent's matmul, per head
        if ac == "op":
            return e * (qr + kv + dr) + (e * nh * (dq + decompressed + dv) + lse) / t + gathered_kv
        latents = sum(4 * w + 4 + e * w for w in (qr, kv) if w)
        heads = e * nh * (2 * dq + decompressed + dv) + lse
        attn_in = 2 if fp32_residual else 1                  # the q and kv matmuls' copies
        return attn_in * e * s.dim + latents + heads / t + gathered_kv
    if ac == "op":
        return (e * (nh * dq + hk + hv + nh * dv) + lse) / t + gathered_kv + gated
    attn_in = 3 if fp32_residual else 1                     # wq, wk, wv: a bf16 copy each
    kv = hk + hv if grouped_kv else nh * (dq + dv)          # repeated to all heads unless grouped
    return attn_in * e * s.dim + (e * (nh * dq + kv + nh * dv) + lse) / t + gathered_kv + gated


def gated_deltanet_bytes(s: BlockShape, ac: str, e: int, tp: int) -> float:
    """What a Gated DeltaNet layer keeps per token as apps/qwen3_next's chunked delta rule in
    torch computes it (fp32 inside, value heads served by repeated key heads; fla's kernel keeps
    less). ac=op: the six projections' outputs, the chunk's q.k and k.k matmuls (C x C a head),
    per chunk the state reads and writes (C x dv each, the state update dk x dv). none: the
    input; each short convolution's padded input and output and its fp32 result; beta (with an
    fp32 copy when e < 4) and the decay's softplus input and output; then in fp32 the l2 norms'
    rsqrt, q and k repeated to the value heads, six C x C matrices a head (decays, k.k, the
    triangular system, q.k, scores), the operands of those two matmuls (copied for bmm), the two
    triangular solves, four per-position decays, the chunks' states (dk x dv a head per C
    tokens), the written values u, two per-chunk operand copies; the gated norm's rsqrt,
    normalised and scaled outputs, z in fp32 and its silu, and out_proj's input."""
    hk, hv, c = s.linear_key_heads / tp, s.linear_value_heads / tp, s.chunk
    dk, dv = s.linear_key_dim, s.linear_value_dim
    key, value = hk * dk, hv * dv
    if ac == "op":
        return e * (2 * key + 2 * value + 2 * hv) + 4 * hv * (2 * c + 3 * dv + dk * dv / c)
    convs = 2 * key + value
    chunked = 2 * hk + hv * (6 * c + 9 * dk + 2 * dv + 4 + dk * dv / c)
    gates = e * hv + (4 * hv if e < 4 else 0) + 8 * hv
    return e * s.dim + (2 * e + 4) * convs + gates + 4 * chunked + 4 * hv + 16 * value + e * value


def _norm_bytes(h: int, r: int, tp: int) -> int:
    """What an RMSNorm keeps per token: its fp32 normalised input and rsqrt; under tp (DTensors
    take torch's composite ops one by one) also its normalised output before the weight."""
    return 4 * h + 4 + (r * h if tp > 1 else 0)


def output_activation_bytes(model_args, e: int, tp: int, loss_parallel: bool,
                            fp32_residual: bool = False) -> float:
    """Bytes per token at the last stage's end: final norm, the output projection's (gathered)
    input, bf16 logits, their fp32 copy and the fp32 log-probabilities of the cross-entropy."""
    h, vocab = model_args.dim, model_args.vocab_size
    norm = _norm_bytes(h, 4 if fp32_residual else e, tp)
    v_local = vocab / tp if loss_parallel else vocab
    return norm / tp + e * h + (e + 8) * v_local


def chunks_in_flight(schedule: str, pp: int, virtual: int, n_mb: int, pp_rank: int) -> float:
    """Micro-batches a pipeline rank holds at once, in units of its stages' average."""
    if pp == 1:
        return 1.0
    name = pipeline.schedule_name(schedule)
    if name in ("GPipe", "LoopedBFS"):   # every micro-batch (of every stage) before a backward
        return float(n_mb)
    if pipeline.SCHEDULE_STYLES[name] == "single":   # 1F1B
        return float(min(n_mb, pp - pp_rank))
    # Interleaved / zero-bubble: torch's warmup forwards ((v - 1) pp + 2 (pp - 1 - rank)) plus
    # the one the steady state adds, in chunks; a chunk is 1/virtual of the rank's layers.
    chunks = min(n_mb * virtual, (virtual - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)
    return chunks / virtual


def lora_activation_bytes(block, s: BlockShape, moe: bool, ac: str, e: int, tp: int = 1,
                          fp32_residual: bool = False) -> float:
    """What a block with frozen Linears or LoRA adapters keeps per token beyond
    block_activation_bytes (negative: less). A frozen Linear keeps no input for its (absent)
    weight gradient; an adapter keeps its rank-wide middle, and under ac=op also B's output."""
    from torch import nn

    from lingua.model.lora import LoRALinear

    if ac == "full":
        return 0.0
    linears = {name.rsplit(".", 1)[-1]: m for name, m in block.named_modules()
               if isinstance(m, nn.Linear)}
    adapters = [m for m in linears.values() if isinstance(m, LoRALinear)]
    if ac == "op":
        return sum(e * (m.rank + m.out_features / tp) for m in adapters)
    out = float(sum(e * m.rank for m in adapters))

    def frozen(name):   # no weight gradient and no adapter: its input is not kept for it
        m = linears.get(name)
        return m is not None and not isinstance(m, LoRALinear) and not m.weight.requires_grad

    if all(frozen(n) for n in ("wq", "wk", "wv")):
        out -= (3 if fp32_residual else 1) * e * s.dim
    if not moe:
        ffn_frozen = [frozen(n) for n in ("w1", "w3")]
        if all(ffn_frozen):
            out -= (2 if fp32_residual else 1) * e * s.dim
        elif fp32_residual and any(ffn_frozen):   # autocast: one copy of the input each
            out -= e * s.dim
        if frozen("w2"):
            out -= e * s.ffn_hidden / tp
    return out
