"""Our trainer and a Hugging Face loop, run at the same time on separate cores: the pieces
benchmarks/llama_cpu.py measures with (and its --profile mode).

Why both at once: these shared machines drift by 30-40% within minutes, so two runs one after
the other compare the machine's moods, not the code. Here each side is a process pinned to its
own core (one torch thread each) and they run side by side, so load from elsewhere hits both
alike; each round swaps the cores, and the caller takes the median of the per-round ratios.

Ours: `python -m apps.llama.train` (a subprocess, the real entry point and loop) on the shape,
with logging.every=1 (a metrics.jsonl row and a log line every step: the most logging the loop
does), no validation and no checkpoint (neither happens inside a training step). Its tokens/s are
read from metrics.jsonl (the steps after the warm-up; `tokens_per_s` is tokens / step_s of each
row) and, as a check that the loop hides nothing outside its timer, from the wall-clock time
between its log lines (which also covers writing the row and the line).

Hugging Face: `python benchmarks/trainer_vs_hf.py hf ...` (a subprocess) doing what the
`transformers.Trainer` defaults do for one training step on this shape:
  * `LlamaForCausalLM` (sdpa attention, which runs grouped-query attention with sdpa's
    enable_gqa, as ours does), the same shape (heads, kv heads, SwiGLU width, rope theta, norm
    eps, untied output), fp32 parameters;
  * loss: the model's own (`labels=`, HF's ForCausalLMLoss: fp32 logits, mean cross-entropy over
    the same seq_len next-token targets as ours, passed as `shift_labels`);
  * backward; `torch.nn.utils.clip_grad_norm_(params, 1.0)` (what Trainer calls, torch's default
    foreach choice); `torch.optim.AdamW(..., fused=True)` (Trainer's default optimizer,
    adamw_torch_fused, on torch >= 2.8) with our hyper-parameters and weight-decay groups
    (matrices decay; norm gains do not); a LambdaLR schedule step; zero_grad(set_to_none=True);
  * bf16: autocast(cpu, bf16) around forward and loss with fp32 weights, gradients and optimizer
    state, which is what our trainer does in one process (lingua.train.build.mixed_precision);
  * data: random byte tokens from a pool made before the loop (ours reads its memory-mapped
    corpus inside the step, and pays for it).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Byte-level LLaMA shapes (vocab 258: 256 bytes + BOS + EOS, the debug preset's tokenizer), SwiGLU
# width from multiple_of=256. Parameters: 4.9M, 9.6M, 50.7M. "10M-vocab32k" is the
# 10M body with a real tokenizer's vocabulary (LLaMA 2's 32000; 34.0M parameters), where the
# output layer and the loss weigh what they do in real runs; both sides still train on byte tokens.
SHAPES = {
    "5M": dict(dim=256, n_layers=6, n_heads=8, n_kv_heads=4),
    "10M": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=2),
    "50M": dict(dim=768, n_layers=8, n_heads=12, n_kv_heads=4),
    "10M-vocab32k": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=2, vocab_size=32000),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2),   # tests/test_benchmarks.py
}
VOCAB, MULTIPLE_OF, ROPE_THETA, NORM_EPS = 258, 256, 10000.0, 1e-5
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0

_STEP_LINE = re.compile(r"train: step (\d+)\b")


def vocab_size(shape: dict) -> int:
    return shape.get("vocab_size", VOCAB)


def n_params(shape: dict) -> int:
    from lingua.model.layers import ffn_hidden_dim

    d, layers = shape["dim"], shape["n_layers"]
    kv_dim = d // shape["n_heads"] * shape["n_kv_heads"]
    per_layer = 2 * d * d + 2 * d * kv_dim + 3 * d * ffn_hidden_dim(d, MULTIPLE_OF) + 2 * d
    return layers * per_layer + 2 * vocab_size(shape) * d + d


# ---------------------------------------------------------------------------------------------
# Our side: the trainer's command line


def trainer_command(shape: dict, dtype: str, batch: int, seq_len: int, steps: int, dump_dir,
                    compile: bool = False, extra=()) -> list:
    model = [f"model.{k}={v}" for k, v in {"vocab_size": VOCAB, **shape}.items()]
    return [sys.executable, "-m", "apps.llama.train", f"dump_dir={dump_dir}", f"steps={steps}",
            *model, f"model.multiple_of={MULTIPLE_OF}",
            f"model.max_seq_len={max(seq_len, 1024)}", f"data.seq_len={seq_len}",
            f"data.batch_size={batch}", f"distributed.model_dtype={dtype}",
            f"distributed.compile={str(compile).lower()}", f"optim.lr={LR}",
            "logging.every=1", "eval.every=0", "eval.at_end=false", "checkpoint.every=0",
            "checkpoint.save_final=false", *extra]


def pinned_env() -> dict:
    """One torch thread, unbuffered output (we time the trainer's log lines as they come)."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                WANDB_MODE="offline", PYTHONPATH=str(REPO))


# Set for the HF process by `--hf-malloc-like-ours`: HF's loop tunes glibc's malloc as our
# trainer does on CPU (lingua.launch.host_memory.keep_freed_memory), to show what that setting
# alone is
# worth.
HF_MALLOC_VAR = "BENCH_HF_KEEP_FREED_MEMORY"


def hf_malloc_like_ours() -> None:
    """In the HF process: our trainer's malloc tuning, when the benchmark asked for it."""
    if os.environ.get(HF_MALLOC_VAR) == "1":
        from lingua.launch.host_memory import keep_freed_memory

        if not keep_freed_memory():
            sys.exit("--hf-malloc-like-ours: this C library has no mallopt, or malloc's knobs are "
                     "set (MALLOC_*_ variables, glibc.malloc tunables in GLIBC_TUNABLES); unset "
                     "them or drop the option.")


def pinned(core: int):
    """preexec_fn: the child runs on `core` alone."""
    return lambda: os.sched_setaffinity(0, {core})


# ---------------------------------------------------------------------------------------------
# The Hugging Face side (runs in its own process: `python benchmarks/trainer_vs_hf.py hf ...`)


def hf_model(shape: dict, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lingua.model.layers import ffn_hidden_dim

    cfg = LlamaConfig(hidden_size=shape["dim"], num_hidden_layers=shape["n_layers"],
                      num_attention_heads=shape["n_heads"], num_key_value_heads=shape["n_kv_heads"],
                      intermediate_size=ffn_hidden_dim(shape["dim"], MULTIPLE_OF),
                      vocab_size=vocab_size(shape), max_position_embeddings=max(seq_len, 1024),
                      rope_theta=ROPE_THETA, rms_norm_eps=NORM_EPS, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def hf_optimizer(model, lr: float, betas, eps: float, weight_decay: float, warmup: int):
    """What `transformers.Trainer` builds by default for the HF side of every benchmark here:
    fused AdamW (adamw_torch_fused) with weight decay on matrices only, and a linear warm-up
    LambdaLR. Shared with benchmarks/moe_trainer_vs_hf.py and benchmarks/gpu_vs_hf.py."""
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))


def hf_loop(shape: dict, dtype: str, batch: int, seq_len: int, steps: int, profile_steps: int = 0,
            warmup: int = 3, out=sys.stdout) -> None:
    """Train HF's model `steps` steps; print one JSON line per step with its end time
    (time.monotonic, comparable across processes). With profile_steps, torch.profiler records
    that many steps after `warmup` (+1 of profiler warm-up) and the table is printed."""
    import torch

    hf_malloc_like_ours()
    torch.manual_seed(0)
    model = hf_model(shape, seq_len)
    opt, sched = hf_optimizer(model, LR, BETAS, EPS, WEIGHT_DECAY, warmup=20)
    pool = torch.randint(0, VOCAB, (8, batch, seq_len + 1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    prof = None
    if profile_steps:
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=torch.profiler.schedule(wait=warmup, warmup=1, active=profile_steps, repeat=1))
        prof.start()
    record = torch.profiler.record_function
    for i in range(steps):
        tokens = pool[i % len(pool)]
        inputs, targets = tokens[:, :-1], tokens[:, 1:].contiguous()
        with record("forward"), autocast:
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets).loss
        with record("backward"):
            loss.backward()
        with record("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        print(json.dumps({"hf_step": i + 1, "end": time.monotonic(), "cpu": time.process_time(),
                          "loss": loss.item()}),
              file=out, flush=True)
        if prof is not None:
            prof.step()
            if i + 1 == warmup + 1 + profile_steps:
                prof.stop()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40),
                      file=out, flush=True)
                return


