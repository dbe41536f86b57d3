"""RMSNorm and RoPE on CPU, forward and backward: lingua's hand-written autograd functions
(lingua/model/layers.py) against what torch offers. RMSNorm: torch's own F.rms_norm (the
baseline) and the composite x * rsqrt(mean(x^2) + eps) * w. RoPE: torch has no op; the baseline
is the composite x * cos + rotate_half(x) * sin that HF runs.

    python benchmarks/norm_rope_cpu.py [--shape 8,512,1024] [--heads 16] [--repeats 20]

Each side's outputs and gradients are checked equal to the baseline's before anything is timed;
the sides alternate round by round in one process (machine drift hits all alike); prints each
one's best fwd+bwd time over the rounds and the baseline's time over it, with the CPU model.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpu import cpu_description  # noqa: E402

from lingua.model.layers import _RMSNormFunction, _RopeFunction, _rotate_half  # noqa: E402

EPS = 1e-5


def rms_norm_sides(dim: int) -> dict:
    return {"F.rms_norm": lambda x, w: F.rms_norm(x, (dim,), w, EPS),
            "composite": lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w,
            "lingua": lambda x, w: _RMSNormFunction.apply(x, w, EPS)}


def rope_sides() -> dict:
    return {"composite": lambda x, cos, sin: x * cos + _rotate_half(x) * sin,
            "lingua": lambda x, cos, sin: _RopeFunction.apply(x, cos, sin)}


def fwd_bwd(fn, x, other, grad):
    x.grad = None
    out = fn(x, *other)
    out.backward(grad)
    return out, x.grad


def compare(name: str, sides: dict, x, other, repeats: int) -> dict:
    """{side: best seconds} over `repeats` alternating rounds, after checking every side's output
    and input gradient against the first (the baseline)."""
    grad = torch.randn_like(x)
    base_out, base_grad = fwd_bwd(next(iter(sides.values())), x, other, grad)
    base_out, base_grad = base_out.detach().clone(), base_grad.clone()
    for side, fn in sides.items():
        out, gx = fwd_bwd(fn, x, other, grad)
        torch.testing.assert_close(out, base_out, rtol=1e-5, atol=1e-5, msg=f"{name} {side}")
        torch.testing.assert_close(gx, base_grad, rtol=1e-5, atol=1e-5, msg=f"{name} {side} grad")
    best = {side: float("inf") for side in sides}
    for _ in range(repeats):
        for side, fn in sides.items():
            start = time.perf_counter()
            fwd_bwd(fn, x, other, grad)
            best[side] = min(best[side], time.perf_counter() - start)
    return best


def report(name: str, best: dict) -> None:
    baseline = next(iter(best))
    for side, seconds in best.items():
        print(f"{name} {side:<12} fwd+bwd {seconds * 1e3:8.2f} ms   {baseline}/this "
              f"{best[baseline] / seconds:5.2f}x")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8,512,1024", help="batch,seq,dim")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    b, s, dim = map(int, args.shape.split(","))
    torch.manual_seed(0)
    print(f"CPU: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, fp32, [b, s, dim] = [{b}, {s}, {dim}], {args.heads} heads")
    x = torch.randn(b, s, dim, requires_grad=True)
    weight = torch.randn(dim)
    report("rmsnorm", compare("rmsnorm", rms_norm_sides(dim), x, (weight,), args.repeats))
    head_dim = dim // args.heads
    q = torch.randn(b, s, args.heads, head_dim, requires_grad=True)
    angles = torch.rand(s, head_dim // 2).repeat(1, 2) * 6.3
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    report("rope", compare("rope", rope_sides(), q, (cos, sin), args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
