"""Training configs from YAML, and the range checks every TrainConfig goes through.

A YAML file is a `ConfigFile`: the fields of `TrainingConfig` (worker/engine/training_config.py,
where each is declared with its default and range) plus where the run reads and writes and its
limits (`RunOptions`). `lora:` is a nested mapping; relative paths are taken relative to the YAML
file's directory. Every problem raises a ConfigError naming the field: an unknown field, a wrong
type, a value out of range.

Configs written for the engine before it shared the API's names keep working: `pack` is read as
`packing`, and `learning_rate` (an absolute peak rate) may stand instead of `learning_rate_multiplier`.

`validate_config` is also run by the recipe on configs built in code (the worker's), so the ranges
hold whatever the config's origin. README's "Engine configuration" lists the same table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator, Field, ValidationError

from worker.engine.memory_plan import CHECKPOINTING
from worker.engine.training_config import LOCAL_N_EPOCHS, NEpochs, Strict, TrainingConfig
from worker.engine.types import ConfigError, DeviceName, TrainConfig


def _path(v: object) -> Path:
    if isinstance(v, Path):
        return v
    if isinstance(v, str) and v:
        return Path(v).expanduser()
    raise ValueError(f"must be a path (string), got {v!r}")


ConfigPath = Annotated[Path, BeforeValidator(_path)]
PATH_FIELDS = ("train_file", "output_dir", "model_store", "validation_file", "resume_from")
OLD_NAMES = {"pack": "packing"}  # an older config's name -> the field's name


class RunOptions(Strict):
    """What a local run needs beyond its training config; unset fields take TrainConfig's defaults."""

    model: str = Field(min_length=1, description="base model (`loraq models list`)")
    train_file: ConfigPath
    output_dir: ConfigPath
    model_store: ConfigPath | None = None
    validation_file: ConfigPath | None = None
    resume_from: ConfigPath | None = None
    learning_rate: float | None = Field(
        None, gt=0, le=1, description="AdamW peak learning rate, instead of learning_rate_multiplier"
    )
    max_steps: int | None = Field(None, ge=1, description="optimizer steps (overrides n_epochs)")
    device: DeviceName | None = None
    checkpoint_each_epoch: bool | None = None
    checkpoint_interval_seconds: float | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    max_wall_seconds: float | None = Field(None, gt=0)
    step_limit: int | None = Field(None, ge=1)


class ConfigFile(TrainingConfig, RunOptions):
    """A `loraq train` YAML file. A local run keeps its one-pass default: unset `n_epochs` is 1
    here (`LOCAL_N_EPOCHS`), `auto` only when written; a job sent to the API resolves unset as auto."""

    n_epochs: NEpochs = Field(LOCAL_N_EPOCHS, description="passes over the training file (`auto`: 3)")


def _config_error(exc: ValidationError, renamed: dict[str, str]) -> ConfigError:
    """The first problem, naming the field as the YAML spells it."""
    err = exc.errors()[0]
    parts: list[str] = []
    for part in err["loc"]:
        if isinstance(part, int) or "[" in str(part):  # a list index or a union branch: the field ends
            break
        parts.append(str(part))
    name = ".".join(parts) or "config"
    name = renamed.get(name, name)
    if err["type"] == "extra_forbidden":
        known = ", ".join(ConfigFile.model_fields)
        return ConfigError(name, f"unknown field {name!r} (known: {known})")
    if err["type"] == "missing":
        return ConfigError(name, f"missing required field {name!r}")
    if err["type"] == "value_error":
        return ConfigError(name, f"{name} {err['msg'].removeprefix('Value error, ')}")
    phrase = _PHRASES.get(err["type"], "{}").format(err["msg"], **err.get("ctx", {}))
    return ConfigError(name, f"{name} {phrase}, got {err['input']!r}")


# pydantic's error types, said as the rest of this module says them ("{}" is pydantic's message)
_PHRASES = {
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "literal_error": "must be one of {expected}",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "model_type": "must be a mapping",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
}


def config_from_mapping(
    data: Any, *, base_dir: Path | None = None, default_model_store: Path | None = None
) -> TrainConfig:
    """Build and validate a TrainConfig from a plain mapping (parsed YAML/JSON)."""
    if not isinstance(data, dict):
        raise ConfigError(
            "config", f"the config must be a mapping of field: value, got {type(data).__name__}"
        )
    data = dict(data)
    renamed: dict[str, str] = {}
    for old, new in OLD_NAMES.items():
        if old in data:
            if new in data:
                raise ConfigError(old, f"give {new} or {old} (its older name), not both")
            data[new] = data.pop(old)
            renamed[new] = old
    if "learning_rate" in data and "learning_rate_multiplier" in data:
        raise ConfigError("learning_rate", "give learning_rate or learning_rate_multiplier, not both")
    try:
        file = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc, renamed) from None
    run = file.model_dump(include=set(RunOptions.model_fields), exclude_none=True)
    for name in PATH_FIELDS:
        if base_dir is not None and name in run and not run[name].is_absolute():
            run[name] = base_dir / run[name]
    if "model_store" not in run:
        if default_model_store is None:
            raise ConfigError("model_store", "missing required field 'model_store'")
        run["model_store"] = default_model_store
    learning_rate = run.pop("learning_rate", None)
    config = TrainConfig.build(file, **run)
    if learning_rate is not None:  # an absolute rate: nothing for the plan to choose
        config.learning_rate = learning_rate
        config.auto = tuple(name for name in config.auto if name != "learning_rate")
    return config


def validate_config(config: TrainConfig) -> None:
    """Re-check every field of a config built in code (types and ranges, as for YAML)."""
    data = config.to_dict()
    data["packing"] = data.pop("pack")
    del data["auto"], data["row_tokens"]  # the plan's bookkeeping, not fields a config file sets
    memory = data.pop("memory")  # the memory plan's choice (worker/engine/step_memory.py)
    if memory is not None and (
        (memory["micro_rows"] or 1) < 1 or memory["checkpointing"] not in CHECKPOINTING
    ):
        raise ConfigError(
            "memory", f"memory needs micro_rows >= 1 and checkpointing in {CHECKPOINTING}: {memory}"
        )
    config_from_mapping(data)


def load_config_file(
    path: Path, *, default_model_store: Path | None = None, overrides: dict[str, Any] | None = None
) -> TrainConfig:
    """Read a YAML training config; errors name the file and the field. `overrides` (the command
    line's) replace the file's fields, but a mapping over a mapping of the same `type` is merged:
    `method: {type: dpo}` keeps the file's DPO beta."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from exc
    if isinstance(data, dict):
        for name, value in (overrides or {}).items():
            old = data.get(name)
            if isinstance(old, dict) and isinstance(value, dict) and old.get("type") == value.get("type"):
                value = {**old, **value}
            data[name] = value
    try:
        return config_from_mapping(
            data, base_dir=path.resolve().parent, default_model_store=default_model_store
        )
    except ConfigError as exc:
        raise ConfigError(exc.field, f"{path}: {exc}") from exc
