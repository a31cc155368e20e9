"""The job path's packed step, on the CPU in float64 through gpu_kernels' reference ops.

`fuse_model` is forced on (as in tests/gpu_kernels/test_fused_model.py), so the fused modules,
variable-length attention over cu_seqlens and the gathered loss run exactly as on the GPU, with
the reference twin of every kernel. The oracle is the plain (unfused) Hugging Face model run on
one example at a time.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from gpu_kernels.dispatch import KernelStatus
from worker.engine import fused_model
from worker.engine.data import IGNORE_INDEX, Row, collate
from worker.engine.lora import apply_lora, trainable_parameters
from worker.engine.models import load_base_model
from worker.engine.train_step import CapturedTrainStep, HostStep, StepShape, host_step
from worker.engine.types import LoraConfig

LENGTHS = [7, 12, 5, 9]  # four examples; rows of 40 tokens hold all of them (33) plus padding
SEQ = 40


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = load_base_model("tiny-llama", store=Path(tmp_path_factory.mktemp("store"))).model
    assert isinstance(model, LlamaForCausalLM)
    apply_lora(model, LoraConfig(r=4, alpha=8))
    model.double()
    for p in trainable_parameters(model):
        torch.nn.init.normal_(p, std=0.05)  # B nonzero, so the LoRA path matters
    return model


@pytest.fixture
def fused(base: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> LlamaForCausalLM:
    monkeypatch.setattr(fused_model.gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))
    model = copy.deepcopy(base)
    fused_model.fuse_model(model)
    assert fused_model.fused_stack(model.model)
    return model


def examples(seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per example: the first third is prompt (no loss), as in chat data."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        ids = torch.randint(3, 400, (n,), generator=g).tolist()
        labels = [IGNORE_INDEX if t <= n // 3 else x for t, x in enumerate(ids)]
        out.append((ids, labels))
    return out


def packed_row(exs: list[tuple[list[int], list[int]]]) -> Row:
    row = Row([], [], [], [])
    for i, (ids, labels) in enumerate(exs):
        row.input_ids += ids
        row.labels += labels
        row.position_ids += range(len(ids))
        row.lines.append(i + 1)
    return row


def shape(micro: int = 1, rows: int = 1) -> StepShape:
    return StepShape(micro, rows, SEQ, segments=rows * 8, loss_tokens=rows * SEQ)


def only_example(host: HostStep, row: Row, which: int) -> HostStep:
    """The same step with the loss restricted to one example's positions of the packed row."""
    start = sum(LENGTHS[:which])
    keep = (host.loss_index[0] >= start) & (host.loss_index[0] < start + LENGTHS[which] - 1)
    targets = torch.where(keep, host.loss_targets[0], torch.full_like(host.loss_targets[0], IGNORE_INDEX))
    return HostStep(
        host.input_ids, host.position_ids, host.cu_seqlens, host.loss_index, targets.unsqueeze(0), 1, 0
    )


