"""What optim.name=muon costs per step against AdamW, on the benchmark model
(benchmarks/llama_cpu.py).

    python benchmarks/muon_cost.py [--dtype fp32|bf16] [--ns-dtype bf16|fp32] [--threads N]
                                   [--steps 5]

Two timings, medians after `warmup`, with Muon and AdamW taking turns step by step so that drift
in machine load hits both alike (wall time and this process's CPU time, which moves less with
other work on a shared machine):
  * the optimizer step alone (lingua.optim.Optimizers: the fused AdamW kernel, or MuonAdamW:
    AdamW for embeddings/output/norms and Muon, with its Newton-Schulz, for the blocks'
    matrices), on fixed gradients, 3 x steps of each;
  * a whole training step: forward, cross-entropy, backward, clip, optimizer step.
Prints each, the ratios Muon / AdamW, Newton-Schulz's FLOPs per step and the rate they ran at,
and this CPU's model and bf16 flags (Newton-Schulz runs in bf16 by default whatever the model
dtype, as torch.optim.Muon does: on a CPU without avx512_bf16/amx_bf16 that bf16 is emulated and
slow; --ns-dtype fp32 is optim.muon.ns_dtype=fp32).
"""

import argparse
import copy
import os
import time

import torch
from llama_cpu import SHAPE, cpu_description, median  # run as python benchmarks/muon_cost.py

from lingua import optim
from lingua.models.llama.model import LlamaArgs, Transformer
from lingua.observe import metrics
from lingua.optim.muon import MuonArgs, muon_flops, split_params


def timed(fn) -> tuple:
    """(wall seconds, CPU seconds of this process) of fn(): on a shared machine the CPU time
    moves less with other load than the wall time does."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def interleaved(steps: dict, n: int, warmup: int) -> dict:
    """{name: (median wall s, median CPU s)}: the named step functions run in turn, one step
    each, so drift in machine load hits every side alike."""
    times = {name: [] for name in steps}
    for i in range(warmup + n):
        for name, step in steps.items():
            t = timed(step)
            if i >= warmup:
                times[name].append(t)
    return {name: (median([w for w, _ in ts]), median([c for _, c in ts]))
            for name, ts in times.items()}


def optimizer_step(model, optimizers):
    """The optimizer step alone, on fixed gradients (set once, never cleared)."""
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return optimizers.optimizers[0].step


def training_step(model, optimizers, tokens, dtype: str):
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step():
        with autocast:
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        optim.clip_grad_norm([model], 1.0)
        optimizers.step()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32",
                        help="the model's compute dtype (Newton-Schulz is bf16 either way)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ns-dtype", choices=["bf16", "fp32"], default="bf16",
                        help="optim.muon.ns_dtype (bf16: torch.optim.Muon's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's). On a shared machine 1 thread keeps "
                             "other load from stalling OpenMP barriers, which hits Newton-Schulz's "
                             "many small matmuls hardest")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    cli = parser.parse_args()
    if cli.threads:
        torch.set_num_threads(cli.threads)

    args = LlamaArgs(**SHAPE, max_seq_len=cli.seq_len)
    torch.manual_seed(0)
    base = Transformer(args)
    models = {name: copy.deepcopy(base) for name in ("adamw", "muon")}
    total = 10_000  # far beyond the run: the lr stays near its peak
    muon_args = MuonArgs(ns_dtype=cli.ns_dtype)
    optimizers = {name: optim.Optimizers([m], optim.OptimArgs(name=name, warmup=0, muon=muon_args),
                                         total, torch.device("cpu")) for name, m in models.items()}
    tokens = torch.randint(0, args.vocab_size, (cli.batch, cli.seq_len + 1))
    muon_params = [p for _, p in split_params(base)[0]]
    ns_flops = muon_flops(muon_params)

    names = ("adamw", "muon")
    load = os.getloadavg()[0]
    opt = interleaved({n: optimizer_step(models[n], optimizers[n]) for n in names}, cli.steps * 3,
                      cli.warmup)
    for m in models.values():
        m.zero_grad(set_to_none=True)
    train = interleaved({n: training_step(models[n], optimizers[n], tokens, cli.dtype)
                         for n in names},
                        cli.steps, cli.warmup)

    n_params = sum(p.numel() for p in base.parameters())
    n_muon = sum(p.numel() for p in muon_params)
    print(f"CPU: {cpu_description()}; {torch.get_num_threads()} threads; "
          f"bf16 {'emulated' if metrics.cpu_bf16_emulated() else 'native'}")
    print(f"model {n_params / 1e6:.1f}M params "
          f"({n_muon / 1e6:.1f}M in {len(muon_params)} Muon matrices), "
          f"batch {cli.batch} x {cli.seq_len}, {cli.dtype} compute, torch {torch.__version__}")
    print(f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
          f"(the machine's other work; CPU time moves less with it than wall time)")
    for name in names:
        print(f"{name:>6}: optimizer step {opt[name][0] * 1000:8.1f} ms wall "
              f"{opt[name][1] * 1000:8.1f} ms CPU"
              f"   training step {train[name][0] * 1000:8.1f} ms wall "
              f"{train[name][1] * 1000:8.1f} ms CPU")
    extra = opt["muon"][0] - opt["adamw"][0]
    print(f"Newton-Schulz: {ns_flops / 1e9:.1f} GFLOP per step ({cli.ns_dtype}), "
          f"{ns_flops / max(extra, 1e-9) / 1e9:.0f} GFLOP/s in Muon's extra optimizer time")
    for i, kind in enumerate(("wall", "CPU")):
        r_opt, r_step = opt["muon"][i] / opt["adamw"][i], train["muon"][i] / train["adamw"][i]
        print(f"ratio muon/adamw ({kind}): optimizer step {r_opt:.1f}x, "
              f"training step {r_step:.3f}x "
              f"({100 * (r_step - 1):+.1f}%)")

if __name__ == "__main__":
    main()
