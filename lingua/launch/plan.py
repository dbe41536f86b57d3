"""Plan a run before submitting it: per-rank memory, FLOPs and time, and whether it fits.

    python -m lingua.plan apps.llama.train config=llama_8b slurm.nodes=8 slurm.gpus_per_node=8
    python -m lingua.plan apps.moe.train config=deepseek_16b ... --world-size 64 --mfu 0.3

The config is validated as the job's (run.validate) for its world size and device, but a missing
corpus, tokenizer or checkpoint.init_from is a `warning:`. The model is built on the meta device
and parallelised with the app's own plan on torch's fake process group at that world size; a
rank's share is read off its parameters' local shards, not a formula. The first rank of each
stage is built (it gets the larger chunks of uneven splits); the busiest rank decides.

Memory (plan_memory): parameters, gradients and optimizer state of the trainable shards (LoRA's
frozen base: storage only), FSDP's gathered buffers, autocast copies, activations
(plan_activations) for the micro-batches in flight; it fits at USABLE_FRACTION of the GPU's
memory; cpu_offload's host memory is not counted. Time: tokens/s = MFU (--mfu) x the dense peak
(metrics.GPU_PEAK_FLOPS) / FLOPs per token (App.flops_per_token, else metrics'). A run that does
not fit is re-planned with the cheapest changes in order (ac=op, ac=full, tp up to 8 in a node,
2x / 4x / 8x the nodes) and the first that fits is named."""

import argparse
import copy
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import torch

from lingua import data
from lingua.data.tokenizer import TokenizerArgs
from lingua.errors import ConfigError
from lingua.launch import run
from lingua.launch.plan_memory import RankPlan, quiet, rank_plan
from lingua.model.layers import head_dim
from lingua.model.moe import moe_layers
from lingua.observe import metrics
from lingua.optim import OPTIMIZERS
from lingua.parallel import distributed, pipeline
from lingua.train import app as app_checks

GIB = 2 ** 30
GPU_MEMORY_GIB = {"H100": 80.0, "H200": 141.0, "A100": 80.0, "B200": 180.0}
USABLE_FRACTION = 0.9   # of the GPU's memory; the rest: CUDA context, NCCL, fragmentation
DEFAULT_MFU = 0.4
# Dense float8 tensor-core FLOP/s over bf16's (data sheets); the A100 has no float8 tensor cores.
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
    moe: bool = False         # the model has MoE layers
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
        # MFU is over the bf16 peak (as torchtitan's); float8 matmuls at FLOAT8_SPEEDUP x it.
        f8 = self.float8_flops_per_token
        return self.mfu * self.peak_flops / (self.flops_per_token - f8 + f8 / FLOAT8_SPEEDUP)

    @property
    def days(self) -> float:
        return self.args.steps * self.tokens_per_step / (self.tokens_per_s_per_gpu *
                                                          self.world_size) / 86400


def host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


