"""How the engine obeys a memory plan (worker/engine/step_memory.py), on the CPU: activation
checkpointing (full, selective) and offload change no loss or gradient, bit for bit; micro-batches
split into passes of fewer rows give the same loss (Σ CE / N over the whole step) to rounding."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from gpu_kernels import KernelStatus
from tests.engine.recipe_helpers import Recorder, tiny_config
from worker.engine import fused_model
from worker.engine.catalog import PRESET_SHAPES
from worker.engine.data import IGNORE_INDEX, Batch
from worker.engine.lora import apply_lora, trainable_parameters
from worker.engine.memory_plan import MemoryChoice, ModelDims, plan_memory, predict_peak
from worker.engine.models import LoadedModel
from worker.engine.recipe import train
from worker.engine.step_memory import apply_checkpointing, obey, offloaded, remove_checkpointing, split_rows
from worker.engine.types import ConfigError, LoraConfig

CHOICES = {
    "full": MemoryChoice(None, "full"),
    "selective": MemoryChoice(None, "selective"),
    "full+offload": MemoryChoice(None, "full", offload=True),
    "offload": MemoryChoice(None, "none", offload=True),
}


def loss_and_grads(model: Any, choice: MemoryChoice) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward/backward of a LoRA model (dropout on) in fp64 under `choice`."""
    torch.manual_seed(0)
    apply_lora(model, LoraConfig(r=4, alpha=8.0, dropout=0.1))
    model.train()
    for p in trainable_parameters(model):
        torch.nn.init.normal_(p, std=0.05)
    apply_checkpointing(model, choice.checkpointing)
    ids = torch.randint(3, 500, (3, 32), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :10] = IGNORE_INDEX
    torch.manual_seed(2)  # the dropout masks
    with offloaded(choice.offload, torch.device("cpu")):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), [p.grad for p in trainable_parameters(model) if p.grad is not None]


@pytest.mark.parametrize("name", list(CHOICES))
def test_checkpointing_and_offload_change_no_loss_or_gradient_bit_for_bit(
    tiny: LoadedModel, name: str
) -> None:
    plain = copy.deepcopy(tiny.model).double()
    ours = copy.deepcopy(tiny.model).double()
    loss, grads = loss_and_grads(plain, MemoryChoice())
    got, got_grads = loss_and_grads(ours, CHOICES[name])
    assert torch.equal(got, loss)
    assert len(got_grads) == len(grads) == 28
    for g, ref in zip(got_grads, grads, strict=True):
        assert torch.equal(g, ref)
    remove_checkpointing(ours)
    assert not any("forward" in m.__dict__ for m in ours.modules())  # the plain forwards are back


def test_checkpointing_recomputes_the_layers_it_names(tiny: LoadedModel) -> None:
    model = copy.deepcopy(tiny.model)
    assert apply_checkpointing(model, "full") == 2  # tiny-llama's two decoder layers
    assert apply_checkpointing(model, "selective") == 2  # their MLPs (the layers' patch undone)
    assert "forward" in model.model.layers[0].mlp.__dict__ and "forward" not in model.model.layers[0].__dict__
    assert apply_checkpointing(model, "none") == 0


def test_split_rows_are_the_batch_in_order() -> None:
    ids = torch.arange(5 * 4).view(5, 4)
    batch = Batch(ids, ids.clone(), torch.ones_like(ids), ids % 4, False, torch.arange(5))
    parts = split_rows(batch, 2)
    assert [p.input_ids.shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p.input_ids for p in parts]), ids)
    assert torch.equal(torch.cat([p.row_ids for p in parts if p.row_ids is not None]), torch.arange(5))
    assert split_rows(batch, None) == [batch] and split_rows(batch, 8) == [batch]


