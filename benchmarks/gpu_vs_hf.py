"""Tokens/s of our trainer against a Hugging Face training loop on the same model, on one CUDA GPU
in bf16; also peak memory and MFU of each side.

    python benchmarks/gpu_vs_hf.py [--shapes 8B-wide,1B,moe,deepseek,qwen3-next] [--no-moe]
        [--rounds 2]
        [--float8 tensorwise|rowwise|tensorwise,rowwise] [--float8-shapes 8B-wide]
        [--warmup 10] [--steps 20] [--ours compiled|eager|compiled,eager] [--ours-eager]
        [--hf compiled,eager|none] [--hf-experts default,eager] [--out results.json]
        [--time-limit 540] [--device cuda|cpu]

Every side runs in a subprocess of its own (a fresh CUDA context, so each side's peak memory is
its own), one after the other; a round runs every side of a shape once, the order reversed every
other round (ours, HF, HF, ours, ...), so a GPU that warms up or slows down over the run moves
both sides alike. Per side the median over rounds is reported, with the ratios ours/HF-eager and
ours/HF-compiled.

Ours: the real entry point, `python -m apps.llama.train` (apps.moe / apps.deepseek .train for
the MoE and DeepSeek shapes), with
distributed.model_dtype=bf16 (fp32 weights and optimizer state, autocast to bf16: what one
process does, lingua.train.build.mixed_precision) and distributed.compile=true (each block
compiled; `--ours eager` or `--ours-eager` without). The app's debug preset gives everything but the
shape: its logging (logging.every=10, a metrics.jsonl row every 10 steps; the warm-up and
measured step counts are rounded up to multiples of it), its optimizer defaults (fused AdamW,
clip 1.0, cosine schedule), loss-spike logging; no validation, no checkpoint. Data: the embedded
corpus with the byte tokenizer (data.root=data/embedded, memmap, prepared on first use), read
inside the step as always; model.vocab_size is the shape's (32000 for the LLaMA shapes: the
trainer only requires it to be at least the tokenizer's 258, so the unused embedding rows cost
what a real vocabulary's output layer costs). Tokens/s: from metrics.jsonl, over the rows after
the warm-up (each row's step_s is the mean step time of its window); also from the wall-clock time
between the log lines that open and close the measured window ("wall": the loop's own work
between steps, logging included).

Shapes: "8B-wide" (the headline: Llama 3 8B's width with 8 of its layers, 2 x 4096 tokens), "1B",
"moe", "deepseek" (DeepSeek-V3's width, MLA and routing, two layers, against
DeepseekV3ForCausalLM), "qwen3-next" (Qwen3-Next-80B-A3B's width, 3 Gated DeltaNet layers and
one gated full attention, 64 of its 512 experts, against Qwen3NextForCausalLM; ours with
model.linear_kernel=fla, and transformers takes flash-linear-attention's kernels too where fla
imports: `pip install fla-core`), "125M", and tiny ones for the CPU tests. `--float8 RECIPE`
runs each of our sides a second time with distributed.float8=RECIPE, in the same round, and
reports float8/bf16 tokens/s; MFU stays over the bf16 peak for both (as torchtitan reports
it), so float8's MFU can pass bf16's.

Hugging Face: `python benchmarks/gpu_vs_hf.py hf ...`, doing one `transformers.Trainer` step
with bf16=True: LlamaForCausalLM / MixtralForCausalLM (attn_implementation="sdpa") built from the
config our exporter writes for the same shape (apps/llama/hf.py's llama_hf_config, apps/moe/hf.py's
hf_config: the same widths, heads, kv heads, RoPE (Llama 3 scaling on the 1B shape), norm eps,
tying), random init, fp32 weights and autocast(cuda, bf16) around forward and loss; the model's
own loss (labels=, fp32 logits, mean over the tokens); backward; clip_grad_norm_(1.0); fused
torch.optim.AdamW with weight decay on matrices; a LambdaLR step; zero_grad(set_to_none=True);
one loss.item() per step (Trainer syncs for logging too). Tokens: random, made on the GPU before
the loop. "hf_compiled" is the same after `model = torch.compile(model)` (Trainer's
torch_compile=True). Timed with torch.cuda.synchronize() and time.perf_counter over the measured
steps after the warm-up ones.

MoE ("moe": dim 1024, 8 layers, 16 heads, 8 experts top-2 of expert_hidden_dim 1408, no shared
expert or dense layer, softmax routing with renormalised top-k weights: exactly what Mixtral
computes; no balancing losses on either side). The HF side is MixtralForCausalLM built from the
config apps.moe.hf's export writes for this shape, with random weights: loading our exported
checkpoint (benchmarks/moe_trainer_vs_hf.py's export_shape) would first need a trainer run to
save 376M parameters with their optimizer state (~6 GB written and read again) and cost a minute
of the few this benchmark has on a GPU, to change numbers the throughput does not depend on. HF's
default experts implementation (grouped_mm where torch has it; under autocast it casts the tokens
to the fp32 weights, so HF's experts run in fp32 even in "bf16": torch's CUDA grouped_mm has its
fast kernel for bf16 only and loops over the experts otherwise, and under torch.compile HF itself
swaps a non-bf16 grouped_mm for its own per-expert loop) and, where transformers has
`experts_implementation`, also "eager" (the per-expert Python loop of transformers < 5), which is
measured uncompiled only: its loop depends on the routing (which experts got tokens, how many),
so compiling it measures recompilation, not training.

MFU of every side: the FLOPs per token the trainer itself uses
(lingua.observe.metrics.flops_per_token, apps.moe.model.flops_per_token for MoE: 6 x active matmul
parameters + attention) x tokens/s, over (a) the data-sheet bf16 peak
(lingua.observe.metrics.peak_flops) and (b) a bf16 8192^3 matmul peak measured at the start
(benchmarks/llama_gpu.py's measured_matmul_peak). Peak memory: torch.cuda.max_memory_allocated of
each process (ours logs it as peak_mem_gib).

The whole run keeps within --time-limit seconds (default 540, under a 10-minute job): round 1 of
every shape comes before round 2, and a side that would start too late is skipped and said so.
Every number goes to --out (JSON, rewritten after each side); the table is printed last.

`--device cpu` runs the same on CPU in fp32 (no autocast; tests/test_benchmarks_gpu.py runs the
tiny shape end to end).
"""

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from moe_trainer_vs_hf import MIXTRAL as MIXTRAL_OVERRIDES  # noqa: E402
from trainer_vs_hf import follow_trainer, hf_optimizer  # noqa: E402  (shared with the CPU twin)


