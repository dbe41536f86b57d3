"""Chat data for supervised fine-tuning (`data.format=chat`): jsonl conversations rendered with a
chat template (chat_template.py), trained on the tokens the assistant writes only.

A line of `data.root/*.jsonl` (`val/*.jsonl`: validation) is {"messages": [{"role": "system" |
"user" | "assistant", "content": "..."}, ...]} or {"prompt": "...", "completion": "..."}, with at
least one assistant turn and no empty one; other lines follow jsonl.SkipCounter's rule.

Targets: the assistant's content and the token closing its turn, all else IGNORE_INDEX. A
conversation's first token is never a target, so no label crosses between conversations.

Every rank tokenizes all conversations at start (cached in data.root/.chat_cache); one over
seq_len+1 tokens is truncated or skipped (data.chat.too_long). Epoch e orders them by a
permutation seeded by (seed, e); pack=true fills rows greedily in that order, pack=false puts one
a row, and EOS pads the rest (uncounted, a doc_id of its own). As for memmap, step k's global batch
is rows [k*G, (k+1)*G). Rank 0 alone reports skipped lines (the trainer sums over ranks).
"""

import hashlib
import io
import json
import logging
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from lingua.data.batch import VAL_DIR, Batch, check_position, stdlib_docstrings, write_once
from lingua.data.chat_template import BUILTIN, ChatTemplate  # noqa: F401  (BUILTIN: callers)
from lingua.data.jsonl import BadLine, SkipCounter, check_utf8, load_json
from lingua.data.loader import Loader
from lingua.data.tokenizer import Tokenizer, build_tokenizer
from lingua.errors import ConfigError
from lingua.model.loss import IGNORE_INDEX

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
TOO_LONG = ("truncate", "skip")
# The keys of a ChatLoader's skipped_by_reason.
CHAT_SKIP_REASONS = ("invalid_utf8", "invalid_json", "not_chat", "bad_role", "no_assistant",
                     "template_error", "too_long")


@dataclass
class ChatArgs:
    pack: bool = True           # several conversations a row (doc_ids apart) | one a row, padded
    too_long: str = "truncate"  # a conversation over seq_len+1 tokens: truncate | skip
    template: Optional[str] = None  # tokenizer_config.json or .jinja; None: chat_template.py
    cache: bool = True          # tokenize once into data.root/.chat_cache, read it at later starts


def parse_sample(obj) -> List[dict]:
    """The messages ({"role", "content"}) of one decoded jsonl line; BadLine if it is none."""
    if not isinstance(obj, dict):
        raise BadLine("not_chat", f"a JSON {type(obj).__name__}, not an object with \"messages\""
                                  f" or \"prompt\" and \"completion\"")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadLine("not_chat", '"messages" is not a non-empty list')
        out = [_message(m, i) for i, m in enumerate(messages)]
    elif "prompt" in obj or "completion" in obj:
        prompt, completion = obj.get("prompt"), obj.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise BadLine("not_chat", '"prompt" and "completion" are not both strings')
        out = [_message({"role": "user", "content": prompt}, 0),
               _message({"role": "assistant", "content": completion}, 1)]
    else:
        raise BadLine("not_chat", 'neither "messages" nor "prompt" and "completion"')
    answers = [m for m in out if m["role"] == "assistant"]
    if not answers:
        raise BadLine("no_assistant", "no assistant turn, so nothing to train on")
    if not all(m["content"] for m in answers):
        raise BadLine("no_assistant", "an assistant turn with empty content")
    return out


def _message(m, i: int) -> dict:
    if isinstance(m, dict) and "content" not in m and "text" in m:   # another format's key
        raise BadLine("not_chat", f'message {i} has "text" where "content" is expected')
    if not isinstance(m, dict) or not isinstance(m.get("content"), str):
        raise BadLine("not_chat", f"message {i} is not an object with a string \"content\"")
    if m.get("role") not in ROLES:
        raise BadLine("bad_role", f"message {i} has role {m.get('role')!r}, not one of "
                                  f"{', '.join(ROLES)}")
    check_utf8(m["content"], f"message {i}")
    return {"role": m["role"], "content": m["content"]}