@functools.lru_cache(maxsize=None)
def cpu_peak_flops(dtype: str, dim: int) -> float:
    """This CPU's matmul rate on a linear of the model's width, for a CPU job's time estimate."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    return metrics.measure_matmul_peak(2048, dim, 4 * dim, torch_dtype, torch.device("cpu"),
                                       seconds=0.3)["flops_per_s"]


def job_world_size(slurm) -> int:
    """The processes a stool job starts: nodes x tasks per node (0 tasks: one per GPU)."""
    tasks = slurm.tasks_per_node or max(slurm.gpus_per_node, 1)
    return slurm.nodes * tasks


def load_args(app_module: str, overrides: List[str], world_size: Optional[int],
              device_type: str):
    """(app module, args, world size), checked as the job will be but for the data files."""
    app = app_checks.load_app(app_module)
    raw = app.load_config(list(overrides), check=False)
    world = world_size or job_world_size(raw.slurm)
    if world < 1:
        raise ConfigError(f"The world size must be at least 1, got {world}.")
    checked = copy.copy(raw)   # keeps the overrides config.load refused, for run.validate
    init_from = raw.checkpoint.init_from
    if init_from is not None and not Path(init_from).is_dir():   # read by the job, not the plan
        checked.checkpoint = dataclasses.replace(raw.checkpoint, init_from=None)
    try:
        _validate(checked, app, world, device_type)
    except ConfigError as err:
        d = checked.distributed   # the smallest world the degrees fill (dp_shard=-1: ep ranks)
        fits = d.dp_replicate * d.cp * d.tp * d.pp * (d.dp_shard if d.dp_shard > 0 else d.ep)
        if world_size or world != 1 or fits == 1:
            raise
        try:
            _validate(checked, app, fits, device_type)
        except ConfigError:
            raise err from None   # not (only) the world size: the job's own message
        why = "; ".join(p.split(". ")[0].rstrip(".") for p in getattr(err, "problems", [str(err)]))
        raise ConfigError(f"{NO_WORLD_SIZE}, and this layout cannot run on 1 rank ({why}). Give "
                          f"the job's world size: --world-size N, e.g. --world-size {fits}, or "
                          f"slurm.nodes=N slurm.gpus_per_node=G.") from None
    return app, raw, world


NO_WORLD_SIZE = "Planned for 1 rank: no --world-size and no slurm.nodes given"


def _validate(args, app, world: int, device_type: str) -> None:
    with distributed.job_view(world, device_type):
        run.validate(args, app, data_files=False)


def data_warnings(args, app=None) -> List[str]:
    """What a job needs and a plan does without, each problem once: the corpus and its val/, the
    tokenizer file, checkpoint.init_from (App.check_init_from where the app has one)."""
    found, corpus = [], args.data
    init_from = args.checkpoint.init_from
    if app is not None and app.check_init_from is not None:
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
        if not data.loader_class(corpus).checks_need_tokenizer:   # a missing val/ shows too
            corpus = dataclasses.replace(corpus, tokenizer=TokenizerArgs())
    try:
        data.validate_data_args(corpus)
    except ConfigError as err:
        if str(err) not in found:   # the same missing tokenizer file
            found.insert(0, str(err))
    return found


def model_on_meta(args, app) -> torch.nn.Module:
    """The whole model on meta as the trainer builds it, the app's transform_model applied."""
    with torch.device("meta"):
        model = app.model_class(args.model)
    if app.transform_model is not None:
        with quiet():
            app.transform_model(model, args)
    return model


def _flops_per_token(args, app, whole) -> float:
    if app.flops_per_token is not None:
        return app.flops_per_token(args)
    m = args.model
    return metrics.flops_per_token(whole, m.n_layers, m.n_heads * head_dim(m), args.data.seq_len,
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
    per_stage = world // dims.pp   # the first rank of each stage holds the largest shards
    built = [rank_plan(args, app, dims, pp_rank * per_stage, n_mb, microbatch, device_type)
             for pp_rank in range(dims.pp)]
    ranks, flights = [one for one, _ in built], [flight for _, flight in built]
    whole = model_on_meta(args, app)
    n_params = sum(p.numel() for p in whole.parameters())
    n_trainable = sum(p.numel() for p in whole.parameters() if p.requires_grad)
    flops = _flops_per_token(args, app, whole)
    dtype = "bf16" if d.model_dtype == "bf16" else "fp32"
    result = Plan(module=app_module, overrides=overrides, args=args, world_size=world, dims=dims,
                  device_type=device_type, gpu=gpu, gpu_mem_gib=gpu_mem_gib, mfu=mfu, ranks=ranks,
                  n_params=n_params, n_trainable=n_trainable, flops_per_token=flops,
                  peak_flops=metrics.GPU_PEAK_FLOPS[dtype][gpu],
                  tokens_per_step=args.data.batch_size * dims.dp * args.data.grad_accum
                  * args.data.seq_len, microbatch=microbatch, in_flight=flights,
                  float8_flops_per_token=float8_flops_per_token(args, app, whole),
                  moe=bool(moe_layers(whole)))
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
    if world_size is None and world == 1:
        result.notes.append(f"{NO_WORLD_SIZE.lower()}; pass --world-size N (or slurm.nodes=N "
                            f"slurm.gpus_per_node=G) to plan the job at its size")
    if suggest and not result.fits:
        result.suggestion, result.tried = _cheapest_fix(result, gpu, gpu_mem_gib, mfu,
                                                        device_type)
    return result


def lora_rank(args) -> int:
    """The run's LoRA rank (apps/sft's lora.rank); 0 for full training or an app without LoRA."""
    return getattr(getattr(args, "lora", None), "rank", 0) or 0


def float8_flops_per_token(args, app, model) -> float:
    """FLOPs a token of the matmuls distributed.float8 converts in `model` (on meta): 6 x each
    converted Linear's weight (4 x a frozen one's), 6 x the top_k experts' of a converted MoE."""
    if args.distributed.float8 == "none":
        return 0.0
    from lingua import float8
    from lingua.float8 import moe as float8_moe
    from lingua.model.moe import MoE, routed_params_per_token

    convert = app.float8_filter or float8.default_filter
    total = 0.0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and convert(name, m):
            total += (6.0 if m.weight.requires_grad else 4.0) * m.weight.numel()
        elif (isinstance(m, MoE) and convert(f"{name}.experts", m.experts)
              and float8_moe.converts_experts(m.experts)):
            total += 6.0 * routed_params_per_token(m)
    return total


def _candidates(p: Plan) -> list:
    """(overrides to add, world size) by cost: recompute, tp inside a node, more nodes."""
    d, slurm = p.args.distributed, p.args.slurm
    acs = list(dict.fromkeys([d.ac, "op", "full"]))

    def with_ac(extra, ac):
        return extra + ([] if ac == d.ac else [f"distributed.ac={ac}"])

    out = [([f"distributed.ac={ac}"], p.world_size) for ac in acs
           if ac != d.ac and d.ac != "full"]
    node_limit = (slurm.tasks_per_node or slurm.gpus_per_node) if slurm.gpus_per_node else 8
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
        tried.append(f"{label} ({_gib(candidate.busiest.total)} GiB)")
        if candidate.fits:
            return tried[-1], tried
    return None, tried


def _in(unit: int):
    return lambda n: f"{n / unit:.1f}"


_gib = _in(GIB)


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _beside_the_peak(p: Plan, fmt, unit: str) -> list:
    """The busiest rank's optimizer workspace (once activations are freed) and process groups."""
    b, lines = p.busiest, []
    if b.optim_workspace:
        what = OPTIMIZERS[p.args.optim.name].workspace_label
        lines.append(f"  ({what} at the optimizer step, once activations are freed: "
                     f"{fmt(b.optim_workspace)} {unit} a rank)")
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
            (OPTIMIZERS[a.optim.name].label.format(only=only), lambda r: r.optim)]
    if any(r.fsdp for r in shown):
        what = "float8 weights, " if d.float8 == "tensorwise" else ""
        rows.append((f"FSDP gathered ({what}{e_name} root + 2 blocks)", lambda r: r.fsdp))
    if any(r.autocast for r in shown):
        rows.append(("autocast bf16 weight copies", lambda r: r.autocast))
    if any(r.float8 for r in shown):
        experts = ", experts' bf16 copies" if p.moe else ""
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


