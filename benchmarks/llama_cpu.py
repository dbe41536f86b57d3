"""Our LLaMA training step vs Hugging Face's LlamaForCausalLM on the same shape, batch and dtype.

    python benchmarks/llama_cpu.py [--dtype bf16|fp32] [--steps 6] [--warmup 2]

Both sides do the same work per step: forward, next-token cross-entropy, backward, grad-norm clip
and a fused AdamW step, with sdpa attention; bf16 means autocast compute with fp32 weights and
optimizer state on both sides. Prints tokens/s of each, their ratio (ours / HF), and each one's
MFU against this machine's matmul peak measured in the same run and dtype. The default dtype is
bf16 where the CPU has bf16 instructions, else fp32 (emulated bf16 is 30-100x slower, and its
"peak" measures the emulation: MFU is then not reported).
"""

import argparse
import time

import torch

from apps.llama.model import LlamaArgs, Transformer
from lingua import metrics, optim

# ~36M parameters: 8 layers of width 512, 8k vocabulary (untied), SwiGLU hidden 1536.
SHAPE = dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab_size=8192, multiple_of=256)


def cpu_description() -> str:
    """The CPU model and the flags that decide its matmul speed, for every benchmark's output."""
    model, flags = "unknown CPU", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return f"{model}; flags: {' '.join(f for f in wanted if f in flags) or 'none of ' + ', '.join(wanted)}"


def median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def hf_model(args: LlamaArgs):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lingua.transformer import ffn_hidden_dim

    cfg = LlamaConfig(hidden_size=args.dim, num_hidden_layers=args.n_layers,
                      num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
                      intermediate_size=ffn_hidden_dim(args.dim, args.multiple_of, None),
                      vocab_size=args.vocab_size, max_position_embeddings=args.max_seq_len,
                      rope_theta=args.rope_theta, rms_norm_eps=args.norm_eps,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def time_steps(model, loss_fn, tokens, dtype, steps, warmup) -> float:
    """Seconds per training step (median over `steps` after `warmup`)."""
    opt = torch.optim.AdamW(optim.param_groups(model, 0.1), lr=1e-4, fused=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with autocast:
            loss = loss_fn(model, tokens)
        loss.backward()
        optim.clip_grad_norm([model], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def ours_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def hf_loss(model, tokens):
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="default: bf16 where this CPU has bf16 instructions, else fp32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    cli = parser.parse_args()
    emulated = metrics.cpu_bf16_emulated()
    cli.dtype = cli.dtype or ("fp32" if emulated else "bf16")
    emulated = emulated and cli.dtype == "bf16"
    if emulated:
        print("note: this CPU has no bf16 instructions (no avx512_bf16 / amx_bf16), so bf16 is "
              "emulated: 30-100x slower than fp32, and no MFU is reported. --dtype fp32 measures "
              "what this CPU can do.")

    args = LlamaArgs(**SHAPE, max_seq_len=cli.seq_len)
    torch.manual_seed(0)
    ours = Transformer(args)
    theirs = hf_model(args)
    n_params = sum(p.numel() for p in ours.parameters())
    assert n_params == sum(p.numel() for p in theirs.parameters()), "shapes differ"
    tokens = torch.randint(0, args.vocab_size, (cli.batch, cli.seq_len + 1))
    n_tokens = cli.batch * cli.seq_len

    peak = None if emulated else metrics.measure_cpu_peak(
        torch.bfloat16 if cli.dtype == "bf16" else torch.float32, 1.0)
    flops = metrics.flops_per_token(ours, args.n_layers, args.dim, cli.seq_len)
    results = {}
    # Alternate the two sides so that drift in machine load hits both equally.
    for _ in range(2):
        for name, model, loss_fn in (("ours", ours, ours_loss), ("hf", theirs, hf_loss)):
            t = time_steps(model, loss_fn, tokens, cli.dtype, cli.steps, cli.warmup)
            results[name] = min(results.get(name, float("inf")), t)

    print(f"model {n_params / 1e6:.1f}M params, batch {cli.batch} x {cli.seq_len}, {cli.dtype}, "
          f"{torch.get_num_threads()} threads; measured matmul peak "
          f"{'n/a (emulated bf16)' if peak is None else f'{peak / 1e9:.0f} GFLOP/s'}")
    for name in ("ours", "hf"):
        tps = n_tokens / results[name]
        mfu = metrics.mfu(flops * tps, peak)  # None: no credible peak
        print(f"{name:>5}: {results[name] * 1000:7.0f} ms/step  {tps:8.0f} tokens/s  "
              f"MFU {'  n/a' if mfu is None else f'{100 * mfu:5.1f}%'} of measured peak")
    print(f"ratio ours/hf tokens/s: {results['hf'] / results['ours']:.3f}")


if __name__ == "__main__":
    main()
