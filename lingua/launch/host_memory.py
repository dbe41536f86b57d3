"""The process's host-memory policy: when Python's garbage collector runs (the GarbageCollection
hook: never at a random step) and how glibc's malloc keeps freed memory on CPU
(keep_freed_memory: as CUDA's caching allocator does on GPU).
"""

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

    def start(self, view) -> None:
        self.was_enabled = gc.isenabled()
        gc.disable()

    def after_step(self, view, step: int) -> None:
        collect_garbage(step, self.young_every, self.full_every)

    def close(self, view) -> None:
        if self.was_enabled:
            gc.enable()
