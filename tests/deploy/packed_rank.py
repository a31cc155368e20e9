"""One rank (or the one process) of the packed-step distributed tests, on the CPU.

`python -m torch.distributed.run --standalone --nproc-per-node=2 -m tests.deploy.packed_rank
CONFIG_JSON OUT_DIR` runs the recipe as a job's torchrun rank does, with the fused Llama modules
forced on (their reference ops, as tests/engine/test_packed_step.py does), so the step is the job
path's packed step (`CapturedTrainStep.load_step`, capture off on the CPU) and its gradients go
through `distributed.FlatGrads` over gloo. Each rank writes OUT_DIR/rank<r>.pt: per reported
step (rank 0 only) the loss, grad norm and the step's (clipped) gradients; its final gradients
and adapter; and, when resuming, the adapter and optimizer state right after setup.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, Literal

import torch

import gpu_kernels
from gpu_kernels.dispatch import KernelStatus
from worker.engine import distributed, recipe
from worker.engine.lora import lora_state_dict
from worker.engine.types import CheckpointInfo, StepMetrics, TrainConfig


def force_fused() -> None:
    """fuse_model swaps in the fused modules; every op still runs its reference twin on the CPU."""
    gpu_kernels.available = lambda: KernelStatus(True, "forced for a test")


class GradRecorder:
    def __init__(self) -> None:
        self.recipe: recipe.LoRAFinetuneRecipe | None = None
        self.steps: list[dict[str, Any]] = []
        self.events: list[str] = []

    def on_step(self, metrics: StepMetrics) -> None:
        assert self.recipe is not None
        grads = [p.grad.detach().clone() for p in self.recipe.params if p.grad is not None]
        self.steps.append(
            {"step": metrics.step, "loss": metrics.train_loss, "grad_norm": metrics.grad_norm,
             "tokens": metrics.tokens, "lr": metrics.lr, "grads": grads}
        )  # fmt: skip

    def on_event(self, level: Literal["info", "warn", "error"], message: str, data: Any = None) -> None:
        self.events.append(message)

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        return None

    def should_stop(self) -> bool:
        return False


def record_run(config: TrainConfig, out: Path) -> Path:
    """Train `config` in this process (a rank under torchrun); write and return rank<r>.pt."""
    rank = int(os.environ.get("RANK", "0"))
    rec = GradRecorder()
    run = recipe.LoRAFinetuneRecipe(config, rec)
    try:
        run.setup()
        rec.recipe = run
        resumed = None
        if config.resume_from is not None:
            # copies: on the CPU both dicts hold the live tensors, which training then changes
            resumed = copy.deepcopy(
                {"adapter": lora_state_dict(run.model), "optimizer": run.optimizer.state_dict()}
            )
        run.train()
        final = {
            "grads": [p.grad.detach().clone() for p in run.params if p.grad is not None],
            "adapter": copy.deepcopy(lora_state_dict(run.model)),
            "world_size": run.dist.world_size,
            "packed_step": run.step_fn is not None,
            # the rows this rank's step buffers hold: its share of every micro-batch
            "rank_rows": run.step_fn.shape.rows if run.step_fn is not None and run.step_fn.shape else None,
            "total_steps": run.total_steps,
        }
    finally:
        run.cleanup()
    path = out / f"rank{rank}.pt"
    torch.save({"steps": rec.steps, "events": rec.events, "final": final, "resumed": resumed}, path)
    return path


def main() -> int:
    config_path, out = (Path(a) for a in sys.argv[1:3])
    force_fused()
    record_run(distributed.config_from_json(config_path.read_text()), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
