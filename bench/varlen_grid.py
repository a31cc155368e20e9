"""What the packed step's attention costs against the fixed step's, and what its launch shape adds.

The job path runs flash-attention's varlen kernel over K sequences padded to a fixed count with
empty ones, with `max_seqlen` = the row length T (both static, so the step can be captured).
Its grid is (T / block) x K x heads, whatever the sequences' real lengths: blocks past a
sequence's end, and every block of an empty one, start and exit. This times the forward and
backward of one attention layer on B rows of T tokens packed with the long-tail lengths of the
job benchmark (mean ~440 tokens, 20 to 2,004), for K = the real sequence count and padded counts,
and max_seqlen = T or the longest real sequence, next to dense causal SDPA over the whole rows
(the fixed-shape step's attention, which a packed row cannot use), and the other candidates for
packed rows: cuDNN's attention with ragged offsets (torch's `_cudnn_attention_forward/backward`
with cum_seq, the nested-tensor path, on the same cu_seqlens; its largest differences from the
flash kernel's output and gradients),
FlexAttention with a document mask (compiled; the time to build its block mask apart, and its
largest difference from the varlen output), and SDPA over nested jagged tensors (recorded as
unavailable with torch's reason where it refuses causal attention).

Usage (CUDA host): python bench/varlen_grid.py [--out DIR] [--skip flex,nested]
  -> DIR/varlen-grid-<gpu>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_kernels.ops.varlen import varlen_attention  # noqa: E402

# (name, q heads H, kv heads G, head size D) of the benchmark's presets
HEADS = [("smollm2-135m", 9, 3, 64), ("llama-1b", 32, 8, 64), ("llama-8b", 32, 8, 128)]
ROWS, SEQ = 4, 2048


def packed_lengths(seed: int = 0) -> list[list[int]]:
    """ROWS rows of SEQ tokens filled greedily with long-tail lengths (exponential, mean ~440,
    clipped to 20..2,004); a row's unused tail continues its last sequence, as host_step does."""
    g = torch.Generator().manual_seed(seed)
    rows: list[list[int]] = []
    for _ in range(ROWS):
        row: list[int] = []
        while sum(row) < SEQ:
            n = int(torch.empty(1).exponential_(1 / 420, generator=g).clamp(20, 2004))
            row.append(min(n, SEQ - sum(row)))
        rows.append(row)
    return rows


def cu_seqlens(rows: list[list[int]], segments: int) -> torch.Tensor:
    """(segments + 1,) int32 offsets of every sequence, padded by repeating the total."""
    lengths = [n for row in rows for n in row]
    offsets = torch.tensor([0, *lengths]).cumsum(0)
    out = torch.full((segments + 1,), int(offsets[-1]), dtype=torch.int32)
    out[: offsets.numel()] = offsets.to(torch.int32)
    return out.cuda()


def time_ms(fn: Callable[[], Any], iters: int = 30) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def one_model(h: int, g: int, d: int, rows: list[list[int]], skip: set[str]) -> dict[str, Any]:
    n = ROWS * SEQ
    q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16)
    real = sum(len(r) for r in rows)
    longest = max(max(r) for r in rows)

    def varlen(segments: int, max_seqlen: int) -> Callable[[], Any]:
        cu = cu_seqlens(rows, segments)
        return lambda: varlen_attention(q, k, v, cu, max_seqlen).backward(grad)

    qd, kd, vd = (t.detach().view(ROWS, SEQ, -1, d).transpose(1, 2).requires_grad_() for t in (q, k, v))
    gd = grad.view(ROWS, SEQ, h, d).transpose(1, 2)

    def dense() -> None:
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)
        out.backward(gd)

    cells: dict[str, float] = {"dense_causal_sdpa": round(time_ms(dense), 4)}
    for segments in sorted({real, 64, 128, 256}):
        if segments < real:
            continue
        for max_seqlen in (SEQ, longest):
            cells[f"varlen_K{segments}_max{max_seqlen}"] = round(time_ms(varlen(segments, max_seqlen)), 4)
    reference = varlen_attention(q, k, v, cu_seqlens(rows, real), SEQ).detach()  # (N, H, D)
    candidates: dict[str, Callable[[], dict[str, Any]]] = {
        "cudnn_ragged": lambda: cudnn_cell(q, k, v, grad, rows),
        "flex_document_mask": lambda: flex_cell(qd, kd, vd, gd, rows, reference),
        "nested_jagged_sdpa": lambda: jagged_cell(q, k, v, rows),
    }
    return {
        "sequences": real,
        "longest": longest,
        "fwd_bwd_ms": cells,
        **{name: _attempt(cell) for name, cell in candidates.items() if name.split("_")[0] not in skip},
    }


