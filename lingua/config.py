"""Hydra glue: compose a run's config from a preset and command-line overrides, check it, dump it.

Hydra's compose API, not `@hydra.main` (under torchrun its per-process output directory and
chdir race). A preset (`configs/<app>/*.yaml`) starts its defaults with the app's dataclass schema,
so unknown keys and wrong types are refused; stool calls the same `load` before queueing a job.
"""

import contextlib
import dataclasses
import difflib
import importlib
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Type, TypeVar

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import KeyValidationError, OmegaConfBaseException, ValidationError

from lingua.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"

T = TypeVar("T")


def register_schema(name: str, schema: Type) -> None:
    """Make `schema` usable as `- <name>` in a preset's defaults list."""
    ConfigStore.instance().store(name=name, node=schema)


def _unalias(override: str) -> str:
    """The contract's spellings (shared/DESIGN.md) that name no field: `checkpoint.async=B` is
    checkpoint.async_save=B, `eval.async=true|false` is eval.mode=async|inline (Python keywords),
    `optim.spike=P` is spikes.policy=P (the section it moved to)."""
    key, eq, value = override.partition("=")
    bare = key.lstrip("+~")
    prefix = key[:len(key) - len(bare)]
    if bare == "checkpoint.async":
        return f"{prefix}checkpoint.async_save{eq}{value}"
    if bare == "optim.spike":
        return f"{prefix}spikes.policy{eq}{value}"
    if bare == "eval.async":
        mode = {"true": "async", "false": "inline"}.get(value.strip().lower(), value)
        return f"{prefix}eval.mode{eq}{mode}"
    return override


# Keys that moved: the old name on a command line or in a preset is refused naming the new one;
# a run directory's config.yaml that has it is read under the new name (`migrate`).
_SPIKE_KEYS = ("on", "rule", "factor", "sigmas", "window", "warmup", "skip_before", "skip_after",
               "max_rollbacks", "max_skips")
_MUON_KEYS = ("lr", "momentum", "nesterov", "ns_steps", "adjust_lr_fn", "ns_dtype")
MOVED = {"optim.spike": "spikes.policy", "logging.spike_factor": "spikes.factor",
         "logging.spike_window": "spikes.window",
         **{f"optim.spike_{k}": f"spikes.{k}" for k in _SPIKE_KEYS},
         **{f"optim.muon_{k}": f"optim.muon.{k}" for k in _MUON_KEYS}}


def _moved_error(key: str) -> ConfigError:
    new = MOVED[key]
    return ConfigError(f"{key} was moved to {new} (the `{new.rpartition('.')[0]}` section). "
                       f"Write {new}=... instead.")


def migrate(saved: DictConfig) -> DictConfig:
    """A run directory's config.yaml with moved keys under their new names (a null dropped)."""
    for old, new in MOVED.items():
        section, _, key = old.rpartition(".")
        node = OmegaConf.select(saved, section)
        if isinstance(node, DictConfig) and key in node:
            value = node.pop(key)
            if value is not None:
                OmegaConf.update(saved, new, value, force_add=True)
    return saved


def split_argv(argv: Sequence[str], default_preset: str) -> tuple:
    """Separate the preset choice (`config=NAME` or `--config-name NAME`) from Hydra overrides."""
    preset, overrides, args = default_preset, [], iter(argv)
    for arg in args:
        if arg.startswith(("config=", "--config-name=")):
            preset = arg.split("=", 1)[1]
        elif arg in ("--config-name", "-cn"):
            preset = next(args, None)
            if preset is None:
                raise ConfigError(f"{arg} needs a preset name after it, e.g. `{arg} debug`.")
        elif (key := _unalias(arg).partition("=")[0].lstrip("+~")) in MOVED:
            raise _moved_error(key)
        else:
            overrides.append(_unalias(arg))
    return preset, overrides


def _preset_location(app: str, preset: str) -> tuple:
    """(config dir, config name) for a preset given by name (configs/<app>/NAME.yaml) or path."""
    as_path = Path(preset)
    if preset.endswith((".yaml", ".yml")) or as_path.is_file():
        if not as_path.is_file():
            raise ConfigError(f"Config file {preset} does not exist. Give an existing YAML "
                              f"file or a preset name from {CONFIG_DIR / app} (without .yaml).")
        return str(as_path.resolve().parent), as_path.stem
    app_dir = CONFIG_DIR / app
    if not (app_dir / f"{preset}.yaml").is_file():
        known = sorted(p.stem for p in app_dir.glob("*.yaml"))
        raise ConfigError(f"Unknown preset config={preset} for app '{app}'. Known presets in "
                          f"{app_dir}: {', '.join(known) or 'none'}. Pick one of them or give a "
                          f"path to a YAML file.")
    return str(app_dir), preset


