"""YAML training configs: defaults, relative paths, and errors that name the bad field."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.engine.config_file import config_from_mapping, load_config_file, validate_config
from worker.engine.training_config import BASE_LEARNING_RATE
from worker.engine.types import ConfigError, LoraConfig, TrainConfig

STORE = Path("/srv/models")


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_full_config_with_relative_paths(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
model: tiny-llama
train_file: data/train.jsonl
validation_file: /abs/valid.jsonl
output_dir: out
max_steps: 50
learning_rate: 1e-3
warmup_ratio: 0.1
lr_scheduler: linear
pack: true
lora:
  r: 8
  alpha: 16
  target_modules: [q_proj, v_proj]
  use_rslora: true
""",
    )
    cfg = load_config_file(path, default_model_store=STORE)
    assert cfg.train_file == tmp_path / "data" / "train.jsonl"
    assert cfg.validation_file == Path("/abs/valid.jsonl")
    assert cfg.output_dir == tmp_path / "out"
    assert cfg.model_store == STORE
    assert (cfg.max_steps, cfg.learning_rate, cfg.lr_scheduler, cfg.pack) == (50, 1e-3, "linear", True)
    assert cfg.lora == LoraConfig(r=8, alpha=16.0, target_modules=["q_proj", "v_proj"], use_rslora=True)
    assert cfg.batch_size == TrainConfig.batch_size  # untouched fields keep their defaults


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ("max_step: 5", "max_step", "unknown field 'max_step'"),
        ("batch_size: four", "batch_size", "batch_size must be an integer"),
        ("batch_size: 2.5", "batch_size", "batch_size must be an integer"),
        ("batch_size: 0", "batch_size", "batch_size must be between 1 and 1024"),
        ("learning_rate: 0", "learning_rate", "learning_rate must be > 0"),
        ("warmup_ratio: 1.0", "warmup_ratio", "warmup_ratio must be < 1"),
        ("lr_scheduler: step", "lr_scheduler", "must be one of 'cosine', 'linear' or 'constant'"),
        ("pack: yes please", "pack", "pack must be true or false"),
        ("device: tpu", "device", "device must be one of"),
        ("max_steps: -1", "max_steps", "max_steps must be >= 1"),
        ("lora: {r: 0}", "lora.r", "lora.r must be >= 1"),
        ("lora: {dropout: 1}", "lora.dropout", "lora.dropout must be < 1"),
        ("lora: {rank: 8}", "lora.rank", "unknown field 'lora.rank'"),
        ("lora: {target_modules: everything}", "lora.target_modules", "'all-linear' or a non-empty list"),
        ("lora: 8", "lora", "lora must be a mapping"),
    ],
)
def test_bad_fields_are_named(tmp_path: Path, extra: str, field: str, message: str) -> None:
    path = _write(tmp_path, f"model: tiny-llama\ntrain_file: t.jsonl\noutput_dir: out\n{extra}\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_config_file(path, default_model_store=STORE)
    assert err.value.param == field
    assert str(path) in str(err.value)


def test_missing_required_field_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing required field 'train_file'"):
        config_from_mapping({"model": "tiny-llama", "output_dir": "o"}, default_model_store=STORE)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config_file(_write(tmp_path, "model: [unclosed\n"), default_model_store=STORE)
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config_file(_write(tmp_path, "- a\n- b\n"), default_model_store=STORE)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "nope.yaml", default_model_store=STORE)


def test_configs_built_in_code_are_range_checked(tmp_path: Path) -> None:
    ok = TrainConfig(model="tiny-llama", train_file=tmp_path, output_dir=tmp_path, model_store=tmp_path)
    validate_config(ok)
    bad = TrainConfig(
        model="tiny-llama", train_file=tmp_path, output_dir=tmp_path, model_store=tmp_path, grad_accum=0
    )
    with pytest.raises(ConfigError, match="grad_accum"):
        validate_config(bad)


def test_api_names_and_older_engine_names(tmp_path: Path) -> None:
    base = {"model": "tiny-llama", "train_file": "t.jsonl", "output_dir": "o"}
    cfg = config_from_mapping(
        {**base, "packing": False, "learning_rate_multiplier": 5}, default_model_store=STORE
    )
    assert cfg.pack is False and cfg.learning_rate == pytest.approx(5 * BASE_LEARNING_RATE)
    auto = config_from_mapping({**base, "n_epochs": "auto", "batch_size": "auto"}, default_model_store=STORE)
    # left to the run's plan (worker/engine/training_config.py:plan_auto), which sees the data
    assert auto.auto == ("n_epochs", "batch_size", "learning_rate")
    local = config_from_mapping({**base, "learning_rate": 1e-3}, default_model_store=STORE)
    assert local.auto == ("batch_size",) and local.n_epochs == 1 and local.learning_rate == 1e-3
    with pytest.raises(ConfigError, match="not both") as err:
        config_from_mapping({**base, "pack": True, "packing": True}, default_model_store=STORE)
    assert err.value.param == "pack"
    with pytest.raises(ConfigError, match="not both") as err:
        config_from_mapping(
            {**base, "learning_rate": 1e-3, "learning_rate_multiplier": 2}, default_model_store=STORE
        )
    assert err.value.param == "learning_rate"
