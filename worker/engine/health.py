"""Training health: tell the user when a run went wrong, from its losses alone.

Pure Python (no torch). The recipe feeds every step's train loss and every validation loss in;
`HealthMonitor` answers with findings (each kind reported once per run) or raises:

- diverged (fatal, `DivergedError`): a NaN/inf train loss, or once warm-up is over a train loss
  above DIVERGE_FACTOR × the first step's loss (and at least DIVERGE_MIN_RISE nats above it, so a
  run that starts near zero is not failed for the noise of one batch);
- overfitting: the validation loss rose at OVERFIT_RISES evaluations in a row while the train loss
  (its mean since the evaluation before) fell;
- memorizing: the mean train loss of the last MEMORIZE_WINDOW steps is below MEMORIZE_BELOW;
- not_training: over at least FLAT_MIN_STEPS steps, the mean loss of the last fifth of the steps is
  not FLAT_MIN_DROP (relatively) below that of the first fifth: nothing was learnt.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, Literal

from worker.engine.types import DivergedError, NonFiniteError

HealthKind = Literal["overfitting", "memorizing", "not_training"]

DIVERGE_FACTOR = 3.0
DIVERGE_MIN_RISE = 1.0
OVERFIT_RISES = 2
MEMORIZE_BELOW = 0.05
MEMORIZE_WINDOW = 5
FLAT_MIN_STEPS = 10
FLAT_MIN_DROP = 0.01


@dataclass(frozen=True)
class Finding:
    kind: HealthKind
    step: int
    message: str

    def data(self) -> dict[str, Any]:
        """The event's data: what the dashboard needs to put a badge on the job and the chart."""
        return {"health": self.kind, "step": self.step}


@dataclass
class HealthMonitor:
    warmup_steps: int = 0
    first_loss: float | None = None
    losses: list[float] = field(default_factory=list)
    # (step, validation loss, mean train loss since the evaluation before)
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    reported: set[HealthKind] = field(default_factory=set)
    _since_eval: list[float] = field(default_factory=list)

    def _once(self, kind: HealthKind, step: int, message: str) -> list[Finding]:
        if kind in self.reported:
            return []
        self.reported.add(kind)
        return [Finding(kind, step, message)]

    def check_step(self, step: int, loss: float) -> list[Finding]:
        """Before the optimizer applies this step: raise if it diverged, else the new findings."""
        if not math.isfinite(loss):
            raise NonFiniteError(step, "loss")
        if self.first_loss is None:
            self.first_loss = loss
        elif step > self.warmup_steps and loss > max(
            DIVERGE_FACTOR * self.first_loss, self.first_loss + DIVERGE_MIN_RISE
        ):
            raise DivergedError(
                step,
                f"train loss {loss:.4g} is over {DIVERGE_FACTOR:g}x its first value {self.first_loss:.4g}",
            )
        self.losses.append(loss)
        self._since_eval.append(loss)
        recent = self.losses[-MEMORIZE_WINDOW:]
        if len(recent) == MEMORIZE_WINDOW and fmean(recent) < MEMORIZE_BELOW:
            return self._once(
                "memorizing",
                step,
                f"Memorizing: train loss {fmean(recent):.4f} < {MEMORIZE_BELOW} at step {step}: the model "
                "recites its training data; use fewer epochs or more data, and watch the validation loss",
            )
        return []

    def check_eval(self, step: int, valid_loss: float) -> list[Finding]:
        since = self._since_eval or self.losses[-1:]
        train = fmean(since) if since else math.nan
        self._since_eval = []
        self.evals.append((step, valid_loss, train))
        if len(self.evals) <= OVERFIT_RISES:
            return []
        window = self.evals[-(OVERFIT_RISES + 1) :]
        valid_rising = all(b[1] > a[1] for a, b in itertools.pairwise(window))
        train_falling = window[-1][2] < window[0][2]
        if not (valid_rising and train_falling):
            return []
        return self._once(
            "overfitting",
            step,
            f"Overfitting: validation loss rose {window[0][1]:.4f} -> {valid_loss:.4f} over the last "
            f"{OVERFIT_RISES} evaluations while train loss fell {window[0][2]:.4f} -> {window[-1][2]:.4f}; "
            "use an earlier checkpoint, fewer epochs or more data",
        )

    def check_progress(self, step: int) -> list[Finding]:
        """Has the train loss moved at all? Called mid-run and at the end."""
        if len(self.losses) < FLAT_MIN_STEPS:
            return []
        n = max(1, len(self.losses) // 5)
        head, tail = fmean(self.losses[:n]), fmean(self.losses[-n:])
        if head - tail >= FLAT_MIN_DROP * abs(head):
            return []
        return self._once(
            "not_training",
            step,
            f"Nothing trained: train loss flat over {len(self.losses)} steps ({head:.4f} -> {tail:.4f}); "
            "raise the learning rate, or check that the examples have assistant turns to learn",
        )
