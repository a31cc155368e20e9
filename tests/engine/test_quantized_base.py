"""A quantized frozen base (worker/engine/quantize.py), on the CPU in fp64.

The oracle of each test is the same model whose linear layers are plain nn.Linear holding the
dequantized weights (for GGUF: gguf-py's dequantization, un-permuted by transformers' own code):
loss and LoRA gradients must agree to rounding. The GGUF case writes a real GGUF file with
gguf-py's writer (Q8_0/Q4_0/Q4_1 blocks by llama.cpp's quantizer port, q/k permuted as
convert_hf_to_gguf does) and reads its blocks from the mmap.
"""

from __future__ import annotations

import copy
import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import peft
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from torch import nn
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from gpu_kernels import KernelStatus
from gpu_kernels.quant import StackedWeight
from tests.engine.recipe_helpers import Recorder, tiny_config
from worker.engine import fused_model
from worker.engine.catalog import TINY_LLAMA_SHAPE, PresetShape
from worker.engine.export import load_adapter
from worker.engine.lora import apply_lora, merge_lora, trainable_parameters
from worker.engine.models import LoadedModel, load_base_model, load_random_shape
from worker.engine.quantize import (
    GGUF_LLAMA_LINEARS,
    QuantizedLinear,
    quantization_of,
    quantize_model,
    use_gguf_blocks,
)
from worker.engine.recipe import train
from worker.engine.types import ConfigError, LoraConfig

LORA = LoraConfig(r=4, alpha=8.0)


def dequantized(quantized: nn.Module) -> nn.Module:
    """A copy of `quantized` whose quantized layers are nn.Linear holding the dequantized weights
    (fp64); everything else as it is."""
    twin = copy.deepcopy(quantized)
    for name, module in list(twin.named_modules()):
        if isinstance(module, QuantizedLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = module.qweight.dequantize(torch.float64)
            if module.bias is not None:
                linear.bias.data = module.bias.data.double()
            parent, _, leaf = name.rpartition(".")
            setattr(twin.get_submodule(parent), leaf, linear)
    return twin


def loss_and_grads(
    model: nn.Module, seed: int = 1, then: Callable[[nn.Module], object] | None = None, fused: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """LoRA (B nonzero) on every linear layer (then `then(model)`), one forward/backward on fixed
    tokens; `fused`: through the fused stack's loss (fused_model.causal_lm_loss), as a job's step."""
    torch.manual_seed(seed)
    apply_lora(model, LORA)
    params = trainable_parameters(model)
    for p in params:
        nn.init.normal_(p, std=0.05)
    if then is not None:
        then(model)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(2))
    labels = ids.clone()
    labels[:, :8] = -100
    loss = (
        fused_model.causal_lm_loss(model, ids, labels) if fused else model(input_ids=ids, labels=labels).loss
    )
    loss.backward()
    return loss.detach(), [p.grad for p in params if p.grad is not None]


def assert_same_training(model: nn.Module, oracle: nn.Module) -> None:
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = loss_and_grads(oracle)
    assert len(grads) == len(ref_grads) == 28  # A and B of 7 projections in 2 layers
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-12)


@pytest.fixture
def tiny64(tiny: LoadedModel) -> Any:
    return copy.deepcopy(tiny.model).double()