@dataclass(frozen=True)
class Shape:
    app: str        # "llama" | "moe" | "deepseek" | "qwen3_next": apps.<app>.train, its args
    model: dict     # model.* of the run (the dataclass's fields)
    seq_len: int
    batch: int


def _preset_model(app: str, preset: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(REPO / "configs" / app / f"{preset}.yaml").model)


def _as_python(value: str):
    return {"true": True, "false": False}.get(value, value)


# Mixtral's routing as MoEArgs (benchmarks/moe_trainer_vs_hf.py's overrides, the same mapping).
MIXTRAL = {k: _as_python(v) if isinstance(v, str) else v for k, v in MIXTRAL_OVERRIDES.items()}

SHAPES = {
    # The headline: Llama 3 8B's width (configs/llama/llama_8b.yaml's model) with 8 of its 32
    # layers, 2.8B parameters, on 2 x 4096 tokens: one GPU's share of an 8B run's matmuls.
    "8B-wide": Shape("llama", {**_preset_model("llama", "llama_8b"), "n_layers": 8}, 4096, 2),
    # 124.7M parameters (100.1M without the input embedding), GQA 12/4.
    "125M": Shape("llama", dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000,
                                multiple_of=256, max_seq_len=2048), 2048, 8),
    # configs/llama/llama_1b.yaml's model (Llama 3.2 1B: tied embeddings, Llama 3 RoPE scaling)
    # with a 32000 vocabulary instead of 128256: 1.04B parameters.
    "1B": Shape("llama", {**_preset_model("llama", "llama_1b"), "vocab_size": 32000}, 2048, 4),
    # 376M parameters; 135.6M matmul parameters active a token (the output layer's included).
    "moe": Shape("moe", dict(dim=1024, n_layers=8, n_heads=16, n_kv_heads=16, vocab_size=32000,
                             multiple_of=256, max_seq_len=2048, n_experts=8, top_k=2,
                             expert_hidden_dim=1408, **MIXTRAL), 2048, 8),
    # DeepSeek-V3's width and attention (configs/deepseek/deepseek_v3_671b.yaml's model: MLA with
    # both latents, YaRN, 8 experts a token in 4 of 8 groups of its 2048-wide experts, one shared)
    # on one dense and one MoE layer of 32 experts instead of 256, no MTP: 4.08B parameters, the
    # most one GPU trains in fp32 weights + AdamW beside HF's side.
    "deepseek": Shape("deepseek", {**_preset_model("deepseek", "deepseek_v3_671b"), "n_layers": 2,
                                   "n_dense_layers": 1, "n_experts": 32, "mtp_depth": 0,
                                   "max_seq_len": 4096}, 4096, 1),
    # Qwen3-Next-80B-A3B's width and layer kinds (configs/qwen3_next/qwen3_next_80b_a3b.yaml's
    # model) on 4 layers (3 Gated DeltaNet, 1 gated full attention) of 64 experts instead of 512,
    # no balancing loss (HF's side has none with output_router_logits=False): 1.57B parameters.
    "qwen3-next": Shape("qwen3_next", {**_preset_model("qwen3_next", "qwen3_next_80b_a3b"),
                                       "n_layers": 4, "n_experts": 64, "aux_loss_coef": 0.0,
                                       "max_seq_len": 4096, "linear_kernel": "fla"}, 4096, 1),
    # For the tests (CPU).
    "tiny": Shape("llama", dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                                multiple_of=32, max_seq_len=64), 64, 2),
    "tiny-moe": Shape("moe", dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=512,
                                  multiple_of=32, max_seq_len=64, n_experts=4, top_k=2,
                                  expert_hidden_dim=64, **MIXTRAL), 64, 2),
    # the debug preset's model (ours starts from that preset), smaller and without MTP (HF's
    # model has none)
    "tiny-deepseek": Shape("deepseek", {**_preset_model("deepseek", "debug"), **dict(
        dim=64, n_layers=2, vocab_size=512, max_seq_len=64, q_lora_rank=32, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, dense_hidden_dim=128,
        expert_hidden_dim=32, mtp_depth=0)}, 64, 2),
    "tiny-qwen3-next": Shape("qwen3_next", {**_preset_model("qwen3_next", "debug"), **dict(
        dim=64, n_layers=4, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
        vocab_size=512, max_seq_len=128, expert_hidden_dim=32, shared_expert_hidden_dim=32,
        aux_loss_coef=0.0, z_loss_coef=0.0)}, 128, 2),
}
DEFAULT_SHAPES = "8B-wide,1B,moe,deepseek"
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")   # distributed.float8

