"""Reading jsonl chunk files: which lines hold a document to train on (the others skipped by
reason), and one data-parallel rank's share of a source's lines, resumable by byte offset."""

import json
import logging
from pathlib import Path

from lingua.errors import ConfigError

# Why a line was skipped; the keys of `skipped_by_reason` (and of meta.json's, for memmap corpora).
SKIP_REASONS = ("invalid_utf8", "invalid_json", "no_text", "empty")
logger = logging.getLogger("lingua.data")


class BadLine(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


CHECKED_FROM = 100   # lines read before the unusable fraction is judged


class SkipCounter:
    """The one policy for unusable lines, in every format: skipped and counted by reason, the
    first warned of with its file and line (then a count at 100, 1000 and every 10,000), and
    refused once more than `max_fraction` of the lines read are unusable, judged from the
    CHECKED_FROM-th line on (a corpus mostly unusable is a wrong path or format, not noise)."""

    def __init__(self, reasons, max_fraction: float = 1.0, log: bool = True, what: str = ""):
        self.by_reason = dict.fromkeys(reasons, 0)
        self.max_fraction, self.log, self.what = max_fraction, log, what
        self.usable = 0
        self.first = None   # (path, line number, reason) of the first skipped line

    @property
    def count(self) -> int:
        return sum(self.by_reason.values())

    @property
    def nonzero(self) -> dict:
        return {k: n for k, n in self.by_reason.items() if n}

    def restore(self, by_reason: dict, usable: int, first) -> None:
        """The counts of an earlier pass over the same lines, warned of and judged as if now."""
        self.usable = usable
        self.by_reason.update(by_reason)
        if first is not None:
            self._first_skipped(*first)
        self.check()

    def used(self) -> None:
        self.usable += 1
        self.check()

    def skip(self, path, line_no: int, err: BadLine) -> None:
        self.by_reason[err.reason] += 1
        if self.first is None:
            self._first_skipped(path, line_no, f"{err.reason}: {err}")
        elif self.log and (self.count in (100, 1000) or self.count % 10_000 == 0):
            logger.warning("%d lines skipped so far (%s), the last line %d of %s", self.count,
                           self.nonzero, line_no, path)
        self.check()

    def _first_skipped(self, path, line_no: int, why: str) -> None:
        self.first = (path, line_no, why)
        if self.log:
            logger.warning("skipping unusable line %d of %s (%s); such lines are skipped and "
                           "counted (skipped_lines, skipped_<reason>), the run refused if more "
                           "than %g of the lines read are", line_no, path, why, self.max_fraction)

    def check(self) -> None:
        read = self.usable + self.count
        if read < CHECKED_FROM or self.count <= self.max_fraction * read:
            return
        first = (f"; the first is line {self.first[1]} of {self.first[0]} ({self.first[2]})"
                 if self.first else "")
        raise ConfigError(
            f"{self.count} of the first {read} lines{self.what} are unusable ({self.nonzero}), "
            f"more than data.max_skipped_fraction={self.max_fraction}{first}. Check data.root and "
            f"data.format against the files, fix the lines, or raise data.max_skipped_fraction "
            f"if they are expected.")


def load_json(raw: bytes):
    """The line's JSON value; BadLine (invalid_utf8, invalid_json) when it has none."""
    try:
        line = raw.decode("utf-8-sig")  # -sig: a byte-order mark at a file's start is no error
    except UnicodeDecodeError as err:
        raise BadLine("invalid_utf8", f"invalid UTF-8: {err}") from None
    try:
        return json.loads(line)
    except (ValueError, RecursionError) as err:  # RecursionError: absurdly deep nesting
        raise BadLine("invalid_json", f"invalid JSON: {str(err)[:100]}") from None


def check_utf8(text: str, what: str) -> None:
    """BadLine unless `text` encodes: JSON escapes can encode lone surrogates, which no tokenizer
    can."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise BadLine("invalid_utf8", f"{what} not encodable as UTF-8: {err}") from None


def decode_line(raw: bytes) -> str:
    """The line's text; raises BadLine with one of SKIP_REASONS when there is none to train on."""
    obj = load_json(raw)
    text = obj.get("text") if isinstance(obj, dict) else None
    if not isinstance(text, str):
        raise BadLine("no_text", 'no string "text" field' if isinstance(obj, dict)
                      else f"a JSON {type(obj).__name__}, not an object with a \"text\" field")
    if not text:
        raise BadLine("empty", "empty text")
    check_utf8(text, "text")
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
                        text = decode_line(raw)
                    except BadLine as err:
                        if s["epoch"] == 0:  # count (and log) each bad line once, not per epoch
                            self.counter.skip(path, line - s["file_start"] + 1, err)
                        continue
                    if s["epoch"] == 0:
                        self.counter.used()
                    return text
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
