"""GPU correctness check (and op micro-benchmarks) for gpu_kernels; run on a CUDA host.

    python scripts/gpu_check.py ops            # every op + gradients vs a float64 reference
    python scripts/gpu_check.py ops --small    # tiny shapes (for compute-sanitizer)
    python scripts/gpu_check.py bench          # op timings: compiled vs the torch reference
    python scripts/gpu_check.py train          # tiny-llama 50 steps, compiled vs reference path

Error measure: ‖out − ref‖_F / ‖ref‖_F against a float64 reference on the same inputs (fresh
random inputs per check, outputs' memory poisoned with NaN first). Bounds per dtype: fp32 (TF32
off) 1e-4; bf16 2e-2 for outputs and gradients (bf16 operands land between 1e-3 and 1e-2; the
gradients pass through two bf16 roundings). Also required: the compiled error is at most twice
the error of the same-dtype torch reference + the bound's 10%, so a kernel can be no sloppier
than eager torch. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_kernels
from gpu_kernels import reference
from service.settings import get_settings
from worker.engine.versions import package_versions
from worker.kernels import configure_kernels

BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
RESULTS: list[dict[str, Any]] = []
TAG = ""  # appended to op names (which rank-update path a LoRA check ran on)
FAILED: list[str] = []


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a64, r64 = a.detach().double(), ref.detach().double()
    if not torch.isfinite(a64).all():
        return math.inf
    denom = r64.norm().item()
    return (a64 - r64).norm().item() / (denom if denom > 0 else 1.0)


def poison() -> None:
    """Fill recently freed allocator blocks with NaN so an unwritten output shows up."""
    blob = torch.full((64 * 1024 * 1024,), float("nan"), dtype=torch.float32, device="cuda")
    del blob


def record(
    name: str, dtype: torch.dtype, shape: str, errs: dict[str, float], ref_errs: dict[str, float]
) -> None:
    name = name + TAG
    bound = BOUNDS[dtype]
    ok = True
    for k, e in errs.items():
        allowed = max(bound, 2 * ref_errs.get(k, 0.0) + 0.1 * bound)
        if not (e <= allowed):
            ok = False
    row = {"op": name, "dtype": str(dtype).removeprefix("torch."), "shape": shape, "bound": bound, "ok": ok}
    row.update({f"err_{k}": float(f"{v:.3e}") for k, v in errs.items()})
    row.update({f"ref_err_{k}": float(f"{v:.3e}") for k, v in ref_errs.items()})
    RESULTS.append(row)
    flag = "ok  " if ok else "FAIL"
    errs_s = " ".join(f"{k}={v:.2e}(ref {ref_errs.get(k, 0):.1e})" for k, v in errs.items())
    print(f"{flag} {name:<22} {row['dtype']:<9} {shape:<28} {errs_s}", flush=True)
    if not ok:
        FAILED.append(f"{name} {row['dtype']} {shape}")


def grads_of(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], gy: torch.Tensor | None
) -> list[Any]:
    xs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*xs)
    if gy is None:
        out.backward()
    else:
        out.backward(gy.to(out.dtype))
    return [out.detach(), *[x.grad for x in xs if x.requires_grad]]


def compare(name: str, dtype: torch.dtype, shape: str, fn_ours, fn_ref, inputs, gy, names) -> None:  # type: ignore[no-untyped-def]
    poison()
    ours = grads_of(fn_ours, inputs, gy)
    same = grads_of(fn_ref, inputs, gy)
    inputs64 = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    gold = grads_of(fn_ref, inputs64, gy.double() if gy is not None else None)
    errs = {n: rel(o, g) for n, o, g in zip(names, ours, gold, strict=True)}
    ref_errs = {n: rel(s, g) for n, s, g in zip(names, same, gold, strict=True)}
    record(name, dtype, shape, errs, ref_errs)


def randn(*shape: int, dtype: torch.dtype, grad: bool = False, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(dtype).requires_grad_(grad)


# ---------------------------------------------------------------------------------------- ops


def check_lora(dtype: torch.dtype, small: bool) -> None:
    from gpu_kernels.ops import lora as lora_ops

    shapes = [(1, 7, 5, 1), (37, 129, 67, 3), (4, 33, 1000, 16)]
    if not small:
        shapes += [(1000, 2048, 512, 16), (2048, 576, 1536, 16), (517, 1031, 263, 64), (64, 256, 130, 200)]
    for m, k, n, r in shapes:
        x = randn(m, k, dtype=dtype, grad=True)
        w = randn(n, k, dtype=dtype, scale=k**-0.5)
        a = randn(r, k, dtype=torch.float32, grad=True, scale=k**-0.5)
        b = randn(n, r, dtype=torch.float32, grad=True, scale=0.5)
        gy = torch.randn(m, n, device="cuda")

        def ours(x, w, a, b):  # type: ignore[no-untyped-def]
            return lora_ops.lora_linear(x, w, None, a, b, 2.0)

        def ref(x, w, a, b):  # type: ignore[no-untyped-def]
            return reference.lora_linear(x, w, None, a.to(x.dtype), b.to(x.dtype), 2.0)

        compare(
            "lora_linear", dtype, f"M{m} K{k} N{n} r{r}", ours, ref, [x, w, a, b], gy, ["y", "dx", "dA", "dB"]
        )
    # 3-d input with a bias
    x = randn(2, 9, 40, dtype=dtype, grad=True)
    w = randn(24, 40, dtype=dtype, scale=0.2)
    bias = randn(24, dtype=dtype)
    a = randn(8, 40, dtype=torch.float32, grad=True, scale=0.2)
    b = randn(24, 8, dtype=torch.float32, grad=True)
    compare(
        "lora_linear+bias 3d", dtype, "B2 S9 K40 N24 r8",
        lambda x, a, b: lora_ops.lora_linear(x, w, bias, a, b, 0.5),
        lambda x, a, b: reference.lora_linear(
            x, w.to(x.dtype), bias.to(x.dtype), a.to(x.dtype), b.to(x.dtype), 0.5
        ),
        [x, a, b], torch.randn(2, 9, 24, device="cuda"), ["y", "dx", "dA", "dB"],
    )  # fmt: skip
    # grouped q/k/v-like: widths 96/33/33, ranks 8/4/16, different scales
    m, k = (300, 257) if not small else (17, 40)
    widths, ranks, scales = [96, 33, 33], [8, 4, 16], [2.0, 1.0, 0.25]
    x = randn(m, k, dtype=dtype, grad=True)
    w = randn(sum(widths), k, dtype=dtype, scale=k**-0.5)
    ads = []
    for n, r in zip(widths, ranks, strict=True):
        ads += [
            randn(r, k, dtype=torch.float32, grad=True, scale=k**-0.5),
            randn(n, r, dtype=torch.float32, grad=True),
        ]

    def g_ours(x, *ab):  # type: ignore[no-untyped-def]
        adapters = [(ab[2 * i], ab[2 * i + 1], scales[i]) for i in range(3)]
        return lora_ops.lora_linear_grouped(x, w, None, adapters)

    def g_ref(x, *ab):  # type: ignore[no-untyped-def]
        adapters = [(ab[2 * i].to(x.dtype), ab[2 * i + 1].to(x.dtype), scales[i]) for i in range(3)]
        return reference.lora_linear_grouped(x, w.to(x.dtype), None, adapters)

    names = ["y", "dx", "dA1", "dB1", "dA2", "dB2", "dA3", "dB3"]
    compare(
        "lora_linear_grouped",
        dtype,
        f"M{m} K{k} N96+33+33",
        g_ours,
        g_ref,
        [x, *ads],
        torch.randn(m, 162, device="cuda"),
        names,
    )
    # dropout: the compiled mask is reproduced exactly by reference.hash_dropout
    p = 0.25
    x = randn(70, 130, dtype=dtype, grad=True)
    seed = lora_ops.dropout_seed(x.device)
    seed.fill_(1234)
    out = lora_ops.dropout(x.detach().contiguous(), p, seed, 99)
    expect = reference.hash_dropout(x.detach(), p, 1234, 99)
    kept = (out != 0).float().mean().item()
    same = torch.equal(out, expect)
    RESULTS.append({"op": "dropout mask", "dtype": str(dtype), "exact": same, "kept": kept})
    print(
        f"{'ok  ' if same and abs(kept - (1 - p)) < 0.03 else 'FAIL'} dropout mask "
        f"exact={same} kept={kept:.3f}"
    )
    if not (same and abs(kept - (1 - p)) < 0.03):
        FAILED.append(f"dropout mask {dtype}")
    # LoRA with dropout: forward/backward against the reference fed the same masked input
    w = randn(50, 130, dtype=dtype, scale=0.1)
    a = randn(8, 130, dtype=torch.float32, grad=True, scale=0.1)
    b = randn(50, 8, dtype=torch.float32, grad=True)
    lora_ops._salts = itertools.count(777)

    def d_ours(x, a, b):  # type: ignore[no-untyped-def]
        return lora_ops.lora_linear(x, w, None, a, b, 2.0, p, True)

    def d_ref(x, a, b):  # type: ignore[no-untyped-def]
        xd = reference.hash_dropout(x, p, 1234, 777)
        y = torch.nn.functional.linear(x, w.to(x.dtype))
        return y + 2.0 * torch.nn.functional.linear(
            torch.nn.functional.linear(xd, a.to(x.dtype)), b.to(x.dtype)
        )

    poison()
    gy = torch.randn(70, 50, device="cuda")
    lora_ops._salts = itertools.count(777)
    ours_out = grads_of(d_ours, [x, a, b], gy)
    gold = grads_of(d_ref, [t.detach().double().requires_grad_() for t in (x, a, b)], gy.double())
    same_dtype = grads_of(d_ref, [x, a, b], gy)
    names = ["y", "dx", "dA", "dB"]
    record(
        "lora_linear dropout", dtype, "M70 K130 N50 r8 p.25",
        {n: rel(o, g) for n, o, g in zip(names, ours_out, gold, strict=True)},
        {n: rel(o, g) for n, o, g in zip(names, same_dtype, gold, strict=True)},
    )  # fmt: skip


def check_lora_both(dtype: torch.dtype, small: bool) -> None:
    """check_lora with the LoRA term added by our rank-update kernel, by a cuBLAS rank update, and
    in the base GEMM's epilogue (the default)."""
    from gpu_kernels.ops import lora as lora_ops

    global TAG
    default = lora_ops._RANK_UPDATE
    try:
        for mode in ("kernel", "cublas", "epilogue"):
            lora_ops._RANK_UPDATE = mode
            TAG = f"[{mode}]"
            check_lora(dtype, small)
    finally:
        lora_ops._RANK_UPDATE = default
        TAG = ""


