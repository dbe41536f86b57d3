"""Reading jsonl chunk files: which lines hold a document to train on (the others skipped by
reason), and one data-parallel rank's share of a source's lines, resumable by byte offset."""

import json
from pathlib import Path

from lingua.errors import ConfigError

# Why a line was skipped; the keys of `skipped_by_reason` (and of meta.json's, for memmap corpora).
SKIP_REASONS = ("invalid_utf8", "invalid_json", "no_text", "empty")


class BadLine(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def decode_line(raw: bytes) -> str:
    """The line's text; raises BadLine with one of SKIP_REASONS when there is none to train on."""
    try:
        line = raw.decode("utf-8-sig")  # -sig: a byte-order mark at a file's start is no error
    except UnicodeDecodeError as err:
        raise BadLine("invalid_utf8", f"invalid UTF-8: {err}") from None
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as err:  # RecursionError: absurdly deep nesting
        raise BadLine("invalid_json", f"invalid JSON: {str(err)[:100]}") from None
    text = obj.get("text") if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise BadLine("no_text", 'no string "text" field' if isinstance(obj, dict)
                      else f"a JSON {type(obj).__name__}, not an object with a \"text\" field")
    if not text:
        raise BadLine("empty", "empty text")
    if not text.isascii():
        try:  # JSON escapes can encode lone surrogates, which no tokenizer can encode
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise BadLine("invalid_utf8", f"text not encodable as UTF-8: {err}") from None
    return text


def _count_lines(path: Path) -> int:
    """Lines as readline() sees them (a last line without a newline counts)."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            n, last = n + chunk.count(b"\n"), chunk[-1:]
    return n + (last != b"\n")


class JsonlSource:
    """This rank's share of one source's lines, looping over epochs; resumable by byte offset."""

    def __init__(self, name: str, directory: Path, dp_rank: int, dp_size: int, counter):
        self.name, self.dp_rank, self.dp_size, self.counter = name, dp_rank, dp_size, counter
        self.files = sorted(directory.glob("*.jsonl"))
        # line: index in this epoch's files concatenated (it picks the rank's lines);
        # file_start: the line index of the current file's first line (for messages)
        self.state = {"epoch": 0, "file": 0, "offset": 0, "line": 0, "file_start": 0}

    def load_state(self, saved: dict) -> None:
        self.state = dict(saved)
        if "file_start" not in self.state:  # a checkpoint from before file_start was kept
            self.state["file_start"] = sum(_count_lines(f) for f in self.files[:saved["file"]])

    def next_text(self) -> str:
        s = self.state
        for _ in range(2 * len(self.files) + 2):  # give up after two empty passes over all files
            path = self.files[s["file"]]
            with open(path, "rb") as f:
                f.seek(s["offset"])
                while True:
                    raw = f.readline()
                    if not raw:
                        break
                    s["offset"] += len(raw)
                    line, s["line"] = s["line"], s["line"] + 1
                    if line % self.dp_size != self.dp_rank or not raw.strip():
                        continue
                    try:
                        return decode_line(raw)
                    except BadLine as err:
                        if s["epoch"] == 0:  # count (and log) each bad line once, not per epoch
                            self.counter.skip(path, line - s["file_start"] + 1, err)
            s["file"], s["offset"], s["file_start"] = s["file"] + 1, 0, s["line"]
            if s["file"] == len(self.files):
                s.update(file=0, line=0, file_start=0, epoch=s["epoch"] + 1)
        # check_jsonl_lines refuses such a corpus at start: here only if the files changed since
        fix = ("Train on fewer data-parallel ranks than usable lines, or add documents."
               if self.dp_size > 1 else "Fix the files: one {\"text\": ...} object a line.")
        raise ConfigError(f"Source {self.name or '(root)'} has no usable line for data-parallel "
                          f"rank {self.dp_rank} of {self.dp_size} in {len(self.files)} files "
                          f"({self.counter.count} lines skipped as bad, {self.counter.by_reason}). "
                          + fix)
