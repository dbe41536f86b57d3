"""Hugging Face model directories on disk: safetensors files read and written through DCP's
Hugging Face storage reader and writer, one file's worth of tensors at a time, and the tokenizer
files beside an export. Each architecture's hf.py names the tensors (`to_hf`); hf.py beside this
file holds the checks and the commands."""

import json
import logging
import re
from pathlib import Path
from typing import Callable, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from lingua.checkpoint import quiet_single_process_dcp
from lingua.errors import ConfigError

# The most bytes of one safetensors file of an export, and so the most an export holds at once.
SHARD_BYTES = 4 << 30
INDEX = "model.safetensors.index.json"


def layer_of(key: str) -> Optional[int]:
    """The decoder layer a state-dict key belongs to; None for the embeddings, norm and head."""
    match = re.match(r"layers\.(\d+)\.", key)
    return int(match.group(1)) if match else None


def renaming(key_map: Callable) -> Callable:
    """The `to_hf` of an architecture whose tensors keep their values under HF names."""
    def to_hf(state, args, dtype, layer):
        return {theirs: cast(state[ours], dtype) for ours, theirs in key_map(args).items()
                if layer_of(ours) == layer}
    return to_hf


def cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    return t.detach() if dtype is None else t.detach().to(dtype)


class _Reads(dict):
    """A state dict that records the keys a conversion read: the tensors an export keeps."""

    def __init__(self, state):
        super().__init__(state)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def convert(to_hf: Callable, state: dict, args, dtype, layer) -> Dict[str, torch.Tensor]:
    try:
        return to_hf(state, args, dtype, layer)
    except KeyError as e:
        raise ConfigError(f"save_hf: the model has no {e}; it does not match model_args (a "
                          "pipeline stage or a different architecture?). Export a whole "
                          "model.") from None


def plan_files(state: dict, args, dtype, to_hf: Callable, shard_bytes: int):
    """The export's files from the tensors' shapes alone (converted on the meta device): a list of
    [layers, our keys they read, HF names, bytes], layers whole and in order; and every key read."""
    meta = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
    files, read = [], set()
    for layer in [None, *range(args.n_layers)]:
        part = _Reads(meta)
        tensors = convert(to_hf, part, args, dtype, layer)
        nbytes = sum(t.nbytes for t in tensors.values())
        if not files or files[-1][3] + nbytes > shard_bytes:
            files.append([[], set(), [], 0])
        files[-1][0].append(layer)
        files[-1][1].update(part.read)
        files[-1][2].extend(tensors)
        files[-1][3] += nbytes
        read |= part.read
    return files, read


def write_files(out: Path, files: list, read: Callable, args, dtype, to_hf: Callable):
    """The safetensors files of `plan_files`, each from `read(its keys)` -> values: one
    model.safetensors when the model fits one file, else HF's numbered files and their index.
    A failure leaves no weight file behind. Returns the embeddings' dtype as written."""
    n = len(files)
    index = {name: i + 1 for i, file in enumerate(files) for name in file[2]}
    weight_map, total, first = {}, 0, None
    try:
        for layers, keys, _, _ in files:
            values = read(sorted(keys))
            tensors = {}
            for layer in layers:
                tensors.update(convert(to_hf, values, args, dtype, layer))
            tensors = {k: t.cpu().contiguous() for k, t in tensors.items()}
            first = first or tensors["model.embed_tokens.weight"].dtype
            quiet_single_process_dcp()
            dcp.save(tensors, no_dist=True, storage_writer=HuggingFaceStorageWriter(
                str(out), fqn_to_index_mapping=index))
            weight_map.update(json.loads((out / INDEX).read_text())["weight_map"])
            total += sum(t.nbytes for t in tensors.values())
            del values, tensors
    except BaseException:
        for f in out.glob(f"model-*-of-{n:05d}.safetensors"):
            f.unlink()
        (out / INDEX).unlink(missing_ok=True)
        raise
    if n == 1:  # HF's own name for a model in one file, without an index
        (out / weight_map["model.embed_tokens.weight"]).replace(out / "model.safetensors")
        (out / INDEX).unlink()
    else:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return first


def write_hf(out_dir, state: dict, read: Callable, *, args, dtype, to_hf: Callable,
             hf_config: Callable, check: Callable, shard_bytes: Optional[int] = None) -> None:
    """A Hugging Face directory of the model whose keys and shapes `state` holds: `to_hf(values,
    args, dtype, layer)` gives HF tensors per layer (None: embeddings, norm, head), `read(keys)`
    the values, `check(keys read)` refuses before anything is written."""
    files, keys_read = plan_files(state, args, dtype, to_hf, shard_bytes or SHARD_BYTES)
    check(keys_read)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype_written = write_files(out, files, read, args, dtype, to_hf)
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype_written), indent=2) + "\n")


