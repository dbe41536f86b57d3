"""Fine-tune a Hugging Face Llama, Mistral, Qwen2/2.5 or Qwen3 on conversations:
`python -m apps.sft.train checkpoint.init_from=DIR data.root=CHAT [config=PRESET] ...`.

The LLaMA app's model, plans and HF map, started from `checkpoint.init_from` (a Hugging Face
directory: its config.json gives model.*, its tokenizer.json data.tokenizer and the chat
template beside it; lingua/checkpoint/hf.py shape_from_init_from), trained on
`data.format=chat` (lingua/data/chat.py: only the assistant's tokens count in the loss), with
LoRA adapters (`lora.rank` > 0; lingua/model/lora.py) or every weight (`lora.rank=0`). What is
fine-tuning's own lives in this folder: the config schema and its checks, the App, the debug
inputs (prepare.py), the export (hf.py: merged or a PEFT adapter) and chat generation
(generate.py).
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lingua import config
from lingua.checkpoint import hf as lingua_hf
from lingua.launch import run
from lingua.model import lora
from lingua.model.lora import LoRAArgs
from lingua.models.llama.hf import ARCHITECTURES, args_from_hf_config, export_problems, load_hf
from lingua.models.llama.model import LlamaArgs, Transformer, validate_model_args
from lingua.models.llama.parallelize import (
    parallelize_llama,
    tp_plans,
    uses_loss_parallel,
    validate_tp,
)
from lingua.parallel.tensor_parallel import lora_tp_plans
from lingua.train.app import App

FAMILIES = ", ".join(ARCHITECTURES.values())   # what lingua/models/llama reads


@dataclass
class TrainArgs(run.BaseTrainArgs):
    model: LlamaArgs = field(default_factory=LlamaArgs)
    lora: LoRAArgs = field(default_factory=LoRAArgs)


config.register_schema("sft_schema", TrainArgs)




def check_init_from(args: TrainArgs) -> None:
    """checkpoint.init_from is a directory of a family lingua/models/llama reads (its
    args_from_hf_config refuses any other, naming them) whose weights have model.*'s shapes: said
    now, not after the process group and the model exist."""
    path = args.checkpoint.init_from
    config.require(path is not None,
                   "apps.sft fine-tunes a Hugging Face checkpoint, and checkpoint.init_from is not "
                   "set. Set checkpoint.init_from=DIR, a directory with config.json and "
                   "*.safetensors (e.g. a Llama 3.1 8B Instruct or Qwen3 0.6B download).")
    config.require(Path(path).exists(),
                   f"checkpoint.init_from={path} does not exist. Point it at a Hugging Face "
                   f"model directory ({FAMILIES}: config.json and *.safetensors), e.g. the "
                   f"output of `python -m apps.llama.hf export`.")
    config_json = Path(path) / "config.json"
    config.require(config_json.is_file(),
                   f"checkpoint.init_from={path} has no config.json: it is not a Hugging Face "
                   f"model directory. Point it at one ({FAMILIES}).")
    theirs = config.to_dict(args_from_hf_config(config_json))
    ours = config.to_dict(args.model)
    differing = {k: (ours[k], theirs.get(k)) for k in ours
                 if k not in lingua_hf.RUNTIME_KEYS and ours[k] != theirs.get(k)}
    given = " ".join(f"model.{k}={v[0]}" for k, v in differing.items())
    config.require(not differing,
                   f"checkpoint.init_from={path} holds a model that differs from model.* in "
                   f"(ours, theirs): {differing}. The shape comes from init_from's config.json: "
                   f"remove `{given}` from the command line, or point checkpoint.init_from at a "
                   f"model of the shape you mean.")


def validate_sft(args: TrainArgs) -> None:
    validate_model_args(args.model)
    validate_tp(args.model, args.distributed.tp, args.data.seq_len)
    config.require(args.distributed.ep == 1, f"distributed.ep={args.distributed.ep}: LLaMA has no "
                                             f"experts to shard. Remove distributed.ep.")
    lora.validate_args(args.lora)
    config.require(not (args.lora.rank and args.distributed.float8 != "none"),
                   f"distributed.float8={args.distributed.float8} with lora.rank="
                   f"{args.lora.rank}: float8 training would replace the adapted layers "
                   f"(their adapters with them). Set distributed.float8=none for LoRA, or "
                   f"lora.rank=0 to fine-tune every weight in float8.")
    with torch.device("meta"):   # targets, rank and TP plan against the model's real layers
        model = Transformer(args.model)
        lora.check_targets(model, args.lora)
        if args.lora.rank and args.distributed.tp > 1:   # a LoRA layer the plan leaves out
            lora.apply_lora(model, args.lora)
            lora_tp_plans(model, *tp_plans(model, uses_loss_parallel(args.distributed)),
                          model.layers.values())


def transform_model(model, args: TrainArgs) -> None:
    lora.apply_lora(model, args.lora)


APP = App(model_class=Transformer, parallelize=parallelize_llama, validate_model=validate_sft,
          load_hf=load_hf, transform_model=transform_model, check_init_from=check_init_from)


def validate(args: TrainArgs) -> None:
    # Not in validate_sft: lingua.plan validates through APP without the files a job reads,
    # and warns of a missing init_from with check_init_from.
    check_init_from(args)
    run.validate(args, APP)
    lingua_hf.warn_unexportable(export_problems(args.model), "python -m apps.sft.hf")


def load_config(argv=None, check: bool = True) -> TrainArgs:
    """Compose (and check) the config exactly as a run would; stool calls this before submitting."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = config.load("sft", TrainArgs, argv)
    lingua_hf.shape_from_init_from(args, argv, args_from_hf_config)
    if check:
        validate(args)
    return args


def main(argv=None) -> int:
    """The debug inputs on first use, the config's checks, then run.run."""
    from apps.sft import prepare

    args = load_config(argv, check=False)
    if args.data.prepare_embedded:
        prepare.ensure_debug_inputs(args, train=base_pretraining)
    validate(args)
    return run.run(args, APP)


def base_pretraining(argv) -> int:
    """The debug base's pretraining (apps/sft/prepare.py): every weight trained, no init_from."""
    args = load_config(argv, check=False)
    run.validate(args, APP)
    return run.run(args, APP)


if __name__ == "__main__":
    run.exit_cli(main)
