"""Training metrics: FLOPs and MFU, memory, and where they go (stdout, metrics.jsonl, wandb). MFU's
peak (`Peak`, dump_dir/peak.json: a data sheet's or measured per run, never cached) and when mfu is
null: docs/observing.md, "Metrics and MFU"."""

import collections
import json
import logging
import math
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Dense (non-sparse) peak FLOP/s per GPU from the vendors' data sheets (SXM parts).
GPU_PEAK_FLOPS = {
    "bf16": {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12},
    "fp32": {"H100": 67e12, "H200": 67e12, "A100": 19.5e12, "B200": 80e12},  # without TF32
}


@dataclass
class LoggingArgs:
    every: int = 1                  # a line to stdout and metrics.jsonl every N steps
    wandb: bool = False
    wandb_project: str = "lingua"
    wandb_entity: Optional[str] = None
    wandb_mode: str = "offline"     # offline | online (online needs WANDB_API_KEY in the env)
    name: Optional[str] = None      # run name (defaults to the dump_dir's name)
    quiet: bool = False             # no progress lines on stderr (python -m apps.<app>.eval)


def flops_per_token(model: nn.Module, n_layers: int, attn_width: int, seq_len: int,
                    tied_embeddings: bool = False) -> float:
    """6 x trainable + 4 x frozen (LoRA's base: no weight grad) nn.Linear matrices (no bias, tied
    output once, no embedding), plus attention's QK^T and AV (PaLM's: as if not causal)."""
    matrices = [p for m in model.modules() if isinstance(m, nn.Linear)
                for p in m.parameters(recurse=False) if p.dim() >= 2]
    if tied_embeddings:  # the output matmul reuses the embedding matrix, but still costs FLOPs
        matrices.append(model.tok_embeddings.weight)
    trainable = sum(p.numel() for p in matrices if p.requires_grad)
    frozen = sum(p.numel() for p in matrices if not p.requires_grad)
    return 6.0 * trainable + 4.0 * frozen + 12.0 * n_layers * attn_width * seq_len


# A measured matmul's work is capped (its rows cut) to stay well under a second on a CPU.
MAX_MEASURED_FLOPS = 2e10
MIN_MEASURED_ROWS = 64
PEAK_NAME = "peak.json"


def largest_linear(parts) -> Optional[tuple]:
    """(in, out) features of the parts' largest nn.Linear (a DTensor's logical shape), or None."""
    shapes = [tuple(m.weight.shape) for part in parts for m in part.modules()
              if isinstance(m, nn.Linear)]
    if not shapes:
        return None
    out_features, in_features = max(shapes, key=lambda s: s[0] * s[1])
    return in_features, out_features


def measure_matmul_peak(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
                        seconds: float = 0.5, max_repeats: int = 50) -> dict:
    """Best FLOP/s of an [m, k] x [k, n] matmul: after two warm-up calls, the fastest of 3 to
    `max_repeats` timed calls within `seconds` (other load only slows a call)."""
    # A generator of its own: the global one is the run's (checkpointed, resumed).
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(m, k, dtype=dtype, device=device, generator=gen)
    b = torch.randn(k, n, dtype=dtype, device=device, generator=gen)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    best, repeats, deadline = math.inf, 0, time.perf_counter() + seconds
    while repeats < 3 or (repeats < max_repeats and time.perf_counter() < deadline):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
        repeats += 1
    return {"flops_per_s": 2.0 * m * k * n / best, "best_s": best, "repeats": repeats}


