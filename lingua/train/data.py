"""Training data in two formats.

memmap (the default, and the debug presets'): all documents' tokens in one memory-mapped array
plus document start offsets, written by `setup/prepare_data.py`. Sample i of the endless sample
stream is window perm_e[i mod n] of seq_len+1 tokens, where e = i // n is the epoch and perm_e a
permutation seeded by (seed, e). The global batch of step k is samples [k*G, (k+1)*G) with
G = batch_size x dp_size x grad_accum, and data-parallel rank r reads its contiguous slice. So a
step's global batch is the same sequences for every layout with the same G, the loader's whole
state is the number of samples consumed, and a resume on another layout has no repeat and no gap.

jsonl (lingua-compatible streaming): `{"text": ...}` lines in `*.jsonl` chunk files, grouped in
source sub-directories mixed by weight, tokenized and packed on the fly. Every chunk file is read
whatever the number of ranks: rank r takes lines r, r + dp, r + 2dp, ... of the source's files
concatenated in name order. (lingua gave each rank whole files, so with more files than ranks some
files were never read, and with fewer they were read twice.) The price is that every rank scans
every line; tokenization, the expensive part, is done once per line.

Bad data. A jsonl line that is not valid UTF-8, not valid JSON, has no string "text" field, or
whose text is empty is skipped and counted by reason (`skipped_lines`, `skipped_by_reason`), once
however many epochs pass over it; the first few are logged with their file and line number.
Blank lines are formatting, not documents, and are skipped silently. `setup/prepare_data.py`
applies the same rules when it builds the memmap format. A document longer than seq_len is
packed across as many rows (and steps) as it needs. A memmap corpus whose files disagree with its
meta.json (a truncated or damaged train.bin, a size that is not a whole number of tokens, a
broken docs.npy) is refused with a ConfigError naming the file and the command that rebuilds it,
before any process group or run directory exists.

The loaders are single-process by design (no workers, no prefetch): a step's batch is a function
of the seed, data.seq_len, the global batch and the data-parallel layout alone.
"""

import ast
import json
import logging
import os
import shlex
import shutil
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np
import torch

from lingua.errors import ConfigError
from lingua.train.tokenizer import Tokenizer, TokenizerArgs, build_tokenizer, check_tokenizer_args

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
VAL_DIR = "val"


@dataclass
class DataArgs:
    root: str = "data/embedded"     # corpus directory (relative paths resolve against the cwd)
    format: str = "memmap"          # memmap (pre-tokenized, global-index) | jsonl (streaming)
    seq_len: int = 256
    batch_size: int = 8             # per-rank micro-batch, in sequences
    grad_accum: int = 1
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    sources: Dict[str, float] = field(default_factory=dict)  # jsonl: sub-directory -> weight
    prepare_embedded: bool = False  # build the embedded debug corpus in `root` if it is missing
    val_sequences: int = 64         # size of the held-out validation set


@dataclass
class Batch:
    tokens: torch.Tensor    # [b, seq_len] inputs
    labels: torch.Tensor    # [b, seq_len] next tokens
    doc_ids: torch.Tensor   # [b, seq_len] document index of each input token (for masking)


def _rows_to_batch(rows: np.ndarray, docs: np.ndarray) -> Batch:
    rows = torch.from_numpy(rows.astype(np.int64))
    docs = torch.from_numpy(docs.astype(np.int64))
    return Batch(tokens=rows[:, :-1], labels=rows[:, 1:], doc_ids=docs[:, :-1])


# ------------------------------------------------------------------------------------------------
# memmap format


def read_meta(root: Path) -> dict:
    path = Path(root) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"data.root={root} holds no meta.json, so it is not a prepared corpus "
                          f"(or it is empty, or its preparation was interrupted). Prepare one with "
                          f"`python setup/prepare_data.py embedded --out {root}` or `... jsonl "
                          f"<files> --out {root}`, or set data.format=jsonl for raw jsonl chunk "
                          f"files.") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON ({err}): the corpus is damaged. "
                          f"{rebuild_hint(root, {})}") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{path} holds a JSON {type(meta).__name__}, not the object "
                          f"setup/prepare_data.py writes: the corpus is damaged. "
                          f"{rebuild_hint(root, {})}")
    return meta


