"""One schema for a step's metrics (`service.step_metrics`): the stored row, the event data, the
results CSV and the worker's live Prometheus gauges all take their fields from it."""

from __future__ import annotations

import dataclasses
import math

from service.db.models import JobMetric
from service.step_metrics import (
    PREFERENCE_FIELDS,
    RESULTS_CSV_COLUMNS,
    StepData,
    StepRow,
    event_data,
    metrics_csv,
    preference_fields,
)
from worker.engine.types import PreferenceMetrics, StepMetrics
from worker.metrics.live_jobs import LIVE_JOB_GAUGES

JOB_LABELS = {"job_id", "model", "clip_rate"}  # what a live-job file adds to a step's data


def step(
    step: int = 3, train_loss: float = 2.5, tokens_per_s: float = 900.0, valid_loss: float | None = None
) -> StepMetrics:
    return StepMetrics(
        step=step, total_steps=10, epoch=0.3, train_loss=train_loss, lr=1e-4, grad_norm=0.7, tokens=512,
        trained_tokens=1536, tokens_per_s=tokens_per_s, step_seconds=0.5, eta_seconds=3.5,
        valid_loss=valid_loss,
    )  # fmt: skip


def test_the_schemas_fields_come_from_the_engine_and_the_table() -> None:
    # a DPO step's readings are its `preference` and `valid_preference`, flat (preference_fields)
    engine_fields = {f.name for f in dataclasses.fields(StepMetrics)} | set(PREFERENCE_FIELDS)
    assert set(StepRow.model_fields) <= engine_fields
    assert set(StepRow.model_fields) == set(JobMetric.__table__.columns.keys()) - {
        "id",
        "job_id",
        "created_at",
    }
    assert set(StepData.model_fields) - engine_fields == {"train_mean_token_accuracy"}  # OpenAI's, unmeasured
    assert set(StepRow.model_fields) <= set(StepData.model_fields)


def test_a_dpo_steps_readings_are_stored_and_sent_flat() -> None:
    dpo = dataclasses.replace(
        step(valid_loss=0.6),
        preference=PreferenceMetrics(0.3, -0.1, 0.4, 0.75, chosen_nll=1.8),
        valid_preference=PreferenceMetrics(0.2, 0.0, 0.2, 0.5, chosen_nll=2.1),
    )
    assert set(preference_fields(dpo)) == set(PREFERENCE_FIELDS)
    row = StepRow.from_metrics(dpo)
    assert (row.chosen_reward, row.reward_margin, row.valid_reward_accuracy) == (0.3, 0.4, 0.5)
    assert (row.chosen_nll, row.valid_chosen_nll) == (1.8, 2.1)
    assert (event_data(dpo)["reward_accuracy"], event_data(dpo)["chosen_nll"]) == (0.75, 1.8)
    assert StepRow.from_metrics(step()).reward_margin is None  # a supervised step has none
    record = dataclasses.asdict(dpo)  # what a torchrun rank writes, read back by the launcher
    assert StepMetrics.from_record(record) == dpo


def test_every_live_gauge_reads_a_field_of_the_schema() -> None:
    for metric, _, key, labels in LIVE_JOB_GAUGES:
        assert key in set(StepData.model_fields) | JOB_LABELS, metric
        assert set(labels) <= JOB_LABELS, metric


def test_event_data_is_json_and_the_gauges_keep_a_diverged_loss() -> None:
    m = step(train_loss=math.nan, tokens_per_s=math.inf, valid_loss=1.25)
    data = event_data(m)
    assert data["train_loss"] is None and data["tokens_per_s"] is None  # JSON has no NaN/inf
    assert (data["valid_loss"], data["step"], data["train_mean_token_accuracy"]) == (1.25, 3, None)
    assert math.isnan(StepData.from_metrics(m).train_loss or 0.0)  # what the live gauge shows


def test_results_csv_from_stored_rows() -> None:
    rows = [StepRow.from_metrics(step(step=1)), StepRow.from_metrics(step(step=2, valid_loss=1.5))]
    lines = metrics_csv(rows).decode().splitlines()
    assert lines == [",".join(RESULTS_CSV_COLUMNS), "1,2.500000,,,", "2,2.500000,,1.500000,"]
