"""MFU of the trainer on CUDA: FSDP2 + torch.compile + bf16, against the GPU's measured matmul peak.

    python benchmarks/llama_gpu.py [--gpus N] [--steps 30] [--preset llama_1b]
        [--float8 tensorwise|rowwise] [extra overrides ...]

The 8B-wide headline shape: `--preset llama_8b model.n_layers=8 data.batch_size=2
data.seq_len=4096 distributed.ac=none`. With --float8 the same run follows in float8 and the two
are printed side by side (tokens/s ratio, largest loss gap); MFU is over the bf16 peak for both.

Trains the preset's model shape on the embedded corpus (bytes, so no tokenizer
file is needed: the vocabulary is resized to the byte tokenizer's) for a few steps with torchrun,
then prints tokens/s and MFU from metrics.jsonl (steps after the first few, to skip compilation),
against both the data-sheet peak the trainer uses and a bf16 matmul peak measured here.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def measured_matmul_peak(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * iters / (start.elapsed_time(end) / 1000)


def train(cli, extra: list, float8: str) -> tuple:
    """(tokens/s, MFU of the data-sheet bf16 peak) of one torchrun training of the preset."""
    dump = Path(tempfile.mkdtemp(prefix=f"lingua_gpu_bench_{float8}_"))
    overrides = [f"config={cli.preset}", f"dump_dir={dump}", f"steps={cli.steps}",
                 f"data.root={REPO / 'data' / 'embedded'}", "data.format=memmap",
                 "data.prepare_embedded=true", "data.tokenizer.kind=bytes",
                 "data.tokenizer.path=null", "model.vocab_size=258", "model.tie_embeddings=false",
                 "distributed.compile=true", "distributed.model_dtype=bf16", "checkpoint.every=0",
                 "checkpoint.save_final=false", f"distributed.float8={float8}",
                 "eval.at_end=false", "logging.every=1", "optim.warmup=5", *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cli.gpus}",
           "-m", "apps.llama.train", *overrides]
    print(" ".join(cmd))
    subprocess.run(cmd, cwd=REPO, check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steady = rows[min(10, len(rows) // 2):]
    tps = sum(r["tokens_per_s"] for r in steady) / len(steady)
    mfus = [r["mfu"] for r in steady if r["mfu"] is not None]  # null: no credible peak
    if not mfus:
        sys.exit("metrics.jsonl has mfu null on every steady step (the run's log says why).")
    return tps, sum(mfus) / len(mfus), [r["loss"] for r in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--preset", default="llama_1b")
    parser.add_argument("--float8", choices=["none", "tensorwise", "rowwise"], default="none",
                        help="also train with distributed.float8=RECIPE, after the bf16 run")
    cli, extra = parser.parse_known_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/llama_gpu.py needs CUDA; see benchmarks/llama_cpu.py for the CPU one.")
    recipes = ["none"] + ([cli.float8] if cli.float8 != "none" else [])
    runs = {recipe: train(cli, extra, recipe) for recipe in recipes}
    measured = measured_matmul_peak()
    for recipe, (tps, mfu, _) in runs.items():
        mfu_measured = mfu * _datasheet_peak() / measured
        print(f"{torch.cuda.get_device_name()} x {cli.gpus}, "
              f"{'bf16' if recipe == 'none' else 'float8 ' + recipe}: {tps:.0f} tokens/s; "
              f"MFU {100 * mfu:.1f}% of the data-sheet bf16 peak, "
              f"{100 * mfu_measured:.1f}% of the bf16 matmul peak measured "
              f"here ({measured / 1e12:.0f} TFLOP/s per GPU)")
    if len(runs) == 2:
        (base, _, base_loss), (fast, _, fast_loss) = runs["none"], runs[cli.float8]
        gap = max(abs(a - b) / b for a, b in zip(fast_loss, base_loss))
        print(f"float8 {cli.float8} / bf16: {fast / base:.3f}x tokens/s; largest relative loss "
              f"gap over {len(base_loss)} steps {gap:.4f}")


def _datasheet_peak() -> float:
    from lingua.observe.metrics import peak_flops

    return peak_flops(torch.device("cuda", 0), "bf16")


if __name__ == "__main__":
    main()
