"""Hugging Face interop for apps/qwen3_next: Qwen3NextForCausalLM directories (config.json +
safetensors) <-> Transformer, computing the same logits.

Names: the key table below (`LAYER_KEYS`, `DELTANET_KEYS`); the routed experts are stacked
[E, in, out] here and written per expert (`mlp.experts.{e}.gate_proj.weight`, the Hub layout;
transformers 5's fused gate_up_proj / down_proj also read).

Fused tensors: transformers' Gated DeltaNet projects q, k, v, z in one `in_proj_qkvz` and b, a in
one `in_proj_ba`, grouped by key head (for key head h: its q and k rows, then the v and z rows of
the value heads it serves), and convolves q, k, v in one depthwise `conv1d` (q, k, v channels in
that order). Ours keeps each separate and head-major (for a tensor-parallel split by head):
`fuse` / `unfuse` reorder the rows on the way out and back, nothing else changes.

Qwen's Hub checkpoints also hold a multi-token-prediction module (`mtp.*`); transformers'
Qwen3NextForCausalLM has none and drops it on load, and so does this import (NOT_IMPORTED).

CLI: python -m apps.qwen3_next.hf export <run_dir or checkpoint_dir> <out_dir> [--dtype bf16|fp32]
     python -m apps.qwen3_next.hf import <hf_dir>   (checks it and prints the model.* overrides
     that train from it with checkpoint.init_from=<hf_dir>)
"""

from dataclasses import fields
from pathlib import Path
from typing import Dict, List, Optional

import torch

from apps.qwen3_next.model import Qwen3NextArgs, Transformer, layer_is_full
from lingua.checkpoint import hf as lingua_hf
from lingua.checkpoint.hf_files import cast, layer_of
from lingua.errors import ConfigError

# Qwen3NextArgs fields with no config.json name, recorded there so load_hf gives back the same args.
LINGUA_FIELDS = ("aux_loss_coef", "z_loss_coef", "expert_impl", "linear_kernel", "multiple_of",
                 "ffn_dim_multiplier")

# Our module -> its HF name inside a decoder layer (tensors copied as they are).
LAYER_KEYS = {
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "moe.router.gate": "mlp.gate",
    "moe.shared_expert.w1": "mlp.shared_expert.gate_proj",
    "moe.shared_expert.w3": "mlp.shared_expert.up_proj",
    "moe.shared_expert.w2": "mlp.shared_expert.down_proj",
    "moe.shared_expert_gate": "mlp.shared_expert_gate",
}
ATTENTION_KEYS = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
}
DELTANET_KEYS = {   # parameters (no .weight suffix added)
    "linear_attention.A_log": "linear_attn.A_log",
    "linear_attention.dt_bias": "linear_attn.dt_bias",
    "linear_attention.norm.weight": "linear_attn.norm.weight",
    "linear_attention.out_proj.weight": "linear_attn.out_proj.weight",
}
# HF fused tensor -> the tensors of ours it is made of, in its row order (per key-head group).
FUSED = {
    "linear_attn.in_proj_qkvz.weight": ("wq", "wk", "wv", "wz"),
    "linear_attn.in_proj_ba.weight": ("wb", "wa"),
    "linear_attn.conv1d.weight": ("q_conv", "k_conv", "v_conv"),
}
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

NOT_EXPORTED: Dict[str, str] = {
    r"layers\.\d+\.moe\.router\.expert_bias": "the selection bias of lingua's router, always "
    "zero here (Qwen3-Next routes by its softmax scores alone)",
}
NOT_IMPORTED: Dict[str, str] = {
    r"model\.rotary_emb\.inv_freq": "RoPE inverse frequencies, recomputed from the config",
    r"mtp\..*": "Qwen's multi-token-prediction module, which transformers' Qwen3NextForCausalLM "
    "does not run either",
}


def _where() -> str:
    return f"LAYER_KEYS / ATTENTION_KEYS / DELTANET_KEYS / FUSED in {lingua_hf.app_file(__file__)}"