def _groups_line(p: Plan) -> str:
    """The plan is one replica group's: each group is its own job, with its own shards."""
    n, w, t = p.args.fault_tolerance.replica_groups, p.world_size, p.tokens_per_step
    tps = p.tokens_per_s_per_gpu * w
    return (f"  fault tolerance: {n} replica groups of {w} ranks, {_count(tps * n)} tokens/s and "
            f"{_count(n * t)} tokens a step in all; one group lost: {(n - 1) * w} ranks, "
            f"{_count(tps * (n - 1))} tokens/s, {_count((n - 1) * t)} tokens a step, the same "
            f"{_gib(p.busiest.total)} GiB a rank")


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
        full = p.full_finetune_bytes
        lines.append(f"  LoRA saves {_gib(full - b.total)} GiB a rank against full fine-tuning "
                     f"({_gib(full)} GiB a rank with lora.rank=0)")
    if not p.fits and p.suggestion:
        lines.append(f"  cheapest change that fits: {p.suggestion}")
    elif not p.fits:
        lines.append("  no change tried fits (ac=op/full, tp up to 8 in a node, up to 8x the "
                     "nodes): lower data.batch_size or data.seq_len, or add pp")
    tps, each = p.tokens_per_s_per_gpu, "a GPU" if p.device_type == "cuda" else "a process"
    peak = (f"{p.peak_flops / 1e12:.0f} TFLOP/s" if p.peak_flops >= 1e12 else
            f"{p.peak_flops / 1e9:.0f} GFLOP/s")
    lines.append(f"at {p.mfu:.0%} MFU ({p.gpu} {e_name} peak {peak}): "
                 f"{tps:,.0f} tokens/s {each}, {_count(tps * p.world_size)} tokens/s; "
                 f"{_count(p.tokens_per_step)} tokens a step, {a.steps} steps = "
                 f"{_count(a.steps * p.tokens_per_step)} tokens in {_duration(p.days * 86400)}")
    if a.fault_tolerance.enabled:
        lines.append(_groups_line(p))
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
    return format_plan(plan(app_module, list(overrides), world_size, device_type, gpu, gpu_mem_gib,
                            mfu))


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
