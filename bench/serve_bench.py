"""Multi-adapter serving throughput: Loraq's serving engine next to HF `generate` + PEFT, one GPU.

One invocation, the same requests on both sides: `--streams` (32) requests spread over
`--adapters` (8) different LoRA adapters of llama-1b (random-init weights of the Llama-3.2-1B
shape, bf16), `--streams / --adapters` rows per adapter, each with `--prompt` (256) random prompt
tokens and exactly `--new` (256) generated tokens, greedy. Every adapter has random non-zero A and
B of rank 16 (alpha 32) on q, k, v, o, gate, up and down.

- loraq: `ServingModel.admit` / `step`, the code the inference worker runs (worker/inference.py),
  requests with `ignore_eos` so each row generates its full `--new` tokens. All requests are
  admitted in one call (one prefill of 32 rows), then stepped to the end. A warm-up round on the
  same batch first (the decode step's CUDA graph is captured there). Variants, same requests:
  `loraq_eager` (no CUDA graphs), `loraq_reference_lora` (graphs, LoRA by the gathered torch
  reference instead of the compiled kernel), `loraq_admit_each` (the worker's admission: one
  admit call per request).
- hf_peft: `PeftModel.generate` on the same base weights with the same 8 adapters loaded, one
  batch of all 32 rows with `adapter_names=[...]` per row (PEFT's mixed-adapter batch),
  `min_new_tokens = max_new_tokens = --new` (EOS cannot end a row), greedy, SDPA attention.

Reported: aggregate generated tokens/s (generated tokens counted on the outputs / wall time from
the first admit or the generate call to the last token), their ratio, time to first token (each
row's first token; HF's from a streamer: the whole batch's first decode step), peak GPU memory of
each side (each side alone on the GPU), ours' per-step profile (prefill, step wall times, the
decode graph's replay on its own), and the greedy agreement of the two sides' tokens: in bf16,
where a random-init model's flat logits make near-ties common and the two part ways at the first
one, and again with both bases in fp32 (`--fp32-check-new` tokens), where they should not (the
fraction of equal tokens and the common prefix lengths). `lora_op_us`: the LoRA term alone by the
kernel and by the gathered GEMMs on llama-1b's shapes (what sets KERNEL_MAX_TOKENS).

Usage: python bench/serve_bench.py [--out bench/results/serve-<gpu>-<date>.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peers import TARGETS  # noqa: E402
from bench.train_bench import run_header  # noqa: E402

RANK, ALPHA = 16, 32
GOAL = 5.0  # aggregate tokens/s of loraq over hf_peft


def target_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """{module path: (in, out)} of every TARGETS linear layer of a plain transformers model."""
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS
    }


def adapter_tensors(shapes: dict[str, tuple[int, int]], seed: int) -> dict[str, torch.Tensor]:
    """PEFT-layout tensors (base_model.model.<path>.lora_A/B.weight) of a random adapter on every
    layer of `shapes`: A ~ N(0, 1/in), B ~ N(0, 0.02²), so each changes the outputs visibly."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        n_in, n_out = shapes[name]
        out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(RANK, n_in, generator=gen) * n_in**-0.5
        out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(n_out, RANK, generator=gen) * 0.02
    return out


def adapter_config(preset: str) -> dict[str, Any]:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
        "lora_dropout": 0.0, "bias": "none", "target_modules": TARGETS, "base_model_name_or_path": preset,
    }  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def decode_profile(served: Any, batch: Any, top: int = 12) -> dict[str, Any]:
    """Where a decode step's GPU time goes: one eager run of the captured shape under the
    profiler, the kernels' summed time and count, and the `top` kernels by time."""
    kv = batch.kv
    if kv is None or not kv.graphs or not torch.cuda.is_available():
        return {}
    bb, lb = next(iter(kv.graphs))
    try:
        with (
            torch.inference_mode(),
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof,
        ):
            served.decoder._decode_body(kv, bb, lb)
            sync()
    except Exception as exc:  # the figures above stand without it
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        served.rows.index = None
    kernels = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    total_us = sum(e.device_time_total for e in kernels)
    ranked = sorted(kernels, key=lambda e: -e.device_time_total)[:top]
    return {
        "shape": [bb, lb],
        "kernel_time_us": round(total_us, 1),
        "kernel_launches": sum(e.count for e in kernels),
        "top": [{"name": e.key[:120], "us": round(e.device_time_total, 1), "count": e.count} for e in ranked],
    }


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None


