"""Export a fine-tuning run for Hugging Face tools.

`python -m apps.sft.hf export RUN_OR_CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32] [--adapter-only]`

By default the merged model: every LoRA adapter folded into its base weight (W + alpha/rank B A),
written as model.family's architecture (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
or Qwen3ForCausalLM: the family init_from was) through the key map below, with the tokenizer
files, the run's chat template (tokenizer_config.json) and its stop tokens (generation_config.json)
beside it. With --adapter-only, a PEFT LoRA adapter (adapter_config.json +
adapter_model.safetensors) for the base model the run started from (checkpoint.init_from):
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)`; the base's own
weights (Qwen2's q/k/v biases included) stay as they are.

The map is lingua/models/llama/hf.py's, the one apps/llama exports with: fine-tuning changes the
training, not the architecture.
"""

import json
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lingua.checkpoint import hf as lingua_hf
from lingua.checkpoint import hf_files
from lingua.errors import ConfigError
from lingua.model import lora
from lingua.model.lora import LoRAArgs, LoRALinear
from lingua.models.llama.hf import (  # noqa: F401 (the app's interface: load_hf, save_hf)
    WHERE,
    args_from_hf_config,
    export_problems,
    key_map,
    llama_hf_config,
    load_hf,
    save_hf,
)
from lingua.models.llama.model import LlamaArgs, Transformer

COMMAND = lingua_hf.command(__file__)
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."   # PeftModel wraps the *ForCausalLM as base_model.model


# ---------------------------------------------------------------------------------------------
# Reading a run


def run_lora_args(run_config, ckpt_dir) -> LoRAArgs:
    """The run's lora section; a run without one was not trained by apps.sft."""
    section = OmegaConf.select(run_config, "lora")
    if section is None:
        raise ConfigError(f"{ckpt_dir}/config.yaml has no lora section: {ckpt_dir} is not a "
                          f"fine-tuning run of apps.sft. Use the commands of the app that "
                          f"trained it (python -m apps.llama.hf export, python -m "
                          f"apps.llama.generate for apps.llama).")
    try:
        return LoRAArgs(**OmegaConf.to_container(section, resolve=True))
    except TypeError as e:
        raise ConfigError(f"{ckpt_dir}/config.yaml: its lora section does not fit LoRAArgs "
                          f"({e}); export it with the code that trained it.") from None


def model_args(run_config, ckpt_dir) -> LlamaArgs:
    try:
        args = LlamaArgs(**OmegaConf.to_container(run_config.model, resolve=True))
    except (TypeError, AttributeError) as e:
        raise ConfigError(f"{ckpt_dir}/config.yaml: its model section does not fit LlamaArgs "
                          f"({e}); export it with the app that trained it.") from None
    args.attn_backend = "sdpa"   # export and decoding run sdpa; xformers would refuse on CPU
    return args


def build_model(args: LlamaArgs, lora_args: LoRAArgs, device="cpu") -> Transformer:
    """The run's model (adapters included, as training built it) with empty weights."""
    with torch.device("meta"):
        model = Transformer(args)
        lora.apply_lora(model, lora_args)
    model.to_empty(device=device)
    model.init_rope(device)
    return model


def load_run(target, device="cpu"):
    """(model with the checkpoint's weights, in eval mode, LlamaArgs, LoRAArgs, run config,
    checkpoint dir) from a run directory (its newest complete checkpoint) or a checkpoint."""
    from lingua.checkpoint import load_model_state, read_run_config, resolve

    ckpt_dir = resolve(target)
    run_config = read_run_config(ckpt_dir)
    lora_args = run_lora_args(run_config, ckpt_dir)
    args = model_args(run_config, ckpt_dir)
    model = build_model(args, lora_args, device)
    lingua_hf.load_base(model, ckpt_dir, load_hf)   # LoRA checkpoints hold the adapters only
    with warnings.catch_warnings():   # a single-process load is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_model_state(ckpt_dir, model)
    return model.eval(), args, lora_args, run_config, ckpt_dir


def data_args(run_config):
    """The run's DataArgs (its config.yaml's data section over the schema's defaults)."""
    from lingua.data import DataArgs

    section = OmegaConf.to_container(run_config.data, resolve=True)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataArgs), section))