@pytest.mark.parametrize(("method", "double_quant"), [("nf4", False), ("nf4", True), ("int8", False)])
def test_loss_and_lora_grads_on_a_quantized_base_equal_the_dequantized_model(
    tiny64: Any, method: str, double_quant: bool
) -> None:
    quantized = copy.deepcopy(tiny64)
    report = quantize_model(quantized, method, double_quant=double_quant)  # type: ignore[arg-type]
    assert report.layers == 14  # 7 projections in 2 layers
    assert quantization_of(quantized) == method
    head = quantized.get_output_embeddings()
    assert isinstance(head, nn.Linear)  # the LM head stays dense
    oracle = dequantized(quantized)
    # the quantization did change the weights (else this tests nothing), by a bounded error
    q = oracle.get_submodule("model.layers.0.mlp.down_proj")
    d = tiny64.get_submodule("model.layers.0.mlp.down_proj")
    assert isinstance(q, nn.Linear) and isinstance(d, nn.Linear)
    assert 0 < (q.weight - d.weight).abs().max() < 0.2 * d.weight.abs().max()
    # the stated error is the relative Frobenius error over every quantized layer
    names = [n for n, m in quantized.named_modules() if isinstance(m, QuantizedLinear)]
    diffs = [oracle.get_submodule(n).weight - tiny64.get_submodule(n).weight for n in names]
    err = sum(float(x.square().sum()) for x in diffs)
    ref = sum(float(tiny64.get_submodule(n).weight.square().sum()) for n in names)
    assert report.rel_error == pytest.approx((err / ref) ** 0.5, rel=1e-6)
    assert 0 < report.rel_error < (0.2 if method == "nf4" else 0.02)
    assert_same_training(quantized, oracle)


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_a_random_base_quantized_as_it_is_made_trains_as_its_dequantized_twin(
    method: Literal["nf4", "int8"],
) -> None:
    """A random-init preset shape with quantization is made a decoder layer at a time
    (models.random_quantized_llama); in fp64 its loss and LoRA gradients equal those of the same
    model with the dequantized weights in plain nn.Linear layers."""
    cpu = torch.device("cpu")
    loaded = load_random_shape(TINY_LLAMA_SHAPE, "tiny", device=cpu, dtype=torch.float64, quantization=method)
    model: Any = loaded.model
    assert loaded.quantization == method and quantization_of(model) == method
    assert len(model.model.layers) == model.config.num_hidden_layers == 2
    assert loaded.note is not None and "14 linear layers" in loaded.note
    head = model.get_output_embeddings()
    assert isinstance(head, nn.Linear) and head.weight.dtype == torch.float64
    q_proj = model.get_submodule("model.layers.1.self_attn.q_proj")
    assert isinstance(q_proj, QuantizedLinear)
    # HF's init, N(0, 0.02), survives the quantization
    assert 0.015 < float(q_proj.qweight.dequantize(torch.float64).std()) < 0.025
    again = load_random_shape(TINY_LLAMA_SHAPE, "tiny", device=cpu, dtype=torch.float64, quantization=method)
    q_again = again.model.get_submodule("model.layers.1.self_attn.q_proj")
    assert isinstance(q_again, QuantizedLinear)
    assert torch.equal(q_again.qweight.dequantize(), q_proj.qweight.dequantize())  # seeded
    assert_same_training(model, dequantized(model))