def check_norm_act(dtype: torch.dtype, small: bool) -> None:
    from gpu_kernels.ops import norm_act

    shapes = [(1, 7), (37, 576), (5, 4097)] + ([] if small else [(2048, 2048), (300, 8192)])
    for m, d in shapes:
        x = randn(m, d, dtype=dtype, grad=True, scale=3.0)
        w = (1 + 0.1 * torch.randn(d, device="cuda")).to(dtype)
        compare(
            "rms_norm", dtype, f"M{m} D{d}",
            lambda x, w=w: norm_act.rms_norm(x, w, 1e-5),
            lambda x, w=w: reference.rms_norm(x, w.to(x.dtype), 1e-5),
            [x], torch.randn(m, d, device="cuda"), ["y", "dx"],
        )  # fmt: skip
    for m, f in [(1, 3), (33, 1536), (7, 1001)] + ([] if small else [(4096, 8192)]):
        g = randn(m, f, dtype=dtype, grad=True, scale=2.0)
        u = randn(m, f, dtype=dtype, grad=True)
        gy = torch.randn(m, f, device="cuda")
        compare(
            "swiglu", dtype, f"M{m} F{f}", norm_act.swiglu, reference.swiglu, [g, u], gy, ["h", "dg", "du"]
        )
        gu = randn(m, 2 * f, dtype=dtype, grad=True, scale=2.0)
        compare(
            "swiglu_packed", dtype, f"M{m} 2F{2 * f}", norm_act.swiglu_packed, reference.swiglu_packed,
            [gu], gy, ["h", "dgu"],
        )  # fmt: skip
    # strided views of one (M, 2F) buffer, as the MLP's grouped gate/up produces them
    gu = randn(64, 200, dtype=dtype, grad=True)
    compare(
        "swiglu strided views", dtype, "M64 F100 (views)",
        lambda t: norm_act.swiglu(t[:, :100], t[:, 100:]), lambda t: reference.swiglu(t[:, :100], t[:, 100:]),
        [gu], torch.randn(64, 100, device="cuda"), ["h", "dgu"],
    )  # fmt: skip


