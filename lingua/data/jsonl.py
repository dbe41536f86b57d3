"""Reading jsonl chunk files (`data.format=jsonl`): which lines hold a document to train on (the
others skipped by reason), one data-parallel rank's share of a source's lines, resumable by byte
offset, and the loader that mixes the sources and packs their tokens into rows."""

import dataclasses
import json
import logging
from pathlib import Path
from typing import Dict, List

import numpy as np

from lingua.data.batch import VAL_DIR, Batch, packed_batch, val_share
from lingua.data.loader import Loader
from lingua.data.tokenizer import build_tokenizer
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
    """The one policy for unusable lines, in every format: counted by reason, the first warned of
    with its file and line (then counts), refused once over `max_fraction` of the lines read from
    the CHECKED_FROM-th on (a corpus mostly unusable is a wrong path or format, not noise)."""

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
                           "than %g of the lines read are unusable (data.max_skipped_fraction)",
                           line_no, path, why, self.max_fraction)

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
    """BadLine unless `text` encodes (JSON escapes can hold lone surrogates)."""
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
    PATTERN, ROW = "*.jsonl", 'one {"text": ...} object a line'

    def __init__(self, name: str, directory: Path, dp_rank: int, dp_size: int, counter):
        self.name, self.dp_rank, self.dp_size, self.counter = name, dp_rank, dp_size, counter
        self.files = sorted(directory.glob(self.PATTERN))
        # line: index in this epoch's files concatenated (it picks the rank's lines);
        # file_start: the line index of the current file's first line (for messages)
        self.state = {"epoch": 0, "file": 0, "offset": 0, "line": 0, "file_start": 0}

    def load_state(self, saved: dict) -> None:
        self.state = dict(saved)
        if "file_start" not in self.state:  # a checkpoint from before file_start was kept
            self.state["file_start"] = sum(_count_lines(f) for f in self.files[:saved["file"]])

    def read(self, path: Path, offset: int):
        """(line, the offset after it) of each line of `path` from byte `offset` on."""
        with open(path, "rb") as f:
            f.seek(offset)
            for raw in iter(f.readline, b""):
                offset += len(raw)
                yield raw, offset

    @staticmethod
    def decode(raw: bytes):
        """The line's text, None for a blank line (not counted, it keeps its place), or BadLine."""
        return decode_line(raw) if raw.strip() else None

    def next_text(self) -> str:
        s = self.state
        for _ in range(2 * len(self.files) + 2):  # give up after two empty passes over all files
            path = self.files[s["file"]]
            for raw, offset in self.read(path, s["offset"]):
                s["offset"] = offset
                line, s["line"] = s["line"], s["line"] + 1
                if line % self.dp_size != self.dp_rank:
                    continue
                try:
                    text = self.decode(raw)
                except BadLine as err:
                    if s["epoch"] == 0:  # count (and log) each bad line once, not per epoch
                        self.counter.skip(path, line - s["file_start"] + 1, err)
                    continue
                if text is None:
                    continue
                if s["epoch"] == 0:
                    self.counter.used()
                return text
            s["file"], s["offset"], s["file_start"] = s["file"] + 1, 0, s["line"]
            if s["file"] == len(self.files):
                s.update(file=0, line=0, file_start=0, epoch=s["epoch"] + 1)
        # check_ranks refuses such a corpus at start: here only if the files changed since
        fix = ("Train on fewer data-parallel ranks than usable lines, or add documents."
               if self.dp_size > 1 else f"Fix the files: {self.ROW}.")
        raise ConfigError(f"Source {self.name or '(root)'} has no usable line for data-parallel "
                          f"rank {self.dp_rank} of {self.dp_size} in {len(self.files)} files "
                          f"({self.counter.count} lines skipped as bad, {self.counter.by_reason}). "
                          + fix)


def source_dirs(args, pattern: str = "*.jsonl") -> Dict[str, Path]:
    """Source name -> directory, with their weights taken from args.sources (default: all, 1)."""
    root = Path(args.root)
    if args.sources:
        return {name: root / name for name in args.sources}
    subdirs = sorted(p for p in root.iterdir()
                     if p.is_dir() and p.name != VAL_DIR and any(p.glob(pattern)))
    return {p.name: p for p in subdirs} if subdirs else {"": root}


