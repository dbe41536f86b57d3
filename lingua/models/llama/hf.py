"""Hugging Face interop: LlamaForCausalLM directories (config.json + safetensors) <-> Transformer.

`python -m apps.llama.hf export RUN_OR_CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32]`. LLaMA's names
and config.json live here, lingua/checkpoint/hf.py does the rest. Our RoPE rotates each head's
halves as HF's `rotate_half` does, so q/k rows are copied as they are."""

import torch

from lingua.checkpoint import hf as lingua_hf
from lingua.checkpoint import hf_files
from lingua.errors import ConfigError
from lingua.models.llama.model import LlamaArgs, Transformer


def key_map(args: LlamaArgs) -> dict[str, str]:
    """Our state_dict key -> Hugging Face key, for save_hf and load_hf. A fork that adds a weight
    maps it here: save_hf refuses an unmapped tensor, load_hf an unconsumed one."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
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


def llama_hf_config(args: LlamaArgs, dtype: torch.dtype) -> dict:
    """config.json: the decoder's shape (lingua_hf.decoder_config) as LlamaForCausalLM."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **lingua_hf.decoder_config(args, dtype),
        "attention_bias": False,
        "mlp_bias": False,
    }


def args_from_hf_config(config_path) -> LlamaArgs:
    cfg = lingua_hf.read_config(config_path)
    try:
        unsupported = lingua_hf.decoder_problems(cfg)
        unsupported += [k for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
        if unsupported:
            raise ConfigError(f"{config_path}: {', '.join(unsupported)} is not supported by "
                              f"{__package__}.")
        multiple_of, mult = lingua_hf.ffn_recipe(cfg["hidden_size"], cfg["intermediate_size"],
                                                 cfg.get("lingua_ffn"))
        return LlamaArgs(**lingua_hf.decoder_args(cfg, config_path), multiple_of=multiple_of,
                         ffn_dim_multiplier=mult)
    except KeyError as e:
        raise ConfigError(f"{config_path} lacks {e}; it is not a LlamaForCausalLM config.") \
            from None


# State-dict tensors deliberately not exported: pattern -> why (the RoPE tables are not persistent).
NOT_EXPORTED: dict[str, str] = {}

# Tensors some HF files carry that load_hf deliberately does not read: pattern -> why.
NOT_IMPORTED: dict[str, str] = {
    r"model\.rotary_emb\.inv_freq":
        "RoPE inverse frequencies, recomputed from rope_theta/rope_scaling",
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq":
        "the same, stored per layer by older transformers (Llama 2 era Hub files)",
}


def export_problems(model_args: LlamaArgs) -> list[str]:
    """Why the export would refuse a model with these args, each with its fix (train.py warns at
    start). None: every LlamaArgs option has its LlamaForCausalLM setting."""
    return []


WHERE = f"key_map in {lingua_hf.app_file(__file__)}"


def save_hf(model: Transformer, model_args: LlamaArgs, path, dtype: torch.dtype | None = None):
    lingua_hf.save_hf(model, model_args, path, dtype, to_hf=hf_files.renaming(key_map),
                      hf_config=llama_hf_config, not_exported=NOT_EXPORTED, where=WHERE)


def load_hf(path, dtype: torch.dtype | None = torch.float32):
    """(Transformer, LlamaArgs) on CPU from a HF directory; dtype None keeps the file's."""
    return lingua_hf.load_hf(path, dtype, model_class=Transformer,
                             args_from_hf_config=args_from_hf_config, key_map=key_map,
                             not_imported=NOT_IMPORTED, where=WHERE)


def export(ckpt_dir, out_dir, dtype: torch.dtype | None = None) -> None:
    lingua_hf.export(ckpt_dir, out_dir, dtype, model_class=Transformer, args_class=LlamaArgs,
                     export_problems=export_problems, to_hf=hf_files.renaming(key_map),
                     hf_config=llama_hf_config, not_exported=NOT_EXPORTED, where=WHERE,
                     command=lingua_hf.command(__file__))


def main(argv=None) -> None:
    lingua_hf.export_cli(argv, lingua_hf.command(__file__), __doc__.split("\n")[0], export)


if __name__ == "__main__":
    main()