def run_loraq(served: Any, requests: list[Any], *, admit_each: bool, batch: Any) -> dict[str, Any]:
    """One timed round of `requests` through admit/step on `batch`; tokens and timings."""
    from worker.engine.serving import GenRequest

    first: dict[int, float] = {}
    step_ms: list[float] = []

    def on_text(key: int, _delta: str) -> None:
        first.setdefault(key, time.perf_counter())

    keyed: list[tuple[Any, GenRequest]] = list(enumerate(requests))
    sync()
    t0 = time.perf_counter()
    if admit_each:
        for item in keyed:
            served.admit(batch, [item])
    else:
        served.admit(batch, keyed)
    rows = {row.key: row for row in batch.rows}  # their streams keep every generated id
    sync()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    while batch.rows:
        ts = time.perf_counter()
        served.step(batch, on_text)
        step_ms.append((time.perf_counter() - ts) * 1e3)
    wall = time.perf_counter() - t0
    tokens = [rows[i].stream.ids for i in range(len(requests))]
    generated = sum(len(t) for t in tokens)
    ttft = [(first[i] - t0) * 1e3 for i in range(len(requests))]
    return {
        "tok_s": round(generated / wall, 1),
        "wall_s": round(wall, 3),
        "generated_tokens": generated,
        "ttft_ms": {"p50": round(statistics.median(ttft), 1), "p99": round(percentile(ttft, 0.99), 1)},
        "prefill_ms": round(prefill_ms, 1),
        "steps": len(step_ms),
        "step_ms": {"p50": round(statistics.median(step_ms), 2), "p99": round(percentile(step_ms, 0.99), 2)},
        "tokens": tokens,
    }


def decode_replay_ms(batch: Any) -> float | None:
    """The decode step's CUDA graph replayed on its own (the GPU time of one step), ms."""
    kv = batch.kv
    if kv is None or not kv.graphs or not torch.cuda.is_available():
        return None
    graph = next(iter(kv.graphs.values())).graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / 20, 3)


def lora_op_timings() -> list[dict[str, Any]]:
    """Microseconds of the LoRA term alone (y already holds the base GEMM's output) by the compiled
    kernel and by the gathered GEMMs, on llama-1b's shapes, 8 slots of rank 16: what decides
    gpu_kernels.ops.lora_multi.KERNEL_MAX_TOKENS."""
    from gpu_kernels.ops import lora_multi

    rows = []
    for b, s in ((32, 1), (8, 64), (1, 256), (32, 256)):
        for k, n in ((2048, 2048), (2048, 8192), (8192, 2048)):
            a = torch.randn(9, RANK, k, device="cuda") * 0.02
            bb = torch.randn(9, n, RANK, device="cuda") * 0.02
            scales = torch.full((9,), 2.0, device="cuda")
            x = torch.randn(b, s, k, device="cuda", dtype=torch.bfloat16)
            y = torch.zeros(b, s, n, device="cuda", dtype=torch.bfloat16)
            index = torch.arange(b, device="cuda") % 8 + 1
            row: dict[str, Any] = {"rows": b, "seq": s, "in": k, "out": n}
            for name, add in (("kernel", lora_multi.kernel_add_), ("gathered", lora_multi.gathered_add_)):
                for _ in range(3):
                    add(y, x, a, bb, scales, index)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(50):
                    add(y, x, a, bb, scales, index)
                end.record()
                end.synchronize()
                row[f"{name}_us"] = round(start.elapsed_time(end) / 50 * 1e3, 1)
            rows.append(row)
    return rows


def dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.device == "cuda" else torch.float32  # as load_serving_model


def served_with_adapters(args: argparse.Namespace, dt: torch.dtype) -> tuple[Any, list[int]]:
    """The ServingModel of args.model in `dt` on args.device with the adapters loaded; their slots."""
    from worker.engine.models import load_base_model
    from worker.engine.serving import Adapter, ServingModel

    loaded = load_base_model(args.model, store=Path(tempfile.mkdtemp()), device=args.device, dtype=dt)
    served = ServingModel(loaded, args.adapters)
    assert served.decoder is not None, "llama-1b runs our KV-cache engine"
    shapes = {
        path: (layer.base.in_features, layer.base.out_features)
        for path, layer in served.layers.items()
        if path.rsplit(".", 1)[-1] in TARGETS
    }
    config = adapter_config(args.model)

    def loader(i: int) -> Callable[[], Adapter]:
        return lambda: Adapter(config, adapter_tensors(shapes, i))

    slots = [served.adapter_slot(f"a{i}", loader(i)) for i in range(args.adapters)]
    return served, slots


