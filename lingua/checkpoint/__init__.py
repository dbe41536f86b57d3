"""Distributed checkpoints (DCP) that are either complete or invisible, and resume from the newest.
Everything is written into `<step>.tmp-<nonce>/` and renamed by rank 0 once every rank is done
(manifest.json, sizes and CRC-32s, last): a crash leaves a `.tmp-` directory, which resume ignores
and the next start removes; resume falls back past a damaged checkpoint (integrity.py)."""

import io
import json
import logging
import os
import random
import shutil
import time
import warnings
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lingua.checkpoint.frozen_base import (  # noqa: F401 (the API: checkpoint.<name>)
    BASE_RECORD,
    base_fingerprint,
    frozen_base,
    read_base,
    verified_base,
)
from lingua.checkpoint.integrity import (  # noqa: F401 (newest_verified: API)
    MANIFEST,
    STEP_DIR,
    InUse,
    _all_gather,
    checkpoints_dir,
    describe,
    newest_verified,
    prune,
    step_dirs,
    verified,
    verify,
)
from lingua.errors import ConfigError, RunError
from lingua.parallel import groups

logger = logging.getLogger(__name__)


@dataclass
class CheckpointArgs:
    every: int = 0                  # save every N steps (0: only at the end of training)
    keep: int = 3                   # keep the newest N checkpoints (0: keep all)
    save_final: bool = True         # also save after the last step
    init_from: Optional[str] = None  # a Hugging Face directory to initialise weights from
    # Write periodic checkpoints while the next steps run (not `async`, a Python keyword): only
    # the copy to CPU memory holds up training. See `save_async`.
    async_save: bool = False


def validate_args(args: CheckpointArgs) -> None:
    if args.every < 0:
        raise ConfigError(f"checkpoint.every={args.every} must be 0 (only at the end) or positive.")
    if args.keep < 0:
        raise ConfigError(f"checkpoint.keep={args.keep} must be 0 (keep all) or positive.")
    if args.init_from is not None and not Path(args.init_from).is_dir():
        raise ConfigError(f"checkpoint.init_from={args.init_from} is not a directory. Give a "
                          f"Hugging Face model directory (config.json + *.safetensors).")


def list_complete(dump_dir) -> list:
    """Complete checkpoints, oldest first (renamed step directories holding DCP metadata)."""
    return [p for p in step_dirs(checkpoints_dir(dump_dir)) if (p / ".metadata").is_file()]


def newest(dump_dir, warn: bool = True) -> Optional[Path]:
    """The newest checkpoint whose files have the manifest's sizes (a quick look, before any
    process group; resume checksums through `newest_verified`)."""
    for ckpt in reversed(step_dirs(checkpoints_dir(dump_dir))):
        problem = verify(ckpt, checksums=False)
        if problem is None:
            return ckpt
        if warn:
            logger.warning("skipping damaged checkpoint %s: %s; trying the one before", ckpt,
                           problem)
    return None


def remove_unfinished(dump_dir) -> None:
    """Delete what killed saves left; at start, under lingua.train.dump_lock: none in flight."""
    for tmp in sorted(p for p in checkpoints_dir(dump_dir).glob("*.tmp-*") if p.is_dir()):
        size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        shutil.rmtree(tmp, ignore_errors=True)
        logger.warning("removed %s (%.1f MB), a save its run was stopped in", tmp, size / 1e6)


