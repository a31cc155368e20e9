"""Training checkpoints: everything needed to continue a run exactly where it stopped.

A checkpoint is a directory `output_dir/checkpoints/step-XXXXXX/`, written into a temp directory
beside it and renamed into place, so a crash leaves either the whole checkpoint or none:

    adapter_model.safetensors, adapter_config.json   the adapter (PEFT layout: loadable as is)
    training_state.pt     optimizer + scheduler state, RNG states, data position, counters;
                          read back with torch.load(weights_only=True) only (no code in pickles)
    trainer_state.json    step, trained tokens, data position and the config, for people and tools
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from worker.engine.export import ADAPTER_WEIGHTS, replace_dir_atomically, write_adapter
from worker.engine.lora import load_lora_state_dict
from worker.engine.types import ConfigError, TrainConfig

TRAINING_STATE = "training_state.pt"
TRAINER_STATE = "trainer_state.json"
CHECKPOINTS = "checkpoints"

# Fields that must match between a checkpoint and the config that resumes it: a change in any of
# them would make the resumed run a different run (other data order, other shapes, other schedule).
RESUME_MUST_MATCH = (
    "model",
    "max_seq_len",
    "batch_size",
    "grad_accum",
    "n_epochs",
    "max_steps",
    "learning_rate",
    "weight_decay",
    "lr_scheduler",
    "warmup_ratio",
    "seed",
    "pack",
    "row_tokens",
    "lora",
    "method",  # a DPO checkpoint never resumes a supervised run (nor another beta or rpo_alpha)
)
# what a checkpoint written before a key existed held: its run's value then
RESUME_DEFAULTS: dict[str, Any] = {"method": {"type": "supervised"}}


@dataclass
class TrainingState:
    """Counters of the run. `micro_batches` is the number of micro-batches consumed so far; the
    next one is batch `micro_batches % batches_per_epoch` of epoch `micro_batches // batches_per_epoch`."""

    step: int
    micro_batches: int
    trained_tokens: int
    last_train_loss: float


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / CHECKPOINTS / f"step-{step:06d}"


def rng_state() -> dict[str, Any]:
    return {
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        # random.getstate() is (version, tuple of 625 ints, gauss_next): store as plain lists
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda") or []
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(
    *,
    output_dir: Path,
    model: nn.Module,
    config: TrainConfig,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainingState,
    batches_per_epoch: int,
) -> Path:
    final = checkpoint_dir(output_dir, state.step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        write_adapter(tmp, model, config.lora, config.model)
        # To a file object: a failed write (a full disk) raises torch's RuntimeError from the
        # file's OSError, which says ENOSPC; given a path, torch's C++ writer loses the errno.
        with (tmp / TRAINING_STATE).open("wb") as state_file:
            torch.save(
                {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rng_state(),
                    "step": state.step,
                    "micro_batches": state.micro_batches,
                    "trained_tokens": state.trained_tokens,
                    "last_train_loss": state.last_train_loss,
                },
                state_file,
            )
        epoch, index = divmod(state.micro_batches, batches_per_epoch)
        summary = {
            "step": state.step,
            "trained_tokens": state.trained_tokens,
            "epoch": epoch,
            "batch_index": index,
            "micro_batches": state.micro_batches,
            "last_train_loss": state.last_train_loss,
            "config": config.to_dict(),
        }
        (tmp / TRAINER_STATE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
        replace_dir_atomically(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def check_resumable(checkpoint: Path, config: TrainConfig) -> None:
    """Refuse to resume when the checkpoint is incomplete or was made by a different run config."""
    for name in (ADAPTER_WEIGHTS, TRAINING_STATE, TRAINER_STATE):
        if not (checkpoint / name).is_file():
            raise ConfigError("resume_from", f"resume_from {checkpoint} is not a checkpoint: no {name}")
    saved = json.loads((checkpoint / TRAINER_STATE).read_text())["config"]
    current = config.to_dict()
    for key in RESUME_MUST_MATCH:
        was = saved.get(key, RESUME_DEFAULTS.get(key))
        if key == "method" and isinstance(was, dict) and was.get("type") == "dpo":
            was = {"rpo_alpha": 0.0, **was}  # a DPO checkpoint from before rpo_alpha trained DPO alone
        if was != current.get(key):
            raise ConfigError(
                key,
                f"cannot resume from {checkpoint}: {key} was {saved.get(key)!r} there, "
                f"now {current.get(key)!r}",
            )


def load_checkpoint(
    checkpoint: Path,
    *,
    model: nn.Module,
    config: TrainConfig,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainingState:
    """Restore adapter weights, optimizer, scheduler and RNG states; return the run's counters."""
    check_resumable(checkpoint, config)
    device = next(p for p in model.parameters()).device
    load_lora_state_dict(model, load_file(str(checkpoint / ADAPTER_WEIGHTS), device=str(device)))
    blob = torch.load(checkpoint / TRAINING_STATE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    set_rng_state(blob["rng"])
    return TrainingState(
        step=int(blob["step"]),
        micro_batches=int(blob["micro_batches"]),
        trained_tokens=int(blob["trained_tokens"]),
        last_train_loss=float(blob["last_train_loss"]),
    )
