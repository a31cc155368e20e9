"""The dry run's benchmark table (service/estimates.py) against the committed benchmark results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.estimates import GIB, SHAPE_OF, TABLES, estimates
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


def test_estimates_reproduce_the_measured_row_and_scale_with_the_step() -> None:
    row = TABLES["h100"]["llama-1b"]
    tokens = int(row.tokens_per_s * 100)
    (at_row,) = estimates("llama-1b", trained_tokens=tokens, batch_size=row.batch, longest_row=row.seq)
    assert at_row.wall_seconds == 100.0 and at_row.peak_gpu_memory_gib == pytest.approx(row.mem_gib, abs=0.01)
    (small,) = estimates("llama-1b", trained_tokens=tokens, batch_size=1, longest_row=128)
    weights = PRESET_SHAPES["llama-1b"].parameter_count() * 2 / GIB
    assert weights < small.peak_gpu_memory_gib < at_row.peak_gpu_memory_gib
    assert estimates("tiny-llama", trained_tokens=1, batch_size=1, longest_row=1) == []
    assert SHAPE_OF["smollm2-135m-instruct"] in TABLES["h100"]
    assert estimates("smollm2-135m-instruct", trained_tokens=1, batch_size=1, longest_row=1)
