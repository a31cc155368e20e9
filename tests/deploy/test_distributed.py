"""The multi-GPU code path on CPU: 2 gloo ranks under torchrun train the same adapter as one process.

One process trains on whole batches; two ranks each train on half of every batch's rows and sum
their adapter gradients. Same data order, same init, same optimizer: the adapters must agree to
float tolerance, and rank 0 alone reports one step per optimizer step (one loss curve).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from safetensors.torch import load_file

from worker.engine import distributed, recipe
from worker.engine.types import CheckpointInfo, LoraConfig, StepMetrics, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL_STORE = ROOT / "var" / "test-models" / "models"  # tiny-llama is built here once (engine tests too)


class Recorder:
    def __init__(self, stop_after: int | None = None) -> None:
        self.steps: list[StepMetrics] = []
        self.events: list[str] = []
        self.checkpoints: list[CheckpointInfo] = []
        self.stop_after = stop_after

    def on_step(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)

    def on_event(
        self, level: Literal["info", "warn", "error"], message: str, data: dict[str, Any] | None = None
    ) -> None:
        self.events.append(message)

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        self.checkpoints.append(checkpoint)

    def should_stop(self) -> bool:
        return self.stop_after is not None and len(self.steps) >= self.stop_after


def write_dataset(path: Path, n: int = 9) -> Path:
    """Rows of different lengths, so that ranks see different padding and token counts."""
    rows = []
    for i in range(n):
        answer = " ".join(["arr"] * (1 + 3 * i)) + f" number {i}."
        rows.append({"messages": [{"role": "user", "content": f"Question {i}?" + " why" * (i % 4)},
                                  {"role": "assistant", "content": answer}]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_config(tmp_path: Path, out: str, **overrides: object) -> TrainConfig:
    base = TrainConfig(
        model="tiny-llama",
        train_file=write_dataset(tmp_path / "train.jsonl"),
        validation_file=write_dataset(tmp_path / "valid.jsonl", n=5),  # 3+2 rows: ranks split each batch
        output_dir=tmp_path / out,
        model_store=MODEL_STORE,
        lora=LoraConfig(r=4, alpha=8.0, dropout=0.0),
        max_seq_len=128,
        # 3 rows per micro-batch (ranks get 2 and 1 rows), 2 micro-batches per step, 3 steps;
        # one example per row, so that the rows are this file's lines
        pack=False,
        batch_size=3,
        grad_accum=2,
        max_steps=3,
        learning_rate=1e-2,
        lr_scheduler="constant",
        seed=7,
        device="cpu",
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def adapter_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(adapter_dir / "adapter_model.safetensors"))


@pytest.mark.timeout(300)
def test_two_gloo_ranks_match_one_process(tmp_path: Path) -> None:
    single_cb = Recorder()
    single = recipe.train(make_config(tmp_path, "single"), single_cb)

    ddp_cb = Recorder()
    ddp = distributed.run_torchrun(
        make_config(tmp_path, "ddp"), ddp_cb, n_gpus=2, workdir=tmp_path / "ddp-run"
    )

    # One curve: rank 0 alone reported, one row per optimizer step, same losses as one process.
    assert [m.step for m in ddp_cb.steps] == [1, 2, 3]
    assert [m.tokens for m in ddp_cb.steps] == [m.tokens for m in single_cb.steps]
    for a, b in zip(ddp_cb.steps, single_cb.steps, strict=True):
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    # validation (at the last step) is sharded across ranks too, and sums to the same mean
    assert single_cb.steps[-1].valid_loss is not None
    assert ddp_cb.steps[-1].valid_loss == pytest.approx(single_cb.steps[-1].valid_loss, rel=1e-6)
    assert ddp.final_valid_loss == pytest.approx(single.final_valid_loss, rel=1e-6)
    assert ddp.steps == single.steps == 3
    assert ddp.trained_tokens == single.trained_tokens
    assert [c.step for c in ddp_cb.checkpoints] == [3]
    assert sum("Adapter exported" in e for e in ddp_cb.events) == 1

    want, got = adapter_tensors(single.adapter_dir), adapter_tensors(ddp.adapter_dir)
    assert want.keys() == got.keys() and want
    moved = 0
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-6, msg=name)
        moved += int(bool(w.abs().sum() > 0))
    assert moved == len(want)  # every factor trained (lora_B starts at zero), so the check bites


@pytest.mark.timeout(300)
def test_stop_request_reaches_every_rank_and_engine_errors_keep_their_code(tmp_path: Path) -> None:
    cb = Recorder(stop_after=1)
    result = distributed.run_torchrun(
        make_config(tmp_path, "stop", max_steps=50), cb, n_gpus=2, workdir=tmp_path / "stop-run"
    )
    assert result.stopped and 1 <= result.steps < 50

    bad = make_config(tmp_path, "bad")
    bad.train_file.write_text('{"messages": [\n')
    with pytest.raises(distributed.EngineError) as err:
        distributed.run_torchrun(bad, Recorder(), n_gpus=2, workdir=tmp_path / "bad-run")
    assert err.value.code == "invalid_training_file"
    assert "line 1" in str(err.value)