def key_map(args: Qwen3NextArgs) -> Dict[str, str]:
    """Our key -> HF key for every tensor copied under a new name (not the fused projections
    and convolution, not the stacked experts)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        table = dict(LAYER_KEYS)
        if not args.shared_expert_hidden_dim:
            table = {o: t for o, t in table.items() if "shared" not in o}
        if layer_is_full(args, i):
            table.update(ATTENTION_KEYS)
        names.update({f"{ours}{o}.weight": f"{theirs}{t}.weight" for o, t in table.items()})
        if not layer_is_full(args, i):
            names.update({f"{ours}{o}": f"{theirs}{t}" for o, t in DELTANET_KEYS.items()})
    return names


def _group_rows(args: Qwen3NextArgs, part: str) -> int:
    """Rows of `part` (one of ours fused) per key-head group."""
    r = args.linear_value_heads // args.linear_key_heads
    key, value = args.linear_key_head_dim, r * args.linear_value_head_dim
    return {"wq": key, "wk": key, "wv": value, "wz": value, "wb": r, "wa": r}[part]


def fuse(name: str, parts: List[torch.Tensor], args: Qwen3NextArgs) -> torch.Tensor:
    """HF's fused tensor `name` (a FUSED key) from ours, in FUSED's order."""
    if name.endswith("conv1d.weight"):   # channels q, k, v, each head-major already
        return torch.cat(parts)
    groups = args.linear_key_heads
    grouped = [p.reshape(groups, -1, p.shape[-1]) for p in parts]
    return torch.cat(grouped, dim=1).reshape(-1, parts[0].shape[-1])


def unfuse(name: str, t: torch.Tensor, args: Qwen3NextArgs) -> List[torch.Tensor]:
    """fuse's inverse: our tensors, in FUSED's order."""
    ours = FUSED[name]
    if name.endswith("conv1d.weight"):
        key = args.linear_key_heads * args.linear_key_head_dim
        return list(t.split([key, key, t.shape[0] - 2 * key]))
    rows = [_group_rows(args, p) for p in ours]
    split = t.reshape(args.linear_key_heads, sum(rows), t.shape[-1]).split(rows, dim=1)
    return [s.reshape(-1, t.shape[-1]) for s in split]


def _fused_ours(args: Qwen3NextArgs, i: int, name: str) -> List[str]:
    return [f"layers.{i}.linear_attention.{p}.weight" for p in FUSED[name]]


def hf_config(args: Qwen3NextArgs, dtype: torch.dtype) -> dict:
    every = args.full_attention_every
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": args.dim, "num_hidden_layers": args.n_layers,
        # the dense MLP of mlp_only_layers, which this model has none of
        "intermediate_size": args.shared_expert_hidden_dim or args.expert_hidden_dim,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": args.head_dim or args.dim // args.n_heads,
        "partial_rotary_factor": args.partial_rotary_factor, "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "layer_types": ["full_attention" if layer_is_full(args, i) else "linear_attention"
                        for i in range(args.n_layers)],
        "full_attention_interval": every,
        "linear_conv_kernel_dim": args.linear_conv_kernel,
        "linear_key_head_dim": args.linear_key_head_dim,
        "linear_value_head_dim": args.linear_value_head_dim,
        "linear_num_key_heads": args.linear_key_heads,
        "linear_num_value_heads": args.linear_value_heads,
        "num_experts": args.n_experts, "num_experts_per_tok": args.top_k,
        "moe_intermediate_size": args.expert_hidden_dim,
        "shared_expert_intermediate_size": args.shared_expert_hidden_dim,
        "norm_topk_prob": args.norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "router_aux_loss_coef": args.aux_loss_coef,
        "vocab_size": args.vocab_size, "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "attention_bias": False, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "initializer_range": args.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "lingua_qwen3_next": {k: getattr(args, k) for k in LINGUA_FIELDS},
    }


def export_problems(args: Qwen3NextArgs) -> List[str]:
    """Why the export would refuse a model trained with `args`, each with its fix."""
    if not args.shared_expert_hidden_dim:
        return ["model.shared_expert_hidden_dim=0 (Qwen3NextForCausalLM always has a gated "
                "shared expert): train with a positive model.shared_expert_hidden_dim"]
    return []


def to_hf(state, args: Qwen3NextArgs, dtype: Optional[torch.dtype], layer: Optional[int]) -> dict:
    """Layer `layer`'s tensors under Qwen3-Next's names (None: embeddings, final norm, head)."""
    out = {theirs: cast(state[ours], dtype) for ours, theirs in key_map(args).items()
           if layer_of(ours) == layer}
    if layer is None:
        return out
    theirs = f"model.layers.{layer}."
    if not layer_is_full(args, layer):
        for name in FUSED:
            parts = [cast(state[k], dtype) for k in _fused_ours(args, layer, name)]
            out[theirs + name] = fuse(name, parts, args)
    for w, name in EXPERT_NAMES.items():
        stacked = cast(state[f"layers.{layer}.moe.experts.{w}"], dtype)   # [E, in, out]
        for e in range(stacked.shape[0]):                                   # HF Linear: [out, in]
            out[f"{theirs}mlp.experts.{e}.{name}.weight"] = stacked[e].t()
    return out


def save_hf(model: Transformer, model_args: Qwen3NextArgs, path,
            dtype: Optional[torch.dtype] = None) -> None:
    """Write `path/config.json` and the safetensors files (Qwen3NextForCausalLM)."""
    lingua_hf.refuse_unexportable(export_problems(model_args), lingua_hf.command(__file__), path)
    lingua_hf.save_hf(model, model_args, path, dtype, to_hf=to_hf, hf_config=hf_config,
                      not_exported=NOT_EXPORTED, where=_where())


# ---------------------------------------------------------------------------------------------
# Import


def _every(cfg: dict, n_layers: int) -> Optional[int]:
    """full_attention_every from layer_types (or full_attention_interval); None if the pattern is
    not 'every k-th layer is full attention'."""
    types = cfg.get("layer_types")
    if not types:
        return int(cfg.get("full_attention_interval", 4))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else n_layers + 1
    expected = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(n_layers)]
    return every if list(types) == expected else None


def _unsupported(cfg: dict) -> List[str]:
    bad = lingua_hf.decoder_problems(cfg)
    if cfg.get("attention_bias"):
        bad.append("attention_bias=true")
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        bad.append(f"mlp_only_layers={cfg.get('mlp_only_layers')}, decoder_sparse_step="
                   f"{cfg.get('decoder_sparse_step')} (dense layers: every layer of this app's "
                   "model is an MoE)")
    if not cfg.get("num_experts") or not cfg.get("shared_expert_intermediate_size"):
        bad.append("num_experts or shared_expert_intermediate_size 0 (this app's model has routed "
                   "experts and a gated shared expert in every layer)")
    if _every(cfg, cfg["num_hidden_layers"]) is None:
        bad.append(f"layer_types={cfg['layer_types']} (this app's pattern is every k-th layer "
                   "full attention: model.full_attention_every)")
    return bad


def args_from_hf_config(config_path) -> Qwen3NextArgs:
    cfg = lingua_hf.read_config(config_path)
    if cfg.get("model_type") != "qwen3_next":
        raise ConfigError(f"{config_path}: model_type {cfg.get('model_type')!r} is not "
                          "'qwen3_next'; apps.qwen3_next reads Qwen3NextForCausalLM directories.")
    try:
        bad = _unsupported(cfg)
        if bad:
            raise ConfigError(f"{config_path}: {'; '.join(bad)}: not supported by "
                              "apps.qwen3_next.")
        rope = cfg.get("rope_parameters") or {}
        fields_ = dict(
            **lingua_hf.decoder_args(cfg, config_path),
            full_attention_every=_every(cfg, cfg["num_hidden_layers"]),
            partial_rotary_factor=float(cfg.get("partial_rotary_factor",
                                                rope.get("partial_rotary_factor", 0.25))),
            linear_key_heads=cfg["linear_num_key_heads"],
            linear_value_heads=cfg["linear_num_value_heads"],
            linear_key_head_dim=cfg["linear_key_head_dim"],
            linear_value_head_dim=cfg["linear_value_head_dim"],
            linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
            n_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
            expert_hidden_dim=cfg["moe_intermediate_size"],
            shared_expert_hidden_dim=cfg["shared_expert_intermediate_size"],
            norm_topk=bool(cfg.get("norm_topk_prob", True)))
    except KeyError as e:
        raise ConfigError(f"{config_path} lacks {e}; it is not a complete Qwen3Next config.") \
            from None
    if fields_["rope_scaling"]:
        raise ConfigError(f"{config_path}: rope scaling {cfg.get('rope_scaling')} is not "
                          "supported by apps.qwen3_next (plain partial RoPE only).")
    hint = cfg.get("lingua_qwen3_next") or {}
    known = {f.name for f in fields(Qwen3NextArgs)}
    fields_.update({k: v for k, v in hint.items() if k in LINGUA_FIELDS and k in known})
    args = Qwen3NextArgs(**fields_)
    if "expert_impl" not in hint and (args.dim % 8 or args.expert_hidden_dim % 8):
        args.expert_impl = "loop"   # torch._grouped_mm needs 16-byte aligned rows
    return args


def load_hf(path, dtype: Optional[torch.dtype] = torch.float32):
    """(Transformer on CPU, Qwen3NextArgs) from a Qwen3NextForCausalLM directory; dtype None
    keeps the file's."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path} is missing: {path} is not a Hugging Face model "
                          "directory.")
    args, file_names = args_from_hf_config(config_path), lingua_hf.tensor_names(path)
    names = key_map(args)
    linear = [i for i in range(args.n_layers) if not layer_is_full(args, i)]
    consumed = set(names.values()) | {f"model.layers.{i}.{n}" for i in linear for n in FUSED}
    consumed |= {k for k in file_names for i in range(args.n_layers)
                 if k.startswith(f"model.layers.{i}.mlp.experts.")}
    ignored = {**NOT_IMPORTED, **(lingua_hf.TIED_NOT_IMPORTED if args.tie_embeddings else {})}
    lingua_hf.check_import(file_names, consumed, ignored, _where(), path)
    tensors, origin = lingua_hf.read_weights(path)
    state = {ours: lingua_hf.weight(tensors, theirs, path) for ours, theirs in names.items()}
    sources = dict(names)
    for i in linear:
        for name in FUSED:
            theirs = f"model.layers.{i}.{name}"
            parts = unfuse(name, lingua_hf.weight(tensors, theirs, path), args)
            for ours, t in zip(_fused_ours(args, i, name), parts):
                state[ours], sources[ours] = t, theirs
    for i in range(args.n_layers):
        experts = lingua_hf.stacked_experts(tensors, f"model.layers.{i}.mlp.experts",
                                            args.n_experts, EXPERT_NAMES, path)
        for w, (t, source) in experts.items():
            state[f"layers.{i}.moe.experts.{w}"], sources[f"layers.{i}.moe.experts.{w}"] = t, source
        state[f"layers.{i}.moe.router.expert_bias"] = torch.zeros(args.n_experts)
    with torch.device("meta"):
        model = Transformer(args)
    lingua_hf.check_filled(model.state_dict(), state, _where(), path)
    return lingua_hf.assign(model, state, dtype, sources=sources, origin=origin, path=path), args


# ---------------------------------------------------------------------------------------------
# CLI


def export(ckpt_dir, out_dir, dtype: Optional[torch.dtype] = None) -> None:
    lingua_hf.export(ckpt_dir, out_dir, dtype, model_class=Transformer, args_class=Qwen3NextArgs,
                     export_problems=export_problems, to_hf=to_hf, hf_config=hf_config,
                     not_exported=NOT_EXPORTED, where=_where(),
                     command=lingua_hf.command(__file__))


def main(argv=None) -> None:
    lingua_hf.export_cli(argv, lingua_hf.command(__file__), __doc__.split("\n")[0], export,
                         load_hf=load_hf)


if __name__ == "__main__":
    main()