def read_conversations(files: List[Path], on_bad: Callable[[Path, int, BadLine], None]
                       ) -> Iterator[Tuple[Path, int, list]]:
    """(file, line number, messages) of each usable line; on_bad(file, line, err) for the rest."""
    for path in files:
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    messages = parse_sample(load_json(raw))
                except BadLine as err:
                    on_bad(path, line_no, err)
                    continue
                yield path, line_no, messages


def chat_counter(args, log: bool, what: str = "") -> SkipCounter:
    return SkipCounter(CHAT_SKIP_REASONS, args.max_skipped_fraction, log, what)


def train_files(args) -> List[Path]:
    return sorted(Path(args.root).glob("*.jsonl"))


def val_files(args) -> List[Path]:
    return sorted((Path(args.root) / VAL_DIR).glob("*.jsonl"))


@dataclass
class Conversations:
    ids: List[np.ndarray]       # each conversation's tokens (int64), at most seq_len+1
    counted: List[np.ndarray]   # bool: a target (the first token never is)
    lengths: np.ndarray         # tokens of each
    targets: np.ndarray         # counted tokens of each: the labels it gives in a row
    truncated: int = 0          # conversations cut to seq_len+1 tokens

    def __len__(self) -> int:
        return len(self.ids)


def tokenize_conversations(files: List[Path], args, template: ChatTemplate,
                           tokenizer: Tokenizer, counter: SkipCounter) -> Conversations:
    row_len, ids_list, counted_list, truncated = args.seq_len + 1, [], [], 0
    for path, line_no, messages in read_conversations(files, counter.skip):
        try:
            ids, counted = template.encode(messages, tokenizer)
        except BadLine as err:
            counter.skip(path, line_no, err)
            continue
        if ids:
            counted[0] = False   # nothing before it in its conversation: no label crosses into it
        if len(ids) > row_len:
            if args.chat.too_long == "skip" or not any(counted[:row_len]):
                counter.skip(path, line_no, BadLine(
                    "too_long", f"{len(ids)} tokens, more than data.seq_len+1={row_len}" +
                    ("" if args.chat.too_long == "skip" else ", and none of the first are the "
                     "assistant's")))
                continue
            ids, counted, truncated = ids[:row_len], counted[:row_len], truncated + 1
        ids_list.append(np.asarray(ids, dtype=np.int64))
        counted_list.append(np.asarray(counted, dtype=bool))
        counter.used()
    return Conversations(ids_list, counted_list,
                         np.array([len(i) for i in ids_list], dtype=np.int64),
                         np.array([c.sum() for c in counted_list], dtype=np.int64), truncated)


def pack_rows(order: np.ndarray, lengths: np.ndarray, row_len: int, pack: bool) -> List[list]:
    """Rows as lists of conversation indices: greedily in `order` (packed), or one a row."""
    if not pack:
        return [[int(i)] for i in order]
    rows, row, space = [], [], row_len
    for i in order:
        if lengths[i] > space and row:
            rows.append(row)
            row, space = [], row_len
        row.append(int(i))
        space -= lengths[i]
    return rows + ([row] if row else [])


