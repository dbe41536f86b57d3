"""Grouped-GEMM experts (torch._grouped_mm) vs the per-expert Python loop, on one MoE layer.

    python benchmarks/moe_cpu.py [--tokens 4096] [--dim 256] [--hidden 512] [--experts 8]
                                 [--top_k 2] [--steps 9] [--warmup 2] [--threads N]
    python benchmarks/moe_cpu.py --experts 64 --top_k 8 --hidden 128 --threads 1   # fine-grained

Both sides run the same MoE layer (same weights, 8 experts, top-2, softmax router) forward and
backward on the same tokens; only `experts.impl` differs. fp32: fp32 weights and inputs; bf16:
autocast to bf16 with fp32 weights, as the trainer runs it. Prints the median seconds per
forward+backward of each, the ratio loop / grouped (> 1: grouped is faster) and the expert
matmuls' GFLOP/s, with the CPU model and flags. The two alternate step by step in one process, so
drift in the machine's load hits both alike.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama_cpu import cpu_description  # noqa: E402

from lingua.model.moe import MoE  # noqa: E402


def time_layers(layers: dict, x: torch.Tensor, dtype: str, steps: int, warmup: int) -> dict:
    """Median seconds per forward+backward of each layer; the layers alternate within each round so
    that load from other processes on the machine hits both sides alike."""
    times = {name: [] for name in layers}
    for i in range(warmup + steps):
        for name, moe in layers.items():
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                y = moe(x)
            y.float().square().mean().backward()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
            moe.zero_grad(set_to_none=True)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"CPU: {cpu_description()}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"MoE layer: {a.tokens} tokens, dim {a.dim}, hidden {a.hidden}, {a.experts} experts, "
          f"top-{a.top_k}; forward+backward")
    # 3 matmuls of dim x hidden per assignment, x2 FLOPs per MAC, x3 for forward + backward.
    expert_flops = 3 * 2 * 3 * a.tokens * a.top_k * a.dim * a.hidden
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        x = torch.randn(a.tokens, a.dim, requires_grad=True)
        layers = {}
        for impl in ("loop", "grouped"):
            torch.manual_seed(0)
            layers[impl] = MoE(a.dim, a.hidden, a.experts, a.top_k, expert_impl=impl)
            with torch.no_grad():
                for w in layers[impl].parameters():
                    w.normal_(std=0.02)
        seconds = time_layers(layers, x, dtype, a.steps, a.warmup)
        for impl, s in seconds.items():
            print(f"{dtype} {impl:8s} {s * 1e3:8.1f} ms/iter  "
                  f"experts {expert_flops / s / 1e9:6.1f} GFLOP/s")
        print(f"{dtype} ratio loop/grouped = {seconds['loop'] / seconds['grouped']:.2f}x")


if __name__ == "__main__":
    main()