def loss_and_grads(model: torch.nn.Module, host: HostStep) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Σ CE of the step (scale 1) and the adapters' gradients, through packed_lm_loss."""
    inputs = fused_model.PackedInputs(
        host.input_ids,
        host.position_ids,
        host.cu_seqlens,
        SEQ,
        host.loss_index,
        host.loss_targets,
        torch.ones((), dtype=torch.float64),
    )
    params = trainable_parameters(model)
    model.zero_grad(set_to_none=True)
    loss = fused_model.packed_lm_loss(model, inputs, 0)
    loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def alone(
    model: torch.nn.Module, ids: list[int], labels: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Σ CE and gradients of one example run by itself through the plain Hugging Face model."""
    params = trainable_parameters(model)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels[1:]), reduction="sum")
    loss.backward()
    return loss.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def test_host_step_layout() -> None:
    exs = examples()
    row = packed_row(exs)
    host = host_step([collate([row], 0, packed=True)], shape())
    # sequences start at 0, 7, 19, 24; the 7 padding columns continue the last one (after its
    # real tokens: causal attention keeps them unseen); the unused offsets repeat the end
    assert host.cu_seqlens[0].tolist() == [0, 7, 19, 24, 40, 40, 40, 40, 40]
    assert host.position_ids[0, 0].tolist() == [*range(7), *range(12), *range(5), *range(16)]
    padded = host_step([collate([row], 0, packed=True, pad_to=SEQ)], shape())  # the same, padded first
    assert torch.equal(padded.cu_seqlens, host.cu_seqlens) and torch.equal(
        padded.position_ids, host.position_ids
    )
    assert host.trainable_tokens == sum(1 for _, labels in exs for x in labels if x != IGNORE_INDEX)
    assert host.real_tokens == 33
    n = host.trainable_tokens
    # position t predicts token t + 1: no position predicts the first token of the next example
    index = host.loss_index[0, :n].tolist()
    assert all(host.input_ids[0, 0, t + 1] == host.loss_targets[0, k] for k, t in enumerate(index))
    assert not {6, 18, 23} & set(index)
    assert (host.loss_targets[0, n:] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="4 sequences, over the step's 3"):
        host_step([collate([row], 0, packed=True, pad_to=SEQ)], StepShape(1, 1, SEQ, 3, SEQ))
    with pytest.raises(ValueError, match="trainable tokens, over"):
        host_step([collate([row], 0, packed=True)], StepShape(1, 1, SEQ, 8, 8))


def test_packed_row_losses_and_grads_equal_examples_one_at_a_time(
    base: torch.nn.Module, fused: torch.nn.Module
) -> None:
    """Each example's loss and gradient inside the packed row equal (a) the same example alone in
    a row, through the same reference path, to float64 rounding, and (b) the example alone
    through the plain Hugging Face model, whose RMSNorm computes in float32 even in a float64
    model (so ~1e-9 apart there, where a leak or a wrong divisor is O(1))."""
    exs = examples()
    row = packed_row(exs)
    host = host_step([collate([row], 0, packed=True)], shape())
    total, total_grads = loss_and_grads(fused, host)
    expect_total = torch.zeros((), dtype=torch.float64)
    expect_grads = [torch.zeros_like(g) for g in total_grads]
    for i, (ids, labels) in enumerate(exs):
        got, got_grads = loss_and_grads(fused, only_example(host, row, i))
        single = host_step([collate([packed_row([(ids, labels)])], 0, packed=True, pad_to=SEQ)], shape())
        want, want_grads = loss_and_grads(fused, single)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-14)
        hf, hf_grads = alone(base, ids, labels)
        torch.testing.assert_close(got, hf, rtol=1e-8, atol=1e-9)
        for g, w in zip(got_grads, hf_grads, strict=True):
            assert float((g - w).norm()) <= 1e-6 * float(w.norm()) + 1e-12
        expect_total += want
        expect_grads = [e + w for e, w in zip(expect_grads, want_grads, strict=True)]
    torch.testing.assert_close(total, expect_total, rtol=1e-13, atol=1e-13)
    for g, e in zip(total_grads, expect_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-14)


def test_no_example_sees_another_in_its_row(fused: torch.nn.Module) -> None:
    """Change every token of example 1 (not its length): examples 0, 2 and 3 keep their loss and
    gradient. The same change does move them under plain causal attention over the row, so the
    perturbation is one that a leak would show."""
    exs = examples()
    changed = copy.deepcopy(exs)
    changed[1] = ([(x * 7 + 11) % 397 + 3 for x in exs[1][0]], exs[1][1])
    row_a, row_b = packed_row(exs), packed_row(changed)
    host_a = host_step([collate([row_a], 0, packed=True)], shape())
    host_b = host_step([collate([row_b], 0, packed=True)], shape())
    for i in (0, 2, 3):
        loss_a, grads_a = loss_and_grads(fused, only_example(host_a, row_a, i))
        loss_b, grads_b = loss_and_grads(fused, only_example(host_b, row_b, i))
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=1e-12)
        for a, b in zip(grads_a, grads_b, strict=True):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-13)
    # the control: one causal sequence per row (cu_seqlens = [0, 40]) leaks example 1 into 2 and 3
    for host in (host_a, host_b):
        host.cu_seqlens[0] = torch.tensor([0] + [SEQ] * 8, dtype=torch.int32)
    leak_a, _ = loss_and_grads(fused, only_example(host_a, row_a, 2))
    leak_b, _ = loss_and_grads(fused, only_example(host_b, row_b, 2))
    assert abs(float(leak_a - leak_b)) > 1e-6


def _one_step(
    model: torch.nn.Module, rows: list[Row], micro: int, per: int
) -> tuple[float, list[torch.Tensor]]:
    """One optimizer step of the captured-step class (eager on the CPU) on the rows, split into
    `micro` micro-batches of `per` rows; returns the loss and the updated adapters."""
    model = copy.deepcopy(model)
    params = trainable_parameters(model)
    step = CapturedTrainStep(
        model, params, batch=per, seq=SEQ, lr=1e-2, max_grad_norm=1e9, shape=shape(micro, per), warmup=1
    )
    batches = [collate(rows[i * per : (i + 1) * per], 0, packed=True) for i in range(micro)]
    host = host_step(batches, step.shape)  # type: ignore[arg-type]
    step.load_step(host)
    assert step.fixed is None  # a packed step keeps no (B, T) buffers of the fixed-shape kind
    with pytest.raises(ValueError, match="use load_step"):
        step.load_batch(batches[0].input_ids, batches[0].labels)
    out = step.run()
    return float(out["loss"]), [p.detach().clone() for p in params]


def test_grad_accumulation_4x1_equals_1x4(fused: torch.nn.Module) -> None:
    """Rows of different trainable counts: a mean of per-micro-batch means would differ."""
    rows = [packed_row(examples(seed)[: 1 + seed % 4]) for seed in range(4)]
    assert len({sum(1 for x in r.labels if x != IGNORE_INDEX) for r in rows}) > 1
    loss_41, after_41 = _one_step(fused, rows, micro=4, per=1)
    loss_14, after_14 = _one_step(fused, rows, micro=1, per=4)
    assert loss_41 == pytest.approx(loss_14, rel=1e-12)
    for a, b in zip(after_41, after_14, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # and the loss is the mean over all trainable tokens of the step
    host = host_step([collate(rows, 0, packed=True)], shape(1, 4))
    total, _ = loss_and_grads(
        copy.deepcopy(fused), dataclasses.replace(host, trainable_tokens=1, real_tokens=0)
    )
    assert loss_14 == pytest.approx(float(total) / host.trainable_tokens, rel=1e-12)