# Both sides' optimizer: our OptimArgs' AdamW defaults (a shorter warm-up), which HF's copies.
LR, BETAS, EPS, WEIGHT_DECAY, CLIP, WARMUP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0, 10


def model_args(shape: Shape):
    """LlamaArgs / MoEArgs of the shape, typed as the trainer's config makes them (an int given
    for a float field becomes a float: transformers' configs refuse `router_aux_loss_coef=0`)."""
    from lingua.config import from_dict

    if shape.app == "moe":
        from apps.moe.model import MoEArgs

        return from_dict(MoEArgs, shape.model)
    if shape.app == "deepseek":
        from apps.deepseek.model import DeepSeekArgs

        return from_dict(DeepSeekArgs, shape.model)
    if shape.app == "qwen3_next":
        from apps.qwen3_next.model import Qwen3NextArgs

        return from_dict(Qwen3NextArgs, shape.model)
    from lingua.models.llama.model import LlamaArgs

    return from_dict(LlamaArgs, shape.model)


def our_model(shape: Shape):
    """Our model of the shape (on the current default device: meta in the tests)."""
    if shape.app == "moe":
        from apps.moe.model import Transformer
    elif shape.app == "deepseek":
        from apps.deepseek.model import Transformer
    elif shape.app == "qwen3_next":
        from apps.qwen3_next.model import Transformer
    else:
        from lingua.models.llama.model import Transformer
    return Transformer(model_args(shape))


def flops_per_token(shape: Shape) -> float:
    """The FLOPs per token the trainer uses for its MFU (lingua.train.loop.Run._flops_per_token:
    apps.moe's over active parameters, lingua.observe.metrics' for LLaMA)."""
    import torch

    args = model_args(shape)
    if shape.app == "moe":
        from apps.moe.model import flops_per_token as moe_flops

        return moe_flops(args, shape.seq_len)
    if shape.app == "deepseek":
        from apps.deepseek.model import flops_per_token as deepseek_flops

        return deepseek_flops(args, shape.seq_len)
    if shape.app == "qwen3_next":
        from apps.qwen3_next.train import TrainArgs
        from apps.qwen3_next.train import flops_per_token as qwen3_next_flops

        train_args = TrainArgs(model=args)
        train_args.data.seq_len = shape.seq_len
        return qwen3_next_flops(train_args)
    from lingua.observe.metrics import flops_per_token as dense_flops

    with torch.device("meta"):
        model = our_model(shape)
    return dense_flops(model, args.n_layers, args.dim, shape.seq_len, args.tie_embeddings)


# ---------------------------------------------------------------------------------------------
# The Hugging Face side (its own process: `python benchmarks/gpu_vs_hf.py hf ...`)


def hf_config(shape: Shape):
    """The transformers config our exporter writes for this shape (config.json's dict)."""
    import torch
    from transformers import CONFIG_MAPPING

    if shape.app == "moe":
        from apps.moe.hf import hf_config as moe_config

        cfg = moe_config(model_args(shape), torch.float32)
    elif shape.app == "deepseek":
        from apps.deepseek.hf import hf_config as deepseek_config

        cfg = deepseek_config(model_args(shape), torch.float32)
    elif shape.app == "qwen3_next":
        from apps.qwen3_next.hf import hf_config as qwen3_next_config

        cfg = qwen3_next_config(model_args(shape), torch.float32)
    else:
        from lingua.models.llama.hf import llama_hf_config

        cfg = llama_hf_config(model_args(shape), torch.float32)
    return CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)


