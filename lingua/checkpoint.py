"""Distributed checkpoints (DCP) that are either complete or invisible, and resume from the newest.

Layout of one checkpoint, `<dump_dir>/checkpoints/<step>/`:
  - DCP files of {"model": ..., "optim": ...} (full parameter names, so any parallel layout can
    load them: DCP reshards on load),
  - `train_state_rank<r>.pt`: step, data-loader state, scheduler and RNG of rank r (plain tensors
    and numbers, loaded with weights_only=True),
  - `config.yaml`: the run's resolved config, so a checkpoint is self-describing (export, generate).
Everything is written into `<step>.tmp-<nonce>/` and renamed to `<step>/` by rank 0 after all ranks
finished writing; a rename is atomic, so a crash mid-write leaves only a `.tmp` directory, which
resume ignores. A directory named after a step is therefore always complete.
"""

import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

from lingua.errors import ConfigError

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^\d+$")


@dataclass
class CheckpointArgs:
    every: int = 0                  # save every N steps (0: only at the end of training)
    keep: int = 3                   # keep the newest N checkpoints (0: keep all)
    save_final: bool = True         # also save after the last step
    init_from: Optional[str] = None # a Hugging Face directory to initialise weights from (fine-tuning)


def validate_args(args: CheckpointArgs) -> None:
    if args.every < 0:
        raise ConfigError(f"checkpoint.every={args.every} must be 0 (only at the end) or positive.")
    if args.keep < 0:
        raise ConfigError(f"checkpoint.keep={args.keep} must be 0 (keep all) or positive.")
    if args.init_from is not None and not Path(args.init_from).is_dir():
        raise ConfigError(f"checkpoint.init_from={args.init_from} is not a directory. Give a "
                          f"Hugging Face model directory (config.json + *.safetensors).")


def checkpoints_dir(dump_dir) -> Path:
    return Path(dump_dir) / "checkpoints"


def list_complete(dump_dir) -> list:
    """Complete checkpoints, oldest first (only renamed step directories holding DCP metadata)."""
    root = checkpoints_dir(dump_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)
             and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: int(p.name))


def newest(dump_dir) -> Optional[Path]:
    found = list_complete(dump_dir)
    return found[-1] if found else None


def read_run_config(ckpt_dir) -> DictConfig:
    path = Path(ckpt_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {ckpt_dir} is not a checkpoint written by this "
                          f"project (each checkpoint directory holds its run's config.yaml). Give "
                          f"a directory like <dump_dir>/checkpoints/<step>.")
    return OmegaConf.load(path)


def _dcp_load(state: dict, ckpt_dir: Path) -> None:
    try:
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=not dist.is_initialized())
    except Exception as err:  # DCP wraps shape/key mismatches in a CheckpointException
        raise ConfigError(f"Could not load checkpoint {ckpt_dir}: {str(err).strip()[:2000]}\n"
                          f"The checkpoint does not match the model being built (different "
                          f"model config?) or is damaged. Use a matching config, or another "
                          f"dump_dir.") from None


def load_model_state(ckpt_dir, model: nn.Module) -> None:
    """Load the 'model' entry into a plain model, e.g. for export or generation."""
    state = {"model": model.state_dict()}
    _dcp_load(state, Path(ckpt_dir))
    model.load_state_dict(state["model"])


