"""The per-family job benchmark's plumbing on the CPU (bench/family_shapes.py, job_bench's family
rows): each shape builds its family's model at the published size, the FLOP count reads the
shape, one invocation's cells and the goals assembled from its rows. (The rows here are inputs to
the assembly, not results.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from bench import job_bench, train_bench
from bench.family_shapes import FAMILY_SHAPES, LLAMA_PEER, LLAMA_TWIN

# published parameter counts, in billions to two decimals
PUBLISHED = {
    "llama-3.1-8b": 8.03,
    "qwen3-8b": 8.19,
    "mistral-7b": 7.24,
    "gemma-3-4b": 3.88,
    "gemma-3-12b": 11.77,
    "phi-4-mini": 3.84,
    "llama-3.2-1b": 1.24,
    "qwen3-1.7b": 1.72,
    "gemma-3-1b": 1.0,
}


@pytest.mark.parametrize("name", sorted(FAMILY_SHAPES))
def test_shape_builds_its_family_at_the_published_size(name: str) -> None:
    """A Llama twin (`llama-as-<shape>`) has its shape's size too: the family's own parts (norm
    weights) are under 0.01B."""
    shape = FAMILY_SHAPES[name]
    config = CONFIG_MAPPING[shape.family.model_type](**shape.config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == shape.architecture
    twin_of = {twin: family for family, twin in LLAMA_TWIN.items()}
    published = PUBLISHED[twin_of.get(name, name)]
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == published
    # every Linear's weight, a tied LM head too: a matmul, though the parameters count it once
    assert (
        sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        == shape.linear_weights()
    )
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(shape.targets()) <= names
    flops = train_bench.flops_per_token(name, 1000)
    assert flops == 4 * shape.linear_weights() + 6 * 1000 * shape.attention_width()


def test_cells_run_job_and_padded_rows_first_then_padding_free() -> None:
    cells = job_bench.cells(["llama-3.1-8b", "gemma-3-1b"])
    assert [c[1:3] for c in cells] == [
        ["llama-3.1-8b", "job"], ["llama-3.1-8b", "peft_padded"], ["gemma-3-1b", "job"],
        ["gemma-3-1b", "peft_padded"], ["llama-3.1-8b", "peft_padding_free"],
        ["gemma-3-1b", "peft_padding_free"],
    ]  # fmt: skip
    assert cells[0][3:] == ["2", "2048", "4", "12"] and cells[2][3:] == ["4", "2048", "8", "20"]


def test_an_out_of_memory_padded_peer_is_retried_with_half_the_examples_down_to_one() -> None:
    oom = {"error": "OutOfMemoryError('CUDA out of memory. Tried to allocate 3.83 GiB.')"}
    cell = ["--job-cell", "llama-3.1-8b", "peft_padded", "2", "2048", "4", "12"]
    assert job_bench.smaller_peer_cell(cell, oom) == [*cell[:5], "2", "12"]
    assert job_bench.smaller_peer_cell([*cell[:5], "1", "12"], oom) is None
    assert job_bench.smaller_peer_cell(cell, {"error": "timed out after 120s"}) is None
    assert job_bench.smaller_peer_cell(cell, {"tok_s": 2_000}) is None
    job = ["--job-cell", "llama-3.1-8b", "job", "2", "2048", "4", "12"]
    assert job_bench.smaller_peer_cell(job, oom) is None


def row(model: str, variant: str, tok_s: int, mem: int) -> dict[str, Any]:
    seq = FAMILY_SHAPES[model].job[1]
    return {"model": model, "variant": variant, "seq": seq, "tok_s": tok_s, "trainable_tok_s": tok_s // 2,
            "mem_gib": mem / 2**30, "mem_bytes": mem, "padding_fraction": 0.0}  # fmt: skip


def test_goals_hold_each_family_against_its_llama_row() -> None:
    assert LLAMA_PEER["gemma-3-1b"] == "llama-3.2-1b" and LLAMA_PEER["qwen3-8b"] == "llama-3.1-8b"
    result: dict[str, Any] = {
        "peak_tflops": 800.0,
        "dataset": {"attention_equivalent_seq": 800},
        "rows": [
            row("llama-3.1-8b", "job", 10_000, 30 << 30),
            row("qwen3-8b", "job", 10_000, 31 << 30),  # as fast in tokens, more FLOPs: MFU up; memory over
            row("qwen3-8b", "peft_padded", 1_900, 60 << 30),
            row("mistral-7b", "job", 12_000, 29 << 30),
            row("mistral-7b", "peft_padded", 1_900, 60 << 30),
            row("phi-4-mini", "job", 9_000, 20 << 30),  # half Llama-8B's FLOPs a token: MFU 0.46x
        ],
    }
    job_bench.summarize_job(result)
    goals = result["goals"]
    assert goals["llama-3.1-8b"]["mfu_vs_llama"] == 1.0
    qwen = goals["qwen3-8b"]
    assert qwen["mfu_vs_llama"] > 1 and qwen["mem_le_llama"] is False and qwen["met"] is False
    mistral = goals["mistral-7b"]
    assert mistral["job_vs_peft_padded"] == 6.32 and mistral["mem_le_llama"] is True
    assert mistral["mfu_vs_llama"] >= 0.9 and mistral["met"] is True
    phi = goals["phi-4-mini"]
    assert phi["mfu_vs_llama"] < 0.9 and "job_vs_peft_padded" not in phi and phi["met"] is False
    assert result["models"]["qwen3-8b"]["peft_padded_tok_s"] == 1_900


def test_a_twin_row_reports_what_the_family_costs_beside_the_goals() -> None:
    """The Llama twin's row gives the family's MFU and memory against a Llama of its own sizes;
    the goal still holds the family against its published Llama peer."""
    twin = FAMILY_SHAPES[LLAMA_TWIN["qwen3-8b"]]
    assert twin.architecture == "LlamaForCausalLM" and twin.config["num_hidden_layers"] == 36
    assert (
        twin.config["tie_word_embeddings"] is False
        and "sliding_window" not in FAMILY_SHAPES["llama-as-gemma-3-1b"].config
    )
    assert FAMILY_SHAPES["llama-as-gemma-3-1b"].config["tie_word_embeddings"] is True  # Gemma 3's default
    result: dict[str, Any] = {
        "peak_tflops": 800.0,
        "dataset": {"attention_equivalent_seq": 800},
        "rows": [
            row("llama-3.1-8b", "job", 10_000, 30 << 30),
            row("qwen3-8b", "job", 10_000, 33 << 30),
            row("llama-as-qwen3-8b", "job", 10_000, 32 << 30),
        ],
    }
    job_bench.summarize_job(result)
    goals = result["goals"]
    assert goals["llama-as-qwen3-8b"] == {"twin_of": "qwen3-8b"}
    qwen = goals["qwen3-8b"]
    assert qwen["mem_le_llama"] is False and qwen["met"] is False
    assert qwen["llama_twin"] == {"model": "llama-as-qwen3-8b", "mfu_vs_twin": 1.0, "mem_vs_twin_gib": 1.0}


def test_cells_keep_only_the_variants_asked_for() -> None:
    cells = job_bench.cells(["llama-3.2-1b", "llama-as-gemma-3-1b"], ["job"])
    assert [c[1:3] for c in cells] == [["llama-3.2-1b", "job"], ["llama-as-gemma-3-1b", "job"]]