def _run(
    tmp: Path, memory: MemoryChoice | None, dropout: float = 0.1
) -> tuple[Recorder, dict[str, torch.Tensor]]:
    recorder = Recorder()
    cfg = tiny_config(tmp, memory=memory, max_steps=4, lora=LoraConfig(r=4, alpha=8.0, dropout=dropout))
    result = train(cfg, recorder)
    return recorder, load_file(result.adapter_dir / "adapter_model.safetensors")


def test_a_job_with_checkpointing_and_offload_trains_the_same_adapter_bit_for_bit(tmp_path: Path) -> None:
    plain, plain_adapter = _run(tmp_path / "plain", None)
    ours, adapter = _run(tmp_path / "full", MemoryChoice(None, "full", offload=True))
    assert [m.train_loss for m in ours.steps] == [m.train_loss for m in plain.steps]
    assert [m.grad_norm for m in ours.steps] == [m.grad_norm for m in plain.steps]
    assert adapter.keys() == plain_adapter.keys()
    assert all(torch.equal(adapter[k], plain_adapter[k]) for k in adapter)


def test_a_job_split_into_one_row_passes_has_the_same_loss(tmp_path: Path) -> None:
    # no dropout: a pass of fewer rows draws its dropout mask in another shape
    plain, plain_adapter = _run(tmp_path / "plain", None, dropout=0.0)
    split, adapter = _run(tmp_path / "split", MemoryChoice(1, "none"), dropout=0.0)
    for a, b in zip(split.steps, plain.steps, strict=True):  # 4 rows a step in 4 passes of 1 row
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-6)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for k in adapter:
        torch.testing.assert_close(adapter[k], plain_adapter[k], rtol=1e-4, atol=1e-6)


