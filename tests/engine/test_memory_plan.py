"""The memory plan (worker/engine/memory_plan.py): its prediction against the peaks measured on an
H100 (bench/results, as service/estimates.py lists them), and the choices it makes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.estimates import TABLES
from tests.engine.conftest import loaded_after
from worker.engine.catalog import PRESET_SHAPES
from worker.engine.memory_plan import (
    GIB,
    MemoryChoice,
    ModelDims,
    catalog_dims,
    plan_memory,
    predict_peak,
    refusal,
)

H100 = 80 * GIB


def dims(name: str) -> ModelDims:
    found = catalog_dims(name, Path("/nonexistent"))
    assert found is not None
    return found


@pytest.mark.parametrize("shape", sorted(TABLES["h100"]))
def test_the_predicted_peak_is_within_15_percent_of_the_measured_one(shape: str) -> None:
    row = TABLES["h100"][shape]  # r=16 on every linear layer, bf16 base, no checkpointing
    parts = predict_peak(
        dims(shape), rank=16, targets="all-linear", micro_tokens=row.batch * row.seq, choice=MemoryChoice()
    )
    assert abs(parts["total"] / GIB - row.mem_gib) <= 0.15 * row.mem_gib, (parts, row)


def test_a_step_that_fits_runs_whole_without_checkpointing() -> None:
    plan = plan_memory(dims("llama-1b"), rank=16, targets="all-linear", rows=4, seq=2048, gpu_bytes=H100)
    assert plan.fits and plan.choice == MemoryChoice()
    assert "no activation checkpointing" in plan.sentence()


def test_checkpointing_and_splitting_keep_a_large_step_under_the_share() -> None:
    d = dims("llama-8b")
    whole = predict_peak(d, rank=16, targets="all-linear", micro_tokens=8 * 4096, choice=MemoryChoice())
    assert whole["total"] > 0.9 * H100  # 8 rows of 4096 tokens do not fit as they are
    plan = plan_memory(d, rank=16, targets="all-linear", rows=8, seq=4096, gpu_bytes=H100)
    assert plan.fits and plan.peak_bytes <= 0.9 * H100
    assert plan.choice != MemoryChoice()
    # checkpointing lowers the peak, and offloading lowers it further
    full = predict_peak(
        d, rank=16, targets="all-linear", micro_tokens=4096, choice=MemoryChoice(None, "full")
    )
    off = predict_peak(
        d, rank=16, targets="all-linear", micro_tokens=4096, choice=MemoryChoice(None, "full", True)
    )
    sel = predict_peak(
        d, rank=16, targets="all-linear", micro_tokens=4096, choice=MemoryChoice(None, "selective")
    )
    none = predict_peak(d, rank=16, targets="all-linear", micro_tokens=4096, choice=MemoryChoice())
    assert none["total"] > sel["total"] > full["total"] > off["total"]


def test_an_8b_bf16_base_fits_no_16_gib_gpu_but_an_nf4_one_does() -> None:
    d = dims("llama-8b")
    dense = plan_memory(d, rank=16, targets="all-linear", rows=1, seq=1024, gpu_bytes=16 * GIB)
    assert not dense.fits
    message = refusal(dense, quantization=None, rank=16, seq=1024, rows=1)
    assert '"quantization": "nf4"' in message and "larger GPU" in message
    nf4 = plan_memory(
        d, rank=16, targets="all-linear", rows=1, seq=1024, gpu_bytes=16 * GIB, quantization="nf4"
    )
    assert nf4.fits
    # 4.5 bits a linear weight; the 2 GiB of untied embeddings and LM head stay bf16
    assert nf4.breakdown["weights"] < dense.breakdown["weights"] / 2.5


def test_fewer_targets_and_a_smaller_rank_shrink_the_adapter() -> None:
    d = dims("llama-1b")
    every = predict_peak(d, rank=64, targets="all-linear", micro_tokens=1024, choice=MemoryChoice())
    two = predict_peak(d, rank=8, targets=["q_proj", "v_proj"], micro_tokens=1024, choice=MemoryChoice())
    assert two["adapter"] < every["adapter"] / 20


def test_dims_of_a_local_directory_come_from_its_config(tmp_path: Path) -> None:
    config = PRESET_SHAPES["tiny-llama"].config_kwargs()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    (tmp_path / "registry.json").write_text(json.dumps({"models": {"mine": {"path": str(tmp_path / "m")}}}))
    assert catalog_dims("mine", tmp_path) == catalog_dims("tiny-llama", tmp_path)
    assert catalog_dims("nobody", tmp_path) is None


def test_the_plan_loads_no_torch() -> None:
    assert loaded_after("import worker.engine.memory_plan", ("torch", "transformers")) == []


def test_a_config_that_leaves_out_tie_word_embeddings_takes_its_familys_default() -> None:
    """Hugging Face writes only what differs from the config class's default, so a Gemma 3
    config.json (tied by default) usually has no tie_word_embeddings; Llama's default is untied.
    The plan must not count a tied head twice: vocab·hidden·2 bytes."""
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 1000}  # fmt: skip
    gemma, llama = (
        {**base, "architectures": ["Gemma3ForCausalLM"]},
        {**base, "architectures": ["LlamaForCausalLM"]},
    )
    assert ModelDims.from_config(gemma).tied and not ModelDims.from_config(llama).tied
    assert not ModelDims.from_config({**gemma, "tie_word_embeddings": False}).tied
    assert ModelDims.from_config({**llama, "tie_word_embeddings": True}).tied
    assert not ModelDims.from_config(base).tied  # no family named: untied, as before
    untied = predict_peak(ModelDims.from_config({**gemma, "tie_word_embeddings": False}), rank=16,
                          targets="all-linear", micro_tokens=64, choice=MemoryChoice())  # fmt: skip
    tied = predict_peak(ModelDims.from_config(gemma), rank=16, targets="all-linear", micro_tokens=64,
                        choice=MemoryChoice())  # fmt: skip
    assert untied["weights"] - tied["weights"] == 1000 * 64 * 2


def _activations(d: ModelDims, micro_tokens: int, **kw: object) -> int:
    """The predicted activation bytes of r=16 on every linear, no checkpointing, unless `kw` says."""
    args: dict[str, object] = {
        "rank": 16,
        "targets": "all-linear",
        "micro_tokens": micro_tokens,
        "choice": MemoryChoice(),
    }
    args.update(kw)
    return predict_peak(d, **args)["activations"]  # type: ignore[arg-type]


def test_the_fused_mlp_keeps_no_product_and_the_plan_knows_where_it_runs() -> None:
    """Rank ≤ 16 on gate, up and down, no dropout, on a dense or a quantized base: the fused LoRA
    MLP op keeps gate and up but not their product (L · 2 bytes · intermediate · T less), and its
    x·Aᵀ 16 wide; anything else keeps all three."""
    d = dims("llama-1b")
    t, lay = 4096, d.layers

    def peak(**kw: object) -> int:
        return _activations(d, t, **kw)

    product = lay * 2 * d.intermediate * t
    # dropout also keeps both norms' outputs (the test below); a quantized base's activations are
    # a dense one's (its LoRA ops are the same compiled ops, their base GEMMs over its tiles)
    norm_outputs = lay * 2 * 2 * d.hidden * t
    assert peak(dropout=0.05) - peak() == product + norm_outputs
    assert peak(quantization="nf4") == peak() == peak(quantization="int8")
    # without down_proj the MLP is not one op: the product is kept, down's x·Aᵀ is not
    without_down = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]
    assert peak(targets=without_down) - peak() == product - lay * 2 * 16 * t
    # rank 8 is fused too, its MLP inputs padded to 16: only the 4 attention targets' are narrower
    assert peak() - peak(rank=8) == lay * 2 * 8 * 4 * t
    # rank 32 is not: the product is kept and all 7 targets' x·Aᵀ are 32 wide
    assert peak(rank=32) - peak() == product + lay * 2 * 16 * 7 * t


def test_lora_ops_keep_the_norm_input_not_its_output_where_the_plan_says() -> None:
    """Without checkpointing or LoRA dropout, on any base, the LoRA ops keep no norm output whose
    norm keeps its input (gpu_kernels/ops/norm_source.py): q/k/v's and, with pre-norms, gate/up's,
    L · 2 bytes · hidden · T each; a sandwich MLP norm's output stays kept, and so does every MLP
    norm's output where the MLP is checkpointed (the checkpoint keeps its input)."""
    # head_dim given: Gemma 3's default (256, as transformers' config class has it) would differ
    base = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64, "num_hidden_layers": 3,
            "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": True}  # fmt: skip
    llama = ModelDims.from_config({**base, "architectures": ["LlamaForCausalLM"]})
    gemma = ModelDims.from_config({**base, "architectures": ["Gemma3ForCausalLM"]})
    assert gemma.sandwich and not llama.sandwich
    t = 1024
    norm_output = 3 * 2 * 256 * t

    def acts(d: ModelDims, **kw: object) -> int:
        return _activations(d, t, **kw)

    # the same shape: Gemma's sandwich keeps the MLP norm's output, Llama keeps neither
    assert acts(gemma) - acts(llama) == norm_output
    # only the MLP targeted: only its norm's output goes (pre-norm); q/k/v only: the attention's
    mlp_only = ["gate_proj", "up_proj", "down_proj"]
    product = 3 * 2 * 512 * t  # dropout also unfuses the MLP: act(gate) ⊙ up is kept
    assert acts(llama, targets=mlp_only, dropout=0.1) - acts(llama, targets=mlp_only) == norm_output + product
    qv = ["q_proj", "v_proj"]
    assert acts(gemma, targets=qv, dropout=0.1) - acts(gemma, targets=qv) == norm_output
    # a quantized base's LoRA ops are the compiled ops too (their base GEMMs over its tiles)
    assert acts(gemma, targets=qv, quantization="nf4") == acts(gemma, targets=qv)
    # selective checkpointing: the MLP norm's output kept by the checkpoint, in either family; the
    # attention norm's not, unless dropout keeps it
    selective = MemoryChoice(None, "selective")
    assert acts(gemma, choice=selective) == acts(llama, choice=selective)
    assert acts(llama, choice=selective, dropout=0.1) - acts(llama, choice=selective) == norm_output
