"""One schema for a step's metrics, as every reader sees them.

The engine reports each optimizer step as a `StepMetrics` (`worker.engine.types`). From it:

- `StepRow` is what `job_metrics` stores per step: the dashboard's chart rows
  (`GET /dashboard/api/jobs/{id}/metrics`) and the results CSV (`metrics_csv`) are read from it;
- `StepData` adds the step's progress fields: a `metrics` event's `data` (`/v1/.../events`) and the
  worker's live Prometheus gauges (`worker.metrics.live_jobs`, whose gauges name its fields).

Both keep the floats as the engine gave them, NaN and inf included (a diverged loss is a reading
Prometheus should show); JSON has none (PostgreSQL refuses them in json columns), so `event_data`
dumps them as null.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

from worker.engine.types import StepMetrics


class PreferenceReadings(BaseModel):
    """DPO only (worker/engine/preference.py): the step's rewards β·(log π - log π_ref) of the
    chosen and rejected answers, their margin, the share of pairs ranked right and the chosen
    answers' NLL per token (the term the loss adds × rpo_alpha); the validation pass's margin,
    accuracy and chosen NLL on the steps that ran one. None on supervised steps."""

    chosen_reward: float | None = None
    rejected_reward: float | None = None
    reward_margin: float | None = None
    reward_accuracy: float | None = None
    valid_reward_margin: float | None = None
    valid_reward_accuracy: float | None = None
    chosen_nll: float | None = None
    valid_chosen_nll: float | None = None


PREFERENCE_FIELDS = tuple(PreferenceReadings.model_fields)


class StepRow(PreferenceReadings):
    """One stored step (a `job_metrics` row)."""

    model_config = ConfigDict(from_attributes=True)  # read straight from a `JobMetric` row

    step: int  # 1-based optimizer step
    train_loss: float
    valid_loss: float | None = None  # only the steps that ran a validation pass
    lr: float
    grad_norm: float  # before clipping
    tokens: int  # tokens in this step (all micro-batches)
    tokens_per_s: float
    step_seconds: float

    @classmethod
    def from_metrics(cls, m: StepMetrics) -> StepRow:
        plain = {name: getattr(m, name) for name in cls.model_fields if hasattr(m, name)}
        return cls(**plain, **preference_fields(m))


def preference_fields(m: StepMetrics) -> dict[str, float | None]:
    """A DPO step's readings under the names a stored step and a metrics event give them."""
    out: dict[str, float | None] = {}
    if m.preference is not None:
        p = m.preference
        out |= {
            "chosen_reward": p.chosen_reward,
            "rejected_reward": p.rejected_reward,
            "reward_margin": p.margin,
            "reward_accuracy": p.accuracy,
            "chosen_nll": p.chosen_nll,
        }
    if m.valid_preference is not None:
        out |= {
            "valid_reward_margin": m.valid_preference.margin,
            "valid_reward_accuracy": m.valid_preference.accuracy,
            "valid_chosen_nll": m.valid_preference.chosen_nll,
        }
    return out


class StepData(PreferenceReadings):
    """A step with its progress: a `metrics` event's data and the live gauges' values."""

    step: int
    total_steps: int
    epoch: float | None  # null in JSON where the engine's value was not finite, as each float here
    train_loss: float | None
    valid_loss: float | None
    train_mean_token_accuracy: None = None  # OpenAI's field; not measured
    lr: float | None
    grad_norm: float | None
    tokens: int
    trained_tokens: int  # cumulative
    tokens_per_s: float | None
    padding_fraction: float | None  # share of the step's token slots that were padding
    step_seconds: float | None
    eta_seconds: float | None

    @classmethod
    def from_metrics(cls, m: StepMetrics) -> StepData:
        plain = {name: getattr(m, name) for name in cls.model_fields if hasattr(m, name)}
        return cls(**plain, **preference_fields(m))


RESULTS_CSV_COLUMNS = ("step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy")


def metrics_csv(rows: Iterable[StepRow]) -> bytes:
    """OpenAI's results file: one row per step, accuracy columns empty (not measured)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(RESULTS_CSV_COLUMNS)
    for r in rows:
        valid = "" if r.valid_loss is None else f"{r.valid_loss:.6f}"
        writer.writerow([r.step, f"{r.train_loss:.6f}", "", valid, ""])
    return buf.getvalue().encode()


def event_data(m: StepMetrics) -> dict[str, Any]:
    """A `metrics` event's data: `StepData` as JSON, a non-finite float as null."""
    values = StepData.from_metrics(m).model_dump()
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