def read_hf_tensors(path, tensors: Dict[str, torch.Tensor]) -> None:
    """Fill `tensors` (HF name -> tensor of the expected shape, any dtype) from the directory's
    safetensors files, through DCP's Hugging Face reader: only those tensors are read."""
    quiet_single_process_dcp()
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)


# ---------------------------------------------------------------------------------------------
# Tokenizer files beside an export


def byte_tokenizer_json():
    """A `tokenizers` Tokenizer that gives exactly lingua's byte tokenizer's ids (byte b -> id b,
    BOS 256 as `<s>`, EOS 257 as `</s>`; encoding with special tokens prepends BOS), so Hugging
    Face tools (transformers, lm-eval's HFLM) read an export of a byte-level model as we do."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    # ByteLevel maps each byte to a printable character; a BPE without merges then gives one
    # token per byte, with the byte's value as its id.
    byte_char = _bytes_to_unicode()
    assert set(byte_char.values()) == set(ByteLevel.alphabet())
    vocab = {byte_char[b]: b for b in range(256)}
    tok = HFTok(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 256)])
    return tok


def is_byte_tokenizer(path: Path) -> bool:
    """Whether a tokenizer.json is byte_tokenizer_json: what an export of a byte-tokenized run
    writes, which init_from then reads as data.tokenizer.kind=bytes (its corpora match)."""
    from tokenizers import Tokenizer as HFTok

    ours = byte_tokenizer_json().to_str()
    return path.stat().st_size < 4 * len(ours) and HFTok.from_file(str(path)).to_str() == ours


def _bytes_to_unicode() -> Dict[int, str]:
    # GPT-2's printable stand-ins for bytes, the mapping `tokenizers`' ByteLevel uses.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def write_tokenizer(run_config, out_dir) -> Optional[str]:
    """Tokenizer files (of the run config's data.tokenizer) beside an export, so that
    `AutoTokenizer.from_pretrained(out_dir)` encodes as training did: the byte tokenizer as an
    equivalent tokenizer.json, an HF tokenizer.json as it is. Returns what was written, or None
    with a warning for kinds transformers cannot read as they are (tiktoken, sentencepiece)."""
    import shutil

    tokenizer_args = _tokenizer_args(run_config)
    out = Path(out_dir)
    kind = tokenizer_args.kind
    if kind == "bytes":
        byte_tokenizer_json().save(str(out / "tokenizer.json"))
        bos, eos = "<s>", "</s>"
    elif kind == "hf":
        src = Path(tokenizer_args.path)
        shutil.copyfile(src, out / "tokenizer.json")
        from lingua.data.tokenizer import HFTokenizer

        tok = HFTokenizer(str(src))
        bos, eos = tok.model.id_to_token(tok.bos_id), tok.model.id_to_token(tok.eos_id)
    else:
        logging.getLogger(__name__).warning(
            "the export has no tokenizer files: transformers cannot read a %s tokenizer as it "
            "is; pass yours to the Hugging Face tools", kind)
        return None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "clean_up_tokenization_spaces": False, "model_max_length": 1_000_000_000}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return "tokenizer.json and tokenizer_config.json"


def write_token_ids(run_config, out_dir) -> None:
    """The run tokenizer's BOS and EOS ids into the export: without them transformers takes
    Llama's (1, 2) and generate() runs past our EOS. Skipped, with a warning, where the tokenizer
    file is no longer where the run read it."""
    from lingua.data.tokenizer import build_tokenizer

    try:
        tokenizer = build_tokenizer(_tokenizer_args(run_config))
    except ConfigError as err:
        logging.getLogger(__name__).warning("the export has no BOS/EOS ids: %s", err)
        return
    write_generation_ids(out_dir, tokenizer.bos_id, tokenizer.eos_id, pad=tokenizer.eos_id)


def write_generation_ids(out_dir, bos: int, eos, pad: int) -> None:
    """`bos`, `eos` (an id or stop ids) into config.json, and with `pad` generation_config.json."""
    ids = {"bos_token_id": bos, "eos_token_id": eos}
    config = Path(out_dir) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **ids}, indent=2) + "\n")
    generation = {**ids, "pad_token_id": pad}
    (Path(out_dir) / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _tokenizer_args(run_config):
    """The TokenizerArgs of a run config's data.tokenizer section."""
    from omegaconf import OmegaConf

    from lingua.data.tokenizer import TokenizerArgs

    section = OmegaConf.select(run_config, "data.tokenizer") or {}
    return TokenizerArgs(**OmegaConf.to_container(OmegaConf.create(section), resolve=True))
