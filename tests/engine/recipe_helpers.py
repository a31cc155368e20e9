"""Shared pieces of the recipe, checkpoint and export tests: a tiny chat dataset and a recorder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from worker.engine.types import CheckpointInfo, LoraConfig, NullCallbacks, StepMetrics, TrainConfig

ANIMALS = ["cat", "dog", "bird", "fish", "horse", "cow", "sheep", "goat"]


def write_animal_chats(path: Path, n: int = 32) -> Path:
    """n chats "what is the X?" -> "the X is an animal." (X cycles through ANIMALS)."""
    lines = []
    for i in range(n):
        a = ANIMALS[(i * 5) % len(ANIMALS)]
        row = {
            "messages": [
                {"role": "user", "content": f"what is the {a}?"},
                {"role": "assistant", "content": f"the {a} is an animal."},
            ]
        }
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_config(tmp: Path, **overrides: Any) -> TrainConfig:
    tmp.mkdir(parents=True, exist_ok=True)
    train = tmp / "train.jsonl"
    if not train.exists():
        write_animal_chats(train)
    values: dict[str, Any] = {
        "model": "tiny-llama",
        "train_file": train,
        "output_dir": tmp / "out",
        "model_store": tmp / "models",
        "lora": LoraConfig(r=8, alpha=16.0),
        "max_seq_len": 64,
        "batch_size": 4,
        "max_steps": 6,
        "learning_rate": 5e-3,
        "seed": 3,
        "device": "cpu",
        "pack": False,  # one example per row: these tests count rows and steps
    }
    values.update(overrides)
    return TrainConfig(**values)


class Recorder(NullCallbacks):
    """Records everything; `stop_after` makes should_stop() true once that many steps were seen."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.steps: list[StepMetrics] = []
        self.events: list[tuple[str, str]] = []
        self.full_events: list[tuple[str, str, dict[str, Any] | None]] = []
        self.checkpoints: list[CheckpointInfo] = []
        self.stop_after = stop_after
        self.stop_checks = 0

    def on_step(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)

    def on_event(
        self, level: Literal["info", "warn", "error"], message: str, data: dict[str, Any] | None = None
    ) -> None:
        self.events.append((level, message))
        self.full_events.append((level, message, data))

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        self.checkpoints.append(checkpoint)

    def should_stop(self) -> bool:
        self.stop_checks += 1
        return self.stop_after is not None and len(self.steps) >= self.stop_after

    @property
    def losses(self) -> list[float]:
        return [m.train_loss for m in self.steps]
