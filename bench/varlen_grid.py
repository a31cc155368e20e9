"""What the packed step's attention costs against the fixed step's, and what its launch shape adds.

The job path runs flash-attention's varlen kernel over K sequences padded to a fixed count with
empty ones, with `max_seqlen` = the row length T (both static, so the step can be captured).
Its grid is (T / block) x K x heads, whatever the sequences' real lengths: blocks past a
sequence's end, and every block of an empty one, start and exit. This times the forward and
backward of one attention layer on B rows of T tokens packed with the long-tail lengths of the
job benchmark (mean ~440 tokens, 20 to 2,004), for K = the real sequence count and padded counts,
and max_seqlen = T or the longest real sequence, next to dense causal SDPA over the whole rows
(the fixed-shape step's attention, which a packed row cannot use), and two other candidates for
packed rows: FlexAttention with a document mask (compiled; the time to build its block mask
apart, and its largest difference from the varlen output), and SDPA over nested jagged tensors
(recorded as unavailable with torch's reason where it refuses causal attention).

Usage (CUDA host): python bench/varlen_grid.py [--out DIR]   -> DIR/varlen-grid-<gpu>.json
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


def one_model(h: int, g: int, d: int, rows: list[list[int]]) -> dict[str, Any]:
    import gpu_kernels

    n = ROWS * SEQ
    q = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, g, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16)
    real = sum(len(r) for r in rows)
    longest = max(max(r) for r in rows)

    def varlen(segments: int, max_seqlen: int) -> Callable[[], Any]:
        cu = cu_seqlens(rows, segments)
        return lambda: gpu_kernels.varlen_attention(q, k, v, cu, max_seqlen).backward(grad)

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
    reference = gpu_kernels.varlen_attention(q, k, v, cu_seqlens(rows, real), SEQ).detach()  # (N, H, D)
    return {
        "sequences": real,
        "longest": longest,
        "fwd_bwd_ms": cells,
        "flex_document_mask": _attempt(lambda: flex_cell(qd, kd, vd, gd, rows, reference)),
        "nested_jagged_sdpa": _attempt(lambda: jagged_cell(q, k, v, rows)),
    }


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
    args = ap.parse_args()
    rows = packed_lengths()
    device = torch.cuda.get_device_name()
    result = {
        "device": device,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "command": "python bench/varlen_grid.py",
        "rows": f"{ROWS} x {SEQ}",
        "row_lengths": rows,
        "models": {name: one_model(h, g, d, rows) for name, h, g, d in HEADS},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"varlen-grid-{device.split()[1].lower() if ' ' in device else 'gpu'}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["models"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
