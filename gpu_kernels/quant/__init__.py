"""Frozen base weights in compact formats (NF4, int8, GGML blocks) and the tiled matmul over them.

The tiles are dequantized in plain torch (on the CPU, for the GGML blocks, and as the reference),
or on the GPU by one compiled launch a tile for NF4 and int8 (compiled.py, csrc/quant.cu), then
multiplied by cuBLAS; no host syncs, so it runs inside the captured step. See frozen.py.
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
