"""Hugging Face interop shared by the apps: save_hf, load_hf, export (one safetensors file at a
time, hf_files) and its command, the decoder's config fields, init_from. Each architecture's hf.py
(lingua/models/llama/hf.py; apps/moe/hf.py for Mixtral, Qwen2/3-MoE, GLM-4.5 MoE) holds its key
table, its `to_hf(state, args, dtype, layer)` and its config mapping.

Nothing is dropped silently: every state-dict tensor is mapped or on the app's NOT_EXPORTED list
(`check_export`), every tensor of the safetensors files consumed or on NOT_IMPORTED
(`check_import`), each list a regular expression -> why; a fork that adds a weight is told which
file to edit instead of getting a model without it.
"""

import argparse
import json
import logging
import os
import re
import sys
from functools import partial
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file

from lingua import config
from lingua.checkpoint import _dcp_load, hf_files, read_run_config, resolve, verified, verified_base
from lingua.errors import ConfigError, RunError
from lingua.model import weights
from lingua.model.layers import ffn_hidden_dim, head_dim

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rope_args(cfg: dict, config_path: Path) -> dict:
    # transformers < 5 writes rope_theta + rope_scaling; 5.x rope_parameters, the theta inside.
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta), "rope_scaling": False}
    if kind != "llama3":
        raise ConfigError(f"{config_path}: rope type {kind!r} is not supported; this model "
                          "implements plain RoPE and Llama 3.1 ('llama3') scaling only.")
    return {"rope_theta": float(theta), "rope_scaling": True,
            "rope_scale_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_seq_len": int(params["original_max_position_embeddings"])}


def ffn_recipe(dim: int, hidden: int, hint: Optional[dict] = None) -> Tuple[int, Optional[float]]:
    """(multiple_of, ffn_dim_multiplier) giving SwiGLU width `hidden` under Meta's recipe: those
    our export recorded (`hint`), else those Meta's configs use, so the args read back equal the
    trained ones; else multiple_of = hidden, which rounds any smaller width up to `hidden`."""
    recorded = []
    if isinstance(hint, dict):
        recorded = [(hint.get("multiple_of"), hint.get("ffn_dim_multiplier"))]
    known = [(256, None), (1024, None), (1024, 1.3), (256, 1.5), (256, 1.3), (4096, 1.3)]
    for multiple_of, mult in recorded + known:
        valid = isinstance(multiple_of, int) and multiple_of > 0
        if valid and ffn_hidden_dim(dim, multiple_of, mult) == hidden:
            return multiple_of, mult
    base = int(2 * 4 * dim / 3)
    return hidden, (None if hidden >= base else hidden / base)


def _weight_files(path: Path) -> List[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"No weights in {path}: expected model.safetensors (or shards listed in "
                          "model.safetensors.index.json). Only safetensors files are read.")
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{f} is listed in {index} but missing; copy the complete model "
                              f"directory.")
    return files


def tensor_names(path: Path) -> Dict[str, Path]:
    """Every tensor name in the directory's safetensors -> its file, read from the headers alone."""
    names = {}
    for f in _weight_files(path):
        with safe_open(str(f), framework="pt") as handle:
            names.update((k, f) for k in handle.keys())
    return names


def read_weights(path: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, Path]]:
    """All tensors of the directory, and the file each came from (for error messages)."""
    tensors, origin = {}, {}
    for f in _weight_files(path):
        for k, t in load_file(str(f)).items():  # safetensors holds raw tensors only: no pickle
            tensors[k], origin[k] = t, f
    return tensors, origin


def weight(tensors: Dict[str, torch.Tensor], key: str, path) -> torch.Tensor:
    """tensors[key], or a ConfigError saying the directory does not match its config.json."""
    if key not in tensors:
        raise ConfigError(f"{path}: weight {key} is missing from the safetensors files; the "
                          "directory does not match its config.json.")
    return tensors[key]


