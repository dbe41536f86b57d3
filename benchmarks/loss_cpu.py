"""The training loss alone on CPU: next-token cross-entropy of [tokens, vocab] logits, forward and
backward, eager F.cross_entropy (what HF's loss and our eager trainer run) vs the same compiled by
torch.compile vs lingua's compiled loss (token_loss_sum under torch.compile: the written-out
cross-entropy of lingua.parallel.tensor_parallel).

    python benchmarks/loss_cpu.py [--tokens 2048] [--vocab 32000] [--dtypes fp32,bf16] [--repeats 7]

One torch thread; the three alternate call by call in one process (machine drift hits all alike);
prints each one's median forward and backward time and the ratio of the baselines' forward +
backward over lingua's, with the CPU model and flags. The logits are fresh each call, as a
training step's are (their gradient is a new buffer each time too), and malloc is tuned as the
trainer tunes it on CPU (lingua.launch.host_memory.keep_freed_memory), so that those buffers are
reused,
not faulted in afresh each call (`--glibc-default-malloc` to time with the faults).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpu import cpu_description, dtypes_for_this_cpu  # noqa: E402

from lingua.launch.host_memory import keep_freed_memory  # noqa: E402
from lingua.model.loss import token_loss_sum  # noqa: E402


def f_cross_entropy(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def timed(fn, logits, labels):
    x = logits.clone().requires_grad_()
    start = time.perf_counter()
    loss = fn(x, labels)
    middle = time.perf_counter()
    loss.backward()
    return middle - start, time.perf_counter() - middle, loss.detach(), x.grad


def bench(tokens: int, vocab: int, dtype: torch.dtype, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, vocab, generator=gen).to(dtype)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    sides = {"eager F.cross_entropy": f_cross_entropy,
             "compiled F.cross_entropy": torch.compile(f_cross_entropy),
             "lingua compiled (token_loss_sum)": torch.compile(token_loss_sum)}
    for fn in sides.values():   # compile, warm up
        for _ in range(2):
            timed(fn, logits, labels)
    _, _, want_loss, want_grad = timed(sides["eager F.cross_entropy"], logits, labels)
    _, _, loss, grad = timed(sides["lingua compiled (token_loss_sum)"], logits, labels)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=1e-2, atol=1e-5)
    times = {name: ([], []) for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            fwd, bwd, _, _ = timed(fn, logits, labels)
            times[name][0].append(fwd)
            times[name][1].append(bwd)
    return {name: (statistics.median(f), statistics.median(b)) for name, (f, b) in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtypes", default=None,
                        help="default: fp32,bf16 where this CPU has bf16 instructions, else fp32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--glibc-default-malloc", action="store_true",
                        help="leave malloc as glibc sets it (the trainer tunes it on CPU)")
    cli = parser.parse_args(argv)
    dtypes, _ = dtypes_for_this_cpu(cli.dtypes)
    torch.set_num_threads(1)
    tuned = not cli.glibc_default_malloc and keep_freed_memory()
    print(f"CPU: {cpu_description()}; torch {torch.__version__}; one thread; logits "
          f"[{cli.tokens}, {cli.vocab}]; median of {cli.repeats}, the three alternating; malloc "
          f"{'tuned as the trainer tunes it' if tuned else 'glibc default'}")
    for name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        result = bench(cli.tokens, cli.vocab, dtype, cli.repeats)
        ours = sum(result["lingua compiled (token_loss_sum)"])
        for side, (fwd, bwd) in result.items():
            print(f"{name} {side:<34} forward {fwd * 1e3:7.1f} ms  backward {bwd * 1e3:7.1f} ms  "
                  f"(fwd+bwd) / lingua's {(fwd + bwd) / ours:.2f}x")


if __name__ == "__main__":
    main()
