"""Hugging Face interop shared by the apps: names, config fields and files of a LLaMA-style
decoder built from lingua.transformer's blocks (attention, SwiGLU, RMSNorm, RoPE).

An app's hf.py (apps/llama/hf.py for LlamaForCausalLM, apps/moe/hf.py for Mixtral and GLM-4.5
MoE) adds only what its architecture has on top.
"""

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from safetensors.torch import load_file

from lingua.errors import ConfigError
from lingua.transformer import TransformerArgs, ffn_hidden_dim

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def key_map(args: TransformerArgs) -> Dict[str, str]:
    """Our state_dict key -> HF key."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
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


def llama_hf_config(args: TransformerArgs, dtype: torch.dtype) -> dict:
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {
            "rope_type": "llama3", "factor": args.rope_scale_factor,
            "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
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
        "lingua_ffn": {"multiple_of": args.multiple_of, "ffn_dim_multiplier": args.ffn_dim_multiplier},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def rope_args(cfg: dict, config_path: Path) -> dict:
    # transformers < 5 writes rope_theta + rope_scaling; 5.x writes rope_parameters (with the theta inside).
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": False}
    if kind != "llama3":
        raise ConfigError(f"{config_path}: rope type {kind!r} is not supported; this model implements "
                          "plain RoPE and Llama 3.1 ('llama3') scaling only.")
    return {
        "rope_theta": float(theta), "rope_scaling": True,
        "rope_scale_factor": float(params["factor"]),
        "rope_low_freq_factor": float(params["low_freq_factor"]),
        "rope_high_freq_factor": float(params["high_freq_factor"]),
        "rope_original_max_seq_len": int(params["original_max_position_embeddings"]),
    }


def ffn_recipe(dim: int, hidden: int, hint: Optional[dict] = None) -> Tuple[int, Optional[float]]:
    """(multiple_of, ffn_dim_multiplier) giving SwiGLU width `hidden` under Meta's recipe.

    Prefer the values our own export recorded (`hint`), then those Meta's configs use (our default
    256; Llama 3's 1024 with 1.3; Llama 3.2's 256 with 1.5), so the args read back equal the ones
    the model was trained with; otherwise multiple_of = hidden rounds any smaller width up to
    exactly `hidden`.
    """
    recorded = [(hint.get("multiple_of"), hint.get("ffn_dim_multiplier"))] if isinstance(hint, dict) else []
    for multiple_of, mult in recorded + [(256, None), (1024, None), (1024, 1.3), (256, 1.5), (256, 1.3), (4096, 1.3)]:
        if isinstance(multiple_of, int) and multiple_of > 0 and ffn_hidden_dim(dim, multiple_of, mult) == hidden:
            return multiple_of, mult
    base = int(2 * 4 * dim / 3)
    return hidden, (None if hidden >= base else hidden / base)


def read_weights(path: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, Path]]:
    """All tensors of the directory, and the file each came from (for error messages)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"No weights in {path}: expected model.safetensors (or shards listed in "
                          "model.safetensors.index.json). Only safetensors files are read.")
    tensors, origin = {}, {}
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{f} is listed in {index} but missing; copy the complete model directory.")
        for k, t in load_file(str(f)).items():  # safetensors holds raw tensors only: no pickle
            tensors[k], origin[k] = t, f
    return tensors, origin