def stacked_experts(tensors, prefix: str, n_experts: int, names: Dict[str, str],
                    path) -> Dict[str, Tuple[torch.Tensor, str]]:
    """An MoE layer's routed experts as [E, in, out] stacks with the HF key each came from, from
    per-expert Linears (`{prefix}.{e}.{names[w]}.weight`, the Hub layout) or transformers 5's fused
    `{prefix}.gate_up_proj` / `down_proj`. `names`: w1, w3, w2 -> the per-expert names."""
    if f"{prefix}.gate_up_proj" in tensors:
        gate, up = tensors[f"{prefix}.gate_up_proj"].chunk(2, dim=1)   # [E, 2 hidden, dim]
        down = weight(tensors, f"{prefix}.down_proj", path)
        return {"w1": (gate.transpose(1, 2), f"{prefix}.gate_up_proj"),
                "w3": (up.transpose(1, 2), f"{prefix}.gate_up_proj"),
                "w2": (down.transpose(1, 2), f"{prefix}.down_proj")}
    return {w: (torch.stack([weight(tensors, f"{prefix}.{e}.{name}.weight", path).t()
                             for e in range(n_experts)]), f"{prefix}.0.{name}.weight")
            for w, name in names.items()}


def _listed(names: Iterable[str], limit: int = 10) -> str:
    names = sorted(names, key=lambda n: [int(p) if p.isdigit() else p  # layers.2 before .10
                                         for p in re.split(r"(\d+)", n)])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _allowed(name: str, allow_list: Dict[str, str]) -> bool:
    return any(re.fullmatch(pattern, name) for pattern in allow_list)


