"""The debug preset's inputs, made here on first use (no download): a tiny Hugging Face Llama that
transformers builds from a config (random weights, the byte tokenizer's files beside it), and a
small chat corpus written from the embedded corpus's text (lingua/train/chat_data.py).

`python -m apps.sft.prepare OUT_DIR` writes both as OUT_DIR/base and OUT_DIR/chat; the debug
preset trains from data/sft_debug/base on data/sft_debug/chat.
"""

import json
import sys
from pathlib import Path

import torch

from apps.sft.hf import llama_hf_config
from apps.sft.model import LlamaArgs
from lingua.train import hf as lingua_hf
from lingua.train.data_common import write_once

BASE, CHAT = "base", "chat"


def write_base_model(out: Path, args: LlamaArgs, seed: int = 0) -> Path:
    """A LlamaForCausalLM of `args`' shape, initialised by transformers from `seed`, saved as a
    Hugging Face directory (config.json, model.safetensors, byte tokenizer files); safe when
    processes race (write_once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def write(tmp: Path) -> None:
        cfg = {k: v for k, v in llama_hf_config(args, torch.float32).items() if k != "torch_dtype"}
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
        model.save_pretrained(tmp, safe_serialization=True)
        config = json.loads((tmp / "config.json").read_text())
        config["lingua_ffn"] = cfg["lingua_ffn"]   # lets load_hf give back the same args
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        lingua_hf.byte_tokenizer_json().save(str(tmp / "tokenizer.json"))

    write_once(out, "config.json", write, "the debug base model (checkpoint.init_from)")
    return Path(out)


def ensure_debug_inputs(args) -> None:
    """The chat corpus at data.root, and the base model beside it (data.root's parent / base) when
    checkpoint.init_from names that place: a directory the user named elsewhere is never made up
    behind her back (run.validate then says it is missing)."""
    from lingua.train.chat_data import write_debug_chat

    root = Path(args.data.root)
    if not any(root.glob("*.jsonl")):
        write_debug_chat(root)
    base = root.parent / BASE
    init_from = args.checkpoint.init_from
    if init_from is not None and Path(init_from).resolve() == base.resolve():
        write_base_model(base, args.model)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m apps.sft.prepare OUT_DIR")
    from omegaconf import OmegaConf

    from lingua.config import CONFIG_DIR
    from lingua.train.chat_data import write_debug_chat

    out = Path(argv[0])
    # The debug preset's model, read from its file (apps.sft.train imports this module)
    shape = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "sft" / "debug.yaml").model)
    write_debug_chat(out / CHAT)
    write_base_model(out / BASE, LlamaArgs(**shape))
    print(f"wrote {out / BASE} (a tiny LlamaForCausalLM) and {out / CHAT} (chat jsonl)")


if __name__ == "__main__":
    main()
