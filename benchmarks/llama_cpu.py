"""Our LLaMA trainer (`python -m apps.llama.train`) vs a Hugging Face training loop, on CPU, with
both sides running at the same time on separate cores.

    python benchmarks/llama_cpu.py [--shapes 5M,10M,50M] [--dtypes fp32,bf16] [--rounds 3]
                                   [--warmup 3] [--steps 8] [--compile] [--batch 4] [--seq-len 512]
                                   [--hf-malloc-like-ours]
    python benchmarks/llama_cpu.py --profile [--shapes 10M] [--dtypes fp32]

Each round runs the trainer (the real entry point and loop, in a subprocess) and the HF loop (in
another) side by side, each pinned to its own core with one torch thread, and swaps the cores the
next round; a round's ratio is ours / HF tokens/s over the same wall-clock window. Prints, per
shape and dtype, each round's figures and the median of the per-round ratios, with the CPU
model and flags. Figures from back-to-back runs are not evidence on a shared machine (they drift
by 30-40% within minutes); side by side, drift hits both alike. What each side does, step by
step, is written in benchmarks/trainer_vs_hf.py.

Each round also gives the ratio per CPU-second (user + system time of each process, all its
threads): where other work on the machine takes turns on our two cores, wall-clock tokens/s of
one side can drop by half while it waits, but its CPU time per step moves far less; on an idle
machine the two ratios agree.

Our trainer tunes glibc's malloc on CPU (lingua.launch.host_memory.keep_freed_memory: freed
blocks are
kept for reuse, not unmapped and faulted in again); HF's process runs with glibc's default, what
an HF user gets, unless `--hf-malloc-like-ours` gives it the same setting (what the setting
alone is worth).

`--compile` runs ours with distributed.compile=true (inductor compiles each block once; the
warm-up steps absorb the compilation). `--profile` runs both sides once under torch.profiler
(ours through profiling.enabled=true, the trainer's own window) and prints their top operators
side by side, in ms per step.

bf16 is autocast compute with fp32 weights and optimizer state on both sides; it is refused where
the CPU has no bf16 instructions (emulated bf16 is 30-100x slower and measures the emulation).
"""

import argparse
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trainer_vs_hf as pair  # noqa: E402

# The ~36M-parameter shape benchmarks/muon_cost.py and checkpoint_async.py train in-process:
# 8 layers of width 512, 8k vocabulary (untied), SwiGLU hidden 1536.
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
    present = " ".join(f for f in wanted if f in flags) or "none of " + ", ".join(wanted)
    return f"{model}; flags: {present}"


def median(values: list) -> float:
    """statistics.median: with an even number of rounds, the mean of the middle two (taking
    the upper one would make a 2-round run report its better round)."""
    return statistics.median(values)


def two_cores() -> tuple:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        sys.exit(f"{Path(sys.argv[0]).name} runs both sides at once, one core each: it needs "
                 f"two cores, and this process may use {len(cores)}.")
    return cores[0], cores[1]


def bench(shape: str, dtype: str, cli, cores, workdir) -> tuple:
    """Rounds of ours vs HF side by side; prints each round and returns the medians of the
    per-round ratios: (tokens/s, tokens per CPU-second)."""
    ratios, cpu_ratios = [], []
    for r in range(cli.rounds):
        core_ours, core_hf = cores if r % 2 == 0 else cores[::-1]
        res = pair.run_pair(shape, dtype, cli.batch, cli.seq_len, cli.warmup, cli.steps,
                            core_ours, core_hf, cli.compile, workdir)
        ratios.append(res["ours"] / res["hf"])
        cpu_ratios.append(res["ours_cpu"] / res["hf_cpu"])
        print(f"  round {r + 1}: ours {res['ours']:7.0f} tokens/s "
              f"(wall-clock {res['ours_wall']:7.0f}"
              f", {res['ours_steps']} steps, core {core_ours})  HF {res['hf']:7.0f} tokens/s "
              f"({res['hf_steps']:.1f} steps, core {core_hf})  ratio {ratios[-1]:.3f} (wall-clock "
              f"{res['ours_wall'] / res['hf']:.3f}; per CPU-second {cpu_ratios[-1]:.3f})",
              flush=True)
    result = median(ratios), median(cpu_ratios)
    print(f"{shape} ({pair.n_params(pair.SHAPES[shape]) / 1e6:.1f}M params) {dtype} "
          f"{'compiled' if cli.compile else 'eager'}: ours / HF tokens/s = {result[0]:.3f} "
          f"(median of {cli.rounds}: {', '.join(f'{x:.3f}' for x in ratios)}); per CPU-second "
          f"{result[1]:.3f}", flush=True)
    return result


def _parse_table(text: str) -> dict:
    """{operator: self CPU ms total} from a torch.profiler key_averages() table."""
    units = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    ops = {}
    for line in text.splitlines():
        m = re.match(r"^\s*(\S.*?)\s+[\d.]+%\s+([\d.]+)(us|ms|s)\s+[\d.]+%\s+[\d.]+(?:us|ms|s)\s+"
                     r"[\d.]+(?:us|ms|s)\s+(\d+)\s*$", line)
        if m:
            ops[m.group(1)] = float(m.group(2)) * units[m.group(3)]
    return ops


