"""The dry run's benchmark table (service/estimates.py) against the committed benchmark results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.estimates import GIB, SHAPE_OF, TABLES, Estimate, estimates
from worker.engine.catalog import PRESET_SHAPES

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@pytest.mark.parametrize(("worker_class", "shape"), [(c, s) for c, rows in TABLES.items() for s in rows])
def test_table_rows_are_the_committed_loraq_rows(worker_class: str, shape: str) -> None:
    row = TABLES[worker_class][shape]
    measured = [
        r
        for r in json.loads((RESULTS / row.source).read_text())["rows"]
        if r.get("variant") == "loraq" and r.get("model") == shape and "tok_s" in r
    ]
    assert [(r["batch"], r["seq"], r["tok_s"], r["mem_gib"]) for r in measured] == [
        (row.batch, row.seq, row.tokens_per_s, row.mem_gib)
    ]


def _one(model: str, **job: int) -> list[Estimate]:
    return estimates(model, queue="h100", **job)


def test_estimates_reproduce_the_measured_row_and_scale_with_the_step() -> None:
    row = TABLES["h100"]["llama-1b"]
    tokens = int(row.tokens_per_s * 100)
    (at_row,) = _one("llama-1b", trained_tokens=tokens, batch_size=row.batch, longest_row=row.seq)
    assert at_row.wall_seconds == 100.0 and at_row.peak_gpu_memory_gib == pytest.approx(row.mem_gib, abs=0.01)
    (small,) = _one("llama-1b", trained_tokens=tokens, batch_size=1, longest_row=128)
    weights = PRESET_SHAPES["llama-1b"].parameter_count() * 2 / GIB
    assert small.peak_gpu_memory_gib is not None and at_row.peak_gpu_memory_gib is not None
    assert weights < small.peak_gpu_memory_gib < at_row.peak_gpu_memory_gib
    assert SHAPE_OF["smollm2-135m-instruct"] in TABLES["h100"]
    (smollm,) = _one("smollm2-135m-instruct", trained_tokens=1, batch_size=1, longest_row=1)
    assert smollm.unavailable is None and smollm.wall_seconds is not None


def test_every_table_row_is_a_preset_shape() -> None:
    # the memory estimate needs the parameter count, which only presets declare
    assert {shape for rows in TABLES.values() for shape in rows} <= set(PRESET_SHAPES)


def test_a_class_without_a_row_says_why_rather_than_vanishing() -> None:
    job = {"trained_tokens": 1000, "batch_size": 4, "longest_row": 128}
    (h100,) = _one("tiny-llama", **job)  # h100 has a table, but no row for tiny-llama
    assert (h100.worker_class, h100.peak_gpu_memory_gib, h100.wall_seconds, h100.source) == (
        "h100", None, None, None,
    )  # fmt: skip
    assert h100.unavailable is not None and "no training benchmark of tiny-llama on h100" in h100.unavailable
    # the job's own class is reported too, even with no table at all
    found = {e.worker_class: e for e in estimates("llama-1b", queue="cpu", **job)}
    assert sorted(found) == ["cpu", "h100"]
    assert found["h100"].unavailable is None
    cpu = found["cpu"]
    assert cpu.wall_seconds is None and cpu.unavailable is not None
    assert "no training benchmark for worker class 'cpu'" in cpu.unavailable