def app_file(module_file: str) -> str:
    """An app's hf.py as the user would open it: relative to the repository when inside it."""
    f = Path(module_file).resolve()
    try:
        return str(f.relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        return str(f)


def check_export(state_keys: Iterable[str], exported: Iterable[str], *,
                 not_exported: Dict[str, str], where: str, out_dir) -> None:
    """Refuse, before anything is written, a state-dict tensor neither mapped (`exported`) nor on
    the app's NOT_EXPORTED list. `where` names the map: "key_map in apps/llama/hf.py"."""
    exported = set(exported)
    unmapped = [k for k in state_keys if k not in exported and not _allowed(k, not_exported)]
    if unmapped:
        raise ConfigError(
            f"save_hf: {len(unmapped)} tensor(s) of the model have no Hugging Face name, so the "
            f"export would silently lack them: {_listed(unmapped)}. Map each one to its Hugging "
            f"Face name in {where} (load_hf reads the same map back), or, for a buffer that is "
            "derived or runtime state with no Hugging Face equivalent, add a pattern for it with "
            f"the reason to NOT_EXPORTED in that file. Nothing was written to {out_dir}.")


def check_filled(state_keys: Iterable[str], filled: Iterable[str], where: str, path) -> None:
    """Refuse a model with a state-dict tensor the import gives no value (a fork's new weight)."""
    filled = set(filled)
    empty = [k for k in state_keys if k not in filled]
    if empty:
        raise ConfigError(
            f"load_hf: {len(empty)} tensor(s) of the model get no value from {path}: "
            f"{_listed(empty)}. Map each one to its Hugging Face name in {where}, or, if a Hugging "
            "Face model of this architecture has no such weight, this directory cannot initialise "
            "the model.")


def check_import(names: Dict[str, Path], consumed: Iterable[str], not_imported: Dict[str, str],
                 where: str, path) -> None:
    """Refuse a directory holding a tensor neither consumed by the app's map nor on NOT_IMPORTED."""
    consumed = set(consumed)
    dropped = [k for k in names if k not in consumed and not _allowed(k, not_imported)]
    if dropped:
        files = sorted({names[k].name for k in dropped})
        raise ConfigError(
            f"{path}: {len(dropped)} tensor(s) in {', '.join(files)} have no place in the model, "
            f"so loading would silently drop them: {_listed(dropped)}. Either config.json "
            "describes fewer layers or experts than the files hold, or the checkpoint has weights "
            "this architecture lacks (biases, extra norms?): use an app whose model has them, or "
            f"add them to the model and map them in {where}; a tensor that is derived and "
            "recomputed on load can go on NOT_IMPORTED in that file with the reason.")


def warn_unexportable(problems: List[str], command: str) -> None:
    """One warning line (rank 0) at the start of a run whose checkpoints `command` will refuse."""
    if problems and _rank0():
        logging.getLogger(__name__).warning(
            "warning: %s export will refuse this run's checkpoints: %s. Training goes on; change "
            "those options now if you need a Hugging Face model.", command, "; ".join(problems))


def _rank0() -> bool:   # before any process group
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0


def refuse_unexportable(problems: List[str], command: str, ckpt_dir) -> None:
    if problems:
        raise ConfigError(f"{command} export: {ckpt_dir} cannot be written as a Hugging Face "
                          f"model: {'; '.join(problems)}.")


# With tie_word_embeddings transformers ignores a stored lm_head and ties it to the embedding.
TIED_NOT_IMPORTED = {
    r"lm_head\.weight": "a copy of embed_tokens that transformers replaces by the tied embedding"}


def command(module_file: str) -> str:
    """`python -m` and the hf module run as __main__, else module_file's."""
    running = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = running.name if running is not None and running.name.endswith(".hf") else None
    return "python -m " + (name or app_file(module_file).removesuffix(".py").replace(os.sep, "."))


def decoder_config(args, dtype: torch.dtype) -> dict:
    """config.json fields of TransformerArgs and the dtype under the Llama family's shared names."""
    rope_scaling = None
    if args.rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": args.rope_scale_factor,
                        "low_freq_factor": args.rope_low_freq_factor,
                        "high_freq_factor": args.rope_high_freq_factor,
                        "original_max_position_embeddings": args.rope_original_max_seq_len}
    return {
        "hidden_size": args.dim,
        "intermediate_size": ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier),
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads or args.n_heads,
        "head_dim": head_dim(args), "vocab_size": args.vocab_size,
        "hidden_act": "silu", "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_scaling": rope_scaling,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "initializer_range": args.init_std,
        # HF needs only intermediate_size; these let load_hf give back the same args.
        "lingua_ffn": {"multiple_of": args.multiple_of,
                       "ffn_dim_multiplier": args.ffn_dim_multiplier},
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def read_config(config_path: Path) -> dict:
    try:
        return json.loads(Path(config_path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"Cannot read {config_path}: {e}. A Hugging Face model directory needs a "
                          "valid config.json.") from None


def decoder_problems(cfg: dict) -> List[str]:
    """What in a config makes its model compute something lingua's decoder shape does not."""
    return [f"hidden_act={cfg['hidden_act']}"] if cfg.get("hidden_act", "silu") != "silu" else []


def decoder_args(cfg: dict, config_path: Path) -> dict:
    """TransformerArgs fields (not the FFN's) from a config; a missing key raises KeyError."""
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    width = cfg.get("head_dim")   # None where it is dim / n_heads, so such args read back equal
    return dict(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                head_dim=None if width in (None, dim // n_heads) else width,
                n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                vocab_size=cfg["vocab_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6),
                max_seq_len=cfg.get("max_position_embeddings", 4096),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                init_std=cfg.get("initializer_range", 0.02), **rope_args(cfg, config_path))


def save_hf(model, model_args, path, dtype: Optional[torch.dtype], *, to_hf: Callable,
            hf_config: Callable, not_exported: Dict[str, str], where: str) -> None:
    """Write the model as a Hugging Face directory: `to_hf` names its tensors layer by layer,
    config.json from `hf_config(model_args, dtype)`. `where` names the map in refusals."""
    state = model.state_dict()
    check = partial(check_export, state, not_exported=not_exported, where=where, out_dir=path)
    hf_files.write_hf(path, state, lambda keys: state, args=model_args, dtype=dtype, to_hf=to_hf,
                      hf_config=hf_config, check=check)


def load_hf(path, dtype: Optional[torch.dtype], *, model_class, args_from_hf_config: Callable,
            key_map: Callable, not_imported: Dict[str, str], where: str):
    """(model on CPU, args) from an HF directory via `args_from_hf_config` and `key_map(args)`."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ConfigError(f"{config_path} is missing: {path} is not a Hugging Face model "
                          f"directory.")
    args = args_from_hf_config(config_path)
    names = key_map(args)
    ignored = {**not_imported, **(TIED_NOT_IMPORTED if args.tie_embeddings else {})}
    check_import(tensor_names(path), names.values(), ignored, where, path)
    with torch.device("meta"):
        model = model_class(args)
    check_filled(model.state_dict(), names, where, path)
    tensors, origin = read_weights(path)
    state = {ours: weight(tensors, theirs, path) for ours, theirs in names.items()}
    return assign(model, state, dtype, sources=names, origin=origin, path=path), args


def assign(model, state: dict, dtype: Optional[torch.dtype], *, sources: Dict[str, str],
           origin: Dict[str, Path], path):
    """`model`, built on the meta device, holding `state` read from the HF directory `path`. A
    tensor whose shape config.json does not imply is refused, named by its HF key (`sources`)
    and file (`origin`). dtype None keeps the file's; the routers' expert_bias stays fp32."""
    expected = model.state_dict()
    for key in [k for k in expected if k in state]:  # model order: errors name the first layer's
        t = state[key]
        if t.shape != expected[key].shape:
            theirs = sources.get(key)
            where = f"{origin[theirs]}: {theirs}" if theirs in origin else f"{path}: {key}"
            raise ConfigError(f"{where} gives {key} of shape {tuple(t.shape)} but config.json "
                              f"implies {tuple(expected[key].shape)}; the weights do not match the "
                              "config.")
        fp32 = key.endswith("expert_bias")  # routing decisions flip on small differences
        state[key] = t.to(torch.float32 if fp32 else (dtype or t.dtype)).contiguous()
    model.load_state_dict(state, strict=True, assign=True)
    model.init_rope("cpu")  # non-persistent, still on meta; init_weights would redraw the weights
    return model


def _frozen_base(ckpt_dir, reader: Optional[Callable]) -> Optional[str]:
    """The base a LoRA checkpoint leaves out, checked unchanged (None: it holds every weight)."""
    base = verified_base(ckpt_dir)
    if base is not None and reader is None:
        raise ConfigError(f"{ckpt_dir} holds the trained weights of a run over the frozen base "
                          f"{base}, and this command cannot read that base. Use the commands of "
                          f"the app that trained it (python -m apps.sft.hf, apps.sft.generate).")
    return base


def load_base(model, ckpt_dir, load_hf: Optional[Callable]) -> None:
    """A LoRA checkpoint's base (base.json), checked unchanged, into `model` (app's load_hf)."""
    base = _frozen_base(ckpt_dir, load_hf)
    if base is not None:
        model.load_state_dict(load_hf(base)[0].state_dict(), strict=False)


def checkpoint_reader(ckpt_dir, state: dict, base_key_map: Optional[Callable], args) -> Callable:
    """read(keys) -> values of a training checkpoint (only those tensors are read); the frozen
    base a LoRA checkpoint leaves out comes from the HF directory it names, via `base_key_map`."""
    verified(ckpt_dir)
    base = _frozen_base(ckpt_dir, base_key_map)
    saved = dcp.FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata
    base_names = base_key_map(args) if base is not None else {}

    def read(keys):
        values = {k: torch.empty_like(state[k], device="cpu") for k in keys}
        from_base = {k for k in keys if base is not None and f"model.{k}" not in saved}
        _dcp_load({"model": {k: v for k, v in values.items() if k not in from_base}},
                  Path(ckpt_dir))
        if from_base:
            hf_files.read_hf_tensors(base, {base_names[k]: values[k] for k in from_base})
        return values
    return read


def export(ckpt_dir, out_dir, dtype: Optional[torch.dtype], *, model_class, args_class,
           export_problems: Callable, to_hf: Callable, hf_config: Callable,
           not_exported: Dict[str, str], where: str, command: str,
           base_key_map: Optional[Callable] = None, shard_bytes: Optional[int] = None):
    """A training checkpoint (a run directory: its newest complete one) -> a Hugging Face
    directory with the tokenizer files; returns the model args. Refused, before any weight is
    read, for what `export_problems(args)` names. One safetensors file at a time."""
    ckpt_dir = resolve(ckpt_dir)
    run_config = read_run_config(ckpt_dir)
    try:
        args = args_class(**OmegaConf.to_container(run_config.model, resolve=True))
    except TypeError as e:
        raise ConfigError(f"{ckpt_dir}/config.yaml: its model section does not fit "
                          f"{args_class.__name__} ({e}); export it with the app that trained "
                          "it.") from None
    args.attn_backend = "sdpa"  # the export never runs attention; xformers would refuse on CPU
    refuse_unexportable(export_problems(args), command, ckpt_dir)
    with torch.device("meta"):
        state = model_class(args).state_dict()
    read = checkpoint_reader(ckpt_dir, state, base_key_map, args)
    check = partial(check_export, state, not_exported=not_exported, where=where, out_dir=out_dir)
    hf_files.write_hf(out_dir, state, read, args=args, dtype=dtype, to_hf=to_hf,
                      hf_config=hf_config, check=check, shard_bytes=shard_bytes)
    hf_files.write_tokenizer(run_config, out_dir)  # HF tools encode as we did
    hf_files.write_token_ids(run_config, out_dir)  # and generate() stops where we do
    return args


def export_cli(argv, prog: str, description: str, export, load_hf: Optional[Callable] = None):
    """`<prog> export <checkpoint_dir> <out_dir> [--dtype]`, one command line for every app's hf.py:
    `export(ckpt_dir, out_dir, dtype)` is the app's own; with the app's `load_hf`, also `<prog>
    import <hf_dir>`, which reads the directory as training would and prints the model section
    checkpoint.init_from sets from it. A bad input prints an `error:` line and exits, status 2."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="write a training checkpoint as a Hugging Face directory")
    p.add_argument("checkpoint_dir", help="a run directory (its newest complete checkpoint) or "
                                          "<dump_dir>/checkpoints/<step>")
    p.add_argument("out_dir")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: as trained (fp32)")
    if load_hf is not None:
        p = sub.add_parser("import", help="read a Hugging Face directory and print the model "
                                          "section checkpoint.init_from sets from it")
        p.add_argument("hf_dir")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "import":
            print(imported(ns.hf_dir, load_hf))
            return
        ckpt = resolve(ns.checkpoint_dir)
        export(ckpt, ns.out_dir, DTYPES.get(ns.dtype))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(wrote(ckpt, ns.out_dir))


def imported(hf_dir, load_hf: Callable) -> str:
    """What `import` prints: the directory read in full, and the model section training from it."""
    model, args = load_hf(hf_dir, dtype=None)
    n_params = sum(p.numel() for p in model.parameters())
    section = OmegaConf.to_yaml({"model": config.to_dict(args)})
    return (f"read {hf_dir}: {n_params:,} parameters, every tensor mapped. Train from it with "
            f"checkpoint.init_from={hf_dir} alone: the run sets this model section from the "
            f"directory by itself (shown for reference, nothing to copy; a model.* key typed on "
            f"the command line must agree with it):\n{section}")


def wrote(ckpt_dir, out_dir) -> str:
    """The export's line, with the architecture read back from the config.json it wrote."""
    try:
        archs = json.loads((Path(out_dir) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError):
        archs = None
    arch = ", ".join(archs) if archs else "a model (config.json names no architecture)"
    return f"wrote {arch} from {ckpt_dir}: {out_dir}/config.json and {out_dir}/model.safetensors"


# Training from a Hugging Face checkpoint (checkpoint.init_from): the trainer's side of it.
# RUNTIME_KEYS: model.* keys that say how the model runs, not its shape (config.json has none).
RUNTIME_KEYS = {"attn_backend", "attn_mask", "init_std", "depth_init", "max_seq_len"}


def shape_from_init_from(args, argv, args_from_hf_config: Callable) -> None:
    """With checkpoint.init_from a Hugging Face directory, model.* takes its config.json's shape
    (`args_from_hf_config`) and data.tokenizer its tokenizer.json (and chat template). A key the
    command line sets is kept, so that the check against the weights names it (data.tokenizer.path
    naming that tokenizer.json alone is the directory's)."""
    path = args.checkpoint.init_from
    config_json = Path(path) / "config.json" if path is not None else None
    if config_json is None or not config_json.is_file():
        return   # the app's checks say what is wrong (or apps/sft's debug inputs make it first)
    argv = sys.argv[1:] if argv is None else argv
    keys = {item.lstrip("+").split("=", 1)[0] for item in argv if "=" in item}
    given = {key.removeprefix("model.") for key in keys if key.startswith("model.")}
    for key, value in config.to_dict(args_from_hf_config(config_json)).items():
        if key not in RUNTIME_KEYS and key not in given:
            setattr(args.model, key, value)
    tokenizer_json, tok = Path(path) / "tokenizer.json", args.data.tokenizer
    named = {key for key in keys if key == "data.tokenizer" or key.startswith("data.tokenizer.")}
    # The directory's own tokenizer.json named without a kind is the directory's tokenizer, not
    # a file for the preset's kind (which may be bytes) to ignore.
    if named == {"data.tokenizer.path"} and tok.path and tokenizer_json.is_file() and \
            Path(tok.path).resolve() == tokenizer_json.resolve():
        named = set()
    if named:
        return
    if tokenizer_json.is_file():   # our byte tokenizer's export reads back as itself
        byte = hf_files.is_byte_tokenizer(tokenizer_json)
        tok.kind, tok.path = ("bytes", None) if byte else ("hf", str(tokenizer_json))
    elif _rank0():
        logging.getLogger(__name__).warning(
            "warning: %s has no tokenizer.json: training reads data with data.tokenizer.kind=%s "
            "(path %s); set data.tokenizer.path to the model's tokenizer.", path, tok.kind,
            tok.path)


def load_init_from(args, app, env):
    """Rank 0's state of checkpoint.init_from's model (None elsewhere), after every rank checked
    it is model.*'s; in the files' dtype, memory-mapped, read from disk when sent."""
    path = args.checkpoint.init_from
    hf_model, outcome = None, None
    if env.rank == 0:
        try:
            hf_model, outcome = app.load_hf(path, dtype=None)
        except Exception as err:  # every rank must stop, not wait for weights that never come
            outcome = err
    if env.world_size > 1:
        shared = outcome if not isinstance(outcome, BaseException) else (
            type(outcome).__name__, str(outcome), isinstance(outcome, ConfigError))
        shared = weights.broadcast_object(shared)
        if env.rank == 0 and isinstance(outcome, BaseException):
            raise outcome
        if isinstance(shared, tuple):
            kind, message, is_config = shared
            raise (ConfigError if is_config else RunError)(
                message if is_config else f"rank 0 could not read {path}: {kind}: {message}")
        outcome = shared
    elif isinstance(outcome, BaseException):
        raise outcome
    hf_args = outcome
    # Only what fixes the weights' shapes and meaning must agree; backends, masks and init
    # settings are the run's own choice.
    ours, theirs = config.to_dict(args.model), config.to_dict(hf_args)
    differing = {k: (ours[k], theirs.get(k)) for k in ours
                 if k not in RUNTIME_KEYS and ours[k] != theirs.get(k)}
    config.require(not differing,
                   f"checkpoint.init_from={args.checkpoint.init_from} holds a model that differs "
                   f"from model.* in (ours, theirs): {differing}. Set those model.* keys to "
                   f"the checkpoint's values.")
    return hf_model.state_dict() if hf_model is not None else None