def rows_to_batch(rows: List[list], convs: Conversations, row_len: int, pad_id: int,
                  step_targets: Optional[int] = None) -> Batch:
    tokens = np.full((len(rows), row_len), pad_id, dtype=np.int64)
    counted = np.zeros((len(rows), row_len), dtype=bool)
    docs = np.zeros((len(rows), row_len), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for doc, i in enumerate(row):
            end = at + convs.lengths[i]
            tokens[r, at:end], counted[r, at:end], docs[r, at:end] = \
                convs.ids[i], convs.counted[i], doc
            at = end
        docs[r, at:] = len(row)   # padding: a document of its own
    labels = np.where(counted[:, 1:], tokens[:, 1:], IGNORE_INDEX)
    return Batch(tokens=torch.from_numpy(tokens[:, :-1]), labels=torch.from_numpy(labels),
                 doc_ids=torch.from_numpy(docs[:, :-1]), step_targets=step_targets)


def _load(args, files: List[Path], counter: SkipCounter, what: str):
    tokenizer = build_tokenizer(args.tokenizer)
    template = ChatTemplate.from_args(args)
    if args.chat.cache:
        convs = cached_conversations(files, args, template, tokenizer, counter)
    else:
        convs = tokenize_conversations(files, args, template, tokenizer, counter)
    if not len(convs):
        raise ConfigError(f"The {what} data in {args.root} has no usable conversation "
                          f"({counter.count} line(s) skipped: {counter.nonzero}). "
                          f"Fix the lines, or raise data.seq_len if they are too long.")
    return tokenizer, convs


CACHE_DIR, CACHE_VERSION = ".chat_cache", 2   # 2: meta.json holds the arrays' CRC-32
CACHE_ARRAYS = ("ids", "counted", "lengths", "targets")


def cache_key(files: List[Path], args, template: ChatTemplate) -> str:
    """What the tokenized conversations depend on (files' CRC-32, tokenizer, template, ...)."""
    def stat(path) -> list:
        crc = 0
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                crc = zlib.crc32(chunk, crc)
        return [str(Path(path).resolve()), crc]

    tok = args.tokenizer
    parts = {"version": CACHE_VERSION, "files": [stat(p) for p in files],
             "tokenizer": [tok.kind, stat(tok.path) if tok.path else None],
             "template": [template.source, template.jinja_text, template.special],
             "seq_len": args.seq_len, "too_long": args.chat.too_long}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def cached_conversations(files: List[Path], args, template: ChatTemplate, tokenizer: Tokenizer,
                         counter: SkipCounter) -> Conversations:
    """The conversations of `files`, tokenized once by rank 0 into data.root/.chat_cache/<key>/
    for later starts and the other ranks, which read it once rank 0 has checked (or rebuilt) it;
    a read-only data.root tokenizes at every start."""
    import torch.distributed as dist

    cache = Path(args.root) / CACHE_DIR / cache_key(files, args, template)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    if ranks == 1 or dist.get_rank() == 0:
        convs = _read_cache(cache, counter, warn=True)
        if convs is None:
            convs = tokenize_conversations(files, args, template, tokenizer, counter)
            try:
                if cache.exists():   # damaged: moved aside first, so that no one reads half of it
                    aside = cache.parent / f".{cache.name}.damaged-{os.getpid()}"
                    os.rename(cache, aside)
                    shutil.rmtree(aside)
                write_once(cache, "meta.json", lambda tmp: _write_cache(tmp, convs, counter),
                           "the chat data's tokenized cache")
            except (OSError, ConfigError) as err:
                logger.warning("chat data: could not cache the tokenized conversations in %s "
                               "(%s); every start tokenizes them again", cache, err)
        if ranks > 1:
            dist.barrier()
        return convs
    dist.barrier()   # rank 0 checks, rebuilds or writes it
    # Not on this node's filesystem (or damaged since): tokenize, leave the file to rank 0.
    convs = _read_cache(cache, counter, warn=False)
    return convs or tokenize_conversations(files, args, template, tokenizer, counter)


def _write_cache(tmp: Path, convs: Conversations, counter: SkipCounter) -> None:
    tmp.mkdir(parents=True)
    ids = np.concatenate(convs.ids) if len(convs) else np.zeros(0, np.int64)
    arrays = {"ids": ids.astype(np.int32) if ids.size and ids.max() < 2**31 else ids,
              "counted": np.concatenate(convs.counted) if len(convs) else np.zeros(0, bool),
              "lengths": convs.lengths, "targets": convs.targets}
    crc = {}
    for name in CACHE_ARRAYS:
        buffer = io.BytesIO()
        np.save(buffer, arrays[name])
        (tmp / f"{name}.npy").write_bytes(buffer.getvalue())
        crc[name] = zlib.crc32(buffer.getvalue())
    first = None if counter.first is None else [str(counter.first[0]), *counter.first[1:]]
    (tmp / "meta.json").write_text(json.dumps({
        "truncated": convs.truncated, "skipped_by_reason": counter.by_reason,
        "usable": counter.usable, "first_skipped": first, "crc32": crc}))


def _read_cache(cache: Path, counter: SkipCounter, warn: bool) -> Optional[Conversations]:
    """The cache's conversations; None when there is none, or (a warning naming the file) when
    it does not read back as written: truncated, overwritten, a byte flipped."""
    if not cache.exists():
        return None
    arrays, path = {}, cache / "meta.json"
    try:
        meta = json.loads(path.read_text())
        for name in CACHE_ARRAYS:
            path = cache / f"{name}.npy"
            raw = path.read_bytes()
            if zlib.crc32(raw) != meta["crc32"][name]:
                raise ValueError("its checksum does not match the one written with it")
            arrays[name] = np.load(io.BytesIO(raw))
    except (OSError, ValueError, KeyError, TypeError) as err:
        if warn:
            logger.warning("chat data: the tokenized cache file %s is damaged (%s); tokenizing "
                           "the conversations again and rebuilding the cache", path, err)
        return None
    lengths = arrays["lengths"]
    bounds = np.cumsum(lengths)[:-1]
    ids = np.split(arrays["ids"], bounds) if len(lengths) else []
    counted = np.split(arrays["counted"], bounds) if len(lengths) else []
    counter.restore(meta["skipped_by_reason"], meta["usable"], meta["first_skipped"])
    return Conversations(ids, counted, lengths, arrays["targets"], meta["truncated"])


class ChatLoader(Loader):
    def __init__(self, args, dp_rank: int, dp_size: int, seed: int):
        self.args, self.dp_rank, self.dp_size, self.seed = args, dp_rank, dp_size, seed
        self.row_len = args.seq_len + 1
        self.counter = chat_counter(args, log=dp_rank == 0)
        self.tokenizer, self.convs = _load(args, train_files(args), self.counter, "training")
        self.truncated_samples = self.convs.truncated
        self.rows_consumed = 0
        self._epoch_sizes: List[int] = []   # rows in epochs 0, 1, ... as far as the stream went
        self._epochs: Dict[int, List[list]] = {}   # the rows of the last epochs used
        rows = len(self._rows_of_epoch(0))
        global_batch = args.batch_size * dp_size * args.grad_accum
        if dp_rank == 0:
            tok = args.tokenizer
            logger.info("chat data: %d conversations (%d cut to a row of data.seq_len+1 = %d "
                        "tokens: %d inputs and the last one's target; %d lines skipped: %s), %d "
                        "rows in the first epoch; the %s tokenizer%s (%d tokens), template: %s",
                        len(self.convs), self.truncated_samples, self.row_len, args.seq_len,
                        self.counter.count, self.counter.nonzero, rows, tok.kind,
                        f" {tok.path}" if tok.path else "", self.tokenizer.vocab_size,
                        ChatTemplate.from_args(args).source)
            if rows < global_batch:
                logger.warning("chat data: %d rows an epoch, fewer than the global batch of %d "
                               "(data.batch_size x data-parallel ranks x data.grad_accum): every "
                               "step repeats rows. Add conversations, or lower data.batch_size.",
                               rows, global_batch)

    def skipped(self) -> Dict[str, int]:   # every rank reads every line: rank 0 reports them
        return {k: (n if self.dp_rank == 0 else 0) for k, n in self.counter.by_reason.items()}

    def _rows_of_epoch(self, epoch: int) -> List[list]:
        if epoch not in self._epochs:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.convs))
            if len(self._epochs) > 1:   # a step spans two epochs at most
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = pack_rows(order, self.convs.lengths, self.row_len,
                                            self.args.chat.pack)
        return self._epochs[epoch]

    def row(self, k: int) -> list:
        """Row k of the endless row stream, as conversation indices."""
        epoch, start = 0, 0
        while True:
            if epoch == len(self._epoch_sizes):
                self._epoch_sizes.append(len(self._rows_of_epoch(epoch)))
            if k < start + self._epoch_sizes[epoch]:
                return self._rows_of_epoch(epoch)[k - start]
            start, epoch = start + self._epoch_sizes[epoch], epoch + 1

    def next_step(self) -> List[Batch]:
        a = self.args
        per_rank = a.batch_size * a.grad_accum
        rows = [self.row(self.rows_consumed + k) for k in range(per_rank * self.dp_size)]
        self.rows_consumed += len(rows)
        # Every rank knows the whole global batch's rows, so no collective is needed.
        step_targets = int(sum(self.convs.targets[i] for row in rows for i in row))
        mine = rows[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return [rows_to_batch(mine[m * a.batch_size:(m + 1) * a.batch_size], self.convs,
                              self.row_len, self.tokenizer.eos_id, step_targets)
                for m in range(a.grad_accum)]

    def state_dict(self) -> dict:
        c = self.args.chat
        return {"format": "chat", "rows_consumed": self.rows_consumed,
                "seq_len": self.args.seq_len, "seed": self.seed, "pack": c.pack,
                "too_long": c.too_long, "conversations": len(self.convs)}

    def load_state_dict(self, state: dict) -> None:
        mine, keys = self.state_dict(), ("format", "seq_len", "seed", "pack", "too_long")
        check_position(state, {k: mine[k] for k in keys},
                       "data.format, data.seq_len, seed, data.chat.pack and data.chat.too_long")
        if state.get("conversations") != len(self.convs) and self.dp_rank == 0:
            logger.warning("the checkpoint's data position was saved over %s conversations, "
                           "this run reads %d: the files changed, so the rows resumed from are "
                           "not those the run would have seen", state.get("conversations"),
                           len(self.convs))
        self.rows_consumed = state["rows_consumed"]

    @classmethod
    def validate(cls, args, root: Path) -> None:
        validate_chat_data(args)

    @classmethod
    def check_model(cls, args, model_args) -> None:
        if args.chat.pack and model_args.attn_mask != "block_causal":
            raise ConfigError(
                "data.chat.pack=true puts several conversations in one row, and "
                f"model.attn_mask={model_args.attn_mask} would let each attend to the ones before "
                "it. Set model.attn_mask=block_causal, or data.chat.pack=false (one padded "
                "conversation a row).")

    @classmethod
    def val_batches(cls, args, dp_rank: int, dp_size: int) -> List[Batch]:
        """This rank's share of the first val_sequences rows of root/val, in file order."""
        n = (args.val_sequences // dp_size) * dp_size
        counter = chat_counter(args, dp_rank == 0, " of the validation data")
        tokenizer, convs = _load(args, val_files(args), counter, "validation")
        rows = pack_rows(np.arange(len(convs)), convs.lengths, args.seq_len + 1, args.chat.pack)
        share = min(n, (len(rows) // dp_size) * dp_size) // dp_size
        mine = rows[dp_rank * share:(dp_rank + 1) * share]
        return [rows_to_batch(mine[i:i + args.batch_size], convs, args.seq_len + 1,
                              tokenizer.eos_id) for i in range(0, share, args.batch_size)]


LINE_FORMAT = ('one conversation a line: {"messages": [{"role": "system"|"user"|"assistant", '
               '"content": "..."}, ...]} with at least one non-empty assistant turn, or '
               '{"prompt": "...", "completion": "..."}')


def validate_chat_data(args) -> None:
    """Cheap checks of a chat corpus (every line parsed, one conversation rendered)."""
    if args.chat.too_long not in TOO_LONG:
        raise ConfigError(f"data.chat.too_long={args.chat.too_long!r} is unknown: use truncate "
                          f"(cut a conversation to data.seq_len+1 tokens) or skip.")
    root = Path(args.root)
    train = train_files(args)
    if not train:
        raise ConfigError(f"data.root={root} holds no *.jsonl file of conversations "
                          f"(data.format=chat reads {LINE_FORMAT}). Point data.root at their "
                          f"directory.")
    val = val_files(args) if args.val_sequences else []
    if args.val_sequences and not val:
        raise ConfigError(f"Validation needs held-out conversations: {root / VAL_DIR} holds no "
                          f"*.jsonl file. Put some there, or set data.val_sequences=0.")
    template = ChatTemplate.from_args(args)
    first = _check_lines(args, train, root, template)
    if val:
        _check_lines(args, val, root / VAL_DIR, template)
    _check_template(args, template, *first)


def _check_lines(args, files: List[Path], where: Path,
                 template: ChatTemplate) -> Tuple[Path, int, list]:
    """The first usable conversation; ConfigError when none or too many lines are unusable."""
    counter, first = chat_counter(args, log=False, what=f" of {where}"), None
    cached = args.chat.cache and (Path(args.root) / CACHE_DIR / cache_key(files, args, template)
                                  / "meta.json").is_file()
    for found in read_conversations(files, counter.skip):
        counter.used()
        first = first or found
        if cached:
            break
    if first is None:
        raise ConfigError(f"{where} has no usable conversation in its {len(files)} *.jsonl "
                          f"files ({counter.count} lines skipped: {counter.nonzero}"
                          f"; the first, line {counter.first[1]} of {counter.first[0]}: "
                          f"{counter.first[2]}). Fix them: {LINE_FORMAT}."
                          if counter.first else
                          f"{where} has no conversation: its {len(files)} *.jsonl files are "
                          f"blank. Add conversations: {LINE_FORMAT}.")
    return first


def _check_template(args, template: ChatTemplate, path: Path, line_no: int, messages) -> None:
    try:
        _, counted = template.encode(messages, build_tokenizer(args.tokenizer))
    except BadLine as err:
        raise ConfigError(f"Line {line_no} of {path}: {err}. Fix the template (data.chat."
                          f"template) or the line.") from None
    if not any(counted[1:]):
        raise ConfigError(f"The chat template {template.source} renders no assistant tokens for "
                          f"line {line_no} of {path}, so nothing would be trained on. Use a "
                          f"template that writes each assistant message's content, or unset "
                          f"data.chat.template for the built-in one.")


def write_debug_chat(out_dir, n_train: int = 2000, n_val: int = 100) -> Path:
    """A small chat corpus from stdlib docstrings (user: a word's start, assistant: its end)."""
    def write(tmp: Path) -> None:
        (tmp / VAL_DIR).mkdir(parents=True)
        docs = stdlib_docstrings()
        lines = [json.dumps(_debug_conversation(i, docs[i % len(docs)], i // len(docs)))
                 for i in range(n_train + n_val)]
        (tmp / VAL_DIR / "val.jsonl").write_text("\n".join(lines[:n_val]) + "\n")
        (tmp / "train.jsonl").write_text("\n".join(lines[n_val:]) + "\n")

    write_once(out_dir, "train.jsonl", write, "the debug chat corpus (data.root)")
    return Path(out_dir)


def _debug_conversation(i: int, doc: str, pass_no: int) -> dict:
    # Finish a word of the docstrings: a base that learned their words knows the rest, and LoRA
    # has to teach the chat format, the answer in the assistant's turn and its end (EOS).
    words = re.findall(r"[A-Za-z]{6,}", doc) or ["function"]
    word = words[(i + pass_no) % len(words)]
    start, rest = word[:max(3, len(word) // 2)], word[max(3, len(word) // 2):]
    if i % 3 == 0:
        return {"prompt": f"Finish the word: {start}", "completion": rest}
    messages = [{"role": "user", "content": f"Finish the word: {start}"},
                {"role": "assistant", "content": rest}]
    if i % 3 == 2:
        messages.insert(0, {"role": "system", "content": "You finish words."})
    return {"messages": messages}
