"""What makes a checkpoint intact: its manifest (size and CRC-32 of every file), the checks
against it, the ranks' agreement on the newest intact one, and pruning."""

import heapq
import json
import logging
import os
import re
import shutil
import stat
import zlib
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from lingua.errors import ConfigError, RunError

logger = logging.getLogger(__name__)
# Whether the checkpoint of a step must outlive pruning (the trainer's: an evaluation job that has
# not read it yet, lingua.launch.eval_jobs.checkpoint_in_use).
InUse = Callable[[int], bool]

STEP_DIR = re.compile(r"^\d+$")
MANIFEST = "manifest.json"


def crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def describe(paths) -> dict:
    return {p.name: {"size": p.stat().st_size, "crc32": crc32(p)} for p in paths}


def write_manifest(ckpt_dir) -> None:
    """Describe a checkpoint made outside `save` (a conversion, a test), so `verify` accepts it."""
    ckpt_dir = Path(ckpt_dir)
    files = describe(sorted(p for p in ckpt_dir.iterdir() if p.is_file() and p.name != MANIFEST))
    (ckpt_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def read_manifest(ckpt_dir) -> tuple:
    """(the manifest's {name: {"size", "crc32"}}, None), or (None, what is wrong with it)."""
    manifest_path = Path(ckpt_dir) / MANIFEST
    if not manifest_path.is_file():
        return None, (f"{manifest_path} is missing (the checkpoint was not finished, or was "
                      f"copied partly)")
    try:
        files = json.loads(manifest_path.read_text())["files"]
        if not all(isinstance(f["size"], int) and isinstance(f["crc32"], str)
                   for f in files.values()):
            raise ValueError("an entry lacks an integer size or a crc32")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"{manifest_path} is unreadable ({err})"
    return files, None


def _check(ckpt_dir, pick, checksums: bool, manifest=None) -> Optional[str]:
    """`manifest`: what read_manifest gave another rank (None: read it here)."""
    ckpt_dir = Path(ckpt_dir)
    files, problem = read_manifest(ckpt_dir) if manifest is None else manifest
    if problem is not None:
        return problem
    names = sorted(pick(files))
    for name in names:
        path = ckpt_dir / name
        try:   # one stat a file: at resume every rank does this for its share of the files
            info = path.stat()
            size = info.st_size if stat.S_ISREG(info.st_mode) else None
        except FileNotFoundError:
            size = None
        except OSError as err:
            return f"{path} cannot be read ({err})"
        if size is None:
            return f"{path} is missing"
        if size != files[name]["size"]:
            return f"{path} has {size} bytes, the manifest says {files[name]['size']} (truncated?)"
    for name in (names if checksums else []):
        try:
            crc = crc32(ckpt_dir / name)
        except OSError as err:  # a disk error is damage too, and must not leave peers waiting
            return f"{ckpt_dir / name} cannot be read ({err})"
        if crc != files[name]["crc32"]:
            return f"{ckpt_dir / name} is damaged (its CRC-32 differs from the manifest's)"
    return None


def verify(ckpt_dir, checksums: bool = True) -> Optional[str]:
    """None if the checkpoint is intact, else what is wrong; `checksums` also reads every file."""
    return _check(ckpt_dir, lambda files: files, checksums)


def crc_share(files: dict, rank: int, world_size: int) -> list:
    """The files `rank` checksums: largest first, each to the least loaded rank (balanced bytes)."""
    loads = [(0, r) for r in range(world_size)]
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        load, r = heapq.heappop(loads)
        if r == rank:
            mine.append(name)
        heapq.heappush(loads, (load + files[name]["size"], r))
    return sorted(mine)


def verify_share(ckpt_dir, rank: int, world_size: int, manifest=None) -> Optional[str]:
    """`verify` of this rank's share, so that no rank stats every file (at 1,000 ranks, a
    metadata storm). `manifest`: read_manifest's answer on rank 0 (None: read it here)."""
    if not Path(ckpt_dir).is_dir():   # a rank with nothing to check must still see it
        return f"{ckpt_dir} is missing"
    return _check(ckpt_dir, lambda files: crc_share(files, rank, world_size), True, manifest)


def step_dirs(root: Path) -> list:
    """Renamed step directories, oldest first (unfinished `.tmp-` ones are not candidates)."""
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                  key=lambda p: int(p.name)) if root.is_dir() else []


