"""Host side of the device-side non-finite gradient flag written by clip_grad_norm_.

The clip kernels count steps and record the first step whose gradient norm was non-finite in
a small int64[2] device tensor. Reading it costs a host sync, so the engine reads it only every
`every` steps (and at the end): a bad step is reported at most every-1 steps late, by number.
"""

from __future__ import annotations

import torch

from gpu_kernels import reference


class NonFiniteMonitor:
    def __init__(self, device: torch.device | str, every: int = 50) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.every = every
        self.state = reference.new_nonfinite_state(device)  # [first bad step, steps counted]

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def first_bad_step(self) -> int | None:
        """Reads the device flag (a host sync): the first step with non-finite grads, or None."""
        bad = int(self.state[0].item())
        return bad or None

    def check(self, step: int, *, force: bool = False) -> int | None:
        """At every `every`-th step (or when forced), the first bad step so far, else None."""
        if force or self.due(step):
            return self.first_bad_step()
        return None
