"""Prepare training data.

    python setup/prepare_data.py embedded --out data/embedded
        the debug corpus: Python standard-library docstrings, bytes tokenizer (no download)
    python setup/prepare_data.py jsonl <dir or files ...> --out DIR
                                 [--tokenizer-kind K --tokenizer-path P]
        jsonl chunk files ({"text": ...} a line) -> the memory-mapped format; bad lines (invalid
        UTF-8 or JSON, no string "text", empty text) are counted by reason in meta.json and
        skipped, the first few logged with file and line; files under a `val/` directory (or
        --val-fraction of the documents) form the validation split
    python setup/prepare_data.py hf {fineweb-edu,dclm} --out DIR [--max-docs N --chunk-docs N]
        download a Hugging Face data set (needs network and the `datasets` package) into jsonl
        chunk files <name>.chunk.NN.jsonl, usable with data.format=jsonl or the jsonl command
"""

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lingua.data import VAL_DIR, DataArgs, ensure_embedded_corpus  # noqa: E402
from lingua.data.jsonl import SKIP_REASONS, BadLine, SkipCounter, decode_line  # noqa: E402
from lingua.data.memmap import read_meta, write_memmap_corpus  # noqa: E402
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer  # noqa: E402
from lingua.errors import ConfigError  # noqa: E402

HF_DATASETS = {
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", "text"),
    "dclm": ("mlfoundations/dclm-baseline-1.0", None, "text"),
}


def jsonl_texts(files, counter: SkipCounter):
    for path in files:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():  # blank lines are formatting, not documents
                    continue
                try:
                    text = decode_line(raw)
                except BadLine as err:
                    counter.skip(path, line_no, err)
                    continue
                counter.used()
                yield text


def prepare_jsonl(inputs, out: Path, tokenizer_args: TokenizerArgs, val_fraction: float,
                  command: str = "",
                  max_skipped_fraction: float = DataArgs.max_skipped_fraction) -> dict:
    files, is_val = [], {}
    for item in map(Path, inputs):
        found = sorted(item.rglob("*.jsonl")) if item.is_dir() else [item]
        files += found
        # only a val/ directory inside the input counts (not one among its ancestors)
        is_val.update({f: VAL_DIR in (f.relative_to(item).parts[:-1] if item.is_dir()
                                      else f.parts[-2:-1]) for f in found})
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise ConfigError(f"No jsonl input found ({', '.join(map(str, missing or inputs))}). Give "
                          f"*.jsonl files or directories holding them.")
    val_files = [f for f in files if is_val[f]]
    train_files = [f for f in files if not is_val[f]]
    tokenizer = build_tokenizer(tokenizer_args)
    counter = SkipCounter(SKIP_REASONS, max_skipped_fraction)
    if val_files:
        splits = {"train": jsonl_texts(train_files, counter),
                  "val": jsonl_texts(val_files, counter)}
    else:  # hold out every k-th document
        every = max(2, round(1 / val_fraction))
        splits = {"train": (t for i, t in enumerate(jsonl_texts(train_files, counter))
                            if i % every),
                  # the same lines again: counted and logged by the first pass already
                  "val": (t for i, t in enumerate(jsonl_texts(train_files,
                                                              SkipCounter(SKIP_REASONS, log=False)))
                          if i % every == 0)}
    meta = write_memmap_corpus(out, splits, tokenizer, tokenizer_args,
                               source=f"jsonl: {len(files)} files")
    meta["skipped_lines"] = counter.count
    meta["skipped_by_reason"] = counter.by_reason
    if command:
        meta["prepared_by"] = command  # error messages about a damaged corpus quote it
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(f"skipped {counter.count} bad lines: {counter.by_reason}")
    return meta


def jsonl_command(args) -> str:
    """The command line that prepares the same corpus again, with absolute paths."""
    words = ["python", "setup/prepare_data.py", "jsonl",
             *(str(Path(i).resolve()) for i in args.inputs), "--out", str(args.out.resolve()),
             "--tokenizer-kind", args.tokenizer_kind]
    if args.tokenizer_path:
        words += ["--tokenizer-path", str(Path(args.tokenizer_path).resolve())]
    return " ".join(map(shlex.quote, words + ["--val-fraction", str(args.val_fraction)]))


def download_hf(name: str, out: Path, max_docs: int, chunk_docs: int) -> None:
    """Stream a Hugging Face data set into jsonl chunk files (needs network)."""
    try:
        from datasets import load_dataset
    except ImportError:
        raise ConfigError("The `hf` command needs the `datasets` package: pip install datasets "
                          "(and network access to the Hugging Face hub).") from None
    repo, subset, field = HF_DATASETS[name]
    try:
        stream = load_dataset(repo, name=subset, split="train", streaming=True)
    except Exception as err:  # no network, unknown repo, auth: all surface here
        raise ConfigError(f"Could not open {repo} on the Hugging Face hub ({err}). Check the "
                          f"network, or copy jsonl files here by other means.") from None
    out.mkdir(parents=True, exist_ok=True)
    chunk, f = -1, None
    for i, row in enumerate(stream):
        if i == max_docs:
            break
        if i % chunk_docs == 0:
            if f:
                f.close()
            chunk += 1
            f = open(out / f"{name}.chunk.{chunk:02d}.jsonl", "w")
        f.write(json.dumps({"text": row[field]}) + "\n")
    if f:
        f.close()
    print(f"wrote {chunk + 1} chunk files to {out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1] if __doc__ else "",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("embedded")
    p.add_argument("--out", type=Path, default=Path("data/embedded"))
    p = sub.add_parser("jsonl")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer-kind", default="bytes")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--max-skipped-fraction", type=float, default=DataArgs.max_skipped_fraction,
                   help="refuse the corpus when more of its lines than this are unusable")
    p = sub.add_parser("hf")
    p.add_argument("name", choices=sorted(HF_DATASETS))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-docs", type=int, default=1_000_000)
    p.add_argument("--chunk-docs", type=int, default=100_000)
    args = parser.parse_args(argv)
    try:
        if args.command == "embedded":
            ensure_embedded_corpus(args.out)
            print(f"{args.out}: {read_meta(args.out)['splits']}")
        elif args.command == "jsonl":
            meta = prepare_jsonl(args.inputs, args.out,
                                 TokenizerArgs(args.tokenizer_kind, args.tokenizer_path),
                                 args.val_fraction, jsonl_command(args),
                                 args.max_skipped_fraction)
            print(f"wrote {args.out}: {meta['splits']}")
        else:
            download_hf(args.name, args.out, args.max_docs, args.chunk_docs)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
