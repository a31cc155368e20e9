"""A quantized frozen base (QLoRA): the decoder's linear layers hold compact frozen weights.

`quantization` (a job's extension field, `TrainConfig.quantization`):

- unset: the base's weights are dense in the activation dtype (bf16 on CUDA), as always;
- "nf4" / "int8": every decoder linear layer (not the LM head, not embeddings or norms: those
  stay dense, as torchtune and PEFT's QLoRA keep them) is quantized when the model loads, on the
  device it trains on, one layer at a time (gpu_kernels.quant.nf4 / int8);
- "gguf": a base pulled as GGUF keeps its file's blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K)
  as its frozen linear weights: read zero-copy from the mmap'd file (on the CPU; copied as
  they are onto a GPU), never dequantized to a dense weight.

LoRA factors stay fp32 on every layer and gradients flow only into them; an adapter trained on
a quantized base is an ordinary PEFT adapter of the dense base (the QLoRA convention).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from gpu_kernels.quant import FrozenWeight, GGMLWeight, quantize_int8, quantize_nf4
from worker.engine.types import ConfigError, ModelError

Quantization = Literal["nf4", "int8", "gguf"]
QUANTIZATIONS: tuple[str, ...] = ("nf4", "int8", "gguf")

# GGUF tensor names of a Llama block -> the Hugging Face module path under model.layers.N
GGUF_LLAMA_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class QuantizedLinear(nn.Module):
    """A frozen linear layer y = x·Wᵀ + b whose W is a `FrozenWeight` (the LM head never is).

    `weight` is that FrozenWeight: its `dtype` (the activation dtype), `device` and `shape` read
    like a dense weight's. Moving the module (`.to(device, dtype)`) moves the packed tensors as
    they are (a cast would re-round the scales) and makes `dtype` the dtype it computes in."""

    def __init__(self, weight: FrozenWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    @property
    def weight(self) -> FrozenWeight:
        return self.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        y = self.qweight.matmul(x)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantizedLinear:
        # `fn` is nn.Module.to's (or .cuda()'s, .bfloat16()'s) conversion: where it sends a float
        # tensor of the compute dtype tells the target device and dtype
        probe = fn(torch.empty(0, dtype=self.qweight.dtype, device=self.qweight.device))
        self.qweight = self.qweight.to(probe.device, probe.dtype)
        super()._apply(fn, recurse)
        return self

    def extra_repr(self) -> str:
        w = self.qweight
        return f"in={self.in_features}, out={self.out_features}, format={w.format}, nbytes={w.nbytes}"


def is_frozen_linear(module: nn.Module) -> bool:
    """A frozen linear layer LoRA may wrap: nn.Linear or QuantizedLinear."""
    return isinstance(module, nn.Linear | QuantizedLinear)


def decoder_linear_paths(model: nn.Module) -> list[str]:
    """Every frozen linear layer (dense or quantized) except the output head (lm_head): what
    LoRA's "all-linear" means, and what a quantized base quantizes."""
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    return [
        name
        for name, m in model.named_modules()
        if is_frozen_linear(m) and m is not head and name.split(".")[-1] != "lm_head"
    ]


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, leaf, module)


@dataclass(frozen=True)
class QuantizeReport:
    layers: int  # decoder linears quantized
    error_sq: float = 0.0  # ‖Ŵ − W‖² summed over them (Frobenius), W as it was loaded
    weight_sq: float = 0.0  # ‖W‖² summed over them

    @property
    def rel_error(self) -> float:
        """‖Ŵ − W‖ / ‖W‖ over every quantized layer."""
        return (self.error_sq / self.weight_sq) ** 0.5 if self.weight_sq > 0 else 0.0

    def __add__(self, other: QuantizeReport) -> QuantizeReport:
        """Two parts of one model quantized separately (a random base, layer by layer)."""
        return QuantizeReport(
            self.layers + other.layers, self.error_sq + other.error_sq, self.weight_sq + other.weight_sq
        )

    def sentence(self, method: str) -> str:
        return (
            f"Base quantized to {method} as it loaded: {self.layers} linear layers, weight error "
            f"‖Ŵ − W‖ / ‖W‖ = {self.rel_error:.2%} (embeddings, norms and LM head stay dense)"
        )


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    method: Literal["nf4", "int8"],
    *,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    double_quant: bool = False,
) -> QuantizeReport:
    """Replace every decoder nn.Linear of `model` by a QuantizedLinear of `method`, quantized on
    `device` (default: where the layer is) one layer at a time: the dense weight is dropped as its
    replacement lands, so a GPU holds at most one dense layer beside the quantized ones. Reports
    how many layers were quantized and the conversion's error. `dtype`: the dtype they compute in
    (default: the weight's)."""
    count = 0
    err = ref = torch.zeros((), dtype=torch.float64)
    for path in decoder_linear_paths(model):
        linear = model.get_submodule(path)
        if not isinstance(linear, nn.Linear):
            continue  # quantized already
        w = linear.weight.to(device) if device is not None else linear.weight
        if method == "nf4":
            frozen: FrozenWeight = quantize_nf4(w, double_quant=double_quant, dtype=dtype or w.dtype)
        elif method == "int8":
            frozen = quantize_int8(w, dtype=dtype or w.dtype)
        else:
            raise ConfigError("quantization", f"quantization must be one of nf4, int8, gguf; got {method!r}")
        for start, stop in frozen.tiles():  # the error a tile at a time, as the step dequantizes
            rows = w[start:stop].float()
            err = err + (rows - frozen.dequant_rows(start, stop)).double().square().sum().cpu()
            ref = ref + rows.double().square().sum().cpu()
        bias = linear.bias.to(frozen.device, frozen.dtype) if linear.bias is not None else None
        _replace(model, path, QuantizedLinear(frozen, bias))
        del w, linear
        count += 1
    return QuantizeReport(count, float(err), float(ref))


