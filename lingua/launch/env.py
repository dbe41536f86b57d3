"""What this machine offers a training run: `python -m lingua.env` (the first thing to run on a new
cluster, and what to paste into a bug report). Prints torch, CUDA and NCCL versions, GPUs,
InfiniBand devices, Slurm, and the distributed variables; those whose names look like keys or
tokens are shown as set / not set only."""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
             "SLURM_JOB_NODELIST", "SLURM_CPUS_PER_TASK", "CUDA_VISIBLE_DEVICES",
             "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "OMP_NUM_THREADS")
SECRET_HINTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def infiniband_devices(root: Path = Path("/sys/class/infiniband")) -> list:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def slurm_version() -> str:
    if shutil.which("sinfo") is None:
        return "not found (sinfo is not on PATH)"
    try:
        out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or out.stderr.strip() or "installed"
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"installed, but `sinfo --version` failed: {err}"


def shown(name: str, value: str) -> str:
    if any(hint in name.upper() for hint in SECRET_HINTS):
        return "(set)"
    return value


def report() -> list:
    import torch

    lines = [f"python      {sys.version.split()[0]} ({sys.executable})",
             f"platform    {platform.platform()}, {os.cpu_count()} CPUs",
             f"torch       {torch.__version__}, {torch.get_num_threads()} threads"]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
        lines.append(f"cuda        {torch.version.cuda}, NCCL {nccl}, "
                     f"{torch.cuda.device_count()} GPU(s)")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"  gpu {i}     {props.name}, {props.total_memory / 2 ** 30:.0f} GiB, "
                         f"compute {props.major}.{props.minor}")
    else:
        lines.append("cuda        not available (CPU only: gloo backend)")
    ib = infiniband_devices()
    lines.append(f"infiniband  {', '.join(ib) if ib else 'none found in /sys/class/infiniband'}")
    lines.append(f"slurm       {slurm_version()}")
    seen = [(name, os.environ[name]) for name in DIST_VARS if name in os.environ]
    seen += [(name, value) for name, value in sorted(os.environ.items())
             if name.startswith(("WANDB_", "HF_")) and name not in dict(seen)]
    lines.append("environment "
                 + ("(none of the distributed variables is set)" if not seen else ""))
    lines += [f"  {name}={shown(name, value)}" for name, value in seen]
    return lines


def main() -> None:
    print("\n".join(report()))


if __name__ == "__main__":
    main()
