"""Hugging Face interop for apps/deepseek: DeepseekV3ForCausalLM directories (config.json +
safetensors) <-> Transformer, computing the same logits.

Names: the key table below (`LAYER_KEYS`, `MTP_KEYS`); the routed experts are stacked [E, in, out]
here and written per expert (`mlp.experts.{e}.gate_proj.weight`, the Hub layout; transformers
5's fused gate_up_proj / down_proj also read). The MTP modules are written as DeepSeek-V3's
checkpoint holds them, as layers n_layers.. with embed_tokens / enorm / hnorm / eh_proj /
shared_head (transformers' model ignores them; shared_head.head is the main lm_head, checked equal
on import).

RoPE: DeepSeek's checkpoints rotate interleaved channel pairs (rope_interleave=true); ours rotate
halves (lingua.model.layers). The rope rows of the query and of kv_a_proj_with_mqa are permuted on
the way out and back, which leaves every attention score unchanged.

CLI: python -m apps.deepseek.hf export <run_dir or checkpoint_dir> <out_dir> [--dtype bf16|fp32]
     python -m apps.deepseek.hf import <hf_dir>   (checks it and prints the model section that
     checkpoint.init_from=<hf_dir> sets by itself)
"""

from dataclasses import fields
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from apps.deepseek.model import DeepSeekArgs, Transformer, dense_hidden
from lingua.checkpoint import hf as lingua_hf
from lingua.checkpoint.hf_files import cast, layer_of
from lingua.errors import ConfigError

# DeepSeekArgs fields that only matter for training or are recipes of a width; recorded in
# config.json so that load_hf gives back the same args.
LINGUA_FIELDS = ("bias_update_rate", "aux_loss_coef", "z_loss_coef", "expert_impl",
                 "mtp_loss_weight", "dense_hidden_dim", "multiple_of", "ffn_dim_multiplier",
                 "rope_scale_factor", "rope_original_max_seq_len")

# Our module -> its HF name inside a decoder layer (and an MTP layer's block).
LAYER_KEYS = {
    "attention.wq": "self_attn.q_proj", "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_norm": "self_attn.q_a_layernorm", "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_norm": "self_attn.kv_a_layernorm", "attention.wkv_b": "self_attn.kv_b_proj",
    "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "moe.router.gate": "mlp.gate",
    "moe.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "moe.shared_experts.w3": "mlp.shared_experts.up_proj",
    "moe.shared_experts.w2": "mlp.shared_experts.down_proj",
}
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
MTP_KEYS = {"embed": "embed_tokens", "enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
            "head_norm": "shared_head.norm"}

NOT_EXPORTED: Dict[str, str] = {}   # every tensor has its DeepSeek-V3 name
NOT_IMPORTED: Dict[str, str] = {
    r"model\.rotary_emb\.inv_freq": "RoPE inverse frequencies, recomputed from the config",
}


def _where() -> str:
    return f"LAYER_KEYS / MTP_KEYS in {lingua_hf.app_file(__file__)}"


def _block_keys(ours: str, theirs: str, args: DeepSeekArgs, layer_id: int) -> Dict[str, str]:
    """One block's our key -> HF key: its query path (wq, or the latent's wq_a, q_norm, wq_b)
    and its FFN (dense before n_dense_layers, else the router and any shared experts), from the
    args alone (an export calls this per layer; building the model to list its keys cost 0.8 s
    a call at 671B)."""
    query = ["attention.wq"] if args.q_lora_rank is None else [
        "attention.wq_a", "attention.q_norm", "attention.wq_b"]
    modules = [*query, "attention.wkv_a", "attention.kv_norm", "attention.wkv_b",
               "attention.wo", "attention_norm", "ffn_norm"]
    moe = layer_id >= args.n_dense_layers
    if not moe:
        modules += ["feed_forward.w1", "feed_forward.w3", "feed_forward.w2"]
    else:
        modules.append("moe.router.gate")
        if args.n_shared_experts:
            modules += ["moe.shared_experts.w1", "moe.shared_experts.w3", "moe.shared_experts.w2"]
    names = {f"{ours}{o}.weight": f"{theirs}{LAYER_KEYS[o]}.weight" for o in modules}
    if moe:
        names[f"{ours}moe.router.expert_bias"] = f"{theirs}mlp.gate.e_score_correction_bias"
    return names


