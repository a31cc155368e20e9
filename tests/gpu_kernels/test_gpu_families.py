"""Every supported family trains on a CUDA device through the job's recipe (`gpu`).

Each family must take the fused captured step (its info event says so; no eager warning), and
its bf16 losses must match the plain path within bf16 tolerance: the eager Hugging Face step on
the same GPU in bf16 (gpu_kernels' reference backend: no fused modules, no kernels) and the eager
step on the CPU in fp32. The CPU fp64 comparisons are tests/engine/test_fused_families.py (the
fused modules vs the plain model) and tests/engine/test_families.py (the plain model vs
transformers + PEFT).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.tiny_families import build_tiny_family, save_tiny_family
from tests.gpu_kernels.oracle import rel, saved_storages
from worker.engine.families import FAMILIES, TEXT_FAMILIES
from worker.engine.types import LoraConfig, NullCallbacks, StepMetrics, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


BF16 = 5e-2  # worst relative loss difference over the steps, bf16 against another path
FUSED_STEP = "Training step: fused kernels, CUDA graph"


class Recorder(NullCallbacks):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.warnings: list[str] = []
        self.infos: list[str] = []

    def on_step(self, metrics: StepMetrics) -> None:
        self.losses.append(metrics.train_loss)

    def on_event(self, level: Any, message: str, data: dict[str, Any] | None = None) -> None:
        (self.warnings if level == "warn" else self.infos).append(message)


def run(architecture: str, tmp: Path, device: str) -> Recorder:
    """The tiny family's job on `device` (a multimodal architecture: tests/engine/
    test_multimodal_text.py's tiny checkpoint, whose language model trains)."""
    from tests.engine.test_multimodal_text import build_multimodal
    from worker.engine.catalog import register_local_model
    from worker.engine.recipe import train

    name = "fam-" + architecture.lower().removesuffix("forcausallm")
    store = tmp / "models"
    if not (store / name).exists():
        directory = tmp / architecture
        if architecture in TEXT_FAMILIES:
            build_multimodal(directory)
        else:
            save_tiny_family(architecture, directory)
        register_local_model(name, directory, store)
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"what is {w}?"},
                {"role": "assistant", "content": f"{w} is fine."},
            ]
        }
        for w in ("a cat", "a dog", "the sea", "a hill", "the sun", "a tree", "the moon", "a boat")
    ]
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rec = Recorder()
    cfg = TrainConfig(
        model=name,
        train_file=data,
        output_dir=tmp / f"out-{device}",
        model_store=store,
        lora=LoraConfig(r=8, alpha=16),
        max_seq_len=64,
        batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        device=device,  # type: ignore[arg-type]
    )
    train(cfg, rec)
    return rec


def worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_family_fused_packed_loss_matches_the_plain_model(architecture: str, record_property: Any) -> None:
    """The compiled kernels under each family's fused modules (what compute-sanitizer runs: no
    capture): one packed row of three examples in bf16, loss and LoRA gradients against the
    plain model run on each example alone, in bf16 on the same GPU."""
    import gpu_kernels
    from tests.engine.test_fused_families import examples_alone, packed_row
    from worker.engine import fused_model
    from worker.engine.lora import apply_lora, trainable_parameters

    torch.manual_seed(0)
    model = build_tiny_family(architecture)
    apply_lora(model, LoraConfig(r=8, alpha=16))
    for p in trainable_parameters(model):
        torch.nn.init.normal_(p, std=0.05)
    torch.nn.Module.to(model, "cuda", torch.bfloat16).train()
    for p in trainable_parameters(model):
        p.data = p.data.float()  # adapters in fp32, as the recipe keeps them
    assert gpu_kernels.available().compiled
    fused = copy.deepcopy(model)
    report = fused_model.fuse_model(fused)
    assert fused_model.fused_stack(fused.model) and not report.skipped, report.skipped
    examples = [torch.randint(3, 500, (n,), device="cuda") for n in (23, 40, 9)]
    got = fused_model.packed_lm_loss(fused, packed_row(examples, torch.float32), 0)
    got.backward()
    want = examples_alone(model, examples)
    grads = [
        (p.grad, q.grad)
        for p, q in zip(trainable_parameters(fused), trainable_parameters(model), strict=True)
    ]
    grad_err = max(rel(a, b) for a, b in grads if a is not None and b is not None)
    loss_err = abs(float(got.detach()) - float(want)) / float(want)
    record_property(
        "family_packed", {"architecture": architecture, "loss_err": loss_err, "grad_err": grad_err}
    )
    assert loss_err <= 2e-2 and grad_err <= BF16, (loss_err, grad_err)


