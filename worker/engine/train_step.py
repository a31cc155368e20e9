"""One training step at a fixed token budget, captured as a CUDA graph where possible.

The step reads static (batch, seq) buffers that each call refills (rows padded with labels
-100: right padding under a causal mask changes no real token's output), runs forward with the
fused loss, backward, sync-free clipping, and `AdamW(fused=True, capturable=True)` with the
learning rate held in a device tensor, so a replay needs no host work at all. The first
`warmup` calls run eagerly (that is also when the optimizer state is created), the next one
captures; if capture fails the step stays eager and `on_fallback` hears why.
Non-finite gradients are flagged on the device and read every `check_every` steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import gpu_kernels
from worker.engine.fused_llama import causal_lm_loss


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
    ) -> None:
        device = params[0].device
        self.device = device
        self.model = model
        self.params = params
        self.batch = batch
        self.seq = seq
        self.max_grad_norm = max_grad_norm
        self.input_ids = torch.zeros(batch, seq, dtype=torch.int64, device=device)
        self.labels = torch.full((batch, seq), -100, dtype=torch.int64, device=device)
        self.lr = torch.tensor(lr, dtype=torch.float32, device=device)
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            params, lr=self.lr, weight_decay=weight_decay, fused=fused, capturable=fused
        )
        self.monitor = gpu_kernels.NonFiniteMonitor(device, every=check_every)
        self.graphed = gpu_kernels.GraphedStep(
            self._step, warmup=warmup, enabled=capture and fused, on_fallback=on_fallback
        )

    def _step(self) -> dict[str, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        gpu_kernels.dropout_seed_step_(self.device)
        loss = causal_lm_loss(self.model, self.input_ids, self.labels)
        loss.backward()
        norm = gpu_kernels.clip_grad_norm_(self.params, self.max_grad_norm, self.monitor.state)
        self.optimizer.step()
        return {"loss": loss.detach(), "grad_norm": norm}

    def load_batch(self, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
        """Copy a (b <= batch, s <= seq) batch into the static buffers, padding the rest."""
        b, s = input_ids.shape
        if b > self.batch or s > self.seq:
            raise ValueError(f"batch {b}x{s} exceeds the captured budget {self.batch}x{self.seq}")
        self.input_ids.zero_()
        self.labels.fill_(-100)
        self.input_ids[:b, :s].copy_(input_ids, non_blocking=True)
        self.labels[:b, :s].copy_(labels, non_blocking=True)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, lr: float) -> dict[str, torch.Tensor]:
        """One optimizer step on this batch; returns device tensors (read them when needed)."""
        self.load_batch(input_ids, labels)
        self.lr.fill_(lr)
        return self.graphed()