def key_map(args: DeepSeekArgs) -> Dict[str, str]:
    """Our key -> HF key for every tensor copied under a new name (not the stacked experts)."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        names.update(_block_keys(f"layers.{i}.", f"model.layers.{i}.", args, i))
    for k in range(args.mtp_depth):
        ours, theirs = f"mtp.{k}.", f"model.layers.{args.n_layers + k}."
        names.update({f"{ours}{o}.weight": f"{theirs}{t}.weight" for o, t in MTP_KEYS.items()})
        names.update(_block_keys(f"{ours}block.", theirs, args, args.n_layers + k))
    return names


def _rope_rows(args: DeepSeekArgs, rows: int, interleave: bool) -> torch.Tensor:
    """Row order that takes a projection whose last qk_rope_head_dim rows (of each `rows`-row
    head) are in half layout to interleaved pairs (interleave=True), or back."""
    d = args.qk_rope_head_dim
    to_pairs = torch.stack([torch.arange(d // 2), torch.arange(d // 2) + d // 2], 1).flatten()
    rope = to_pairs if interleave else torch.argsort(to_pairs)
    return torch.cat([torch.arange(rows - d), rows - d + rope])


def permute_rope(name: str, t: torch.Tensor, args: DeepSeekArgs, interleave: bool):
    """The query's and kv_a_proj_with_mqa's rope rows between our layout and DeepSeek's."""
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        head = args.qk_nope_head_dim + args.qk_rope_head_dim
        order = _rope_rows(args, head, interleave)
        return t.view(-1, head, t.shape[-1])[:, order].reshape(t.shape)
    if name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
        return t[_rope_rows(args, t.shape[0], interleave)]
    return t


def hf_config(args: DeepSeekArgs, dtype: torch.dtype) -> dict:
    rope_scaling = None
    if args.yarn:
        rope_scaling = {"type": "yarn", "rope_type": "yarn", "factor": args.rope_scale_factor,
                        "original_max_position_embeddings": args.rope_original_max_seq_len,
                        "beta_fast": args.yarn_beta_fast, "beta_slow": args.yarn_beta_slow,
                        "mscale": args.yarn_mscale, "mscale_all_dim": args.yarn_mscale_all_dim}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": args.dim, "intermediate_size": dense_hidden(args),
        "moe_intermediate_size": args.expert_hidden_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_heads,
        "q_lora_rank": args.q_lora_rank, "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim, "head_dim": args.qk_rope_head_dim,
        "n_routed_experts": args.n_experts, "num_experts_per_tok": args.top_k,
        "n_shared_experts": args.n_shared_experts, "first_k_dense_replace": args.n_dense_layers,
        "n_group": args.n_groups, "topk_group": args.topk_groups,
        "norm_topk_prob": args.norm_topk, "routed_scaling_factor": args.route_scale,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": args.mtp_depth, "vocab_size": args.vocab_size,
        "hidden_act": "silu", "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling, "rope_interleave": True, "attention_bias": False,
        "max_position_embeddings": args.max_seq_len, "tie_word_embeddings": False,
        "initializer_range": args.init_std, "torch_dtype": str(dtype).removeprefix("torch."),
        "lingua_deepseek": {k: getattr(args, k) for k in LINGUA_FIELDS},
    }


def export_problems(args: DeepSeekArgs) -> List[str]:
    """Why the export would refuse a model trained with `args`, each with its fix."""
    if args.tie_embeddings:
        return ["model.tie_embeddings=true (DeepSeek-V3 has a separate lm_head): train with "
                "model.tie_embeddings=false"]
    return []


def to_hf(state, args: DeepSeekArgs, dtype: Optional[torch.dtype], layer: Optional[int]) -> dict:
    """Layer `layer`'s tensors under DeepSeek-V3's names (None: embeddings, norm, head and the
    MTP modules)."""
    names = {o: t for o, t in key_map(args).items() if layer_of(o) == layer}
    out = {}
    for ours, theirs in names.items():
        fp32 = ours.endswith("expert_bias")   # HF keeps it fp32: it decides the routing
        out[theirs] = permute_rope(theirs, cast(state[ours], torch.float32 if fp32 else dtype),
                                   args, interleave=True)
    blocks = [(f"layers.{layer}.", f"model.layers.{layer}.")] if layer is not None else [
        (f"mtp.{k}.block.", f"model.layers.{args.n_layers + k}.") for k in range(args.mtp_depth)]
    for ours, theirs in blocks:
        if f"{ours}moe.experts.w1" not in state:
            continue
        for w, name in EXPERT_NAMES.items():
            stacked = cast(state[f"{ours}moe.experts.{w}"], dtype)   # [E, in, out]
            for e in range(stacked.shape[0]):                         # HF Linear is [out, in]
                out[f"{theirs}mlp.experts.{e}.{name}.weight"] = stacked[e].t()
    if layer is None:
        for k in range(args.mtp_depth):   # DeepSeek stores the shared head with each module
            out[f"model.layers.{args.n_layers + k}.shared_head.head.weight"] = cast(
                state["output.weight"], dtype).clone()   # safetensors refuses shared storage
    return out


