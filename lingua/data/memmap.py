"""The memmap corpus (`data.format=memmap`): meta.json and its files, their checks (a damaged
corpus is refused naming the file and the fix), the token windows, the loader, and the writer."""

import json
import logging
import shlex
from pathlib import Path
from typing import Dict, Iterator, List

import numpy as np

from lingua.data.batch import Batch, check_position, packed_batch, val_share
from lingua.data.jsonl import SKIP_REASONS, SkipCounter
from lingua.data.loader import Loader
from lingua.data.tokenizer import Tokenizer, TokenizerArgs, build_tokenizer
from lingua.errors import ConfigError

logger = logging.getLogger("lingua.data")

FORMAT_VERSION = 1


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
    """A split's windows of seq_len+1 tokens; files checked against meta.json when validated."""

    def __init__(self, root, split: str, seq_len: int):
        root = Path(root)
        self.meta = meta = read_meta(root)
        try:
            info = meta["splits"][split]
            n_tokens, n_docs = int(info["tokens"]), int(info["docs"])
            dtype = np.dtype(meta["dtype"])
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"{root / 'meta.json'} has no usable entry for the {split} split "
                              f"({type(err).__name__}: {err}): it was not written by "
                              f"setup/prepare_data.py, or it is damaged. {rebuild_hint(root, meta)}"
                              ) from None
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


def validate_memmap_corpus(args, root: Path) -> None:
    """The corpus at `root` against `args`: version, tokenizer, vocabulary, every split's files."""
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


class MemmapLoader(Loader):
    builds_embedded, validate = True, staticmethod(validate_memmap_corpus)

    def __init__(self, args, dp_rank: int, dp_size: int, seed: int):
        self.args, self.dp_rank, self.dp_size, self.seed = args, dp_rank, dp_size, seed
        self.windows = TokenWindows(args.root, "train", args.seq_len)
        # Bad lines were dropped when the corpus was prepared (meta.json counts them): none here.
        self.samples_consumed, self.counter = 0, SkipCounter(SKIP_REASONS)
        if dp_rank == 0:
            meta, tok = self.windows.meta, self.windows.meta.get("tokenizer") or {}
            logger.info("memmap data: %s, tokenized by the %s tokenizer%s (%s tokens)", args.root,
                        tok.get("kind"), f" {tok['path']}" if tok.get("path") else "",
                        meta.get("vocab_size"))
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
        return [packed_batch(*self.windows.rows(w)) for w in np.split(windows, a.grad_accum)]

    def state_dict(self) -> dict:
        return {"format": "memmap", "samples_consumed": self.samples_consumed,
                "seq_len": self.args.seq_len, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        check_position(state, {"format": "memmap", "seq_len": self.args.seq_len, "seed": self.seed},
                       "data.format, data.seq_len and seed")
        self.samples_consumed = state["samples_consumed"]

    @classmethod
    def val_batches(cls, args, dp_rank: int, dp_size: int) -> List[Batch]:
        windows = TokenWindows(args.root, "val", args.seq_len)
        n = min(args.val_sequences // dp_size, windows.n_windows // dp_size) * dp_size
        return val_share(*windows.rows(np.arange(n)), dp_rank, dp_size, args.batch_size)


def write_memmap_corpus(out: Path, splits: Dict[str, Iterator[str]], tokenizer: Tokenizer,
                        tokenizer_args: TokenizerArgs, source: str) -> dict:
    """Tokenize each split's documents (BOS + text + EOS) into `<split>.bin`, `<split>.docs.npy`."""
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
