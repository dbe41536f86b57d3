"""Tokenizers behind one small interface: bytes (no file), tiktoken, sentencepiece, HF tokenizers,
each loaded from a local file (nothing is fetched from a hub)."""

import base64
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from lingua.errors import ConfigError

logger = logging.getLogger(__name__)

KINDS = ("bytes", "tiktoken", "sentencepiece", "hf")
EXPECTED_FILE = {"tiktoken": "tokenizer.model (tiktoken BPE ranks)",
                 "sentencepiece": "tokenizer.model", "hf": "tokenizer.json"}

# Llama 3's pre-tokenizer split pattern (contractions, words, 1-3 digit numbers, punctuation runs).
TIKTOKEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass
class TokenizerArgs:
    kind: str = "bytes"             # bytes | tiktoken | sentencepiece | hf
    path: Optional[str] = None      # tiktoken BPE ranks, sentencepiece .model, or HF tokenizer.json


class Tokenizer:
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> List[int]:
        ids = self._encode(text)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def _encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def decode(self, ids: List[int]) -> str:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are ids 0..255; BOS=256, EOS=257."""

    vocab_size, bos_id, eos_id = 258, 256, 257

    def _encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TikTokenizer(Tokenizer):
    def __init__(self, path: str):
        import tiktoken

        ranks = read_bpe_ranks(path)
        n = len(ranks)
        # Special tokens go right after the merges, as in Llama 3's tokenizer.
        self.bos_id, self.eos_id, self.vocab_size = n, n + 1, n + 2
        self.model = tiktoken.Encoding(
            name=Path(path).name, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
            special_tokens={"<|begin_of_text|>": n, "<|end_of_text|>": n + 1})

    def _encode(self, text):
        return self.model.encode(text, disallowed_special=())

    def decode(self, ids):
        return self.model.decode([i for i in ids if i < self.bos_id])


def read_bpe_ranks(path: str) -> dict:
    """token bytes -> rank from a tiktoken ranks file (lines of `base64(token) rank`), read from
    the file each time: tiktoken's load_tiktoken_bpe caches every file by its path (under
    $TMPDIR/data-gym-cache), so a file replaced in place would load as its old contents."""
    ranks, why = {}, "it holds no line"
    try:
        for line in Path(path).read_bytes().splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except ValueError as err:   # a file of another kind, or damaged (binascii.Error too)
        ranks, why = {}, f"{str(err) or type(err).__name__} in line {line[:40]!r}"
    if not ranks:
        raise ConfigError(f"The tokenizer file {path} is empty or not tiktoken BPE ranks ({why}). "
                          f"Point data.tokenizer.path at a tiktoken ranks file (lines of "
                          f"`base64(token) rank`, as Llama 3's tokenizer.model), or set "
                          f"data.tokenizer.kind to the file's kind.")
    return ranks


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str):
        import sentencepiece

        self.model = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self.model.vocab_size()
        self.bos_id, self.eos_id = self.model.bos_id(), self.model.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise ConfigError(f"The sentencepiece model {path} has no BOS or EOS piece (bos_id="
                              f"{self.bos_id}, eos_id={self.eos_id}). Train it with bos_id and "
                              f"eos_id set, or use another tokenizer.")

    def _encode(self, text):
        return self.model.encode(text)

    def decode(self, ids):
        return self.model.decode(list(ids))


class HFTokenizer(Tokenizer):
    BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|endoftext|>")
    EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTok

        self.model = HFTok.from_file(path)
        self.vocab_size = self.model.get_vocab_size(with_added_tokens=True)
        # tokenizer.json does not say which token is BOS/EOS; the tokenizer_config.json saved
        # beside it by transformers does, so it wins over the usual names.
        config = _hf_special_tokens(Path(path).with_name("tokenizer_config.json"))
        self.bos_id = self._find(config["bos_token"] + self.BOS_NAMES, path, "BOS")
        self.eos_id = self._find(config["eos_token"] + self.EOS_NAMES, path, "EOS")

    def _find(self, names, path, what) -> int:
        for name in names:
            token_id = self.model.token_to_id(name)
            if token_id is not None:
                return token_id
        raise ConfigError(f"The tokenizer file {path} has none of the usual {what} tokens "
                          f"({', '.join(names)}). Add one to the tokenizer, or use another one.")

    def _encode(self, text):
        return self.model.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.model.decode(list(ids), skip_special_tokens=True)


def special_tokens(config: dict) -> Dict[str, str]:
    """bos_token, eos_token, ... of a tokenizer_config.json as texts (also from AddedToken form)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    return out