def resolve(target, in_run: bool = False) -> Path:
    """The checkpoint a command line means: a run directory means its newest complete one.
    `in_run`: it must sit in its run (eval writes results beside the run's metrics)."""
    path = Path(target)
    in_checkpoints = path.parent.name == "checkpoints" and STEP_DIR.match(path.name)
    if not path.exists():
        if in_checkpoints and path.parent.parent.is_dir():
            have = [p.name for p in list_complete(path.parent.parent)]
            raise ConfigError(f"no checkpoint {path.name} in {path.parent}; the run has: "
                              f"{', '.join(have) or 'none'}. Give one of those, or the run "
                              f"directory {path.parent.parent} for its newest complete checkpoint.")
        raise ConfigError(f"{target} does not exist: give a run directory (dump_dir) or one of "
                          f"its checkpoints, <dump_dir>/checkpoints/<step>.")
    # DCP's metadata or our manifest: a damaged checkpoint is still one (loading names the damage)
    holds = (path / ".metadata").is_file() or (path / MANIFEST).is_file()
    if path.is_dir() and (holds or in_checkpoints):
        if in_run and not in_checkpoints:
            raise ConfigError(f"{target} is a checkpoint outside a run directory: results are "
                              f"written beside the run's metrics, so give the checkpoint inside "
                              f"its run directory (<dump_dir>/checkpoints/<step>).")
        return path
    if path.name == "checkpoints" and path.is_dir():
        path = path.parent
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        ckpt = newest(path)
        if ckpt is None:
            raise ConfigError(f"{target} has no complete checkpoint (no {path}/checkpoints/<step> "
                              f"with its files): train it with checkpoint.every set, or give "
                              f"another run directory.")
        return ckpt
    raise ConfigError(f"{target} is neither a run directory (dump_dir, holding config.yaml and "
                      f"checkpoints/) nor a checkpoint (<dump_dir>/checkpoints/<step>, holding "
                      f"config.yaml, manifest.json and the DCP files). Give the dump_dir of a "
                      f"training run, or one of its checkpoints.")


def read_run_config(ckpt_dir) -> DictConfig:
    path = Path(ckpt_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {ckpt_dir} is not a checkpoint written by this "
                          f"project (each checkpoint directory holds its run's config.yaml). Give "
                          f"a directory like <dump_dir>/checkpoints/<step>.")
    return OmegaConf.load(path)


def quiet_single_process_dcp() -> None:
    """Ignore DCP's one-process warning (our intent). A filter, not catch_warnings: dcp.async_save
    saves in its own thread; installed before each call as pytest resets filters."""
    warnings.filterwarnings("ignore", r"torch\.distributed is disabled, unavailable or "
                            r"uninitialized, assuming the intent is to (save|load) in a single "
                            r"process", UserWarning, r"torch\.distributed\.checkpoint")


def _dcp_load(state: dict, ckpt_dir: Path) -> None:
    quiet_single_process_dcp()
    try:
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as err:  # DCP wraps mismatches in a CheckpointException
        err = _root_cause(err)
        raise ConfigError(f"Could not load checkpoint {ckpt_dir}: {str(err).strip()[:2000]}\n"
                          f"The checkpoint does not match the model being built (different "
                          f"model config?) or is damaged. Use a matching config, or another "
                          f"dump_dir.") from None


def load_model_state(ckpt_dir, model: nn.Module) -> None:
    """Load the 'model' entry into a plain model, e.g. for generation. A checkpoint without its
    frozen base (base.json) loads the trained weights only, over a model that holds the base."""
    verified(ckpt_dir)
    without_base = read_base(ckpt_dir) is not None
    state = {"model": _model_state(model, without_base)}
    _dcp_load(state, Path(ckpt_dir))
    model.load_state_dict(state["model"], strict=not without_base)


