"""Checkpoints of a run that froze weights it started from (LoRA on checkpoint.init_from) leave
those weights out: `base.json` names the base (path and fingerprint), loaded first and checked."""

import json
import zlib
from pathlib import Path
from typing import Optional

from lingua.errors import ConfigError

BASE_RECORD = "base.json"


def base_fingerprint(init_from) -> dict:
    """A Hugging Face directory's weights, a few MB read: sizes, and a CRC-32 of the headers and
    first MiB of weights (two fine-tunes of one architecture share the headers)."""
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
    """The base.json record for a run from init_from with frozen parameters (LoRA), else None."""
    if init_from is None or all(p.requires_grad for part in parts for p in part.parameters()):
        return None
    return base_fingerprint(init_from)


def read_base(ckpt_dir) -> Optional[dict]:
    path = Path(ckpt_dir) / BASE_RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def verified_base(ckpt_dir, init_from: Optional[str] = None, key: str = "") -> Optional[str]:
    """The frozen base a checkpoint left out, checked unchanged; None for a complete checkpoint."""
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