@pytest.mark.gpu
@pytest.mark.no_memcheck  # CUDA-graph capture and three training runs
@pytest.mark.parametrize("architecture", sorted(FAMILIES) + sorted(TEXT_FAMILIES))
def test_family_takes_the_fused_step_and_matches_the_plain_path(
    architecture: str, tmp_path: Path, record_property: Any
) -> None:
    import gpu_kernels

    fused = run(architecture, tmp_path, "cuda")
    gpu_kernels.set_backend("reference")
    try:
        (tmp_path / "plain").mkdir()
        plain = run(architecture, tmp_path / "plain", "cuda")
    finally:
        gpu_kernels.set_backend("auto")
    cpu = run(architecture, tmp_path, "cpu")
    took_fused = any(m.startswith(FUSED_STEP) for m in fused.infos)
    record_property(
        "family",
        {
            "architecture": architecture,
            "fused_step": took_fused,
            "eager_warnings": [w for w in fused.warnings if "eagerly" in w],
            "fused_gpu_bf16": fused.losses,
            "plain_gpu_bf16": plain.losses,
            "cpu_fp32": cpu.losses,
            "worst_vs_plain_gpu": worst(fused.losses, plain.losses),
            "worst_vs_cpu": worst(fused.losses, cpu.losses),
        },
    )
    assert len(fused.losses) == STEPS and all(x == x and abs(x) < 1e4 for x in fused.losses)
    assert took_fused and not [w for w in fused.warnings if "eagerly" in w], (fused.infos, fused.warnings)
    assert any("eagerly" in w for w in plain.warnings)  # the control really ran the plain modules
    assert worst(fused.losses, plain.losses) <= BF16, (fused.losses, plain.losses)
    assert worst(fused.losses, cpu.losses) <= BF16, (fused.losses, cpu.losses)


def _stream_saves(model: torch.nn.Module, hidden: int) -> int:
    """How many distinct storages of (tokens, hidden) activations the fused forward keeps for the
    backward, for one packed row, bf16 on the GPU. Parameters are not counted."""
    from tests.engine.test_fused_families import packed_row
    from worker.engine import fused_model
    from worker.engine.lora import apply_lora

    apply_lora(model, LoraConfig(r=8, alpha=16))
    torch.nn.Module.to(model, "cuda", torch.bfloat16).train()
    fused_model.fuse_model(model)
    assert fused_model.fused_stack(model.model)  # type: ignore[arg-type]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    examples = [torch.randint(3, 500, (n,), device="cuda") for n in (23, 40, 9)]
    tokens = sum(len(e) for e in examples)

    def stream(t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return t.dim() > 0 and t.shape[-1] == hidden and t.numel() == tokens * hidden and ptr not in params

    with saved_storages(stream) as kept:
        fused_model.packed_lm_loss(model, packed_row(examples, torch.float32), 0)
    return len(kept)


@pytest.mark.gpu
def test_a_sandwich_layer_keeps_two_stream_tensors_more_than_a_pre_norm_layer() -> None:
    """Gemma 3's step keeps, per layer, two (tokens, hidden) tensors more than a Llama of its sizes:
    both sublayer outputs (for the sandwich norms) less the sum after attention, which the
    backward forms again (gpu_kernels.add_rms_norm with keep_sum=False), and the MLP norm's output,
    which the MLP's LoRA ops keep because that norm keeps no sum to form it from (a pre-norm MLP
    keeps neither: test_lora_ops_keep_no_norm_output_whose_input_the_norm_keeps). The first layer
    keeps one more still: its input, the embeddings, has no gradient, so no norm before it keeps
    it for the sum to be formed from."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.engine.tiny_families import tiny_config

    gemma = tiny_config("Gemma3ForCausalLM")
    twin = LlamaConfig(**{k: getattr(gemma, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "eos_token_id", "pad_token_id",
    )}, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    gemma_saves = _stream_saves(build_tiny_family("Gemma3ForCausalLM"), gemma.hidden_size)
    twin_saves = _stream_saves(AutoModelForCausalLM.from_config(twin), gemma.hidden_size)
    layers = gemma.num_hidden_layers
    assert gemma_saves - twin_saves == 2 * layers + 1, (gemma_saves, twin_saves, layers)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("architecture", "fewer_a_layer", "fewer"),
    # pre-norm: both norms' outputs, less the first layer's attention norm (its input, the
    # embeddings, is not kept by that norm); sandwich: the attention norms' outputs only
    [
        ("LlamaForCausalLM", 2, -1),
        ("Qwen3ForCausalLM", 2, -1),
        ("Phi3ForCausalLM", 2, -1),
        ("Gemma3ForCausalLM", 1, -1),
    ],
)
def test_lora_ops_keep_no_norm_output_whose_input_the_norm_keeps(
    architecture: str, fewer_a_layer: int, fewer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused stack hands each norm's NormSource to the LoRA ops reading its output (q/k/v,
    the MLP), which then keep the norm's own input and rstd instead of the output: against the
    same stack with the sources withheld, the forward keeps that many (tokens, hidden) tensors
    fewer."""
    from tests.engine.tiny_families import tiny_config
    from worker.engine import fused_model

    hidden = tiny_config(architecture).hidden_size
    layers = tiny_config(architecture).num_hidden_layers
    torch.manual_seed(0)
    with_sources = _stream_saves(build_tiny_family(architecture), hidden)
    add_rms_norm = fused_model.gpu_kernels.add_rms_norm

    def without_source(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, None]:
        h, n, _ = add_rms_norm(*args, **kwargs)
        return h, n, None

    monkeypatch.setattr(fused_model.gpu_kernels, "add_rms_norm", without_source)
    torch.manual_seed(0)
    without = _stream_saves(build_tiny_family(architecture), hidden)
    assert without - with_sources == fewer_a_layer * layers + fewer, (without, with_sources, layers)
