"""Hydra glue: compose a run's config from a preset and command-line overrides, check it, dump it.

We use Hydra's compose API instead of `@hydra.main` on purpose: `@hydra.main` makes a timestamped
output directory per process and changes the working directory, which under torchrun means one
directory per rank racing to write the same files. `load()` gives the same overrides, config groups
and schema checks, and leaves the filesystem alone. The launcher (stool) calls the same function,
so a bad config fails before a job is queued.

A run's schema is a dataclass (the app's `TrainArgs`) registered in Hydra's ConfigStore; a preset
is a YAML file under `configs/<app>/` whose defaults list starts with that schema, so unknown keys
and wrong types are refused by OmegaConf while composing.
"""

import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Type, TypeVar

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lingua.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"

T = TypeVar("T")


def register_schema(name: str, schema: Type) -> None:
    """Make `schema` usable as `- <name>` in a preset's defaults list."""
    ConfigStore.instance().store(name=name, node=schema)


def split_argv(argv: Sequence[str], default_preset: str) -> tuple:
    """Separate the preset choice (`config=NAME` or `--config-name NAME`) from Hydra overrides."""
    preset, overrides, i = default_preset, [], 0
    argv = list(argv)
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("config="):
            preset = arg.split("=", 1)[1]
        elif arg.startswith("--config-name="):
            preset = arg.split("=", 1)[1]
        elif arg in ("--config-name", "-cn"):
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a preset name after it, e.g. `{arg} debug`.")
            preset = argv[i + 1]
            i += 1
        else:
            overrides.append(arg)
        i += 1
    return preset, overrides


def _preset_location(app: str, preset: str) -> tuple:
    """(config dir, config name) for a preset given by name (configs/<app>/NAME.yaml) or path."""
    as_path = Path(preset)
    if preset.endswith((".yaml", ".yml")) or as_path.is_file():
        if not as_path.is_file():
            raise ConfigError(f"Config file {preset} does not exist. Give an existing YAML file or a "
                              f"preset name from {CONFIG_DIR / app} (without .yaml).")
        return str(as_path.resolve().parent), as_path.stem
    app_dir = CONFIG_DIR / app
    if not (app_dir / f"{preset}.yaml").is_file():
        known = sorted(p.stem for p in app_dir.glob("*.yaml"))
        raise ConfigError(f"Unknown preset config={preset} for app '{app}'. Known presets in "
                          f"{app_dir}: {', '.join(known) or 'none'}. Pick one of them or give a "
                          f"path to a YAML file.")
    return str(app_dir), preset


def _explain_compose_error(err: Exception, overrides: Sequence[str]) -> str:
    text = str(err).strip()
    cause = err.__cause__ or err.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in text:
        text += "\n" + str(cause).strip()
    first = text.splitlines()[0] if text else type(err).__name__
    hint = ("Check the key's spelling and type against the schema: "
            "`python -m apps.<app>.train --help` is not available, but the dataclasses in "
            "lingua/*.py and apps/<app>/*.py list every key with its type and default. "
            "To add a key that is not in the schema, change the dataclass, not the command line.")
    full_key = getattr(cause, "full_key", None) or getattr(err, "full_key", None)
    key_part = f" (key: {full_key})" if full_key else ""
    return (f"Bad configuration{key_part}: {first}\n{text if text != first else ''}"
            f"Overrides given: {' '.join(overrides) or '(none)'}. {hint}").replace("\n\n", "\n")


def compose_config(app: str, argv: Sequence[str], default_preset: str = "debug") -> DictConfig:
    """Compose (preset + overrides) into a typed DictConfig; raises ConfigError on any bad key/type."""
    preset, overrides = split_argv(argv, default_preset)
    config_dir, config_name = _preset_location(app, preset)
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None, job_name=app):
            cfg = compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError, TypeError) as err:
        raise ConfigError(_explain_compose_error(err, overrides)) from None
    return cfg


def load(app: str, schema: Type[T], argv: Optional[Sequence[str]] = None,
         validate: Optional[Callable[[T], None]] = None, default_preset: str = "debug") -> T:
    """The one entry point: argv -> a validated dataclass instance of `schema`.

    `validate` is the app's function for cross-field checks (divisibility, files, ...); it must
    raise ConfigError and must not touch process groups, devices or the dump directory.
    """
    argv = sys.argv[1:] if argv is None else argv
    cfg = compose_config(app, argv, default_preset)
    try:
        args = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:  # e.g. a missing mandatory value (???)
        raise ConfigError(f"Bad configuration: {err}. Set the key on the command line "
                          f"(key=value) or in the preset.") from None
    if not isinstance(args, schema):
        raise ConfigError(f"The preset for '{app}' does not use the {schema.__name__} schema: its "
                          f"defaults list must start with the schema registered for the app.")
    if validate is not None:
        validate(args)
    return args


def to_yaml(args: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(args))


def to_dict(args: Any) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(args), resolve=True)


def from_dict(schema: Type[T], data: Any) -> T:
    """Rebuild a dataclass (e.g. model args) from a dict read from a run's config.yaml."""
    merged = OmegaConf.merge(OmegaConf.structured(schema), data)
    return OmegaConf.to_object(merged)


def dump(args: Any, path: Path) -> None:
    """Write the resolved config atomically (a crash never leaves half a config.yaml)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(to_yaml(args))
    os.replace(tmp, path)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_positive(obj: Any, prefix: str, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(obj, name)
        key = f"{prefix}.{name}" if prefix else name
        require(value > 0, f"{key}={value} must be positive. Set {key} to a value above 0.")