def hf_model(shape: Shape, experts: str = "default", device: str = "meta"):
    """LlamaForCausalLM / MixtralForCausalLM of the shape, fp32, sdpa attention, built on
    `device` with HF's own random init. experts: "default" leaves the experts implementation to
    transformers (recorded in config._experts_implementation), else names it."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = dict(attn_implementation="sdpa", dtype=torch.float32)
    if experts != "default":
        kwargs["experts_implementation"] = experts
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config(shape), **kwargs)
    return model.to(device)


def hf_side(shape: Shape, mode: str, experts: str, device: str, warmup: int, steps: int) -> dict:
    """Train HF's model warmup + steps steps as Trainer(bf16=True[, torch_compile=True]) would;
    tokens/s over the `steps` after the warm-up."""
    import torch

    from lingua.observe.metrics import peak_memory_gib

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    t_build = time.perf_counter()
    model = hf_model(shape, experts, device)
    model.train()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    opt, sched = hf_optimizer(model, LR, BETAS, EPS, WEIGHT_DECAY, WARMUP)
    config = model.config
    forward = torch.compile(model) if mode == "compiled" else model
    # bf16 as Trainer(bf16=True) does it on a GPU: fp32 weights, autocast around forward + loss.
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda)
    extra = {"output_router_logits": False} if shape.app in ("moe", "qwen3_next") else {}
    vocab = config.vocab_size
    pool = torch.randint(0, vocab, (4, shape.batch, shape.seq_len + 1), device=dev)
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in pool]
    build_s = time.perf_counter() - t_build

    def step(i: int) -> float:
        inputs, targets = batches[i % len(batches)]
        with autocast:
            # HF's loss (ForCausalLMLoss: fp32 logits, mean over the targets given as
            # shift_labels: the same next-token targets as ours).
            loss = forward(input_ids=inputs, labels=targets, shift_labels=targets,
                           use_cache=False, **extra).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    t0 = time.perf_counter()
    losses = [step(i) for i in range(warmup)]
    sync()
    t1 = time.perf_counter()
    ends = []
    for i in range(warmup, warmup + steps):
        losses.append(step(i))
        ends.append(time.perf_counter())
    sync()
    t2 = time.perf_counter()
    step_times = [b - a for a, b in zip([t1] + ends, ends)]
    return {"tokens_per_s": shape.batch * shape.seq_len * steps / (t2 - t1),
            "measured_s": t2 - t1, "warmup_s": t1 - t0, "build_s": build_s,
            "median_step_s": statistics.median(step_times),
            "peak_mem_gib": peak_memory_gib(dev),
            "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2 ** 30 if cuda else None,
            "loss_first": losses[0], "loss_last": losses[-1], "n_params": n_params,
            "attn_implementation": config._attn_implementation,
            "experts_implementation": getattr(config, "_experts_implementation", None)
            if shape.app == "moe" else None,
            "warmup_steps": warmup, "measured_steps": steps}


# ---------------------------------------------------------------------------------------------
# The machine (its own process: `python benchmarks/gpu_vs_hf.py env ...`)


def env_side(device: str) -> dict:
    """Versions, the device, and the two peaks MFU is reported against."""
    import torch
    import transformers

    from lingua.observe.metrics import measure_cpu_peak, peak_flops

    dev = torch.device(device)
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "device": device, "machine": platform.machine()}
    if dev.type == "cuda":
        from llama_gpu import measured_matmul_peak

        torch.cuda.init()
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=torch.cuda.get_device_name(dev), capability=f"{props.major}.{props.minor}",
                    gpu_memory_gib=props.total_memory / 2 ** 30,
                    cudnn=torch.backends.cudnn.version(), dtype="bf16",
                    datasheet_peak=peak_flops(dev, "bf16"),
                    # The best of 3 timings of 50 calls (the clocks ramp up in the first).
                    measured_peak=max(measured_matmul_peak(8192, 50) for _ in range(3)),
                    measured_peak_what="bf16 8192^3 matmul (benchmarks/llama_gpu.py), "
                                       "best of 3 x 50 calls")
    else:
        info.update(gpu=None, dtype="fp32", cpu=platform.processor() or platform.machine(),
                    threads=torch.get_num_threads(),
                    datasheet_peak=peak_flops(dev, "fp32"),   # on CPU: measured (1024^3)
                    measured_peak=measure_cpu_peak(torch.float32),
                    measured_peak_what="fp32 1024^3 matmul (metrics.measure_cpu_peak)")
    return info


# ---------------------------------------------------------------------------------------------
# Our side: the trainer's command line and what its run left


def _hydra(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def ours_overrides(shape: Shape, compile: bool, device: str, steps: int, dump_dir,
                   data_root, float8: str = "none") -> list:
    # distributed.float8 only when asked: an older trainer (--trainer) may not know the key
    return [f"dump_dir={dump_dir}", f"steps={steps}",
            *([f"distributed.float8={float8}"] if float8 != "none" else []),
            *(f"model.{k}={_hydra(v)}" for k, v in shape.model.items()),
            f"data.root={data_root}", "data.format=memmap", "data.prepare_embedded=true",
            "data.tokenizer.kind=bytes", "data.tokenizer.path=null",
            f"data.seq_len={shape.seq_len}", f"data.batch_size={shape.batch}", "data.grad_accum=1",
            "data.val_sequences=0",
            f"distributed.model_dtype={'bf16' if device == 'cuda' else 'fp32'}",
            f"distributed.compile={_hydra(compile)}",
            f"optim.lr={LR}", f"optim.beta1={BETAS[0]}", f"optim.beta2={BETAS[1]}",
            f"optim.eps={EPS}", f"optim.weight_decay={WEIGHT_DECAY}", f"optim.clip={CLIP}",
            f"optim.warmup={WARMUP}",
            "eval.every=0", "eval.at_end=false", "checkpoint.every=0",
            "checkpoint.save_final=false"]


def logging_every(shape: Shape, device: str, data_root) -> int:
    """logging.every of the run we are about to start: the app's preset default (composed the
    way the trainer composes it)."""
    from importlib import import_module

    load_config = import_module(f"apps.{shape.app}.train").load_config
    args = load_config(ours_overrides(shape, False, device, 1, "unused", data_root), check=False)
    return int(args.logging.every)


def read_ours(dump_dir: Path, shape: Shape, warmup: int, total: int, arrivals: dict) -> dict:
    """Tokens/s over metrics.jsonl's rows after the warm-up, and from the log lines' arrival
    times; the trainer's peak memory, its logged MFU, and the FLOPs per token that MFU implies
    (mfu x peak / tokens_per_s with peak.json's peak, the last peak it used: a check on
    flops_per_token above)."""
    rows = [json.loads(line) for line in (dump_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = shape.batch * shape.seq_len
    windows = [(row["step"] - before, row) for before, row
               in zip([0] + [r["step"] for r in rows], rows)]
    measured = [(n, row) for n, row in windows if row["step"] > warmup]
    if not measured:
        raise RuntimeError(f"no metrics.jsonl row after step {warmup} in {dump_dir}")
    steps = sum(n for n, _ in measured)
    seconds = sum(n * row["step_s"] for n, row in measured)
    peak_record = json.loads((dump_dir / "peak.json").read_text())
    peak = peak_record.get("flops_per_s")
    # The last row with an MFU (the warm-up's will do): a row faster than the run's one measured
    # peak logs mfu null (and mfu_above_peak) instead.
    implied = [row["mfu"] * peak / row["tokens_per_s"] for row in rows
               if row.get("mfu") is not None and peak][-1:]
    wall = None
    if warmup in arrivals and total in arrivals and arrivals[total] > arrivals[warmup]:
        wall = tokens * (total - warmup) / (arrivals[total] - arrivals[warmup])
    return {"tokens_per_s": tokens * steps / seconds, "wall_tokens_per_s": wall,
            "measured_steps": steps, "measured_s": seconds,
            "rows": [row["step"] for row in rows],
            "peak_mem_gib": max(r["peak_mem_gib"] for r in rows),
            "logged_mfu": statistics.mean(r["mfu"] for _, r in measured if r.get("mfu") is not None)
            if any(r.get("mfu") is not None for _, r in measured) else None,
            "trainer_flops_per_token": implied[0] if implied else None,
            "trainer_peak_flops": peak, "trainer_peak_note": peak_record.get("note", ""),
            "loss_last": rows[-1]["loss"],
            "first_row_s": arrivals.get(rows[0]["step"])}


# ---------------------------------------------------------------------------------------------
# Running the sides


@dataclass(frozen=True)
class Side:
    name: str       # "ours", "ours_eager", "ours_float8", "hf_eager", "hf_compiled", ...
    kind: str       # "ours" | "hf"
    compiled: bool
    experts: str = "default"   # HF MoE only
    float8: str = "none"       # ours only: distributed.float8


def sides_for(shape: Shape, ours: list, hf: list, hf_experts: list, float8: str = "none") -> list:
    """Ours in each mode (and beside each, in float8 with --float8: "ours_float8" for one recipe,
    "ours_float8_rowwise" and so on for several), then HF's sides."""
    recipes = [r for r in float8.split(",") if r != "none"]
    sides = []
    for mode in ours:
        name = "ours" if mode == "compiled" else "ours_eager"
        sides.append(Side(name, "ours", mode == "compiled"))
        for recipe in recipes:
            suffix = "_float8" + (f"_{recipe}" if len(recipes) > 1 else "")
            sides.append(Side(name + suffix, "ours", mode == "compiled", float8=recipe))
    for mode in hf:
        for experts in (hf_experts if shape.app == "moe" else ["default"]):
            if experts == "eager" and mode == "compiled":
                continue   # a routing-dependent Python loop: compiling it times recompilation
            suffix = "" if experts == "default" else f"_experts_{experts}"
            sides.append(Side(f"hf_{mode}{suffix}", "hf", mode == "compiled", experts))
    return sides


