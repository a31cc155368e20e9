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


def build_pretrained_tiny(store: Path, workdir: Path) -> None:
    """Register `tiny-sharp` and `tiny-pretrained` (local models) in `store`.

    tiny-llama's random head keeps its logits near zero (its final RMSNorm bounds the hidden
    state), so its loss can neither blow up nor fall near zero. `tiny-sharp` is tiny-llama with
    the head scaled x20; `tiny-pretrained` is tiny-sharp with 100 steps on the animal chats merged
    in (train loss about 0.04): a small "pretrained" model whose loss can go wrong."""
    import torch

    from worker.engine.catalog import register_local_model
    from worker.engine.export import export_merged
    from worker.engine.models import load_base_model
    from worker.engine.recipe import train

    tiny = load_base_model("tiny-llama", store=store)
    with torch.no_grad():
        tiny.model.get_output_embeddings().weight.mul_(20.0)
    tiny.model.save_pretrained(workdir / "sharp", safe_serialization=True)
    tiny.tokenizer.save_pretrained(workdir / "sharp")
    register_local_model("tiny-sharp", workdir / "sharp", store)
    config = tiny_config(
        workdir / "pre", model="tiny-sharp", model_store=store, max_steps=100, learning_rate=1e-2,
        lr_scheduler="constant",
    )  # fmt: skip
    adapter = train(config, NullCallbacks()).adapter_dir
    export_merged(adapter, load_base_model("tiny-sharp", store=store), workdir / "pretrained")
    register_local_model("tiny-pretrained", workdir / "pretrained", store)
