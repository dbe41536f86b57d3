"""A training process's start: logging, the torch version check, malloc on CPU (host_memory.py),
signals, the embedded corpus on first use, the run's config.yaml."""

import logging
from pathlib import Path
from typing import Optional

import torch

from lingua import config, data
from lingua.launch.host_memory import keep_freed_memory, user_malloc_setting
from lingua.observe import metrics
from lingua.parallel import distributed
from lingua.parallel.distributed import DistEnv
from lingua.train import preemption

logger = logging.getLogger("train")

TESTED_TORCH = "2.13"   # pyproject.toml's pin: the version the suite runs on


def torch_version_warning(version: str) -> Optional[str]:
    """What to say when the run's torch is not the tested one (private distributed paths change)."""
    if version.split("+")[0].rsplit(".", 1)[0] == TESTED_TORCH:
        return None
    return (f"torch {version} is not the version lingua is tested with ({TESTED_TORCH}.x, "
            "pyproject.toml). Under torch 2.11 the one-GPU runbook passes, but the "
            "InterleavedZeroBubble, ZBVZeroBubble and DualPipeV pipeline schedules fail (on gloo; "
            "NCCL untried). "
            f"Install torch=={TESTED_TORCH}.0 where you can.")


def start_process(args, env: DistEnv) -> None:
    metrics.setup_logging(env.rank)
    if env.is_main and (untested := torch_version_warning(torch.__version__)):
        logger.warning(untested)
    if env.device.type == "cpu":
        if (user := user_malloc_setting()) is None:
            keep_freed_memory()
        elif env.is_main:
            logger.info(f"malloc: left as set by {user} (the trainer would keep freed blocks "
                        "for reuse on CPU; lingua.launch.host_memory.keep_freed_memory)")
    preemption.SIGNALS.listen()
    if args.data.prepare_embedded and data.loader_class(args.data).builds_embedded:
        if env.local_rank == 0:
            data.ensure_embedded_corpus(args.data.root)
        distributed.barrier(env)


def write_config(args, env: DistEnv) -> None:
    """The resolved config.yaml (rank 0), into the dump_dir lingua.train.dump_lock made."""
    if env.is_main:
        config.dump(args, Path(args.dump_dir) / "config.yaml")
