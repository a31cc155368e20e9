"""The DPO benchmark's plumbing on the CPU (bench/dpo_bench.py, `train_bench.py --dpo`): the
preference generator is seeded and its pairs are in range as the engine counts them; one
invocation runs the job path's DPO cell and TRL's padded cell for 2 steps each on tiny-llama and
writes the result file, both with the same rpo_alpha (the job's default), so both first losses are
ln 2 (the reference is the policy at step 1) plus that × the chosen answers' NLL; the
ratios and the goal are assembled from the rows. (The rows of the last test are inputs to the
assembly, not results.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import dpo_bench
from bench.preference_dataset import DEFAULT_OUT, DEFAULT_SEED, MAX_TOKENS, MIN_TOKENS, generate, pair_lengths
from worker.engine.data import load_dataset
from worker.engine.tiny import build_tiny_tokenizer
from worker.engine.training_config import DpoTraining

ROOT = Path(__file__).resolve().parents[2]


def test_generator_is_seeded_and_its_pairs_are_in_range(tmp_path: Path) -> None:
    rows = generate(20, DEFAULT_SEED)
    assert rows == generate(20, DEFAULT_SEED) != generate(20, DEFAULT_SEED + 1)
    # the committed file is this generator's: its first lines are the same draws
    committed = [json.loads(line) for line in DEFAULT_OUT.read_text().splitlines()[:20]]
    assert committed == rows
    lengths = pair_lengths(rows)
    assert all(MIN_TOKENS - 5 <= n <= MAX_TOKENS + 5 for n in lengths), lengths
    # the engine reads them as preference pairs and counts the same tokens (prompt twice a pair)
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_dataset(path, build_tiny_tokenizer(), 2048, pack=False)
    assert [len(r.input_ids) for r in data.rows] == lengths
    assert all(r["preferred_output"] != r["non_preferred_output"] for r in rows)


@pytest.mark.slow
def test_one_invocation_runs_both_cells_and_writes_the_result(tmp_path: Path) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in generate(4, 1)))
    out = tmp_path / "dpo.json"
    cmd = [sys.executable, str(ROOT / "bench" / "train_bench.py"), "--dpo", "--presets", "tiny-llama",
           "--variants", "dpo_job,trl_padded", "--dpo-data", str(pairs), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert {"device", "date", "commit", "command", "settings", "dataset", "rows", "ratios", "goals"} <= set(
        result
    )
    assert result["device"] == "cpu" and "--dpo" in result["command"]
    assert result["rpo_alpha"] == DpoTraining().rpo_alpha_value and "sft" in result["settings"]
    assert result["dataset"]["examples"] == 4
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"dpo_job", "trl_padded"}, result["rows"]
    for row in rows.values():
        assert "error" not in row, row
        assert row["steps_timed"] == 1 and row["tok_s"] > 0 and row["trainable_tok_s"] < row["tok_s"]
        assert len(row["losses_first"]) == 2
        # ln 2 + rpo_alpha × the chosen answers' NLL (tiny-llama's is ~6 nats a token); the two
        # sides' first steps take different pairs (packed rows, TRL's shuffle), so not equal values
        assert row["losses_first"][0] > math.log(2) + 1.0, row
        assert row["mem_bytes"] is None  # no GPU: no peak memory to read
    assert rows["dpo_job"]["padding_fraction"] == 0.0 and rows["trl_padded"]["pairs"] == 4
    assert 0 < rows["trl_padded"]["padding_fraction"] < 1  # two sequences of unequal length a step
    ratio = result["ratios"]["tiny-llama"]["tok_s_vs_trl_padded"]
    assert ratio == round(rows["dpo_job"]["tok_s"] / rows["trl_padded"]["tok_s"], 2)
    assert result["goals"]["tiny-llama"]["met"] is False  # no memory reading: the goal cannot hold


def row(variant: str, tok_s: int, mem: int) -> dict[str, Any]:
    return {"model": "llama-1b", "variant": variant, "tok_s": tok_s, "mem_bytes": mem}


@pytest.mark.parametrize(
    ("job", "job_mem", "met"),
    [(40_000, 10 << 30, True), (39_000, 10 << 30, False), (40_000, 21 << 30, False)],
)
def test_ratios_and_goal(job: int, job_mem: int, met: bool) -> None:
    result: dict[str, Any] = {
        "rows": [
            row("dpo_job", job, job_mem),
            row("trl_padded", 10_000, 20 << 30),
            row("trl_precomputed", 16_000, 18 << 30),
            {"model": "smollm2-135m", "variant": "dpo_job", "error": "exit 1"},
        ]
    }
    dpo_bench.summarize(result)
    ratios = result["ratios"]["llama-1b"]
    assert ratios["tok_s_vs_trl_padded"] == round(job / 10_000, 2)
    assert ratios["tok_s_vs_trl_precomputed"] == round(job / 16_000, 2)
    assert ratios["mem_vs_trl_padded"] == round(job_mem / (20 << 30), 3)
    assert result["goals"] == {"llama-1b": {"tok_s_ratio_goal": 4.0, "met": met}}
    assert "smollm2-135m" not in result["ratios"]