def child_env(device: str, root: Path = REPO) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join(
                   [str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    from lingua.parallel.distributed import JOB_DEVICE_VAR

    if device == "cpu":
        env[JOB_DEVICE_VAR] = "cpu"
    else:
        env.pop(JOB_DEVICE_VAR, None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)   # one process: not a rank of whatever launched us
    return env


class Killer:
    """Kills a child's process group (inductor's compile workers too) after `seconds`."""

    def __init__(self, proc: subprocess.Popen, seconds: float):
        self.fired = False

        def kill():
            self.fired = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        self.timer = threading.Timer(max(seconds, 1.0), kill)
        self.timer.start()

    def cancel(self):
        self.timer.cancel()


def run_ours(name: str, shape: Shape, side: Side, cli, tag: str, timeout: float) -> dict:
    dump_dir = cli.workdir / f"{tag}_{side.name}_{name}"
    total = cli.warmup + cli.steps
    module = f"apps.{shape.app}.train"
    cmd = [sys.executable, "-m", module,
           *ours_overrides(shape, side.compiled, cli.device, total, dump_dir, cli.data_root,
                           side.float8)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cli.trainer, env=child_env(cli.device, cli.trainer),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            start_new_session=True)
    killer = Killer(proc, timeout)
    lines = []
    try:   # each logged step's line, timed as it arrives
        arrivals = follow_trainer(proc, lambda: time.monotonic() - start, lines)
    except RuntimeError as err:
        raise RuntimeError(
            f"{'timed out: ' if killer.fired else ''}{' '.join(cmd[1:])}\n{err}") from None
    finally:
        killer.cancel()
    out = read_ours(dump_dir, shape, cli.warmup, total, arrivals)
    out.update(command=" ".join(cmd[1:]), dump_dir=str(dump_dir),
               output_tail=[line.rstrip() for line in lines[-20:]],
               warnings=[line.rstrip() for line in lines
                         if "warn" in line.lower() or "recompil" in line.lower()][:20])
    return out


def run_child(args: list, cli, result: Path, timeout: float, what: str) -> dict:
    """`python benchmarks/gpu_vs_hf.py <args>`, which writes its JSON to `result`."""
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), *args, "--result", str(result)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(cli.device), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    killer = Killer(proc, timeout)
    output, _ = proc.communicate()
    killer.cancel()
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"{what} {'timed out' if killer.fired else 'failed'} (exit "
                           f"{proc.returncode}): {' '.join(cmd[1:])}\n{output[-3000:]}")
    out = json.loads(result.read_text())
    out["output_tail"] = output.splitlines()[-20:]   # graph breaks, recompiles, HF's warnings
    return out


