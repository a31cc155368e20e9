"""Checkpoints: stop at step k, resume, and the run continues exactly as if never interrupted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.recipe_helpers import Recorder, tiny_config
from worker.engine.checkpoint import TRAINER_STATE, TRAINING_STATE
from worker.engine.recipe import train
from worker.engine.types import ConfigError, LoraConfig, TrainConfig

STEPS = 7


def _config(tmp: Path, **overrides: object) -> TrainConfig:
    # dropout > 0: the resumed run must also restore the RNG stream the dropout masks come from
    base = {"max_steps": STEPS, "lora": LoraConfig(r=8, alpha=16.0, dropout=0.1), "warmup_ratio": 0.2}
    base.update(overrides)
    return tiny_config(tmp, **base)


def test_resume_continues_the_uninterrupted_run_exactly(tmp_path: Path) -> None:
    whole = Recorder()
    full = train(_config(tmp_path / "whole"), whole)
    assert full.steps == STEPS

    first = Recorder(stop_after=3)
    stopped = train(_config(tmp_path / "split"), first)
    assert stopped.stopped and stopped.steps == 3
    ckpt = tmp_path / "split" / "out" / "checkpoints" / "step-000003"

    # resume into a fresh output dir, as the worker does for a new attempt
    second = Recorder()
    resumed = train(_config(tmp_path / "split", output_dir=tmp_path / "resumed", resume_from=ckpt), second)
    assert [m.step for m in second.steps] == list(range(4, STEPS + 1))
    assert first.losses + second.losses == whole.losses  # bit for bit on the CPU
    assert [m.lr for m in first.steps + second.steps] == [m.lr for m in whole.steps]
    assert resumed.trained_tokens == full.trained_tokens
    a = load_file(str(full.adapter_dir / "adapter_model.safetensors"))
    b = load_file(str(resumed.adapter_dir / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_layout_and_no_temp_dirs(tmp_path: Path) -> None:
    train(_config(tmp_path, checkpoint_every=3), Recorder())
    root = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000003", "step-000006", "step-000007"]
    ckpt = root / "step-000003"
    names = {p.name for p in ckpt.iterdir()}
    assert names == {"adapter_model.safetensors", "adapter_config.json", TRAINING_STATE, TRAINER_STATE}
    summary = json.loads((ckpt / TRAINER_STATE).read_text())
    assert summary["step"] == 3 and summary["epoch"] == 0 and summary["batch_index"] == 3
    assert summary["config"]["model"] == "tiny-llama"
    # the training state loads with weights_only (no arbitrary code in the pickle)
    blob = torch.load(ckpt / TRAINING_STATE, weights_only=True)
    assert {"optimizer", "scheduler", "rng", "step", "micro_batches", "trained_tokens"} <= set(blob)
    assert not list(tmp_path.glob("out/**/.tmp-*"))


def test_resume_refuses_a_changed_config(tmp_path: Path) -> None:
    train(_config(tmp_path), Recorder(stop_after=2))
    ckpt = tmp_path / "out" / "checkpoints" / "step-000002"
    with pytest.raises(ConfigError, match="batch_size") as err:
        train(_config(tmp_path, batch_size=2, output_dir=tmp_path / "r", resume_from=ckpt), Recorder())
    assert err.value.param == "batch_size"


def test_resume_finds_the_checkpoint_inside_an_unzipped_archive(tmp_path: Path) -> None:
    train(_config(tmp_path), Recorder(stop_after=5))
    unzipped = tmp_path / "resume"
    shutil.copytree(tmp_path / "out" / "checkpoints" / "step-000005", unzipped / "step-000005")
    rec = Recorder()
    result = train(_config(tmp_path, output_dir=tmp_path / "r", resume_from=unzipped), rec)
    assert [m.step for m in rec.steps] == [6, 7] and result.steps == STEPS


def test_resume_from_a_directory_without_a_checkpoint_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="resume_from") as err:
        train(_config(tmp_path, resume_from=tmp_path / "empty"), Recorder())
    assert err.value.param == "resume_from"
