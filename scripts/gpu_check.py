"""Op micro-benchmarks for gpu_kernels on a CUDA host: each compiled op against eager torch.

    python scripts/gpu_check.py bench [--json PATH]

Measuring only: the correctness of every op (forward and backward against its reference, fp32
and bf16) and of the training paths is `pytest -m gpu tests/gpu_kernels`, which
scripts/gpu_check.sh runs first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_kernels
from bench.train_bench import git_commit
from tests.gpu_kernels.oracle import rope_tables
from worker.engine.versions import package_versions
from worker.kernels import configure_kernels

# ----------------------------------------------------------------------------------- timings


def time_ms(fn: Callable[[], Any], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def backward_of(fn: Callable[[], torch.Tensor], grad: torch.Tensor) -> Callable[[], None]:
    """`fn().backward(grad)` as a callable to time, bound to this `fn` and `grad`."""
    return lambda: fn().backward(grad)


def ceilings() -> dict[str, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b)
    src = torch.randn(512 * 1024 * 1024 // 4, device="cuda")
    dst = torch.empty_like(src)
    ms_copy = time_ms(lambda: dst.copy_(src))
    return {"bf16_matmul_tflops": 2 * 8192**3 / ms / 1e9, "copy_tb_s": 2 * src.numel() * 4 / ms_copy / 1e9}


def bench_ops() -> list[dict[str, Any]]:
    from gpu_kernels.ops import clip, cross_entropy, lora, norm_act

    rows: list[dict[str, Any]] = []
    bf = torch.bfloat16

    def add(name: str, ours: Callable[[], Any], ref: Callable[[], Any]) -> None:
        t_ours, t_ref = time_ms(ours), time_ms(ref)
        rows.append(
            {
                "op": name,
                "ours_ms": round(t_ours, 4),
                "torch_ms": round(t_ref, 4),
                "speedup": round(t_ref / t_ours, 2),
            }
        )
        print(
            f"{name:<44} ours {t_ours:8.3f} ms   torch {t_ref:8.3f} ms   x{t_ref / t_ours:5.2f}", flush=True
        )

    # the rank update alone: ours vs cuBLAS GEMM with beta = 1 (in place), + effective bandwidth
    for m_, n_, r_ in [
        (8192, 2048, 16),
        (8192, 8192, 16),
        (8192, 2048, 48),
        (8192, 576, 16),
        (4096, 14336, 16),
    ]:
        out = torch.randn(m_, n_, device="cuda", dtype=bf)
        u = torch.randn(m_, r_, device="cuda", dtype=bf)
        v = torch.randn(r_, n_, device="cuda")
        vb = v.to(bf)
        t_ours = time_ms(partial(lora.rank_update_, out, 0, n_, u, 0, r_, v, 0.5))
        t_blas = time_ms(partial(out.addmm_, u, vb, alpha=0.5))
        gbs = 2 * out.numel() * 2 / t_ours / 1e6
        rows.append(
            {
                "op": f"rank update M{m_} N{n_} R{r_}",
                "ours_ms": round(t_ours, 4),
                "cublas_ms": round(t_blas, 4),
                "ours_GB_s": round(gbs),
            }
        )
        print(
            f"rank update M{m_} N{n_} R{r_}: ours {t_ours * 1e3:7.1f} us ({gbs:5.0f} GB/s)  "
            f"cuBLAS addmm_ {t_blas * 1e3:7.1f} us",
            flush=True,
        )
    m = 8192  # llama-1b 4x2048 tokens
    for k, n, label in [(2048, 2048, "q/o"), (2048, 8192, "gate/up"), (8192, 2048, "down")]:
        x = torch.randn(m, k, device="cuda", dtype=bf, requires_grad=True)
        w = torch.randn(n, k, device="cuda", dtype=bf) * k**-0.5
        a = (torch.randn(16, k, device="cuda") * k**-0.5).requires_grad_()
        b = torch.randn(n, 16, device="cuda").requires_grad_()
        gy = torch.randn(m, n, device="cuda", dtype=bf)

        def peft_like(
            x: torch.Tensor = x, w: torch.Tensor = w, a: torch.Tensor = a, b: torch.Tensor = b
        ) -> torch.Tensor:
            # what HF+PEFT runs under bf16 autocast: base + B(A(x)) * s with full-size temporaries
            with torch.autocast("cuda", dtype=bf):
                return (
                    torch.nn.functional.linear(x, w)
                    + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * 2.0
                )

        add(
            f"lora fwd M{m} K{k} N{n} ({label})",
            partial(lora.lora_linear, x, w, None, a, b, 2.0),
            peft_like,
        )
        add(
            f"lora fwd+bwd M{m} K{k} N{n} ({label})",
            backward_of(partial(lora.lora_linear, x, w, None, a, b, 2.0), gy),
            backward_of(peft_like, gy),
        )
    x = torch.randn(m, 2048, device="cuda", dtype=bf, requires_grad=True)
    w = torch.randn(3072, 2048, device="cuda", dtype=bf) * 0.02
    ads = [
        (
            torch.randn(16, 2048, device="cuda").requires_grad_(),
            torch.randn(n, 16, device="cuda").requires_grad_(),
            2.0,
        )
        for n in (2048, 512, 512)
    ]
    gy = torch.randn(m, 3072, device="cuda", dtype=bf)
    ws = w.split([2048, 512, 512])
    add(
        "qkv grouped fwd+bwd vs 3 separate",
        lambda: lora.lora_linear_grouped(x, w, None, ads).backward(gy),
        lambda: torch.cat(
            [lora.lora_linear(x, wi, None, a, b, s) for wi, (a, b, s) in zip(ws, ads, strict=True)], -1
        ).backward(gy),
    )
    xn = torch.randn(m, 2048, device="cuda", dtype=bf, requires_grad=True)
    wn = torch.ones(2048, device="cuda", dtype=bf)
    gyn = torch.randn(m, 2048, device="cuda", dtype=bf)

    def hf_rms(x: torch.Tensor = xn) -> torch.Tensor:
        xf = x.float()
        return wn * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(bf)

    add(
        "rms_norm fwd+bwd M8192 D2048",
        lambda: norm_act.rms_norm(xn, wn, 1e-5).backward(gyn),
        lambda: hf_rms().backward(gyn),
    )
    gu = torch.randn(m, 16384, device="cuda", dtype=bf, requires_grad=True)
    gyh = torch.randn(m, 8192, device="cuda", dtype=bf)
    add(
        "swiglu_packed fwd+bwd M8192 F8192",
        lambda: norm_act.swiglu_packed(gu).backward(gyh),
        lambda: (torch.nn.functional.silu(gu[:, :8192]) * gu[:, 8192:]).backward(gyh),
    )
    h = torch.randn(m, 2048, device="cuda", dtype=bf, requires_grad=True)
    wv = torch.randn(128256, 2048, device="cuda", dtype=bf) * 0.02
    t = torch.randint(0, 128256, (m,), device="cuda")
    add(
        "linear+CE fwd+bwd N8192 d2048 V128256",
        lambda: cross_entropy.fused_linear_cross_entropy(h, wv, t).backward(),
        lambda: torch.nn.functional.cross_entropy((h @ wv.t()).float(), t).backward(),
    )
    bench_attention(add, rows)
    bench_quantized(rows)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cross_entropy.fused_linear_cross_entropy(h, wv, t).backward()
    ours_mem = (torch.cuda.max_memory_allocated() - base) / 2**30
    torch.cuda.reset_peak_memory_stats()
    torch.nn.functional.cross_entropy((h @ wv.t()).float(), t).backward()
    ref_mem = (torch.cuda.max_memory_allocated() - base) / 2**30
    rows.append({"op": "linear+CE extra peak GiB", "ours": round(ours_mem, 2), "torch": round(ref_mem, 2)})
    print(f"linear+CE extra peak memory: ours {ours_mem:.2f} GiB, torch {ref_mem:.2f} GiB")
    grads = [
        torch.randn(s, device="cuda")
        for s in [16 * 2048, 2048 * 16, 16 * 2048, 512 * 16, 16 * 8192, 8192 * 16] * 16 * 2
    ]
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    add(
        f"clip_grad_norm_ {len(grads)} fp32 grads",
        lambda: clip.clip_grad_norm_(grads, 1e9),
        lambda: torch.nn.utils.clip_grad_norm_(params, 1e9, foreach=True),
    )
    return rows


def _dense_step(w: torch.Tensor, x: torch.Tensor, gy: torch.Tensor) -> None:
    (x @ w.t()).backward(gy)


def _quantized_step(w: Any, x: torch.Tensor, gy: torch.Tensor) -> None:
    w.matmul(x).backward(gy)


def bench_quantized(rows: list[dict[str, Any]]) -> None:
    """The frozen-base GEMM of an 8B layer at 2,048 tokens (a micro-batch of one row), forward +
    input gradient: NF4 and int8 tiles dequantized by the compiled kernel (ours) against the same
    op with the torch tiles (backend "reference": what ran before csrc/quant.cu) and the dense
    bf16 GEMM it stands in for (its floor)."""
    from gpu_kernels.quant import quantize_int8, quantize_nf4

    bf = torch.bfloat16
    for n, k, label in [(4096, 4096, "q"), (28672, 4096, "gate+up"), (4096, 14336, "down")]:
        dense = torch.randn(n, k, device="cuda", dtype=bf) * k**-0.5
        x = torch.randn(2048, k, device="cuda", dtype=bf, requires_grad=True)
        gy = torch.randn(2048, n, device="cuda", dtype=bf)
        t_dense = time_ms(partial(_dense_step, dense, x, gy))
        for name, weight in [("nf4", quantize_nf4(dense)), ("nf4-dq", quantize_nf4(dense, double_quant=True)),
                             ("int8", quantize_int8(dense))]:  # fmt: skip
            step = partial(_quantized_step, weight, x, gy)
            t_ours = time_ms(step)
            gpu_kernels.set_backend("reference")
            try:
                t_torch = time_ms(step)
            finally:
                gpu_kernels.set_backend("auto")
            op = f"{name} GEMM fwd+dx {label} M2048 N{n} K{k}"
            rows.append(
                {
                    "op": op,
                    "ours_ms": round(t_ours, 4),
                    "torch_tiles_ms": round(t_torch, 4),
                    "dense_bf16_ms": round(t_dense, 4),
                    "speedup": round(t_torch / t_ours, 2),
                    "vs_dense": round(t_ours / t_dense, 2),
                }
            )
            print(
                f"{op:<48} ours {t_ours:8.3f} ms   torch tiles {t_torch:8.3f} ms   dense {t_dense:8.3f} ms",
                flush=True,
            )
        del dense


def _rope_attention_ours(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv: int
) -> torch.Tensor:
    """The fused module's order: rope_qkv splits and rotates (B, S, (H + 2G)·D) in one kernel."""
    from gpu_kernels.ops import rope

    b, s = qkv.shape[:2]
    q, k, v = rope.rope_qkv(qkv, cos, sin, heads, kv)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(b, s, -1)