def rope_tables(b: int, s: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-style cos/sin (b, s, d): positions times inverse frequencies, halves repeated."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    pos = torch.arange(s, device="cuda").float() + torch.randint(0, 50, (b, 1), device="cuda")
    ang = pos[..., None] * inv  # (b, s, d/2)
    return torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)


def check_rope(dtype: torch.dtype, small: bool) -> None:
    from gpu_kernels.ops import rope

    shapes = [(1, 1, 1, 1, 2), (2, 7, 6, 2, 10), (3, 33, 9, 3, 64), (1, 129, 32, 8, 128)]
    shapes += [] if small else [(8, 1024, 9, 3, 64), (2, 2048, 32, 8, 64)]
    for b, s, heads, kv, d in shapes:
        qkv = randn(b, s, (heads + 2 * kv) * d, dtype=dtype, grad=True)
        cos, sin = rope_tables(1 if b == 3 else b, s, d, dtype)  # b = 3: one table broadcast
        label = f"B{b} S{s} H{heads} G{kv} D{d}"

        def flat(fn, t, cos=cos, sin=sin, heads=heads, kv=kv):  # type: ignore[no-untyped-def]
            q, k, v = fn(t, cos.to(t.dtype), sin.to(t.dtype), heads, kv)
            return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])

        n_out = b * s * (heads + 2 * kv) * d
        compare(
            "rope_qkv", dtype, label, lambda t, flat=flat: flat(rope.rope_qkv, t),
            lambda t, flat=flat: flat(reference.rope_qkv, t), [qkv], torch.randn(n_out, device="cuda"),
            ["qkv_out", "dqkv"],
        )  # fmt: skip

        # as the fused attention uses it: the gradients arrive in SDPA's own strides
        def attend(fn, t, cos=cos, sin=sin, heads=heads, kv=kv):  # type: ignore[no-untyped-def]
            q, k, v = fn(t, cos.to(t.dtype), sin.to(t.dtype), heads, kv)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=heads != kv
            )

        compare(
            "rope_qkv + sdpa", dtype, label, lambda t, attend=attend: attend(rope.rope_qkv, t),
            lambda t, attend=attend: attend(reference.rope_qkv, t), [qkv],
            torch.randn(b, heads, s, d, device="cuda"), ["attn", "dqkv"],
        )  # fmt: skip


