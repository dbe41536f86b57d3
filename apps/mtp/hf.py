"""Hugging Face interop: export the main model of an MTP run as a LlamaForCausalLM directory
(config.json + safetensors); the MTP modules stay behind (NOT_EXPORTED).

CLI: python -m apps.mtp.hf export <run_dir or checkpoint_dir> <out_dir> [--dtype bf16|fp32]
(a run directory: its newest complete checkpoint). This file holds what is this app's: its names
(`key_map`), its config.json (`llama_hf_config`, `args_from_hf_config`) and what the export may
refuse (`export_problems`, which apps/mtp/train.py warns with at start); lingua/checkpoint/hf.py
does the rest. Our RoPE rotates the two halves of each head, as Hugging Face's `rotate_half` does,
so q/k rows are copied as they are.
"""

from typing import Dict, List, Optional

import torch

from apps.mtp.model import MTPArgs, Transformer
from lingua.checkpoint import hf as lingua_hf
from lingua.checkpoint import hf_files
from lingua.errors import ConfigError


def key_map(args: MTPArgs) -> Dict[str, str]:
    """Our state_dict key -> Hugging Face key, for save_hf and load_hf alike. A fork that adds a
    weight (QK-norm's layers.N.attention.q_norm.weight, ...) maps it here; save_hf refuses a model
    with an unmapped tensor and load_hf a file with an unconsumed one."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    per_layer = {
        "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
        "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    }
    for i in range(args.n_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    return names


def llama_hf_config(args: MTPArgs, dtype: torch.dtype) -> dict:
    """config.json: the decoder's shape (lingua_hf.decoder_config) as LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **lingua_hf.decoder_config(args, dtype),
        "attention_bias": False,
        "mlp_bias": False,
    }


def args_from_hf_config(config_path) -> MTPArgs:
    cfg = lingua_hf.read_config(config_path)
    try:
        unsupported = lingua_hf.decoder_problems(cfg)
        unsupported += [k for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
        if unsupported:
            raise ConfigError(f"{config_path}: {', '.join(unsupported)} is not supported by "
                              f"{__package__}.")
        multiple_of, mult = lingua_hf.ffn_recipe(cfg["hidden_size"], cfg["intermediate_size"],
                                                 cfg.get("lingua_ffn"))
        return MTPArgs(**lingua_hf.decoder_args(cfg, config_path), multiple_of=multiple_of,
                       ffn_dim_multiplier=mult)
    except KeyError as e:
        raise ConfigError(f"{config_path} lacks {e}; it is not a LlamaForCausalLM config.") \
            from None


# State-dict tensors deliberately not exported: pattern (whole name) -> why. (The RoPE tables are
# non-persistent: not in the state dict.)
NOT_EXPORTED: Dict[str, str] = {
    r"mtp\..*|mtp_embeddings\.weight":
        "the multi-token prediction modules: LlamaForCausalLM has no place for them, and the "
        "exported model is the main one (generation uses the main head only)",
}

# Tensors some HF files carry that load_hf deliberately does not read: pattern -> why.
NOT_IMPORTED: Dict[str, str] = {
    r"model\.rotary_emb\.inv_freq":
        "RoPE inverse frequencies, recomputed from rope_theta/rope_scaling",
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq":
        "the same, stored per layer by older transformers (Llama 2 era Hub files)",
}


def export_problems(model_args: MTPArgs) -> List[str]:
    """Why the export would refuse a model trained with these args, each reason with its fix.
    Empty: every option of the main model has its LlamaForCausalLM setting, and the MTP modules
    stay behind by design (NOT_EXPORTED)."""
    return []


# The shared machinery (lingua/checkpoint/hf.py), given this file's names.
WHERE = f"key_map in {lingua_hf.app_file(__file__)}"


def save_hf(model: Transformer, model_args: MTPArgs, path,
            dtype: Optional[torch.dtype] = None) -> None:
    lingua_hf.save_hf(model, model_args, path, dtype, to_hf=hf_files.renaming(key_map),
                      hf_config=llama_hf_config, not_exported=NOT_EXPORTED, where=WHERE)


def load_hf(path, dtype: Optional[torch.dtype] = torch.float32):
    """(Transformer on CPU, MTPArgs) from a Hugging Face directory; dtype None keeps the file's."""
    return lingua_hf.load_hf(path, dtype, model_class=Transformer,
                             args_from_hf_config=args_from_hf_config, key_map=key_map,
                             not_imported=NOT_IMPORTED, where=WHERE)


def export(ckpt_dir, out_dir, dtype: Optional[torch.dtype] = None) -> None:
    lingua_hf.export(ckpt_dir, out_dir, dtype, model_class=Transformer, args_class=MTPArgs,
                     export_problems=export_problems, to_hf=hf_files.renaming(key_map),
                     hf_config=llama_hf_config, not_exported=NOT_EXPORTED, where=WHERE,
                     command=lingua_hf.command(__file__))


def main(argv=None) -> None:
    lingua_hf.export_cli(argv, lingua_hf.command(__file__), __doc__.split("\n")[0], export)


if __name__ == "__main__":
    main()
