"""Training metrics: FLOPs and MFU, memory, and where they go (stdout, metrics.jsonl, wandb).

MFU = model FLOPs per token x tokens/s / peak FLOP/s of the hardware.
  model FLOPs per token = 6 x N + 12 x n_layers x dim x seq_len
N counts every parameter that takes part in a matmul (the embedding lookup does not, the output
projection does, once even when tied); the second term is attention's QK^T and AV (forward and
backward, PaLM's convention, counted as if not causal). On a GPU the peak comes from a table of
dense bf16 peaks; on CPU it is measured at start-up with a short matmul benchmark in the run's
dtype and cached, so MFU on CPU is "fraction of what a large matmul reaches on this machine".
Where no credible peak exists (bf16 on a CPU without bf16 instructions, which torch emulates) or
MFU would exceed 100%, mfu is logged as null with a warning instead of a made-up number.
"""

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
    # Moved to optim.spike_factor / optim.spike_window (optim.spike picks what a spike does:
    # README, "Loss spikes"). Kept only so that the config.yaml of older runs still loads (eval,
    # export); setting either is a config error naming the new key.
    spike_factor: Optional[float] = None
    spike_window: Optional[int] = None


def flops_per_token(model: nn.Module, n_layers: int, dim: int, seq_len: int,
                    tied_embeddings: bool = False) -> float:
    n_matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    if tied_embeddings:  # the output matmul reuses the embedding matrix, but still costs FLOPs
        n_matmul += model.tok_embeddings.weight.numel()
    return 6.0 * n_matmul + 12.0 * n_layers * dim * seq_len


def _cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "lingua" / "matmul_peak.json"


def measure_cpu_peak(dtype: torch.dtype, seconds: float = 0.5) -> float:
    """Best FLOP/s of a square matmul on this CPU with the current thread count."""
    n = 1024
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t0))
    return best


# Native bf16 matmuls on CPU: x86's AVX512-BF16 or AMX, Arm's BF16 extension (hwcap "bf16").
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> Optional[frozenset]:
    """This CPU's feature flags as /proc/cpuinfo lists them ("flags" on x86, "Features" on Arm);
    None where there is no /proc/cpuinfo to read (macOS). Tests replace this function."""
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
    """True where this CPU has no bf16 instructions and torch emulates bf16 matmuls (an AVX2-only
    x86: about 0.7 GFLOP/s, 30-100x slower than fp32); False where it has them, or is unknown."""
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


def mfu(flops_per_s: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation (`flops_per_s` of model FLOPs on one device over its peak), or None
    where no honest number exists: no credible peak (bf16 emulated on this CPU: peak_flops gives
    None), or a value above 1, which says the peak is wrong (a CPU measurement disturbed by other
    load, a GPU not in GPU_PEAK_FLOPS, a FLOP count that misses work), not that the run beat the
    hardware. Logged as JSON null rather than a made-up number, with a warning the first time."""
    if not peak:
        return None
    value = flops_per_s / peak
    if not math.isfinite(value) or value > 1:
        shown = f"{peak / 1e12:.1f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:.1f} GFLOP/s"
        warn_once("mfu_above_1",
                  f"MFU came out at {100 * value:.0f}% of the peak ({shown} per device), which "
                  f"no run reaches: that peak is not credible for this hardware, so such MFU "
                  f"values are logged as null. On a GPU the peak is the data-sheet value in "
                  f"lingua/metrics.py's GPU_PEAK_FLOPS; on CPU a short matmul measurement cached "
                  f"in {_cache_path()}: delete that file to measure again on an idle machine.")
        return None
    return value


def peak_flops(device: torch.device, dtype_name: str) -> Optional[float]:
    """Peak FLOP/s of one device in the run's dtype; None where there is no credible one (bf16
    emulated on this CPU: measuring it would only time the emulation)."""
    if device.type == "cpu" and dtype_name == "bf16" and cpu_bf16_emulated():
        warn_once("bf16_emulated",
                  "distributed.model_dtype=bf16 on a CPU without bf16 instructions (no "
                  "avx512_bf16 or amx_bf16 among /proc/cpuinfo's flags): torch emulates bf16 "
                  "matmuls here, so this run will be 30-100x slower than in fp32. Use "
                  "distributed.model_dtype=fp32 on this CPU. MFU is logged as null: there is no "
                  "meaningful bf16 peak to measure it against.")
        return None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_FLOPS[dtype_name].items():
            if key in name:
                return value
        logger.warning("no peak FLOP/s known for %s: MFU is reported against the H100's", name)
        return GPU_PEAK_FLOPS[dtype_name]["H100"]
    key = f"{platform.processor() or platform.machine()}|{torch.get_num_threads()}|{dtype_name}|{torch.__version__}"
    path = _cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
        cache[key] = measure_cpu_peak(dtype)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps(cache, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home only costs a re-measurement next time
        logger.info("measured CPU matmul peak (%s): %.1f GFLOP/s", dtype_name, cache[key] / 1e9)
    return cache[key]


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

            # The API key stays in the environment: we pass only the run config, which holds none.
            self.wandb_run = wandb.init(
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
        """Forget the rows after `step` (a loss-spike rollback went back to that step's
        checkpoint: those steps run again). wandb keeps what it was sent: it cannot go back."""
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
    """On resume, forget rows a crashed run logged after its last checkpoint: those steps are
    about to run again, and metrics.jsonl should hold each step once."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


def wandb_id(dump_dir) -> str:
    """A stable id per dump_dir, so a resumed run continues the same wandb run."""
    path = Path(dump_dir) / "wandb_id.txt"
    if not path.is_file():
        import uuid

        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()


def format_line(m: dict) -> str:
    parts = [f"step {m['step']}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.2e}",
             f"gnorm {m['grad_norm']:.3f}", f"tok/s {m['tokens_per_s']:.0f}",
             "mfu n/a" if m["mfu"] is None else f"mfu {100 * m['mfu']:.1f}%",
             f"data {1000 * m['data_s']:.0f}ms",
             f"mem {m['peak_mem_gib']:.2f}GiB"]
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} ppl {m['val_ppl']:.1f}")
    parts += [f"{k.removeprefix('eval/')} {v:.4f}" for k, v in m.items()
              if k.startswith("eval/") and not k.endswith("_stderr")]   # downstream tasks
    return " | ".join(parts)


class Window:
    """Step times and token counts since the last logged step (tokens/s over the window)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.steps, self.seconds, self.data_seconds, self.tokens = 0, 0.0, 0.0, 0
        self.timed_steps, self.phase_seconds = 0, {}

    def add(self, step_seconds: float, data_seconds: float, tokens: int,
            phase_seconds: Optional[dict] = None) -> None:
        """`phase_seconds` ({"fwd": s, ...}) only for steps whose phases were timed: on CUDA
        that is the synchronized, logged step alone (see profiling.PhaseTimer)."""
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
