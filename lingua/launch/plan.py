"""Plan a run before submitting it: per-rank memory, FLOPs and time, and whether it fits.

    python -m lingua.plan apps.llama.train config=llama_8b slurm.nodes=8 slurm.gpus_per_node=8
    python -m lingua.plan apps.moe.train config=deepseek_16b ... --world-size 64 --mfu 0.3

The config is composed as the job's (the app's `load_config`) and validated for the job's world
size and device (lingua.launch.run.validate), but without the data: whether a run fits is asked
before the corpus is downloaded, so a missing data.root, tokenizer file or val/ directory is a
`warning:` line (stool refuses them before submitting) and the vocabulary is model.vocab_size. Then,
in this one process and without a GPU, the real model is built on the meta device and parallelised
with the app's own plan (`APP.parallelize`: TP, CP, EP, activation checkpointing, FSDP;
`pipeline.split_model` for each pipeline rank's stages) on torch's fake process group at the job's
world size. What a rank holds is read off the local shards of its parameters (DTensor `to_local()`
shapes), never computed from a formula: a sharding plan that leaves a layer replicated shows up
here as memory. compile, async_tp and cpu_offload are left out of the build (they change no shard).
Each pipeline rank is built (the first rank of each pipeline stage, which holds the largest FSDP /
TP shard of uneven splits: torch gives the first ranks the larger chunks); expert parallelism gives
every rank the same number of experts. The busiest rank decides.

Memory of a rank, in bytes (what is counted, and what is assumed):
  parameters   local shards, as stored: fp32 master weights (model_dtype bf16 or fp32), plus the
               buffers (RoPE tables, expert bias);
  gradients    the same shapes and dtype as the parameters (FSDP reduces in fp32 into fp32
               sharded gradients), of the trainable ones: a frozen weight (LoRA's base, apps/sft)
               is stored and sharded like the rest, with no gradient and no optimizer state;
  optimizer    AdamW: two moments of each trainable local parameter in its dtype (8 bytes per
               fp32 param);
  FSDP buffers compute-dtype copies gathered by FSDP (sizes read from the shards times the FSDP
               degree): the root unit (embeddings, final norm, output; kept gathered for the
               whole step, reshard_after_forward=False) and two blocks in flight (the one computing
               and the one prefetched; every block with reshard_after_forward=false), plus the
               unsharded gradients of the root and of one block in compute dtype and that block's
               fp32 reduce-scatter input;
  autocast     bf16 layouts without FSDP (one process, tp only, pp only, tp x pp) compute through
               autocast, whose bf16 copy of every matmul weight is kept for backward;
  activations  the estimate below, for the micro-batches in flight on this rank;
and the rank fits when the sum is at most 90% of the GPU's memory (the rest is the CUDA context,
NCCL's buffers and the caching allocator's fragmentation). With distributed.cpu_offload the
parameters, gradients and optimizer state live in host memory and are listed, not counted.

Activations (lingua.launch.plan_activations): bytes kept per token and per block between forward and
backward, counted from what lingua.model.layers's blocks and lingua.model.moe's MoE layer save
(the Megatron-style per-layer accounting of Korthikanti et al. 2022, redone for this code: RMSNorm
in fp32 with its written-out backward, GQA attention whose keys and values are repeated to all
heads before flash attention on GPU (on CPU sdpa groups them itself: `grouped_kv`, which the
tests measure), SwiGLU, torch's TP + sequence parallel, and the op-level checkpointing policy of
lingua.parallel.distributed). tests/test_plan.py measures the live tensors of real blocks on CPU
(dense and MoE, bf16, fp32 and autocast, every ac mode, tp 1 and 2) and checks this formula against
them. Assumptions: a flash/memory-efficient attention kernel (no seq x seq matrix, as on GPU),
MoE routing balanced across experts and EP ranks (an overloaded EP rank receives more rows), no
CPU expert padding (bf16 / fp16 MoE on CPU pads each expert's rows to a multiple of
lingua.model.moe.CPU_GROUP_ROWS: at most 10% more expert rows kept; the plan is for GPUs), no
torch.compile fusion (compile only lowers it, the loss's fp32 logits included, which compiled
runs do not keep: see BENCHMARKS.md, "MFU and memory of llama_1b on one H100"); context
parallelism adds the all-gathered keys and values of the whole sequence (not measured). Under
autocast the residual stream is fp32 and each matmul keeps its own bf16 copy of its input (wq,
wk, wv: three). Per rank: the layers it holds x the micro-batches in flight (1 without
pipelining; with pp: GPipe all, 1F1B pp - pp_rank, interleaved (v-1) x pp + 2 (pp - 1 - pp_rank)
+ 1 chunks as in torch's schedule) + one block recomputed in backward (ac != none) + the last
stage's output: the gathered input of the output projection, the bf16 logits, their fp32 copy
and fp32 log-probs (vocabulary / tp with loss parallel). With tp > 1, torch's TP keeps the
all-gathered (full-sequence) inputs of attention and FFN, and ac=op also keeps the
full-sequence partial sums of wo and w2 (op keeps every matmul's output): so under tp, ac=op can
keep MORE than ac=none, and ac=full is the one that shrinks activations. Frozen Linears and LoRA
adapters (plan_activations.lora_activation_bytes, measured on CPU in fp32): a frozen weight keeps
no input for its gradient, an adapter its rank-wide middle (and, under ac=op, B's output).
For a LoRA run the plan also prints the busiest rank of the same run at lora.rank=0 (full
fine-tuning), and checkpoint.init_from need not exist (a warning, as for the data).

FLOPs per token are the app's (`APP.flops_per_token`, else lingua.observe.metrics.flops_per_token
of the model after APP.transform_model, the numbers MFU is logged with: 4 x a frozen matmul
parameter, 6 x a trainable one); tokens/s = MFU x peak / FLOPs per token, with the dense bf16 (or
fp32) peak of lingua.observe.metrics.GPU_PEAK_FLOPS. The MFU is an assumption (--mfu, default 40%),
not a measurement: pipeline bubbles and communication are in it.

When the run does not fit, the planner re-plans the cheapest changes in order (ac=op, ac=full,
a larger tp inside a node up to 8 with each ac, then 2x / 4x / 8x the nodes with each ac) and
names the first that fits.
"""

