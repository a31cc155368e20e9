"""Frozen base weights in compact formats (NF4, int8, GGML blocks) and the tiled matmul over them.

Plain torch: the reference twins of a fused dequantize-GEMM kernel, and what runs today on both
the CPU and the GPU (inside the captured step: no host syncs). See frozen.py for the contract.
"""

from gpu_kernels.quant.frozen import TILE_ELEMENTS, DenseWeight, FrozenWeight, StackedWeight, stack_frozen
from gpu_kernels.quant.ggml import GGML_TYPES, GGMLWeight, dequantize_blocks
from gpu_kernels.quant.int8 import Int8Weight, quantize_int8
from gpu_kernels.quant.nf4 import NF4_BLOCK, NF4_CODE, NF4Weight, quantize_nf4

__all__ = [
    "GGML_TYPES",
    "NF4_BLOCK",
    "NF4_CODE",
    "TILE_ELEMENTS",
    "DenseWeight",
    "FrozenWeight",
    "GGMLWeight",
    "Int8Weight",
    "NF4Weight",
    "StackedWeight",
    "dequantize_blocks",
    "quantize_int8",
    "quantize_nf4",
    "stack_frozen",
]
