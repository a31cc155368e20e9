"""The multi-GPU benchmark's plumbing on the CPU: which cells one invocation runs, how the JSON's
per-model figures and `ratios` are assembled from the cells' rows, where the file goes, and the
refusal on a host with too few GPUs. (The rows here are inputs to the assembly, not results.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import job_bench, train_bench

ROOT = Path(__file__).resolve().parents[2]


def test_cells_run_the_same_job_on_one_gpu_then_n() -> None:
    cells = job_bench.multi_gpu_cells(["smollm2-135m", "llama-1b"], 2)
    assert [c[1:3] for c in cells] == [
        ["smollm2-135m", "job"], ["smollm2-135m", "job_x2"], ["llama-1b", "job"], ["llama-1b", "job_x2"]
    ]  # fmt: skip
    # one cell pair shares batch, row length and steps: the same job
    assert cells[2][3:] == cells[3][3:] == ["4", "2048", "8", "40"]
    # every rank gets whole rows: 4 rows stay 4 on 2 and 4 GPUs, become 8 on 8
    assert [job_bench.multi_gpu_batch("llama-1b", n) for n in (1, 2, 4, 8)] == [4, 4, 4, 8]


def test_per_gpu_cells_put_the_one_gpu_batch_on_every_gpu() -> None:
    cells = job_bench.multi_gpu_cells(["smollm2-135m", "llama-1b"], 4, "per_gpu")
    assert [c[2] for c in cells] == ["job", "job_x4_per_gpu", "job", "job_x4_per_gpu"]
    # the one-GPU job's batch_size, and on 4 GPUs that batch_size on each (a global batch 4x)
    assert cells[2][3:] == cells[3][3:] == ["4", "2048", "8", "40"]
    assert [job_bench.multi_gpu_batch("llama-1b", n, "per_gpu") for n in (1, 2, 8)] == [4, 4, 4]


def row(model: str, n_gpus: int, tok_s: int, losses: list[float]) -> dict[str, object]:
    variant = "job" if n_gpus == 1 else f"job_x{n_gpus}"
    return {"model": model, "variant": variant, "n_gpus": n_gpus, "tok_s": tok_s, "step_ms": 1e3 / tok_s,
            "loss_curve": losses}  # fmt: skip


def test_summary_gives_each_model_both_rates_and_the_ratio() -> None:
    result: dict[str, object] = {
        "rows": [
            row("smollm2-135m", 1, 1000, [2.0, 1.5]),
            row("smollm2-135m", 2, 1600, [2.0, 1.53]),
            row("llama-1b", 1, 500, [3.0, 2.0]),
            row("llama-1b", 2, 950, [3.03, 2.0]),
            {"model": "llama-8b", "variant": "job", "n_gpus": 1, "error": "exit 1"},
        ]
    }
    job_bench.summarize_multi_gpu(result, 2)
    assert result["ratios"] == {"smollm2-135m": 1.6, "llama-1b": 1.9}
    models = result["models"]
    assert isinstance(models, dict) and models.keys() == {"smollm2-135m", "llama-1b"}
    assert models["llama-1b"]["tok_s_1_gpu"] == 500 and models["llama-1b"]["tok_s_2_gpus"] == 950
    assert models["smollm2-135m"]["loss_max_rel_diff"] == pytest.approx(0.02)
    assert models["llama-1b"]["loss_max_rel_diff"] == pytest.approx(0.01)
    assert result["goals"] == {
        "smollm2-135m": {"goal": 1.8, "ratio": 1.6, "met": False},
        "llama-1b": {"goal": 1.9, "ratio": 1.9, "met": True},
    }


def test_a_per_gpu_summary_has_ratios_but_no_curve_comparison_or_goals() -> None:
    # another global batch and learning rate than one GPU's: another run, not the target
    result: dict[str, object] = {
        "batch_scaling": "per_gpu",
        "rows": [row("smollm2-135m", 1, 1000, [2.0, 1.5]), row("smollm2-135m", 2, 1900, [2.0, 1.2])],
    }
    job_bench.summarize_multi_gpu(result, 2)
    assert result["ratios"] == {"smollm2-135m": 1.9} and result["goals"] == {}
    models = result["models"]
    assert isinstance(models, dict) and models["smollm2-135m"]["loss_max_rel_diff"] is None


def test_a_model_missing_either_run_has_no_ratio() -> None:
    result: dict[str, object] = {"rows": [row("llama-1b", 1, 500, [3.0]), {"model": "llama-1b", "n_gpus": 4,
                                                                          "error": "timed out"}]}  # fmt: skip
    job_bench.summarize_multi_gpu(result, 4)
    assert result["ratios"] == {} and result["models"] == {} and result["goals"] == {}


def test_result_file_names() -> None:
    results = ROOT / "bench" / "results"
    assert train_bench.multi_gpu_out("h200", "2026-11-25", 2) == results / "multi-gpu-h200-2026-11-25.json"
    assert train_bench.multi_gpu_out("h200", "2026-11-25", 8) == results / "multi-gpu-x8-h200-2026-11-25.json"
    per_gpu = train_bench.multi_gpu_out("h100", "2026-11-27", 4, "per_gpu")
    assert per_gpu == results / "multi-gpu-x4-per-gpu-h100-2026-11-27.json"


def test_refused_on_a_host_with_too_few_gpus(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "train_bench.py"), "--job", "--n-gpus", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--n-gpus 2: this host has 0 CUDA GPU(s)" in proc.stderr
    assert not out.exists()


def test_the_straggler_reading_predicts_each_split_step_by_its_slowest_row() -> None:
    from bench.straggler import straggler_reading

    # 2 GPUs, 1 warm-up step, then 3 timed steps: rows (10, 14), (12, 12), (9, 17) ms alone
    one_row = [0.5, 0.5, 0.010, 0.014, 0.012, 0.012, 0.009, 0.017]
    split = [0.9, 0.015, 0.013, 0.018]  # measured 2-GPU steps: 1 ms more than the slowest row
    r = straggler_reading(one_row, 2, split, one_gpu_step_ms=24.0, warmup=1)
    assert r["steps"] == 3
    assert r["predicted_step_ms_slowest_row"] == round((14 + 12 + 17) / 3, 2)
    assert r["measured_step_ms"] == round((15 + 13 + 18) / 3, 2)
    assert r["communication_and_waiting_ms"] == 1.0
    assert r["one_row_step_ms"] == {"mean": 12.33, "sd": 2.62, "min": 9.0, "max": 17.0}
    assert r["one_gpu_step_ms_per_gpu"] == 12.0
    assert r["ratio_ceiling_without_communication"] == round(24 / ((14 + 12 + 17) / 3), 3)
    assert r["correlation_predicted_measured"] == 1.0
    with pytest.raises(ValueError, match="cover fewer"):
        straggler_reading(one_row[:6], 2, split, one_gpu_step_ms=24.0, warmup=1)


def test_the_split_reading_sets_the_engines_split_against_the_strided_one() -> None:
    """4 rows on 2 GPUs: strided, the two long rows (0 and 2) share a rank; the engine's split
    (by attention work) gives each rank one long row and one short one."""
    from bench.straggler import split_reading

    one_row = [0.5, 0.020, 0.010, 0.019, 0.011]  # 1 warm-up step, then rows of 20, 10, 19, 11 ms
    work = [0, 2_000, 900, 1_900, 1_000]
    r = split_reading(one_row, work, n_gpus=2, rows=4, warmup=1)
    assert r["batches"] == 1
    assert r["strided_slowest_over_mean"] == round(39 / 30, 4)  # ranks: 20 + 19, 10 + 11
    assert r["balanced_slowest_over_mean"] == 1.0  # ranks: 20 + 10, 19 + 11
    assert r["step_shorter_percent"] == round(100 * (1 - 30 / 39), 2)
    assert r["correlation_work_time"] > 0.99
    with pytest.raises(ValueError, match="no batch of 8 rows"):
        split_reading(one_row, work, n_gpus=2, rows=8, warmup=1)
