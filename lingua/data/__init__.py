"""Training data in three formats. The loaders are single-process (no workers, no prefetch): a
step's batch is a function of the seed, data.seq_len, the global batch and the data-parallel
layout alone.

memmap (the default): all documents' tokens in one memory-mapped array plus document starts,
written by `setup/prepare_data.py` (memmap.py). Sample i of the endless stream is window
perm_e[i mod n] of seq_len+1 tokens, e = i // n the epoch and perm_e a permutation seeded by
(seed, e). Step k's global batch is samples [k*G, (k+1)*G), G = batch_size x dp_size x
grad_accum, and data-parallel rank r reads its contiguous slice: the same sequences for every
layout with the same G, the loader's whole state is the samples consumed, and a resume on
another layout has no repeat and no gap.

jsonl (streaming): `{"text": ...}` lines in `*.jsonl` chunk files, in source sub-directories
mixed by weight, tokenized and packed on the fly. Rank r takes lines r, r + dp, r + 2dp, ... of
a source's files concatenated in name order (jsonl.py), so every file is read whatever the number
of ranks; every rank scans every line, but tokenizes only its own.

chat (supervised fine-tuning): conversations rendered with a chat template (chat.py).

Unusable lines are skipped and counted by reason, and too many stop the run: jsonl.SkipCounter,
the rule of every format (setup/prepare_data.py applies it too). A document longer than seq_len
spans as many rows as it needs. A damaged memmap corpus is refused with a ConfigError naming the
file and the command that rebuilds it, before any process group or run directory exists.
"""

import dataclasses
import logging
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

from lingua.data.batch import VAL_DIR, Batch, check_position, stdlib_docstrings, write_once  # noqa: F401 (re-exported)
from lingua.data.chat import ChatArgs, ChatLoader, chat_val_batches, validate_chat_data
from lingua.data.jsonl import SKIP_REASONS, BadLine, JsonlSource, SkipCounter, decode_line
from lingua.data.memmap import TokenWindows, validate_memmap_corpus, write_memmap_corpus
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer, check_tokenizer_args
from lingua.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class DataArgs:
    root: str = "data/embedded"     # corpus directory (relative paths resolve against the cwd)
    format: str = "memmap"          # memmap (pre-tokenized, global-index) | jsonl (streaming)
                                    # | chat (conversations for fine-tuning: chat.py)
    seq_len: int = 256
    batch_size: int = 8             # per-rank micro-batch, in sequences
    grad_accum: int = 1
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    sources: Dict[str, float] = field(default_factory=dict)  # jsonl: sub-directory -> weight
    prepare_embedded: bool = False  # build the embedded debug corpus in `root` if it is missing
    val_sequences: int = 64         # size of the held-out validation set
    max_skipped_fraction: float = 0.1   # unusable lines (skipped, counted) above it: refused
    chat: ChatArgs = field(default_factory=ChatArgs)  # format=chat only


def _rows_to_batch(rows: np.ndarray, docs: np.ndarray) -> Batch:
    rows = torch.from_numpy(rows.astype(np.int64))
    docs = torch.from_numpy(docs.astype(np.int64))
    return Batch(tokens=rows[:, :-1], labels=rows[:, 1:], doc_ids=docs[:, :-1])