def check_resume_compatible(dump_dir, run_config: dict, keys=("model",)) -> Optional[Path]:
    """Before any work: refuse a dump_dir whose newest checkpoint was made with other values of
    `keys` (dotted keys or whole sections). Quiet about damaged ones: resume warns, once."""
    ckpt = newest(dump_dir, warn=False)
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
            differing += [(f"{key}.{k}", old.get(k), new.get(k))
                          for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
        elif old != new:
            differing.append((key, old, new))
    if differing:
        details = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, a, b in differing[:8])
        raise ConfigError(
            f"dump_dir={dump_dir} holds a checkpoint ({ckpt}) of a different model or data stream "
            f"({details}). Resuming would mix two runs. Use another dump_dir for this run, or the "
            f"same settings to resume that one. Nothing was changed on disk.")
    return ckpt


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# Optimizer state keyed by parameter name ("state.layers.3.attention.wq.weight.exp_avg"), so the
# state of several model parts merges into one dict and loads into any other layout.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _model_state(part: nn.Module, without_frozen: bool) -> dict:
    state = get_model_state_dict(part)
    if without_frozen:   # frozen weights come from the base (base.json), not the checkpoint
        frozen = {name for name, p in part.named_parameters() if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def _union(dicts) -> dict:
    return {k: v for d in dicts for k, v in d.items()}


def save(dump_dir, step: int, parts: list, optimizers: list, train_state: dict,
         config_yaml: str, rank: int, world_size: int, keep: int,
         in_use: Optional[InUse] = None, base: Optional[dict] = None, background: bool = False):
    """Collective. If any rank cannot write, every rank raises RunError after the half-written
    directory is removed. `base`: the frozen weights are left out, base.json names them.
    `background`: returns the PendingSave once the state is copied to CPU memory; the checkpoint
    is visible once every rank called `finish` at the same step boundary."""
    ckpt = PendingSave(dump_dir, step, train_state, config_yaml, rank, world_size, keep, in_use,
                       base)
    error = ckpt.open()
    if error is None:
        quiet_single_process_dcp()
        state = {"model": _union(_model_state(part, base is not None) for part in parts),
                 "optim": _union(get_optimizer_state_dict(part, optimizer, options=_FLAT)
                                 for part, optimizer in zip(parts, optimizers))}
        try:
            if background:
                started = time.perf_counter()
                upload = dcp.async_save(state, checkpoint_id=str(ckpt.tmp), no_dist=world_size == 1,
                                        process_group=_async_group() if world_size > 1 else None)
                # A Future; an AsyncSaveResponse only with a stager that copies in the background.
                ckpt.start(getattr(upload, "upload_completion", upload))
                if rank == 0:
                    logger.info("checkpoint %s: state copied to CPU memory in %.2f s, written "
                                "while training goes on", ckpt.final, time.perf_counter() - started)
            else:
                dcp.save(state, checkpoint_id=str(ckpt.tmp), no_dist=world_size == 1)
        except (Exception, CheckpointException) as err:
            # DCP raises the same CheckpointException (a BaseException) on every rank.
            error = _root_cause(err)
    if background:
        # Every rank is writing, or none goes on (a rank that could not copy its state would
        # leave the others' writers waiting for it).
        error = _first_error(error, world_size)
        if error is not None:
            ckpt.close(error, {})   # raises RunError
        return ckpt
    described = {}
    if error is None:
        try:
            described = ckpt.write_own()
        except OSError as err:
            error = err
    return ckpt.close(error, described)


def save_async(*args, **kwargs) -> "PendingSave":
    return save(*args, **kwargs, background=True)


class PendingSave:
    """One checkpoint from `<step>.tmp-<nonce>/` to `<step>/`: `open`, fill (here or after
    `start`, in the background), then `close` makes it visible or removes it."""

    def __init__(self, dump_dir, step: int, train_state: dict, config_yaml: str, rank: int,
                 world_size: int, keep: int, in_use: Optional[InUse] = None,
                 base: Optional[dict] = None):
        self.dump_dir, self.step, self.config_yaml, self.base = dump_dir, step, config_yaml, base
        self.rank, self.world_size, self.keep, self.in_use = rank, world_size, keep, in_use
        self.root = checkpoints_dir(dump_dir)
        self.final = self.root / str(step)
        self.tmp: Optional[Path] = None
        # Serialized now: the train state of this step, whenever the files are written.
        buffer = io.BytesIO()
        torch.save(dict(train_state, rng=rng_state(), world_size=world_size), buffer)
        self.own_state = buffer.getvalue()
        self.writing: Optional[futures.Future] = None   # the background write (save_async)

    def open(self) -> Optional[BaseException]:
        """Collective: the tmp directory, made by rank 0; every rank's view of any failure."""
        # All ranks must write into the same tmp dir: rank 0 picks the nonce.
        nonce = [os.urandom(4).hex()]
        if self.world_size > 1:
            dist.broadcast_object_list(nonce, src=0)
        self.tmp = self.root / f"{self.step}.tmp-{nonce[0]}"
        error = None
        try:
            if self.rank == 0:
                self.tmp.mkdir(parents=True, exist_ok=False)
        except OSError as err:
            error = err
        return _first_error(error, self.world_size)

    def write_own(self) -> dict:
        """This rank's train state file; then the manifest entries of every file it wrote."""
        (self.tmp / f"train_state_rank{self.rank}.pt").write_bytes(self.own_state)
        mine = [p for p in self.tmp.iterdir()
                if p.name.startswith((f"__{self.rank}_", f"train_state_rank{self.rank}."))]
        return describe(mine)

    def start(self, upload: futures.Future) -> None:
        """Write in the background: DCP's upload, then this rank's train state and checksums
        (reading the shards back for the CRC-32 is not left to the training loop either)."""
        def write():
            upload.result()   # raises what the DCP write raised
            return self.write_own()

        executor = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lingua-checkpoint")
        self.writing = executor.submit(write)
        executor.shutdown(wait=False)   # the thread ends after this one job

    def finish(self, block: bool, all_written: bool = False) -> Optional[Path]:
        """Collective while the write is pending (every rank, same step boundaries). Without
        `block`, None unless every rank's write is done (`all_written`); then `close`."""
        if self.writing is None:
            return self.final
        if block:
            futures.wait([self.writing])
        elif not all_written:
            return None
        writing, self.writing = self.writing, None
        error = writing.exception()
        if error is not None:
            return self.close(_root_cause(error), {})
        return self.close(None, writing.result())

    def written_here(self) -> bool:
        return self.writing is None or self.writing.done()

    def close(self, error: Optional[BaseException], described: dict) -> Path:
        """Collective: with no error on any rank, rank 0 writes config.yaml and the manifest,
        renames to `<step>/` and prunes; else every rank raises RunError, the directory removed."""
        rank, world_size, tmp, final = self.rank, self.world_size, self.tmp, self.final
        error = _first_error(error, world_size)
        if error is None:
            gathered = _all_gather(described) if world_size > 1 else [described]
            if rank == 0:
                try:
                    (tmp / "config.yaml").write_text(self.config_yaml)
                    own = [tmp / ".metadata", tmp / "config.yaml"]
                    if self.base is not None:
                        (tmp / BASE_RECORD).write_text(json.dumps(self.base, indent=1))
                        own.append(tmp / BASE_RECORD)
                    files = _union([*gathered, describe(own)])
                    (tmp / MANIFEST).write_text(json.dumps({"step": self.step, "files": files},
                                                           indent=1))
                    if final.exists():  # a checkpoint of the same step from an earlier attempt
                        shutil.rmtree(final)
                    os.rename(tmp, final)
                except OSError as err:
                    error = err
            error = _first_error(error, world_size)
        if error is not None:
            if rank == 0 and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = newest(self.dump_dir)
            kept = (f"the previous checkpoint {previous} is intact" if previous
                    else "no earlier checkpoint exists")
            raise RunError(f"Could not write checkpoint {final}: {error}. Nothing of it was kept; "
                           f"{kept}. Free disk space (or make {self.root} writable, or point "
                           f"dump_dir at a filesystem with room), then run the same command to "
                           f"resume.") from None
        if rank == 0:
            logger.info("saved checkpoint %s", final)
        _barrier(world_size)
        if rank == 0:   # after the barrier: the others go on while an old checkpoint is deleted
            self._prune()
        return final

    def _prune(self) -> None:
        """A failure only costs disk space (the next save prunes again): the run goes on."""
        try:
            prune(self.root, self.keep, self.in_use, newest=self.final)
        except Exception as err:   # a vanished directory, a failing in_use, ...
            logger.warning("could not prune old checkpoints in %s (%s: %s); the next save "
                           "tries again", self.root, type(err).__name__, err)


# A background write's DCP collectives get a gloo group of their own: on the default group they
# would interleave with the training loop's in an order that differs between ranks (a hang), and
# dcp.async_save needs a CPU backend. Made once per default group, at start (prepare_async_saves).
_ASYNC_GROUP: list = [None, None]   # [default group it belongs to, the gloo group]


def prepare_async_saves(args: CheckpointArgs, world_size: int) -> None:
    """Collective: the background writes' gloo group now, so a rank fails at start, not mid-run."""
    if args.async_save and world_size > 1:
        _async_group()


def _async_group():
    world = dist.group.WORLD
    if _ASYNC_GROUP[0] is not world:
        _ASYNC_GROUP[:] = [world, dist.new_group(backend="gloo", timeout=groups.world_timeout())]
    return _ASYNC_GROUP[1]


def _root_cause(err: BaseException) -> BaseException:
    """DCP's CheckpointException holds each failed rank's exception (and a traceback per rank in
    its text): keep the first underlying one, which says what went wrong (e.g. ENOSPC)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))   # (exception, traceback summary)
        return first[0] if isinstance(first, tuple) else first
    return err


def _first_error(error: Optional[BaseException], world_size: int) -> Optional[BaseException]:
    """Make every rank see a failure on any rank (so none waits forever in a later collective)."""
    if world_size == 1:
        return error
    flags = _all_gather(None if error is None else f"{type(error).__name__}: {error}")
    failed = [f"rank {r}: {msg}" for r, msg in enumerate(flags) if msg is not None]
    if error is None and failed:
        return OSError("; ".join(failed))
    return error


def load(ckpt_dir: Path, parts: list, optimizers: list, rank: int, world_size: int) -> dict:
    """Collective: restore model parts, optimizers and RNG; return this rank's train state."""
    load_model(ckpt_dir, parts, optimizers)
    train_state = torch.load(ckpt_dir / "train_state_rank0.pt", weights_only=True)
    same_layout = train_state["world_size"] == world_size
    # On another layout the per-rank files do not line up with the ranks: keep rank 0's, which
    # holds everything a global-index loader needs (the data loader refuses it if it cannot).
    own = ckpt_dir / f"train_state_rank{rank}.pt"
    if rank != 0 and same_layout and own.is_file():
        train_state = torch.load(own, weights_only=True)
    if same_layout:
        set_rng_state(train_state["rng"])
    logger.info("resumed from %s (step %d)", ckpt_dir, train_state["step"])
    return train_state


def load_model(ckpt_dir: Path, parts: list, optimizers: Optional[list] = None) -> None:
    """Collective: weights (and optimizer states) into parts of any layout (DCP reshards). A
    checkpoint without its frozen base loads over parts that hold the base already."""
    without_base = read_base(ckpt_dir) is not None
    strict = StateDictOptions(strict=not without_base)
    models = [_model_state(part, without_base) for part in parts]
    optims = [get_optimizer_state_dict(part, optimizer, options=_FLAT)
              for part, optimizer in zip(parts, optimizers or [])]
    state = {"model": _union(models), **({"optim": _union(optims)} if optimizers else {})}
    _dcp_load(state, Path(ckpt_dir))  # in place; non-tensor entries are replaced in `state`
    for part, own in zip(parts, models):
        set_model_state_dict(part, {k: state["model"][k] for k in own}, options=strict)
    for part, optimizer, own in zip(parts, optimizers or [], optims):
        set_optimizer_state_dict(part, optimizer, {k: state["optim"][k] for k in own},
                                 options=_FLAT)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()