def requests_for(prompts: list[list[int]], slots_of: list[int], slots: list[int], new: int) -> list[Any]:
    from worker.engine.serving import GenRequest

    return [
        GenRequest(p, max_tokens=new, slot=slots[s], temperature=0, ignore_eos=True)
        for p, s in zip(prompts, slots_of, strict=True)
    ]


def loraq_tokens(
    args: argparse.Namespace, prompts: list[list[int]], slots_of: list[int], dt: torch.dtype, new: int
) -> list[list[int]]:
    """Our greedy tokens for the requests, the base in `dt` (the correctness check in fp32)."""
    from worker.engine.serving import DecodeBatch

    served, slots = served_with_adapters(args, dt)
    result = run_loraq(
        served, requests_for(prompts, slots_of, slots, new), admit_each=False, batch=DecodeBatch()
    )
    tokens: list[list[int]] = result["tokens"]
    return tokens


def loraq_side(args: argparse.Namespace, prompts: list[list[int]], slots_of: list[int]) -> dict[str, Any]:
    import gpu_kernels
    from worker.engine.serving import DecodeBatch

    reset_peak()
    served, slots = served_with_adapters(args, dtype(args))
    assert served.decoder is not None

    def reqs(new: int) -> list[Any]:
        return requests_for(prompts, slots_of, slots, new)

    out: dict[str, Any] = {"kernels": gpu_kernels.available().reason}
    batch = DecodeBatch()
    run_loraq(served, reqs(8), admit_each=False, batch=batch)  # warm-up: lazy inits, graph capture
    main = run_loraq(served, reqs(args.new), admit_each=False, batch=batch)
    main["decode_graph_replay_ms"] = decode_replay_ms(batch)
    main["decode_profile"] = decode_profile(served, batch)
    main["graph_failure"] = served.decoder.graph_failure
    main["peak_mem_gib"] = peak_gib()
    out["loraq"] = main

    each_batch = DecodeBatch()
    run_loraq(served, reqs(4), admit_each=True, batch=each_batch)
    out["loraq_admit_each"] = run_loraq(served, reqs(args.new), admit_each=True, batch=each_batch)

    graphs, served.decoder.graphs = served.decoder.graphs, False
    eager_batch = DecodeBatch()
    run_loraq(served, reqs(4), admit_each=False, batch=eager_batch)
    out["loraq_eager"] = run_loraq(served, reqs(args.new), admit_each=False, batch=eager_batch)
    served.decoder.graphs = graphs

    gpu_kernels.set_backend("reference")
    try:
        ref_batch = DecodeBatch()
        run_loraq(served, reqs(8), admit_each=False, batch=ref_batch)
        out["loraq_reference_lora"] = run_loraq(served, reqs(args.new), admit_each=False, batch=ref_batch)
    finally:
        gpu_kernels.set_backend("auto")
    for key in ("loraq_admit_each", "loraq_eager", "loraq_reference_lora"):
        out[key].pop("tokens")
    del served, batch, each_batch, eager_batch, ref_batch
    return out


