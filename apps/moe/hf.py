"""Hugging Face interop for the MoE model: config.json + safetensors directories <-> our Transformer.

Two Hugging Face architectures, chosen from the model args on export and from config.json's
`model_type` on import; both compute exactly what our model computes:

* MixtralForCausalLM ("mixtral"): softmax over all experts, top-k, the top-k weights renormalised
  to sum to 1. So it needs score_func=softmax, norm_topk=True, route_scale=1, no shared experts,
  no dense layers and a zero expert_bias.
* Glm4MoeForCausalLM ("glm4_moe", GLM-4.5) for the DeepSeek-V3 router: sigmoid scores,
  `e_score_correction_bias` used only to choose the experts, optional renormalisation
  (norm_topk_prob), routed_scaling_factor, shared experts of width n_shared * expert width, the
  first `first_k_dense_replace` layers dense. DeepseekV3ForCausalLM has the same router but
  multi-head latent attention, which our model lacks; Dots1 has it too but always applies q/k
  RMSNorm; Qwen2-MoE gates its shared expert with a learned sigmoid. Glm4Moe's attention is ours
  (GQA, rotate_half RoPE) once attention_bias=False, use_qk_norm=False and partial_rotary_factor=1
  (its default rotates half of each head), and its group-limited routing is plain top-k when
  every group is kept (n_group == topk_group, e.g. both 1).

Hugging Face models route every token (dropless): a model trained with capacity_factor > 0 is
exported as is and reads back with capacity_factor=0, which is what the HF model computes.
Attention, embeddings, norms and the safetensors reading are apps/llama/hf.py's.

CLI: python -m apps.moe.hf export <checkpoint_dir> <out_dir> [--dtype bf16|fp32]
"""

import argparse
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from lingua import hf as lingua_hf
from apps.llama.hf import key_map, llama_hf_config
from lingua.hf import DTYPES, ffn_recipe, read_weights, rope_args
from apps.moe.model import MoEArgs, Transformer, expert_hidden
from lingua.errors import ConfigError
from lingua.transformer import ffn_hidden_dim

# MoEArgs fields that only matter for training; recorded so that load_hf gives back the same args.
TRAINING_FIELDS = ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "expert_impl")


@dataclass(frozen=True)
class Layout:
    arch: str
    block: str                # the MoE module's name inside a HF decoder layer
    proj: Dict[str, str]      # our expert weight -> HF per-expert Linear name


