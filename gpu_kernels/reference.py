"""Plain-torch reference of every op in gpu_kernels, gathered in one namespace: the CPU path
gpu_kernels.dispatch falls back to, and the test oracle.

Each op's reference lives beside its compiled twin, as gpu_kernels/ops/<op>_reference.py next
to gpu_kernels/ops/<op>.py (autograd function) and gpu_kernels/csrc/<op>.cu (kernel), with the
same signature and the same math; this module only re-exports them.
"""

from gpu_kernels.ops.clip_reference import clip_grad_norm_, new_nonfinite_state
from gpu_kernels.ops.cross_entropy_reference import fused_linear_cross_entropy
from gpu_kernels.ops.lora_multi_reference import lora_linear_multi
from gpu_kernels.ops.lora_reference import dropout_mask, hash_dropout, lora_linear, lora_linear_grouped
from gpu_kernels.ops.norm_act_reference import rms_norm, swiglu, swiglu_packed
from gpu_kernels.ops.residual_norm_reference import add_rms_norm
from gpu_kernels.ops.rope_reference import HeadNorm, packed_rows, rope_head_size, rope_qkv
from gpu_kernels.ops.varlen_reference import varlen_attention

__all__ = [
    "HeadNorm",
    "add_rms_norm",
    "clip_grad_norm_",
    "dropout_mask",
    "fused_linear_cross_entropy",
    "hash_dropout",
    "lora_linear",
    "lora_linear_grouped",
    "lora_linear_multi",
    "new_nonfinite_state",
    "packed_rows",
    "rms_norm",
    "rope_head_size",
    "rope_qkv",
    "swiglu",
    "swiglu_packed",
    "varlen_attention",
]
