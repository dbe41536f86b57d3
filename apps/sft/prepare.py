"""The debug preset's inputs, made here on first use (no download): a tiny Hugging Face Llama that
has learned something (apps/sft's Llama of the preset's shape pretrained on the embedded corpus for
BASE_STEPS steps, as the quickstart trains apps.llama's debug preset, then exported with the byte
tokenizer's files: LoRA on a random base has nothing to adapt), and a small chat corpus written
from the same text (lingua/data/chat.py).

The debug preset trains from data/sft_debug/base on data/sft_debug/chat (`python -m apps.sft.train`
makes them). LINGUA_SFT_BASE_STEPS sets the
base's pretraining steps (the tests make a quick one).
"""

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Callable, Optional

import torch

from lingua.checkpoint import hf_files
from lingua.data.batch import write_once
from lingua.errors import RunError
from lingua.models.llama.hf import llama_hf_config
from lingua.models.llama.model import LlamaArgs

BASE, CHAT = "base", "chat"
logger = logging.getLogger(__name__)


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
        hf_files.byte_tokenizer_json().save(str(tmp / "tokenizer.json"))

    write_once(out, "config.json", write, "the debug base model (checkpoint.init_from)")
    return Path(out)


BASE_STEPS = 500   # ~3 minutes on 2 CPU cores: the base then writes words of the docstrings


def pretrain_base(out: Path, args: LlamaArgs, corpus: Path, train: Callable[[list], int],
                  steps: Optional[int] = None) -> Path:
    """The debug preset's base: a Llama of `args`' shape pretrained for `steps` on the embedded
    corpus at `corpus` (made there if missing), exported as a LlamaForCausalLM directory; safe
    when processes race (write_once). `train(argv)` is apps.sft.train's run of a config (it
    imports this module, so it hands itself in). The pretraining run is kept beside `out`
    (`<out>.pretrain`): stopped, the same command resumes it."""
    from apps.sft import hf as sft_hf

    steps = steps or int(os.environ.get("LINGUA_SFT_BASE_STEPS", BASE_STEPS))
    run_dir = out.parent / f"{out.name}.pretrain"

    def write(tmp: Path) -> None:
        shape = [f"model.{k}={v}" for k, v in dataclasses.asdict(args).items() if v is not None]
        argv = ["config=debug", f"dump_dir={run_dir}", "checkpoint.init_from=null", "lora.rank=0",
                "data.format=memmap", f"data.root={corpus}", "data.prepare_embedded=true",
                "data.val_sequences=0", f"steps={steps}", "optim.lr=3e-3", "optim.warmup=20",
                "optim.weight_decay=0.1", "eval.at_end=false", "checkpoint.every=50",
                "model.attn_mask=causal", *shape]
        logger.info("the debug base: pretraining %d steps on %s (once; then %s)", steps, corpus,
                    out)
        if train(argv) != 0:
            raise RunError(f"the debug base's pretraining in {run_dir} stopped before its end; "
                           f"run the same command again to go on from its checkpoint.")
        sft_hf.export_merged(run_dir, tmp)

    write_once(out, "config.json", write, "the debug base model (checkpoint.init_from)")
    return Path(out)


def ensure_debug_inputs(args, train: Callable[[list], int]) -> None:
    """The chat corpus at data.root, and the base model beside it (data.root's parent / base) when
    checkpoint.init_from names that place: a directory the user named elsewhere is never made up
    behind her back (run.validate then says it is missing)."""
    from lingua.data.chat import write_debug_chat

    root = Path(args.data.root)
    if not any(root.glob("*.jsonl")):
        write_debug_chat(root)
    base = root.parent / BASE
    init_from = args.checkpoint.init_from
    if init_from is not None and Path(init_from).resolve() == base.resolve():
        pretrain_base(base, args.model, root.parent / "embedded", train)