def profile(shape: str, dtype: str, cli, cores, workdir) -> None:
    """Both sides under torch.profiler at the same time; top operators side by side."""
    import subprocess

    active, warmup = 3, 3
    core_ours, core_hf = cores
    hf_out = Path(workdir) / f"hf_profile_{shape}_{dtype}.txt"
    with open(hf_out, "w") as out:
        hf = subprocess.Popen(pair.hf_command(shape, dtype, cli.batch, cli.seq_len, 100, active),
                              cwd=pair.REPO, env=pair.pinned_env(), preexec_fn=pair.pinned(core_hf),
                              stdout=out, stderr=subprocess.STDOUT)
        dump = Path(workdir) / f"ours_profile_{shape}_{dtype}"
        cmd = pair.trainer_command(pair.SHAPES[shape], dtype, cli.batch, cli.seq_len,
                                   warmup + 1 + active, dump, cli.compile,
                                   ["profiling.enabled=true", f"profiling.start_step={warmup}",
                                    "profiling.wait=0", "profiling.warmup=1",
                                    f"profiling.active={active}", "profiling.memory=false",
                                    "profiling.record_shapes=false", "profiling.top_ops=40"])
        subprocess.run(cmd, cwd=pair.REPO, env=pair.pinned_env(), preexec_fn=pair.pinned(core_ours),
                       check=True, stdout=subprocess.DEVNULL)
        hf.wait()
    ours = _parse_table((dump / "profiling" / "summary_rank0.txt").read_text())
    theirs = _parse_table(hf_out.read_text())
    print(f"\n{shape} {dtype}: self CPU time, ms per step (mean of {active} profiled steps)")
    print(f"{'operator':<58} {'ours':>9} {'HF':>9}")
    names = sorted(set(ours) | set(theirs), key=lambda n: -max(ours.get(n, 0), theirs.get(n, 0)))
    cell = lambda d, name: f"{d[name] / active:9.1f}" if name in d else f"{'-':>9}"  # noqa: E731
    for name in names[:30]:
        print(f"{name[:58]:<58} {cell(ours, name)} {cell(theirs, name)}")
    total = lambda d: sum(v for k, v in d.items() if k.startswith("aten::"))  # noqa: E731
    print(f"{'sum of aten:: operators listed':<58} {total(ours) / active:9.1f} "
          f"{total(theirs) / active:9.1f}")


def dtypes_for_this_cpu(asked) -> tuple:
    """(--dtypes as a list, whether bf16 is emulated here): by default fp32, and bf16 too where the
    CPU has bf16 instructions; exits when bf16 is asked for where it is emulated (30-100x slower
    than fp32: it would measure the emulation)."""
    from lingua.observe import metrics

    emulated = metrics.cpu_bf16_emulated()
    dtypes = (asked or ("fp32" if emulated else "fp32,bf16")).split(",")
    if emulated and "bf16" in dtypes:
        sys.exit("this CPU has no bf16 instructions (no avx512_bf16 / amx_bf16): bf16 is emulated "
                 "there, 30-100x slower than fp32, and would measure the emulation. "
                 "Use --dtypes fp32.")
    return dtypes, emulated


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="5M,10M,50M", help=f"of {', '.join(pair.SHAPES)}")
    parser.add_argument("--dtypes", default=None,
                        help="default: fp32,bf16 where this CPU has bf16 instructions, else fp32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="trainer steps left out")
    parser.add_argument("--steps", type=int, default=8, help="trainer steps measured")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--compile", action="store_true", help="ours with distributed.compile=true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--hf-malloc-like-ours", action="store_true",
                        help="HF's process tunes malloc as our trainer does on CPU")
    parser.add_argument("--workdir", default=None)
    cli = parser.parse_args(argv)

    dtypes, emulated = dtypes_for_this_cpu(cli.dtypes)
    shapes = cli.shapes.split(",")
    for name in shapes:
        if name not in pair.SHAPES:
            sys.exit(f"--shapes: unknown shape {name!r}; use some of {', '.join(pair.SHAPES)}.")
    if cli.hf_malloc_like_ours:
        os.environ[pair.HF_MALLOC_VAR] = "1"   # read by the HF process only
    cores = two_cores()
    import torch
    import transformers

    print(f"CPU: {cpu_description()} (bf16 {'emulated' if emulated else 'native'})")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"batch {cli.batch} x {cli.seq_len} tokens, one thread per side, "
          f"cores {cores[0]} and {cores[1]}, swapped each round; "
          f"ours {'compiled' if cli.compile else 'eager'}; HF's malloc "
          f"{'tuned like ours' if cli.hf_malloc_like_ours else 'glibc default'}", flush=True)
    workdir = cli.workdir or tempfile.mkdtemp(prefix="llama_cpu_")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    summary = []
    for shape in shapes:
        for dtype in dtypes:
            if cli.profile:
                profile(shape, dtype, cli, cores, workdir)
                continue
            print(f"{shape} {dtype}:", flush=True)
            summary.append((shape, dtype, bench(shape, dtype, cli, cores, workdir)))
    for shape, dtype, (ratio, cpu_ratio) in summary:
        print(f"ratio ours/hf tokens/s: {shape} {dtype} {ratio:.3f} "
              f"(per CPU-second {cpu_ratio:.3f})")


if __name__ == "__main__":
    main()
