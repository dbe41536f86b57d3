"""Training data, a format a Loader (loader.py) in a file of its own and a line in FORMATS. The
loaders are single-process (no workers, no prefetch): a step's batch is a function of the seed,
data.seq_len, the global batch and the data-parallel layout alone.

memmap (the default): all documents' tokens in one memory-mapped array plus document starts,
written by `setup/prepare_data.py` (memmap.py). Sample i of the endless stream is window
perm_e[i mod n] of seq_len+1 tokens, e = i // n the epoch and perm_e a permutation seeded by
(seed, e). Step k's global batch is samples [k*G, (k+1)*G), G = batch_size x dp_size x
grad_accum, and data-parallel rank r reads its contiguous slice: the same sequences for every
layout with the same G, the loader's whole state is the samples consumed, and a resume on
another layout has no repeat and no gap.

jsonl, parquet (streaming, jsonl.py, parquet.py): rows of text in source sub-directories mixed by
weight, tokenized and packed on the fly; rank r takes rows r, r + dp, r + 2dp, ... of a source.
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
from typing import Dict, List, Type

from lingua.data.batch import VAL_DIR, Batch, check_position, stdlib_docstrings, write_once  # noqa: F401 (re-exported)
from lingua.data.chat import ChatArgs, ChatLoader
from lingua.data.jsonl import JsonlLoader
from lingua.data.loader import Loader
from lingua.data.memmap import MemmapLoader, write_memmap_corpus
from lingua.data.parquet import ParquetLoader
from lingua.data.tokenizer import TokenizerArgs, build_tokenizer, check_tokenizer_args
from lingua.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class DataArgs:
    root: str = "data/embedded"     # corpus directory (relative paths resolve against the cwd)
    format: str = "memmap"          # a key of FORMATS: memmap (pre-tokenized, global-index) |
                                    # jsonl, parquet (streaming) | chat (conversations: chat.py)
    seq_len: int = 256
    batch_size: int = 8             # per-rank micro-batch, in sequences
    grad_accum: int = 1
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    sources: Dict[str, float] = field(default_factory=dict)  # jsonl, parquet: sub-dir -> weight
    prepare_embedded: bool = False  # build the embedded debug corpus in `root` if it is missing
    val_sequences: int = 64         # size of the held-out validation set
    max_skipped_fraction: float = 0.1   # unusable lines (skipped, counted) above it: refused
    chat: ChatArgs = field(default_factory=ChatArgs)  # format=chat only


# data.format -> its loader: a new format is a file beside these and one line here.
FORMATS: Dict[str, Type[Loader]] = {
    "memmap": MemmapLoader,     # memmap.py
    "jsonl": JsonlLoader,       # jsonl.py
    "parquet": ParquetLoader,   # parquet.py
    "chat": ChatLoader,         # chat.py
}


def build_train_loader(args: DataArgs, dp_rank: int, dp_size: int, seed: int) -> Loader:
    return FORMATS[args.format](args, dp_rank, dp_size, seed)


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
    batches = FORMATS[args.format].val_batches(args, dp_rank, dp_size)
    if not batches:   # the same on every rank: each gets as many sequences
        raise ConfigError(
            f"data.val_sequences={args.val_sequences}, but {Path(args.root) / VAL_DIR} holds "
            f"fewer validation sequences of data.seq_len={args.seq_len} tokens than the "
            f"{dp_size} data-parallel ranks, so there would be none to validate on. Add "
            f"validation data, shorten data.seq_len, or set data.val_sequences=0 (no validation).")
    return batches


def validate_data_args(args: DataArgs, files: bool = True) -> None:
    """Cheap checks before any work: ConfigError naming the key or file and the fix. files=False
    checks the batch shape only, not the corpus and tokenizer files (lingua.launch.plan)."""
    if args.format not in FORMATS:
        raise ConfigError(f"data.format={args.format!r} is unknown: use one of "
                          f"{', '.join(FORMATS)}.")
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
    root, loader = Path(args.root), loader_class(args)
    embedded = loader.builds_embedded and args.tokenizer.kind == "bytes"
    if not root.is_dir():
        if args.prepare_embedded and embedded:
            return  # built on first use
        # A preset builds its embedded corpus only at its own data.root (lingua.config
        # PRESET_SCOPED): a missing directory the user named is not created behind her back.
        build = (", or add data.prepare_embedded=true to build it there on first use"
                 if embedded else "")
        raise ConfigError(f"data.root={args.root} does not exist. Prepare a corpus there (`python "
                          f"setup/prepare_data.py embedded --out {args.root}` for the built-in "
                          f"one{build}), or point data.root at an existing corpus directory.")
    loader.validate(args, root)


def loader_class(args: DataArgs) -> Type[Loader]:
    """The format's Loader; for an unknown one (validate_data_args reports it), the contract's."""
    return FORMATS.get(args.format, Loader)


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