def rebuild_hint(root, meta: dict) -> str:
    """The sentence telling how to make the corpus at `root` again (for error messages)."""
    root = shlex.quote(str(root))
    if meta.get("prepared_by"):
        return (f"Rebuild it with the command that prepared it, `{meta['prepared_by']}` (with "
                f"--out {root} if it has moved), or copy it again from where it came from.")
    if "stdlib docstrings" in str(meta.get("source", "")):  # the embedded debug corpus
        return (f"Rebuild it with `rm -r {root} && python setup/prepare_data.py embedded --out "
                f"{root}` (a preset with data.prepare_embedded=true rebuilds a removed one "
                f"itself).")
    return (f"Rebuild it with `python setup/prepare_data.py jsonl <your jsonl files or "
            f"directories> --out {root}`, or copy it again from where it came from.")


def _split_info(root: Path, meta: dict, split: str):
    """(tokens, docs, dtype) of a split as meta.json records them."""
    try:
        info = meta["splits"][split]
        return int(info["tokens"]), int(info["docs"]), np.dtype(meta["dtype"])
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{root / 'meta.json'} has no usable entry for the {split} split "
                          f"({type(err).__name__}: {err}): it was not written by "
                          f"setup/prepare_data.py, or it is damaged. {rebuild_hint(root, meta)}"
                          ) from None


def _check_bin_size(path: Path, n_tokens: int, dtype: np.dtype, meta: dict) -> None:
    expected = n_tokens * dtype.itemsize
    if not path.is_file():
        raise ConfigError(f"{path} is missing, but meta.json next to it says it holds {n_tokens} "
                          f"{dtype.name} tokens. {rebuild_hint(path.parent, meta)}")
    actual = path.stat().st_size
    if actual == expected:
        return
    whole = (f", not a whole number of {dtype.name} tokens ({dtype.itemsize} bytes each),"
             if actual % dtype.itemsize else "")
    what = "truncated" if actual < expected else "longer than meta.json says"
    raise ConfigError(f"{path} has {actual} bytes{whole} but meta.json says {n_tokens} "
                      f"{dtype.name} tokens ({expected} bytes): the file is {what} (an "
                      f"interrupted copy or preparation?) and is not trained on. "
                      f"{rebuild_hint(path.parent, meta)}")


def _load_doc_starts(path: Path, n_docs: int, n_tokens: int, meta: dict) -> np.ndarray:
    """The documents' start offsets, checked against meta.json (cheap: one entry a document)."""
    try:
        starts = np.load(path)
    except (OSError, ValueError, EOFError) as err:  # missing, truncated, or no .npy file at all
        raise ConfigError(f"{path} cannot be read ({type(err).__name__}: {str(err)[:200]}). "
                          f"{rebuild_hint(path.parent, meta)}") from None
    good = (starts.ndim == 1 and starts.dtype.kind in "iu" and len(starts) == n_docs
            and (n_docs == 0 or (starts[0] == 0 and starts[-1] <= n_tokens
                                 and bool(np.all(np.diff(starts) >= 0)))))
    if not good:
        raise ConfigError(f"{path} holds {starts.shape} {starts.dtype} values, but meta.json "
                          f"says {n_docs} document starts, increasing from 0, within {n_tokens} "
                          f"tokens: the file is damaged. {rebuild_hint(path.parent, meta)}")
    return starts


