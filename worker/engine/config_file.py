"""Training configs from YAML, and the range checks every TrainConfig goes through.

A YAML file maps TrainConfig's field names to values; `lora:` is a nested mapping of LoraConfig's
fields. Relative paths are taken relative to the YAML file's directory. Every problem raises a
ConfigError naming the field: an unknown field, a wrong type, a value out of range.

`validate_config` is also run by the recipe on configs built in code (the worker's), so the ranges
below hold whatever the config's origin. README's "Engine configuration" lists the same table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from worker.engine.types import ConfigError, LoraConfig, TrainConfig

Check = Callable[[Any], str | None]  # returns a problem ("must be >= 1") or None


@dataclass(frozen=True)
class FieldSpec:
    kind: str  # "int", "float", "bool", "str", "path", "choice", "targets"
    required: bool = False
    optional: bool = False  # None allowed
    check: Check | None = None
    choices: tuple[str, ...] = ()


def _at_least(lo: float) -> Check:
    return lambda v: None if v >= lo else f"must be >= {lo}"


def _between(lo: float, hi: float, *, hi_open: bool = False, lo_open: bool = False) -> Check:
    def check(v: Any) -> str | None:
        lo_ok = v > lo if lo_open else v >= lo
        hi_ok = v < hi if hi_open else v <= hi
        if lo_ok and hi_ok:
            return None
        return f"must be in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    return check


LORA_SPECS: dict[str, FieldSpec] = {
    "r": FieldSpec("int", check=_between(1, 1024)),
    "alpha": FieldSpec("float", check=_between(0, 1e6, lo_open=True)),
    "dropout": FieldSpec("float", check=_between(0, 1, hi_open=True)),
    "target_modules": FieldSpec("targets"),
    "use_rslora": FieldSpec("bool"),
}

TRAIN_SPECS: dict[str, FieldSpec] = {
    "model": FieldSpec("str", required=True),
    "train_file": FieldSpec("path", required=True),
    "output_dir": FieldSpec("path", required=True),
    "model_store": FieldSpec("path"),
    "validation_file": FieldSpec("path", optional=True),
    "lora": FieldSpec("lora"),
    "max_seq_len": FieldSpec("int", check=_between(16, 131_072)),
    "batch_size": FieldSpec("int", check=_between(1, 4096)),
    "grad_accum": FieldSpec("int", check=_between(1, 4096)),
    "n_epochs": FieldSpec("int", check=_between(1, 1000)),
    "max_steps": FieldSpec("int", optional=True, check=_at_least(1)),
    "learning_rate": FieldSpec("float", check=_between(0, 1, lo_open=True)),
    "weight_decay": FieldSpec("float", check=_between(0, 1)),
    "lr_scheduler": FieldSpec("choice", choices=("cosine", "linear", "constant")),
    "warmup_ratio": FieldSpec("float", check=_between(0, 1, hi_open=True)),
    "max_grad_norm": FieldSpec("float", check=_between(0, 1e6, lo_open=True)),
    "seed": FieldSpec("int", check=_between(0, 2**63 - 1)),
    "pack": FieldSpec("bool"),
    "validation_split": FieldSpec("float", check=_between(0, 0.5)),
    "eval_every": FieldSpec("int", check=_at_least(0)),
    "checkpoint_every": FieldSpec("int", check=_at_least(0)),
    "resume_from": FieldSpec("path", optional=True),
    "device": FieldSpec("choice", choices=("auto", "cpu", "cuda")),
    "max_tokens": FieldSpec("int", optional=True, check=_at_least(1)),
    "step_limit": FieldSpec("int", optional=True, check=_at_least(1)),
    "max_wall_seconds": FieldSpec("float", optional=True, check=_between(0, math.inf, lo_open=True)),
}


def _coerce(name: str, spec: FieldSpec, value: Any, base_dir: Path | None) -> Any:
    """Check `value`'s type (YAML gives str/int/float/bool/None/list/dict) and convert paths."""
    if value is None:
        if spec.optional:
            return None
        raise ConfigError(name, f"{name} must not be empty (null)")
    kind = spec.kind
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"{name} must be an integer, got {value!r}")
    elif kind == "float":
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads "1e-3" (no dot in the mantissa) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(name, f"{name} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(name, f"{name} must be a number, got {value!r}")
        value = float(value)
        if math.isnan(value):
            raise ConfigError(name, f"{name} must be a number, got NaN")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(name, f"{name} must be true or false, got {value!r}")
    elif kind in ("str", "choice"):
        if not isinstance(value, str) or not value:
            raise ConfigError(name, f"{name} must be a non-empty string, got {value!r}")
        if kind == "choice" and value not in spec.choices:
            raise ConfigError(name, f"{name} must be one of {', '.join(spec.choices)}; got {value!r}")
    elif kind == "path":
        if isinstance(value, Path):
            pass
        elif isinstance(value, str) and value:
            value = Path(value).expanduser()
        else:
            raise ConfigError(name, f"{name} must be a path (string), got {value!r}")
        if base_dir is not None and not value.is_absolute():
            value = base_dir / value
    elif kind == "targets":
        ok_list = isinstance(value, list) and value and all(isinstance(t, str) and t for t in value)
        if value != "all-linear" and not ok_list:
            raise ConfigError(
                name, f"{name} must be 'all-linear' or a non-empty list of module names, got {value!r}"
            )
    if spec.check is not None:
        problem = spec.check(value)
        if problem:
            raise ConfigError(name, f"{name} {problem}, got {value!r}")
    return value


def _lora_from_mapping(data: Any) -> LoraConfig:
    if isinstance(data, LoraConfig):
        data = {f.name: getattr(data, f.name) for f in fields(LoraConfig)}
    if not isinstance(data, dict):
        raise ConfigError("lora", f"lora must be a mapping of LoRA options, got {data!r}")
    unknown = sorted(set(data) - set(LORA_SPECS))
    if unknown:
        raise ConfigError(
            f"lora.{unknown[0]}", f"unknown field lora.{unknown[0]} (known: {', '.join(LORA_SPECS)})"
        )
    values = {k: _coerce(f"lora.{k}", LORA_SPECS[k], v, None) for k, v in data.items()}
    return LoraConfig(**values)


def config_from_mapping(
    data: Any, *, base_dir: Path | None = None, default_model_store: Path | None = None
) -> TrainConfig:
    """Build and validate a TrainConfig from a plain mapping (parsed YAML/JSON)."""
    if not isinstance(data, dict):
        raise ConfigError(
            "config", f"the config must be a mapping of field: value, got {type(data).__name__}"
        )
    unknown = sorted(set(data) - set(TRAIN_SPECS))
    if unknown:
        raise ConfigError(unknown[0], f"unknown field {unknown[0]!r} (known: {', '.join(TRAIN_SPECS)})")
    values: dict[str, Any] = {}
    for name, spec in TRAIN_SPECS.items():
        if name not in data:
            if spec.required:
                raise ConfigError(name, f"missing required field {name!r}")
            continue
        if name == "lora":
            values[name] = _lora_from_mapping(data[name])
        else:
            values[name] = _coerce(name, spec, data[name], base_dir)
    if "model_store" not in values:
        if default_model_store is None:
            raise ConfigError("model_store", "missing required field 'model_store'")
        values["model_store"] = default_model_store
    config = TrainConfig(**values)
    validate_config(config)
    return config


def validate_config(config: TrainConfig) -> None:
    """Re-check every field of a config built in code (types and ranges, as for YAML)."""
    for name, spec in TRAIN_SPECS.items():
        value = getattr(config, name)
        if name == "lora":
            _lora_from_mapping(value)
        else:
            _coerce(name, spec, value, None)


def load_config_file(path: Path, *, default_model_store: Path | None = None) -> TrainConfig:
    """Read a YAML training config; errors name the file and the field."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from exc
    try:
        return config_from_mapping(
            data, base_dir=path.resolve().parent, default_model_store=default_model_store
        )
    except ConfigError as exc:
        raise ConfigError(exc.field, f"{path}: {exc}") from exc
