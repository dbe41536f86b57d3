"""Hugging Face interop: Llama, Mistral, Qwen2/2.5 and Qwen3 directories (config.json +
safetensors) <-> Transformer, the family read from config.json's model_type (model.family).

`python -m apps.llama.hf export RUN_OR_CHECKPOINT_DIR OUT_DIR [--dtype bf16|fp32]`. The families'
names and config.json live here, lingua/checkpoint/hf.py does the rest. Our RoPE rotates each
head's halves as HF's `rotate_half` does, so q/k rows are copied as they are."""

import torch

from lingua.checkpoint import hf as lingua_hf
from lingua.checkpoint import hf_files
from lingua.errors import ConfigError
from lingua.models.llama.model import LlamaArgs, Transformer

# model.family -> its Hugging Face architecture, and the options its model computes with (each
# family's attention: Qwen2's q/k/v biases, Qwen3's QK-norm, Mistral's sliding window).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
FAMILY_OPTIONS = {"llama": {"qk_norm": False, "qkv_bias": False},
                  "mistral": {"qk_norm": False, "qkv_bias": False},
                  "qwen2": {"qk_norm": False, "qkv_bias": True},
                  "qwen3": {"qk_norm": True, "qkv_bias": False}}


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
    if args.qk_norm:
        per_layer.update({"attention.q_norm": "self_attn.q_norm",
                          "attention.k_norm": "self_attn.k_norm"})
    biased = ("attention.wq", "attention.wk", "attention.wv") if args.qkv_bias else ()
    for i in range(args.n_layers):
        for ours, theirs in per_layer.items():
            names[f"layers.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
        for ours in biased:
            names[f"layers.{i}.{ours}.bias"] = f"model.layers.{i}.{per_layer[ours]}.bias"
    return names


def llama_hf_config(args: LlamaArgs, dtype: torch.dtype) -> dict:
    """config.json: the decoder's shape (lingua_hf.decoder_config) as model.family's architecture.
    Every family's window key is written: Mistral's default is 4096, not none."""
    return {
        "architectures": [ARCHITECTURES[args.family]],
        "model_type": args.family,
        **lingua_hf.decoder_config(args, dtype),
        "attention_bias": False,
        "mlp_bias": False,
        "sliding_window": args.window,
        "use_sliding_window": False,
    }


def family_of(cfg: dict, config_path) -> str:
    """config.json's model_type, refused (naming the families read) when not one of ours."""
    family = cfg.get("model_type")
    if family not in ARCHITECTURES:
        raise ConfigError(
            f"{config_path}: model_type={family!r} is not a family this model reads; it reads "
            f"{', '.join(ARCHITECTURES)} (apps/moe reads mixtral, qwen2_moe, qwen3_moe and "
            "glm4_moe; apps/deepseek deepseek_v3; apps/qwen3_next qwen3_next). Use a directory "
            "of one of those, or fork an app for this architecture (docs/forking.md).")
    return family


def args_from_hf_config(config_path) -> LlamaArgs:
    cfg = lingua_hf.read_config(config_path)
    family = family_of(cfg, config_path)
    try:
        unsupported = lingua_hf.decoder_problems(cfg)
        unsupported += [k for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
        if cfg.get("use_sliding_window") or (family != "mistral" and cfg.get("layer_types") and
                                              set(cfg["layer_types"]) != {"full_attention"}):
            unsupported.append("sliding-window layers (use_sliding_window, layer_types)")
        if unsupported:
            raise ConfigError(f"{config_path}: {', '.join(unsupported)} is not supported by "
                              f"{__package__}.")
        multiple_of, mult = lingua_hf.ffn_recipe(cfg["hidden_size"], cfg["intermediate_size"],
                                                 cfg.get("lingua_ffn"))
        window = cfg.get("sliding_window") if family == "mistral" else None
        return LlamaArgs(**lingua_hf.decoder_args(cfg, config_path), multiple_of=multiple_of,
                         ffn_dim_multiplier=mult, family=family, window=window,
                         **FAMILY_OPTIONS[family])
    except KeyError as e:
        raise ConfigError(f"{config_path} lacks {e}; it is not a {ARCHITECTURES[family]} "
                          "config.") from None


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
    start): an option that model.family's architecture does not compute with."""
    family = model_args.family
    window = model_args.window if family == "mistral" else None
    wanted = {**FAMILY_OPTIONS[family], "window": window}
    return [f"model.{key}={getattr(model_args, key)} but {ARCHITECTURES[family]} (model.family="
            f"{family}) has {key}={value}: set model.family to the family with these options "
            f"(qwen2: qkv_bias, qwen3: qk_norm, mistral: a window)"
            for key, value in wanted.items() if getattr(model_args, key) != value]


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
