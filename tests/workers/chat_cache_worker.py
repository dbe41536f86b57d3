"""The chat cache read by several gloo ranks, for tests/test_chat_data.py.

`torchrun --nproc-per-node N -m tests.workers.chat_cache_worker ROOT OUT_DIR`: every rank builds
a ChatLoader on the chat corpus ROOT (seq_len 64, as the test's chat_args) and writes
OUT_DIR/rank<r>.json: whether it tokenized and its first step's tokens. Warnings go to stdout,
prefixed with the rank.
"""

import json
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from lingua.data import DataArgs
from lingua.data import chat as chat_data
from lingua.data.chat import ChatArgs, ChatLoader
from lingua.parallel import distributed


def main(root: Path, out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout,
                        format=f"[rank{rank}] %(name)s: %(message)s")
    calls, tokenize = [], chat_data.tokenize_conversations
    chat_data.tokenize_conversations = lambda *a, **k: calls.append(1) or tokenize(*a, **k)
    args = DataArgs(root=str(root), format="chat", seq_len=64, batch_size=2, val_sequences=0,
                    chat=ChatArgs())
    loader = ChatLoader(args, rank, world_size, seed=0)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(
        {"tokenized": len(calls), "tokens": loader.next_step()[0].tokens.tolist()}))
    dist.barrier()
    distributed.exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
