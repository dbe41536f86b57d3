"""Hugging Face interop for the MoE model: config.json + safetensors directories <-> Transformer.

Four Hugging Face architectures, chosen from the model args on export and from config.json's
`model_type` on import; each computes exactly what our model computes:

* MixtralForCausalLM ("mixtral"): softmax over all experts, top-k, the top-k weights renormalised
  to sum to 1. So it needs score_func=softmax, norm_topk=True, route_scale=1, no shared experts,
  no dense layers and a zero expert_bias. Its sliding_window is our model.window.
* Qwen3MoeForCausalLM ("qwen3_moe", Qwen3-30B-A3B, Qwen3-235B-A22B) for softmax models with
  QK-norm (model.qk_norm, which its attention always has): fp32 softmax over all experts, top-k,
  renormalised when norm_topk_prob, no shared expert, dense layers by mlp_only_layers and
  decoder_sparse_step (ours: the first n_dense_layers), head_dim free. Its attention_bias would
  bias o_proj too, and its sliding window is not read: both are refused.
* Qwen2MoeForCausalLM ("qwen2_moe", Qwen1.5-MoE / Qwen2-MoE) for the other softmax models (the
  debug preset's): softmax top-k with optional renormalisation (norm_topk_prob), a shared expert
  of width n_shared * expert width, the first layers dense (mlp_only_layers), no routed scaling
  and no selection bias. Its shared expert is gated, sigmoid(shared_expert_gate . x); ours is
  not, so the export writes a zero gate (sigmoid(0) = 1/2 for every token) and doubles the shared
  down projection: both are exact in floating point (powers of two), and the import undoes it,
  refusing a learned (non-zero) gate. Its qkv_bias (Qwen's default: q/k/v biases) is
  model.qkv_bias; its sliding windows (some layers only) are refused.
* Glm4MoeForCausalLM ("glm4_moe", GLM-4.5) for the DeepSeek-V3 router: sigmoid scores,
  `e_score_correction_bias` used only to choose the experts, optional renormalisation
  (norm_topk_prob), routed_scaling_factor, shared experts of width n_shared * expert width, the
  first `first_k_dense_replace` layers dense. DeepseekV3ForCausalLM has the same router but
  multi-head latent attention, which our model lacks; Dots1 has it too but always applies q/k
  RMSNorm; Qwen2-MoE gates its shared expert with a learned sigmoid. Glm4Moe's attention is ours
  (GQA, rotate_half RoPE; attention_bias is model.qkv_bias, use_qk_norm model.qk_norm) once
  partial_rotary_factor=1 (its default rotates half of each head), and its group-limited routing
  is plain top-k when every group is kept (n_group == topk_group, e.g. both 1).

Hugging Face models route every token (dropless): a model trained with capacity_factor > 0 is
exported as is and reads back with capacity_factor=0, which is what the HF model computes.
The plumbing (checks that nothing is dropped, reading and writing the files, the export command)
is lingua/checkpoint/hf.py's; this file holds what is MoE's.

CLI: python -m apps.moe.hf export <run_dir or checkpoint_dir> <out_dir> [--dtype bf16|fp32]
(a run directory: its newest complete checkpoint). `export_problems(model_args)` says from the
args alone why the export would refuse a model; apps/moe/train.py warns with it at start.
"""

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from apps.moe.model import MoEArgs, Transformer, expert_hidden
from lingua.checkpoint import hf as lingua_hf
from lingua.checkpoint.hf import (
    TIED_NOT_IMPORTED,
    ffn_recipe,
    read_weights,
    stacked_experts,
    weight,
)
from lingua.checkpoint.hf_files import cast, layer_of
from lingua.errors import ConfigError
from lingua.model.layers import ffn_hidden_dim

# MoEArgs fields that only matter for training; recorded so that load_hf gives back the same args.
TRAINING_FIELDS = ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "expert_impl")


