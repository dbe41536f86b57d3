"""One run per dump_dir: rank 0 holds an flock on `<dump_dir>/.lock` (its pid, host and Slurm job
inside, for the messages) from before anything is written there until the run returns or raises;
the OS drops it when the process dies, so a killed run's lock is taken over."""

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from lingua import checkpoint
from lingua.errors import ConfigError
from lingua.model.weights import broadcast_object

logger = logging.getLogger("train")

LOCK = ".lock"
REQUEUE_WAIT_S = 120.0   # a requeued job's previous instance may hold it this long (NFS leases)


def _holder(fd: int) -> tuple:   # the lock file's record, and its words for the messages
    with contextlib.suppress(OSError, ValueError):
        if r := json.loads(os.pread(fd, 4096, 0) or b"{}"):
            job = f"Slurm job {r['slurm_job']}, " if r.get("slurm_job") else ""
            since = r.get("since")
            return r, f"process {r.get('pid')} on host {r.get('host')} ({job}since {since})"
    return {}, "a process (its name not yet written)"


def acquire(dump_dir) -> int:
    """The lock's file descriptor, held; ConfigError naming the holder when another run has it.
    A holder of this same Slurm job (a requeue's previous instance, being ended) is waited for."""
    path, job = Path(dump_dir) / LOCK, os.environ.get("SLURM_JOB_ID")
    deadline = time.monotonic() + REQUEUE_WAIT_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder, named = _holder(fd)
            os.close(fd)
            if job and holder.get("slurm_job") == job and time.monotonic() < deadline:
                time.sleep(1.0)
                continue
            raise ConfigError(
                f"dump_dir={dump_dir} is in use by another run: {named} holds {path}. Two runs "
                f"there would both append to metrics.jsonl and write the same checkpoints. Let "
                f"that run end (or stop it) and start this one again to resume, or give this run "
                f"another dump_dir.") from None
        except OSError as err:   # a filesystem without flock (some network mounts)
            logger.warning("could not lock %s (%s): nothing stops a second run here", path, err)
        # Its last holder may have removed the file between our open and our flock.
        if os.path.exists(path) and os.path.samestat(os.fstat(fd), os.stat(path)):
            break
        os.close(fd)
    stale, named = _holder(fd)
    if stale:
        logger.warning("took over %s from %s, which no longer holds it (killed, or its node went "
                       "down)", path, named)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "slurm_job": job,
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(mine).encode(), 0)
    return fd


@contextlib.contextmanager
def held(dump_dir, env):
    """Rank 0 holds dump_dir's lock while the body runs, after removing unfinished saves; a refusal
    reaches every rank. Directories this start made are removed again if left empty."""
    path, fd, problem = Path(dump_dir), None, None
    made = [p for p in (path, *path.parents) if not p.exists()]
    if env.is_main:
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = acquire(path)
            checkpoint.remove_unfinished(path)
        except (ConfigError, OSError) as err:
            problem = str(err)
    problem = broadcast_object(problem)
    try:
        if problem is not None:
            raise ConfigError(problem)
        yield
    finally:
        if fd is not None:   # removed while held: a run waiting on this file retries on a new one
            (path / LOCK).unlink(missing_ok=True)
            os.close(fd)
            with contextlib.suppress(OSError):   # stops at the first that is not empty
                for directory in made:
                    directory.rmdir()
