"""What a fine-tuning start costs in reading its chat data: N synthetic conversations (100k by
default) in data.format=chat, the training loader built as a rank builds it at start.

    python benchmarks/chat_startup.py [--conversations 100000] [--out DIR]

Three starts, each timed (the config's data checks, then the training loader): `tokenize`
without the on-disk cache (what every rank did at every start before the cache existed), `first`
with the cache (tokenizes once and writes data.root/.chat_cache), `cached` every start after it
(reads the cache). It prints each in seconds and the ratio of `cached` to `tokenize`: the
start-up the cache saves every rank of every later start.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lingua.data import DataArgs, validate_data_args  # noqa: E402
from lingua.data import chat as chat_data  # noqa: E402


def write_conversations(root: Path, n: int) -> None:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    root.mkdir(parents=True)
    with open(root / "train.jsonl", "w") as f:
        for i in range(n):
            question = " ".join(words[(i + k) % 8] for k in range(8 + i % 24))
            answer = " ".join(words[(i * 3 + k) % 8] for k in range(12 + i % 40))
            messages = [{"role": "user", "content": f"Q{i}: {question}?"},
                        {"role": "assistant", "content": answer}]
            if i % 3 == 0:
                messages.insert(0, {"role": "system", "content": "Answer briefly."})
            f.write(json.dumps({"messages": messages}) + "\n")


def timed_start(args: DataArgs) -> tuple:
    t0 = time.perf_counter()
    validate_data_args(args)
    loader = chat_data.ChatLoader(args, 0, 1, seed=0)
    return time.perf_counter() - t0, len(loader.convs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=None)
    ns = parser.parse_args()
    out = ns.out or Path(tempfile.mkdtemp(prefix="chat_startup_"))
    root = out / "chat"
    write_conversations(root, ns.conversations)
    args = DataArgs(root=str(root), format="chat", seq_len=256, batch_size=8, val_sequences=0)
    results = {}
    args.chat.cache = False
    results["tokenize"], n = timed_start(args)
    args.chat.cache = True
    results["first"], _ = timed_start(args)
    results["cached"], m = timed_start(args)
    assert n == m, (n, m)
    for name, seconds in results.items():
        print(f"{name:>9}: {seconds:7.2f} s  ({n} conversations)")
    print(f"cached / tokenize: {results['cached'] / results['tokenize']:.3f}")


if __name__ == "__main__":
    main()