def check_varlen(dtype: torch.dtype, small: bool) -> None:
    """Variable-length causal attention (flash, GQA) vs one SDPA call per sequence, with
    zero-length padding sequences at the end of cu_seqlens as the packed step pads them."""
    from gpu_kernels.ops import varlen

    if dtype != torch.bfloat16:
        return  # flash attention takes 16-bit inputs only
    cases = [([5, 1, 17, 0], 4, 2, 16)] + ([] if small else [([300, 41, 700, 128, 513, 366], 32, 8, 64)])
    for lengths, heads, kv, d in cases:
        n = sum(lengths)
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        cu = torch.tensor([*offsets, n, n], dtype=torch.int32, device="cuda")
        q = randn(n, heads, d, dtype=dtype, grad=True)
        k, v = randn(n, kv, d, dtype=dtype, grad=True), randn(n, kv, d, dtype=dtype, grad=True)
        m = max(lengths)
        compare(
            "varlen_attention", dtype, f"N{n} K{len(lengths)} H{heads} G{kv} D{d}",
            lambda q, k, v, cu=cu, m=m: varlen.varlen_attention(q, k, v, cu, m),
            lambda q, k, v, cu=cu, m=m: reference.varlen_attention(q, k, v, cu, m), [q, k, v],
            torch.randn(n, heads, d, device="cuda"), ["out", "dq", "dk", "dv"],
        )  # fmt: skip


def check_cross_entropy(dtype: torch.dtype, small: bool) -> None:
    from gpu_kernels.ops import cross_entropy

    shapes = [(7, 33, 101), (300, 64, 1000)] + ([] if small else [(2500, 256, 49152), (1030, 512, 128256)])
    for n, d, v in shapes:
        h = randn(n, d, dtype=dtype, grad=True)
        w = randn(v, d, dtype=dtype, scale=d**-0.5 * 4)
        t = torch.randint(0, v, (n,), device="cuda")
        t[torch.rand(n, device="cuda") < 0.2] = -100
        compare(
            "fused_linear_ce", dtype, f"N{n} d{d} V{v}",
            lambda h, w=w, t=t: cross_entropy.fused_linear_cross_entropy(h, w, t, -100, 1024),
            lambda h, w=w, t=t: reference.fused_linear_cross_entropy(h, w.to(h.dtype), t),
            [h], None, ["loss", "dh"],
        )  # fmt: skip
    # every target ignored: loss 0 and zero gradient, like the reference
    h = randn(5, 16, dtype=dtype, grad=True)
    w = randn(40, 16, dtype=dtype)
    t = torch.full((5,), -100, device="cuda")
    loss = cross_entropy.fused_linear_cross_entropy(h, w, t)
    loss.backward()
    ok = loss.item() == 0.0 and h.grad is not None and h.grad.abs().sum().item() == 0.0
    print(f"{'ok  ' if ok else 'FAIL'} fused_linear_ce all-ignored loss={loss.item()}")
    if not ok:
        FAILED.append(f"fused_linear_ce all-ignored {dtype}")


def check_clip(small: bool) -> None:
    from gpu_kernels.ops import clip

    sizes_sets = [[1, 7, 16384, 16385, 100003], [3] * 700] + ([] if small else [[2048 * 16, 16 * 8192] * 112])
    for sizes in sizes_sets:
        for max_norm in (1e-3, 1e6):
            grads = [torch.randn(s, device="cuda") for s in sizes]
            before = [g.clone() for g in grads]
            gold = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))  # type: ignore[arg-type]
            state = reference.new_nonfinite_state("cuda")
            norm = clip.clip_grad_norm_(grads, max_norm, state)
            coef = min(1.0, max_norm / (gold.item() + 1e-6))
            err_norm = abs(norm.item() - gold.item()) / gold.item()
            err_g = max(rel(g, b.double() * coef) for g, b in zip(grads, before, strict=True))
            untouched = max_norm < 1e5 or all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))
            ok = err_norm < 1e-5 and err_g < 1e-6 and untouched and state.tolist() == [0, 1]
            label = f"{len(sizes)} tensors max_norm={max_norm:g}"
            RESULTS.append(
                {"op": "clip_grad_norm_", "shape": label, "err_norm": err_norm, "err_grads": err_g, "ok": ok}
            )
            print(
                f"{'ok  ' if ok else 'FAIL'} clip_grad_norm_        {label:<36} "
                f"norm err={err_norm:.1e} grads err={err_g:.1e}"
            )
            if not ok:
                FAILED.append(f"clip {label}")
    # non-finite: flagged with the step number, grads left unscaled, flag sticky
    grads = [torch.randn(100, device="cuda"), torch.randn(50, device="cuda")]
    state = reference.new_nonfinite_state("cuda")
    clip.clip_grad_norm_(grads, 1.0, state)
    grads[1][3] = float("inf")
    before = [g.clone() for g in grads]
    norm = clip.clip_grad_norm_(grads, 1.0, state)
    clip.clip_grad_norm_([torch.randn(10, device="cuda")], 1.0, state)
    ok = (not math.isfinite(norm.item())) and state.tolist() == [2, 3] and torch.equal(grads[0], before[0])
    print(f"{'ok  ' if ok else 'FAIL'} clip non-finite flag state={state.tolist()} norm={norm.item()}")
    if not ok:
        FAILED.append("clip non-finite")


