"""Checkpoints of a run that froze weights it started from (LoRA on checkpoint.init_from) leave
those weights out: `base.json` in the checkpoint names the base they go with (its path, and a
fingerprint: the size of its safetensors files, a CRC-32 of their headers and first MiB), which
resume and every reader load first and check unchanged (lingua/checkpoint/__init__.py)."""

import json
import zlib
from pathlib import Path
from typing import Optional

from lingua.errors import ConfigError

BASE_RECORD = "base.json"


def base_fingerprint(init_from) -> dict:
    """What identifies a Hugging Face directory's weights, a few MB read: the total size of its
    *.safetensors files and a CRC-32 of its index, each file's header (names, shapes, dtypes,
    offsets) and first MiB of weights (two fine-tunes of one architecture share the headers)."""
    root = Path(init_from)
    files = sorted(root.glob("*.safetensors"))
    crc = 0
    index = root / "model.safetensors.index.json"
    if index.is_file():
        crc = zlib.crc32(index.read_bytes())
    for path in files:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            crc = zlib.crc32(f.read(min(header_len, 1 << 26)), crc)
            crc = zlib.crc32(f.read(1 << 20), crc)
    return {"init_from": str(root.resolve()), "files": len(files),
            "bytes": sum(p.stat().st_size for p in files), "index_crc32": crc}


def frozen_base(parts: list, init_from: Optional[str]) -> Optional[dict]:
    """The base.json record when checkpoints leave the frozen weights out: a run started from
    init_from with some parameters frozen (LoRA); else None (checkpoints hold every weight)."""
    if init_from is None or all(p.requires_grad for part in parts for p in part.parameters()):
        return None
    return base_fingerprint(init_from)


def read_base(ckpt_dir) -> Optional[dict]:
    path = Path(ckpt_dir) / BASE_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def verified_base(ckpt_dir, init_from: Optional[str] = None, key: str = "") -> Optional[str]:
    """The base a checkpoint without its frozen weights (base.json) was trained on, checked to
    be unchanged on disk (the directory base.json names, or `init_from`, as `key` says); None
    for a checkpoint that holds every weight."""
    saved = read_base(ckpt_dir)
    if saved is None:
        return None
    init_from = saved["init_from"] if init_from is None else init_from
    given = f"{key}={init_from}" if key else init_from
    fix = (f"Point checkpoint.init_from at {saved['init_from']} as it was when the run trained "
           f"(or start a new dump_dir to fine-tune another base).")
    if not Path(init_from).is_dir():
        raise ConfigError(f"{ckpt_dir} holds the trained weights only; the frozen base they go "
                          f"with was {saved['init_from']}, and {given} is not a directory. {fix}")
    now = base_fingerprint(init_from)
    if any(now[k] != saved[k] for k in ("files", "bytes", "index_crc32")):
        raise ConfigError(
            f"{ckpt_dir} holds the trained weights only, over the base {saved['init_from']} "
            f"({saved['files']} safetensors files, {saved['bytes']} bytes, index CRC-32 "
            f"{saved['index_crc32']}); {given} is another model now ({now['files']} files, "
            f"{now['bytes']} bytes, CRC-32 {now['index_crc32']}), and the adapters would be put "
            f"on weights they were not trained with. {fix}")
    return init_from