def _explain_compose_error(err: Exception, overrides: Sequence[str], known: Sequence[str],
                           maps: Sequence[str]) -> str:
    text = str(err).strip()
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text += "\n" + str(cause).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    hint = ("Check the key's spelling and type against the schema: the dataclasses in "
            "lingua/*/*.py and apps/<app>/*.py list every key with its type and default. "
            "To add a key that is not in the schema, change the dataclass, not the command line.")
    full_key = getattr(cause, "full_key", None) or getattr(err, "full_key", None)
    key_part = f" (key: {full_key})" if full_key else ""
    if full_key in MOVED:
        return str(_moved_error(full_key))
    if full_key and full_key not in known and not any(full_key.startswith(k + ".") for k in maps):
        close = difflib.get_close_matches(full_key, known, n=2, cutoff=0.8)
        if close:
            hint = f"Did you mean {' or '.join(close)}? " + hint
    # Hydra's "To append to your config use +key=value" does not apply: the schema is closed;
    # OmegaConf's indented full_key/reference_type/object_type lines are its internals.
    details = "\n".join(line for line in text.splitlines()[1:] if line.strip() != first.strip()
                        and not line.startswith(("To append", " ")))
    return (f"Bad configuration{key_part}: {first}\n" + (f"{details}\n" if details else "")
            + f"Overrides given: {' '.join(overrides) or '(none)'}. {hint}")


def _key_type(schema: Type, key: str):
    """The schema's type of a dotted key (a map's entry: the map's value type), or None."""
    hint = schema
    for part in key.split("."):
        hint = _unoptional(hint)
        if dataclasses.is_dataclass(hint):
            hint = typing.get_type_hints(hint).get(part)
        elif typing.get_origin(hint) is dict:
            hint = typing.get_args(hint)[1]
        else:
            return None
    return hint


def _unoptional(hint):
    """X for Optional[X] (or X | None), else the hint itself."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return args[0] if union and len(args) == 1 else hint


TYPE_WORDS = {int: "an integer", float: "a float", bool: "true or false", str: "a string",
              list: "a list ([a,b,...])", dict: "a map ({a:1,...})"}


def _type_words(hint) -> str:
    if _unoptional(hint) is not hint:
        return f"{_type_words(_unoptional(hint))} or null"
    return TYPE_WORDS.get(typing.get_origin(hint) or hint, getattr(hint, "__name__", str(hint)))


def _as_override(value) -> Optional[str]:
    """A scalar as it is written on the command line; None for anything else."""
    if value is None or isinstance(value, bool):
        return str(value).lower() if value is not None else "null"
    return str(value) if isinstance(value, (int, float, str)) else None


def _type_mismatch(err: Exception, overrides: Sequence[str], schema: Optional[Type]):
    """One sentence for a value of the wrong type (key, value, type, an example); else None."""
    cause = err.__cause__ or err.__context__
    key = getattr(cause, "full_key", None)
    wrong_value = isinstance(cause, ValidationError) and not isinstance(cause, KeyValidationError)
    hint = _key_type(schema, key) if schema is not None and key and wrong_value else None
    if hint is None:
        return None
    given = next((o.split("=", 1)[1] for o in reversed(overrides)
                  if "=" in o and o.split("=", 1)[0].lstrip("+~") == key), None)
    given = given if given is not None else _as_override(cause.value) or str(cause.value)
    shown = given if given == "null" else f"'{given}'"
    if dataclasses.is_dataclass(_unoptional(hint)):
        return (f"{key} is a section of the config, not a value ({shown}): set its keys, as in "
                f"{key}.<name>=<value>.")
    node = getattr(cause, "child_node", None)
    example = _as_override(node._value()) if hasattr(node, "_value") else None
    example = f": for example {key}={example}" if example not in (None, "null") else ""
    return f"{key} takes {_type_words(hint)}, not {shown}{example}."


def schema_keys(schema: Type, prefix: str = "") -> dict:
    """Every dotted key of a dataclass schema -> whether it is a map (e.g. data.sources)."""
    keys = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(hint):
            keys.update(schema_keys(hint, key + "."))
        else:
            keys[key] = typing.get_origin(hint) is dict
    return keys


def _open_maps(overrides: Sequence[str], maps: Sequence[str]) -> list:
    """`data.sources.books=2` or `data.sources={a:1,b:2}` as `++...`: a map's entries are not in
    the schema, so struct mode would ask for Hydra's `+`; `++` adds or replaces the entry."""
    out = []
    for override in overrides:
        key = override.split("=", 1)[0]
        if "=" in override and key[:1] not in "+~" and any(
                key == m or key.startswith(m + ".") for m in maps):
            override = "++" + override
        out.append(override)
    return out


