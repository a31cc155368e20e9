"""Every supported family trains on a CUDA device through the job's recipe (`gpu`).

The fused path covers the Llama shape only so far (worker/engine/families.py); the other families
must take the eager step on the GPU, say so in a warning event, and train in bf16 to the same
losses as the eager step on the CPU in fp32 (within bf16 tolerance). The CPU fp64 comparison with
transformers + PEFT is tests/engine/test_families.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.engine.tiny_families import save_tiny_family
from worker.engine.families import FAMILIES
from worker.engine.types import LoraConfig, NullCallbacks, StepMetrics, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


class Recorder(NullCallbacks):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.warnings: list[str] = []

    def on_step(self, metrics: StepMetrics) -> None:
        self.losses.append(metrics.train_loss)

    def on_event(self, level: Any, message: str, data: dict[str, Any] | None = None) -> None:
        if level == "warn":
            self.warnings.append(message)


def run(architecture: str, tmp: Path, device: str) -> Recorder:
    from worker.engine.catalog import register_local_model
    from worker.engine.recipe import train

    name = "fam-" + architecture.lower().removesuffix("forcausallm")
    store = tmp / "models"
    if not (store / name).exists():
        register_local_model(name, save_tiny_family(architecture, tmp / architecture), store)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is {w}?"},
                {"role": "assistant", "content": f"{w} is fine."},
            ]
        }
        for w in ("a cat", "a dog", "the sea", "a hill", "the sun", "a tree", "the moon", "a boat")
    ]
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = Recorder()
    cfg = TrainConfig(
        model=name,
        train_file=data,
        output_dir=tmp / f"out-{device}",
        model_store=store,
        lora=LoraConfig(r=8, alpha=16),
        max_seq_len=64,
        batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        device=device,  # type: ignore[arg-type]
    )
    train(cfg, rec)
    return rec


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_family_trains_on_the_gpu(architecture: str, tmp_path: Path, record_property: Any) -> None:
    gpu = run(architecture, tmp_path, "cuda")
    cpu = run(architecture, tmp_path, "cpu")
    worst = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(gpu.losses, cpu.losses, strict=True))
    record_property(
        "family",
        {
            "architecture": architecture,
            "eager": any("eagerly" in w for w in gpu.warnings),
            "gpu": gpu.losses,
            "cpu": cpu.losses,
            "worst": worst,
        },
    )
    assert len(gpu.losses) == STEPS and all(x == x and abs(x) < 1e4 for x in gpu.losses)
    eager = [w for w in gpu.warnings if "eagerly" in w]
    if not FAMILIES[architecture].fused_path:  # the fused path refuses it, and says so
        assert eager, gpu.warnings
    assert worst <= 5e-2, (gpu.losses, cpu.losses)
