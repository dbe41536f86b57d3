"""The process's host-memory policy: when Python's garbage collector runs (the GarbageCollection
hook: never at a random step) and how glibc's malloc keeps freed memory on CPU
(keep_freed_memory: as CUDA's caching allocator does on GPU)."""

import gc
from typing import Optional

from lingua.hooks import Hook


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
    """A MALLOC_*_ variable or glibc.malloc tunable the user set, or None."""
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
    does (glibc unmaps large blocks when freed, so every step's activations take fresh zeroed
    pages): no mmap (M_MMAP_MAX=0), no trimming (M_TRIM_THRESHOLD=-1), process-wide. False,
    changing nothing, without mallopt or where the user set one of its knobs."""
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
    """malloc_trim once setup is done, so its transient copies do not stay resident."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


class GarbageCollection(Hook):
    """Automatic GC off while the loop runs (its pauses land at random steps, and on one rank they
    stall all); young generations every gc_every steps, all of them every gc_full_every."""

    def __init__(self, young_every: int, full_every: int):
        self.young_every, self.full_every = young_every, full_every
        self.was_enabled: Optional[bool] = None

    def start(self, view) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def after_step(self, view, step: int) -> None:
        collect_garbage(step, self.young_every, self.full_every)

    def close(self, view) -> None:
        if self.was_enabled:
            gc.enable()