def save_hf(model: Transformer, model_args: DeepSeekArgs, path,
            dtype: Optional[torch.dtype] = None) -> None:
    """Write `path/config.json` and the safetensors files (DeepseekV3ForCausalLM)."""
    lingua_hf.refuse_unexportable(export_problems(model_args), lingua_hf.command(__file__), path)
    lingua_hf.save_hf(model, model_args, path, dtype, to_hf=to_hf, hf_config=hf_config,
                      not_exported=NOT_EXPORTED, where=_where())


# ---------------------------------------------------------------------------------------------
# Import


def _rope_fields(cfg: dict, config_path) -> dict:
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta, "yarn": False}
    if kind != "yarn" or params.get("attention_factor") is not None or \
            params.get("truncate", True) is False:
        raise ConfigError(f"{config_path}: rope {params} is not supported; apps.deepseek "
                          "implements plain RoPE and YaRN (rope_type yarn, without "
                          "attention_factor or truncate=false).")
    return {"rope_theta": theta, "yarn": True, "rope_scale_factor": float(params["factor"]),
            "rope_original_max_seq_len": int(params["original_max_position_embeddings"]),
            "yarn_beta_fast": float(params.get("beta_fast") or 32),
            "yarn_beta_slow": float(params.get("beta_slow") or 1),
            "yarn_mscale": float(params.get("mscale") or 0.0),
            "yarn_mscale_all_dim": float(params.get("mscale_all_dim") or 0.0)}


def _unsupported(cfg: dict) -> List[str]:
    bad = []
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={cfg['hidden_act']}")
    if cfg.get("attention_bias"):
        bad.append("attention_bias=true")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        bad.append(f"scoring_func={cfg['scoring_func']} (DeepSeek-V3 routes by sigmoid scores)")
    n_heads = cfg["num_attention_heads"]
    if cfg.get("num_key_value_heads", n_heads) != n_heads:
        bad.append(f"num_key_value_heads={cfg['num_key_value_heads']} != num_attention_heads")
    return bad


def args_from_hf_config(config_path) -> DeepSeekArgs:
    cfg = lingua_hf.read_config(config_path)
    if cfg.get("model_type") != "deepseek_v3":
        raise ConfigError(f"{config_path}: model_type {cfg.get('model_type')!r} is not "
                          "'deepseek_v3'; apps.deepseek reads DeepseekV3ForCausalLM directories.")
    try:
        bad = _unsupported(cfg)
        if bad:
            raise ConfigError(f"{config_path}: {'; '.join(bad)}: not supported by apps.deepseek.")
        fields_ = dict(
            dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"], vocab_size=cfg["vocab_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            init_std=cfg.get("initializer_range", 0.02), **_rope_fields(cfg, config_path),
            q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
            qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
            v_head_dim=cfg["v_head_dim"], dense_hidden_dim=cfg["intermediate_size"],
            n_dense_layers=min(cfg.get("first_k_dense_replace", 0), cfg["num_hidden_layers"]),
            n_experts=cfg["n_routed_experts"], top_k=cfg["num_experts_per_tok"],
            n_shared_experts=cfg.get("n_shared_experts") or 0,
            expert_hidden_dim=cfg["moe_intermediate_size"],
            n_groups=cfg.get("n_group") or 1, topk_groups=cfg.get("topk_group") or 1,
            norm_topk=bool(cfg.get("norm_topk_prob", True)),
            route_scale=float(cfg.get("routed_scaling_factor", 1.0)),
            mtp_depth=cfg.get("num_nextn_predict_layers", 0))
    except KeyError as e:
        raise ConfigError(f"{config_path} lacks {e}; it is not a complete DeepseekV3 config.") \
            from None
    hint = cfg.get("lingua_deepseek") or {}
    known = {f.name for f in fields(DeepSeekArgs)}
    fields_.update({k: v for k, v in hint.items() if k in LINGUA_FIELDS and k in known})
    args = DeepSeekArgs(**fields_)
    if dense_hidden(args) != cfg["intermediate_size"]:   # a recorded recipe that does not fit
        args.dense_hidden_dim = cfg["intermediate_size"]
    if "expert_impl" not in hint and (args.dim % 8 or args.expert_hidden_dim % 8):
        args.expert_impl = "loop"   # torch._grouped_mm needs 16-byte aligned rows
    return args


