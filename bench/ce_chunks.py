"""The fused LM head + cross-entropy (gpu_kernels.fused_linear_cross_entropy) at each preset's
head shape, forward + backward, for several chunk sizes.

Each chunk writes its (c, V) logits, the cross-entropy kernel overwrites them with the logits'
gradient, and a GEMM reads them back for dh: about 6·c·V bytes pass through memory per chunk.
Small chunks can keep them in the GPU's L2 cache (50 MB on an H100), at the price of smaller
GEMMs. This measures where the balance lies, per head shape (M trained positions, width d,
vocabulary V), and what the automatic choice (`chunk_rows=None`) gives.

Usage: python bench/ce_chunks.py [--out FILE]   (CUDA only)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.varlen_grid import time_ms  # noqa: E402

# (preset, trained positions per micro-batch M, width d, vocabulary V): M as the job step's
# loss_tokens bound on bench/data/chat-longtail.jsonl (4 x 2048 rows; llama-8b 2 x 2048)
SHAPES = (
    ("smollm2-135m", 5176, 576, 49152),
    ("llama-1b", 5176, 2048, 128256),
    ("llama-8b", 2592, 4096, 128256),
)
CHUNKS = (128, 256, 384, 512, 768, 1024, 2048, 4096)


def one_shape(m: int, d: int, v: int) -> dict[str, Any]:
    """fwd + bwd ms per chunk size (and the automatic choice, key "None") at one head shape,
    with each variant's largest hidden-gradient difference from the first's."""
    import torch

    from gpu_kernels.ops import cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(m, d, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(v, d, device="cuda", generator=g) * d**-0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (m,), device="cuda", generator=g)
    targets[-m // 10 :] = -100  # the padded tail of the bound
    scale = torch.tensor(1.0 / m, device="cuda")
    ms: dict[str, float] = {}
    diff: dict[str, float] = {}
    ref: torch.Tensor | None = None
    for chunk in (*CHUNKS, None):

        def step(chunk: int | None = chunk) -> torch.Tensor:
            hidden.grad = None
            loss = cross_entropy.fused_linear_cross_entropy(
                hidden, weight, targets, chunk_rows=chunk, scale=scale
            )
            loss.backward()
            assert hidden.grad is not None
            return hidden.grad

        grad = step().float()
        ref = grad if ref is None else ref
        diff[str(chunk)] = float((grad - ref).abs().max())
        ms[str(chunk)] = round(time_ms(step), 4)
    return {
        "ms": ms,
        "max_grad_diff": diff,
        "auto_chunk_rows": cross_entropy.auto_chunk_rows(v, torch.bfloat16, m),
        "best": min(ms, key=lambda k: ms[k]),
    }


def sweep() -> list[dict[str, Any]]:
    import gpu_kernels

    gpu_kernels.require_compiled()
    rows = []
    for preset, m, d, v in SHAPES:
        row = {"preset": preset, "M": m, "d": d, "V": v, **one_shape(m, d, v)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    import torch

    result = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/ce_chunks.py",
        "torch": torch.__version__,
        "rows": sweep(),
    }
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
