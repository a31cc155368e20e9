"""One optimizer step at a fixed token budget, captured as a CUDA graph where possible.

The step reads static device buffers that each call refills, runs forward with the fused loss,
backward, sync-free clipping, and `AdamW(fused=True, capturable=True)` with the learning rate held
in a device tensor, so a replay needs no host work at all. The first `warmup` calls run eagerly
(that is also when the optimizer state is created), the next one captures; if capture fails the
step stays eager and `on_fallback` hears why. Non-finite gradients are flagged on the device.

Two ways to fill the buffers:

- `load_step(HostStep)`: the job path. `micro_batches` (k) micro-batches of `batch` (B) rows of
  `seq` (T) tokens. Attention is confined to each example by variable-length attention over
  per-micro-batch offsets `cu_seqlens` (k, K + 1) (K = `segments`, padded by repeating B·T, so
  the shape never changes); position ids restart per example. The LM head and cross-entropy run
  only on the trainable positions, gathered through `loss_index` (k, M) (M = `loss_tokens`,
  padded with target -100). The loss of the step is

      L = Σ_micro Σ_trainable CE / N,    N = the trainable tokens of all k micro-batches,

  with 1/N in a device scalar: never a mean of per-row or per-micro-batch means. The objective is
  a parameter (`StepObjective`): DPO (worker/engine/preference.py) sums per-token log-probs by
  sequence and divides by the step's pairs instead, from static buffers of its own.
- `load_batch(input_ids, labels)`: one (B, T) batch with plain causal rows (the fixed-shape
  benchmark step, and tests).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

import gpu_kernels
from worker.engine.data import IGNORE_INDEX, Batch
from worker.engine.fused_model import PackedInputs, attach_adapter_casts, causal_lm_loss, packed_lm_loss

if TYPE_CHECKING:
    from worker.engine.preference import HostPairs


class GradSync(Protocol):
    """Multi-GPU: the gradients' flat buffer (worker.engine.distributed.FlatGrads)."""

    def zero_(self) -> None: ...
    def all_reduce_(self, loss: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepShape:
    """The static shape of one optimizer step's buffers."""

    micro_batches: int  # k
    rows: int  # B, rows per micro-batch
    seq: int  # T, tokens per row
    segments: int  # K, sequences per micro-batch that cu_seqlens can describe (>= B)
    loss_tokens: int  # M, trainable positions per micro-batch that loss_index can hold
    pairs: int = 0  # Q, preference pairs per micro-batch (DPO's objective); 0: not a preference step

    @property
    def slots(self) -> int:
        """Token slots per step: what the GPU computes on, real or padding."""
        return self.micro_batches * self.rows * self.seq


@dataclass
class HostStep:
    """One optimizer step's inputs as CPU tensors, laid out for `StepShape`."""

    input_ids: torch.Tensor  # (k, B, T) int32 (the embedding takes int32 indices: half the bytes)
    position_ids: torch.Tensor  # (k, B, T) int64, restarting at 0 at every sequence start
    cu_seqlens: torch.Tensor  # (k, K + 1) int32, offsets into the flattened B·T tokens
    loss_index: torch.Tensor  # (k, M) int64, flat positions t whose next token is trained
    loss_targets: torch.Tensor  # (k, M) int64, that next token (-100 on padding entries)
    trainable_tokens: int  # N: Σ over micro-batches, the loss's divisor
    real_tokens: int  # non-padding tokens
    pairs: HostPairs | None = None  # a DPO step's pair layout and reference values

    @property
    def divisor(self) -> int:
        """What the step's loss divides by: its pairs (DPO), else its trainable tokens."""
        return self.pairs.pairs if self.pairs is not None else self.trainable_tokens


def segment_count(position_ids: torch.Tensor) -> int:
    """Sequences in a (..., T) position-id tensor: every 0 starts one."""
    return int((position_ids == 0).sum())


def host_step(batches: Sequence[Batch], shape: StepShape) -> HostStep:
    """Lay the micro-batches (each (b <= B, t <= T), on the CPU) into the step's static shape.

    Missing rows and micro-batches are padding: one sequence each, no trainable tokens. A
    sequence starts wherever position_ids is 0, so packed examples (and a packed row's padding
    tail) are separate sequences, and an unpacked row's padding stays in the row's own sequence,
    after its real tokens (causal: no real token sees it)."""
    k, b_max, t_max, segs, m_max = (
        shape.micro_batches, shape.rows, shape.seq, shape.segments, shape.loss_tokens
    )  # fmt: skip
    if not 0 < len(batches) <= k:
        raise ValueError(f"{len(batches)} micro-batches for a step of {k}")
    n = b_max * t_max
    input_ids = torch.zeros(k, b_max, t_max, dtype=torch.int32)
    position_ids = torch.arange(t_max, dtype=torch.int64).repeat(k, b_max, 1)
    cu_seqlens = torch.full((k, segs + 1), n, dtype=torch.int32)
    loss_index = torch.zeros(k, m_max, dtype=torch.int64)
    loss_targets = torch.full((k, m_max), IGNORE_INDEX, dtype=torch.int64)
    trainable = real = 0
    for i, batch in enumerate(batches):
        b, t = batch.input_ids.shape
        if b > b_max or t > t_max:
            raise ValueError(f"micro-batch {b}x{t} exceeds the step's {b_max}x{t_max}")
        input_ids[i, :b, :t] = batch.input_ids
        for r, n_real in enumerate(batch.attention_mask.sum(dim=1).tolist()):
            # real tokens keep their positions; the row's padding, and the columns that widen it to
            # T, continue its last sequence (after its real tokens, so causal attention keeps them
            # unseen): no sequence slot is spent on padding
            position_ids[i, r, :n_real] = batch.position_ids[r, :n_real]
            last = int(batch.position_ids[r, n_real - 1]) + 1 if n_real else 0
            position_ids[i, r, n_real:] = torch.arange(last, last + t_max - n_real)
        starts = (position_ids[i].reshape(-1) == 0).nonzero().flatten()
        if starts.numel() > segs:
            raise ValueError(f"micro-batch {i} has {starts.numel()} sequences, over the step's {segs}")
        cu_seqlens[i, : starts.numel()] = starts.to(torch.int32)
        # position t (flat b·T + t) predicts labels[b, t + 1]
        targets = torch.full((b_max, t_max), IGNORE_INDEX, dtype=torch.int64)
        targets[:b, : t - 1] = batch.labels[:, 1:]
        flat = targets.reshape(-1)
        keep = (flat != IGNORE_INDEX).nonzero().flatten()
        if keep.numel() > m_max:
            raise ValueError(f"micro-batch {i} has {keep.numel()} trainable tokens, over the step's {m_max}")
        loss_index[i, : keep.numel()] = keep
        loss_targets[i, : keep.numel()] = flat[keep]
        trainable += keep.numel()
        real += int(batch.attention_mask.sum())
    for i in range(len(batches), k):  # absent micro-batches: B whole-row sequences
        cu_seqlens[i, :b_max] = torch.arange(0, n, t_max, dtype=torch.int32)
    return HostStep(input_ids, position_ids, cu_seqlens, loss_index, loss_targets, trainable, real)


class StepObjective(Protocol):
    """What the packed step minimises, if not the cross-entropy of its trained tokens: static
    buffers of its own (allocated once, refilled from each HostStep) and micro-batch i's loss,
    × the step's `loss_scale`, with `readings` numbers summed over the step beside it."""

    readings: int

    def allocate(
        self, micro_batches: int, loss_tokens: int, max_pairs: int, device: torch.device
    ) -> None: ...
    def copies(self, pairs: HostPairs) -> list[tuple[torch.Tensor, torch.Tensor]]: ...
    def micro_loss(
        self, model: nn.Module, packed: PackedInputs, i: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class CapturedTrainStep:
    def __init__(
        self,
        model: nn.Module,
        params: list[nn.Parameter],
        *,
        batch: int,
        seq: int,
        lr: float,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        capture: bool = True,
        warmup: int = 3,
        check_every: int = 50,
        on_fallback: Callable[[str], None] | None = None,
        shape: StepShape | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        grads: GradSync | None = None,
        agree: Callable[[bool], bool] | None = None,
        objective: StepObjective | None = None,
    ) -> None:
        """`shape` set: the packed job step (`load_step`); unset: one fixed (batch, seq) batch
        (`load_batch`). `optimizer`, if given, must be a capturable AdamW whose lr is a device
        tensor on CUDA (see `capturable_adamw`). Multi-GPU: `grads` zeroes the flat gradient
        buffer before the backward and sums it (and the loss) over the ranks after it, inside
        the step (so inside the graph); `agree` makes the ranks take the same capture decisions
        (see GraphedStep). `objective`: what a packed step minimises (None: the cross-entropy);
        its readings come back as `readings` beside the loss, summed over the ranks with it."""
        device = params[0].device
        self.device = device
        self.model = model
        self.params = params
        self.batch = batch
        self.seq = seq
        self.shape = shape
        self.max_grad_norm = max_grad_norm
        self.grads = grads
        self.objective = objective
        # the (B, T) input_ids and labels of `load_batch`; a packed step has its own buffers instead
        self.fixed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.packed: PackedInputs | None = None
        fused_ok = device.type == "cuda"
        if shape is None:
            self.fixed = (
                torch.zeros(batch, seq, dtype=torch.int64, device=device),
                torch.full((batch, seq), IGNORE_INDEX, dtype=torch.int64, device=device),
            )
        else:
            k, m = shape.micro_batches, shape.loss_tokens
            self.packed = PackedInputs(
                input_ids=torch.zeros(k, batch, seq, dtype=torch.int32, device=device),
                position_ids=torch.zeros(k, batch, seq, dtype=torch.int64, device=device),
                cu_seqlens=torch.zeros(k, shape.segments + 1, dtype=torch.int32, device=device),
                max_seqlen=seq,
                loss_index=torch.zeros(k, m, dtype=torch.int64, device=device),
                loss_targets=torch.full((k, m), IGNORE_INDEX, dtype=torch.int64, device=device),
                # fp32 for the kernels; float64 on the CPU, where the reference path is the oracle
                loss_scale=torch.ones((), dtype=torch.float32 if fused_ok else torch.float64, device=device),
            )
            if objective is not None:
                objective.allocate(k, m, shape.pairs, device)
        if optimizer is None:
            optimizer = capturable_adamw(params, lr=lr, weight_decay=weight_decay)
        self.optimizer = optimizer
        self.lr = optimizer.param_groups[0]["lr"]
        self.monitor = gpu_kernels.NonFiniteMonitor(device, every=check_every)
        # every LoRA op's adapters in the activation dtype, one launch per step (fused CUDA models)
        self.casts = attach_adapter_casts(model) if fused_ok else None
        self.graphed = gpu_kernels.GraphedStep(
            self._step, warmup=warmup, enabled=capture and fused_ok, on_fallback=on_fallback, agree=agree
        )

    def _loss(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's loss (and its objective's readings), after running its backward (gradients
        accumulate over micro-batches)."""
        if self.packed is None:
            assert self.fixed is not None
            loss = causal_lm_loss(self.model, *self.fixed)
            loss.backward()
            return loss.detach(), None
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        readings: torch.Tensor | None = None
        for i in range(self.packed.input_ids.shape[0]):
            if self.objective is None:
                loss = packed_lm_loss(self.model, self.packed, i)
            else:
                loss, read = self.objective.micro_loss(self.model, self.packed, i)
                readings = read if readings is None else readings + read
            loss.backward()
            total = total + loss.detach()
        return total, readings

    def _step(self) -> dict[str, torch.Tensor]:
        if self.grads is None:
            self.optimizer.zero_grad(set_to_none=True)
        else:  # the backward adds into the flat buffer's views
            self.grads.zero_()
        gpu_kernels.dropout_seed_step_(self.device)
        # the adapters as the last optimizer step left them, cast once for the whole step
        with self.casts.in_step() if self.casts is not None else nullcontext():
            loss, readings = self._loss()
        if self.grads is not None:  # one all_reduce: every rank's gradients and loss summed
            if readings is None:
                loss = self.grads.all_reduce_(loss)
            else:  # and the readings, in the same buffer (FlatGrads(values=1 + readings))
                summed = self.grads.all_reduce_(torch.cat([loss.reshape(1), readings.to(loss.dtype)]))
                loss, readings = summed[0], summed[1:]
        norm = gpu_kernels.clip_grad_norm_(self.params, self.max_grad_norm, self.monitor.state)
        self.optimizer.step()
        out = {"loss": loss, "grad_norm": norm}
        if readings is not None:
            out["readings"] = readings
        return out

    def load_batch(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Copy a (b <= batch, s <= seq) batch into the static buffers, padding the rest."""
        if self.fixed is None:
            raise ValueError("this step was built with a StepShape: use load_step")
        b, s = input_ids.shape
        if b > self.batch or s > self.seq:
            raise ValueError(f"batch {b}x{s} exceeds the captured budget {self.batch}x{self.seq}")
        ids, lab = self.fixed
        ids.zero_()
        lab.fill_(IGNORE_INDEX)
        ids[:b, :s].copy_(input_ids, non_blocking=True)
        lab[:b, :s].copy_(labels, non_blocking=True)

    def load_step(self, host: HostStep) -> None:
        """Copy one packed step's inputs into the static buffers (asynchronously: pinned memory
        on CUDA, whose caching host allocator keeps each block until its copy has run)."""
        p = self.packed
        if p is None:
            raise ValueError("this step was built without a StepShape: use load_batch")
        pairs = [
            (p.input_ids, host.input_ids),
            (p.position_ids, host.position_ids),
            (p.cu_seqlens, host.cu_seqlens),
            (p.loss_index, host.loss_index),
            (p.loss_targets, host.loss_targets),
            (p.loss_scale, torch.tensor(1.0 / max(host.divisor, 1), dtype=torch.float64)),
        ]
        if self.objective is not None:
            if host.pairs is None:
                raise ValueError("this step's objective needs the step's pairs (HostStep.pairs)")
            pairs += self.objective.copies(host.pairs)
        pin = self.device.type == "cuda"
        for dst, src in pairs:
            dst.copy_(src.pin_memory() if pin else src, non_blocking=pin)

    def release(self) -> None:
        """Free the captured graph (before a multi-GPU run destroys its process group)."""
        self.graphed.release()

    def set_lr(self, lr: float) -> None:
        if isinstance(self.lr, torch.Tensor):
            self.lr.fill_(lr)
        else:
            self.optimizer.param_groups[0]["lr"] = lr

    def run(self) -> dict[str, torch.Tensor]:
        """One optimizer step on the loaded buffers; returns device tensors (read when needed)."""
        return self.graphed()

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, lr: float) -> dict[str, torch.Tensor]:
        """One optimizer step on this batch; returns device tensors (read them when needed)."""
        self.load_batch(input_ids, labels)
        self.set_lr(lr)
        return self.graphed()


def capturable_adamw(params: list[nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW as a captured step needs it on CUDA: fused, capturable, lr a device tensor (so an
    LR scheduler's update reaches the graph). On the CPU: the plain AdamW."""
    device = params[0].device
    if device.type != "cuda":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    lr_t = torch.tensor(lr, dtype=torch.float32, device=device)
    return torch.optim.AdamW(params, lr=lr_t, weight_decay=weight_decay, fused=True, capturable=True)