import argparse
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

from lingua import config, data
from lingua.data.tokenizer import TokenizerArgs
from lingua.errors import ConfigError
from lingua.launch import run
from lingua.launch.plan_memory import RankPlan, quiet, rank_plan
from lingua.observe import metrics
from lingua.parallel import distributed, pipeline
from lingua.train import app as app_checks

GIB = 2 ** 30
# Memory per GPU (GiB) when --gpu-mem-gib is not given: the 80 GB parts and the larger ones.
GPU_MEMORY_GIB = {"H100": 80.0, "H200": 141.0, "A100": 80.0, "B200": 180.0}
USABLE_FRACTION = 0.9   # of the GPU's memory; the rest: CUDA context, NCCL, fragmentation
DEFAULT_MFU = 0.4
# Dense float8 tensor-core FLOP/s over bf16's on the data sheets (H100/H200 1979 vs 989, B200 4500
# vs 2250); the A100 has no float8 tensor cores, and torchao's float8 needs compute capability 8.9.
FLOAT8_SPEEDUP = 2.0
NO_FLOAT8 = {"A100"}


@dataclass
class Plan:
    module: str
    overrides: List[str]
    args: object
    world_size: int
    dims: object
    device_type: str
    gpu: str
    gpu_mem_gib: float
    mfu: float
    ranks: List[RankPlan]
    n_params: int             # the whole model's parameters
    n_trainable: int          # of those, the ones that train (LoRA: the adapters)
    flops_per_token: float
    peak_flops: float
    tokens_per_step: int
    microbatch: int           # sequences per micro-batch
    in_flight: List[float]    # micro-batches (pipeline chunks) in flight per pipeline rank
    float8_flops_per_token: float = 0.0   # of flops_per_token: the matmuls float8 converts
    full_finetune_bytes: Optional[int] = None   # LoRA: the busiest rank at lora.rank=0
    notes: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)   # data a job needs and this plan does not
    suggestion: Optional[str] = None    # the cheapest change that fits, when this does not
    tried: List[str] = field(default_factory=list)

    @property
    def busiest(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def usable_bytes(self) -> float:
        return self.gpu_mem_gib * GIB * USABLE_FRACTION

    @property
    def fits(self) -> bool:
        return self.busiest.total <= self.usable_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        # MFU is over the bf16 peak (as torchtitan reports it); the converted matmuls run at the
        # float8 rate, the same fraction of a peak FLOAT8_SPEEDUP times higher.
        f8 = self.float8_flops_per_token
        return self.mfu * self.peak_flops / (self.flops_per_token - f8 + f8 / FLOAT8_SPEEDUP)

    @property
    def days(self) -> float:
        return self.args.steps * self.tokens_per_step / (self.tokens_per_s_per_gpu *
                                                          self.world_size) / 86400


# ---------------------------------------------------------------------------------------------
# Planning


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


@functools.lru_cache(maxsize=None)
def cpu_peak_flops(dtype: str, dim: int) -> float:
    """This CPU's matmul rate on a linear of the model's width (as a CPU run's MFU is measured:
    lingua.observe.metrics.run_peak), for a CPU job's time estimate."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    return metrics.measure_matmul_peak(2048, dim, 4 * dim, torch_dtype, torch.device("cpu"),
                                       seconds=0.3)["flops_per_s"]


def job_world_size(slurm) -> int:
    """The processes a stool job starts: nodes x tasks per node (0 tasks: one per GPU)."""
    tasks = slurm.tasks_per_node or max(slurm.gpus_per_node, 1)
    return slurm.nodes * tasks


def load_args(app_module: str, overrides: List[str], world_size: Optional[int],
              device_type: str):
    """(app module, validated args, world size): composed and checked as the job will be, but
    for the corpus and tokenizer files (data_warnings)."""

    app = config.import_app(app_module)
    if not hasattr(app, "APP"):
        raise ConfigError(f"{app_module} has no APP (a lingua.train.app.App): the planner "
                          f"builds the model and its parallel plan from it, as the trainer does.")
    raw = app.load_config(list(overrides), check=False)
    world = world_size or job_world_size(raw.slurm)
    if world < 1:
        raise ConfigError(f"The world size must be at least 1, got {world}.")
    checked = raw
    init_from = raw.checkpoint.init_from
    if init_from is not None and not Path(init_from).is_dir():
        # The weights to fine-tune from are read by the job, not by the plan (data_warnings).
        checked = dataclasses.replace(raw, checkpoint=dataclasses.replace(raw.checkpoint,
                                                                          init_from=None))
    with distributed.job_view(world, device_type):
        run.validate(checked, app.APP, data_files=False)
    return app, raw, world


def data_warnings(args, app=None) -> List[str]:
    """What a job would refuse to start without and a plan does without: the corpus (data.root,
    its val/), the tokenizer file and the checkpoint.init_from directory (the app module's own
    check_init_from where it has one: apps/sft's), each problem once."""

    found, corpus = [], args.data
    init_from = args.checkpoint.init_from
    if getattr(app, "check_init_from", None) is not None:
        try:
            app.check_init_from(args)
        except ConfigError as err:
            found.append(str(err))
    elif init_from is not None and not Path(init_from).is_dir():
        found.append(f"checkpoint.init_from={init_from} is not a directory. Give a Hugging Face "
                     f"model directory (config.json + *.safetensors).")
    try:
        app_checks.check_vocab(args)
    except ConfigError as err:
        found.append(str(err))
        if corpus.format == "jsonl":   # its checks need no tokenizer: a missing val/ shows too
            corpus = dataclasses.replace(corpus, tokenizer=TokenizerArgs())
    try:
        data.validate_data_args(corpus)
    except ConfigError as err:
        if str(err) not in found:   # the same missing tokenizer file
            found.insert(0, str(err))
    return found


def model_on_meta(args, app) -> torch.nn.Module:
    """The whole model on the meta device as the trainer builds it: the app's transform_model
    applied (apps/sft: LoRA adapters, the base frozen)."""
    with torch.device("meta"):
        model = app.APP.model_class(args.model)
    if app.APP.transform_model is not None:
        with quiet():
            app.APP.transform_model(model, args)
    return model


def _flops_per_token(args, app, model) -> float:
    """`model`: the whole model on the meta device (model_on_meta)."""
    if app.APP.flops_per_token is not None:
        return app.APP.flops_per_token(args)
    m = args.model
    return metrics.flops_per_token(model, m.n_layers, m.dim, args.data.seq_len,
                                   m.tie_embeddings)


def plan(app_module: str, overrides: List[str], world_size: Optional[int] = None,
         device_type: str = "cuda", gpu: str = "H100", gpu_mem_gib: Optional[float] = None,
         mfu: float = DEFAULT_MFU, suggest: bool = True) -> Plan:
    """Build the run at its world size on the fake process group and account each rank."""

    if gpu not in GPU_MEMORY_GIB:
        raise ConfigError(f"--gpu {gpu}: known GPUs are {', '.join(GPU_MEMORY_GIB)}.")
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu}: give a fraction between 0 and 1, e.g. 0.4.")
    given_mem_gib = gpu_mem_gib
    gpu_mem_gib = gpu_mem_gib or GPU_MEMORY_GIB[gpu]
    overrides = list(overrides)
    app, args, world = load_args(app_module, overrides, world_size, device_type)
    d = args.distributed
    if d.float8 != "none" and gpu in NO_FLOAT8:
        raise ConfigError(f"distributed.float8={d.float8} on the {gpu}: it has no float8 tensor "
                          f"cores (torchao's float8 needs an H100 or newer). Plan for --gpu H100, "
                          f"or set distributed.float8=none.")
    dims = distributed.parallel_dims(d, world)
    n_mb, microbatch = 1, args.data.batch_size
    if dims.pp > 1:
        n_mb = d.pp_microbatches or pipeline.default_microbatches(d.pp, d.pp_virtual_stages)
        microbatch = args.data.batch_size // n_mb
    ranks, flights = [], []
    per_stage = world // dims.pp
    for pp_rank in range(dims.pp):   # the first rank of each stage holds the largest shards
        one, flight = rank_plan(args, app.APP, dims, pp_rank * per_stage, n_mb, microbatch,
                                device_type)
        ranks.append(one)
        flights.append(flight)
    whole = model_on_meta(args, app)
    n_params = sum(p.numel() for p in whole.parameters())
    n_trainable = sum(p.numel() for p in whole.parameters() if p.requires_grad)
    dtype = "bf16" if d.model_dtype == "bf16" else "fp32"
    result = Plan(module=app_module, overrides=overrides, args=args, world_size=world, dims=dims,
                  device_type=device_type, gpu=gpu, gpu_mem_gib=gpu_mem_gib, mfu=mfu, ranks=ranks,
                  n_params=n_params, n_trainable=n_trainable,
                  flops_per_token=_flops_per_token(args, app, whole),
                  peak_flops=metrics.GPU_PEAK_FLOPS[dtype][gpu],
                  tokens_per_step=args.data.batch_size * dims.dp * args.data.grad_accum
                  * args.data.seq_len, microbatch=microbatch, in_flight=flights,
                  float8_flops_per_token=float8_flops_per_token(args, app, whole))
    if suggest:   # the candidates of _cheapest_fix change the layout only, not the data
        result.warnings = data_warnings(args, app)
    if suggest and lora_rank(args):   # what the adapters save: the same run, every weight trained
        full = plan(app_module, overrides + ["lora.rank=0"], world, device_type, gpu,
                    gpu_mem_gib, mfu, suggest=False)
        result.full_finetune_bytes = full.busiest.total
    if device_type == "cpu":   # a CPU job: this machine's memory and measured matmul rate
        result.gpu = "this machine's CPU"
        result.gpu_mem_gib = given_mem_gib or host_memory_gib()
        result.peak_flops = cpu_peak_flops(dtype, args.model.dim)
        result.notes.append("planned for cpu: the memory is this machine's RAM and the peak its "
                            "own measured matmul rate; a cluster node's CPU may differ")
    if suggest and not result.fits:
        result.suggestion, result.tried = _cheapest_fix(result, gpu, gpu_mem_gib, mfu,
                                                        device_type)
    return result


def lora_rank(args) -> int:
    """The run's LoRA rank (apps/sft's lora.rank); 0 for full training or an app without LoRA."""
    return getattr(getattr(args, "lora", None), "rank", 0) or 0


def float8_flops_per_token(args, app, model) -> float:
    """FLOPs a token of the matmuls distributed.float8 converts in `model` (the whole model on
    the meta device): 6 x each converted Linear's weight (its forward and both backward
    matmuls; 4 x a frozen one's, which has no weight gradient), and 6 x the weights of the
    top_k experts a token meets in each MoE whose experts are converted, picked as the trainer
    picks them."""
    if args.distributed.float8 == "none":
        return 0.0
    from lingua import float8
    from lingua.float8 import moe as float8_moe
    from lingua.model.moe import MoE

    convert = getattr(app.APP, "float8_filter", None) or float8.default_filter
    total = 0.0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and convert(name, m):
            total += (6.0 if m.weight.requires_grad else 4.0) * m.weight.numel()
        elif (isinstance(m, MoE) and convert(f"{name}.experts", m.experts)
              and float8_moe.converts_experts(m.experts)):
            total += 6.0 * m.top_k * sum(w[0].numel() for w in (m.experts.w1, m.experts.w2,
                                                                 m.experts.w3))
    return total


def _candidates(p: Plan) -> list:
    """(overrides to add, world size) in the order of cost: recompute, then tp inside a node,
    then more nodes."""
    d, slurm = p.args.distributed, p.args.slurm
    acs = list(dict.fromkeys([d.ac, "op", "full"]))

    def with_ac(extra, ac):
        return extra + ([] if ac == d.ac else [f"distributed.ac={ac}"])

    out = [([f"distributed.ac={ac}"], p.world_size) for ac in acs
           if ac != d.ac and d.ac != "full"]
    per_node = slurm.tasks_per_node or max(slurm.gpus_per_node, 1)
    node_limit = per_node if slurm.gpus_per_node else 8
    for tp in (2, 4, 8):
        if tp > d.tp and tp <= node_limit:
            out += [(with_ac([f"distributed.tp={tp}"], ac), p.world_size) for ac in acs]
    for factor in (2, 4, 8):
        world = p.world_size * factor
        nodes = [f"slurm.nodes={slurm.nodes * factor}"] if p.world_size == job_world_size(slurm) \
            else []
        out += [(with_ac(nodes, ac), world) for ac in acs]
    return out


def _cheapest_fix(p: Plan, gpu, gpu_mem_gib, mfu, device_type) -> tuple:
    tried = []
    for extra, world in _candidates(p):
        label = " ".join(extra + ([f"--world-size {world}"] if world != p.world_size and not
                                  any(x.startswith("slurm.nodes") for x in extra) else []))
        try:
            candidate = plan(p.module, p.overrides + extra, world, device_type, gpu, gpu_mem_gib,
                             mfu, suggest=False)
        except ConfigError:
            continue
        tried.append(f"{label} ({candidate.busiest.total / GIB:.1f} GiB)")
        if candidate.fits:
            return f"{label} ({candidate.busiest.total / GIB:.1f} GiB)", tried
    return None, tried


# ---------------------------------------------------------------------------------------------
# Text


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _in(unit: int):
    return lambda n: f"{n / unit:.1f}"


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _beside_the_peak(p: Plan, fmt, unit: str) -> list:
    """Lines on what the busiest rank needs besides its peak: Muon's workspace (its optimizer
    step runs once the activations are freed) and its process groups."""
    b, lines = p.busiest, []
    if b.ns_workspace:
        lines.append(f"  (Muon's Newton-Schulz at the optimizer step, once activations are freed: "
                     f"{fmt(b.ns_workspace)} {unit} a rank)")
    if p.world_size > 1:
        lines.append(f"  process groups a rank joins: {b.process_groups}, the default one included "
                     f"(one NCCL communicator each; a set of ranks that another group or a size-1 "
                     f"dimension already has gets none of its own)")
    return lines


def _memory_rows(p: Plan, shown: list, e_name: str) -> list:
    """(label, bytes of a RankPlan) for each line of the memory table."""
    a, d = p.args, p.args.distributed
    only = ", trainable only" if p.n_trainable < p.n_params else ""
    rows = [("parameters (fp32 shards + buffers)" if e_name == "bf16" else "parameters (+ buffers)",
             lambda r: r.params + r.buffers),
            ("gradients (trainable only)" if only else "gradients", lambda r: r.grads),
            (f"AdamW moments (2 x fp32{only})" if a.optim.name != "muon"
             else f"optimizer state (Muon 1x, AdamW 2x{only})", lambda r: r.optim)]
    if any(r.fsdp for r in shown):
        what = "float8 weights, " if d.float8 == "tensorwise" else ""
        rows.append((f"FSDP gathered ({what}{e_name} root + 2 blocks)", lambda r: r.fsdp))
    if any(r.autocast for r in shown):
        rows.append(("autocast bf16 weight copies", lambda r: r.autocast))
    if any(r.float8 for r in shown):
        experts = ", experts' bf16 copies" if getattr(a.model, "n_experts", 0) else ""
        rows.append((f"float8 casts (a block's weights, scales{experts})", lambda r: r.float8))
    rows.append((f"activations (ac={d.ac})", lambda r: r.activations))
    rows.append(("total", lambda r: r.total))
    return rows


def _model_line(p: Plan) -> str:
    trained = ""
    if p.n_trainable < p.n_params:
        a = p.args
        lora = (f": LoRA rank {a.lora.rank} on {', '.join(a.lora.targets)}" if lora_rank(a)
                else "")
        trained = f" ({_count(p.n_trainable)} trainable{lora}; the rest frozen)"
    return (f"  model: {_count(p.n_params)} parameters{trained}, "
            f"{p.flops_per_token:.3g} FLOPs/token")


def format_plan(p: Plan) -> str:
    a, d, dims = p.args, p.args.distributed, p.dims
    e_name = "bf16" if d.model_dtype == "bf16" else "fp32"
    lines = [f"plan: {p.module} {' '.join(p.overrides)}".rstrip()]
    lines.append(f"  {p.world_size} ranks: dp_replicate={dims.dp_replicate} "
                 f"dp_shard={dims.dp_shard} cp={dims.cp} tp={dims.tp} pp={dims.pp}"
                 + (f" ep={d.ep}" if d.ep > 1 else "")
                 + f", ac={d.ac}, {e_name} compute, micro-batch {p.microbatch} x "
                 f"{a.data.seq_len} tokens" + (f" ({p.in_flight[0]:g} in flight on pp rank 0,"
                                               f" {d.pp_schedule})" if dims.pp > 1 else ""))
    lines.append(_model_line(p))
    shown = p.ranks if len(p.ranks) <= 8 else [p.ranks[0], p.busiest, p.ranks[-1]]
    shown = list({r.rank: r for r in shown}.values())
    heads = [f"rank {r.rank}" + (f" (pp {r.pp_rank})" if dims.pp > 1 else "") for r in shown]
    width = max(10, *(len(h) for h in heads))
    rows = _memory_rows(p, shown, e_name)
    label_w = max(len(r[0]) for r in rows) + 2
    unit, fmt = ("GiB", _in(GIB)) if p.busiest.total >= GIB else ("MiB", _in(2 ** 20))
    lines.append(f"  {unit + ' per rank':<{label_w}}" + "".join(f"{h:>{width + 2}}" for h in heads))
    for label, get in rows:
        lines.append(f"  {label:<{label_w}}" + "".join(f"{fmt(get(r)):>{width + 2}}"
                                                      for r in shown))
    if any(r.offloaded for r in shown):
        lines.append(f"  (in host memory, cpu_offload: {fmt(p.busiest.offloaded)} {unit} a rank)")
    b = p.busiest
    lines += _beside_the_peak(p, fmt, unit)
    verdict = "fits" if p.fits else "does not fit"
    lines.append(f"{verdict}: {fmt(b.total)} {unit} on rank {b.rank} of {_gib(p.usable_bytes)} GiB "
                 f"usable ({USABLE_FRACTION:.0%} of {p.gpu_mem_gib:.3g} GiB, {p.gpu})")
    if p.full_finetune_bytes is not None:
        lines.append(f"  LoRA saves {_gib(p.full_finetune_bytes - b.total)} GiB a rank against "
                     f"full fine-tuning ({_gib(p.full_finetune_bytes)} GiB a rank with "
                     f"lora.rank=0)")
    if not p.fits:
        if p.suggestion:
            lines.append(f"  cheapest change that fits: {p.suggestion}")
        else:
            lines.append("  no change tried fits (ac=op/full, tp up to 8 in a node, up to 8x the "
                         "nodes): lower data.batch_size or data.seq_len, or add pp")
    tps = p.tokens_per_s_per_gpu
    total_tokens = a.steps * p.tokens_per_step
    each = "a GPU" if p.device_type == "cuda" else "a process"
    peak = (f"{p.peak_flops / 1e12:.0f} TFLOP/s" if p.peak_flops >= 1e12 else
            f"{p.peak_flops / 1e9:.0f} GFLOP/s")
    lines.append(f"at {p.mfu:.0%} MFU ({p.gpu} {e_name} peak {peak}): "
                 f"{tps:,.0f} tokens/s {each}, {_count(tps * p.world_size)} tokens/s; "
                 f"{_count(p.tokens_per_step)} tokens a step, {a.steps} steps = "
                 f"{_count(total_tokens)} tokens in {_duration(p.days * 86400)}")
    if p.float8_flops_per_token:
        lines.append(f"  (float8 {d.float8}: {p.float8_flops_per_token / p.flops_per_token:.0%} "
                     f"of the FLOPs at {FLOAT8_SPEEDUP:g}x the bf16 rate; MFU stays over the "
                     f"bf16 peak)")
    lines.append("  (shards read from the model built on the fake process group; activations "
                 "estimated per block, see lingua/launch/plan.py)")
    lines += [f"  note: {n}" for n in p.notes]
    if p.warnings:   # planned all the same: the model's size does not depend on the data
        lines += [f"warning: {w}" for w in p.warnings]
        lines.append(f"  (planned without them, with model.vocab_size={a.model.vocab_size}; "
                     f"the job and stool refuse to start until they are fixed)")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    """In the unit that fits: 40 s, 25 minutes, 7.5 hours, 3.2 days."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} minutes"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} hours"
    return f"{seconds / 86400:.1f} days"


def report_text(app_module: str, overrides: list, world_size: int, device_type: str = "cuda",
                gpu: str = "H100", gpu_mem_gib: Optional[float] = None,
                mfu: float = DEFAULT_MFU) -> str:
    """The text `python -m lingua.plan` prints, for stool's dry run."""
    return format_plan(plan(app_module, list(overrides), world_size, device_type, gpu,
                            gpu_mem_gib, mfu))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lingua.plan",
        description="Per-rank memory, FLOPs and time of a run at its world size, built on the "
                    "fake process group (no GPU needed). Exit code 0: fits, 1: does not fit, "
                    "2: bad config.")
    parser.add_argument("module", help="the app's train module, e.g. apps.llama.train")
    parser.add_argument("overrides", nargs="*", help="config overrides as for the train module")
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes (default: slurm.nodes x slurm.tasks_per_node, or one "
                             "per GPU from slurm.gpus_per_node)")
    parser.add_argument("--gpu", default="H100", choices=sorted(GPU_MEMORY_GIB),
                        help="peak FLOP/s and default memory (default H100)")
    parser.add_argument("--gpu-mem-gib", type=float, default=None,
                        help="memory per GPU in GiB (default: the GPU's, 80 for H100)")
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                        help="assumed model FLOPs utilisation for the time estimate (0.4)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="the job's device, for validation (default cuda)")
    ns = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    try:
        result = plan(ns.module, ns.overrides, ns.world_size, ns.device, ns.gpu, ns.gpu_mem_gib,
                      ns.mfu)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_plan(result))
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
