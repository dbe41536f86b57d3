"""The async checkpoint's gloo group on 2 gloo ranks, for tests/test_scale_hazards.py.

`torchrun --nproc-per-node 2 -m tests.workers.scale_async_group_worker OUT_DIR <overrides>`: runs
apps.llama.train's main with the training loop replaced by a probe (no step runs) that writes
OUT_DIR/rank<r>.json: whether the background writes' gloo group exists when training would start.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from apps.llama import train
from lingua import checkpoint
from lingua.launch import run
from lingua.train.loop import Run


def main(out_dir: Path, overrides: list) -> None:
    def probe(self) -> bool:
        owner, group = checkpoint._ASYNC_GROUP
        made = group is not None and owner is dist.group.WORLD
        (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(
            {"made": made, "again": made and checkpoint._async_group() is group}))
        return True

    Run.train = probe
    run.exit_cli(lambda: train.main(overrides))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
