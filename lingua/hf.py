"""Hugging Face interop machinery shared by the apps: reading safetensors files and config fields
(RoPE, SwiGLU width), and the checks that nothing is dropped. What names map to what is each
app's own: its hf.py (apps/llama/hf.py for LlamaForCausalLM, apps/moe/hf.py for Mixtral and
GLM-4.5 MoE) holds its key map and config.

Nothing is dropped silently in either direction. The app's key map is the source of truth: on
export every tensor of the model's state dict must be mapped or be on the app's NOT_EXPORTED list
(`check_export`), on import every tensor in the safetensors files must be consumed by the map or
be on its NOT_IMPORTED list (`check_import`). Both lists map a regular expression (matched against
the whole name) to the reason the tensor may be left out, so a fork that adds a weight (QK-norm,
biases) is told which file to edit instead of getting a Hugging Face model without it.
"""

import json
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lingua.errors import ConfigError
from lingua.transformer import ffn_hidden_dim

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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
            raise ConfigError(f"{f} is listed in {index} but missing; copy the complete model directory.")
    return files


def tensor_names(path: Path) -> Dict[str, Path]:
    """Every tensor name in the directory's safetensors files -> its file, from the headers alone
    (no tensor data is read), so a refusal costs nothing however large the checkpoint."""
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


# ---------------------------------------------------------------------------------------------
# Nothing dropped silently


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _listed(names: Iterable[str], limit: int = 10) -> str:
    names = sorted(names, key=_natural)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _allowed(name: str, allow_list: Dict[str, str]) -> bool:
    return any(re.fullmatch(pattern, name) for pattern in allow_list)


def app_file(module_file: str) -> str:
    """An app's hf.py as the user would open it: relative to the repository when it lies inside
    (apps/<app>/hf.py, a fork's own name included), else as given."""
    f = Path(module_file).resolve()
    try:
        return str(f.relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return str(f)


def check_export(state_keys: Iterable[str], exported: Iterable[str], not_exported: Dict[str, str],
                 where: str, out_dir) -> None:
    """Refuse (before anything is written) a model with a state-dict tensor the export would leave
    out: neither mapped (`exported`) nor on the app's NOT_EXPORTED list. `where` names the map:
    "key_map in apps/llama/hf.py"."""
    exported = set(exported)
    unmapped = [k for k in state_keys if k not in exported and not _allowed(k, not_exported)]
    if unmapped:
        raise ConfigError(
            f"save_hf: {len(unmapped)} tensor(s) of the model have no Hugging Face name, so the export would "
            f"silently lack them: {_listed(unmapped)}. Map each one to its Hugging Face name in {where} "
            "(load_hf reads the same map back), or, for a buffer that is derived or runtime state with no Hugging "
            "Face equivalent, add a pattern for it with the reason to NOT_EXPORTED in that file. "
            f"Nothing was written to {out_dir}.")


def check_filled(state_keys: Iterable[str], filled: Iterable[str], where: str, path) -> None:
    """Refuse a model with a state-dict tensor the import gives no value (a fork's new weight)."""
    filled = set(filled)
    empty = [k for k in state_keys if k not in filled]
    if empty:
        raise ConfigError(
            f"load_hf: {len(empty)} tensor(s) of the model get no value from {path}: {_listed(empty)}. Map each "
            f"one to its Hugging Face name in {where}, or, if a Hugging Face model of this architecture has no "
            "such weight, this directory cannot initialise the model.")


def check_import(names: Dict[str, Path], consumed: Iterable[str], not_imported: Dict[str, str],
                 where: str, path) -> None:
    """Refuse a directory whose safetensors files hold a tensor the import would drop: neither
    consumed by the app's map nor on its NOT_IMPORTED list. `names`: tensor_names(path)."""
    consumed = set(consumed)
    dropped = [k for k in names if k not in consumed and not _allowed(k, not_imported)]
    if dropped:
        files = sorted({names[k].name for k in dropped})
        raise ConfigError(
            f"{path}: {len(dropped)} tensor(s) in {', '.join(files)} have no place in the model, so loading would "
            f"silently drop them: {_listed(dropped)}. Either config.json describes fewer layers or experts than "
            "the files hold, or the checkpoint has weights this architecture lacks (biases, extra norms?): use an "
            f"app whose model has them, or add them to the model and map them in {where}; a tensor that is derived "
            "and recomputed on load can go on NOT_IMPORTED in that file with the reason.")
