"""Chunked fused linear + cross-entropy on the GPU: the (N, V) logits never exist at once.

For each chunk of rows: logits = h_c·Wᵀ (cuBLAS, (c, V) in the hidden dtype); one kernel
(csrc/cross_entropy.cu) writes each row's loss and overwrites the logits with
d(mean loss)/dlogits; dh_c = grad·W (cuBLAS). The hidden-state gradient is thus formed during
the forward and stored (N, d); the backward only scales it by the incoming gradient. The
weight (the LM head or tied embedding) is frozen in LoRA training; dispatch sends a trainable
one to the reference path.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_kernels import _lib

# Logits bytes per chunk (`auto_chunk_rows`); one chunk's logits are alive at a time. Larger
# chunks run faster (bigger GEMMs, fewer launches) and take more memory at the step's peak, which
# is here. On an H100 (bench/ce_chunks.py, bench/results/ce-chunks-h100-2026-11-27.json), fwd +
# bwd of smollm2's head (M 5,176, d 576, V 49,152) took 1.41 ms in chunks of 1,024 rows (one of
# them 56 rows), 1.33 ms in chunks of 2,048 and 2.79 ms in chunks of 256 (logits that fit the L2
# cache). 200 MiB is about 800 rows of a 128k vocabulary and 2,100 of a 49k one.
CHUNK_BYTES = 200 << 20


def auto_chunk_rows(vocab: int, dtype: torch.dtype, rows: int) -> int:
    """Rows per chunk: as many as fit CHUNK_BYTES of logits, spread evenly over `rows` (no short
    tail chunk), a multiple of 8."""
    per_row = vocab * torch.finfo(dtype).bits // 8
    target = max(8, CHUNK_BYTES // per_row // 8 * 8)
    if rows <= target:
        return max(rows, 1)
    chunks = -(-rows // target)
    return (-(-rows // chunks) + 7) // 8 * 8


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        chunk_rows: int | None,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        d = hidden.shape[-1]
        v = weight.shape[0]
        h2 = hidden.reshape(-1, d).contiguous()  # (N, d)
        t = targets.reshape(-1).to(torch.int64).contiguous()  # (N,)
        n = h2.shape[0]
        if t.shape[0] != n:
            raise ValueError(f"targets have {t.shape[0]} entries but hidden has {n} rows")
        w = weight.to(h2.dtype).contiguous()
        if scale is None:  # the mean over the non-ignored targets
            inv_count = (t != ignore_index).sum().clamp(min=1).to(torch.float32).reciprocal()  # device 0-d
        else:  # a sum scaled by the caller (1 / the step's trainable tokens)
            inv_count = scale.to(device=h2.device, dtype=torch.float32).reshape(())
        losses = torch.empty(n, dtype=torch.float32, device=h2.device)
        dh = torch.empty_like(h2) if hidden.requires_grad else None
        if chunk_rows is None:
            chunk_rows = auto_chunk_rows(v, h2.dtype, n)
        lib = _lib.load()
        code = _lib.dtype_code(h2.dtype)
        stream = _lib.stream(h2.device)
        for start in range(0, n, chunk_rows):
            end = min(start + chunk_rows, n)
            logits = h2[start:end] @ w.t()  # (c, V)
            rc = lib.loraq_cross_entropy_fwd_bwd(
                logits.data_ptr(), code, end - start, v, t[start:end].data_ptr(), int(ignore_index),
                inv_count.data_ptr(), losses[start:end].data_ptr(), stream,
            )  # fmt: skip
            _lib.check(rc, "loraq_cross_entropy_fwd_bwd")
            if dh is not None:
                torch.mm(logits, w, out=dh[start:end])  # (c, V)·(V, d)
            del logits  # before the next chunk's: one chunk's logits alive at a time
        ctx.save_for_backward(dh)
        ctx.shape = hidden.shape
        return losses.sum() * inv_count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (dh,) = ctx.saved_tensors
        dhidden = None
        if ctx.needs_input_grad[0] and dh is not None:
            dhidden = (dh * grad.to(dh.dtype)).view(ctx.shape)
        return dhidden, None, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    *,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean CE over the non-ignored targets, or with `scale` (0-d fp32 device tensor) their sum
    times scale; the kernel writes d(loss)/dlogits with that same factor. `chunk_rows` None:
    `auto_chunk_rows`."""
    out = FusedLinearCrossEntropyFunction.apply(hidden, weight, targets, ignore_index, chunk_rows, scale)
    assert isinstance(out, torch.Tensor)
    return out