def _llama_permuted(blocks: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf's `permute`, transformers'
    `_reverse_permute_weights`) on (out, row bytes) blocks: it moves whole rows only."""
    out = blocks.shape[0]
    dim = out // n_head // 2
    return blocks.reshape(n_head, dim, 2, -1).transpose(1, 2).reshape(out, -1).contiguous()


def gguf_block_weights(path: Path, config: Any, dtype: torch.dtype) -> dict[str, tuple[GGMLWeight, str]]:
    """{module path: (weight, GGUF tensor name)} for every decoder linear of the Llama GGUF file at
    `path` stored in a supported block type. Blocks are zero-copy views of the mmap'd file, but
    q/k, whose rows llama.cpp permuted, are re-ordered copies (still blocks)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(path, "r")
    arch_field = reader.get_field("general.architecture")
    arch = bytes(arch_field.parts[-1]).decode() if arch_field is not None else "?"
    if arch != "llama":
        raise ModelError(f"keeping GGUF blocks supports Llama files; {path.name} is {arch!r}")
    n_head, n_kv = int(config.num_attention_heads), int(config.num_key_value_heads)
    found: dict[str, tuple[GGMLWeight, str]] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")  # blk.N.attn_q.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in GGUF_LLAMA_LINEARS:
            continue
        ggml_type = tensor.tensor_type.name
        n_in, n_out = (int(d) for d in tensor.shape)  # GGUF lists dimensions innermost first
        if ggml_type not in _supported():
            continue  # F16/F32/other layers stay as transformers loaded them (dense)
        data = np.asarray(tensor.data)  # (out, row bytes) uint8, a view of the mmap
        with warnings.catch_warnings():  # the mmap is read-only; the frozen weight never writes
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            blocks = torch.from_numpy(data).view(n_out, -1)
        if parts[2] == "attn_q":
            blocks = _llama_permuted(blocks, n_head)
        elif parts[2] == "attn_k":
            blocks = _llama_permuted(blocks, n_kv)
        module = f"model.layers.{parts[1]}.{GGUF_LLAMA_LINEARS[parts[2]]}"
        found[module] = (GGMLWeight((n_out, n_in), dtype, blocks, ggml_type), tensor.name)
    return found


def _supported() -> set[str]:
    from gpu_kernels.quant import GGML_TYPES

    return set(GGML_TYPES)


@torch.no_grad()
def use_gguf_blocks(
    model: nn.Module, path: Path, *, device: torch.device, dtype: torch.dtype
) -> dict[str, int]:
    """Replace each decoder linear of `model` (loaded from the GGUF file at `path`) whose tensor
    is in a supported block type by a QuantizedLinear over those blocks, on `device`. Returns
    {GGML type: layers} of what was replaced; layers of other types stay dense."""
    counts: dict[str, int] = {}
    config = getattr(model, "config", None)
    for module_path, (weight, _) in gguf_block_weights(path, config, dtype).items():
        linear = model.get_submodule(module_path)
        if not isinstance(linear, nn.Linear) or tuple(linear.weight.shape) != weight.shape:
            raise ModelError(f"GGUF tensor for {module_path} does not match the model's layer")
        moved = weight.to(device) if device.type != "cpu" else weight
        bias = linear.bias.to(device, dtype) if linear.bias is not None else None
        _replace(model, module_path, QuantizedLinear(moved, bias))
        counts[weight.format] = counts.get(weight.format, 0) + 1
    return counts


def frozen_bytes(model: nn.Module) -> int:
    """Bytes of the model's frozen weights as stored: packed quantized layers plus every dense
    parameter and buffer."""
    total = sum(m.qweight.nbytes for m in model.modules() if isinstance(m, QuantizedLinear))
    total += sum(p.numel() * p.element_size() for p in model.parameters())
    return total + sum(b.numel() * b.element_size() for b in model.buffers())


def quantization_of(model: nn.Module) -> str | None:
    """The formats of the model's quantized layers ("nf4", "Q4_1+Q6_K"), or None when dense."""
    formats = sorted({m.qweight.format for m in model.modules() if isinstance(m, QuantizedLinear)})
    return "+".join(formats) or None