def move_aside(ckpt: Path) -> str:
    """Rename a damaged checkpoint to `<step>.damaged`, which `keep` no longer counts."""
    target, n = ckpt.with_name(f"{ckpt.name}.damaged"), 1
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{ckpt.name}.damaged-{n}")
    try:
        os.rename(ckpt, target)
    except OSError as err:
        return f"could not move it aside ({err}), delete it by hand"
    return f"moved it to {target} (delete that to free its space)"


def prune(root: Path, keep: int, in_use: Optional[InUse] = None,
          newest: Optional[Path] = None) -> None:
    """Rank 0, after a save. `newest`, just written, counts as intact unchecked: a passing stat
    error must not set aside the one the run resumes from."""
    if keep <= 0:
        return
    intact = []
    for ckpt in step_dirs(root):
        problem = None if ckpt == newest else verify(ckpt, checksums=False)
        if problem is None:
            intact.append(ckpt)
        else:
            logger.warning("damaged checkpoint %s: %s; %s", ckpt, problem, move_aside(ckpt))
    for old in intact[:-keep]:
        if old != newest and (in_use is None or not in_use(int(old.name))):   # in use: later
            shutil.rmtree(old, ignore_errors=True)


def checkpoints_dir(dump_dir) -> Path:
    return Path(dump_dir) / "checkpoints"


def _all_gather(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _from_rank0(obj):
    shared = [obj]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def newest_verified(dump_dir, rank: int = 0, world_size: int = 1, gather=None,
                    set_aside: bool = False) -> Optional[Path]:
    """The newest checkpoint that passes every rank's `verify_share`, the same on every rank.
    Collective when world_size > 1. `gather(obj)`: every rank's obj in rank order. Rank 0 alone
    lists and reads manifests, so metadata load does not grow with the world size. `set_aside`
    (resume): rank 0 also moves damaged ones aside."""
    if gather is None:
        gather = _all_gather if world_size > 1 else (lambda obj: [obj])

    def share(obj):   # rank 0's obj, on every rank
        return _from_rank0(obj) if gather is _all_gather else gather(obj)[0]

    root = checkpoints_dir(dump_dir)
    # Rank 0's candidates, so every rank takes the same number of steps in the agreement below;
    # a listing that fails there fails everywhere, instead of leaving the others waiting.
    names = None
    if rank == 0:
        try:
            names = [p.name for p in step_dirs(root)]
        except OSError as err:
            names = f"{root} cannot be listed ({err})"
    names = share(names)
    if isinstance(names, str):
        raise RunError(f"{names}. Check that the run directory is readable from every node "
                       f"(the same mount, permissions), then run the same command again.")
    for name in reversed(names):
        ckpt = root / name
        manifest = share(read_manifest(ckpt) if rank == 0 else None)
        problems = [p for p in gather(verify_share(ckpt, rank, world_size, manifest))
                    if p is not None]
        if not problems:
            return ckpt
        if rank == 0:
            done = f"; {move_aside(ckpt)}" if set_aside else ""
            logger.warning("skipping damaged checkpoint %s: %s%s; trying the one before", ckpt,
                           "; ".join(dict.fromkeys(problems)), done)
    return None


def verified(ckpt_dir, rank: int = 0, world_size: int = 1) -> None:
    """A checkpoint asked for by name: damage is a ConfigError on every rank. Collective."""
    if world_size == 1:
        problems = [verify_share(ckpt_dir, rank, world_size)]
    else:   # one rank reads the manifest (newest_verified says why)
        manifest = _from_rank0(read_manifest(ckpt_dir) if rank == 0 else None)
        problems = _all_gather(verify_share(ckpt_dir, rank, world_size, manifest))
    problems = [p for p in problems if p is not None]
    if problems:
        raise ConfigError(f"Checkpoint {ckpt_dir} is damaged: "
                          f"{'; '.join(dict.fromkeys(problems))}. "
                          f"Use another checkpoint of the run (ls {Path(ckpt_dir).parent}), or "
                          f"copy this one again from where it was written.")