class _FirstToken:
    """A generate() streamer that notes when the first generated tokens arrive (its second put:
    the first is the prompt)."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, _value: torch.Tensor) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_side(
    args: argparse.Namespace, prompts: list[list[int]], slots_of: list[int], dt: torch.dtype, new: int
) -> dict[str, Any]:
    from peft import PeftModel
    from safetensors.torch import save_file

    from worker.engine.models import load_base_model

    reset_peak()
    loaded = load_base_model(args.model, store=Path(tempfile.mkdtemp()), device=args.device, dtype=dt)
    base = loaded.model
    shapes = target_shapes(base)
    root = Path(tempfile.mkdtemp())
    names = []
    for i in range(args.adapters):
        d = root / f"a{i}"
        d.mkdir()
        save_file(adapter_tensors(shapes, i), str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps(adapter_config(args.model)))
        names.append(f"a{i}")
    model = PeftModel.from_pretrained(base, str(root / "a0"), adapter_name="a0")
    for i in range(1, args.adapters):
        model.load_adapter(str(root / f"a{i}"), adapter_name=f"a{i}")
    model.eval()
    ids = torch.tensor(prompts, device=args.device)
    mask = torch.ones_like(ids)
    row_names = [names[s] for s in slots_of]
    tok = loaded.tokenizer

    def generate(new: int, streamer: Any = None) -> torch.Tensor:
        with torch.inference_mode():
            out: torch.Tensor = model.generate(
                input_ids=ids, attention_mask=mask, adapter_names=row_names, max_new_tokens=new,
                min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id, streamer=streamer,
            )  # fmt: skip
        return out

    generate(8)  # warm-up
    sync()
    streamer = _FirstToken()
    t0 = time.perf_counter()
    out = generate(new, streamer)
    sync()
    wall = time.perf_counter() - t0
    new_tokens = out[:, ids.shape[1] :]
    generated = int(new_tokens.numel())
    ttft = (streamer.puts[1] - t0) * 1e3 if len(streamer.puts) > 1 else None
    result = {
        "tok_s": round(generated / wall, 1),
        "wall_s": round(wall, 3),
        "generated_tokens": generated,
        "ttft_ms": {"p50": round(ttft, 1) if ttft is not None else None},
        "peak_mem_gib": peak_gib(),
        "attention": str(base.config._attn_implementation),
        "tokens": new_tokens.tolist(),
    }
    return result


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    equal = sum(a == b for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=False))
    total = sum(min(len(x), len(y)) for x, y in zip(ours, theirs, strict=True))
    prefixes = []
    for x, y in zip(ours, theirs, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {
        "rows": len(ours),
        "token_match_fraction": round(equal / max(total, 1), 4),
        "common_prefix_tokens": {
            "min": min(prefixes),
            "p50": statistics.median(prefixes),
            "max": max(prefixes),
        },
        "rows_fully_equal": sum(
            p == min(len(x), len(y)) for p, x, y in zip(prefixes, ours, theirs, strict=True)
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--fp32-check-new", type=int, default=48, help="tokens of the fp32 agreement check (0: none)"
    )
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (tiny-llama)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("serve_bench needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    gen = torch.Generator().manual_seed(0)
    # ids 4..508: ordinary tokens of the tiny tokenizer the presets come with
    prompts = torch.randint(4, 509, (args.streams, args.prompt), generator=gen).tolist()
    slots_of = [i % args.adapters for i in range(args.streams)]
    result: dict[str, Any] = {
        **run_header(device),
        "model": args.model, "streams": args.streams, "adapters": args.adapters,
        "prompt_tokens": args.prompt, "new_tokens": args.new, "rank": RANK, "alpha": ALPHA,
        "targets": TARGETS, "dtype": str(dtype(args)).removeprefix("torch."),
        "decoding": "greedy, every row forced to new_tokens",
    }  # fmt: skip
    result.update(loraq_side(args, prompts, slots_of))
    free_memory()
    result["hf_peft"] = hf_side(args, prompts, slots_of, dtype(args), args.new)
    if args.device == "cuda":
        result["lora_op_us"] = lora_op_timings()
    ours, theirs = result["loraq"].pop("tokens"), result["hf_peft"].pop("tokens")
    result["greedy_agreement"] = agreement(ours, theirs)
    if args.fp32_check_new:
        # the same requests with both bases in fp32: bf16 near-ties aside, the two compute one function
        free_memory()
        ours32 = loraq_tokens(args, prompts, slots_of, torch.float32, args.fp32_check_new)
        free_memory()
        theirs32 = hf_side(args, prompts, slots_of, torch.float32, args.fp32_check_new)["tokens"]
        result["fp32_greedy_agreement"] = {"new_tokens": args.fp32_check_new, **agreement(ours32, theirs32)}
    ratio = round(result["loraq"]["tok_s"] / result["hf_peft"]["tok_s"], 2)
    result["ratio_vs_hf_peft"] = ratio
    result["goals"] = {"ratio_vs_hf_peft": GOAL, "measured": ratio, "met": ratio >= GOAL}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