def _live_cpu_tensor_bytes() -> int:
    """Bytes of every CPU tensor storage alive in the process (each storage once)."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_a_random_base_is_never_held_dense_while_it_is_quantized(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor bytes alive whenever a decoder layer is about to be quantized stay within the
    dense parts (embeddings, LM head, norms) + the quantized model + one dense layer: far from
    the dense model (the 70B shape's 140 GB never exist on a GPU or in host memory)."""
    from worker.engine import models

    shape = PresetShape(
        hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=1024, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=512,
    )  # fmt: skip
    before = _live_cpu_tensor_bytes()
    marks: list[int] = []
    quantize = models.quantize_model

    def measured(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
        marks.append(_live_cpu_tensor_bytes() - before)  # the dense layer allocated, not yet quantized
        return quantize(layer, *args, **kwargs)

    monkeypatch.setattr(models, "quantize_model", measured)
    loaded = models.load_random_shape(
        shape, "shape", device=torch.device("cpu"), dtype=torch.float32, quantization="nf4"
    )
    model: Any = loaded.model
    layer_dense = 4 * sum(  # fp32 bytes of one decoder layer's linears and norms
        p.numel() for n, p in models.LlamaDecoderLayer(model.config, 0).named_parameters()
    )
    quantized = sum(m.qweight.nbytes for m in model.modules() if isinstance(m, QuantizedLinear))
    rest = sum(p.numel() * p.element_size() for p in model.parameters())  # embeddings, head, norms
    dense_model = rest + shape.num_hidden_layers * layer_dense
    assert len(marks) == shape.num_hidden_layers
    for mark in marks:
        assert mark <= rest + quantized + layer_dense + (64 << 10), (mark, rest, quantized, layer_dense)
    assert max(marks) < dense_model / 2
    assert quantized < shape.num_hidden_layers * layer_dense / 6  # 4.5 of 32 bits a weight


def test_moving_a_quantized_layer_keeps_its_scales_and_sets_its_compute_dtype(tiny64: Any) -> None:
    quantize_model(tiny64, "nf4")
    layer = tiny64.get_submodule("model.layers.1.self_attn.o_proj")
    assert isinstance(layer, QuantizedLinear)
    before = layer.qweight.dequantize(torch.float32)
    tiny64.to(dtype=torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16
    assert layer.qweight.tensors()["absmax"].dtype == torch.float32
    torch.testing.assert_close(layer.qweight.dequantize(torch.float32), before, rtol=0, atol=0)
    assert layer(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_merging_into_a_quantized_base_is_refused(tiny64: Any) -> None:
    quantize_model(tiny64, "int8")
    apply_lora(tiny64, LORA)
    with pytest.raises(ValueError, match="quantized base"):
        merge_lora(tiny64)


# ------------------------------------------------------------------ GGUF blocks


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (Hugging Face row order -> llama.cpp's)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q8_0"}  # MLP: Q4_0


def write_tiny_gguf(model: Any, path: Path) -> Path:
    """The decoder linears of tiny-llama as llama.cpp would write them, quantized by gguf-py."""
    cfg = model.config
    writer = GGUFWriter(path, "llama")
    for i in range(cfg.num_hidden_layers):
        for gguf_name, hf_name in GGUF_LLAMA_LINEARS.items():
            linear = model.get_submodule(f"model.layers.{i}.{hf_name}")
            w = linear.weight.detach().float().numpy()
            if gguf_name == "attn_q":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            qtype = GGMLQuantizationType[GGUF_TYPES.get(gguf_name, "Q4_0")]
            writer.add_tensor(f"blk.{i}.{gguf_name}.weight", quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_reference_weights(path: Path, config: object) -> dict[str, np.ndarray]:
    """Each linear's weight as transformers' GGUF loader computes it: gguf-py's dequantization,
    q/k un-permuted by transformers' LlamaTensorProcessor."""
    processor = LlamaTensorProcessor(
        config={
            "num_attention_heads": config.num_attention_heads,  # type: ignore[attr-defined]
            "num_key_value_heads": config.num_key_value_heads,  # type: ignore[attr-defined]
        }
    )
    out = {}
    for tensor in GGUFReader(path).tensors:
        parts = tensor.name.split(".")  # blk.N.attn_q.weight; embeddings and norms are not linears
        if len(parts) != 4 or parts[2] not in GGUF_LLAMA_LINEARS:
            continue
        _, layer, gguf_name, _ = parts
        dense = quants.dequantize(tensor.data, tensor.tensor_type)
        out[f"model.layers.{layer}.{GGUF_LLAMA_LINEARS[gguf_name]}"] = processor.process(
            dense, tensor.name
        ).weights
    return out


def test_gguf_blocks_are_the_frozen_weights_and_train_as_the_dequantized_model(
    tiny64: Any, tmp_path: Path
) -> None:
    path = write_tiny_gguf(tiny64, tmp_path / "tiny.gguf")
    quantized = copy.deepcopy(tiny64)
    counts = use_gguf_blocks(quantized, path, device=torch.device("cpu"), dtype=torch.float64)
    assert counts == {"Q8_0": 4, "Q4_0": 8, "Q4_1": 2}
    reference = gguf_reference_weights(path, tiny64.config)
    oracle = copy.deepcopy(tiny64)
    for name, weight in reference.items():
        layer = quantized.get_submodule(name)
        assert isinstance(layer, QuantizedLinear)
        np.testing.assert_array_equal(layer.qweight.dequantize(torch.float32).numpy(), weight)
        oracle.get_submodule(name).weight.data = torch.from_numpy(weight).double()
    assert_same_training(quantized, oracle)


def test_gguf_blocks_are_read_from_the_mmap_not_copied(tiny64: Any, tmp_path: Path) -> None:
    """Rewriting a block in the file changes the loaded weight: it reads the file's pages."""
    path = write_tiny_gguf(tiny64, tmp_path / "tiny.gguf")
    use_gguf_blocks(tiny64, path, device=torch.device("cpu"), dtype=torch.float64)
    layer = tiny64.get_submodule("model.layers.0.self_attn.v_proj")  # not permuted: a pure view
    assert isinstance(layer, QuantizedLinear)
    before = layer.qweight.dequantize()
    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_v.weight")
    with open(path, "r+b") as f:  # Q4_1 block 0: d (fp16) := 0, so its 32 weights become m
        f.seek(tensor.data_offset)  # absolute: where the tensor starts in the file
        f.write(np.float16(0).tobytes())
    after = layer.qweight.dequantize()
    assert not torch.equal(before[0, :32], after[0, :32])
    assert torch.equal(after[0, :32], after[0, :1].expand(32))
    torch.testing.assert_close(before[:, 32:], after[:, 32:], rtol=0, atol=0)


# ------------------------------------------------------------------ through the recipe


def test_a_job_on_an_nf4_base_trains_and_its_adapter_loads_in_peft_on_the_dense_base(
    tmp_path: Path, tiny: LoadedModel
) -> None:
    recorder = Recorder()
    result = train(tiny_config(tmp_path, quantization="nf4", max_steps=3, learning_rate=2e-2), recorder)
    assert result.steps == 3
    (note,) = [m for _, m in recorder.events if m.startswith("Base quantized to nf4 as it loaded: 14 linear")]
    assert "weight error" in note
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-llama"
    # PEFT on the dense base computes what our layers compute with the same adapter on it
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    ours_model = copy.deepcopy(tiny.model)
    load_adapter(result.adapter_dir, ours_model)
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(tiny.model), str(result.adapter_dir)).eval()
    with torch.no_grad():
        ours, theirs = ours_model.eval()(input_ids=ids).logits, peft_model(input_ids=ids).logits
        base = tiny.model(input_ids=ids).logits
    assert (ours - base).abs().max() > 1e-3  # the adapter trained on the NF4 base changes the output
    assert (theirs - ours).abs().max() <= 1e-4
    dense = train(tiny_config(tmp_path / "dense", max_steps=3, learning_rate=2e-2), Recorder())
    # the quantization error moves the loss a little, not the run
    assert abs(result.final_train_loss - dense.final_train_loss) < 0.1 * dense.final_train_loss


def test_gguf_quantization_needs_a_gguf_base(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_base_model("tiny-llama", store=tmp_path, quantization="gguf")
    assert err.value.param == "quantization"


def test_a_preloaded_model_of_another_quantization_is_refused(tmp_path: Path, tiny: LoadedModel) -> None:
    with pytest.raises(ConfigError) as err:
        train(tiny_config(tmp_path, quantization="int8"), Recorder(), loaded=tiny)
    assert err.value.param == "quantization"


def test_the_fused_stack_groups_quantized_projections_without_copying_them(
    tiny64: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v and gate/up of a quantized base become one StackedWeight each (the fused path's
    grouped op, here with the reference ops) and train as the fused dequantized model does."""
    quantize_model(tiny64, "nf4")
    monkeypatch.setattr(fused_model.gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))
    fuse = fused_model.fuse_model
    reports = []
    oracle = dequantized(tiny64)
    loss, grads = loss_and_grads(tiny64, then=lambda m: reports.append(fuse(m)))
    ref_loss, ref_grads = loss_and_grads(oracle, then=lambda m: reports.append(fuse(m)))
    assert reports[0].qkv_groups == 2 and reports[0].mlps == 2
    attn = tiny64.get_submodule("model.layers.0.self_attn")
    group = attn.q_proj.group
    assert isinstance(group.weight, StackedWeight)
    assert group.weight.parts[0] is attn.q_proj.base.qweight  # the parts themselves: nothing copied
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-12)


def test_a_quantized_stacks_lora_ops_keep_the_norms_sources(
    tiny64: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QLoRA's LoRA ops are the compiled op (its torch code here, gpu_kernels.ops.lora) over the
    StackedWeights, given each norm's NormSource as on a dense base: loss and gradients equal the
    dequantized model's, and the forward keeps 2 (tokens, hidden) tensors a layer fewer than the
    same stack without sources, less the first layer's attention norm (its input is no sum)."""
    from tests.gpu_kernels.oracle import give_norm_sources, saved_storages

    quantize_model(tiny64, "nf4")
    monkeypatch.setattr(fused_model.gpu_kernels, "available", lambda: KernelStatus(True, "forced for a test"))
    give = give_norm_sources(monkeypatch)
    d, layers = tiny64.config.hidden_size, tiny64.config.num_hidden_layers

    def stream(t: torch.Tensor) -> bool:  # a (tokens, hidden) activation of loss_and_grads' 2 x 24
        return t.dim() > 0 and t.shape[-1] == d and t.numel() == 2 * 24 * d

    runs = []
    for sources in (True, False):
        give[0] = sources
        with saved_storages(stream) as kept:
            loss, grads = loss_and_grads(copy.deepcopy(tiny64), then=fused_model.fuse_model, fused=True)
        runs.append((loss, grads, len(kept)))
    (loss, grads, kept_with), (loss_without, grads_without, kept_without) = runs
    ref_loss, ref_grads = loss_and_grads(dequantized(tiny64))  # the plain model, unfused
    torch.testing.assert_close(loss, loss_without, rtol=1e-12, atol=0)
    torch.testing.assert_close(loss, ref_loss.to(loss.dtype), rtol=1e-6, atol=0)  # the fused loss is fp32
    for g, without, ref in zip(grads, grads_without, ref_grads, strict=True):
        assert float((g - without).norm()) <= 1e-10 * float(without.norm())
        assert float((g - ref).norm()) <= 1e-6 * float(ref.norm())
    assert kept_without - kept_with == 2 * layers - 1, (kept_without, kept_with)


@pytest.mark.slow
def test_the_pulled_smollm2_trains_on_its_own_q4_1_blocks(pulled_store: Path) -> None:
    """The real SmolLM2-135M-Instruct Q4_1 file: every decoder linear keeps its file's blocks (210
    layers, 5 bits a weight, the file's bytes), each equal to what transformers' GGUF loader
    computes; on its first 3 layers (for time), loss and LoRA gradients equal the dense model's
    with those weights."""
    loaded = load_base_model("smollm2-135m-instruct", store=pulled_store, quantization="gguf")
    model: Any = loaded.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 210 and quantization_of(model) == "Q4_1"
    path = pulled_store / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    assert sum(m.qweight.nbytes for m in layers.values()) == sum(
        n for name, n in sizes.items() if name.split(".")[2:3] and name.split(".")[2] in GGUF_LLAMA_LINEARS
    )
    del model.model.layers[3:]  # the first 3 decoder layers: a CPU forward/backward of seconds
    model.config.num_hidden_layers = 3
    reference = {
        k: v for k, v in gguf_reference_weights(path, model.config).items() if int(k.split(".")[2]) < 3
    }
    twin = copy.deepcopy(model)
    for name, weight in reference.items():
        layer = model.get_submodule(name)
        np.testing.assert_array_equal(layer.qweight.dequantize(torch.float32).numpy(), weight)
        dense = nn.Linear(layer.in_features, layer.out_features, bias=False)
        dense.weight.data = torch.from_numpy(weight)
        parent, _, leaf = name.rpartition(".")
        setattr(twin.get_submodule(parent), leaf, dense)
    loss, grads = loss_and_grads(model)
    ref_loss, ref_grads = loss_and_grads(twin)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-3, atol=1e-6)
