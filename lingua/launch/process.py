"""A training process's start before the loop: logging, the torch version check, malloc tuning on
CPU, signal listening, the embedded corpus on first use, and the run's config.yaml; and its
memory policy: when Python's garbage collector runs (GarbageCollection) and how glibc's malloc
keeps freed memory on CPU (keep_freed_memory).
"""

import gc
import logging
from pathlib import Path
from typing import Optional

import torch

from lingua import config, data
from lingua.hooks import Hook
from lingua.observe import metrics
from lingua.parallel import distributed
from lingua.parallel.distributed import DistEnv
from lingua.train import preemption

logger = logging.getLogger("train")

TESTED_TORCH = "2.13"   # pyproject.toml's pin: the version the suite runs on


def torch_version_warning(version: str) -> Optional[str]:
    """What to say when the run's torch is not the tested one (None when it is): clusters often
    carry another build, and torch.distributed's private paths change between versions."""
    if version.split("+")[0].rsplit(".", 1)[0] == TESTED_TORCH:
        return None
    return (f"torch {version} is not the version lingua is tested with ({TESTED_TORCH}.x, "
            "pyproject.toml). Under torch 2.11 the one-GPU runbook passes, but the "
            "InterleavedZeroBubble, ZBVZeroBubble and DualPipeV pipeline schedules fail (on gloo; "
            "NCCL untried). "
            f"Install torch=={TESTED_TORCH}.0 where you can.")


def start_process(args, env: DistEnv) -> None:
    """Logging, the version warning, malloc on CPU, signals, the embedded corpus on first use."""
    metrics.setup_logging(env.rank)
    if env.is_main and (untested := torch_version_warning(torch.__version__)):
        logger.warning(untested)
    if env.device.type == "cpu":
        if (user := user_malloc_setting()) is None:
            keep_freed_memory()
        elif env.is_main:
            logger.info(f"malloc: left as set by {user} (the trainer would keep freed blocks "
                        "for reuse on CPU; lingua.launch.process.keep_freed_memory)")
    preemption.SIGNALS.listen()
    if args.data.prepare_embedded and args.data.format == "memmap":   # chat: apps/sft/prepare.py
        if env.local_rank == 0:
            data.ensure_embedded_corpus(args.data.root)
        distributed.barrier(env)


def write_config(args, env: DistEnv) -> None:
    """The run directory and its resolved config.yaml (rank 0)."""
    if env.is_main:
        Path(args.dump_dir).mkdir(parents=True, exist_ok=True)
        config.dump(args, Path(args.dump_dir) / "config.yaml")


def collect_garbage(step: int, young_every: int, full_every: int) -> Optional[int]:
    """The step's garbage collection, if any: the generation collected (None: none)."""
    if full_every > 0 and step % full_every == 0:
        gc.collect()
        return 2
    if young_every > 0 and step % young_every == 0:
        gc.collect(1)
        return 1
    return None


# The malloc settings keep_freed_memory makes; a user who set any of them keeps theirs.
USER_MALLOC_VARS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                    "MALLOC_TOP_PAD_")
USER_MALLOC_TUNABLES = ("glibc.malloc.mmap_max", "glibc.malloc.mmap_threshold",
                        "glibc.malloc.trim_threshold", "glibc.malloc.top_pad")


def user_malloc_setting() -> Optional[str]:
    """The user's own setting of what keep_freed_memory tunes (a MALLOC_*_ variable or a
    glibc.malloc tunable in GLIBC_TUNABLES), or None."""
    import os

    for key in USER_MALLOC_VARS:
        if key in os.environ:
            return key
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for name in USER_MALLOC_TUNABLES:
        if name in tunables:
            return f"GLIBC_TUNABLES={tunables}"
    return None


def keep_freed_memory() -> bool:
    """CPU training: let glibc's malloc keep freed blocks for reuse, as CUDA's caching allocator
    does on GPU. By default glibc unmaps large blocks when freed, so every step's activations
    (the logits above all) take freshly zeroed pages again (BENCHMARKS.md, "Then: page faults").
    So: no mmap for any size (M_MMAP_MAX=0) and no trimming of the heap's top
    (M_TRIM_THRESHOLD=-1), for the main thread's arena, where training allocates. glibc's
    memalign can still leave a small tail in its per-thread cache between a freed block and the
    heap's top; GLIBC_TUNABLES=glibc.malloc.tcache_max=0 lifts that (tests/test_benchmarks.py).
    What it costs: the process keeps the memory it freed (release_freed_memory gives back what
    setup used once), and fragmentation can raise the resident peak. Process-wide, and it stays
    after run() returns. Returns False, and changes nothing, where the C library has no mallopt
    or the user set one of its knobs (user_malloc_setting, e.g. MALLOC_TOP_PAD_=131072)."""
    import ctypes

    if user_malloc_setting():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0) and mallopt(m_trim_threshold, -1))


def release_freed_memory() -> None:
    """Give the OS back the heap memory free now (glibc's malloc_trim): called once setup is done,
    so that its transient copies do not stay resident under keep_freed_memory's no-trim setting."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


class GarbageCollection(Hook):
    """gc_every / gc_full_every: automatic GC off while the loop runs (its pauses land at random
    steps, and on one rank they stall all); the young generations collected every gc_every steps,
    all of them every gc_full_every (a cycle that outlived two young collections is only freed by
    a full one). The collector is back to its previous state however the loop ends."""

    def __init__(self, young_every: int, full_every: int):
        self.young_every, self.full_every = young_every, full_every
        self.was_enabled: Optional[bool] = None

    def start(self, run) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def after_step(self, run, step: int) -> None:
        collect_garbage(step, self.young_every, self.full_every)

    def close(self, run) -> None:
        if self.was_enabled:
            gc.enable()