class MemmapLoader:
    def __init__(self, args: DataArgs, dp_rank: int, dp_size: int, seed: int):
        self.args, self.dp_rank, self.dp_size, self.seed = args, dp_rank, dp_size, seed
        self.windows = TokenWindows(args.root, "train", args.seq_len)
        # Bad lines were dropped when the corpus was prepared (meta.json counts them): none here.
        self.samples_consumed, self.skipped_lines = 0, 0
        self.skipped_by_reason = dict.fromkeys(SKIP_REASONS, 0)
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
        return [_rows_to_batch(*self.windows.rows(w)) for w in np.split(windows, a.grad_accum)]

    def state_dict(self) -> dict:
        return {"format": "memmap", "samples_consumed": self.samples_consumed,
                "seq_len": self.args.seq_len, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        check_position(state, {"format": "memmap", "seq_len": self.args.seq_len, "seed": self.seed},
                       "data.format, data.seq_len and seed")
        self.samples_consumed = state["samples_consumed"]


def source_dirs(args: DataArgs) -> Dict[str, Path]:
    """Source name -> directory, with their weights taken from args.sources (default: all, 1)."""
    root = Path(args.root)
    if args.sources:
        return {name: root / name for name in args.sources}
    subdirs = sorted(p for p in root.iterdir()
                     if p.is_dir() and p.name != VAL_DIR and any(p.glob("*.jsonl")))
    return {p.name: p for p in subdirs} if subdirs else {"": root}


class JsonlLoader:
    def __init__(self, args: DataArgs, dp_rank: int, dp_size: int, seed: int):
        self.args, self.dp_rank, self.dp_size = args, dp_rank, dp_size
        self.tokenizer = build_tokenizer(args.tokenizer)
        self.counter = SkipCounter(SKIP_REASONS, args.max_skipped_fraction)
        dirs = source_dirs(args)
        self.sources = [JsonlSource(n, d, dp_rank, dp_size, self.counter) for n, d in dirs.items()]
        weights = np.array([args.sources.get(n, 1.0) if args.sources else 1.0 for n in dirs])
        self.probs = weights / weights.sum()
        self.rng = np.random.default_rng([seed, dp_rank])
        # Tokens read but not yet emitted, and their document numbers: arrays, so that a long
        # document is taken a row at a time by slicing.
        self.buffer, self.buffer_docs, self.n_docs = np.zeros(0, np.int64), np.zeros(0, np.int64), 0

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
        rows, docs = self.buffer[:n].reshape(n_rows, -1), self.buffer_docs[:n].reshape(n_rows, -1)
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
                "skipped_lines": self.skipped_lines, "skipped_by_reason": self.skipped_by_reason}

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
        self.n_docs = state["n_docs"]
        self.counter.by_reason.update(state.get("skipped_by_reason", {}))
        self.counter.usable = self.n_docs   # documents read: the usable lines, near enough


FORMATS = ("memmap", "jsonl", "chat")


def build_train_loader(args: DataArgs, dp_rank: int, dp_size: int, seed: int):
    loader = {"memmap": MemmapLoader, "jsonl": JsonlLoader, "chat": ChatLoader}[args.format]
    return loader(args, dp_rank, dp_size, seed)


def build_val_batches(args: DataArgs, dp_rank: int, dp_size: int) -> List[Batch]:
    """This rank's share of the fixed validation set, the first val_sequences rows in order,
    rounded down to a multiple of dp_size (collectives need as many batches on every rank)."""
    if not args.val_sequences:
        return []
    if args.val_sequences < dp_size:   # every rank validates on as many: one each, at least
        if dp_rank == 0:
            logger.warning("data.val_sequences=%d is fewer than the %d data-parallel ranks, "
                           "which each validate on an equal share: validating on %d sequences "
                           "(one a rank)", args.val_sequences, dp_size, dp_size)
        args = dataclasses.replace(args, val_sequences=dp_size)
    batches = (chat_val_batches if args.format == "chat" else _val_batches)(args, dp_rank, dp_size)
    if not batches:   # the same on every rank: each gets as many sequences
        raise ConfigError(
            f"data.val_sequences={args.val_sequences}, but {Path(args.root) / VAL_DIR} holds "
            f"fewer validation sequences of data.seq_len={args.seq_len} tokens than the "
            f"{dp_size} data-parallel ranks, so there would be none to validate on. Add "
            f"validation data, shorten data.seq_len, or set data.val_sequences=0 (no validation).")
    return batches