def check_resume_compatible(dump_dir, run_config: dict, keys=("model",)) -> Optional[Path]:
    """Before any work: refuse a dump_dir whose newest checkpoint was made with other values of
    `keys` (dotted config keys or whole sections, e.g. the model)."""
    ckpt = newest(dump_dir)
    if ckpt is None:
        return None
    saved = OmegaConf.create(OmegaConf.to_container(read_run_config(ckpt), resolve=True))
    now = OmegaConf.create(run_config)
    differing = []
    for key in keys:
        old, new = OmegaConf.select(saved, key), OmegaConf.select(now, key)
        if isinstance(old, DictConfig) or isinstance(new, DictConfig):
            old = OmegaConf.to_container(old) if isinstance(old, DictConfig) else {}
            new = OmegaConf.to_container(new) if isinstance(new, DictConfig) else {}
            differing += [(f"{key}.{k}", old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
                          if old.get(k) != new.get(k)]
        elif old != new:
            differing.append((key, old, new))
    if differing:
        details = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, a, b in differing[:8])
        raise ConfigError(
            f"dump_dir={dump_dir} holds a checkpoint ({ckpt}) of a different model or data stream "
            f"({details}). Resuming would mix two runs. Use another dump_dir for this run, or the "
            f"same settings to resume that one. Nothing was changed on disk.")
    return ckpt


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# Optimizer state keyed by parameter name ("state.layers.3.attention.wq.weight.exp_avg"), so the
# state of several model parts merges into one dict and loads into any other layout.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _part_states(parts: list, optimizers: list) -> list:
    return [(get_model_state_dict(part), get_optimizer_state_dict(part, optimizer, options=_FLAT))
            for part, optimizer in zip(parts, optimizers)]


def _merged(part_states: list) -> dict:
    state = {"model": {}, "optim": {}}
    for model, optim in part_states:
        state["model"].update(model)
        state["optim"].update(optim)
    return state


def save(dump_dir, step: int, parts: list, optimizers: list, train_state: dict,
         config_yaml: str, rank: int, world_size: int, keep: int) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    root = checkpoints_dir(dump_dir)
    final = root / str(step)
    # All ranks must write into the same tmp dir: rank 0 picks the nonce.
    nonce = [os.urandom(4).hex()]
    if world_size > 1:
        dist.broadcast_object_list(nonce, src=0)
    tmp = root / f"{step}.tmp-{nonce[0]}"
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    _barrier(world_size)
    dcp.save(_merged(_part_states(parts, optimizers)), checkpoint_id=str(tmp),
             no_dist=world_size == 1)
    own = dict(train_state, rng=_rng_state(), world_size=world_size)
    torch.save(own, tmp / f"train_state_rank{rank}.pt")
    _barrier(world_size)
    if rank == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        if final.exists():  # a checkpoint of the same step from an earlier attempt: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _prune(root, keep)
        logger.info("saved checkpoint %s", final)
    _barrier(world_size)
    return final


def _prune(root: Path, keep: int) -> None:
    if keep <= 0:
        return
    complete = sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                      key=lambda p: int(p.name))
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load(ckpt_dir: Path, parts: list, optimizers: list, rank: int, world_size: int) -> dict:
    """Collective: restore model parts, optimizers and RNG; return this rank's train state.
    DCP reshards: the checkpoint may come from any other parallel layout."""
    part_states = _part_states(parts, optimizers)
    state = _merged(part_states)
    _dcp_load(state, ckpt_dir)  # in place; non-tensor entries are replaced in `state`
    for part, optimizer, (own_model, own_optim) in zip(parts, optimizers, part_states):
        set_model_state_dict(part, {k: state["model"][k] for k in own_model})
        set_optimizer_state_dict(part, optimizer, {k: state["optim"][k] for k in own_optim},
                                 options=_FLAT)
    train_state = torch.load(ckpt_dir / "train_state_rank0.pt", weights_only=True)
    same_layout = train_state["world_size"] == world_size
    # On another layout the per-rank files do not line up with the ranks: keep rank 0's, which
    # holds everything a global-index loader needs (the data loader refuses it if it cannot).
    own = ckpt_dir / f"train_state_rank{rank}.pt"
    if rank != 0 and same_layout and own.is_file():
        train_state = torch.load(own, weights_only=True)
    if same_layout:
        _set_rng_state(train_state["rng"])
    logger.info("resumed from %s (step %d)", ckpt_dir, train_state["step"])
    return train_state


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()