def _hf_special_tokens(config_path: Path) -> dict:
    """bos_token / eos_token of a transformers tokenizer_config.json, as 0- or 1-tuples."""
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError:
            logger.warning("ignoring %s: not valid JSON", config_path)
    found = special_tokens(config) if isinstance(config, dict) else {}
    return {key: (found[key],) if key in found else () for key in ("bos_token", "eos_token")}


def _kind_of(path: str) -> str:
    """The kind that reads `path`, as far as its first bytes tell: a tokenizer.json is a JSON
    object; tiktoken's ranks (base64 lines) and sentencepiece's protobuf are not."""
    try:
        with open(path, "rb") as f:
            is_json = f.read(64).lstrip().startswith(b"{")
    except OSError:
        return "the file's kind (hf, tiktoken or sentencepiece)"
    return "hf" if is_json else "tiktoken or sentencepiece"


def check_tokenizer_args(args: TokenizerArgs) -> None:
    """Cheap checks (no file is parsed): the kind is known, its file exists and is of the kind."""
    if args.kind not in KINDS:
        raise ConfigError(f"data.tokenizer.kind={args.kind!r} is unknown: use one of "
                          f"{', '.join(KINDS)}.")
    if args.kind == "bytes":
        if args.path:   # the file would be ignored and the data read as bytes
            raise ConfigError(f"data.tokenizer.path={args.path} is set, but data.tokenizer."
                              f"kind=bytes reads no file. Set data.tokenizer.kind="
                              f"{_kind_of(args.path)} to tokenize with that file, or "
                              f"data.tokenizer.path=null for bytes.")
        return
    if not args.path:
        raise ConfigError(f"data.tokenizer.kind={args.kind} needs a file: set "
                          f"data.tokenizer.path=/path/to/{EXPECTED_FILE[args.kind]}.")
    if not Path(args.path).is_file():
        raise ConfigError(f"Tokenizer file data.tokenizer.path={args.path} does not exist (kind "
                          f"{args.kind}). Point data.tokenizer.path at the local "
                          f"{EXPECTED_FILE[args.kind]}, or use data.tokenizer.kind=bytes.")
    kind = _kind_of(args.path)
    if (kind == "hf") != (args.kind == "hf"):
        is_json = "JSON" if kind == "hf" else "not JSON"
        raise ConfigError(f"data.tokenizer.kind={args.kind} reads a {EXPECTED_FILE[args.kind]}, "
                          f"but data.tokenizer.path={args.path} is {is_json} (a Hugging Face "
                          f"tokenizer.json is). Set data.tokenizer.kind="
                          f"{kind}, or point data.tokenizer.path at a "
                          f"{EXPECTED_FILE[args.kind]}.")


def build_tokenizer(args: TokenizerArgs) -> Tokenizer:
    if args.kind == "bytes":   # before the check: a run saved with a stray path still reads back
        return ByteTokenizer()
    check_tokenizer_args(args)
    builders = {"tiktoken": TikTokenizer, "sentencepiece": SentencePieceTokenizer,
                "hf": HFTokenizer}
    try:
        return builders[args.kind](args.path)
    except ConfigError:
        raise
    except Exception as err:  # a file of the wrong kind fails inside the library in many ways
        raise ConfigError(f"Could not load the {args.kind} tokenizer from {args.path}: {err}. "
                          f"Check that the file is a {EXPECTED_FILE[args.kind]}.") from None
