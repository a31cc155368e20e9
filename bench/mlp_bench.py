"""The LoRA gated MLP on one GPU: the fused op (gpu_kernels.ops.lora_mlp, its backward folding the
LoRA reductions into the activation's) against the composed ops it replaces (two LoRA ops and
swiglu_packed), at the MLP shapes of the families' benchmark presets, in one invocation.

Per shape and path: forward + backward time (CUDA events, median of repeats), the backward alone,
and the bytes the forward keeps for the backward (saved-tensor hooks). bf16 base, rank-16 fp32
factors, activation by family; rows = a packed step's tokens (4 × 2,048).

    python bench/mlp_bench.py --out bench/results/mlp-h100-<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# preset: (hidden K, intermediate F, activation)
SHAPES: dict[str, tuple[int, int, str]] = {
    "gemma-3-1b": (1152, 6912, "gelu_tanh"),
    "llama-3.2-1b": (2048, 8192, "silu"),
    "qwen3-1.7b": (2048, 6144, "silu"),
    "gemma-3-4b": (2560, 10240, "gelu_tanh"),
    "llama-3.1-8b": (4096, 14336, "silu"),
}


def run_shape(name: str, rows: int, repeats: int) -> dict[str, Any]:
    import torch

    import gpu_kernels

    k, f, act = SHAPES[name]
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16).requires_grad_()
    w_gu = (torch.randn(2 * f, k, device=dev) * k**-0.5).to(torch.bfloat16)
    w_d = (torch.randn(k, f, device=dev) * f**-0.5).to(torch.bfloat16)

    def factor(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * 0.02).requires_grad_()

    a_g, b_g, a_u, b_u, a_d, b_d = (
        factor(16, k),
        factor(f, 16),
        factor(16, k),
        factor(f, 16),
        factor(16, f),
        factor(k, 16),
    )
    dy = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)

    gate_up = gpu_kernels.LoRAOp(w_gu, None, [(a_g, b_g, 2.0), (a_u, b_u, 2.0)])
    down = gpu_kernels.LoRAOp(w_d, None, [(a_d, b_d, 2.0)])

    def step(fused: bool) -> torch.Tensor:
        if fused:
            return gpu_kernels.lora_gated_mlp(x, gate_up, down, act, training=True)  # type: ignore[arg-type]
        # what lora_gated_mlp composes where the fused op does not serve
        return down(gpu_kernels.swiglu_packed(gate_up(x, True), act), True)  # type: ignore[arg-type]

    out: dict[str, Any] = {"model": name, "rows": rows, "hidden": k, "intermediate": f, "activation": act}
    for label, fused in (("composed", False), ("fused", True)):
        y = step(fused)
        want = "LoRAGatedMLPFunctionBackward"
        assert (type(y.grad_fn).__name__ == want) == fused, type(y.grad_fn).__name__
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step(fused)
        total, backward = [], []
        for i in range(repeats + 3):
            x.grad = None
            s0, s1, s2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            s0.record()
            y = step(fused)
            s1.record()
            y.backward(dy)
            s2.record()
            torch.cuda.synchronize()
            if i >= 3:
                total.append(s0.elapsed_time(s2))
                backward.append(s1.elapsed_time(s2))
        out[label] = {
            "fwd_bwd_ms": round(statistics.median(total), 3),
            "bwd_ms": round(statistics.median(backward), 3),
            "saved_mib": round(sum(saved.values()) / 2**20, 1),
        }
    c, fz = out["composed"], out["fused"]
    out["speedup_fwd_bwd"] = round(c["fwd_bwd_ms"] / fz["fwd_bwd_ms"], 3)
    out["speedup_bwd"] = round(c["bwd_ms"] / fz["bwd_ms"], 3)
    out["saved_mib_less"] = round(c["saved_mib"] - fz["saved_mib"], 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    rows = [run_shape(name, args.rows, args.repeats) for name in args.shapes.split(",")]
    for r in rows:
        c, fz = r["composed"], r["fused"]
        print(
            f"{r['model']:<14} composed {c['fwd_bwd_ms']:7.3f} ms (bwd {c['bwd_ms']:6.3f}) "
            f"fused {fz['fwd_bwd_ms']:7.3f} ms (bwd {fz['bwd_ms']:6.3f})  x{r['speedup_fwd_bwd']} "
            f"saved -{r['saved_mib_less']} MiB"
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python3 bench/mlp_bench.py " + " ".join(sys.argv[1:]),
        "versions": {"torch": torch.__version__},
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
