"""A quantized frozen base on a CUDA device (`gpu`; scripts/gpu_check.sh runs them, the small ones
under compute-sanitizer too): the tiled dequantize-then-GEMM of every format in bf16 against the
fp64 CPU oracle, its peak memory (never a whole dense weight), inside a captured CUDA graph, a
tiny-llama job on an NF4 base through the recipe's captured step, the memory plan's predicted
peak against the measured one, and the load peak of a random 8B NF4 base (made a layer at a time).

The CPU twins of these checks (fp64, exact) are tests/gpu_kernels/test_quant_formats.py and
tests/engine/test_quantized_base.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import gpu_kernels
from gpu_kernels.quant import GGML_TYPES, FrozenWeight, GGMLWeight, quantize_int8, quantize_nf4
from tests.engine.recipe_helpers import Recorder as JobRecorder
from tests.engine.recipe_helpers import tiny_config
from tests.gpu_kernels.oracle import Recorder, rel
from tests.gpu_kernels.test_quant_formats import random_blocks
from worker.engine.memory_plan import MemoryChoice, ModelDims, predict_peak
from worker.engine.recipe import train
from worker.engine.types import LoraConfig


def formats(out: int, n_in: int) -> dict[str, FrozenWeight]:
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(out, n_in, generator=g) * 0.02
    found: dict[str, FrozenWeight] = {
        "nf4": quantize_nf4(dense, dtype=torch.bfloat16),
        "nf4-dq": quantize_nf4(dense, double_quant=True, dtype=torch.bfloat16),
        "int8": quantize_int8(dense, dtype=torch.bfloat16),
    }
    for name, (per_block, _, _) in GGML_TYPES.items():
        raw = random_blocks(name, out * n_in // per_block, seed=1).reshape(out, -1)
        found[name] = GGMLWeight(
            (out, n_in), torch.bfloat16, torch.from_numpy(np.ascontiguousarray(raw)), name
        )
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(formats(64, 256)))
def test_quantized_matmul_in_bf16_matches_the_fp64_oracle(name: str, record_property: Recorder) -> None:
    cpu = formats(1536, 512)[name]
    weight = cpu.to("cuda")
    dense64 = cpu.dequantize(torch.float64)
    assert torch.equal(weight.dequantize(torch.float32).cpu(), cpu.dequantize(torch.float32))
    x = torch.randn(4, 33, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = weight.matmul(x)
    g = torch.randn_like(y)
    y.backward(g)
    x64 = x.detach().double().cpu().requires_grad_(True)
    y64 = x64 @ dense64.t()
    y64.backward(g.double().cpu())
    assert x.grad is not None and x64.grad is not None
    errors = {"y": rel(y.cpu(), y64), "dx": rel(x.grad.cpu(), x64.grad)}
    record_property("errors", errors)
    assert max(errors.values()) < 1e-2, errors  # bf16 inputs and outputs, fp32 accumulation


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nf4", "nf4-dq", "int8"])
def test_the_compiled_tile_is_the_reference_tile_bit_for_bit(name: str) -> None:
    """csrc/quant.cu writes a tile of rows in bf16 in one launch: exactly the torch reference's
    `dequant_rows(...).to(bfloat16)` (the same fp32 products, rounded once), for tiles that start
    anywhere (double quantization's groups of 256 blocks straddle tile starts), and the compiled
    path is the one that runs on CUDA (bigger tiles, the kernel's)."""
    from gpu_kernels.quant.frozen import COMPILED_TILE_ELEMENTS

    weight = formats(1536, 768)[name].to("cuda")  # 12 blocks a row: groups of 256 cross rows
    assert weight.tile_elements(torch.bfloat16) == COMPILED_TILE_ELEMENTS

    def tile(start: int, stop: int) -> torch.Tensor:  # into a buffer dirtied first
        out = torch.full((stop - start, 768), float("nan"), dtype=torch.bfloat16, device="cuda")
        return weight.tile_into(start, stop, out)

    for start, stop in [(0, 1536), (0, 1), (37, 301), (1535, 1536), (500, 1100)]:
        reference = weight.dequant_rows(start, stop).to(torch.bfloat16)
        assert torch.equal(tile(start, stop), reference), (name, start, stop)
    tiles = list(weight.each_tile(torch.bfloat16))
    assert [(a, b) for a, b, _ in tiles] == [(0, 1536)]  # 1.2M weights: one compiled tile
    gpu_kernels.set_backend("reference")
    try:  # forced off, the same call takes the torch tile (and the reference's tile size)
        assert weight.tile_elements(torch.bfloat16) < COMPILED_TILE_ELEMENTS
        assert torch.equal(tile(37, 301), weight.dequant_rows(37, 301).to(torch.bfloat16))
    finally:
        gpu_kernels.set_backend("auto")


@pytest.mark.gpu
def test_the_tiled_matmul_never_holds_a_whole_dense_weight(record_property: Recorder) -> None:
    """An 8192 x 8192 NF4 layer (128 MiB in bf16): forward and backward allocate a tile's
    temporaries (the compiled path: a 16 MiB bf16 tile; the torch one: 4 MiB bf16, 8 MiB fp32
    values, 4 MiB int32 byte index) beyond the input, output and packed weight, never the dense
    weight."""
    weight = quantize_nf4(torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(16, 8192, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = weight.matmul(x)
    y.backward(torch.ones_like(y))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    record_property("extra_mib", extra / 2**20)
    dense_bytes = 8192 * 8192 * 2
    assert extra < dense_bytes / 4, f"{extra / 2**20:.0f} MiB above the start"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nf4", "int8", "Q4_K"])
def test_a_quantized_mlp_takes_the_fused_lora_mlp_op(name: str, record_property: Recorder) -> None:
    """A QLoRA step's MLP: gate/up (one StackedWeight) and down over a compact base, LoRA r=16 on
    all three, through gpu_kernels.lora_gated_mlp: the fused LoRA MLP op serves it (its base GEMMs
    over the dequantized tiles, gpu_kernels.quant.frozen.linear_into), and the output and every
    gradient match the composed ops on the dequantized weights in fp64 within bf16's bound."""
    from gpu_kernels.quant import StackedWeight
    from tests.gpu_kernels.oracle import assert_matches_reference
    from tests.gpu_kernels.test_op_lora_mlp import _inputs, _mlp_reference

    torch.manual_seed(5)
    k, f = 512, 1536
    gate, up, down = (formats(*shape)[name] for shape in ((f, k), (f, k), (k, f)))
    gate_up = StackedWeight([gate.to("cuda"), up.to("cuda")])
    down_w = down.to("cuda")
    dense_gu, dense_d = gate_up.dequantize(torch.float64), down_w.dequantize(torch.float64)
    x, _, _, *factors = _inputs(300, k, f, "cuda", torch.bfloat16)  # factors of rank 16, fp32

    def ours(x, a_g, b_g, a_u, b_u, a_d, b_d):  # type: ignore[no-untyped-def]
        gu = gpu_kernels.LoRAOp(gate_up, None, [(a_g, b_g, 2.0), (a_u, b_u, 0.5)])
        dn = gpu_kernels.LoRAOp(down_w, None, [(a_d, b_d, 1.5)])
        y = gpu_kernels.lora_gated_mlp(x, gu, dn, "silu", training=True)
        assert type(y.grad_fn).__name__ == "LoRAGatedMLPFunctionBackward"
        return y

    def reference(x, *factors):  # type: ignore[no-untyped-def]
        composed = _mlp_reference("silu", (2.0, 0.5, 1.5))  # on the dequantized weights
        return composed(x, dense_gu.to(x.dtype), dense_d.to(x.dtype), *factors)

    names = ["y", "dx", "dA_g", "dB_g", "dA_u", "dB_u", "dA_d", "dB_d"]
    gy = torch.randn(300, k, device="cuda").to(torch.bfloat16)
    assert_matches_reference(ours, reference, [x, *factors], gy, names, torch.bfloat16, record_property)


@pytest.mark.gpu
@pytest.mark.no_memcheck
def test_a_lora_step_on_a_quantized_layer_replays_in_a_cuda_graph() -> None:
    """The tiled op needs no host sync: a forward + backward over an NF4 base captured in a CUDA
    graph and replayed on new inputs gives what the eager op gives."""
    weight = quantize_nf4(torch.randn(512, 256, device="cuda") * 0.05, dtype=torch.bfloat16)
    a = torch.randn(8, 256, device="cuda", requires_grad=True)
    b = torch.randn(512, 8, device="cuda", requires_grad=True)
    static_x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        y = gpu_kernels.lora_linear(static_x, weight, None, a, b, 0.5)
        loss = y.float().square().mean()
        loss.backward()
        return loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    a.grad = b.grad = None
    with torch.cuda.graph(graph):
        static_loss = step()
    new_x = torch.randn_like(static_x)
    static_x.copy_(new_x)
    assert a.grad is not None
    a.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    graphed_loss, graphed_grad = static_loss.clone(), a.grad.clone()
    a.grad = None
    eager = step()
    torch.testing.assert_close(graphed_loss, eager)
    torch.testing.assert_close(graphed_grad, a.grad)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.no_memcheck
def test_a_tiny_llama_job_on_an_nf4_base_trains_on_the_gpu(tmp_path: Path, record_property: Recorder) -> None:
    """The recipe on CUDA (bf16, the captured packed step) with quantization nf4 against the same
    job on the CPU in fp32: the loss curves agree within bf16's error, and the loss falls."""
    losses = {}
    for device in ("cuda", "cpu"):
        recorder = JobRecorder()
        cfg = tiny_config(
            tmp_path / device, device=device, quantization="nf4", max_steps=8, pack=True, lora=LoraConfig(r=8)
        )
        train(cfg, recorder)
        losses[device] = [m.train_loss for m in recorder.steps]
    record_property("losses", losses)
    assert losses["cuda"][-1] < losses["cuda"][0]
    assert max(abs(a - b) for a, b in zip(losses["cuda"], losses["cpu"], strict=True)) < 3e-2


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.no_memcheck
@pytest.mark.parametrize("choice", [MemoryChoice(), MemoryChoice(None, "full")], ids=["none", "full"])
def test_the_predicted_peak_is_near_the_measured_one(choice: MemoryChoice, record_property: Recorder) -> None:
    """A LlamaForCausalLM of smollm2-135m's shape, LoRA r=16 on every linear layer, 4 rows of 1024
    tokens, eager forward + backward in bf16 (no captured step): the memory plan's prediction
    within 25 % of torch's measured peak."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.engine.catalog import PRESET_SHAPES
    from worker.engine.lora import apply_lora
    from worker.engine.step_memory import apply_checkpointing

    kwargs = PRESET_SHAPES["smollm2-135m"].config_kwargs()
    model = torch.nn.Module.to(LlamaForCausalLM(LlamaConfig(**kwargs)), "cuda", torch.bfloat16)
    apply_lora(model, LoraConfig(r=16))
    apply_checkpointing(model, choice.checkpointing)
    model.train()
    ids = torch.randint(0, 1000, (4, 1024), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    dims = ModelDims.from_config(kwargs)
    predicted = predict_peak(dims, rank=16, targets="all-linear", micro_tokens=4 * 1024, choice=choice)[
        "total"
    ]
    record_property("peak_gib", {"measured": measured / 2**30, "predicted": predicted / 2**30})
    # the plain Hugging Face step forms the whole (tokens, vocab) logits, which the plan's chunked
    # loss does not: counted here on top of the prediction (fp32 logits and their gradient)
    logits = 4 * 1024 * dims.vocab * (2 + 4 + 4)
    assert abs(measured - (predicted + logits)) < 0.25 * measured


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.no_memcheck
def test_a_random_8b_nf4_base_is_made_without_its_dense_weights(
    tmp_path: Path, record_property: Recorder
) -> None:
    """load_base_model("llama-8b", quantization="nf4") on the GPU makes the base a decoder layer at
    a time (models.random_quantized_llama): the device's peak while it loads stays within what it
    keeps (the packed linears, the dense embeddings, LM head and norms) + one decoder layer in bf16
    + one linear's quantization temporaries (an fp32 copy, the scaled fp32 weights, int64 codes:
    ~18 bytes a weight), far under the 16 GB of the dense model."""
    from worker.engine.models import load_base_model
    from worker.engine.quantize import frozen_bytes

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded = load_base_model(
        "llama-8b", store=tmp_path, device="cuda", dtype=torch.bfloat16, quantization="nf4"
    )
    torch.cuda.synchronize()
    peak, held = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
    cfg = loaded.model.config
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * i)  # one decoder layer's linears in bf16
    temporaries = 18 * h * i  # the largest linear's, while it is quantized
    kept = frozen_bytes(loaded.model)
    record_property("load_gib", {"peak": peak / 2**30, "held": held / 2**30, "kept": kept / 2**30})
    assert abs(held - kept) < 0.01 * kept  # nothing else stays behind
    assert peak <= kept + layer + temporaries + (64 << 20)
    assert peak < 8e9  # the dense bf16 model alone is 16 GB
