"""Learning-rate schedules against values worked out by hand (10 steps, 2 of warmup)."""

from __future__ import annotations

import math

import pytest
import torch

from worker.engine.schedule import build_scheduler, lr_factor, warmup_steps

TOTAL, WARMUP = 10, 2
# after warmup, p = (step - 2) / 8 for steps 2..9
HAND = {
    "constant": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    "linear": [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125],
    "cosine": [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)],
}


@pytest.mark.parametrize("kind", sorted(HAND))
def test_lr_factor_matches_hand_values(kind: str) -> None:
    got = [lr_factor(s, total_steps=TOTAL, warmup=WARMUP, kind=kind) for s in range(TOTAL)]  # type: ignore[arg-type]
    assert got == pytest.approx(HAND[kind])


def test_cosine_midpoint_and_end() -> None:
    # no warmup: halfway is exactly 0.5, the last step is just above 0 and never negative
    assert lr_factor(5, total_steps=10, warmup=0, kind="cosine") == pytest.approx(0.5)
    assert 0 < lr_factor(9, total_steps=10, warmup=0, kind="cosine") < 0.03
    assert lr_factor(12, total_steps=10, warmup=0, kind="cosine") == 0.0  # past the end: clamped


def test_warmup_rounds_up_and_unknown_kind_fails() -> None:
    assert warmup_steps(10, 0.15) == 2 and warmup_steps(10, 0.0) == 0
    with pytest.raises(ValueError, match="unknown lr_scheduler 'step'"):
        lr_factor(5, total_steps=10, warmup=0, kind="step")  # type: ignore[arg-type]


def test_scheduler_drives_the_optimizer_lr() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=0.1)
    sched = build_scheduler(opt, total_steps=TOTAL, warmup_ratio=0.2, kind="linear")
    seen = []
    for _ in range(TOTAL):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1 * f for f in HAND["linear"]])