def measure_cpu_peak(dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Best FLOP/s of a 1024^3 matmul on this CPU (benchmarks; runs use the model's shape)."""
    n = 1024
    return measure_matmul_peak(n, n, n, dtype, torch.device("cpu"), seconds, 1000)["flops_per_s"]


# Native bf16 matmuls on CPU: x86's AVX512-BF16 or AMX, Arm's BF16 extension (hwcap "bf16").
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Optional[frozenset]:
    """This CPU's /proc/cpuinfo flags ("flags" on x86, "Features" on Arm); None without (macOS)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def cpu_bf16_emulated() -> bool:
    """True where this CPU has no bf16 instructions (emulated: 30-100x slower than fp32)."""
    flags = cpu_flags()
    return flags is not None and not flags & BF16_CPU_FLAGS


_warned = set()


def warn_once(key: str, message: str) -> None:
    """A warning logged once per process, by rank 0 only (every rank would say the same)."""
    if key in _warned:
        return
    _warned.add(key)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message)


def mfu(flops_per_s: float, peak) -> Optional[float]:
    """Model FLOP/s over the peak, or None where no honest number exists (see mfu_fields)."""
    return mfu_fields(flops_per_s, peak)["mfu"]


def mfu_fields(flops_per_s: float, peak) -> dict:
    """A row's {"mfu": value}; above 1, {"mfu": None, "mfu_above_peak": the ratio} and a
    warning. The peak is never changed here: every row of a run is divided by the same one."""
    flops = peak.flops_per_s if isinstance(peak, Peak) else peak
    if not flops:
        return {"mfu": None}
    value = flops_per_s / flops
    value = value if math.isfinite(value) else math.inf
    if value <= 1:
        return {"mfu": value}
    where = f"The peak's record is {peak.path}. " if getattr(peak, "path", None) else ""
    warn_once("mfu_above_1",
              f"MFU came out at {100 * value:.0f}% of the peak ({_show_flops(flops)} per device), "
              f"which no run reaches: that peak is not credible for this hardware, so such MFU "
              f"values are logged as null (the ratio as mfu_above_peak). {where}On a GPU the "
              f"peak is the data-sheet value in lingua.observe.metrics.GPU_PEAK_FLOPS; on CPU it "
              f"is measured before each run's loop on a matmul of the model's shape (a machine "
              f"busy with other work then gives a low peak): run again on an idle machine.")
    return {"mfu": None, "mfu_above_peak": value}


def _show_flops(value: float) -> str:
    return f"{value / 1e12:.1f} TFLOP/s" if value >= 1e12 else f"{value / 1e9:.1f} GFLOP/s"


@dataclass
class Peak:
    """The peak FLOP/s one device's MFU is divided by, and how it was obtained: rank 0 writes it to
    dump_dir/peak.json before the loop (a resumed run's earlier entries under "earlier")."""
    flops_per_s: Optional[float]   # None: no credible peak, mfu is logged as null
    source: str                    # "datasheet" | "measured" | "none"
    dtype: str                     # the run's distributed.model_dtype
    device: str                    # "NVIDIA H100 80GB HBM3", "cpu x86_64, 2 threads"
    matmul: Optional[list] = None  # [tokens, in, out] of the measured matmul (measured only)
    best_s: Optional[float] = None
    repeats: int = 0               # timed calls, all rounds together
    rounds: Optional[list] = None  # each round's best FLOP/s; flops_per_s is their maximum
    measured_at: str = ""          # ISO time of the measurement (or of the data-sheet lookup)
    from_step: int = 0             # the run's first step with this peak
    note: str = ""
    path: Optional[Path] = None    # where peak.json goes (rank 0), None elsewhere

    def write(self, earlier: list) -> None:
        record = {k: v for k, v in self.__dict__.items() if k != "path"}
        _write_atomic(self.path, json.dumps({**record, "earlier": earlier}, indent=1) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def run_peak(device: torch.device, dtype_name: str, parts=(), tokens: int = 1024,
             step: int = 0, dump_dir=None) -> Peak:
    """The run's `Peak` (module docstring), measured over `tokens`; with dump_dir, in peak.json."""
    peak = _obtain_peak(device, dtype_name, parts, tokens)
    peak.from_step = step
    if dump_dir is not None:
        peak.path = Path(dump_dir) / PEAK_NAME
        peak.write(_earlier_peaks(peak.path))
    if peak.flops_per_s is not None:
        how = (f"{peak.source} on a {'x'.join(map(str, peak.matmul))} matmul (tokens x the "
               f"model's largest linear), best of {len(peak.rounds)} rounds of "
               f"{peak.repeats} calls in all" if peak.source == "measured"
               else peak.source)
        logger.info("MFU peak: %s %s on %s, %s%s", _show_flops(peak.flops_per_s), dtype_name,
                    peak.device, how, f" (recorded in {peak.path})" if peak.path else "")
    return peak


def _earlier_peaks(path: Path) -> list:
    """peak.json's entries from the runs before this one in the same dump_dir (resumes)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return old.pop("earlier", []) + [old] if isinstance(old, dict) else []


def _obtain_peak(device: torch.device, dtype_name: str, parts, tokens: int) -> Peak:
    if device.type == "cpu" and dtype_name == "bf16" and cpu_bf16_emulated():
        warn_once("bf16_emulated",
                  "distributed.model_dtype=bf16 on a CPU without bf16 instructions (no "
                  "avx512_bf16 or amx_bf16 among /proc/cpuinfo's flags): torch emulates bf16 "
                  "matmuls here, so this run will be 30-100x slower than in fp32. Use "
                  "distributed.model_dtype=fp32 on this CPU. MFU is logged as null: there is no "
                  "meaningful bf16 peak to measure it against.")
        return Peak(None, "none", dtype_name, _device_name(device), measured_at=_now(),
                    note="bf16 is emulated on this CPU (no bf16 instructions): no credible peak")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_FLOPS[dtype_name].items():
            if key in name:
                return Peak(value, "datasheet", dtype_name, name, measured_at=_now(),
                            note=f"dense {dtype_name} peak of the {key} (SXM) data sheet")
        logger.warning("no data-sheet peak FLOP/s known for %s (lingua/observe/metrics.py's "
                       "GPU_PEAK_FLOPS): MFU is against a matmul measured at start", name)
    k, n = largest_linear(parts) or (1024, 1024)
    m = max(MIN_MEASURED_ROWS, min(tokens, int(MAX_MEASURED_FLOPS / (2 * k * n))))
    return Peak(source="measured", dtype=dtype_name, device=_device_name(device),
                matmul=[m, k, n], measured_at=_now(),
                **measure_rounds(m, k, n, DTYPES[dtype_name], device))


# Best of PEAK_ROUNDS rounds with equal pauses between: a moment of other load lowers one round.
PEAK_ROUNDS = 3
PEAK_ROUND_S = 0.2


def measure_rounds(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Peak's fields of a measured peak: the best round's FLOP/s, and each round's."""
    rounds, spent = [], 0.0
    for _ in range(PEAK_ROUNDS):
        time.sleep(spent)
        t0 = time.perf_counter()
        rounds.append(measure_matmul_peak(m, k, n, dtype, device, PEAK_ROUND_S))
        spent = time.perf_counter() - t0
    best = max(rounds, key=lambda r: r["flops_per_s"])
    return {"flops_per_s": best["flops_per_s"], "best_s": best["best_s"],
            "repeats": sum(r["repeats"] for r in rounds),
            "rounds": [r["flops_per_s"] for r in rounds]}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def peak_flops(device: torch.device, dtype_name: str) -> Optional[float]:
    """Peak FLOP/s of one device in the dtype (benchmarks): data-sheet, else a 1024^3 matmul now."""
    if device.type == "cpu" and not (dtype_name == "bf16" and cpu_bf16_emulated()):
        return measure_cpu_peak(DTYPES[dtype_name])
    return _obtain_peak(device, dtype_name, (), 1024).flops_per_s


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    # ru_maxrss is KiB on Linux: the process's resident high-water mark.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


class MetricLogger:
    """Writes one JSON object per logged step to metrics.jsonl (and wandb), on rank 0 only."""

    def __init__(self, dump_dir, args: LoggingArgs, run_config: dict, enabled: bool,
                 resumed_step: int = 0):
        self.enabled = enabled
        self.wandb_run = None
        self.file = None
        if not enabled:
            return
        path = Path(dump_dir) / "metrics.jsonl"
        drop_rows_after(path, resumed_step)
        self.file = open(path, "a", buffering=1)
        if args.wandb:
            import wandb

            self.wandb_run = wandb.init(  # the API key stays in the environment
                project=args.wandb_project, entity=args.wandb_entity, mode=args.wandb_mode,
                dir=str(dump_dir), name=args.name or Path(dump_dir).name, config=run_config,
                id=wandb_id(dump_dir), resume="allow")

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(metrics) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in metrics.items() if k != "step"},
                               step=metrics["step"])

    def rewind(self, step: int) -> None:
        """Forget the rows after `step` (a loss-spike rollback; wandb keeps what it was sent)."""
        if not self.enabled:
            return
        self.file.close()
        path = Path(self.file.name)
        drop_rows_after(path, step)
        self.file = open(path, "a", buffering=1)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def drop_rows_after(path: Path, step: int) -> None:
    """Drop the rows logged after `step` (a resume or rollback runs those steps again)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        _write_atomic(path, "".join(kept))


def wandb_id(dump_dir) -> str:
    """A stable id per dump_dir, so a resumed run continues the same wandb run."""
    path = Path(dump_dir) / "wandb_id.txt"
    if not path.is_file():
        import uuid

        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def format_line(m: dict, total_steps: Optional[int] = None) -> str:
    """The step's line for a person: `step 120/200 (60%)` first, `eta 0:45` (from eta_s) last."""
    step = f"step {m['step']}"
    if total_steps:
        step += f"/{total_steps} ({100 * m['step'] / total_steps:.0f}%)"
    parts = [step, f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
             f"gnorm {m['grad_norm']:.3f}", f"tok/s {m['tokens_per_s']:.0f}",
             "mfu n/a" if m["mfu"] is None else f"mfu {100 * m['mfu']:.1f}%",
             f"data {1000 * m['data_s']:.0f}ms", f"mem {m['peak_mem_gib']:.2f}GiB"]
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} ppl {m['val_ppl']:.1f}")
    parts += [f"{k.removeprefix('eval/')} {v:.4f}" for k, v in m.items()
              if k.startswith("eval/") and not k.endswith("_stderr")]   # downstream tasks
    if m.get("eta_s") is not None:
        parts.append(f"eta {format_duration(m['eta_s'])}")
    return " | ".join(parts)


def format_duration(seconds: float) -> str:
    """0:45, 12:05, 1:02:03 (hours are not folded into days: a long run shows 50:00:00)."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Window:
    """Step times and tokens since the last logged step; the ends of the last RECENT_STEPS steps
    (the ETA's pace, evaluation and checkpoints included, the first step's warm-up left out)."""

    RECENT_STEPS = 50

    def __init__(self):
        self.step_ends = collections.deque(maxlen=self.RECENT_STEPS + 1)
        self.reset()

    def reset(self) -> None:
        self.steps, self.seconds, self.data_seconds, self.tokens = 0, 0.0, 0.0, 0
        self.timed_steps, self.phase_seconds = 0, {}

    def eta_s(self, steps_left: int) -> Optional[float]:
        """Seconds for `steps_left` more steps at the recent pace; None until two steps ended."""
        if len(self.step_ends) < 2:
            return None
        pace = (self.step_ends[-1] - self.step_ends[0]) / (len(self.step_ends) - 1)
        return pace * max(steps_left, 0)

    def add(self, step_seconds: float, data_seconds: float, tokens: int,
            phase_seconds: Optional[dict] = None, now: Optional[float] = None) -> None:
        """`phase_seconds` ({"fwd": s, ...}) only for timed steps; `now`: the step's end (tests)."""
        self.step_ends.append(time.perf_counter() if now is None else now)
        self.steps += 1
        self.seconds += step_seconds
        self.data_seconds += data_seconds
        self.tokens += tokens
        if phase_seconds:
            self.timed_steps += 1
            for name, seconds in phase_seconds.items():
                self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def phase_s(self) -> dict:
        """{"fwd_s": mean seconds per timed step, ...} for every phase timed in the window."""
        return {f"{name}_s": seconds / self.timed_steps
                for name, seconds in self.phase_seconds.items()}

    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def step_s(self) -> float:
        return self.seconds / max(self.steps, 1)

    def data_s(self) -> float:
        return self.data_seconds / max(self.steps, 1)


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO; the other ranks only warnings, so a 64-rank log stays readable."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s", datefmt="%H:%M:%S", force=True)
