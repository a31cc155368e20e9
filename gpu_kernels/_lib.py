"""Loads the compiled kernel library with ctypes and declares its C ABI.

`load()` builds on first use (gpu_kernels.build, cached on disk) and remembers the outcome, so
a failed build is reported with the compiler's output every time it is asked for, without
recompiling.
"""

from __future__ import annotations

import ctypes
import threading

import torch

# dtype codes of csrc/common.cuh
F32 = 0
BF16 = 1

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int
_f32 = ctypes.c_float
_u32 = ctypes.c_uint32

SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "loraq_rank_update": (_i32, [_p, _i32, _i64, _i64, _i64, _p, _i64, _p, _i64, _i32, _f32, _p]),
    "loraq_dropout": (_i32, [_p, _p, _i32, _i64, _f32, _p, _u32, _p]),
    "loraq_adapter_cast": (_i32, [_p, _i32, _i64, _i32, _p]),
    "loraq_clip_partials": (_i64, [_p, _i32]),
    "loraq_clip_grad_norm": (_i32, [_p, _p, _i32, _f32, _p, _p, _p, _p, _p]),
    "loraq_rmsnorm_fwd": (_i32, [_p, _p, _p, _p, _i32, _i64, _i64, _f32, _f32, _p]),
    "loraq_rmsnorm_bwd": (_i32, [_p, _p, _p, _p, _p, _i32, _i64, _i64, _f32, _p]),
    # (r, y, wp, w, h, n, rstd, rstd_p, dtype, M, D, eps_p, eps, offset, stream)
    "loraq_add_rmsnorm_fwd": (_i32, [*[_p] * 8, _i32, _i64, _i64, _f32, _f32, _f32, _p]),
    # (dr_in, dn, h, w, rstd, y, wp, rstd_p, dh, dy, dtype, M, D, offset, stream)
    "loraq_add_rmsnorm_bwd": (_i32, [*[_p] * 11, _i32, _i64, _i64, _f32, _p]),
    "loraq_swiglu_fwd": (_i32, [_p, _i64, _p, _i64, _p, _i32, _i64, _i64, _i32, _p]),
    "loraq_swiglu_bwd": (_i32, [_p, _p, _i64, _p, _i64, _p, _i64, _p, _i64, _i32, _i64, _i64, _i32, _p]),
    # (dh, gu, ud, dlu, xa, dgu, uacc, gacc, daacc, M, F, act, stream)
    "loraq_glu_bwd_lora": (_i32, [*[_p] * 9, _i64, _i64, _i32, _p]),
    "loraq_cross_entropy_fwd_bwd": (_i32, [_p, _i32, _i64, _i64, _p, _i64, _p, _p, _p]),
    # (qkv, cos, sin, pos, cs_b, cs_s, q, k, v, qw, kw, eps, offset, dtype, B, S, H, G, D, R, stream)
    "loraq_rope_fwd": (_i32, [*[_p] * 4, _i64, _i64, *[_p] * 5, _f32, _f32, _i32, _i64, *[_i32] * 5, _p]),
    # (3x (grad, sb, sh, ss), cos, sin, pos, cs_b, cs_s, qkv, qw, kw, eps, offset, dqkv, dtype, B, S, H,
    #  G, D, R, stream)
    "loraq_rope_bwd": (
        _i32,
        [
            *[_p, _i64, _i64, _i64] * 3,
            *[_p] * 3,
            _i64,
            _i64,
            *[_p] * 3,
            _f32,
            _f32,
            _p,
            _i32,
            _i64,
            *[_i32] * 5,
            _p,
        ],
    ),
    "loraq_lora_multi_workspace": (_i64, [_i64, _i64, _i32]),
    "loraq_lora_multi": (_i32, [_p, _p, _i32, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _i64, _i32, _p, _p]),
    # (packed, absmax, dq_codes, dq_scale, dq_mean, first_block, rows, n_in, block, out, stream)
    "loraq_nf4_dequant": (_i32, [*[_p] * 5, _i64, _i64, _i64, _i32, _p, _p]),
    "loraq_int8_dequant": (_i32, [_p, _p, _i64, _i64, _p, _p]),
    "loraq_error_string": (ctypes.c_char_p, [_i32]),
}


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load() -> ctypes.CDLL:
    """The loaded library; raises RuntimeError (with the build's error) if it cannot be had."""
    global _lib, _error
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise RuntimeError(_error)
        from gpu_kernels import build  # lazy: `python -m gpu_kernels.build` runs it as __main__

        try:
            path = build.build()
            lib = ctypes.CDLL(str(path))
            _declare(lib)
        except (build.BuildError, OSError, AttributeError) as exc:
            _error = f"{type(exc).__name__}: {exc}"
            raise RuntimeError(_error) from exc
        _lib = lib
        return lib


def load_error() -> str | None:
    return _error


def dtype_code(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return F32
    if dtype == torch.bfloat16:
        return BF16
    raise TypeError(f"compiled kernels support float32 and bfloat16, not {dtype}")


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's device address for a launcher, or None (a null pointer) for an absent one."""
    return t.data_ptr() if t is not None else None


def stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream)


def check(rc: int, what: str) -> None:
    """Raise if a launcher returned a CUDA error code."""
    if rc != 0:
        lib = load()
        name = lib.loraq_error_string(rc)
        text = name.decode() if isinstance(name, bytes) else str(rc)
        raise RuntimeError(f"{what}: CUDA error {rc} ({text})")