def _rope_attention_hf(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv: int
) -> torch.Tensor:
    """Hugging Face's order: view, split, transpose, then apply_rotary_pos_emb on q and k."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, s, d = *qkv.shape[:2], cos.shape[-1]
    q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, -1, d).split([heads, kv, kv], dim=2))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(b, s, -1).contiguous()


def bench_attention(
    add: Callable[[str, Callable[[], Any], Callable[[], Any]], None], rows: list[Any]
) -> None:
    """RoPE split + attention fwd+bwd as the fused module runs it vs Hugging Face's sequence, and
    SDPA's backends on the benchmark presets' attention shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from gpu_kernels.ops import rope

    bf = torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for b, s, heads, kv, d in [(8, 1024, 9, 3, 64), (4, 2048, 32, 8, 64), (2, 2048, 32, 8, 128)]:
        qkv = torch.randn(b, s, (heads + 2 * kv) * d, device="cuda", dtype=bf, requires_grad=True)
        cos, sin = rope_tables(b, s, d, bf)
        gy = torch.randn(b, s, heads * d, device="cuda", dtype=bf)

        ours = partial(_rope_attention_ours, qkv, cos, sin, heads, kv)
        hf = partial(_rope_attention_hf, qkv, cos, sin, heads, kv)
        label = f"B{b} S{s} H{heads} G{kv} D{d}"
        add(f"rope+sdpa fwd+bwd {label}", backward_of(ours, gy), backward_of(hf, gy))
        outs = rope.rope_qkv(qkv, cos, sin, heads, kv)
        for layout in ("BSHD", "BHSD"):  # the gradients' memory order as attention hands them back
            gs = [
                torch.randn(b, s, t.shape[1], d, device="cuda", dtype=bf).transpose(1, 2)
                if layout == "BSHD"
                else torch.randn(b, t.shape[1], s, d, device="cuda", dtype=bf)
                for t in outs
            ]
            ms = time_ms(partial(torch.autograd.backward, outs, gs, retain_graph=True))
            gbs = 2 * qkv.numel() * 2 / ms / 1e6  # read the grads once, write dqkv once
            rows.append({"op": f"rope bwd {layout} grads {label}", "ms": round(ms, 4), "GB_s": round(gbs)})
            print(f"rope bwd alone, {layout} grads {label}: {ms * 1e3:.1f} us ({gbs:.0f} GB/s)", flush=True)
        q = torch.randn(b, s, heads, d, device="cuda", dtype=bf).transpose(1, 2).requires_grad_()
        k = torch.randn(b, s, kv, d, device="cuda", dtype=bf).transpose(1, 2).requires_grad_()
        v = torch.randn(b, s, kv, d, device="cuda", dtype=bf).transpose(1, 2).requires_grad_()
        go = torch.randn(b, heads, s, d, device="cuda", dtype=bf)
        backends = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
        for backend in backends:

            def run(
                backend: SDPBackend = backend,
                q: torch.Tensor = q,
                k: torch.Tensor = k,
                v: torch.Tensor = v,
                go: torch.Tensor = go,
            ) -> None:
                with sdpa_kernel(backend):
                    o = sdpa(q, k, v, is_causal=True, enable_gqa=True)
                o.backward(go)

            try:
                ms = time_ms(run)
            except RuntimeError as exc:
                print(f"sdpa {backend.name} {label}: unavailable ({str(exc)[:80]})")
                continue
            rows.append({"op": f"sdpa fwd+bwd {backend.name} {label}", "ms": round(ms, 4)})
            print(f"sdpa fwd+bwd {backend.name:<20} {label}: {ms:.3f} ms", flush=True)


# -------------------------------------------------------------------------------------- main


def header() -> dict[str, Any]:
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "versions": package_versions(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
        "kernels": gpu_kernels.available().__dict__,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["bench"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    configure_kernels()  # LORAQ_KERNEL_CACHE and LORAQ_RANK_UPDATE, as a worker applies them
    t0 = time.time()
    gpu_kernels.require_compiled()
    out: dict[str, Any] = header()
    out["build_s"] = round(time.time() - t0, 1)
    print(json.dumps(out), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    out["ceilings"] = ceilings()
    print(json.dumps(out["ceilings"]), flush=True)
    out["ops"] = bench_ops()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