def check_graph() -> None:
    """A LoRA layer + fused loss + clip + capturable AdamW: graphed steps equal eager steps."""
    torch.manual_seed(0)
    d, v, r = 64, 97, 8
    w = torch.randn(d, d, device="cuda") * 0.1
    head = torch.randn(v, d, device="cuda") * 0.1
    a0 = torch.randn(r, d, device="cuda") * 0.1
    b0 = torch.randn(d, r, device="cuda") * 0.1
    data = [
        (torch.randn(4, 16, d, device="cuda"), torch.randint(0, v, (4, 16), device="cuda")) for _ in range(8)
    ]

    def run(captured: bool) -> list[float]:
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        lr = torch.tensor(1e-2, device="cuda")
        opt = torch.optim.AdamW([a, b], lr=lr, fused=True, capturable=True)
        x_static = torch.zeros(4, 16, d, device="cuda")
        t_static = torch.zeros(4, 16, dtype=torch.int64, device="cuda")

        def step() -> dict[str, torch.Tensor]:
            opt.zero_grad(set_to_none=True)
            h = gpu_kernels.lora_linear(x_static, w, None, a, b, 2.0)
            loss = gpu_kernels.fused_linear_cross_entropy(torch.tanh(h), head, t_static)
            loss.backward()
            norm = gpu_kernels.clip_grad_norm_([a, b], 0.5)
            opt.step()
            return {"loss": loss.detach(), "norm": norm}

        graphed = gpu_kernels.GraphedStep(step, warmup=2, enabled=captured, keep_faster=False)
        losses = []
        for x, t in data:
            x_static.copy_(x)
            t_static.copy_(t)
            losses.append(graphed()["loss"].item())
        if captured and not graphed.captured:
            FAILED.append(f"graph capture fell back: {graphed.fallback_reason}")
        return losses

    eager, graphed = run(False), run(True)
    diff = max(abs(x - y) for x, y in zip(eager, graphed, strict=True))
    ok = diff < 1e-5 and not any("graph capture" in f for f in FAILED)
    RESULTS.append({"op": "graph step", "max_loss_diff": diff, "ok": ok})
    print(f"{'ok  ' if ok else 'FAIL'} graphed step == eager step over 8 steps: max |Δloss| = {diff:.2e}")
    if not ok:
        FAILED.append("graph step")


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
        t_ours = time_ms(
            lambda out=out, u=u, v=v, n_=n_, r_=r_: lora.rank_update_(out, 0, n_, u, 0, r_, v, 0.5)
        )
        t_blas = time_ms(lambda out=out, u=u, vb=vb: out.addmm_(u, vb, alpha=0.5))
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

        def peft_like(x=x, w=w, a=a, b=b):  # type: ignore[no-untyped-def]
            # what HF+PEFT runs under bf16 autocast: base + B(A(x)) * s with full-size temporaries
            with torch.autocast("cuda", dtype=bf):
                return (
                    torch.nn.functional.linear(x, w)
                    + torch.nn.functional.linear(torch.nn.functional.linear(x, a), b) * 2.0
                )

        add(
            f"lora fwd M{m} K{k} N{n} ({label})",
            lambda x=x, w=w, a=a, b=b: lora.lora_linear(x, w, None, a, b, 2.0),
            peft_like,
        )
        add(
            f"lora fwd+bwd M{m} K{k} N{n} ({label})",
            lambda x=x, w=w, a=a, b=b, gy=gy: lora.lora_linear(x, w, None, a, b, 2.0).backward(gy),
            lambda gy=gy, f=peft_like: f().backward(gy),
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

    def hf_rms(x=xn):  # type: ignore[no-untyped-def]
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


def bench_attention(
    add: Callable[[str, Callable[[], Any], Callable[[], Any]], None], rows: list[Any]
) -> None:
    """RoPE split + attention fwd+bwd as the fused module runs it vs Hugging Face's sequence, and
    SDPA's backends on the benchmark presets' attention shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from gpu_kernels.ops import rope

    bf = torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for b, s, heads, kv, d in [(8, 1024, 9, 3, 64), (4, 2048, 32, 8, 64), (2, 2048, 32, 8, 128)]:
        qkv = torch.randn(b, s, (heads + 2 * kv) * d, device="cuda", dtype=bf, requires_grad=True)
        cos, sin = rope_tables(b, s, d, bf)
        gy = torch.randn(b, s, heads * d, device="cuda", dtype=bf)

        def ours(qkv=qkv, cos=cos, sin=sin, heads=heads, kv=kv, b=b, s=s):  # type: ignore[no-untyped-def]
            q, k, v = rope.rope_qkv(qkv, cos, sin, heads, kv)
            o = sdpa(q, k, v, is_causal=True, enable_gqa=True)
            return o.transpose(1, 2).reshape(b, s, -1)

        def hf(qkv=qkv, cos=cos, sin=sin, heads=heads, kv=kv, b=b, s=s, d=d):  # type: ignore[no-untyped-def]
            q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, -1, d).split([heads, kv, kv], dim=2))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            o = sdpa(q, k, v, is_causal=True, enable_gqa=True)
            return o.transpose(1, 2).reshape(b, s, -1).contiguous()

        label = f"B{b} S{s} H{heads} G{kv} D{d}"
        add(f"rope+sdpa fwd+bwd {label}", lambda ours=ours, gy=gy: ours().backward(gy),
            lambda hf=hf, gy=gy: hf().backward(gy))  # fmt: skip
        outs = rope.rope_qkv(qkv, cos, sin, heads, kv)
        for layout in ("BSHD", "BHSD"):  # the gradients' memory order as attention hands them back
            gs = [
                torch.randn(b, s, t.shape[1], d, device="cuda", dtype=bf).transpose(1, 2)
                if layout == "BSHD"
                else torch.randn(b, t.shape[1], s, d, device="cuda", dtype=bf)
                for t in outs
            ]
            ms = time_ms(lambda outs=outs, gs=gs: torch.autograd.backward(outs, gs, retain_graph=True))
            gbs = 2 * qkv.numel() * 2 / ms / 1e6  # read the grads once, write dqkv once
            rows.append({"op": f"rope bwd {layout} grads {label}", "ms": round(ms, 4), "GB_s": round(gbs)})
            print(f"rope bwd alone, {layout} grads {label}: {ms * 1e3:.1f} us ({gbs:.0f} GB/s)", flush=True)
        q = torch.randn(b, s, heads, d, device="cuda", dtype=bf).transpose(1, 2).requires_grad_()
        k = torch.randn(b, s, kv, d, device="cuda", dtype=bf).transpose(1, 2).requires_grad_()
        v = torch.randn(b, s, kv, d, device="cuda", dtype=bf).transpose(1, 2).requires_grad_()
        go = torch.randn(b, heads, s, d, device="cuda", dtype=bf)
        backends = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
        for backend in backends:

            def run(backend=backend, q=q, k=k, v=v, go=go):  # type: ignore[no-untyped-def]
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


# ------------------------------------------------------------------------------------- train


def train_tiny(steps: int, dtype: torch.dtype) -> dict[str, Any]:
    """tiny-llama, same seed and data, compiled path (fused modules, captured step) vs the plain
    reference path on the same GPU; returns both loss curves."""
    import tempfile

    from worker.engine.fused_llama import fuse_llama
    from worker.engine.lora import apply_lora, trainable_parameters
    from worker.engine.models import load_base_model
    from worker.engine.train_step import CapturedTrainStep
    from worker.engine.types import LoraConfig

    curves: dict[str, list[float]] = {}
    info: dict[str, Any] = {}
    store = Path(tempfile.mkdtemp())
    for path in ("compiled", "reference"):
        gpu_kernels.set_backend("auto" if path == "compiled" else "reference")
        torch.manual_seed(0)
        loaded = load_base_model("tiny-llama", store=store, device="cuda", dtype=dtype)
        model = loaded.model
        torch.manual_seed(1)
        apply_lora(model, LoraConfig(r=8, alpha=16, dropout=0.0))
        report = fuse_llama(model)
        model.train()
        params = trainable_parameters(model)
        vocab = model.config.vocab_size
        reasons: list[str] = []
        step = CapturedTrainStep(
            model, params, batch=4, seq=64, lr=5e-3, capture=(path == "compiled"), on_fallback=reasons.append
        )
        g = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, min(vocab, 400), (4, 64), generator=g)
            # a learnable pattern: every other token repeats the previous one
            ids[:, 1::2] = ids[:, 0::2]
            out = step(ids.cuda(), ids.cuda(), 5e-3)
            losses.append(out["loss"].item())
        curves[path] = losses
        info[path] = {
            "fused": report.__dict__,
            "captured": step.graphed.captured,
            "fallback": reasons,
            "first_bad_step": step.monitor.first_bad_step(),
        }
    gpu_kernels.set_backend("auto")
    diffs = [
        abs(a - b) / max(abs(b), 1e-6) for a, b in zip(curves["compiled"], curves["reference"], strict=True)
    ]
    return {"dtype": str(dtype), "steps": steps, "curves": curves, "max_rel_diff": max(diffs), "info": info}


def pirate_config(steps: int, **overrides: Any) -> Any:
    """tiny-llama on the pirate chats, on the GPU, in a fresh temporary directory (a TrainConfig)."""
    import tempfile
    from dataclasses import replace

    from worker.engine.types import LoraConfig, TrainConfig

    tmp = Path(tempfile.mkdtemp())
    cfg = TrainConfig(
        model="tiny-llama",
        train_file=Path(__file__).resolve().parents[1] / "tests/data/pirate/train.jsonl",
        output_dir=tmp / "out",
        model_store=tmp / "store",
        lora=LoraConfig(r=8, alpha=16),
        max_steps=steps,
        learning_rate=2e-3,
        device="cuda",
    )
    return replace(cfg, **overrides)


def recipe_smoke(steps: int) -> dict[str, Any]:
    """The engine's recipe end to end on the GPU (fused modules + fused loss under its bf16
    autocast), against the same recipe on the reference path: final losses must agree."""
    from worker.engine.recipe import train
    from worker.engine.types import NullCallbacks

    out: dict[str, Any] = {}
    for path in ("compiled", "reference"):
        gpu_kernels.set_backend("auto" if path == "compiled" else "reference")
        result = train(pirate_config(steps, batch_size=4), NullCallbacks())
        out[path] = {"steps": result.steps, "final_train_loss": result.final_train_loss}
    gpu_kernels.set_backend("auto")
    a, b = out["compiled"]["final_train_loss"], out["reference"]["final_train_loss"]
    out["rel_diff"] = abs(a - b) / abs(b)
    return out


def multi_gpu_check(steps: int, n_gpus: int) -> dict[str, Any]:
    """The job path on n_gpus GPUs (torchrun, as a worker runs an n_gpus job) against one GPU:
    the same packed rows and global batch, so the same loss curve within bf16 tolerance; every
    rank takes the packed step captured as a CUDA graph with its NCCL all_reduce inside (no
    'runs eagerly' warning: a capture that fails anywhere sends every rank to eager and says so)."""
    from dataclasses import replace

    from worker.engine.distributed import run_torchrun
    from worker.engine.recipe import train
    from worker.engine.types import NullCallbacks, StepMetrics

    class Curve(NullCallbacks):
        def __init__(self) -> None:
            self.steps: list[StepMetrics] = []
            self.events: list[str] = []

        def on_step(self, metrics: StepMetrics) -> None:
            self.steps.append(metrics)

        def on_event(self, level: str, message: str, data: Any = None) -> None:
            self.events.append(message)

    cfg = pirate_config(steps, batch_size=4 * n_gpus, lr_scheduler="constant", pack=True)
    one, many = Curve(), Curve()
    train(cfg, one)
    many_dir = cfg.output_dir.parent / "many"
    run_torchrun(replace(cfg, output_dir=many_dir), many, n_gpus=n_gpus, workdir=many_dir / "torchrun")
    pairs = list(zip(one.steps, many.steps, strict=False))
    out: dict[str, Any] = {
        "n_gpus": n_gpus,
        "steps": [len(one.steps), len(many.steps)],
        "loss_1_gpu": [m.train_loss for m in one.steps],
        f"loss_{n_gpus}_gpus": [m.train_loss for m in many.steps],
        "loss_max_rel_diff": max(
            (abs(a.train_loss - b.train_loss) / abs(a.train_loss) for a, b in pairs), default=math.inf
        ),
        "same_tokens": all(a.tokens == b.tokens for a, b in pairs),
        "events": {"1_gpu": one.events, f"{n_gpus}_gpus": many.events},
    }
    captured = [
        any(e.startswith("Training step: fused kernels, CUDA graph") for e in c.events)
        and not any("runs eagerly" in e for e in c.events)
        for c in (one, many)
    ]
    out["captured"] = captured
    out["ok"] = bool(
        len(many.steps) == len(one.steps) == steps
        and out["same_tokens"]
        and out["loss_max_rel_diff"] <= 2e-2
        and all(captured)
    )
    return out


def packed_check(small: bool = False) -> dict[str, Any]:
    """The job path's packed step in bf16 on the compiled path: every example's loss and gradient
    inside a packed row vs the same example alone in a row (both through variable-length
    attention), a perturbation of one example leaving the others' losses unchanged, and the
    packed loss vs the float32 reference path (HF attention on the example alone)."""
    import tempfile

    from worker.engine.data import IGNORE_INDEX, Row, collate
    from worker.engine.fused_llama import PackedInputs, fuse_llama, packed_lm_loss
    from worker.engine.lora import apply_lora, trainable_parameters
    from worker.engine.models import load_base_model
    from worker.engine.train_step import StepShape, host_step
    from worker.engine.types import LoraConfig

    model_name = "tiny-llama" if small else "smollm2-135m"
    seq, lengths = (256, [30, 4, 70, 12, 51, 7]) if small else (2048, [300, 41, 700, 128, 513, 77])
    g = torch.Generator().manual_seed(5)
    exs = []
    for n in lengths:
        ids = torch.randint(3, 500, (n,), generator=g).tolist()
        exs.append((ids, [IGNORE_INDEX if t <= n // 2 else x for t, x in enumerate(ids)]))

    def row_of(items: list[tuple[list[int], list[int]]]) -> Row:
        r = Row([], [], [], [])
        for i, (ids, labels) in enumerate(items):
            r.input_ids += ids
            r.labels += labels
            r.position_ids += range(len(ids))
            r.lines.append(i + 1)
        return r

    torch.manual_seed(0)
    loaded = load_base_model(model_name, store=Path(tempfile.mkdtemp()), device="cuda", dtype=torch.bfloat16)
    model = loaded.model
    apply_lora(model, LoraConfig(r=16, alpha=32))
    for p in trainable_parameters(model):
        torch.nn.init.normal_(p, std=0.02)
    fuse_llama(model)
    params = trainable_parameters(model)
    shape = StepShape(1, 1, seq, 16, seq)

    def run(items: list[tuple[list[int], list[int]]], which: int | None) -> tuple[float, torch.Tensor]:
        host = host_step([collate([row_of(items)], 0, packed=True, pad_to=seq)], shape)
        targets = host.loss_targets.clone()
        if which is not None:  # keep only example `which`'s positions
            start = sum(len(e[0]) for e in items[:which])
            end = start + len(items[which][0]) - 1
            keep = (host.loss_index >= start) & (host.loss_index < end)
            targets[~keep] = IGNORE_INDEX
        inputs = PackedInputs(
            host.input_ids.cuda(), host.position_ids.cuda(), host.cu_seqlens.cuda(), seq,
            host.loss_index.cuda(), targets.cuda(), torch.ones((), device="cuda"),
        )  # fmt: skip
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = packed_lm_loss(model, inputs, 0)
        loss.backward()
        grads = torch.cat(
            [p.grad.flatten() if p.grad is not None else torch.zeros_like(p).flatten() for p in params]
        )
        return float(loss), grads

    rows = []
    perturbed = list(exs)
    perturbed[1] = ([(x * 7 + 11) % 497 + 3 for x in exs[1][0]], exs[1][1])
    for i in range(len(exs)):
        packed_loss, packed_grad = run(exs, i)
        alone_loss, alone_grad = run([exs[i]], 0)
        row = {
            "example": i,
            "tokens": lengths[i],
            "packed_loss": packed_loss,
            "alone_loss": alone_loss,
            "loss_rel": abs(packed_loss - alone_loss) / abs(alone_loss),
            "grad_rel": rel(packed_grad, alone_grad),
        }
        if i != 1:
            other, _ = run(perturbed, i)
            row["perturbed_rel"] = abs(other - packed_loss) / abs(packed_loss)
        rows.append(row)
    worst = {k: max(r.get(k, 0.0) for r in rows) for k in ("loss_rel", "grad_rel", "perturbed_rel")}
    ok = worst["loss_rel"] <= 1e-2 and worst["grad_rel"] <= 3e-2 and worst["perturbed_rel"] <= 1e-2
    return {"model": model_name, "seq": seq, "lengths": lengths, "examples": rows, "worst": worst, "ok": ok}


# -------------------------------------------------------------------------------------- main


def header() -> dict[str, Any]:
    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "versions": package_versions(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": get_settings().commit or "unknown",
        "kernels": gpu_kernels.available().__dict__,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["ops", "bench", "train", "recipe", "packed", "multi"])
    parser.add_argument("--n-gpus", type=int, default=2)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    configure_kernels()  # LORAQ_KERNEL_CACHE and LORAQ_RANK_UPDATE, as a worker applies them
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.time()
    gpu_kernels.require_compiled()
    out: dict[str, Any] = header()
    out["build_s"] = round(time.time() - t0, 1)
    print(json.dumps(out), flush=True)
    torch.manual_seed(int(time.time()))  # fresh inputs every run
    if args.what == "ops":
        checks: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        for dtype in (torch.float32, torch.bfloat16):
            checks += [(check_lora_both, (dtype, args.small)), (check_norm_act, (dtype, args.small))]
            checks += [(check_cross_entropy, (dtype, args.small)), (check_rope, (dtype, args.small))]
            checks.append((check_varlen, (dtype, args.small)))
        checks.append((check_clip, (args.small,)))
        if not args.small:
            checks.append((check_graph, ()))
        for fn, fn_args in checks:
            try:
                fn(*fn_args)
            except Exception as exc:  # report and go on: one broken op must not hide the others
                import traceback

                traceback.print_exc()
                FAILED.append(f"{fn.__name__}{fn_args}: {type(exc).__name__}: {exc}")
        out["checks"] = RESULTS
        out["failed"] = FAILED
    elif args.what == "bench":
        torch.backends.cuda.matmul.allow_tf32 = True
        out["ceilings"] = ceilings()
        print(json.dumps(out["ceilings"]), flush=True)
        out["ops"] = bench_ops()
    elif args.what == "packed":
        res = packed_check(args.small)
        if not res["ok"]:
            FAILED.append(f"packed per-example loss/grad or isolation off: {res['worst']}")
        print(
            f"{'ok  ' if res['ok'] else 'FAIL'} packed bf16 per-example vs alone: {json.dumps(res['worst'])}"
        )
        out["packed"] = res
        out["failed"] = FAILED
    elif args.what == "multi":
        if torch.cuda.device_count() < args.n_gpus:
            print(f"multi: needs {args.n_gpus} CUDA GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
            return 2
        res = multi_gpu_check(args.steps, args.n_gpus)
        brief = {k: res[k] for k in ("steps", "loss_max_rel_diff", "same_tokens", "captured")}
        if not res["ok"]:
            FAILED.append(f"{args.n_gpus} GPUs vs 1: {json.dumps(brief)}")
        print(
            f"{'ok  ' if res['ok'] else 'FAIL'} job path {args.n_gpus} GPUs vs 1, {args.steps} steps: {brief}"
        )
        out["multi"] = res
        out["failed"] = FAILED
    elif args.what == "recipe":
        res = recipe_smoke(args.steps)
        res["ok"] = res["rel_diff"] <= 0.03 and math.isfinite(res["compiled"]["final_train_loss"])
        if not res["ok"]:
            FAILED.append(f"recipe compiled vs reference final loss differ: {res}")
        print(f"{'ok  ' if res['ok'] else 'FAIL'} recipe tiny-llama {args.steps} steps: {json.dumps(res)}")
        out["recipe"] = res
        out["failed"] = FAILED
    else:
        results = []
        for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 3e-2)):
            res = train_tiny(args.steps, dtype)
            res["tolerance"] = tol
            res["ok"] = res["max_rel_diff"] <= tol and all(
                i["first_bad_step"] is None for i in res["info"].values()
            )
            if not res["ok"]:
                FAILED.append(f"tiny-llama {dtype} curves differ: {res['max_rel_diff']:.2e} > {tol}")
            c, r = res["curves"]["compiled"], res["curves"]["reference"]
            print(
                f"{'ok  ' if res['ok'] else 'FAIL'} tiny-llama {args.steps} steps {dtype}: "
                f"loss {r[0]:.4f} -> {r[-1]:.4f} (ref) / {c[0]:.4f} -> {c[-1]:.4f} (compiled), "
                f"max rel diff {res['max_rel_diff']:.2e} (tol {tol})"
            )
            print("   info:", json.dumps(res["info"]))
            results.append(res)
        out["train"] = results
        out["failed"] = FAILED
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(("FAILED: " + "; ".join(FAILED)) if FAILED else "ALL OK", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    raise SystemExit(main())
