"""The dry run's benchmark table (service/estimates.py) against the committed benchmark results."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.family_shapes import FAMILY_SHAPES
from service.estimates import FAMILY_TABLES, GIB, SHAPE_OF, TABLES, Estimate, estimates
from worker.engine.catalog import PRESET_SHAPES, TINY_LLAMA_SHAPE
from worker.engine.model_shape import ModelShape, shape_of_config

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


@pytest.mark.parametrize("name", list(FAMILY_TABLES["h100"]))
def test_family_rows_are_the_committed_job_rows_at_their_shapes(name: str) -> None:
    family_row = FAMILY_TABLES["h100"][name]
    row = family_row.row
    measured = [
        r
        for r in json.loads((RESULTS / row.source).read_text())["rows"]
        if r.get("variant") == "job" and r.get("model") == name
    ]
    assert [(r["batch"], r["seq"], r["tok_s"], r["mem_gib"]) for r in measured] == [
        (row.batch, row.seq, row.tokens_per_s, row.mem_gib)
    ]
    bench = FAMILY_SHAPES[name]
    config = {**bench.config, "architectures": [bench.architecture]}
    shape = shape_of_config(config, name)
    assert (family_row.architecture, family_row.parameters, family_row.width_depth) == (
        bench.architecture,
        shape.parameters,
        shape.width_depth,
    )


def _one(model: str, shape: ModelShape | None = None, **job: int) -> list[Estimate]:
    return estimates(model, queue="h100", shape=shape, **job)


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
    job: dict[str, Any] = {"trained_tokens": 1000, "batch_size": 4, "longest_row": 128}
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


# Published shapes of one model of each family (config.json values as on the Hub)
FAMILY_MODELS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {  # Llama-3.2-3B
        "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
        "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
    },
    "MistralForCausalLM": {  # Mistral-7B-v0.3
        "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "vocab_size": 32768, "tie_word_embeddings": False,
    },
    "Qwen2ForCausalLM": {  # Qwen2.5-1.5B
        "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen3ForCausalLM": {  # Qwen3-0.6B
        "hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Gemma3ForCausalLM": {  # gemma-3-1b
        "hidden_size": 1152, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 6912, "vocab_size": 262144,
    },
    "Phi3ForCausalLM": {  # Phi-4-mini
        "hidden_size": 3072, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
        "intermediate_size": 8192, "vocab_size": 200064, "tie_word_embeddings": True,
    },
}  # fmt: skip


@pytest.mark.parametrize("architecture", list(FAMILY_MODELS))
def test_every_family_is_estimated_from_the_nearest_row(architecture: str) -> None:
    config = {"architectures": [architecture], "max_position_embeddings": 8192, **FAMILY_MODELS[architecture]}
    shape = shape_of_config(config, architecture)
    assert shape.parameters is not None
    (h100,) = estimates(
        "some/model", queue="h100", trained_tokens=10**6, batch_size=2, longest_row=1024, shape=shape
    )
    assert h100.unavailable is None and h100.peak_gpu_memory_gib and h100.wall_seconds, h100
    assert h100.peak_gpu_memory_gib > shape.parameters * 2 / GIB  # the weights, and activations
    n = shape.parameters
    # a row of the model's own family within 4× of its parameters, else the nearest Llama preset row
    own = {k: r for k, r in FAMILY_TABLES["h100"].items() if r.architecture == architecture}
    near_own = [k for k in own if abs(math.log(own[k].parameters / n)) <= math.log(4)]
    if near_own:
        nearest = min(near_own, key=lambda k: abs(math.log(own[k].parameters / n)))
        source = own[nearest].row.source
    else:
        nearest = min(TABLES["h100"], key=lambda p: abs(math.log(PRESET_SHAPES[p].parameter_count() / n)))
        source = TABLES["h100"][nearest].source
    assert h100.basis is not None and h100.basis.startswith(f"scaled from the {nearest} row"), h100.basis
    assert h100.source == f"bench/results/{source}"
    unmeasured = "row yet: what the family adds to Llama's step is not measured" in h100.basis
    assert unmeasured == (not near_own and architecture != "LlamaForCausalLM")
    assert near_own or architecture == "Qwen2ForCausalLM"  # every other family has a row of its own


def test_a_model_of_a_rows_shape_under_another_name_gets_that_row() -> None:
    # a preset's own name: its row as measured
    row = TABLES["h100"]["llama-1b"]
    tokens = int(row.tokens_per_s * 100)
    (own,) = _one("llama-1b", trained_tokens=tokens, batch_size=row.batch, longest_row=row.seq)
    assert (own.peak_gpu_memory_gib, own.wall_seconds, own.basis) == (row.mem_gib, 100.0, None)
    # a Hub model of a family row's exact shape: that row's figures, scaled by nothing
    family_row = FAMILY_TABLES["h100"]["qwen3-1.7b"]
    bench = FAMILY_SHAPES["qwen3-1.7b"]
    shape = shape_of_config({**bench.config, "architectures": [bench.architecture]}, "Qwen/Qwen3-1.7B")
    fr = family_row.row
    tokens = int(fr.tokens_per_s * 100)
    (scaled,) = _one(
        "Qwen/Qwen3-1.7B", trained_tokens=tokens, batch_size=fr.batch, longest_row=fr.seq, shape=shape
    )
    assert (scaled.peak_gpu_memory_gib, scaled.wall_seconds) == (fr.mem_gib, 100.0)
    assert scaled.basis is not None and scaled.basis.startswith("scaled from the qwen3-1.7b row")


def test_a_model_far_from_every_row_is_not_extrapolated() -> None:
    tiny = shape_of_config(
        {"architectures": ["LlamaForCausalLM"], **TINY_LLAMA_SHAPE.config_kwargs()}, "tiny"
    )
    (h100,) = _one("tiny-llama", trained_tokens=1, batch_size=1, longest_row=1, shape=tiny)
    assert h100.unavailable is not None and h100.unavailable.endswith(
        f"none within 4× of its {tiny.parameters} parameters to scale from"
    )