@dataclass(frozen=True)
class Layout:
    arch: str
    block: str                # the MoE module's name inside a HF decoder layer
    proj: Dict[str, str]      # our expert weight -> HF per-expert Linear name


LAYOUTS = {
    "mixtral": Layout(
        "MixtralForCausalLM", "block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}
    ),
    "glm4_moe": Layout(
        "Glm4MoeForCausalLM", "mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    ),
    "qwen2_moe": Layout(
        "Qwen2MoeForCausalLM", "mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    ),
    "qwen3_moe": Layout(
        "Qwen3MoeForCausalLM", "mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    ),
}
# The layouts with shared experts: their module's name in a decoder layer's "mlp".
SHARED = {"qwen2_moe": "shared_expert", "glm4_moe": "shared_experts"}
# The attention options (AttentionArgs) each layout's attention computes; the others are refused.
ATTENTION_OPTIONS = {"mixtral": ("window",), "qwen2_moe": ("qkv_bias",),
                     "qwen3_moe": ("qk_norm",), "glm4_moe": ("qk_norm", "qkv_bias")}
ATTENTION_WHAT = {"qk_norm": "QK-norm", "window": "sliding window on every layer",
                  "qkv_bias": "q/k/v projection biases alone (Qwen3-MoE's attention_bias biases "
                              "o_proj too)"}
# Qwen2-MoE's shared expert output is scaled by sigmoid(gate . x); a zero gate makes that exactly
# this.
QWEN_GATE = 0.5


# State-dict tensors deliberately not exported: pattern (whole name) -> why. (The RoPE tables are
# derived and registered non-persistent: not in the state dict.)
NOT_EXPORTED: Dict[str, str] = {
    # Glm4Moe exports it as gate.e_score_correction_bias; the softmax layouts leave it out.
    r"layers\.\d+\.moe\.router\.expert_bias":
        "Mixtral, Qwen2-MoE and Qwen3-MoE route without a selection bias; save_hf refuses a "
        "non-zero one, so none is lost",
}

# Tensors some HF files carry that load_hf deliberately does not read: pattern -> why.
NOT_IMPORTED: Dict[str, str] = {
    r"model\.rotary_emb\.inv_freq":
        "RoPE inverse frequencies, recomputed from the config's rope settings",
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq":
        "the same, stored per layer by older transformers",
}


def _where() -> str:
    return f"_plain_keys / _moe_keys / to_hf in {lingua_hf.app_file(__file__)}"


def _kind(args: MoEArgs) -> str:
    """The layout for `args` (its problems, if any, are _layout_problems')."""
    if args.score_func == "sigmoid":
        return "glm4_moe"
    if args.qk_norm:
        return "qwen3_moe"
    if (args.norm_topk and not args.n_shared_experts and not args.n_dense_layers
            and not args.qkv_bias):
        return "mixtral"  # the simplest and most widely supported layout
    return "qwen2_moe"


def _layout_problems(args: MoEArgs) -> List[str]:
    """What no exported architecture can express, from the args (each reason with its fix)."""
    if args.score_func not in ("softmax", "sigmoid"):
        return [f"model.score_func={args.score_func!r}: only softmax and sigmoid routing export"]
    kind, problems = _kind(args), []
    arch = LAYOUTS[kind].arch
    if args.score_func == "softmax" and args.route_scale != 1.0:
        problems.append(f"model.route_scale={args.route_scale} with softmax routing (Mixtral, "
                        "Qwen2-MoE and Qwen3-MoE have no routed scaling): train with "
                        "route_scale=1, or with score_func=sigmoid (exported as "
                        "Glm4MoeForCausalLM, which has routed_scaling_factor)")
    if kind == "qwen3_moe" and args.n_shared_experts:
        problems.append(f"model.n_shared_experts={args.n_shared_experts} with model.qk_norm=true "
                        "and softmax routing (Qwen3MoeForCausalLM has no shared expert, "
                        "Qwen2-MoE no QK-norm): train with n_shared_experts=0, qk_norm=false, or "
                        "score_func=sigmoid (Glm4MoeForCausalLM has both)")
    for option, what in ATTENTION_WHAT.items():
        value = getattr(args, option)
        if value not in (None, False) and option not in ATTENTION_OPTIONS[kind]:
            problems.append(f"model.{option}={value}: {arch} (this model's layout) has no {what}: "
                            "train without it, or with the routing of a layout that has it (a "
                            "window: Mixtral; qkv_bias: Qwen2-MoE, or Glm4Moe under sigmoid "
                            "routing; qk_norm: Qwen3-MoE, or Glm4Moe)")
    return problems


def export_problems(args: MoEArgs) -> List[str]:
    """Why `python -m apps.moe.hf export` would refuse a model trained with `args`, each reason
    with its fix; empty when it exports. Sigmoid routing exports as Glm4Moe; softmax routing as
    Mixtral, Qwen2-MoE or Qwen3-MoE, none of which scales or biases the routing."""
    problems = _layout_problems(args)
    if args.score_func == "softmax" and args.bias_update_rate > 0:
        # A zero bias would export (save_hf checks the weights), but training makes it non-zero.
        problems.append(f"model.bias_update_rate={args.bias_update_rate} with softmax routing "
                        "(the expert_bias it learns chooses experts; Mixtral, Qwen2-MoE and "
                        "Qwen3-MoE route without one): train with bias_update_rate=0, or with "
                        "score_func=sigmoid (DeepSeek-V3's router, exported as Glm4MoeForCausalLM "
                        "with the bias as e_score_correction_bias)")
    return problems


def layout_for(args: MoEArgs) -> str:
    """The HF model_type that expresses `args` exactly; ConfigError naming what none can. (A
    non-zero expert_bias under softmax routing is refused by save_hf, from the weights.)"""
    problems = _layout_problems(args)
    if problems:
        raise ConfigError("save_hf: " + "; ".join(problems) + ".")
    return _kind(args)


def _shared_names(kind: str, hf: str) -> Dict[str, str]:
    """Our shared-expert FFN weight -> its HF name, in layer block `hf`."""
    return {w: f"{hf}.{SHARED[kind]}.{name}.weight" for w, name in LAYOUTS[kind].proj.items()}


def _moe_keys(args: MoEArgs, kind: str, i: int) -> Dict[str, str]:
    """Our key -> HF key for layer i's router and shared experts (routed experts are stacked
    apart)."""
    hf = f"model.layers.{i}.{LAYOUTS[kind].block}"
    names = {f"layers.{i}.moe.router.gate.weight": f"{hf}.gate.weight"}
    if kind == "glm4_moe":
        names[f"layers.{i}.moe.router.expert_bias"] = f"{hf}.gate.e_score_correction_bias"
    # Qwen2-MoE's shared down projection is doubled (QWEN_GATE)
    if kind in SHARED and args.n_shared_experts:
        for ours, theirs in _shared_names(kind, hf).items():
            names[f"layers.{i}.moe.shared_experts.{ours}.weight"] = theirs
    return names


# Our module -> its HF name in every decoder layer, and in the dense ones'.
ATTENTION_KEYS = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
QK_NORM_KEYS = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}
DENSE_FFN_KEYS = {"feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
                  "feed_forward.w2": "mlp.down_proj"}


def _plain_keys(args: MoEArgs, kind: str) -> Dict[str, str]:
    """Our key -> HF key for every tensor copied as it is: embeddings, attention (with its QK-norm
    and q/k/v biases), norms, the dense layers' FFNs, routers and shared experts."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    attention = {**ATTENTION_KEYS, **(QK_NORM_KEYS if args.qk_norm else {})}
    for i in range(args.n_layers):
        dense = i < args.n_dense_layers
        for ours, theirs in {**attention, **(DENSE_FFN_KEYS if dense else {})}.items():
            names[f"layers.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
        for ours in ("attention.wq", "attention.wk", "attention.wv") if args.qkv_bias else ():
            names[f"layers.{i}.{ours}.bias"] = f"model.layers.{i}.{ATTENTION_KEYS[ours]}.bias"
        if not dense:
            names.update(_moe_keys(args, kind, i))
    return names


def hf_config(args: MoEArgs, dtype: torch.dtype) -> dict:
    kind = layout_for(args)
    if args.capacity_factor > 0:
        warnings.warn(f"model.capacity_factor={args.capacity_factor}: the Hugging Face model "
                      "routes every token (no capacity dropping).", stacklevel=2)
    # shape, attention, RoPE, norms, vocabulary: as Llama's
    cfg = {**lingua_hf.decoder_config(args, dtype), "attention_bias": False}
    moe = {
        "architectures": [LAYOUTS[kind].arch],
        "model_type": kind,
        "num_experts_per_tok": args.top_k,
    }
    # router_aux_loss_coef is HF's training option (read by transformers with
    # output_router_logits=true); its loss is normalised over all layers at once, unlike ours.
    if kind == "mixtral":
        moe.update(intermediate_size=expert_hidden(args), num_local_experts=args.n_experts,
                   sliding_window=args.window, router_jitter_noise=0.0,
                   router_aux_loss_coef=args.aux_loss_coef)
    elif kind in ("qwen2_moe", "qwen3_moe"):
        moe.update(moe_intermediate_size=expert_hidden(args), num_experts=args.n_experts,
                   mlp_only_layers=list(range(args.n_dense_layers)), decoder_sparse_step=1,
                   norm_topk_prob=args.norm_topk, use_sliding_window=False,
                   sliding_window=None, router_aux_loss_coef=args.aux_loss_coef)
        if kind == "qwen2_moe":   # its attention_bias is qkv_bias
            moe.update(qkv_bias=args.qkv_bias, shared_expert_intermediate_size=(
                args.n_shared_experts * expert_hidden(args)))
            del cfg["attention_bias"]
    else:
        moe.update(moe_intermediate_size=expert_hidden(args), n_routed_experts=args.n_experts,
                   n_shared_experts=args.n_shared_experts,
                   first_k_dense_replace=args.n_dense_layers,
                   norm_topk_prob=args.norm_topk, routed_scaling_factor=args.route_scale,
                   n_group=1, topk_group=1, use_qk_norm=args.qk_norm, partial_rotary_factor=1.0,
                   num_nextn_predict_layers=0, attention_bias=args.qkv_bias)
    # HF needs none of these; they let load_hf give back the same MoEArgs.
    moe["lingua_moe"] = {"expert_hidden_dim": args.expert_hidden_dim,
                         **{k: getattr(args, k) for k in TRAINING_FIELDS}}
    return {**cfg, **moe}


def _check_bias(bias: torch.Tensor, args: MoEArgs, kind: str, i: int) -> None:
    """Mixtral and Qwen2-MoE have no selection bias: a non-zero expert_bias would choose other
    experts there. (Not on the meta device, where the export plans its files.)"""
    if not bias.is_meta and bias.abs().max() > 0:
        raise ConfigError(
            f"save_hf: layer {i}'s expert_bias is non-zero "
            f"(max |bias| = {bias.abs().max().item():.3g}, "
            f"from model.bias_update_rate={args.bias_update_rate}); "
            f"{LAYOUTS[kind].arch} chooses experts without a bias, so its outputs would "
            "differ. Export sigmoid-routed models (score_func=sigmoid, as DeepSeek-V3) to keep "
            "the bias, or train softmax routing with bias_update_rate=0."
        )


def to_hf(state, args: MoEArgs, dtype: Optional[torch.dtype], layer: Optional[int]) -> dict:
    """Layer `layer`'s tensors (None: embeddings, final norm, head) under their names in the
    layout for `args` (see the module docstring)."""
    kind = layout_for(args)
    names = {o: t for o, t in _plain_keys(args, kind).items() if layer_of(o) == layer}
    out = {theirs: cast(state[ours], dtype) for ours, theirs in names.items()}
    if layer is None or layer < args.n_dense_layers:
        return out
    i, layout, dim = layer, LAYOUTS[kind], args.dim
    if kind != "glm4_moe":
        _check_bias(state[f"layers.{i}.moe.router.expert_bias"], args, kind, i)
    else:  # HF keeps it fp32: it decides the routing
        bias = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        out[bias] = cast(state[f"layers.{i}.moe.router.expert_bias"], torch.float32)
    hf = f"model.layers.{i}.{layout.block}"
    for w, name in layout.proj.items():
        stacked = cast(state[f"layers.{i}.moe.experts.{w}"], dtype)  # [E, in, out]
        for e in range(stacked.shape[0]):  # HF Linear is [out, in]
            out[f"{hf}.experts.{e}.{name}.weight"] = stacked[e].t()
    like = out[f"{hf}.experts.0.{layout.proj['w1']}.weight"]
    shared = _shared_names(kind, hf) if kind in SHARED else {}
    if shared and not args.n_shared_experts:
        # Glm4Moe and Qwen2-MoE always build a shared MLP; width 0 makes it add nothing.
        for w, name in shared.items():
            out[name] = like.new_zeros((dim, 0) if w == "w2" else (0, dim))
    if kind == "qwen2_moe":  # an ungated shared expert: zero gate, doubled down projection
        out[shared["w2"]] = out[shared["w2"]] / QWEN_GATE
        out[f"{hf}.shared_expert_gate.weight"] = like.new_zeros((1, dim))
    return out


def save_hf(
    model: Transformer, model_args: MoEArgs, path, dtype: Optional[torch.dtype] = None
) -> None:
    """Write `path/config.json` and the safetensors files (the layout for `model_args`, see the
    module docstring)."""
    lingua_hf.save_hf(model, model_args, path, dtype, to_hf=to_hf, hf_config=hf_config,
                      not_exported=NOT_EXPORTED, where=_where())


# ---------------------------------------------------------------------------------------------
# Import


def _unsupported(cfg: dict, kind: str) -> list:
    """Settings of the HF config that would make its model compute something ours does not."""
    bad = lingua_hf.decoder_problems(cfg)
    if kind == "mixtral":   # its sliding_window is our model.window
        return bad
    if kind in ("qwen2_moe", "qwen3_moe"):
        return bad + _qwen_unsupported(cfg, kind)
    rope = cfg.get("rope_parameters") or {}
    # 0.5 is HF's default
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    if partial != 1.0:
        bad.append(f"partial_rotary_factor={partial} (our RoPE rotates whole heads)")
    n_group, topk_group = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    if n_group != topk_group:
        bad.append(f"group-limited routing n_group={n_group}, topk_group={topk_group} (our "
                   "router is plain top-k, which equals keeping every group: "
                   "n_group == topk_group, e.g. 1 and 1)")
    return bad


def _n_experts(cfg: dict) -> int:
    # Qwen3MoeConfig's save_pretrained writes num_local_experts; the Hub's files num_experts.
    return cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]


def _qwen_dense_layers(cfg: dict) -> List[int]:
    """The layers transformers' Qwen-MoE builds with a dense MLP: those in mlp_only_layers and
    those whose index + 1 is not a multiple of decoder_sparse_step."""
    only, step = cfg.get("mlp_only_layers") or [], cfg.get("decoder_sparse_step", 1)
    return [i for i in range(cfg["num_hidden_layers"])
            if i in only or _n_experts(cfg) <= 0 or (i + 1) % step]


def _qwen_unsupported(cfg: dict, kind: str) -> list:
    bad = []
    if kind == "qwen3_moe" and cfg.get("attention_bias"):
        bad.append("attention_bias=true (biases on q/k/v and o_proj; ours has q/k/v biases only)")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
        bad.append("sliding-window attention (not read for Qwen-MoE: train full causal)")
    dense = _qwen_dense_layers(cfg)
    if dense != list(range(len(dense))):
        bad.append(f"dense layers {dense} from mlp_only_layers={cfg.get('mlp_only_layers')} and "
                   f"decoder_sparse_step={cfg.get('decoder_sparse_step', 1)} (ours: the first "
                   "n_dense_layers layers are dense, every later one MoE)")
    expert, shared = cfg.get("moe_intermediate_size"), cfg.get("shared_expert_intermediate_size")
    if expert and shared and shared % expert:
        bad.append(f"shared_expert_intermediate_size={shared} is not a multiple of "
                   f"moe_intermediate_size={expert} (ours: n_shared_experts times the expert "
                   "width)")
    return bad


def _ffn_fields(cfg: dict, kind: str) -> dict:
    """multiple_of, ffn_dim_multiplier and expert_hidden_dim reproducing the HF widths."""
    dim = cfg["hidden_size"]
    ffn_hint, moe_hint = cfg.get("lingua_ffn"), cfg.get("lingua_moe") or {}
    if kind == "mixtral":
        expert = cfg["intermediate_size"]
        # No dense layer: any recipe is right, so keep a recorded one, else one of the expert width.
        recorded = isinstance(ffn_hint, dict) and isinstance(ffn_hint.get("multiple_of"), int)
        if recorded and ffn_hint["multiple_of"] > 0:
            multiple_of, mult = ffn_hint["multiple_of"], ffn_hint.get("ffn_dim_multiplier")
        else:
            multiple_of, mult = ffn_recipe(dim, expert)
    else:
        expert = cfg["moe_intermediate_size"]
        multiple_of, mult = ffn_recipe(dim, cfg["intermediate_size"], ffn_hint)
    dense = ffn_hidden_dim(dim, multiple_of, mult)
    explicit = expert != dense or bool(moe_hint.get("expert_hidden_dim"))
    return {
        "multiple_of": multiple_of,
        "ffn_dim_multiplier": mult,
        "expert_hidden_dim": expert if explicit else 0,
    }


def _moe_fields(cfg: dict, kind: str) -> dict:
    if kind == "mixtral":
        return {"n_experts": cfg["num_local_experts"], "top_k": cfg["num_experts_per_tok"],
                "score_func": "softmax", "norm_topk": True, "route_scale": 1.0,
                "n_shared_experts": 0, "n_dense_layers": 0}
    if kind in ("qwen2_moe", "qwen3_moe"):
        shared = (cfg["shared_expert_intermediate_size"] // cfg["moe_intermediate_size"]
                  if kind == "qwen2_moe" else 0)
        return {"n_experts": _n_experts(cfg), "top_k": cfg["num_experts_per_tok"],
                "score_func": "softmax",
                "norm_topk": bool(cfg.get("norm_topk_prob", False)), "route_scale": 1.0,
                "n_shared_experts": shared, "n_dense_layers": len(_qwen_dense_layers(cfg))}
    return {"n_experts": cfg["n_routed_experts"], "top_k": cfg["num_experts_per_tok"],
            "score_func": "sigmoid",
            "norm_topk": bool(cfg.get("norm_topk_prob", True)),
            "route_scale": float(cfg.get("routed_scaling_factor", 1.0)),
            "n_shared_experts": cfg.get("n_shared_experts", 1),
            "n_dense_layers": min(cfg.get("first_k_dense_replace", 1), cfg["num_hidden_layers"])}


def args_from_hf_config(config_path: Path) -> MoEArgs:
    return _args_and_kind(config_path)[0]


def _attention_fields(cfg: dict, kind: str) -> dict:
    """AttentionArgs' options as the layout's config sets them (ATTENTION_OPTIONS)."""
    if kind == "mixtral":
        return {"window": cfg.get("sliding_window")}
    if kind == "qwen2_moe":  # Qwen's default: Qwen1.5-MoE and Qwen2-57B-A14B have the biases
        return {"qkv_bias": bool(cfg.get("qkv_bias", True))}
    if kind == "qwen3_moe":
        return {"qk_norm": True}
    return {"qk_norm": bool(cfg.get("use_qk_norm")), "qkv_bias": bool(cfg.get("attention_bias"))}


def _args_and_kind(config_path: Path) -> Tuple[MoEArgs, str]:
    """(MoEArgs, the config's model_type): the type decides the weight names, and a Qwen2-MoE
    directory whose args Mixtral could also express still has Qwen2-MoE's names."""
    cfg = lingua_hf.read_config(config_path)
    kind = cfg.get("model_type")
    if kind not in LAYOUTS:
        read = ", ".join(f"{layout.arch} ({name!r})" for name, layout in LAYOUTS.items())
        raise ConfigError(f"{config_path}: model_type {kind!r} is not supported by apps.moe, "
                          f"which reads {read} directories (dense Llama, Mistral, Qwen2 and "
                          "Qwen3 ones: apps.llama.hf; DeepSeek-V3: apps.deepseek.hf; Qwen3-Next: "
                          "apps.qwen3_next.hf).")
    try:
        bad = _unsupported(cfg, kind)
        if bad:
            raise ConfigError(f"{config_path}: {'; '.join(bad)}: not supported by apps.moe.")
        fields = dict(**lingua_hf.decoder_args(cfg, config_path), **_ffn_fields(cfg, kind),
                      **_moe_fields(cfg, kind), **_attention_fields(cfg, kind))
    except KeyError as e:
        raise ConfigError(
            f"{config_path} lacks {e}; it is not a complete {LAYOUTS[kind].arch} config."
        ) from None
    hint = cfg.get("lingua_moe") or {}
    fields.update({k: hint[k] for k in TRAINING_FIELDS if k in hint})
    if "expert_impl" not in hint:  # torch._grouped_mm needs 16-byte aligned rows
        aligned = fields["dim"] % 8 == 0 and (fields["expert_hidden_dim"] or ffn_hidden_dim(
            fields["dim"], fields["multiple_of"], fields["ffn_dim_multiplier"])) % 8 == 0
        fields["expert_impl"] = "grouped" if aligned else "loop"
    return MoEArgs(**fields), kind


def _consumed(names: Dict[str, Path], args: MoEArgs, kind: str) -> set:
    """The HF names load_hf reads, from the files' tensor names (either expert layout)."""
    used = set(_plain_keys(args, kind).values())
    layout = LAYOUTS[kind]
    for i in range(args.n_dense_layers, args.n_layers):
        hf = f"model.layers.{i}.{layout.block}"
        if f"{hf}.experts.gate_up_proj" in names:
            used |= {f"{hf}.experts.gate_up_proj", f"{hf}.experts.down_proj"}
        else:
            used |= {
                f"{hf}.experts.{e}.{p}.weight"
                for e in range(args.n_experts) for p in layout.proj.values()
            }
        # zero-width (what save_hf and HF write), checked on load
        if kind in SHARED and not args.n_shared_experts:
            used |= set(_shared_names(kind, hf).values())
        if kind == "qwen2_moe":  # checked zero on load
            used.add(f"{hf}.shared_expert_gate.weight")
    return used


def _ungate_shared(
    tensors: Dict[str, torch.Tensor], origin: Dict[str, Path], args: MoEArgs, path: Path
) -> None:
    """Qwen2-MoE's gated shared expert as our ungated one: only a zero gate (sigmoid = 1/2 for
    every token, what save_hf writes) is expressible; its 1/2 goes into the down projection."""
    for i in range(args.n_dense_layers, args.n_layers):
        hf = f"model.layers.{i}.mlp"
        gate = weight(tensors, f"{hf}.shared_expert_gate.weight", path)
        if gate.abs().max() > 0:
            raise ConfigError(
                f"{origin[f'{hf}.shared_expert_gate.weight']}: {hf}.shared_expert_gate.weight is "
                f"non-zero (max |w| = {gate.abs().max().item():.3g}): a learned per-token gate on "
                "the shared expert, which apps.moe's model does not have (its shared experts are "
                "ungated; an export from it writes a zero gate). Such a model cannot be loaded "
                "without changing what it computes.")
        if args.n_shared_experts:
            down = _shared_names("qwen2_moe", hf)["w2"]
            tensors[down] = weight(tensors, down, path) * QWEN_GATE  # exact: a power of two


def load_hf(path, dtype: Optional[torch.dtype] = torch.float32) -> Tuple[Transformer, MoEArgs]:
    """Read a MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or Glm4MoeForCausalLM
    directory into (Transformer on CPU, MoEArgs). dtype None keeps the file's; the routers'
    expert_bias stays fp32."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(
            f"{config_path} is missing: {path} is not a Hugging Face model directory."
        )
    args, kind = _args_and_kind(config_path)
    def ours_for(k: str) -> str:
        # transformers 5's fused Mixtral layout (save_original_format=False) calls the block "mlp"
        return k.replace(".mlp.", ".block_sparse_moe.") if kind == "mixtral" else k

    names = lingua_hf.tensor_names(path)
    used = _consumed({ours_for(k): f for k, f in names.items()}, args, kind)
    ignored = {**NOT_IMPORTED, **(TIED_NOT_IMPORTED if args.tie_embeddings else {})}
    consumed = [k for k in names if ours_for(k) in used]
    lingua_hf.check_import(names, consumed, ignored, _where(), path)
    tensors, origin = read_weights(path)
    tensors = {ours_for(k): t for k, t in tensors.items()}
    origin = {ours_for(k): f for k, f in origin.items()}
    if kind in SHARED and not args.n_shared_experts:
        for i in range(args.n_dense_layers, args.n_layers):
            for k in _shared_names(kind, f"model.layers.{i}.mlp").values():
                if k in tensors and tensors[k].numel():
                    raise ConfigError(
                        f"{origin[k]}: {k} has shape {tuple(tensors[k].shape)} but config.json's "
                        "n_shared_experts=0 gives it width 0; the weights do not match the config."
                    )
    if kind == "qwen2_moe":
        _ungate_shared(tensors, origin, args, path)
    hf_names = _plain_keys(args, kind)
    state = {ours: weight(tensors, theirs, path) for ours, theirs in hf_names.items()}
    for i in range(args.n_dense_layers, args.n_layers):
        experts = f"model.layers.{i}.{LAYOUTS[kind].block}.experts"
        for w, (t, source) in stacked_experts(tensors, experts, args.n_experts,
                                              LAYOUTS[kind].proj, path).items():
            state[f"layers.{i}.moe.experts.{w}"] = t
            hf_names[f"layers.{i}.moe.experts.{w}"] = source
        if kind != "glm4_moe":  # no selection bias
            state[f"layers.{i}.moe.router.expert_bias"] = torch.zeros(args.n_experts)
    with torch.device("meta"):
        model = Transformer(args)
    lingua_hf.check_filled(model.state_dict(), state, _where(), path)
    return lingua_hf.assign(model, state, dtype, sources=hf_names, origin=origin, path=path), args


# ---------------------------------------------------------------------------------------------
# CLI


def export(ckpt_dir: str, out_dir: str, dtype: Optional[torch.dtype] = None) -> str:
    """A training checkpoint (a run directory: its newest complete one) -> a Hugging Face
    directory; returns its architecture."""
    args = lingua_hf.export(ckpt_dir, out_dir, dtype, model_class=Transformer, args_class=MoEArgs,
                            export_problems=export_problems, to_hf=to_hf, hf_config=hf_config,
                            not_exported=NOT_EXPORTED, where=_where(),
                            command=lingua_hf.command(__file__))
    return LAYOUTS[layout_for(args)].arch


def main(argv=None) -> None:
    lingua_hf.export_cli(argv, lingua_hf.command(__file__), __doc__.split("\n")[0], export)


if __name__ == "__main__":
    main()