class TokenWindows:
    """The windows of seq_len+1 tokens of one split, read from the memory map.

    Every file is checked against meta.json here, so a damaged corpus is refused when the run is
    validated, before training starts."""

    def __init__(self, root, split: str, seq_len: int):
        root = Path(root)
        self.meta = meta = read_meta(root)
        n_tokens, n_docs, dtype = _split_info(root, meta, split)
        self.path = root / f"{split}.bin"
        _check_bin_size(self.path, n_tokens, dtype, meta)
        # an empty file cannot be memory-mapped; the caller reports the split as too short
        self.tokens = (np.memmap(self.path, dtype=dtype, mode="r") if n_tokens
                       else np.zeros(0, dtype))
        self.doc_starts = _load_doc_starts(root / f"{split}.docs.npy", n_docs, n_tokens, meta)
        self.vocab_size = meta.get("vocab_size")
        self.seq_len = seq_len
        self.n_windows = (len(self.tokens) - 1) // seq_len

    def rows(self, windows: np.ndarray):
        starts = windows * self.seq_len
        offsets = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        rows = self.tokens[offsets]
        # A damaged file of the right size is only visible in its tokens: one max per batch.
        if self.vocab_size and rows.size and int(rows.max()) >= self.vocab_size:
            at = int(offsets.flat[int(np.argmax(rows >= self.vocab_size))])
            raise ConfigError(f"{self.path} holds token id {int(self.tokens[at])} at position "
                              f"{at}, outside the vocabulary of {self.vocab_size} that meta.json "
                              f"records: the file is damaged. "
                              f"{rebuild_hint(self.path.parent, self.meta)}")
        docs = np.searchsorted(self.doc_starts, offsets, side="right") - 1
        return rows, docs


