"""Hugging Face interop: LlamaForCausalLM directories (config.json + safetensors) <-> Transformer.

Our RoPE rotates the two halves of each head (lingua/model/transformer.py), exactly as Hugging
Face's `rotate_half` does, so q/k projection rows are copied as they are. (Meta's original
checkpoints use interleaved pairs; converting those needs the row permutation HF's own converter
applies.)

CLI: python -m apps.llama.hf export <run_dir or checkpoint_dir> <out_dir> [--dtype bf16|fp32]
(a run directory: its newest complete checkpoint). `export_problems(model_args)` says from the
args alone why the export would refuse a model; apps/llama/train.py warns with it at start.
"""

import json
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from apps.llama.model import LlamaArgs, Transformer
from lingua.errors import ConfigError
from lingua.model.transformer import ffn_hidden_dim
from lingua.train import hf as lingua_hf
from lingua.train.checkpoint import resolve
from lingua.train.hf import ffn_recipe, read_weights, rope_args


def key_map(args: LlamaArgs) -> Dict[str, str]:
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


def llama_hf_config(args: LlamaArgs, dtype: torch.dtype) -> dict:
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {
            "rope_type": "llama3", "factor": args.rope_scale_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.dim // args.n_heads,
        "vocab_size": args.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": args.init_std,
        # HF needs only intermediate_size; these let load_hf give back the same LlamaArgs.
        "lingua_ffn": {
            "multiple_of": args.multiple_of,
            "ffn_dim_multiplier": args.ffn_dim_multiplier,
        },
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


# State-dict tensors deliberately not exported: pattern (whole name) -> why. Empty: every persistent
# tensor of this model is a weight HF has. The RoPE tables rope_cos/rope_sin are derived from the
# args and registered non-persistent, so they are not in the state dict and need no entry.
NOT_EXPORTED: Dict[str, str] = {}

# Tensors some HF LlamaForCausalLM files carry that load_hf deliberately does not read:
# pattern -> why.
NOT_IMPORTED: Dict[str, str] = {
    r"model\.rotary_emb\.inv_freq":
        "RoPE inverse frequencies, recomputed from rope_theta/rope_scaling",
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq":
        "the same, stored per layer by older transformers (Llama 2 era Hub files)",
}
# With tie_word_embeddings transformers itself ignores a stored lm_head and ties it to the
# embedding.
TIED_NOT_IMPORTED = {
    r"lm_head\.weight":
        "a copy of embed_tokens that transformers also replaces by the tied embedding",
}


def export_problems(model_args: LlamaArgs) -> List[str]:
    """Why `python -m apps.llama.hf export` would refuse a model trained with these args, each
    reason with its fix; training warns with them at start. Empty: every LlamaArgs option has its
    LlamaForCausalLM setting (attn_mask=block_causal only masks training batches; the weights are
    the same). A fork whose model adds an option HF cannot express names it here."""
    return []


def _where() -> str:
    return f"key_map in {lingua_hf.app_file(__file__)}"


def save_hf(
    model: Transformer, model_args: LlamaArgs, path, dtype: Optional[torch.dtype] = None
) -> None:
    """Write `path/config.json` and `path/model.safetensors` (LlamaForCausalLM layout)."""
    state = model.state_dict()
    names = key_map(model_args)
    missing = sorted(set(names) - set(state))
    if missing:
        raise ConfigError(f"save_hf: the model has no {missing[:4]}; it does not match model_args "
                          "(a pipeline stage or a different architecture?). Export a whole model.")
    lingua_hf.check_export(state, names, NOT_EXPORTED, _where(), path)
    tensors = {}
    for ours, theirs in names.items():
        t = state[ours].detach()
        tensors[theirs] = (t if dtype is None else t.to(dtype)).cpu().contiguous()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = llama_hf_config(model_args, tensors["model.embed_tokens.weight"].dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def args_from_hf_config(config_path: Path) -> LlamaArgs:
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"Cannot read {config_path}: {e}. A Hugging Face model directory needs a "
                          "valid config.json.") from None
    try:
        dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
        hidden = cfg["intermediate_size"]
        unsupported = [k for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
        if cfg.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act={cfg['hidden_act']}")
        if cfg.get("head_dim") not in (None, dim // n_heads):
            unsupported.append(f"head_dim={cfg['head_dim']} != hidden_size/num_attention_heads")
        if unsupported:
            raise ConfigError(
                f"{config_path}: {', '.join(unsupported)} is not supported by apps.llama."
            )
        multiple_of, mult = ffn_recipe(dim, hidden, cfg.get("lingua_ffn"))
        args = LlamaArgs(
            dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads") or n_heads, vocab_size=cfg["vocab_size"],
            multiple_of=multiple_of, ffn_dim_multiplier=mult,
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            init_std=cfg.get("initializer_range", 0.02), **rope_args(cfg, config_path),
        )
    except KeyError as e:
        raise ConfigError(
            f"{config_path} lacks {e}; it is not a LlamaForCausalLM config."
        ) from None
    return args


def load_hf(path, dtype: Optional[torch.dtype] = torch.float32) -> Tuple[Transformer, LlamaArgs]:
    """Read a LlamaForCausalLM directory into (Transformer on CPU, LlamaArgs). dtype None keeps
    the file's."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(
            f"{config_path} is missing: {path} is not a Hugging Face model directory."
        )
    args = args_from_hf_config(config_path)
    names = key_map(args)
    ignored = {**NOT_IMPORTED, **(TIED_NOT_IMPORTED if args.tie_embeddings else {})}
    lingua_hf.check_import(lingua_hf.tensor_names(path), names.values(), ignored, _where(), path)
    with torch.device("meta"):
        model = Transformer(args)
    expected = model.state_dict()
    lingua_hf.check_filled(expected, names, _where(), path)
    tensors, origin = read_weights(path)
    state = {}
    for ours, theirs in names.items():
        if theirs not in tensors:
            raise ConfigError(f"{path}: weight {theirs} is missing from the safetensors files; the "
                              f"directory does not match its config.json.")
        t = tensors[theirs]
        if t.shape != expected[ours].shape:
            raise ConfigError(f"{origin[theirs]}: {theirs} has shape {tuple(t.shape)} but "
                              f"config.json implies {tuple(expected[ours].shape)}.")
        state[ours] = t if dtype is None else t.to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.init_rope("cpu")
    return model, args


def export(ckpt_dir: str, out_dir: str, dtype: Optional[torch.dtype] = None) -> None:
    """A training checkpoint (a run directory: its newest complete one) -> a HF directory."""
    from lingua.train.checkpoint import load_model_state, read_run_config

    ckpt_dir = resolve(ckpt_dir)
    model_cfg = OmegaConf.to_container(read_run_config(ckpt_dir).model, resolve=True)
    try:
        args = LlamaArgs(**model_cfg)
    except TypeError as e:
        raise ConfigError(f"{ckpt_dir}/config.yaml: its model section does not fit LlamaArgs "
                          f"({e}); export it with the app that trained it.") from None
    args.attn_backend = "sdpa"  # the export never runs attention; xformers would refuse on CPU
    lingua_hf.refuse_unexportable(export_problems(args), "python -m apps.llama.hf", ckpt_dir)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_rope("cpu")
    with warnings.catch_warnings():  # a single-process load is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_model_state(ckpt_dir, model)
    save_hf(model, args, out_dir, dtype)
    lingua_hf.write_tokenizer(read_run_config(ckpt_dir), out_dir)  # HF tools encode as we did


def main(argv=None) -> None:
    lingua_hf.export_cli(argv, "python -m apps.llama.hf", __doc__.split("\n")[0], export)


if __name__ == "__main__":
    main()
