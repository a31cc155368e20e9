"""DPO on the GPU's fast path (issue 33, point 3; `gpu`, for `pytest -m gpu` on a CUDA host).

The DPO recipe on tiny-llama with packed preference pairs must take the captured step (fused
modules, CUDA graph, PreferenceObjective's static buffers) and train like the eager step: its
per-step losses and readings within bf16 tolerance of the same run on the CPU in fp32 (the eager
Hugging Face step, checked in fp64 against the formula in tests/engine/test_dpo.py), with the
default rpo_alpha (1: the chosen answers' NLL in the loss, from the static 1/N_w buffer). Its first
loss is log 2 + that NLL: the reference pre-pass (adapter off, the packed forward) equals the
policy at B = 0. (The NLL term's part of this test has not run on a GPU yet.)

Not run in this session's CPU suite (written for the lead's GPU run; the CPU twin is
tests/engine/test_dpo.py::test_captured_step_objective_equals_the_formula).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.engine.recipe_helpers import Recorder
from tests.engine.test_dpo import write_pairs
from tests.gpu_kernels.oracle import Recorder as PropertyRecorder
from worker.engine.dpo import DpoRecipe
from worker.engine.preference import LOG2
from worker.engine.training_config import DpoTraining
from worker.engine.types import LoraConfig, TrainConfig

STEPS = 8
BF16_LOSS_TOL = 3e-2  # as the families' GPU run against CPU fp32 (2.8e-2 measured over 6 steps)


def config(tmp: Path, device: str) -> TrainConfig:
    return TrainConfig(
        model="tiny-llama",
        train_file=write_pairs(tmp / "pairs.jsonl", 32),
        validation_file=write_pairs(tmp / "valid.jsonl", 6),
        output_dir=tmp / f"out-{device}",
        model_store=tmp / "models",
        lora=LoraConfig(r=8, alpha=16.0),
        max_seq_len=256,
        batch_size=2,
        grad_accum=2,
        max_steps=STEPS,
        learning_rate=5e-3,
        seed=7,
        device=device,  # type: ignore[arg-type]
        pack=True,  # several pairs a row: the varlen path
        eval_every=4,
        method=DpoTraining(beta=0.1),  # rpo_alpha: auto (1)
    )


def run(cfg: TrainConfig) -> tuple[Recorder, bool]:
    """The recipe's steps and whether its step was captured as a CUDA graph."""
    rec = Recorder()
    recipe = DpoRecipe(cfg, rec)
    try:
        recipe.setup()
        recipe.train()
        captured = recipe.step_fn is not None and bool(recipe.step_fn.graphed.captured)
    finally:
        recipe.cleanup()
    return rec, captured


@pytest.mark.gpu
@pytest.mark.slow
def test_dpo_takes_the_captured_step_and_matches_eager(
    tmp_path: Path, record_property: PropertyRecorder
) -> None:
    gpu, captured = run(config(tmp_path, "cuda"))
    cpu, _ = run(config(tmp_path, "cpu"))
    assert captured, "the DPO step did not run as a CUDA graph"
    assert any(e.startswith("Training step: fused kernels, CUDA graph") for _, e in gpu.events)
    assert len(gpu.steps) == len(cpu.steps) == STEPS
    diffs = [abs(g.train_loss - c.train_loss) for g, c in zip(gpu.steps, cpu.steps, strict=True)]
    margins = [
        abs(g.preference.margin - c.preference.margin)  # type: ignore[union-attr]
        for g, c in zip(gpu.steps, cpu.steps, strict=True)
    ]
    nll = [
        abs(g.preference.chosen_nll - c.preference.chosen_nll)  # type: ignore[union-attr,operator]
        for g, c in zip(gpu.steps, cpu.steps, strict=True)
    ]
    first = gpu.steps[0]
    record_property(
        "dpo", {"loss_diffs": diffs, "margin_diffs": margins, "nll_diffs": nll, "first": first.train_loss}
    )
    assert first.preference is not None and first.preference.chosen_nll is not None
    alpha = DpoTraining().rpo_alpha_value
    # policy == reference at B = 0: the DPO term is log 2
    assert abs(first.train_loss - alpha * first.preference.chosen_nll - LOG2) < 1e-2
    assert max(diffs) < BF16_LOSS_TOL
    assert max(margins) < BF16_LOSS_TOL
    assert max(nll) < BF16_LOSS_TOL
    assert all(s.preference is not None and math.isfinite(s.preference.accuracy) for s in gpu.steps)
    validated = [s for s in gpu.steps if s.valid_loss is not None]
    assert validated and all(s.valid_preference is not None for s in validated)
    assert torch.cuda.is_available()