class CudnnRaggedAttention(torch.autograd.Function):
    """Causal attention within each sequence of (N, heads, D) q/k/v by cuDNN with ragged offsets."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, m: int) -> Any:
        # (out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, debug mask)
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, m, m, True, 0.0, True, False
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.m = m
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        m = ctx.m
        # None: the undefined attn_bias tensor of "no bias"
        grads = torch.ops.aten._cudnn_attention_backward(
            dout.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, m, m, 0.0, True
        )
        return (*grads, None, None)


def cudnn_cell(
    q: torch.Tensor,  # (N, H, D)
    k: torch.Tensor,  # (N, G, D)
    v: torch.Tensor,
    grad: torch.Tensor,  # (N, H, D)
    rows: list[list[int]],
) -> dict[str, Any]:
    """cuDNN's ragged-offset attention on the cu_seqlens the flash kernel gets: forward + backward
    times for the real sequence count and padded counts (max_seqlen = the row length, as the
    step runs it), and the largest differences from the flash kernel (output, dq, dk, dv)."""
    real = sum(len(r) for r in rows)

    def cudnn(segments: int) -> Callable[[], Any]:
        cu = cu_seqlens(rows, segments)
        return lambda: CudnnRaggedAttention.apply(q, k, v, cu, SEQ).backward(grad)

    cells = {
        f"K{segments}_max{SEQ}": round(time_ms(cudnn(segments)), 4)
        for segments in sorted({real, 40, 64, 128})
        if segments >= real
    }
    cu = cu_seqlens(rows, 64)  # padded with empty sequences, as the job step pads them
    results = []
    for attention in (varlen_attention, CudnnRaggedAttention.apply):
        for t in (q, k, v):
            t.grad = None
        out = attention(q, k, v, cu, SEQ)
        out.backward(grad)
        results.append([out.detach().float()] + [t.grad.float() for t in (q, k, v) if t.grad is not None])
    names = ("out", "dq", "dk", "dv")
    diffs = {n: float((a - b).abs().max()) for n, a, b in zip(names, *results, strict=True)}
    finite = all(bool(torch.isfinite(t).all()) for t in results[1])
    return {"fwd_bwd_ms": cells, "max_abs_diff_vs_flash": diffs, "all_finite": finite}


def _attempt(cell: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A candidate's figures, or why it could not run here."""
    try:
        return cell()
    except Exception as exc:  # a candidate this torch refuses is a result, not a crash
        return {"unavailable": f"{type(exc).__name__}: {exc}"[:500]}


def flex_cell(
    q: torch.Tensor,  # (B, H, S, D)
    k: torch.Tensor,  # (B, G, S, D)
    v: torch.Tensor,
    grad: torch.Tensor,  # (B, H, S, D)
    rows: list[list[int]],
    reference: torch.Tensor,  # (B·S, H, D), the varlen kernel's output
) -> dict[str, Any]:
    """FlexAttention (compiled) with a causal document mask over the packed rows."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in rows], device="cuda")

    def document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    def block_mask() -> Any:
        return create_block_mask(
            document_causal, B=ROWS, H=None, Q_LEN=SEQ, KV_LEN=SEQ, device="cuda", _compile=True
        )

    mask = block_mask()
    flex = torch.compile(flex_attention, dynamic=False)

    def step() -> None:
        flex(q, k, v, block_mask=mask, enable_gqa=True).backward(grad)

    out = flex(q, k, v, block_mask=mask, enable_gqa=True)  # (B, H, S, D)
    diff = (out.transpose(1, 2).reshape(reference.shape).float() - reference.float()).abs().max()
    return {
        "fwd_bwd_ms": round(time_ms(step), 4),
        "block_mask_ms": round(time_ms(block_mask), 4),
        "max_abs_diff_vs_varlen": float(diff),
    }


def jagged_cell(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[list[int]]) -> dict[str, Any]:
    """SDPA over nested jagged tensors, one per sequence (k/v heads repeated to q's)."""
    offsets = torch.tensor([0, *[n for row in rows for n in row]], device="cuda").cumsum(0)
    rep = q.shape[1] // k.shape[1]

    def nested(t: torch.Tensor) -> torch.Tensor:  # (N, heads, D) -> (sequences, heads, j, D)
        return torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)

    qn, kn, vn = nested(q), nested(k.repeat_interleave(rep, 1)), nested(v.repeat_interleave(rep, 1))

    def step() -> None:
        out = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
        out.transpose(1, 2).values().sum().backward()

    return {"fwd_bwd_ms": round(time_ms(step), 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--skip", default="", help="candidates not to run: comma-separated of cudnn,flex,nested")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    rows = packed_lengths()
    device = torch.cuda.get_device_name()
    result = {
        "device": device,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "command": " ".join(["python", "bench/varlen_grid.py", *sys.argv[1:]]),
        "rows": f"{ROWS} x {SEQ}",
        "row_lengths": rows,
        "models": {name: one_model(h, g, d, rows, skip) for name, h, g, d in HEADS},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"varlen-grid-{device.split()[1].lower() if ' ' in device else 'gpu'}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["models"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