def test_the_packed_captured_step_obeys_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The captured step's machinery (fused modules with the reference ops, static buffers) on the
    CPU: split into 1-row passes (k·4 micro-batches of 1 row in the static shape) the loss is the
    same to rounding; with full checkpointing it is the same bit for bit."""
    monkeypatch.setattr(fused_model.gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))

    def run(name: str, memory: MemoryChoice | None) -> Recorder:
        recorder = Recorder()
        train(tiny_config(tmp_path / name, memory=memory, max_steps=2, pack=True, max_seq_len=96), recorder)
        assert any(m.startswith("Training step: fused kernels") for _, m in recorder.events)
        return recorder

    plain, split, full = (
        run("plain", None),
        run("split", MemoryChoice(1, "none")),
        run("full", MemoryChoice(None, "full")),
    )
    assert any("4x1 rows" in m or "x1 rows" in m for _, m in split.events)
    for a, b in zip(split.steps, plain.steps, strict=True):
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-6)
    assert [m.train_loss for m in full.steps] == [m.train_loss for m in plain.steps]
    assert [m.grad_norm for m in full.steps] == [m.grad_norm for m in plain.steps]


def _gpu_budgets() -> dict[str, int]:
    """GPU bytes that make tiny-llama's step (4 rows of 64 tokens, r=8) fit whole, fit only with
    checkpointing, or not at all (the plan keeps 90 % of them)."""
    dims = ModelDims.from_config(PRESET_SHAPES["tiny-llama"].config_kwargs())

    def peak(choice: MemoryChoice, rows: int) -> int:
        return predict_peak(dims, rank=8, targets="all-linear", micro_tokens=rows * 64, choice=choice)[
            "total"
        ]

    # between one row recomputed and one row kept: no split alone fits, checkpointing does
    one_kept, one_recomputed = peak(MemoryChoice(1), 1), peak(MemoryChoice(1, "selective"), 1)
    return {
        "fits": int(peak(MemoryChoice(), 4) / 0.9) + 1,
        "checkpointing": int((one_kept + one_recomputed) / 2 / 0.9),
        "no": 100 << 20,
    }


@pytest.mark.parametrize(
    ("budget", "cap", "level", "words"),
    [
        ("fits", None, "info", "whole micro-batches, no activation checkpointing"),
        ("checkpointing", None, "warn", "(fits only with activation checkpointing)"),
        ("no", None, "warn", "does not fit"),
        # a free 80 GB GPU, but the process is capped (torch's per-process memory fraction)
        ("fits", "checkpointing", "warn", "(fits only with activation checkpointing)"),
    ],
)
def test_on_a_gpu_the_plan_comes_from_its_free_memory_and_is_announced(
    tiny: LoadedModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    budget: str,
    cap: str | None,
    level: str,
    words: str,
) -> None:
    """`obey` on a CUDA device without a configured choice plans for the GPU's free memory plus
    what the process holds (both faked here), no more than the process's memory cap where one
    is set, says so once with the plan's data, and applies the choice."""
    from worker.engine import step_memory

    budgets = _gpu_budgets()
    free, total = budgets[budget], 80 << 30
    fraction = budgets[cap] / total if cap else 1.0
    monkeypatch.setattr(step_memory.torch.cuda, "mem_get_info", lambda device: (free - (1 << 20), total))
    monkeypatch.setattr(step_memory.torch.cuda, "memory_allocated", lambda device: 1 << 20)
    monkeypatch.setattr(step_memory.torch.cuda, "get_per_process_memory_fraction", lambda device: fraction)
    monkeypatch.setattr(step_memory.torch.cuda, "current_device", lambda: 0)  # device "cuda": index 0
    events: list[tuple[str, str, Any]] = []
    model = copy.deepcopy(tiny.model)
    cfg = tiny_config(tmp_path, batch_size=4, max_seq_len=64, lora=LoraConfig(r=8, alpha=16.0))
    choice = step_memory.obey(
        cfg, model, torch.device("cuda"), rows=4, seq=64, announce=lambda *e: events.append(e)
    )
    ((got_level, message, data),) = events
    assert got_level == level and message.startswith("Memory plan: ") and words in message, message
    expect_whole = budget == "fits" and cap is None
    assert (choice == MemoryChoice()) == expect_whole
    plan = data["memory_plan"]
    assert (plan["micro_rows"], plan["checkpointing"], plan["offload"]) == (
        choice.micro_rows,
        choice.checkpointing,
        choice.offload,
    )
    assert plan["limit_bytes"] == int(0.9 * min(budgets[budget], budgets[cap] if cap else total))
    dims = ModelDims.from_config(PRESET_SHAPES["tiny-llama"].config_kwargs())
    micro_tokens = (choice.micro_rows or 4) * 64
    predicted = predict_peak(dims, rank=8, targets="all-linear", micro_tokens=micro_tokens, choice=choice)
    assert plan["predicted_peak_bytes"] == predicted["total"] and plan["breakdown"] == predicted
    assert plan["fits"] == (budget != "no")
    patched = any("forward" in m.__dict__ for m in model.modules())
    assert patched == (choice.checkpointing != "none")
    remove_checkpointing(model)


def test_offload_is_for_the_eager_step_only(tiny: LoadedModel, tmp_path: Path) -> None:
    """The captured step keeps its saved tensors on the GPU: a config asking for offload there is
    refused naming `memory`, and a plan made for it never offloads."""
    cfg = tiny_config(tmp_path, memory=MemoryChoice(None, "full", offload=True))
    with pytest.raises(ConfigError) as err:
        obey(
            cfg,
            copy.deepcopy(tiny.model),
            torch.device("cpu"),
            rows=4,
            seq=64,
            announce=print,
            allow_offload=False,
        )
    assert err.value.param == "memory"
    dims = ModelDims.from_config(PRESET_SHAPES["llama-8b"].config_kwargs())
    tight = plan_memory(dims, rank=16, targets="all-linear", rows=8, seq=8192, gpu_bytes=20 << 30)
    assert tight.choice.offload  # the eager step would offload here
    captured = plan_memory(
        dims, rank=16, targets="all-linear", rows=8, seq=8192, gpu_bytes=20 << 30, allow_offload=False
    )
    assert not captured.choice.offload and captured.choice.checkpointing == "full"
