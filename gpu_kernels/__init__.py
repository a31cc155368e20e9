"""Loraq's GPU kernels behind a device-agnostic API.

The engine calls only the functions exported here and never branches on the device itself.
On CPU tensors (or when no GPU is present) every op runs its plain-torch twin from
`gpu_kernels.reference`; on CUDA tensors the compiled kernels (csrc/*.cu, built by
gpu_kernels.build and loaded with ctypes) run, and if a GPU is present but the build failed,
`require_compiled()` raises with the compiler's error instead of silently training on the slow
path. `configure(KernelConfig(...))` sets the switches (see gpu_kernels.config).
"""

from gpu_kernels.backend import get_backend, set_backend
from gpu_kernels.config import KernelConfig, configure, current_config
from gpu_kernels.dispatch import (
    KernelStatus,
    LoRAOp,
    adapter_casts,
    add_rms_norm,
    available,
    clip_grad_norm_,
    dropout_seed_step_,
    fused_linear_cross_entropy,
    lora_gated_mlp,
    lora_linear,
    lora_linear_grouped,
    lora_linear_multi,
    new_nonfinite_state,
    require_compiled,
    rms_norm,
    rope_attention,
    rope_qkv,
    swiglu,
    swiglu_packed,
    varlen_attention,
)
from gpu_kernels.graph import GraphedStep
from gpu_kernels.monitor import NonFiniteMonitor
from gpu_kernels.ops.adapter_casts import AdapterCasts
from gpu_kernels.ops.norm_source import NormSource
from gpu_kernels.ops.rope_reference import HeadNorm

__all__ = [
    "AdapterCasts",
    "GraphedStep",
    "HeadNorm",
    "KernelConfig",
    "KernelStatus",
    "LoRAOp",
    "NonFiniteMonitor",
    "NormSource",
    "adapter_casts",
    "add_rms_norm",
    "available",
    "clip_grad_norm_",
    "configure",
    "current_config",
    "dropout_seed_step_",
    "fused_linear_cross_entropy",
    "get_backend",
    "lora_gated_mlp",
    "lora_linear",
    "lora_linear_grouped",
    "lora_linear_multi",
    "new_nonfinite_state",
    "require_compiled",
    "rms_norm",
    "rope_attention",
    "rope_qkv",
    "set_backend",
    "swiglu",
    "swiglu_packed",
    "varlen_attention",
]