LAYOUTS = {
    "mixtral": Layout("MixtralForCausalLM", "block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    "glm4_moe": Layout("Glm4MoeForCausalLM", "mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
}


# State-dict tensors deliberately not exported: pattern (whole name) -> why. (The RoPE tables are
# derived and registered non-persistent: not in the state dict.)
NOT_EXPORTED: Dict[str, str] = {
    # Glm4Moe exports it as gate.e_score_correction_bias; only Mixtral leaves it out.
    r"layers\.\d+\.moe\.router\.expert_bias":
        "Mixtral routes without a selection bias; save_hf refuses a non-zero one, so none is lost",
}

# Tensors some HF files carry that load_hf deliberately does not read: pattern -> why.
NOT_IMPORTED: Dict[str, str] = {
    r"model\.rotary_emb\.inv_freq": "RoPE inverse frequencies, recomputed from the config's rope settings",
    r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq": "the same, stored per layer by older transformers",
}
# With tie_word_embeddings transformers itself ignores a stored lm_head and ties it to the embedding.
TIED_NOT_IMPORTED = {r"lm_head\.weight": "a copy of embed_tokens that transformers also replaces by the tied embedding"}


def _where() -> str:
    return f"_plain_keys / _moe_keys / _expert_keys in {lingua_hf.app_file(__file__)}"


def layout_for(args: MoEArgs) -> str:
    """The HF model_type that expresses `args` exactly; ConfigError naming what neither can."""
    if args.score_func == "sigmoid":
        return "glm4_moe"
    if args.score_func != "softmax":
        raise ConfigError(f"model.score_func={args.score_func!r}: only softmax and sigmoid routing export.")
    blockers = []
    if not args.norm_topk:
        blockers.append("model.norm_topk=False (Mixtral always renormalises the top-k weights)")
    if args.route_scale != 1.0:
        blockers.append(f"model.route_scale={args.route_scale} (Mixtral has no routed scaling)")
    if args.n_shared_experts:
        blockers.append(f"model.n_shared_experts={args.n_shared_experts} (Mixtral has no shared experts)")
    if args.n_dense_layers:
        blockers.append(f"model.n_dense_layers={args.n_dense_layers} (every Mixtral layer is MoE)")
    if blockers:
        raise ConfigError(
            "save_hf: softmax routing exports as MixtralForCausalLM, which cannot express "
            + "; ".join(blockers) + ". Train with norm_topk=true, route_scale=1, no shared experts and "
            "no dense layers, or use score_func=sigmoid (exported as Glm4MoeForCausalLM, which has "
            "shared experts, dense first layers, optional renormalisation and routed scaling)."
        )
    return "mixtral"


def _moe_keys(args: MoEArgs, kind: str, i: int) -> Dict[str, str]:
    """Our key -> HF key for layer i's router and shared experts (routed experts are stacked apart)."""
    hf = f"model.layers.{i}.{LAYOUTS[kind].block}"
    names = {f"layers.{i}.moe.router.gate.weight": f"{hf}.gate.weight"}
    if kind == "glm4_moe":
        names[f"layers.{i}.moe.router.expert_bias"] = f"{hf}.gate.e_score_correction_bias"
        if args.n_shared_experts:
            for ours, theirs in LAYOUTS[kind].proj.items():
                names[f"layers.{i}.moe.shared_experts.{ours}.weight"] = f"{hf}.shared_experts.{theirs}.weight"
    return names


def _plain_keys(args: MoEArgs, kind: str) -> Dict[str, str]:
    """Our key -> HF key for every tensor copied as it is: apps.llama's map (embeddings, attention,
    norms, dense FFNs) without the FFNs of MoE layers, plus routers and shared experts."""
    names = key_map(args)
    for i in range(args.n_dense_layers, args.n_layers):
        for w in ("w1", "w2", "w3"):
            del names[f"layers.{i}.feed_forward.{w}.weight"]
        names.update(_moe_keys(args, kind, i))
    return names


def _expert_keys(args: MoEArgs, i: int) -> list:
    """Our keys of layer i's routed experts: [E, in, out] stacks, one HF Linear per expert."""
    return [f"layers.{i}.moe.experts.{w}" for w in ("w1", "w3", "w2")]


def hf_config(args: MoEArgs, dtype: torch.dtype) -> dict:
    kind = layout_for(args)
    cfg = llama_hf_config(args, dtype)  # shape, attention, RoPE, norms, vocabulary: as Llama's
    del cfg["mlp_bias"]
    moe = {"architectures": [LAYOUTS[kind].arch], "model_type": kind, "num_experts_per_tok": args.top_k}
    if kind == "mixtral":
        moe.update(intermediate_size=expert_hidden(args), num_local_experts=args.n_experts,
                   sliding_window=None, router_jitter_noise=0.0, router_aux_loss_coef=args.aux_loss_coef)
    else:
        moe.update(moe_intermediate_size=expert_hidden(args), n_routed_experts=args.n_experts,
                   n_shared_experts=args.n_shared_experts, first_k_dense_replace=args.n_dense_layers,
                   norm_topk_prob=args.norm_topk, routed_scaling_factor=args.route_scale,
                   n_group=1, topk_group=1, use_qk_norm=False, partial_rotary_factor=1.0,
                   num_nextn_predict_layers=0)
    # HF needs none of these; they let load_hf give back the same MoEArgs.
    moe["lingua_moe"] = {"expert_hidden_dim": args.expert_hidden_dim,
                         **{k: getattr(args, k) for k in TRAINING_FIELDS}}
    return {**cfg, **moe}


def _take(state: Dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise ConfigError(f"save_hf: the model has no {key}; it does not match model_args (a pipeline "
                          "stage or a different architecture?). Export a whole model.")
    return state[key].detach()


def _check_bias(state: Dict[str, torch.Tensor], args: MoEArgs) -> None:
    """Mixtral has no selection bias: a non-zero expert_bias would choose other experts there."""
    for i in range(args.n_dense_layers, args.n_layers):
        bias = _take(state, f"layers.{i}.moe.router.expert_bias")
        if bias.abs().max() > 0:
            raise ConfigError(
                f"save_hf: layer {i}'s expert_bias is non-zero (max |bias| = {bias.abs().max().item():.3g}, "
                f"from model.bias_update_rate={args.bias_update_rate}); MixtralForCausalLM chooses experts "
                "without a bias, so its outputs would differ. Export sigmoid-routed models (score_func="
                "sigmoid, as DeepSeek-V3) to keep the bias, or train softmax routing with bias_update_rate=0."
            )


def save_hf(model: Transformer, model_args: MoEArgs, path, dtype: Optional[torch.dtype] = None) -> None:
    """Write `path/config.json` and `path/model.safetensors` (Mixtral or Glm4Moe layout, see above)."""
    kind = layout_for(model_args)
    if model_args.capacity_factor > 0:
        warnings.warn(f"model.capacity_factor={model_args.capacity_factor}: the Hugging Face model "
                      "routes every token (no capacity dropping).")
    state = model.state_dict()
    plain = _plain_keys(model_args, kind)
    experts = [k for i in range(model_args.n_dense_layers, model_args.n_layers) for k in _expert_keys(model_args, i)]
    for key in [*plain, *experts]:
        _take(state, key)  # a missing one: a pipeline stage or other args, said before the unmapped ones
    lingua_hf.check_export(state, [*plain, *experts], NOT_EXPORTED, _where(), path)
    if kind == "mixtral":
        _check_bias(state, model_args)
    out = {theirs: _take(state, ours) for ours, theirs in plain.items()}
    layout = LAYOUTS[kind]
    for i in range(model_args.n_dense_layers, model_args.n_layers):
        for w, name in layout.proj.items():
            stacked = _take(state, f"layers.{i}.moe.experts.{w}")  # [E, in, out]: HF Linear is [out, in]
            for e in range(stacked.shape[0]):
                out[f"model.layers.{i}.{layout.block}.experts.{e}.{name}.weight"] = stacked[e].t()
        if kind == "glm4_moe" and not model_args.n_shared_experts:
            # Glm4Moe always builds a shared MLP; width 0 makes it add nothing.
            dim, like = model_args.dim, out["model.embed_tokens.weight"]
            for name, shape in (("gate_proj", (0, dim)), ("up_proj", (0, dim)), ("down_proj", (dim, 0))):
                out[f"model.layers.{i}.mlp.shared_experts.{name}.weight"] = like.new_zeros(shape)
    tensors = {}
    for k, t in out.items():
        keep_fp32 = k.endswith("e_score_correction_bias")  # HF keeps it fp32: it decides routing
        target = torch.float32 if keep_fp32 else (dtype or t.dtype)
        tensors[k] = t.to(target).cpu().contiguous()
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config(model_args, tensors["model.embed_tokens.weight"].dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------------------------------------
# Import


def _read_config(config_path: Path) -> dict:
    try:
        return json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"Cannot read {config_path}: {e}. A Hugging Face model directory needs a "
                          "valid config.json.") from None


def _unsupported(cfg: dict, kind: str) -> list:
    """Settings of the HF config that would make its model compute something ours does not."""
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    bad = []
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={cfg['hidden_act']} (our experts use SiLU)")
    if cfg.get("head_dim") not in (None, dim // n_heads):
        bad.append(f"head_dim={cfg['head_dim']} != hidden_size/num_attention_heads={dim // n_heads}")
    if kind == "mixtral":
        window = cfg.get("sliding_window")
        if window is not None and window < cfg.get("max_position_embeddings", 0):
            bad.append(f"sliding_window={window} (our attention is full causal)")
        return bad
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))  # HF's default
    if partial != 1.0:
        bad.append(f"partial_rotary_factor={partial} (our RoPE rotates whole heads)")
    for key in ("attention_bias", "use_qk_norm"):
        if cfg.get(key):
            bad.append(f"{key}=true")
    n_group, topk_group = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    if n_group != topk_group:
        bad.append(f"group-limited routing n_group={n_group}, topk_group={topk_group} (our router is "
                   "plain top-k, which equals keeping every group: n_group == topk_group, e.g. 1 and 1)")
    return bad


def _ffn_fields(cfg: dict, kind: str) -> dict:
    """multiple_of, ffn_dim_multiplier and expert_hidden_dim reproducing the HF widths."""
    dim = cfg["hidden_size"]
    ffn_hint, moe_hint = cfg.get("lingua_ffn"), cfg.get("lingua_moe") or {}
    if kind == "mixtral":
        expert = cfg["intermediate_size"]
        # No dense layer: any recipe is right, so keep a recorded one, else one of the expert width.
        if isinstance(ffn_hint, dict) and isinstance(ffn_hint.get("multiple_of"), int) and ffn_hint["multiple_of"] > 0:
            multiple_of, mult = ffn_hint["multiple_of"], ffn_hint.get("ffn_dim_multiplier")
        else:
            multiple_of, mult = ffn_recipe(dim, expert)
    else:
        expert = cfg["moe_intermediate_size"]
        multiple_of, mult = ffn_recipe(dim, cfg["intermediate_size"], ffn_hint)
    dense = ffn_hidden_dim(dim, multiple_of, mult)
    explicit = expert != dense or bool(moe_hint.get("expert_hidden_dim"))
    return {"multiple_of": multiple_of, "ffn_dim_multiplier": mult, "expert_hidden_dim": expert if explicit else 0}


def _moe_fields(cfg: dict, kind: str) -> dict:
    if kind == "mixtral":
        return {"n_experts": cfg["num_local_experts"], "top_k": cfg["num_experts_per_tok"],
                "score_func": "softmax", "norm_topk": True, "route_scale": 1.0,
                "n_shared_experts": 0, "n_dense_layers": 0}
    return {"n_experts": cfg["n_routed_experts"], "top_k": cfg["num_experts_per_tok"], "score_func": "sigmoid",
            "norm_topk": bool(cfg.get("norm_topk_prob", True)),
            "route_scale": float(cfg.get("routed_scaling_factor", 1.0)),
            "n_shared_experts": cfg.get("n_shared_experts", 1),
            "n_dense_layers": min(cfg.get("first_k_dense_replace", 1), cfg["num_hidden_layers"])}


def args_from_hf_config(config_path: Path) -> MoEArgs:
    cfg = _read_config(config_path)
    kind = cfg.get("model_type")
    if kind not in LAYOUTS:
        raise ConfigError(f"{config_path}: model_type {kind!r} is not supported by apps.moe, which reads "
                          "MixtralForCausalLM ('mixtral') and Glm4MoeForCausalLM ('glm4_moe') directories "
                          "(dense LlamaForCausalLM ones: apps.llama.hf).")
    try:
        bad = _unsupported(cfg, kind)
        if bad:
            raise ConfigError(f"{config_path}: {'; '.join(bad)}: not supported by apps.moe.")
        fields = dict(
            dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_seq_len=cfg.get("max_position_embeddings", 4096), init_std=cfg.get("initializer_range", 0.02),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            **rope_args(cfg, config_path), **_ffn_fields(cfg, kind), **_moe_fields(cfg, kind),
        )
    except KeyError as e:
        raise ConfigError(f"{config_path} lacks {e}; it is not a complete {LAYOUTS[kind].arch} config.") from None
    hint = cfg.get("lingua_moe") or {}
    fields.update({k: hint[k] for k in TRAINING_FIELDS if k in hint})
    if "expert_impl" not in hint:  # torch._grouped_mm needs 16-byte aligned rows
        aligned = fields["dim"] % 8 == 0 and (fields["expert_hidden_dim"] or ffn_hidden_dim(
            fields["dim"], fields["multiple_of"], fields["ffn_dim_multiplier"])) % 8 == 0
        fields["expert_impl"] = "grouped" if aligned else "loop"
    return MoEArgs(**fields)


def _fetch(tensors: Dict[str, torch.Tensor], key: str, path: Path) -> torch.Tensor:
    if key not in tensors:
        raise ConfigError(f"{path}: weight {key} is missing from the safetensors files; the directory "
                          "does not match its config.json.")
    return tensors[key]


def _consumed(names: Dict[str, Path], args: MoEArgs, kind: str) -> set:
    """The HF names load_hf reads, from the files' tensor names (either expert layout)."""
    used = set(_plain_keys(args, kind).values())
    layout = LAYOUTS[kind]
    for i in range(args.n_dense_layers, args.n_layers):
        hf = f"model.layers.{i}.{layout.block}"
        if f"{hf}.experts.gate_up_proj" in names:
            used |= {f"{hf}.experts.gate_up_proj", f"{hf}.experts.down_proj"}
        else:
            used |= {f"{hf}.experts.{e}.{p}.weight" for e in range(args.n_experts) for p in layout.proj.values()}
        if kind == "glm4_moe" and not args.n_shared_experts:  # zero-width (what save_hf and HF write), checked on load
            used |= {f"{hf}.shared_experts.{p}.weight" for p in layout.proj.values()}
    return used


def _stacked_experts(tensors, args: MoEArgs, kind: str, i: int, path: Path) -> Dict[str, Tuple[torch.Tensor, str]]:
    """Layer i's routed experts as our [E, in, out] stacks (with the HF key they came from), from
    per-expert Linear weights (the Hub layout, which save_pretrained writes) or from transformers
    5's fused gate_up_proj / down_proj (save_original_format=False)."""
    layout = LAYOUTS[kind]
    hf = f"model.layers.{i}.{layout.block}.experts"
    if f"{hf}.gate_up_proj" in tensors:
        gate, up = tensors[f"{hf}.gate_up_proj"].chunk(2, dim=1)  # [E, 2*hidden, dim]: gate rows, then up
        down = _fetch(tensors, f"{hf}.down_proj", path)
        return {"w1": (gate.transpose(1, 2), f"{hf}.gate_up_proj"), "w3": (up.transpose(1, 2), f"{hf}.gate_up_proj"),
                "w2": (down.transpose(1, 2), f"{hf}.down_proj")}
    return {w: (torch.stack([_fetch(tensors, f"{hf}.{e}.{name}.weight", path).t() for e in range(args.n_experts)]),
                f"{hf}.0.{name}.weight") for w, name in layout.proj.items()}


def _init_rope(model: Transformer) -> None:
    """The RoPE tables (non-persistent buffers, still on meta); init_weights would also re-draw the
    weights just loaded."""
    model.init_rope("cpu")


def load_hf(path, dtype: Optional[torch.dtype] = torch.float32) -> Tuple[Transformer, MoEArgs]:
    """Read a MixtralForCausalLM or Glm4MoeForCausalLM directory into (Transformer on CPU, MoEArgs).
    dtype None keeps the file's; the routers' expert_bias stays fp32."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path} is missing: {path} is not a Hugging Face model directory.")
    args = args_from_hf_config(config_path)
    kind = layout_for(args)
    # transformers 5's fused Mixtral layout (save_original_format=False) calls the block "mlp"
    ours_for = (lambda k: k.replace(".mlp.", ".block_sparse_moe.")) if kind == "mixtral" else (lambda k: k)
    names = lingua_hf.tensor_names(path)
    used = _consumed({ours_for(k): f for k, f in names.items()}, args, kind)
    ignored = {**NOT_IMPORTED, **(TIED_NOT_IMPORTED if args.tie_embeddings else {})}
    lingua_hf.check_import(names, [k for k in names if ours_for(k) in used], ignored, _where(), path)
    tensors, origin = read_weights(path)
    tensors = {ours_for(k): t for k, t in tensors.items()}
    origin = {ours_for(k): f for k, f in origin.items()}
    if kind == "glm4_moe" and not args.n_shared_experts:
        for i in range(args.n_dense_layers, args.n_layers):
            for p in LAYOUTS[kind].proj.values():
                k = f"model.layers.{i}.mlp.shared_experts.{p}.weight"
                if k in tensors and tensors[k].numel():
                    raise ConfigError(f"{origin[k]}: {k} has shape {tuple(tensors[k].shape)} but config.json's "
                                      "n_shared_experts=0 gives it width 0; the weights do not match the config.")
    hf_names = _plain_keys(args, kind)
    state = {ours: _fetch(tensors, theirs, path) for ours, theirs in hf_names.items()}
    for i in range(args.n_dense_layers, args.n_layers):
        for w, (t, source) in _stacked_experts(tensors, args, kind, i, path).items():
            state[f"layers.{i}.moe.experts.{w}"], hf_names[f"layers.{i}.moe.experts.{w}"] = t, source
        if kind == "mixtral":
            state[f"layers.{i}.moe.router.expert_bias"] = torch.zeros(args.n_experts)
    with torch.device("meta"):
        model = Transformer(args)
    expected = model.state_dict()
    lingua_hf.check_filled(expected, state, _where(), path)
    for key in [k for k in expected if k in state]:  # model order: errors name the first layer's
        t = state[key]
        if t.shape != expected[key].shape:
            where = f"{origin[hf_names[key]]}: {hf_names[key]}" if key in hf_names else f"{path}: {key}"
            raise ConfigError(f"{where} gives {key} of shape {tuple(t.shape)} but config.json implies "
                              f"{tuple(expected[key].shape)}; the weights do not match the config.")
        fp32 = key.endswith("expert_bias")  # routing decisions flip on small differences
        state[key] = t.to(torch.float32 if fp32 else (dtype or t.dtype)).contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    _init_rope(model)
    return model, args


# ---------------------------------------------------------------------------------------------
# CLI


def export(ckpt_dir: str, out_dir: str, dtype: Optional[torch.dtype] = None) -> str:
    """A training checkpoint (DCP + config.yaml) -> a Hugging Face directory; returns its architecture."""
    from lingua.checkpoint import load_model_state, read_run_config

    section = read_run_config(ckpt_dir).model
    try:
        args = MoEArgs(**OmegaConf.to_container(section, resolve=True))
    except TypeError as e:
        raise ConfigError(f"{ckpt_dir}/config.yaml: its model section does not fit MoEArgs ({e}); "
                          "export it with the app that trained it.") from None
    args.attn_backend = "sdpa"  # never runs attention here; xformers would refuse on CPU
    layout_for(args)  # refuse before reading any weights
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights("cpu")  # fills non-persistent buffers; the checkpoint overwrites the rest
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, on purpose
        load_model_state(ckpt_dir, model)
    save_hf(model, args, out_dir, dtype)
    lingua_hf.write_tokenizer(read_run_config(ckpt_dir), out_dir)  # HF tools encode as we did
    return LAYOUTS[layout_for(args)].arch


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m apps.moe.hf", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("export", help="write a training checkpoint as a Hugging Face MoE directory "
                                             "(MixtralForCausalLM or Glm4MoeForCausalLM, from the routing)")
    cmd.add_argument("checkpoint_dir")
    cmd.add_argument("out_dir")
    cmd.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: as trained (fp32)")
    ns = parser.parse_args(argv)
    try:
        arch = export(ns.checkpoint_dir, ns.out_dir, DTYPES.get(ns.dtype))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {arch}: {ns.out_dir}/config.json and {ns.out_dir}/model.safetensors")


if __name__ == "__main__":
    main()