def run_side(name: str, shape: Shape, side: Side, cli, tag: str, timeout: float) -> dict:
    if side.kind == "ours":
        return run_ours(name, shape, side, cli, tag, timeout)
    args = ["hf", "--shape", name, "--mode", "compiled" if side.compiled else "eager",
            "--experts", side.experts, "--device", cli.device, "--warmup", str(cli.warmup),
            "--steps", str(cli.steps)]
    return run_child(args, cli, cli.workdir / f"{tag}_{side.name}_{name}.json", timeout,
                     f"the HF side ({side.name}, {name})")


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(results: dict, env: dict) -> None:
    """Per shape and side: the median tokens/s over the rounds that ran, peak memory, MFU
    against both peaks; per shape the ratios of each of our sides to each HF side."""
    for shape_result in results["shapes"].values():
        fpt = shape_result["flops_per_token"]
        for side in shape_result["sides"].values():
            ok = [r for r in side["runs"] if r.get("ok")]
            side["rounds_ok"] = len(ok)
            if not ok:
                side.update(tokens_per_s=None, peak_mem_gib=None, mfu_datasheet=None,
                            mfu_measured=None)
                continue
            tps = statistics.median(r["tokens_per_s"] for r in ok)
            side.update(tokens_per_s=tps, peak_mem_gib=max(r["peak_mem_gib"] for r in ok),
                        mfu_datasheet=tps * fpt / env["datasheet_peak"]
                        if env.get("datasheet_peak") else None,
                        mfu_measured=tps * fpt / env["measured_peak"]
                        if env.get("measured_peak") else None)
            walls = [r["wall_tokens_per_s"] for r in ok if r.get("wall_tokens_per_s")]
            if walls:
                side["wall_tokens_per_s"] = statistics.median(walls)
        sides = shape_result["sides"]
        ratios = {}
        for ours_name, ours in sides.items():
            if not ours_name.startswith("ours"):
                continue
            twin = ours_name.split("_float8")[0]
            bf16 = sides.get(twin)
            if "_float8" in ours_name and bf16 and bf16["tokens_per_s"] and \
                    ours["tokens_per_s"]:   # float8 against the same mode's bf16, same run
                ratios[f"{ours_name}/{twin}"] = ours["tokens_per_s"] / bf16["tokens_per_s"]
            for hf_name, hf in sides.items():
                if hf_name.startswith("hf") and ours["tokens_per_s"] and hf["tokens_per_s"]:
                    ratios[f"{ours_name}/{hf_name}"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        shape_result["ratios"] = ratios


def _flops(x) -> str:
    if not x:
        return "none"
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(results: dict) -> str:
    env = results["env"]
    w = max([9, *(len(name) + 1 for name in results["shapes"])])   # the shape column
    lines = [f"{'shape':{w}s}{'side':30s}{'tokens/s':>12s}{'rounds':>7s}{'ours/this':>10s}"
             f"{'mem GiB':>9s}{'MFU sheet':>10s}{'MFU meas':>10s}"]
    for name, shape_result in results["shapes"].items():
        ratios = shape_result.get("ratios", {})
        first_ours = next((s for s in shape_result["sides"] if s.startswith("ours")), None)
        for side_name, side in shape_result["sides"].items():
            tps = side.get("tokens_per_s")
            ratio = ratios.get(f"{first_ours}/{side_name}")
            impl = side.get("experts_implementation")   # what HF's "default" chose
            label = side_name + (f" [{impl}]" if impl and side.get("experts") == "default" else "")
            mem = side.get("peak_mem_gib")
            missing = "skipped" if all(r.get("skipped") for r in side["runs"]) else "failed"
            lines.append(
                f"{name:{w}s}{label:30s}{(f'{tps:,.0f}' if tps else missing):>12s}"
                f"{side.get('rounds_ok', 0):>7d}{(f'{ratio:.2f}' if ratio else '-'):>10s}"
                f"{(f'{mem:.1f}' if mem else '-'):>9s}"
                f"{_pct(side.get('mfu_datasheet')):>10s}{_pct(side.get('mfu_measured')):>10s}")
    device = env.get("gpu") or env.get("cpu")
    head = (f"{device}: torch {env.get('torch')}, CUDA {env.get('cuda')}, transformers "
            f"{env.get('transformers')}, Python {env.get('python')}; {env.get('dtype')}; peaks "
            f"{_flops(env.get('datasheet_peak'))} (lingua.observe.metrics.peak_flops) and "
            f"{_flops(env.get('measured_peak'))} ({env.get('measured_peak_what')})")
    return "\n".join([head] + lines)


def write_json(path: Path, results: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def round_up(n: int, every: int) -> int:
    return max(every, -(-n // every) * every)


def float8_of(cli, shape_name: str) -> str:
    """The float8 recipes a shape's sides run: --float8's, on the shapes of --float8-shapes."""
    shapes = cli.float8_shapes.split(",") if cli.float8_shapes else None
    return cli.float8 if shapes is None or shape_name in shapes else "none"


def bench(cli) -> int:
    started = time.monotonic()
    deadline = started + cli.time_limit if cli.time_limit > 0 else float("inf")
    names = [n for n in cli.shapes.split(",") if cli.moe or SHAPES[n].app != "moe"]
    ours_modes = ["eager"] if cli.ours_eager else cli.ours.split(",")
    hf_modes = [] if cli.hf == "none" else cli.hf.split(",")
    hf_experts = cli.hf_experts.split(",")
    # Our warm-up and measured windows are whole logging windows (the rows' tokens/s are per
    # window), both sides the same step counts.
    every = max(logging_every(SHAPES[n], cli.device, cli.data_root) for n in names)
    warmup, steps = round_up(cli.warmup, every), round_up(cli.steps, every)
    if (warmup, steps) != (cli.warmup, cli.steps):
        print(f"warm-up {cli.warmup} -> {warmup} and measured {cli.steps} -> {steps} steps: "
              f"whole windows of the trainer's logging.every={every}")
    cli.warmup, cli.steps = warmup, steps

    print("measuring the peak and reading versions ...", flush=True)
    env = run_child(["env", "--device", cli.device], cli, cli.workdir / "env.json", 300,
                    "the environment probe")
    results = {"env": env, "complete": False,
               "settings": {"shapes": names, "rounds": cli.rounds, "warmup": warmup,
                            "steps": steps, "logging_every": every, "ours": ours_modes,
                            "hf": hf_modes, "hf_experts": hf_experts, "device": cli.device,
                            "float8": cli.float8, "float8_shapes": cli.float8_shapes,
                            "trainer": str(cli.trainer),
                            "time_limit_s": cli.time_limit, "workdir": str(cli.workdir)},
               "shapes": {}}
    print(table({"env": env, "shapes": {}}).splitlines()[0], flush=True)
    for name in names:
        shape = SHAPES[name]
        results["shapes"][name] = {
            "app": shape.app, "model": shape.model, "seq_len": shape.seq_len,
            "batch": shape.batch, "tokens_per_step": shape.batch * shape.seq_len,
            "flops_per_token": flops_per_token(shape),
            "sides": {s.name: {"kind": s.kind, "compiled": s.compiled, "experts": s.experts,
                               "runs": []}
                      for s in sides_for(shape, ours_modes, hf_modes, hf_experts,
                                         float8_of(cli, name))}}
    failures = 0
    last_s = {}
    for r in range(cli.rounds):
        for name in names:
            shape = SHAPES[name]
            sides = sides_for(shape, ours_modes, hf_modes, hf_experts, float8_of(cli, name))
            for side in (sides if r % 2 == 0 else sides[::-1]):
                record = results["shapes"][name]["sides"][side.name]
                left = deadline - time.monotonic()
                expected = last_s.get((name, side.name), 0.0)
                if left < max(expected, 20.0):
                    record["runs"].append({"round": r + 1, "ok": False, "skipped": True,
                                           "error": f"skipped: {left:.0f} s left of --time-limit"})
                    print(f"round {r + 1} {name} {side.name}: skipped ({left:.0f} s left of "
                          f"--time-limit {cli.time_limit:.0f})", flush=True)
                    continue
                t0 = time.monotonic()
                try:
                    out = run_side(name, shape, side, cli, f"r{r + 1}",
                                   min(left, cli.side_timeout))
                    out.update(ok=True, round=r + 1, wall_s=time.monotonic() - t0)
                    if out.get("experts_implementation"):
                        record["experts_implementation"] = out["experts_implementation"]
                    wall = out.get("wall_tokens_per_s")
                    print(f"round {r + 1} {name:8s} {side.name:24s} {out['tokens_per_s']:>12,.0f} "
                          f"tok/s" + (f" (wall {wall:,.0f})" if wall else "")
                          + f"  mem {out['peak_mem_gib']:.2f} GiB  [{out['wall_s']:.0f} s]",
                          flush=True)
                except Exception as err:   # noted, and the other sides go on
                    failures += 1
                    out = {"ok": False, "round": r + 1, "wall_s": time.monotonic() - t0,
                           "error": str(err)[-4000:]}
                    print(f"round {r + 1} {name} {side.name}: FAILED\n{str(err)[-2000:]}",
                          flush=True)
                last_s[(name, side.name)] = out["wall_s"]
                record["runs"].append(out)
                summarize(results, env)
                write_json(cli.out, results)
    results["complete"] = True
    results["elapsed_s"] = time.monotonic() - started
    summarize(results, env)
    write_json(cli.out, results)
    print("\nratios (ours / HF, of the median tokens/s over the rounds):")
    for name, shape_result in results["shapes"].items():
        for key, ratio in shape_result["ratios"].items():
            print(f"  {name:8s} {key:40s} {ratio:.3f}")
    print(f"\nall numbers: {cli.out}  ({results['elapsed_s']:.0f} s)\n")
    print(table(results))
    return 1 if failures else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("hf", "env"):
        side = argparse.ArgumentParser(description=f"the {argv[0]} side (started by the benchmark)")
        side.add_argument("--shape", choices=sorted(SHAPES))
        side.add_argument("--mode", choices=["eager", "compiled"], default="eager")
        side.add_argument("--experts", default="default")
        side.add_argument("--device", default="cuda")
        side.add_argument("--warmup", type=int, default=10)
        side.add_argument("--steps", type=int, default=20)
        side.add_argument("--result", type=Path, required=True)
        args = side.parse_args(argv[1:])
        if argv[0] == "env":
            out = env_side(args.device)
        else:
            out = hf_side(SHAPES[args.shape], args.mode, args.experts, args.device, args.warmup,
                          args.steps)
        args.result.write_text(json.dumps(out) + "\n")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--moe", action=argparse.BooleanOptionalAction, default=True,
                        help="run the MoE shapes among --shapes (--no-moe: LLaMA only)")
    parser.add_argument("--ours", default="compiled",
                        help="our trainer with distributed.compile true (compiled) "
                             "and/or false (eager)")
    parser.add_argument("--ours-eager", action="store_true", help="the same as --ours eager")
    parser.add_argument("--hf", default="compiled,eager",
                        help="HF loop: eager and/or compiled (torch.compile(model))")
    parser.add_argument("--hf-experts", default="default,eager",
                        help="HF MoE experts_implementation(s): default (transformers' choice) "
                             "and/or a named one (eager: the per-expert loop; uncompiled only)")
    parser.add_argument("--float8", default="none",
                        help="also run ours with distributed.float8=RECIPE beside each of our "
                             "sides (MFU stays over the bf16 peak); several: tensorwise,rowwise")
    parser.add_argument("--float8-shapes", default=None,
                        help="the shapes whose sides --float8 adds to (default: every shape)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=10, help="steps before timing (rounded up "
                        "to a multiple of the trainer's logging.every)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps (rounded likewise)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help="results JSON (default: gpu_vs_hf.json in --workdir)")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary dir")
    parser.add_argument("--trainer", type=Path, default=REPO,
                        help="the tree whose apps.*.train is ours (default: this one), e.g. an "
                             "older commit's, measured with today's harness and HF side")
    parser.add_argument("--data-root", type=Path, default=REPO / "data" / "embedded",
                        help="the embedded byte corpus (prepared there on first use)")
    parser.add_argument("--time-limit", type=float, default=540.0,
                        help="seconds for the whole run: no side starts that would not fit "
                             "(0: no limit)")
    parser.add_argument("--side-timeout", type=float, default=300.0,
                        help="seconds one side's process may take before it is killed")
    cli = parser.parse_args(argv)
    unknown = [n for n in cli.shapes.split(",") if n not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}: choose from {', '.join(SHAPES)}")
    for value, known, flag in ((cli.ours, {"compiled", "eager"}, "--ours"),
                               (cli.hf, {"compiled", "eager"}, "--hf")):
        if not set(value.split(",")) <= known and not (flag == "--hf" and value == "none"):
            parser.error(f"{flag} {value}: a comma-separated list of compiled, eager"
                         + (" (or none)" if flag == "--hf" else ""))
    if not set(cli.float8.split(",")) <= set(FLOAT8_RECIPES):
        parser.error(f"--float8 {cli.float8}: one or more of {', '.join(FLOAT8_RECIPES)}")
    unknown = [n for n in (cli.float8_shapes or "").split(",") if n and n not in SHAPES]
    if unknown:
        parser.error(f"--float8-shapes: unknown shape(s) {unknown}")
    if cli.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("benchmarks/gpu_vs_hf.py: no CUDA device here; --device cpu runs the same "
                     "comparison on the CPU in fp32 (benchmarks/trainer_vs_hf.py is the CPU one).")
    cli.workdir = Path(cli.workdir or tempfile.mkdtemp(prefix="gpu_vs_hf_")).resolve()
    cli.workdir.mkdir(parents=True, exist_ok=True)
    cli.out = Path(cli.out or cli.workdir / "gpu_vs_hf.json").resolve()
    cli.data_root = Path(cli.data_root).resolve()
    cli.trainer = Path(cli.trainer).resolve()
    if not (cli.trainer / "apps").is_dir():
        parser.error(f"--trainer {cli.trainer}: not a checkout of this project (no apps/ in it)")
    return bench(cli)


if __name__ == "__main__":
    sys.exit(main())