def hf_command(shape_name: str, dtype: str, batch: int, seq_len: int, steps: int,
               profile_steps: int = 0) -> list:
    return [sys.executable, str(Path(__file__).resolve()), "hf", "--shape", shape_name,
            "--dtype", dtype, "--batch", str(batch), "--seq-len", str(seq_len),
            "--steps", str(steps), "--profile-steps", str(profile_steps)]


# ---------------------------------------------------------------------------------------------
# Both at once


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process (all threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_first_step(proc, path: Path, timeout: float = 600.0) -> None:
    """Until the HF side has trained a step (its start-up is slower than ours): from then on it
    is training whenever ours is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if '{"hf_step"' in text:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the HF side failed (exit {proc.returncode}):\n{text[-3000:]}")
        time.sleep(0.2)
    raise RuntimeError(f"the HF side did no step in {timeout:.0f} s")


def follow_trainer(ours: subprocess.Popen, stamp, lines: list = None) -> dict:
    """{step: stamp()} taken as each of the trainer's step lines arrives (stdout, line-buffered);
    raises with its last lines if it fails. `lines`, if given, receives every line. Shared with
    benchmarks/moe_trainer_vs_hf.py and benchmarks/gpu_vs_hf.py."""
    arrivals, tail = {}, []
    for line in ours.stdout:
        match = _STEP_LINE.search(line)
        if match:
            arrivals[int(match.group(1))] = stamp()
        tail = (tail + [line])[-30:]
        if lines is not None:
            lines.append(line)
    if ours.wait() != 0:
        raise RuntimeError(f"the trainer failed (exit {ours.returncode}):\n{''.join(tail)}")
    return arrivals


def run_pair(shape_name: str, dtype: str, batch: int, seq_len: int, warmup: int, measured: int,
             core_ours: int, core_hf: int, compile: bool = False, workdir=None,
             trainer_extra=()) -> dict:
    """One round: the trainer and the HF loop at the same time, each on its own core. Returns
    tokens/s of ours (from metrics.jsonl and from wall-clock), of HF over the same wall-clock
    window, and the step counts each had in it."""
    shape = SHAPES[shape_name]
    workdir = Path(workdir or tempfile.mkdtemp(prefix="trainer_vs_hf_"))
    mode = "compile" if compile else "eager"
    dump_dir = workdir / f"ours_{shape_name}_{dtype}_{mode}_{core_ours}"
    steps = warmup + measured
    hf_path = workdir / f"hf_{shape_name}_{dtype}_{core_hf}.jsonl"
    hf_path.unlink(missing_ok=True)
    hf_log = open(hf_path, "a")   # the child's own appends; we read the file by its path
    # HF starts first and runs until we stop it; ours starts once HF has done a step (importing
    # transformers takes seconds), and HF's steps inside our measured window are the ones compared.
    hf = subprocess.Popen(hf_command(shape_name, dtype, batch, seq_len, 100_000), cwd=REPO,
                          env=pinned_env(), preexec_fn=pinned(core_hf), stdout=hf_log,
                          stderr=subprocess.STDOUT)
    try:
        wait_for_first_step(hf, hf_path)
        ours = subprocess.Popen(trainer_command(shape, dtype, batch, seq_len, steps, dump_dir,
                                                compile, trainer_extra),
                                cwd=REPO, env=pinned_env(), preexec_fn=pinned(core_ours),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        arrivals = follow_trainer(ours, lambda: (time.monotonic(), cpu_seconds(ours.pid)))
    finally:
        hf.terminate()
        hf.wait()
    hf_log.close()
    hf_rows = [json.loads(line) for line in hf_path.read_text().splitlines()
               if line.startswith('{"hf_step"')]
    rows = [json.loads(line) for line in open(dump_dir / "metrics.jsonl")]
    timed = [r for r in rows if r["step"] > warmup]
    tokens = batch * seq_len
    (t_start, cpu_start), (t_end, cpu_end) = arrivals[warmup], arrivals[steps]
    # HF's steps over the same window (up to its last whole step: we stopped it mid-step),
    # each step counted by the fraction of it inside.
    hf_end = min(t_end, hf_rows[-1]["end"]) if hf_rows else t_start
    if hf_end - t_start < 0.5 * (t_end - t_start):
        raise RuntimeError("the HF side did not run through our measured window")
    share = [(max(0.0, min(b["end"], hf_end) - max(a["end"], t_start)) / (b["end"] - a["end"]),
              a, b)
             for a, b in zip(hf_rows, hf_rows[1:])]
    hf_steps = sum(f for f, _, _ in share)
    return {
        "ours": tokens * len(timed) / sum(r["step_s"] for r in timed),
        "ours_wall": tokens * measured / (t_end - t_start),
        "hf": tokens * hf_steps / (hf_end - t_start),
        # Per CPU-second of each process (all its threads): what the code costs, whatever
        # share of its core the machine's other work left it.
        "ours_cpu": tokens * measured / (cpu_end - cpu_start),
        "hf_cpu": tokens * hf_steps / sum(f * (b["cpu"] - a["cpu"]) for f, a, b in share),
        "ours_steps": len(timed), "hf_steps": hf_steps, "ours_core": core_ours,
        "hf_core": core_hf, "window_s": t_end - t_start,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description="the Hugging Face side of the benchmark")
    parser.add_argument("side", choices=["hf"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="10M")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=0)
    cli = parser.parse_args(argv)
    hf_loop(SHAPES[cli.shape], cli.dtype, cli.batch, cli.seq_len, cli.steps, cli.profile_steps)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