def args_from_hf_dir(config_path) -> DeepSeekArgs:
    """The directory's args: its config.json's, with mtp_depth 0 where its safetensors hold no MTP
    layer (transformers' save_pretrained drops the ones num_nextn_predict_layers counts)."""
    args = args_from_hf_config(config_path)
    names = lingua_hf.tensor_names(Path(config_path).parent)
    if f"model.layers.{args.n_layers}.eh_proj.weight" not in names:
        args.mtp_depth = 0
    return args


def _expert_blocks(args: DeepSeekArgs) -> List[Tuple[str, str]]:
    """(our prefix, HF prefix) of every MoE block."""
    blocks = [(f"layers.{i}.", f"model.layers.{i}.") for i in range(args.n_dense_layers,
                                                                     args.n_layers)]
    return blocks + [(f"mtp.{k}.block.", f"model.layers.{args.n_layers + k}.")
                     for k in range(args.mtp_depth)]


def load_hf(path, dtype: Optional[torch.dtype] = torch.float32):
    """(Transformer on CPU, DeepSeekArgs) from a DeepseekV3ForCausalLM directory; dtype None keeps
    the file's; the routers' expert_bias stays fp32."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path} is missing: {path} is not a Hugging Face model "
                          "directory.")
    args, file_names = args_from_hf_dir(config_path), lingua_hf.tensor_names(path)
    names = key_map(args)
    consumed = set(names.values())
    for _, theirs in _expert_blocks(args):
        consumed |= {k for k in file_names if k.startswith(f"{theirs}mlp.experts.")}
    consumed |= {f"model.layers.{args.n_layers + k}.shared_head.head.weight"
                 for k in range(args.mtp_depth)}
    lingua_hf.check_import(file_names, consumed, NOT_IMPORTED, _where(), path)
    tensors, origin = lingua_hf.read_weights(path)
    interleaved = lingua_hf.read_config(config_path).get("rope_interleave", True)
    state, sources = {}, dict(names)
    for ours, theirs in names.items():
        t = lingua_hf.weight(tensors, theirs, path)
        state[ours] = permute_rope(theirs, t, args, interleave=False) if interleaved else t
    for ours, theirs in _expert_blocks(args):
        experts = lingua_hf.stacked_experts(tensors, f"{theirs}mlp.experts", args.n_experts,
                                            EXPERT_NAMES, path)
        for w, (t, source) in experts.items():
            state[f"{ours}moe.experts.{w}"], sources[f"{ours}moe.experts.{w}"] = t, source
    for k in range(args.mtp_depth):
        head = f"model.layers.{args.n_layers + k}.shared_head.head.weight"
        if head in tensors and not torch.equal(tensors[head], state["output.weight"]):
            raise ConfigError(f"{origin[head]}: {head} differs from lm_head.weight; "
                              "apps.deepseek's MTP modules share the main output projection, as "
                              "DeepSeek-V3's do.")
    with torch.device("meta"):
        model = Transformer(args)
    lingua_hf.check_filled(model.state_dict(), state, _where(), path)
    return lingua_hf.assign(model, state, dtype, sources=sources, origin=origin, path=path), args


# ---------------------------------------------------------------------------------------------
# CLI


def export(ckpt_dir, out_dir, dtype: Optional[torch.dtype] = None) -> None:
    args = lingua_hf.export(ckpt_dir, out_dir, dtype, model_class=Transformer,
                            args_class=DeepSeekArgs, export_problems=export_problems, to_hf=to_hf,
                            hf_config=hf_config, not_exported=NOT_EXPORTED, where=_where(),
                            command=lingua_hf.command(__file__))
    if args.mtp_depth:   # said before transformers' load report lists them as UNEXPECTED
        layers = ", ".join(f"model.layers.{args.n_layers + k}.*" for k in range(args.mtp_depth))
        print(f"note: {layers}: the MTP modules, written as DeepSeek-V3's checkpoint holds "
              f"them; transformers' DeepseekV3ForCausalLM does not use them and "
              f"lists them as UNEXPECTED when it loads {out_dir}: expected, nothing is wrong. "
              f"`python -m apps.deepseek.hf import` and checkpoint.init_from read them back.")


def main(argv=None) -> None:
    lingua_hf.export_cli(argv, lingua_hf.command(__file__), __doc__.split("\n")[0], export,
                         load_hf=load_hf)


if __name__ == "__main__":
    main()