# A preset's switch that holds only at the preset's own value of another key: the debug presets
# build the embedded corpus at *their* data.root; a data.root given on the command line names a
# corpus the user means to have, missing there an error (unless data.prepare_embedded=true).
PRESET_SCOPED = {"data.prepare_embedded": "data.root"}


def _scope_to_preset(cfg: DictConfig, overrides: Sequence[str], preset_alone: Callable) -> None:
    """Turn off each PRESET_SCOPED switch the preset set when the command line moved its key away
    from the preset's value (`preset_alone()`: the preset composed alone, only then)."""
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    for switch, key in PRESET_SCOPED.items():
        if switch in given or OmegaConf.select(cfg, switch) is not True:
            continue
        parents = {".".join(key.split(".")[:i]) for i in range(1, key.count(".") + 2)}
        if not parents & given:   # neither data.root=... nor data={...} on the command line
            continue
        ours, preset = OmegaConf.select(cfg, key), OmegaConf.select(preset_alone(), key)
        if ours is None or preset is None or Path(ours).resolve() != Path(preset).resolve():
            OmegaConf.update(cfg, switch, False)


def compose_config(app: str, argv: Sequence[str], default_preset: str = "debug",
                   schema: Optional[Type] = None, problems: Optional[list] = None) -> DictConfig:
    """Compose (preset + overrides) into a typed DictConfig, or ConfigError. Given a list
    `problems`, each override refused alone (an unknown key, a wrong type) is noted there and
    left out, so that the rest is composed and its own problems found in the same try."""
    keys = schema_keys(schema) if schema is not None else {}
    maps = [key for key, is_map in keys.items() if is_map]
    preset, overrides = split_argv(argv, default_preset)
    config_dir, config_name = _preset_location(app, preset)
    errors = (HydraException, OmegaConfBaseException, ValueError, TypeError)

    def composed(given: Sequence[str]) -> DictConfig:
        with initialize_config_dir(config_dir=config_dir, version_base=None, job_name=app):
            cfg = compose(config_name=config_name, overrides=_open_maps(given, maps))
            _scope_to_preset(cfg, given, lambda: compose(config_name=config_name))
        return cfg

    def refusal(err: Exception, given: Sequence[str]) -> str:
        message = _type_mismatch(err, given, schema) or \
            _explain_compose_error(err, given, list(keys), maps)
        for override in given:  # quote the user's override, not our `++` form of it
            message = message.replace("++" + override, override)
        return message

    try:
        return composed(overrides)
    except errors as err:
        first = refusal(err, overrides)
    if problems is not None:   # each override on top of the good ones before it
        found, good, cfg = [], [], None
        for override in overrides:
            try:
                cfg = composed([*good, override])
                good.append(override)
            except errors as err:
                found.append(refusal(err, overrides))
        if found:
            problems += found
            return composed([]) if cfg is None else cfg
    raise ConfigError(first)


def load(app: str, schema: Type[T], argv: Optional[Sequence[str]] = None,
         validate: Optional[Callable[[T], None]] = None, default_preset: str = "debug") -> T:
    """The one entry point: argv -> a dataclass instance of `schema`, checked by `validate`.
    The overrides it could not apply are named with validate's problems; without `validate`,
    they wait on the instance for lingua.launch.run.validate (`pending_problems`)."""
    problems = []
    cfg = compose_config(app, sys.argv[1:] if argv is None else argv, default_preset, schema,
                         problems)
    try:
        args = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:  # e.g. a missing mandatory value (???)
        raise ConfigError(f"Bad configuration: {err}. Set the key on the command line "
                          f"(key=value) or in the preset.") from None
    if not isinstance(args, schema):
        raise ConfigError(f"The preset for '{app}' does not use the {schema.__name__} schema: its "
                          f"defaults list must start with the schema registered for the app.")
    if problems:
        setattr(args, PENDING, problems)
    if validate is not None:
        with every_problem() as check:
            check(pending_problems, args)
            check(validate, args)
    return args