def _val_batches(args: DataArgs, dp_rank: int, dp_size: int) -> List[Batch]:
    n = (args.val_sequences // dp_size) * dp_size
    if args.format == "memmap":
        windows = TokenWindows(args.root, "val", args.seq_len)
        n = min(n, (windows.n_windows // dp_size) * dp_size)
        rows, docs = windows.rows(np.arange(n))
    else:   # the first n packed rows of root/val, read in order by a single reader
        val_args = DataArgs(root=str(Path(args.root) / VAL_DIR), format="jsonl",
                            seq_len=args.seq_len, tokenizer=args.tokenizer)
        rows, docs = JsonlLoader(val_args, 0, 1, seed=0).next_rows(n)
    share = n // dp_size
    mine = slice(dp_rank * share, (dp_rank + 1) * share)
    rows, docs = rows[mine], docs[mine]
    return [_rows_to_batch(rows[i:i + args.batch_size], docs[i:i + args.batch_size])
            for i in range(0, share, args.batch_size)]


def validate_data_args(args: DataArgs, files: bool = True) -> None:
    """Cheap checks before any work: ConfigError naming the key or file and the fix. files=False
    checks the batch shape only, not the corpus and tokenizer files (lingua.launch.plan)."""
    if args.format not in FORMATS:
        raise ConfigError(f"data.format={args.format!r} is unknown: use memmap, jsonl or chat.")
    for key in ("seq_len", "batch_size", "grad_accum"):
        if getattr(args, key) < 1:
            raise ConfigError(f"data.{key}={getattr(args, key)} must be at least 1.")
    if args.val_sequences < 0:
        raise ConfigError(f"data.val_sequences={args.val_sequences} must be 0 or more.")
    if not 0 <= args.max_skipped_fraction <= 1:
        raise ConfigError(f"data.max_skipped_fraction={args.max_skipped_fraction} must be between "
                          f"0 (no unusable line allowed) and 1 (any number skipped).")
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
        validate_memmap_corpus(args, root)
    elif args.format == "chat":
        validate_chat_data(args)
    else:
        _validate_jsonl(args, root)


def check_jsonl_lines(args: DataArgs, dp_size: int) -> None:
    """Every data-parallel rank has a usable line in every jsonl source, and validation one in
    val/ (read until each has one), so that a corpus of bad lines is refused before any process
    starts or any file of the run is written."""
    if args.format != "jsonl":
        return
    readers = [(f"source {name} ({d})" if name else f"the corpus in {d}", d, dp_size, "")
               for name, d in source_dirs(args).items()]
    if args.val_sequences:   # one reader, in order (_val_batches)
        val = Path(args.root) / VAL_DIR
        readers.append((f"the validation data in {val}", val, 1,
                        ", or set data.val_sequences=0 to train without validation"))
    for what, directory, ranks, hint in readers:
        _check_lines(what, sorted(directory.glob("*.jsonl")), ranks, hint)


def _check_lines(what: str, files: List[Path], dp_size: int, hint: str) -> None:
    """ConfigError unless each of dp_size readers, taking every dp_size-th line as JsonlSource
    does (blank lines keep their place), finds a usable one."""
    missing, first_bad, usable = set(range(dp_size)), None, 0
    counter = SkipCounter(SKIP_REASONS, log=False)
    index = -1
    for path in files:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                index += 1
                if not raw.strip():
                    continue
                try:
                    decode_line(raw)
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


def build_embedded_corpus(out: Path, val_every: int = 50) -> dict:
    """The debug corpus: stdlib docstrings, bytes tokenizer, every val_every-th one held out."""
    docs = stdlib_docstrings()
    splits = {"train": (d for i, d in enumerate(docs) if i % val_every),
              "val": (d for i, d in enumerate(docs) if i % val_every == 0)}
    return write_memmap_corpus(out, splits, build_tokenizer(TokenizerArgs()), TokenizerArgs(),
                               source=f"python {sysconfig.get_python_version()} stdlib docstrings")


def ensure_embedded_corpus(root) -> Path:
    """Build the embedded corpus at `root` unless it is there; safe when processes race
    (batch.write_once)."""
    root = Path(root)
    if (root / "meta.json").is_file():
        return root
    logger.info("preparing the embedded corpus in %s (first use; a few seconds)", root)
    meta = write_once(root, "meta.json", build_embedded_corpus, "the embedded corpus (data.root)")
    if meta is not None:
        logger.info("prepared the embedded corpus in %s (%d train tokens)", root,
                    meta["splits"]["train"]["tokens"])
    return root