class MemmapLoader:
    def __init__(self, args: DataArgs, dp_rank: int, dp_size: int, seed: int):
        self.args, self.dp_rank, self.dp_size, self.seed = args, dp_rank, dp_size, seed
        self.windows = TokenWindows(args.root, "train", args.seq_len)
        self.samples_consumed = 0
        # Bad lines were dropped when the corpus was prepared (meta.json counts them): none here.
        self.skipped_lines = 0
        self.skipped_by_reason = {reason: 0 for reason in SKIP_REASONS}
        prepared = self.windows.meta.get("skipped_lines")
        if prepared and dp_rank == 0:
            logger.info("%s was prepared from jsonl with %d lines skipped (%s)", args.root,
                        prepared, self.windows.meta.get("skipped_by_reason", "no reasons kept"))
        self._perm_epoch, self._perm = -1, None

    def _window_of(self, sample: int) -> int:
        epoch, j = divmod(sample, self.windows.n_windows)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.windows.n_windows), epoch
        return self._perm[j]

    def next_step(self) -> List[Batch]:
        a = self.args
        per_rank = a.batch_size * a.grad_accum
        first = self.samples_consumed + self.dp_rank * per_rank
        self.samples_consumed += per_rank * self.dp_size
        windows = np.array([self._window_of(i) for i in range(first, first + per_rank)])
        batches = []
        for m in range(a.grad_accum):
            rows, docs = self.windows.rows(windows[m * a.batch_size:(m + 1) * a.batch_size])
            batches.append(_rows_to_batch(rows, docs))
        return batches

    def state_dict(self) -> dict:
        return {"format": "memmap", "samples_consumed": self.samples_consumed,
                "seq_len": self.args.seq_len, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != "memmap" or state["seq_len"] != self.args.seq_len \
                or state["seed"] != self.seed:
            raise ConfigError(
                f"The checkpoint's data position was saved with format={state.get('format')}, "
                f"seq_len={state.get('seq_len')}, seed={state.get('seed')}; this run has "
                f"format=memmap, seq_len={self.args.seq_len}, seed={self.seed}. Resume with the "
                f"same data.format, data.seq_len and seed, or start in a new dump_dir.")
        self.samples_consumed = state["samples_consumed"]


# ------------------------------------------------------------------------------------------------
# jsonl streaming format


def source_dirs(args: DataArgs) -> Dict[str, Path]:
    """Source name -> directory, with their weights taken from args.sources (default: all, 1)."""
    root = Path(args.root)
    if args.sources:
        return {name: root / name for name in args.sources}
    subdirs = sorted(p for p in root.iterdir()
                     if p.is_dir() and p.name != VAL_DIR and any(p.glob("*.jsonl")))
    if subdirs:
        return {p.name: p for p in subdirs}
    return {"": root}


# Why a line was skipped; the keys of `skipped_by_reason` (and of meta.json's, for memmap corpora).
SKIP_REASONS = ("invalid_utf8", "invalid_json", "no_text", "empty")
LOGGED_SKIPS = 10   # lines logged one by one; after that only counted, with a summary now and then


class BadLine(ValueError):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _decode_line(raw: bytes) -> str:
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
                        return _decode_line(raw)
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


class MalformedCounter:
    """Counts skipped lines by reason; logs the first LOGGED_SKIPS with file and line number."""

    def __init__(self, log: bool = True):
        self.count, self.log = 0, log
        self.by_reason = {reason: 0 for reason in SKIP_REASONS}

    def skip(self, path, line_no: int, err: BadLine) -> None:
        """Line line_no (1-based) of path was skipped for err.reason."""
        self.count += 1
        self.by_reason[err.reason] += 1
        if not self.log:
            return
        if self.count <= LOGGED_SKIPS:
            logger.warning("skipping line %d of %s: %s%s", line_no, path, err,
                           "" if self.count < LOGGED_SKIPS else
                           f" (the {LOGGED_SKIPS}th skipped line: further ones are counted, in "
                           f"skipped_lines, and summarized at 100, 1000, ... but not logged)")
        elif self.count in (100, 1000) or self.count % 10_000 == 0:
            logger.warning("%d lines skipped so far (%s), the last line %d of %s",
                           self.count, self.by_reason, line_no, path)


class JsonlLoader:
    def __init__(self, args: DataArgs, dp_rank: int, dp_size: int, seed: int):
        self.args, self.dp_rank, self.dp_size = args, dp_rank, dp_size
        self.tokenizer = build_tokenizer(args.tokenizer)
        self.counter = MalformedCounter()
        dirs = source_dirs(args)
        self.sources = [JsonlSource(n, d, dp_rank, dp_size, self.counter) for n, d in dirs.items()]
        weights = np.array([args.sources.get(n, 1.0) if args.sources else 1.0 for n in dirs])
        self.probs = weights / weights.sum()
        self.rng = np.random.default_rng([seed, dp_rank])
        # Tokens read but not yet emitted, and their document numbers. Arrays, not lists: a
        # document far longer than seq_len is then taken a row at a time by slicing (no copy of
        # the rest per step) at 16 bytes a token.
        self.buffer = np.zeros(0, np.int64)
        self.buffer_docs = np.zeros(0, np.int64)
        self.n_docs = 0

    @property
    def skipped_lines(self) -> int:
        return self.counter.count

    @property
    def skipped_by_reason(self) -> Dict[str, int]:
        return dict(self.counter.by_reason)

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
        rows = self.buffer[:n].reshape(n_rows, -1)
        docs = self.buffer_docs[:n].reshape(n_rows, -1)
        self.buffer, self.buffer_docs = self.buffer[n:], self.buffer_docs[n:]
        return rows, docs

    def next_step(self) -> List[Batch]:
        return [_rows_to_batch(*self.next_rows(self.args.batch_size))
                for _ in range(self.args.grad_accum)]

    def state_dict(self) -> dict:
        return {"format": "jsonl", "dp_rank": self.dp_rank, "dp_size": self.dp_size,
                "sources": [dict(s.state) for s in self.sources],
                "rng": self.rng.bit_generator.state, "buffer": self.buffer.tolist(),
                "buffer_docs": self.buffer_docs.tolist(), "n_docs": self.n_docs,
                "skipped_lines": self.counter.count,
                "skipped_by_reason": dict(self.counter.by_reason)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != "jsonl" or state["dp_size"] != self.dp_size \
                or state["dp_rank"] != self.dp_rank or len(state["sources"]) != len(self.sources):
            raise ConfigError(
                f"The checkpoint's jsonl stream position was saved by data-parallel rank "
                f"{state.get('dp_rank')} of {state.get('dp_size')} over "
                f"{len(state.get('sources', []))} sources; this is rank {self.dp_rank} of "
                f"{self.dp_size} over {len(self.sources)}. A jsonl stream resumes only on the "
                f"same data-parallel layout and sources: use that layout, or the memmap format "
                f"(setup/prepare_data.py jsonl ...), which resumes on any layout.")
        for source, saved in zip(self.sources, state["sources"]):
            source.load_state(saved)
        self.rng.bit_generator.state = state["rng"]
        self.buffer = np.asarray(state["buffer"], dtype=np.int64)
        self.buffer_docs = np.asarray(state["buffer_docs"], dtype=np.int64)
        self.n_docs, self.counter.count = state["n_docs"], state["skipped_lines"]
        self.counter.by_reason.update(state.get("skipped_by_reason", {}))


# ------------------------------------------------------------------------------------------------
# entry points


def build_train_loader(args: DataArgs, dp_rank: int, dp_size: int, seed: int):
    loader = MemmapLoader if args.format == "memmap" else JsonlLoader
    return loader(args, dp_rank, dp_size, seed)


def build_val_batches(args: DataArgs, dp_rank: int, dp_size: int) -> List[Batch]:
    """This rank's share of the fixed validation set: the first val_sequences windows in order.

    The count is rounded down to a multiple of dp_size so that every rank gets the same number of
    sequences (collectives need the same number of batches everywhere).
    """
    n = (args.val_sequences // dp_size) * dp_size
    if n == 0:
        return []
    if args.format == "memmap":
        windows = TokenWindows(args.root, "val", args.seq_len)
        n = min(n, (windows.n_windows // dp_size) * dp_size)
        rows, docs = windows.rows(np.arange(n))
    else:
        rows, docs = _jsonl_val_rows(args, n)
    share = n // dp_size
    mine = slice(dp_rank * share, (dp_rank + 1) * share)
    rows, docs = rows[mine], docs[mine]
    return [_rows_to_batch(rows[i:i + args.batch_size], docs[i:i + args.batch_size])
            for i in range(0, share, args.batch_size)]


def _jsonl_val_rows(args: DataArgs, n_rows: int):
    """The first n_rows packed rows of root/val, read in order by a single reader."""
    val_args = DataArgs(root=str(Path(args.root) / VAL_DIR), format="jsonl", seq_len=args.seq_len,
                        tokenizer=args.tokenizer)
    return JsonlLoader(val_args, 0, 1, seed=0).next_rows(n_rows)


def validate_data_args(args: DataArgs, files: bool = True) -> None:
    """Cheap checks before any work; raises ConfigError naming the key or file and the fix.
    files=False checks the batch shape only, not the corpus and tokenizer files
    (lingua.launch.plan)."""
    if args.format not in ("memmap", "jsonl"):
        raise ConfigError(f"data.format={args.format!r} is unknown: use memmap or jsonl.")
    for key in ("seq_len", "batch_size", "grad_accum"):
        if getattr(args, key) < 1:
            raise ConfigError(f"data.{key}={getattr(args, key)} must be at least 1.")
    if args.val_sequences < 0:
        raise ConfigError(f"data.val_sequences={args.val_sequences} must be 0 or more.")
    if not files:
        return
    if not args.root:
        raise ConfigError("data.root is not set. Set data.root=/path/to/corpus (a directory "
                          "prepared by setup/prepare_data.py, or jsonl chunk files with "
                          "data.format=jsonl).")
    check_tokenizer_args(args.tokenizer)
    root = Path(args.root)
    if not root.is_dir():
        if args.prepare_embedded and args.format == "memmap" and args.tokenizer.kind == "bytes":
            return  # built on first use
        # A preset builds its embedded corpus only at its own data.root (lingua.config
        # PRESET_SCOPED): a missing directory the user named is not created behind her back.
        build = (", or add data.prepare_embedded=true to build it there on first use"
                 if args.format == "memmap" and args.tokenizer.kind == "bytes" else "")
        raise ConfigError(f"data.root={args.root} does not exist. Prepare a corpus there (`python "
                          f"setup/prepare_data.py embedded --out {args.root}` for the built-in "
                          f"one{build}), or point data.root at an existing corpus directory.")
    if args.format == "memmap":
        _validate_memmap(args, root)
    else:
        _validate_jsonl(args, root)


def _validate_memmap(args: DataArgs, root: Path) -> None:
    if not any(root.iterdir()):
        raise ConfigError(f"data.root={root} is empty. Prepare a corpus there with "
                          f"setup/prepare_data.py, or point data.root at a prepared one.")
    meta = read_meta(root)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ConfigError(f"{root}/meta.json has format_version={meta.get('format_version')}, "
                          f"this code reads {FORMAT_VERSION}. {rebuild_hint(root, meta)}")
    saved = meta.get("tokenizer")
    if not isinstance(saved, dict) or "kind" not in saved or "vocab_size" not in meta:
        raise ConfigError(f"{root}/meta.json does not record the tokenizer and vocabulary size: "
                          f"it was not written by setup/prepare_data.py, or it is damaged. "
                          f"{rebuild_hint(root, meta)}")
    if saved["kind"] != args.tokenizer.kind:
        raise ConfigError(f"The corpus in {root} was tokenized with the {saved['kind']} tokenizer "
                          f"but data.tokenizer.kind={args.tokenizer.kind}. Use the corpus's "
                          f"tokenizer (data.tokenizer.kind={saved['kind']}, path "
                          f"{saved.get('path')}) or prepare the corpus again with yours.")
    if args.tokenizer.kind != "bytes":
        # Same kind but another file would silently feed ids from another vocabulary; loading
        # the tokenizer is the only sure check (a second or less for real tokenizer files).
        vocab_size = build_tokenizer(args.tokenizer).vocab_size
        if vocab_size != meta["vocab_size"]:
            raise ConfigError(f"The corpus in {root} was tokenized with a vocabulary of "
                              f"{meta['vocab_size']} ({saved['kind']} {saved.get('path')}), but "
                              f"data.tokenizer.path={args.tokenizer.path} has {vocab_size}. Use "
                              f"the corpus's tokenizer file or prepare the corpus again.")
    for split in ("train",) + (("val",) if args.val_sequences else ()):
        windows = TokenWindows(root, split, args.seq_len)  # checks the file size against meta
        if windows.n_windows < 1:
            raise ConfigError(f"The {split} split of {root} has {len(windows.tokens)} tokens, not "
                              f"enough for one sequence of data.seq_len={args.seq_len} + 1. Use a "
                              f"shorter data.seq_len or a larger corpus.")


def check_jsonl_lines(args: DataArgs, dp_size: int) -> None:
    """Every data-parallel rank has a usable line in every jsonl source, and validation one in
    val/: read from the start until each has one (a few lines for a sound corpus), so that a
    corpus of bad lines is refused before any process starts or any file of the run is written."""
    if args.format != "jsonl":
        return
    readers = [(f"source {name} ({d})" if name else f"the corpus in {d}", d, dp_size, "")
               for name, d in source_dirs(args).items()]
    if args.val_sequences:   # one reader, in order (_jsonl_val_rows)
        val = Path(args.root) / VAL_DIR
        readers.append((f"the validation data in {val}", val, 1,
                        ", or set data.val_sequences=0 to train without validation"))
    for what, directory, ranks, hint in readers:
        _check_lines(what, sorted(directory.glob("*.jsonl")), ranks, hint)


def _check_lines(what: str, files: List[Path], dp_size: int, hint: str) -> None:
    """ConfigError unless each of dp_size readers, taking every dp_size-th line as JsonlSource
    does (blank lines keep their place), finds a usable one."""
    missing, counter, first_bad, usable = set(range(dp_size)), MalformedCounter(log=False), None, 0
    index = -1
    for path in files:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                index += 1
                if not raw.strip():
                    continue
                try:
                    _decode_line(raw)
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
    bad = {reason: n for reason, n in counter.by_reason.items() if n}
    found = (f"its {counter.count} line(s) with text are all bad ({bad}), the first being "
             f"{first_bad}" if first_bad else "its lines are all blank")
    raise ConfigError(f"{what} has no usable line in its {len(files)} *.jsonl files: {found}. "
                      f"Fix the files (one {{\"text\": ...}} object a line) or point data.root "
                      f"at another corpus{hint}.")


def _validate_jsonl(args: DataArgs, root: Path) -> None:
    if args.sources:
        for name, weight in args.sources.items():
            if not (root / name).is_dir() or not any((root / name).glob("*.jsonl")):
                raise ConfigError(f"data.sources names {name!r}, but {root / name} holds no "
                                  f"*.jsonl file. Fix the name or the directory.")
            if weight <= 0:
                raise ConfigError(f"data.sources.{name}={weight} must be a positive weight.")
    elif not any(any(d.glob("*.jsonl")) for d in source_dirs(args).values()):
        raise ConfigError(f"data.root={root} holds no *.jsonl chunk file (nor sub-directories "
                          f"with some). Point data.root at the chunk files' directory.")
    if args.val_sequences and not any((root / VAL_DIR).glob("*.jsonl")):
        raise ConfigError(f"Validation needs held-out data: {root / VAL_DIR} holds no *.jsonl "
                          f"file. Put a few chunk files there, or set data.val_sequences=0.")


# ------------------------------------------------------------------------------------------------
# writing the memmap format, and the embedded debug corpus


def write_memmap_corpus(out: Path, splits: Dict[str, Iterator[str]], tokenizer: Tokenizer,
                        tokenizer_args: TokenizerArgs, source: str) -> dict:
    """Tokenize each split's documents (BOS + text + EOS) into `<split>.bin` +
    `<split>.docs.npy`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # meta.json is written last: until then a re-preparation stopped halfway reads as no corpus,
    # not as the old meta.json over new, partial files
    (out / "meta.json").unlink(missing_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 2 ** 16 else np.uint32
    meta = {"format_version": FORMAT_VERSION, "dtype": np.dtype(dtype).name, "source": source,
            "vocab_size": tokenizer.vocab_size,
            "tokenizer": {"kind": tokenizer_args.kind, "path": tokenizer_args.path}, "splits": {}}
    for split, texts in splits.items():
        starts, n_tokens = [], 0
        with open(out / f"{split}.bin", "wb") as f:
            for text in texts:
                ids = np.asarray(tokenizer.encode(text), dtype=dtype)
                starts.append(n_tokens)
                n_tokens += len(ids)
                f.write(ids.tobytes())
        np.save(out / f"{split}.docs.npy", np.asarray(starts, dtype=np.int64))
        meta["splits"][split] = {"tokens": n_tokens, "docs": len(starts)}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


SKIP_STDLIB_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "turtledemo",
                    "__pycache__", "lib2to3", "ensurepip"}


def stdlib_docstrings(min_chars: int = 200) -> List[str]:
    """Long docstrings of the Python standard library: English prose on every machine with
    Python."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_STDLIB_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= min_chars:
                        docs.append(doc)
    return docs


def build_embedded_corpus(out: Path, val_every: int = 50) -> dict:
    """The debug corpus: stdlib docstrings, bytes tokenizer, every val_every-th document held
    out."""
    docs = stdlib_docstrings()
    splits = {"train": (d for i, d in enumerate(docs) if i % val_every),
              "val": (d for i, d in enumerate(docs) if i % val_every == 0)}
    return write_memmap_corpus(out, splits, build_tokenizer(TokenizerArgs()), TokenizerArgs(),
                               source=f"python {sysconfig.get_python_version()} stdlib docstrings")


def ensure_embedded_corpus(root) -> Path:
    """Build the embedded corpus at `root` unless it is there; safe when processes race.

    It is written to a private temporary directory and renamed into place: a rename is atomic,
    so nobody ever reads half a corpus, and a loser of the race just drops its copy.
    """
    root = Path(root)
    if (root / "meta.json").is_file():
        return root
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    logger.info("preparing the embedded corpus in %s (first use; a few seconds)", root)
    try:
        meta = build_embedded_corpus(tmp)
    except BaseException:   # Ctrl-C or a failure while building: leave nothing half-made behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, root)
        logger.info("prepared the embedded corpus in %s (%d train tokens)", root,
                    meta["splits"]["train"]["tokens"])
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (root / "meta.json").is_file():
            raise ConfigError(f"Could not create the embedded corpus at {root}: the path exists "
                              f"but holds no prepared corpus. Remove it or choose another "
                              f"data.root.") from None
    return root
