"""The memory benchmark's plumbing on the CPU (bench/memory_bench.py, `train_bench.py --memory`):
one invocation runs each kind of cell on tiny-llama for a step (the Loraq cells through recipe.train,
the 70B cell's base made here a layer at a time and handed to the job; the peers, which need a
GPU and their packages, recorded as skipped with the reason) and writes the result file, every
Loraq row with the plan it used and its predicted peak; the ratios and goals are assembled from
the rows. (The rows of the last test are inputs to the assembly, not results.) The 1B/135M rows
and the other peers take the code paths of cells run here; each cell is a process (~20 s on CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import memory_bench
from bench.job_bench import DATASET
from worker.engine.catalog import PRESET_SHAPES
from worker.engine.memory_plan import MemoryChoice, ModelDims, predict_peak

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
# a quantized base, a capped and an uncapped bf16 base, the unpacked job, the layer-at-a-time 70B
# base and a peer (skipped here): each kind of cell once
CELLS_RUN = ("8b-nf4", "unsloth_qlora", "8b-bf16-17.5g", "8b-bf16", "8b-bf16-unpacked-8", "70b-nf4")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_invocation_runs_each_kind_of_cell_and_writes_the_result(tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:64]))
    out = tmp_path / "memory.json"
    cmd = [sys.executable, str(ROOT / "bench" / "train_bench.py"), "--memory", "--presets", "tiny-llama",
           "--cells", ",".join(CELLS_RUN), "--steps", "1", "--warmup", "1", "--memory-data", str(data),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=870, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    header = {"device", "date", "commit", "command", "settings", "cells", "dataset", "rows"}
    assert header | {"ratios", "goals"} <= set(result)
    assert result["device"] == "cpu" and "--memory" in result["command"]
    assert result["dataset"]["examples"] == 64 and result["models_overridden"] == "tiny-llama"
    rows = {r["cell"]: r for r in result["rows"]}
    assert list(rows) == [c for c in memory_bench.CELL_NAMES if c in CELLS_RUN]
    dims = ModelDims.from_config(PRESET_SHAPES["tiny-llama"].config_kwargs())
    for cell in (c for c in memory_bench.CELLS if c.name in CELLS_RUN):
        row = rows[cell.name]
        assert "error" not in row, row
        assert row["model"] == "tiny-llama" and row["steps_timed"] == 1 and row["tok_s"] > 0
        plan = row["plan"]
        choice_keys = {"micro_rows", "checkpointing", "offload"}
        assert choice_keys | {"fits", "limit_bytes", "breakdown", "source"} <= set(plan)
        # a CPU run plans nothing: the prediction is that of the whole micro-batch kept
        expected = predict_peak(
            dims, rank=16, targets=memory_bench.TARGETS, micro_tokens=cell.batch * cell.seq,
            choice=MemoryChoice(), quantization=cell.quantization,
        )  # fmt: skip
        assert row["predicted_peak_bytes"] == plan["predicted_peak_bytes"] == expected["total"] > 0
        assert plan["breakdown"] == expected
        assert row["measured"] is None and row["peak_gib"] is None  # no GPU: nothing measured
        assert row["quantization"] == (cell.quantization or "bf16") and row["limit_gib"] == cell.limit_gib
    nf4, bf16 = rows["8b-nf4"]["plan"]["breakdown"], rows["8b-bf16"]["plan"]["breakdown"]
    assert nf4["weights"] < bf16["weights"]
    assert rows["8b-bf16-unpacked-8"]["padding_fraction"] > 0 and rows["8b-bf16"]["padding_fraction"] < 0.1
    big = rows["70b-nf4"]
    assert big["base_built_s"] is not None and "one decoder layer at a time" in big["quantize_note"]
    for peer in (p for p in memory_bench.PEERS if p in CELLS_RUN):
        assert rows[peer]["skipped"], rows[peer]  # the reason: a missing package, or no GPU
    assert result["ratios"] == {}
    goals = result["goals"]
    assert set(goals) == {
        "8b_nf4", "8b_bf16_capped", "8b_bf16_uncapped", "8b_unpacked_8_rows_fits", "70b_nf4",
        "1b_bf16_unchanged", "135m_bf16_unchanged", "predicted_within_10pct",
    }  # fmt: skip
    assert set(goals["predicted_within_10pct"]) == {c.name for c in memory_bench.CELLS if c.name in CELLS_RUN}
    assert all(g["met"] is None for k, g in goals.items() if k != "predicted_within_10pct")  # a CPU run


def test_cells_past_the_time_budget_are_recorded_as_skipped(tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:8]))
    cmd = [sys.executable, str(ROOT / "bench" / "train_bench.py"), "--memory",
           "--cells", "8b-nf4,unsloth_qlora", "--time-budget", "1", "--memory-data", str(data),
           "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (out,) = tmp_path.glob("memory-cpu-*.json")  # a folder: the default name inside it
    rows = json.loads(out.read_text())["rows"]
    assert rows == [
        {"cell": "8b-nf4", "skipped": "the run's --time-budget was spent"},
        {"cell": "unsloth_qlora", "skipped": "the run's --time-budget was spent"},
    ]


def loraq(cell: str, tok_s: int, peak_gib: float, predicted_gib: float, checkpointing: str = "full") -> Any:
    return {
        "cell": cell, "variant": "loraq", "tok_s": tok_s, "peak_gib": peak_gib,
        "predicted_peak_bytes": int(predicted_gib * GIB),
        "measured": {"max_allocated_bytes": int(peak_gib * GIB)},
        "plan": {"checkpointing": checkpointing, "micro_rows": None},
    }  # fmt: skip


def peer(cell: str, tok_s: int, peak_gib: float) -> dict[str, Any]:
    return {"cell": cell, "variant": cell, "tok_s": tok_s, "peak_gib": peak_gib}


def test_ratios_and_goals() -> None:
    reference = {
        r["model"]: r["tok_s"]
        for r in json.loads(memory_bench.REFERENCE_JOB.read_text())["rows"]
        if r.get("variant") == "job" and r["seq"] == 2048  # not the long-context row
    }
    result: dict[str, Any] = {
        "device": "NVIDIA H100 80GB HBM3",
        "rows": [
            loraq("8b-nf4", 11_000, 7.6, 7.0),  # 1.57x Unsloth's QLoRA, under 8 GiB
            loraq("8b-bf16-17.5g", 12_000, 18.0, 17.0),  # over 17.5 GiB
            loraq("8b-bf16", 20_000, 40.0, 30.0, "none"),  # prediction 25% low
            {"cell": "8b-bf16-unpacked-8", "error": "exit 1"},
            loraq("70b-nf4", 1_500, 70.0, 66.0),
            loraq("1b-bf16", int(reference["llama-1b"] * 0.99), 12.0, 11.5, "none"),
            loraq("135m-bf16", int(reference["smollm2-135m"] * 0.97), 4.5, 4.4, "none"),
            peer("unsloth_qlora", 7_000, 7.9),
            {"cell": "unsloth_bf16", "skipped": "cannot import: ModuleNotFoundError('unsloth')"},
            peer("peft_qlora", 3_000, 9.0),
        ],
    }
    memory_bench.summarize(result)
    goals = result["goals"]
    assert goals["8b_nf4"]["ratio"] == round(11_000 / 7_000, 2) and goals["8b_nf4"]["met"] is True
    assert goals["8b_nf4"]["unsloth_source"] == "this run"
    capped = goals["8b_bf16_capped"]
    assert capped["met"] is False and capped["unsloth_bf16_tok_s"] == 7300  # PEERS.md's, marked so
    assert "not run here" in capped["unsloth_source"]
    assert goals["8b_bf16_uncapped"] == {"tok_s_goal": 19_500, "tok_s": 20_000, "met": True}
    assert goals["8b_unpacked_8_rows_fits"]["met"] is False
    assert goals["70b_nf4"]["met"] is True and goals["70b_nf4"]["tok_s"] == 1_500
    assert goals["1b_bf16_unchanged"]["met"] is True and goals["135m_bf16_unchanged"]["met"] is False
    within = goals["predicted_within_10pct"]
    assert within["8b-nf4"]["met"] is True and within["8b-bf16"]["met"] is False
    assert within["8b-bf16"]["rel_error"] == -0.25 and "8b-bf16-unpacked-8" not in within
    assert result["ratios"] == {
        "8b-nf4_vs_unsloth_qlora": {"tok_s": 1.57, "peak": round(7.6 / 7.9, 3)},
        "8b-nf4_vs_peft_qlora": {"tok_s": 3.67, "peak": round(7.6 / 9.0, 3)},
    }


def test_result_files_name_the_gpu_model() -> None:
    assert memory_bench.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert memory_bench.gpu_slug("NVIDIA H200") == "h200"
