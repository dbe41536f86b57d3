"""Resume's checkpoint verification on several gloo ranks, for tests/test_resume_verify.py.

`torchrun --nproc-per-node N -m tests.workers.verify_worker DUMP_DIR OUT_DIR`: every rank calls
`checkpoint.newest_verified(DUMP_DIR, rank, world_size, set_aside=True)` (as Run.resume does)
and writes OUT_DIR/rank<r>.json with the checkpoint it chose (its directory name, or null) and
the files whose checksums it read. Warnings go to stdout, prefixed with the rank.
"""

import json
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from lingua import checkpoint
from lingua.checkpoint import integrity
from lingua.parallel import distributed


def main(dump_dir: Path, out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout,
                        format=f"[rank{rank}] %(name)s: %(message)s")
    read = []
    crc32 = integrity.crc32

    def recording_crc32(path):
        read.append(f"{path.parent.name}/{path.name}")
        return crc32(path)

    integrity.crc32 = recording_crc32
    choice = checkpoint.newest_verified(dump_dir, rank, world_size, set_aside=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(
        {"choice": None if choice is None else choice.name, "read": read}))
    dist.barrier()
    distributed.exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