PENDING = "_overrides_refused"


def pending_problems(args: Any) -> None:
    """Raise what `load` refused on the command line, for every_problem."""
    problems = getattr(args, PENDING, [])
    if problems:
        err = ConfigError(problems[0])
        err.problems = problems
        raise err


def to_yaml(args: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(args))


def to_dict(args: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(args), resolve=True)


def from_dict(schema: Type[T], data: Any) -> T:
    """Rebuild a dataclass (e.g. model args) from a dict read from a run's config.yaml."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), data))


def dump(args: Any, path: Path) -> None:
    """Write the resolved config atomically (a crash never leaves half a config.yaml)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(to_yaml(args))
    os.replace(tmp, path)


# What runs (and stool, before its job starts) write into their dump_dir: one of these makes a
# directory a run's.
RUN_DIRECTORY_MARKS = ("config.yaml", "metrics.jsonl", "checkpoints", "peak.json", "spikes.jsonl",
                       "probe", "evals", "profiling", "wandb", "wandb_id.txt", "code", "slurm",
                       "plots", ".lock")


def check_dump_dir(dump_dir: str) -> None:
    """Refuse a dump_dir that is a file or lies under one (mkdir would fail only after the start),
    or an existing directory neither empty nor a run's: its files would mix with the run's."""
    path = Path(dump_dir)
    found = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
    if found == path and path.is_dir():
        entries = sorted(p.name for p in path.iterdir())
        if entries and not any(mark in entries for mark in RUN_DIRECTORY_MARKS):
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more"
                                              if len(entries) > 5 else "")
            raise ConfigError(f"dump_dir={path} already holds files that are not a run's ({shown}):"
                              f" no config.yaml, metrics.jsonl or checkpoints/, so it is not a run "
                              f"to resume, and the run's files would be mixed with these. Give "
                              f"dump_dir a new or empty directory (e.g. dump_dir={path / 'run'}), "
                              f"or the dump_dir of the run you mean to resume.")
    if found is None or found.is_dir():
        return
    what = "a file" if found.is_file() else "not a directory"
    where = "is" if found == path else f"lies under {found}, which is"
    raise ConfigError(f"dump_dir={dump_dir} {where} {what}, so no run directory (config.yaml, "
                      f"metrics.jsonl, checkpoints/) can be made there. Give dump_dir a path "
                      f"inside a directory, e.g. dump_dir={found.parent / '<run name>'}, or "
                      f"move {found} away.")


@contextlib.contextmanager
def every_problem():
    """`with every_problem() as check: check(fn, *args)`: fn's result, or None with its ConfigError
    noted; at the end one ConfigError names every problem (one problem: its own message)."""
    found = []

    def check(fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ConfigError as err:   # one problem, or a nested every_problem's
            for problem in getattr(err, "problems", [str(err)]):
                if problem not in found:
                    found.append(problem)
        except Exception:
            if not found:
                raise
            # A later check tripping over a value an earlier one refused: that one is named.
        return None

    yield check
    if len(found) == 1:
        raise ConfigError(found[0])
    if found:
        err = ConfigError(f"{len(found)} problems with this configuration, each with its fix:\n"
                          + "\n".join(f"  {i}. {problem}" for i, problem in enumerate(found, 1)))
        err.problems = found
        raise err


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_positive(obj: Any, prefix: str, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        key = f"{prefix}.{name}" if prefix else name
        require(value > 0, f"{key}={value} must be positive. Set {key} to a value above 0.")


def import_app(module: str):
    # A console script does not put the checkout (or a fork's uninstalled app) on sys.path: look
    # where stool is run from, then in the checkout lingua comes from.
    for path in (str(REPO_ROOT), os.getcwd()):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        app = importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ConfigError(f"Cannot import the app module {module!r} ({err}). Give a train "
                          f"module as for `python -m`, e.g. `stool apps.llama.train ...`, from "
                          f"the repository root.") from None
    if not (hasattr(app, "load_config") and hasattr(app, "main")):
        raise ConfigError(f"{module} is not a lingua train module: it needs load_config(argv) "
                          f"and main(argv) (see apps/llama/train.py). Give e.g. apps.llama.train.")
    return app