def chat_template(run_config):
    """The ChatTemplate the run trained with."""
    from lingua.data.chat import ChatTemplate

    return ChatTemplate.from_args(data_args(run_config))


def turn_end_id(template, tokenizer) -> int:
    """The token that closes an assistant turn, read from a probe conversation: what the
    template writes after the content, when that is one token (EOS for the built-in template,
    <|eot_id|> for Llama 3's); else EOS (a closing spelled in several tokens is no stop token)."""
    content = "ok"
    ids, counted = template.encode([{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": content}], tokenizer)
    targets = [i for i, c in zip(ids, counted) if c]
    spelled = tokenizer.encode(content, add_bos=False, add_eos=False)
    closing = targets[len(spelled):] if targets[:len(spelled)] == spelled else []
    return closing[0] if len(closing) == 1 else tokenizer.eos_id



# ---------------------------------------------------------------------------------------------
# The merged model


class Merged:
    """A state dict read with every adapter folded into its base weight (W + alpha/rank B A):
    what the merged export names, one file's tensors at a time."""

    def __init__(self, state, lora_args: LoRAArgs):
        self.state, self.lora_args = state, lora_args

    def __getitem__(self, key):
        adapter = key.removesuffix("weight")
        if adapter + "lora_a" not in self.state:
            return self.state[key]
        scale = self.lora_args.alpha / self.lora_args.rank
        return lora.merged(self.state[key], self.state[adapter + "lora_a"],
                           self.state[adapter + "lora_b"], scale)


def export_merged(ckpt_dir, out_dir, dtype=None) -> LlamaArgs:
    """The merged model as a Hugging Face directory of model.family: lingua_hf.export reads the
    adapted model's tensors file by file (the frozen base from the directory base.json names),
    merges them and names them through the llama key map."""
    from lingua.checkpoint import read_run_config

    run_config = read_run_config(ckpt_dir)
    lora_args = run_lora_args(run_config, ckpt_dir)
    fields = chat_fields(run_config)
    rename = hf_files.renaming(key_map)

    def adapted(args: LlamaArgs) -> Transformer:   # export builds it on the meta device
        model = Transformer(args)
        lora.apply_lora(model, lora_args)
        return model

    args = lingua_hf.export(
        ckpt_dir, out_dir, dtype, model_class=adapted, args_class=LlamaArgs,
        export_problems=export_problems, hf_config=llama_hf_config, not_exported={}, where=WHERE,
        to_hf=lambda state, *a: rename(Merged(state, lora_args), *a), command=COMMAND,
        base_key_map=key_map)
    write_chat_files(run_config, out_dir, fields)
    return args


def template_jinja(run_config) -> str:
    """The Jinja text of the run's chat template: its file's, or the built-in one's."""
    from lingua.data.chat_template import BUILTIN_JINJA, ChatTemplate

    text = ChatTemplate.from_args(data_args(run_config)).jinja_text
    return BUILTIN_JINJA if text is None else text


def chat_fields(run_config):
    """(the template's Jinja text or None, the stop-token ids) that make HF tools chat as the run
    does; read before any weight is written, so a template that went missing refuses early."""
    from lingua.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(data_args(run_config).tokenizer)
    stops, jinja = [tokenizer.eos_id], None
    if OmegaConf.select(run_config, "data.format") == "chat":
        stops = list(dict.fromkeys([turn_end_id(chat_template(run_config), tokenizer)] + stops))
        jinja = template_jinja(run_config)
    ids = {"bos_token_id": tokenizer.bos_id,
           "eos_token_id": stops[0] if len(stops) == 1 else stops}
    return jinja, {**ids, "pad_token_id": tokenizer.eos_id}


def write_chat_files(run_config, out_dir, fields=None) -> None:
    """The template into tokenizer_config.json (when the export has one: a tokenizer transformers
    reads), the stop tokens (the template's turn end, EOS) into config.json and
    generation_config.json: transformers' Llama defaults (BOS 1, EOS 2) are other tokens of most
    vocabularies."""
    jinja, ids = fields or chat_fields(run_config)
    out = Path(out_dir)
    tok_config = out / "tokenizer_config.json"
    if jinja is not None and tok_config.is_file():
        _update_json(tok_config, {"chat_template": jinja})
    hf_files.write_generation_ids(out, ids["bos_token_id"], ids["eos_token_id"],
                                   pad=ids["pad_token_id"])


def _update_json(path: Path, fields: dict) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# The PEFT adapter


def peft_module(our_weight: str, names: dict) -> str:
    """Hugging Face module name of one of our Linear weights (`layers.0.attention.wq.weight` ->
    `model.layers.0.self_attn.q_proj`), from the llama key map."""
    if our_weight not in names:
        raise ConfigError(f"{our_weight} carries a LoRA adapter but has no Hugging Face name in "
                          f"{WHERE}, so PEFT could not place it. Map it there, or "
                          f"export the merged model (without --adapter-only).")
    return names[our_weight].removesuffix(".weight")


def adapter_tensors(model: Transformer, args: LlamaArgs, dtype=None) -> dict:
    """PEFT's names for every adapter: `base_model.model.<HF module>.lora_A.weight` [r, in] and
    `...lora_B.weight` [out, r]."""
    names = key_map(args)
    tensors = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            module = PEFT_PREFIX + peft_module(f"{name}.weight", names)
            for ours, theirs in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
                t = getattr(m, ours).detach()
                t = t if dtype is None else t.to(dtype)
                tensors[f"{module}.{theirs}.weight"] = t.cpu().contiguous()
    return tensors


def adapter_config(lora_args: LoRAArgs, args: LlamaArgs, base: str) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields; target modules in HF names, read through
    the key map from our targets (wq -> q_proj)."""
    names = key_map(args)
    targets = sorted({peft_module(k, names).rsplit(".", 1)[-1] for k in names
                      if k.endswith(".weight") and k.rsplit(".", 2)[-2] in lora_args.targets})
    alpha = lora_args.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora_args.rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": lora_args.dropout, "target_modules": targets, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,   # scale = alpha / r
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "revision": None,
    }


def export_adapter(ckpt_dir, out_dir, dtype=None) -> LoRAArgs:
    """The adapters alone, as a PEFT LoRA adapter of the run's checkpoint.init_from."""
    from safetensors.torch import save_file

    from lingua.checkpoint import read_run_config

    run_config = read_run_config(ckpt_dir)
    lora_args = run_lora_args(run_config, ckpt_dir)
    if not lora_args.rank:
        raise ConfigError(f"{ckpt_dir} is a full fine-tuning run (lora.rank=0): it has no "
                          f"adapters, every weight changed. Export the whole model: drop "
                          f"--adapter-only.")
    args = model_args(run_config, ckpt_dir)
    lingua_hf.refuse_unexportable(export_problems(args), COMMAND, ckpt_dir)
    tensors = adapter_tensors(load_run(ckpt_dir)[0], args, dtype)
    base = OmegaConf.select(run_config, "checkpoint.init_from")
    if base is not None and Path(base).is_dir():   # a relative path means the run's cwd: pin it
        base = Path(base).resolve()
    config = adapter_config(lora_args, args, str(base) if base is not None else None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return lora_args


# ---------------------------------------------------------------------------------------------
# The command


def main(argv=None) -> None:
    """As lingua_hf.export_cli, with --adapter-only: a bad input prints one `error:` paragraph and
    exits with status 2."""
    import argparse
    import sys

    from lingua.checkpoint import resolve

    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="write a fine-tuning checkpoint for Hugging Face tools")
    p.add_argument("checkpoint_dir", help="a run directory (its newest complete checkpoint) or "
                                          "<dump_dir>/checkpoints/<step>")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=sorted(lingua_hf.DTYPES), default=None,
                   help="default: as trained (fp32)")
    p.add_argument("--adapter-only", action="store_true",
                   help="a PEFT LoRA adapter for the run's checkpoint.init_from, not the merged "
                        "model")
    ns = parser.parse_args(argv)
    dtype = lingua_hf.DTYPES.get(ns.dtype)
    try:
        ckpt = resolve(ns.checkpoint_dir)
        if ns.adapter_only:
            export_adapter(ckpt, ns.out_dir, dtype)
        else:
            export_merged(ckpt, ns.out_dir, dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if ns.adapter_only:
        out = Path(ns.out_dir)
        print(f"wrote a PEFT LoRA adapter from {ckpt}: {out / ADAPTER_CONFIG} and "
              f"{out / ADAPTER_WEIGHTS}")
    else:
        print(lingua_hf.wrote(ckpt, ns.out_dir))


if __name__ == "__main__":
    main()
