"""What makes a checkpoint directory intact: its manifest (size and CRC-32 of every file), the
checks against it (whole, or one rank's share), and what becomes of damaged checkpoints (set aside)
and of old ones (pruned)."""

import heapq
import json
import logging
import os
import re
import shutil
import zlib
from pathlib import Path
from typing import Callable, Optional

from lingua.errors import ConfigError

logger = logging.getLogger(__name__)
# Whether the checkpoint of a step must outlive pruning (the trainer's: an evaluation job that has
# not read it yet, lingua.eval.eval_jobs.checkpoint_in_use).
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
    """Describe every file of a checkpoint directory made outside `save` (a conversion from
    another format, a test): `verify` and resume then accept it."""
    ckpt_dir = Path(ckpt_dir)
    files = describe(sorted(p for p in ckpt_dir.iterdir() if p.is_file() and p.name != MANIFEST))
    (ckpt_dir / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def _read_manifest(ckpt_dir: Path):
    """(the manifest's {name: {"size", "crc32"}}, None), or (None, what is wrong with it)."""
    manifest_path = ckpt_dir / MANIFEST
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


def _size_problem(ckpt_dir: Path, files: dict) -> Optional[str]:
    for name, want in sorted(files.items()):
        path = ckpt_dir / name
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError as err:
            return f"{path} cannot be read ({err})"
        if size is None:
            return f"{path} is missing"
        if size != want["size"]:
            return f"{path} has {size} bytes, the manifest says {want['size']} (truncated?)"
    return None


def _crc_problem(ckpt_dir: Path, files: dict, names) -> Optional[str]:
    for name in names:
        try:
            crc = crc32(ckpt_dir / name)
        except OSError as err:  # a disk error is damage too, and must not leave peers waiting
            return f"{ckpt_dir / name} cannot be read ({err})"
        if crc != files[name]["crc32"]:
            return f"{ckpt_dir / name} is damaged (its CRC-32 differs from the manifest's)"
    return None


def _check(ckpt_dir, crc_names) -> Optional[str]:
    """The manifest, every file's size, then the CRC-32 of the files crc_names(manifest) picks."""
    ckpt_dir = Path(ckpt_dir)
    files, problem = _read_manifest(ckpt_dir)
    if problem is None:
        problem = _size_problem(ckpt_dir, files)
    if problem is None:
        problem = _crc_problem(ckpt_dir, files, crc_names(files))
    return problem


def verify(ckpt_dir, checksums: bool = True) -> Optional[str]:
    """None if the checkpoint is intact, else what is wrong with it (one sentence).
    Sizes are always checked; `checksums` also reads every file (as loading it would)."""
    return _check(ckpt_dir, lambda files: sorted(files) if checksums else [])


def crc_share(files: dict, rank: int, world_size: int) -> list:
    """The names of the manifest's files whose CRC-32 `rank` checks when `world_size` ranks
    verify a checkpoint together: largest first, each to the rank with the fewest bytes so far
    (ties to the lower rank). Every file goes to exactly one rank, no rank reads more than
    1/world_size of the bytes plus one file, and it depends only on the manifest, so it works
    whatever the world size was when the checkpoint was saved."""
    loads = [(0, r) for r in range(world_size)]
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        load, r = heapq.heappop(loads)
        if r == rank:
            mine.append(name)
        heapq.heappush(loads, (load + files[name]["size"], r))
    return sorted(mine)


def verify_share(ckpt_dir, rank: int, world_size: int) -> Optional[str]:
    """`verify` split over ranks: the sizes of every file (cheap) and the CRC-32 of this rank's
    share of the files (`crc_share`). None where this rank found nothing wrong."""
    return _check(ckpt_dir, lambda files: crc_share(files, rank, world_size))


def step_dirs(root: Path) -> list:
    """Renamed step directories, oldest first (unfinished `.tmp-` ones are not candidates)."""
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                  key=lambda p: int(p.name)) if root.is_dir() else []


def move_aside(ckpt: Path) -> str:
    """Rename a damaged checkpoint to `<step>.damaged` (`.damaged-2`, ... if taken): only digit
    names are checkpoints, so nothing lists it and `keep` no longer counts it. What was done."""
    target, n = ckpt.with_name(f"{ckpt.name}.damaged"), 1
    while target.exists():
        n += 1
        target = ckpt.with_name(f"{ckpt.name}.damaged-{n}")
    try:
        os.rename(ckpt, target)
    except OSError as err:
        return f"could not move it aside ({err}), delete it by hand"
    return f"moved it to {target} (delete that to free its space)"


def require_intact(ckpt_dir) -> None:
    """For a checkpoint asked for by name: a damaged one is an error, not a silent fallback."""
    problem = verify(ckpt_dir)
    if problem is not None:
        raise ConfigError(f"Checkpoint {ckpt_dir} is damaged: {problem}. Use another checkpoint "
                          f"of the run (ls {Path(ckpt_dir).parent}), or copy this one again "
                          f"from where it was written.")


def prune(root: Path, keep: int, in_use: Optional[InUse] = None) -> None:
    """Rank 0, after a save: delete the checkpoints older than the newest `keep` intact ones,
    except those `in_use`. One damaged since resume (sizes against its manifest: nothing read)
    is moved aside, uncounted."""
    if keep <= 0:
        return
    intact = []
    for ckpt in step_dirs(root):
        problem = verify(ckpt, checksums=False)
        if problem is None:
            intact.append(ckpt)
        else:
            logger.warning("damaged checkpoint %s: %s; %s", ckpt, problem, move_aside(ckpt))
    for old in intact[:-keep]:
        if in_use is None or not in_use(int(old.name)):   # in use: a later save prunes it
            shutil.rmtree(old, ignore_errors=True)