class JsonlLoader(Loader):
    name, SOURCE = "jsonl", JsonlSource
    checks_need_tokenizer = False

    def __init__(self, args, dp_rank: int, dp_size: int, seed: int):
        self.args, self.dp_rank, self.dp_size = args, dp_rank, dp_size
        self.tokenizer = build_tokenizer(args.tokenizer)
        if dp_rank == 0:
            tok = args.tokenizer
            logger.info("%s data: the %s tokenizer%s (%d tokens)", self.name, tok.kind,
                        f" {tok.path}" if tok.path else "", self.tokenizer.vocab_size)
        self.counter = SkipCounter(SKIP_REASONS, args.max_skipped_fraction)
        dirs = source_dirs(args, self.SOURCE.PATTERN)
        self.sources = [self.SOURCE(n, d, dp_rank, dp_size, self.counter) for n, d in dirs.items()]
        weights = np.array([args.sources.get(n, 1.0) if args.sources else 1.0 for n in dirs])
        self.probs = weights / weights.sum()
        self.rng = np.random.default_rng([seed, dp_rank])
        # Tokens read but not yet emitted, and their document numbers: arrays, so that a long
        # document is taken a row at a time by slicing.
        self.buffer, self.buffer_docs, self.n_docs = np.zeros(0, np.int64), np.zeros(0, np.int64), 0

    def _fill(self, n_tokens: int) -> None:
        tokens, docs, have = [self.buffer], [self.buffer_docs], len(self.buffer)
        while have < n_tokens:
            source = self.sources[self.rng.choice(len(self.sources), p=self.probs)]
            ids = np.asarray(self.tokenizer.encode(source.next_text()), dtype=np.int64)
            tokens.append(ids)
            docs.append(np.full(len(ids), self.n_docs, dtype=np.int64))
            have += len(ids)
            self.n_docs += 1
        if len(tokens) > 1:
            self.buffer, self.buffer_docs = np.concatenate(tokens), np.concatenate(docs)

    def next_rows(self, n_rows: int):
        """The next n_rows packed rows of seq_len+1 tokens, and their document ids."""
        n = n_rows * (self.args.seq_len + 1)
        self._fill(n)
        rows, docs = self.buffer[:n].reshape(n_rows, -1), self.buffer_docs[:n].reshape(n_rows, -1)
        self.buffer, self.buffer_docs = self.buffer[n:], self.buffer_docs[n:]
        return rows, docs

    def next_step(self) -> List[Batch]:
        return [packed_batch(*self.next_rows(self.args.batch_size))
                for _ in range(self.args.grad_accum)]

    def state_dict(self) -> dict:
        return {"format": self.name, "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "sources": [dict(s.state) for s in self.sources],
                "rng": self.rng.bit_generator.state, "buffer": self.buffer.tolist(),
                "buffer_docs": self.buffer_docs.tolist(), "n_docs": self.n_docs,
                "skipped_lines": self.counter.count, "skipped_by_reason": self.skipped()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != self.name or state["dp_size"] != self.dp_size \
                or state["dp_rank"] != self.dp_rank or len(state["sources"]) != len(self.sources):
            raise ConfigError(
                f"The checkpoint's {self.name} stream position was saved by data-parallel rank "
                f"{state.get('dp_rank')} of {state.get('dp_size')} over "
                f"{len(state.get('sources', []))} sources; this is rank {self.dp_rank} of "
                f"{self.dp_size} over {len(self.sources)}. A {self.name} stream resumes only on "
                f"the same data-parallel layout and sources: use that layout, or the memmap "
                f"format (setup/prepare_data.py jsonl ...), which resumes on any layout.")
        for source, saved in zip(self.sources, state["sources"]):
            source.load_state(saved)
        self.rng.bit_generator.state = state["rng"]
        self.buffer = np.asarray(state["buffer"], dtype=np.int64)
        self.buffer_docs = np.asarray(state["buffer_docs"], dtype=np.int64)
        self.n_docs = state["n_docs"]
        self.counter.by_reason.update(state.get("skipped_by_reason", {}))
        self.counter.usable = self.n_docs   # documents read: the usable lines, near enough

    @classmethod
    def val_batches(cls, args, dp_rank: int, dp_size: int) -> List[Batch]:
        """The first packed rows of root/val, read in order by a single reader."""
        n = (args.val_sequences // dp_size) * dp_size
        val_args = dataclasses.replace(args, root=str(Path(args.root) / VAL_DIR), sources={})
        rows, docs = cls(val_args, 0, 1, seed=0).next_rows(n)
        return val_share(rows, docs, dp_rank, dp_size, args.batch_size)

    @classmethod
    def validate(cls, args, root: Path) -> None:
        files = cls.SOURCE.PATTERN
        if args.sources:
            for name, weight in args.sources.items():
                if not (root / name).is_dir() or not any((root / name).glob(files)):
                    raise ConfigError(f"data.sources names {name!r}, but {root / name} holds no "
                                      f"{files} file. Fix the name or the directory.")
                if weight <= 0:
                    raise ConfigError(f"data.sources.{name}={weight} must be a positive weight.")
        elif not any(any(d.glob(files)) for d in source_dirs(args, files).values()):
            raise ConfigError(f"data.root={root} holds no {files} chunk file (nor "
                              f"sub-directories with some). Point data.root at the chunk files' "
                              f"directory.")
        if args.val_sequences and not any((root / VAL_DIR).glob(files)):
            raise ConfigError(f"Validation needs held-out data: {root / VAL_DIR} holds no {files} "
                              f"file. Put a few chunk files there, or set data.val_sequences=0.")

    @classmethod
    def check_ranks(cls, args, dp_size: int) -> None:
        """Every data-parallel rank has a usable line in every source (and val/): a corpus of bad
        lines is refused before any process starts or any file is written."""
        readers = [(f"source {name} ({d})" if name else f"the corpus in {d}", d, dp_size, "")
                   for name, d in source_dirs(args, cls.SOURCE.PATTERN).items()]
        if args.val_sequences:   # one reader, in order (val_batches)
            val = Path(args.root) / VAL_DIR
            readers.append((f"the validation data in {val}", val, 1,
                            ", or set data.val_sequences=0 to train without validation"))
        for what, directory, ranks, hint in readers:
            _check_lines(what, cls.SOURCE("", directory, 0, 1, None), ranks, hint)


def _check_lines(what: str, source: JsonlSource, dp_size: int, hint: str) -> None:
    """ConfigError unless each of dp_size readers, taking every dp_size-th line of the source's
    files as JsonlSource does (blank lines keep their place), finds a usable one."""
    missing, first_bad, usable = set(range(dp_size)), None, 0
    counter = SkipCounter(SKIP_REASONS, log=False)
    index = -1
    for path in source.files:
        for line_no, (raw, _) in enumerate(source.read(path, 0), 1):
            index += 1
            try:
                if source.decode(raw) is None:
                    continue
            except BadLine as err:
                counter.skip(path, line_no, err)
                first_bad = first_bad or f"line {line_no} of {path}: {err}"
                continue
            usable += 1
            missing.discard(index % dp_size)
            if not missing:
                return
    if usable:
        ranks = ", ".join(map(str, sorted(missing)[:8])) + (", ..." if len(missing) > 8 else "")
        raise ConfigError(f"{what} has {usable} usable line(s) for {dp_size} data-parallel "
                          f"ranks, and rank r reads lines r, r+{dp_size}, r+{2 * dp_size}, ... "
                          f"only, so rank {ranks} would get none. Train on fewer data-parallel "
                          f"ranks than usable lines, or add documents.")
    found = (f"its {counter.count} line(s) with text are all bad ({counter.nonzero}), the first "
             f"being {first_bad}" if first_bad else "its lines are all blank")
    raise ConfigError(f"{what} has no usable line in its {len(source.files)} {source.PATTERN} "
                      f"files: {found}. Fix the files ({source.ROW}) or point data.root at "
                      f"another corpus{hint}.")
