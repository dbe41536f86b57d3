"""Our MoE trainer (`python -m apps.moe.train`) vs Hugging Face's MixtralForCausalLM, on CPU, with
both sides training at the same time on separate cores.

    python benchmarks/moe_trainer_vs_hf.py [--shapes issue,fine] [--dtypes fp32,bf16] [--rounds 3]
                                           [--hf-experts grouped_mm,eager] [--windows 1]
                                           [--batch 4] [--seq-len 512] [--compile]
                                           [--hf-malloc-like-ours]

Per shape: the trainer trains one step and saves a checkpoint, and apps.moe.hf's export (the
function behind `python -m apps.moe.hf export`) turns it into a Mixtral directory: the HF side
trains exactly our model (the same weights, the same shape: no shared expert, no dense layer,
softmax top-k with renormalised weights, which is Mixtral's router). Then each round runs, side
by side and each pinned to its own core with one torch thread (the cores swap every round):

  ours  `python -m apps.moe.train` on the shape (a subprocess: the real entry point and loop) with
        the app's default logging, eager (`--compile`: distributed.compile=true, blocks and
        loss); its tokens/s are read from metrics.jsonl, over the rows after the first (the
        first logging window holds the warm-up steps).
  HF    `python benchmarks/moe_trainer_vs_hf.py hf ...` (a subprocess) loading the exported
        directory with `MixtralForCausalLM.from_pretrained` and training it step after step until
        stopped; its tokens/s are over its steps whose midpoints fall inside our measured
        window (between our log lines that open and close it).

Our trainer tunes glibc's malloc on CPU (lingua.launch.host_memory.keep_freed_memory: freed
blocks are
kept for reuse, not unmapped and faulted in again); HF's process runs with glibc's default, what
an HF user gets, unless `--hf-malloc-like-ours` gives it the same setting (what the setting
alone is worth).

A round's ratio is ours / HF; the script prints each round and the median of the per-round
ratios per shape, dtype and HF experts implementation, with the CPU model and flags. Figures from
back-to-back runs are not evidence on these shared machines (they drift by 30-40% within
minutes); side by side, drift hits both alike.

The same work per step on both sides: batch x seq_len next-token cross-entropy (mean over the
tokens, logits in fp32), no load-balancing or z-loss (aux_loss_coef=0, z_loss_coef=0 for us,
router_aux_loss_coef=0 and no router logits for HF), backward, the global gradient norm clipped
to 1.0, fused AdamW (weight decay 0.1 on matrices, none on norm gains) and a learning-rate
schedule step, gradients set to None; no KV cache (use_cache=False). bf16 is autocast with fp32
weights and optimizer state on both sides (our trainer in one process does exactly that);
refused where the CPU has no bf16 instructions (emulated bf16 measures the emulation).

HF experts implementations (transformers >= 5 chooses per model, `experts_implementation=`):
  grouped_mm  the default where torch has `_grouped_mm` (torch >= 2.9 on CPU): tokens sorted by
              expert, one `torch._grouped_mm` for gate and up projections together and one for
              the down projection. Under autocast it casts the tokens to the weights' dtype, so
              HF's experts run in fp32 even in "bf16" (HF's behaviour, not ours: ours cast the
              weights to bf16).
  eager       the original Mixtral code: a Python loop over the experts that received tokens
              (one_hot mask, torch.where, two F.linear per expert, index_add_), which is what
              transformers < 5 always ran.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from llama_cpu import cpu_description, dtypes_for_this_cpu, median, two_cores  # noqa: E402
from trainer_vs_hf import (  # noqa: E402  (the LLaMA twin's helpers, shared)
    HF_MALLOC_VAR,
    follow_trainer,
    hf_malloc_like_ours,
    hf_optimizer,
    pinned,
    pinned_env,
    wait_for_first_step,
)

# Byte-level (vocab 258, the debug preset's tokenizer) Mixtral-exportable MoE shapes.
#   issue: 8 experts top-2 of hidden 768 (30.9M parameters).
#   fine:  the same width and the same active expert FLOPs per token, split into 64 experts top-8
#          of hidden 192 (fine-grained, DeepSeek-style without the shared expert; 59.3M).
#   issue-vocab32k: "issue" with a 32000-token vocabulary (LLaMA 2's; 55.3M), where the
#          output layer and the loss weigh what they do in real runs; still trained on byte tokens.
#   tiny:  for the smoke test.
SHAPES = {
    "issue": dict(dim=384, n_layers=4, n_heads=6, n_kv_heads=6, n_experts=8, top_k=2,
                  expert_hidden_dim=768),
    "fine": dict(dim=384, n_layers=4, n_heads=6, n_kv_heads=6, n_experts=64, top_k=8,
                 expert_hidden_dim=192),
    "issue-vocab32k": dict(dim=384, n_layers=4, n_heads=6, n_kv_heads=6, n_experts=8, top_k=2,
                           expert_hidden_dim=768, vocab_size=32000),
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, n_experts=8, top_k=2,
                 expert_hidden_dim=64),
}
# What makes the model Mixtral: apps/moe/hf.py exports these exactly as MixtralForCausalLM.
MIXTRAL = dict(n_shared_experts=0, n_dense_layers=0, score_func="softmax", norm_topk="true",
               route_scale=1.0, aux_loss_coef=0, z_loss_coef=0, bias_update_rate=0,
               capacity_factor=0)
VOCAB = 258
LR, BETAS, EPS, WEIGHT_DECAY, CLIP, WARMUP = 3e-3, (0.9, 0.95), 1e-8, 0.1, 1.0, 20



# ---------------------------------------------------------------------------------------------
# Our side: the trainer's command line


def trainer_command(shape: dict, dtype: str, batch: int, seq_len: int, steps: int, dump_dir,
                    extra=(), compile: bool = False) -> list:
    model = [f"model.{k}={v}" for k, v in {"vocab_size": VOCAB, **shape, **MIXTRAL}.items()]
    return [sys.executable, "-m", "apps.moe.train", f"dump_dir={dump_dir}", f"steps={steps}",
            *model, f"model.max_seq_len={max(seq_len, 1024)}",
            f"data.seq_len={seq_len}", f"data.batch_size={batch}", "data.grad_accum=1",
            f"distributed.model_dtype={dtype}", f"distributed.compile={str(compile).lower()}",
            f"optim.lr={LR}", f"optim.beta1={BETAS[0]}", f"optim.beta2={BETAS[1]}",
            f"optim.eps={EPS}", f"optim.weight_decay={WEIGHT_DECAY}", f"optim.clip={CLIP}",
            f"optim.warmup={WARMUP}", "eval.every=0", "eval.at_end=false", "checkpoint.every=0",
            "probe.every=0", *extra]


def run(cmd: list, what: str, core=None, **kwargs) -> str:
    out = subprocess.run(cmd, cwd=REPO, env=pinned_env(), capture_output=True, text=True,
                         preexec_fn=None if core is None else pinned(core), **kwargs)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {out.returncode}): {' '.join(cmd)}\n"
                           f"{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout


def export_shape(name: str, batch: int, seq_len: int, workdir: Path, core: int, extra=()) -> Path:
    """One training step and its checkpoint, exported as `python -m apps.moe.hf export` does
    (its function, in this process: one process start-up less)."""
    run_dir, hf_dir = workdir / f"export_{name}", workdir / f"hf_{name}"
    run(trainer_command(SHAPES[name], "fp32", batch, seq_len, 1, run_dir,
                        ["checkpoint.save_final=true", *extra]), "the export run", core)
    from apps.moe.hf import export  # what `python -m apps.moe.hf export run_dir hf_dir` runs

    export(str(run_dir), str(hf_dir))
    return hf_dir


# ---------------------------------------------------------------------------------------------
# The Hugging Face side (its own process: `python benchmarks/moe_trainer_vs_hf.py hf ...`)


def hf_loop(hf_dir: str, experts: str, dtype: str, batch: int, seq_len: int, steps: int,
            out=sys.stdout) -> None:
    """Train the exported Mixtral `steps` steps; one JSON line per step with its end time
    (time.monotonic, comparable across processes)."""
    import torch
    from transformers import MixtralForCausalLM

    hf_malloc_like_ours()
    torch.manual_seed(0)
    model = MixtralForCausalLM.from_pretrained(hf_dir, experts_implementation=experts,
                                               attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    assert model.config._experts_implementation == experts, model.config._experts_implementation
    opt, sched = hf_optimizer(model, LR, BETAS, EPS, WEIGHT_DECAY, WARMUP)
    pool = torch.randint(0, VOCAB, (8, batch, seq_len + 1))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    print(json.dumps({"hf_experts": model.config._experts_implementation}), file=out, flush=True)
    for i in range(steps):
        tokens = pool[i % len(pool)]
        inputs, targets = tokens[:, :-1], tokens[:, 1:].contiguous()
        with autocast:
            # HF's own loss (ForCausalLMLoss: fp32 logits, mean over the targets given as
            # shift_labels, i.e. the same next-token targets as ours); no router logits.
            loss = model(input_ids=inputs, labels=targets, shift_labels=targets,
                         use_cache=False, output_router_logits=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        print(json.dumps({"hf_step": i + 1, "end": time.monotonic(), "loss": loss.item()}),
              file=out, flush=True)


def hf_command(hf_dir: Path, experts: str, dtype: str, batch: int, seq_len: int,
               steps: int) -> list:
    return [sys.executable, str(Path(__file__).resolve()), "hf", str(hf_dir), "--experts", experts,
            "--dtype", dtype, "--batch", str(batch), "--seq-len", str(seq_len),
            "--steps", str(steps)]


# ---------------------------------------------------------------------------------------------
# Both at once


def logging_every(dump_dir: Path) -> int:
    """The app's default logging.every, from a run's resolved config.yaml."""
    from omegaconf import OmegaConf

    return int(OmegaConf.load(dump_dir / "config.yaml").logging.every)


def measured_rows(dump_dir: Path, tokens_per_step: int):
    """(first row's step, [(steps, seconds)] of each later row): the rows after the first (whose
    window holds the warm-up), each row's seconds from its tokens_per_s over the steps since the
    row before."""
    rows = [json.loads(line) for line in open(dump_dir / "metrics.jsonl")]
    return rows[0]["step"], [(row["step"] - before["step"],
                              (row["step"] - before["step"]) * tokens_per_step
                              / row["tokens_per_s"])
                             for before, row in zip(rows, rows[1:])]


def run_pair(name: str, hf_dir: Path, experts: str, dtype: str, batch: int, seq_len: int,
             windows: int, core_ours: int, core_hf: int, workdir: Path, log_every: int,
             extra=(), compile: bool = False) -> dict:
    """One round: the trainer and the HF loop at the same time, each on its own core."""
    tag = f"{name}_{dtype}_{experts}_{core_ours}"
    dump_dir = workdir / f"ours_{tag}"
    steps = log_every * (1 + windows)  # the first logging window is the warm-up
    hf_log = workdir / f"hf_{tag}.jsonl"
    # HF starts first (transformers imports take seconds) and runs until stopped: its steps
    # inside our measured window are the ones compared.
    # (The child writes through its own file object: one shared with our reads would share
    # its offset too.)
    with open(hf_log, "w") as hf_out:
        hf = subprocess.Popen(hf_command(hf_dir, experts, dtype, batch, seq_len, 1_000_000),
                              cwd=REPO, env=pinned_env(), preexec_fn=pinned(core_hf),
                              stdout=hf_out, stderr=subprocess.STDOUT)
    try:
        wait_for_first_step(hf, hf_log)
        ours = subprocess.Popen(trainer_command(SHAPES[name], dtype, batch, seq_len, steps,
                                                dump_dir, ["checkpoint.save_final=false", *extra],
                                                compile),
                                cwd=REPO, env=pinned_env(), preexec_fn=pinned(core_ours),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        arrivals = follow_trainer(ours, time.monotonic)
    finally:
        hf.terminate()
        hf.wait()
    lines = hf_log.read_text().splitlines()
    hf_ends = [json.loads(line)["end"] for line in lines if line.startswith('{"hf_step"')]
    first, rows = measured_rows(dump_dir, batch * seq_len)
    t_start, t_end = arrivals[first], arrivals[steps]
    # HF steps run mostly inside our measured window: their midpoints are in it (a step longer
    # than the window, e.g. HF's expert loop with 64 experts, still counts when centred on it).
    inside = [(a, b) for a, b in zip(hf_ends, hf_ends[1:]) if t_start <= (a + b) / 2 <= t_end]
    if not inside:
        raise RuntimeError(f"no HF step ran inside our measured window ({t_end - t_start:.1f} s): "
                           f"an HF step is longer than twice the window; raise --windows."
                           f"\nHF output:\n" + "\n".join(lines[-20:]))
    ours_steps, ours_s = sum(n for n, _ in rows), sum(s for _, s in rows)
    return {"ours": batch * seq_len * ours_steps / ours_s,
            "hf": batch * seq_len * len(inside) / sum(b - a for a, b in inside),
            "ours_steps": ours_steps, "hf_steps": len(inside), "window_s": t_end - t_start,
            "ours_core": core_ours, "hf_core": core_hf}


def bench(cli) -> dict:
    cores = two_cores()
    workdir = Path(cli.workdir or tempfile.mkdtemp(prefix="moe_trainer_vs_hf_"))
    workdir.mkdir(parents=True, exist_ok=True)
    from lingua.observe.metrics import cpu_bf16_emulated

    print(f"CPU: {cpu_description()}; bf16 {'EMULATED' if cpu_bf16_emulated() else 'native'}")
    import torch
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; one thread a side, "
          f"cores {cores[0]} and {cores[1]} (swapped each round); "
          f"batch {cli.batch} x {cli.seq_len}; "
          f"ours {'compiled' if cli.compile else 'eager'}; HF's malloc "
          f"{'tuned like ours' if cli.hf_malloc_like_ours else 'glibc default'}")
    results = {}
    for name in cli.shapes.split(","):
        hf_dir = export_shape(name, cli.batch, cli.seq_len, workdir, cores[0], cli.extra)
        log_every = logging_every(workdir / f"export_{name}")
        shape = ", ".join(f"{k} {v}" for k, v in SHAPES[name].items())
        for dtype in cli.dtypes.split(","):
            for experts in cli.hf_experts.split(","):
                ratios = []
                print(f"\n{name} ({shape}), {dtype}, HF experts_implementation={experts}; ours: "
                      f"logging.every={log_every}, {cli.windows} window(s) after a warm-up one")
                for r in range(cli.rounds):
                    ours_core, hf_core = (cores if r % 2 == 0 else cores[::-1])
                    res = run_pair(name, hf_dir, experts, dtype, cli.batch, cli.seq_len,
                                   cli.windows, ours_core, hf_core, workdir, log_every, cli.extra,
                                   cli.compile)
                    ratios.append(res["ours"] / res["hf"])
                    print(f"  round {r + 1}: ours {res['ours']:7.0f} tok/s ({res['ours_steps']} "
                          f"steps, core {ours_core})  HF {res['hf']:7.0f} tok/s ({res['hf_steps']} "
                          f"steps, core {hf_core})  ours/HF {ratios[-1]:.2f}", flush=True)
                results[(name, dtype, experts)] = median(ratios)
                print(f"  median ours/HF over {len(ratios)} rounds: {median(ratios):.2f}  "
                      f"({', '.join(f'{x:.2f}' for x in ratios)})", flush=True)
    print("\nsummary (median of per-round ratios, ours / HF tokens/s):")
    for (name, dtype, experts), ratio in results.items():
        print(f"  {name:6s} {dtype:5s} HF {experts:10s} {ratio:.2f}")
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="side")
    hf = sub.add_parser("hf", help="the Hugging Face side (started by the benchmark)")
    hf.add_argument("hf_dir")
    hf.add_argument("--experts", default="grouped_mm")
    hf.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    hf.add_argument("--batch", type=int, default=4)
    hf.add_argument("--seq-len", type=int, default=512)
    hf.add_argument("--steps", type=int, default=10)
    parser.add_argument("--shapes", default="issue,fine", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default="fp32", help="fp32 and/or bf16")
    parser.add_argument("--hf-experts", default="grouped_mm,eager",
                        help="HF experts_implementation(s) to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=1,
                        help="measured logging windows of ours after the warm-up window")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--workdir", default=None, help="default: a new temporary directory")
    parser.add_argument("--compile", action="store_true", help="ours with distributed.compile=true")
    parser.add_argument("--hf-malloc-like-ours", action="store_true",
                        help="HF's process tunes malloc as our trainer does on CPU")
    parser.add_argument("--extra", action="append", default=[],
                        help="a Hydra override for our trainer (e.g. data.root=...), repeatable")
    cli = parser.parse_args(argv)
    if cli.side == "hf":
        return hf_loop(cli.hf_dir, cli.experts, cli.dtype, cli.batch, cli.seq_len, cli.steps)
    dtypes_for_this_cpu(cli.dtypes)   # exits where bf16 is asked for and only emulated here
    if cli.hf_malloc_like_ours:
        os.environ[HF_MALLOC_VAR] = "1"   # read by the HF process only (hf_malloc_like_ours)
    bench(cli)


if __name__ == "__main__":
    main()
