"""Memory and speed of the job path on small and large GPUs (issue 32 point 5): `train_bench.py --memory`.

One invocation on one GPU, each cell in its own subprocess (train_bench.spawn, with a timeout), on
the committed long-tail chat set (bench/data/chat-longtail.jsonl), LoRA r=16/alpha=32 on the seven
projections, fp32 adapters, bf16 compute:

  Loraq cells: `recipe.train` with a job config as the worker runs it (job_bench.job_config; the
  memory plan chooses micro-batches and activation checkpointing for the GPU it finds):
    8b-nf4              Llama-3.1-8B shape, NF4 base, packed 2 x 2,048, plan limit 8 GiB
    8b-nf4-24g          the same, plan limit 20.1 GiB: the plan's share (0.9) of a 24 GB card
    8b-bf16-17.5g       the same, bf16 base, plan limit 17.5 GiB (Unsloth's bf16 peak)
    8b-bf16             the same, bf16 base, the whole GPU (the plan's default share)
    8b-bf16-unpacked-8  bf16 base, `packing: false`, 8 rows of up to 2,048 tokens (the job that
                        died out of memory on 2026-11-27)
    70b-nf4             Llama-3.3-70B shape, NF4 base quantized a decoder layer at a time as it is
                        made (models.random_quantized_llama), packed 2 x 2,048, plan limit 72 GiB
    1b-bf16, 135m-bf16  llama-1b and smollm2-135m as `--job` runs them (regression rows)
  A cell's limit is the plan's: the process is capped at limit / share of the GPU
  (torch.cuda.set_per_process_memory_fraction; share 0.9, memory_plan.DEFAULT_SHARE), which the
  plan reads (step_memory.plan_on_device) and the allocator enforces.

  Peers, where they import (else a row `skipped` with the reason), from one random-init
  Llama-3.1-8B checkpoint written first (the 8B preset's own seeded weights, save_pretrained),
  padded batches of 8 examples in a seeded order (job_bench.peer_batches), bf16 autocast, fused
  AdamW, clip 1.0:
    unsloth_qlora       Unsloth FastLanguageModel, load_in_4bit (bitsandbytes NF4),
                        use_gradient_checkpointing="unsloth"
    unsloth_bf16        the same on the bf16 base
    peft_qlora          transformers + bitsandbytes 4-bit (NF4, double quant) + PEFT, gradient
                        checkpointing (non-reentrant)
    peft_bf16           transformers + PEFT on the bf16 base, gradient checkpointing

Each row: tokens/s (real tokens), the plan the cell used (micro-batch rows, checkpointing,
offload, fits, limit; on a CPU no plan is made: nothing split or recomputed), its predicted peak
(memory_plan.predict_peak of that choice) and the measured peaks (torch.cuda.max_memory_allocated
and max_memory_reserved over the whole cell, load included, and over the steps after the first).
The JSON's `ratios` set each Loraq 8B row against Unsloth (and HF+PEFT), `goals` evaluate point
5's targets with their numbers, and every Loraq row's "predicted within 10% of measured".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.job_bench import StepCollector

if TYPE_CHECKING:
    from worker.engine.catalog import PresetShape
    from worker.engine.types import DeviceName, QuantizationName

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# today's job path on the same data (train_bench.py --job, H100): the regression rows' reference
REFERENCE_JOB = ROOT / "bench" / "results" / "job-h100-2026-11-27.json"
# Unsloth 2026.10.9 on one H100, 2026-11-27 (../shared/PEERS.md "Memory, re-measured"): used
# only where this run's own Unsloth row is missing, and then marked so
UNSLOTH_2026_11_27 = {"unsloth_qlora": (7100, 7.9), "unsloth_bf16": (7300, 17.5)}
PEER_EXAMPLES = 8  # examples a padded peer batch (as PEERS.md's Unsloth runs)
PEER_SEQ = 2048
PEER_STEPS, PEER_WARMUP = 12, 3


def _llama_70b() -> PresetShape:
    """Llama-3.3-70B's config.json shape (plain RoPE: the scaling changes no cost)."""
    from worker.engine.catalog import PresetShape

    return PresetShape(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28_672,
        vocab_size=128_256,
        tie_word_embeddings=False,
        rope_theta=500_000.0,
    )


@dataclass(frozen=True)
class Cell:
    name: str
    model: str  # a catalog preset, or "llama-3.3-70b" (built here, handed to the job as a cached base)
    quantization: QuantizationName | None
    pack: bool
    batch: int  # rows a step
    seq: int  # tokens a row
    limit_gib: float | None  # the plan's limit (None: its default share of the whole GPU)
    steps: int  # timed
    warmup: int  # untimed first steps (eager warm-up, capture)


CELLS: tuple[Cell, ...] = (
    Cell("8b-nf4", "llama-8b", "nf4", True, 2, 2048, 8.0, 20, 8),
    Cell("8b-nf4-24g", "llama-8b", "nf4", True, 2, 2048, 20.1, 20, 8),  # 0.9 x 24e9 bytes
    Cell("8b-bf16-17.5g", "llama-8b", None, True, 2, 2048, 17.5, 20, 8),
    Cell("8b-bf16", "llama-8b", None, True, 2, 2048, None, 20, 8),
    Cell("8b-bf16-unpacked-8", "llama-8b", None, False, 8, 2048, None, 6, 6),
    Cell("70b-nf4", "llama-3.3-70b", "nf4", True, 2, 2048, 72.0, 3, 6),
    Cell("1b-bf16", "llama-1b", None, True, 4, 2048, None, 40, 8),
    Cell("135m-bf16", "smollm2-135m", None, True, 4, 2048, None, 60, 8),
)
PEERS = ("unsloth_qlora", "unsloth_bf16", "peft_qlora", "peft_bf16")
# run order: what point 5's targets compare first (a run cut by --time-budget keeps those), each
# Unsloth peer after the Loraq cell it is compared with; HF+PEFT last
CELL_NAMES = (
    "8b-nf4", "unsloth_qlora", "8b-nf4-24g", "8b-bf16-17.5g", "unsloth_bf16", "8b-bf16", "8b-bf16-unpacked-8",
    "70b-nf4", "1b-bf16", "135m-bf16", "peft_qlora", "peft_bf16",
)  # fmt: skip


# ------------------------------------------------------------------------ cells (subprocess)


class MemoryCollector(StepCollector):
    """StepCollector that keeps the memory plan's event data and, on a GPU, splits the measured
    peak at the first step's report: load + setup + first step, then the steps after it."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda
        self.plan: dict[str, Any] | None = None
        self.plan_sentence: str | None = None
        self.first: tuple[int, int] | None = None  # (allocated, reserved) peaks up to the first report

    def on_event(self, level: str, message: str, data: Any = None) -> None:
        if isinstance(data, dict) and "memory_plan" in data:
            self.plan, self.plan_sentence = data["memory_plan"], message
        super().on_event(level, message, data)

    def on_step(self, metrics: Any) -> None:
        if self.cuda and self.first is None:
            import torch

            torch.cuda.synchronize()
            self.first = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        super().on_step(metrics)


def _cap_process(limit_gib: float | None) -> float | None:
    """Cap this process at limit / share of GPU 0 (the plan then keeps its prediction under the
    limit); returns the fraction set, or None where none was needed."""
    import torch

    from worker.engine.memory_plan import DEFAULT_SHARE

    if limit_gib is None:
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = limit_gib * GIB / DEFAULT_SHARE / total
    if fraction >= 1.0:
        return None
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return round(fraction, 4)


def _peaks(first: tuple[int, int] | None) -> dict[str, Any]:
    """Peak bytes of the whole cell (load included) and of the steps after the first."""
    import torch

    now = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    before = first or (0, 0)
    return {
        "max_allocated_bytes": max(before[0], now[0]),
        "max_reserved_bytes": max(before[1], now[1]),
        "steps_max_allocated_bytes": now[0] if first else None,
        "steps_max_reserved_bytes": now[1] if first else None,
    }


def loraq_cell(
    cell: Cell, model: str, steps: int, warmup: int, device: DeviceName, data_file: Path
) -> dict[str, Any]:
    """The job path (recipe.train) for one cell on the chat set `data_file`; `model` the cell's
    own or a `--presets` override."""
    import torch

    from bench.job_bench import chat_rows, job_config, job_readings
    from worker.engine.catalog import PRESET_SHAPES
    from worker.engine.memory_plan import MemoryChoice, ModelDims, predict_peak
    from worker.engine.models import LoadedModel, load_random_shape
    from worker.engine.recipe import train

    cuda = device == "cuda"
    fraction = _cap_process(cell.limit_gib) if cuda else None
    tmp = Path(tempfile.mkdtemp())
    config = job_config(
        model,
        cell.batch,
        cell.seq,
        steps,
        tmp,
        cell.pack,
        train_file=data_file,
        warmup=warmup,
        device=device,
        quantization=cell.quantization,
    )
    rec = MemoryCollector(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    shape = _llama_70b() if model == "llama-3.3-70b" else PRESET_SHAPES[model]
    loaded: LoadedModel | None = None
    built_s = None
    if cell.model == "llama-3.3-70b":  # no catalog preset: made here, handed over as a worker's cache
        t0 = time.time()
        dtype = torch.bfloat16 if cuda else torch.float32
        loaded = load_random_shape(
            shape, model, device=torch.device(device), dtype=dtype, quantization=cell.quantization
        )
        built_s = round(time.time() - t0, 1)
    t0 = time.time()
    result = train(config, rec, loaded=loaded)
    wall = time.time() - t0
    data, _ = chat_rows(cell.seq, data_file)
    measured = _peaks(rec.first) if cuda else None
    mem = measured["max_allocated_bytes"] if measured else None
    readings = job_readings(rec, result, warmup, data.trainable_tokens / data.tokens, mem)
    if rec.plan is not None:
        plan = {**rec.plan, "source": "the engine's (its Memory plan event)", "sentence": rec.plan_sentence}
        predicted = int(plan["predicted_peak_bytes"])
    else:  # a CPU run plans nothing: the whole micro-batch, nothing recomputed
        choice = MemoryChoice()
        parts = predict_peak(
            ModelDims.from_config(shape.config_kwargs()),
            rank=config.lora.r,
            targets=config.lora.target_modules,
            micro_tokens=cell.batch * cell.seq,
            choice=choice,
            quantization=cell.quantization,
        )
        predicted = parts["total"]
        plan = {
            **asdict(choice),
            "predicted_peak_bytes": predicted,
            "limit_bytes": None,
            "fits": None,
            "breakdown": parts,
            "source": f"none made on {device}: nothing split or recomputed",
        }
    row: dict[str, Any] = {
        "cell": cell.name,
        "model": model,
        "variant": "loraq",
        "quantization": cell.quantization or "bf16",
        "pack": cell.pack,
        "batch": cell.batch,
        "seq": cell.seq,
        "limit_gib": cell.limit_gib,
        "process_memory_fraction": fraction,
        "plan": plan,
        "predicted_peak_bytes": predicted,
        "predicted_peak_gib": round(predicted / GIB, 2),
        "measured": measured,
        "peak_gib": round(mem / GIB, 2) if mem is not None else None,
        "reserved_gib": round(measured["max_reserved_bytes"] / GIB, 2) if measured else None,
        "predicted_over_measured": round(predicted / mem, 3) if mem else None,
        **readings,
        "quantize_note": getattr(loaded, "note", None)
        or next((m for _, m in rec.events if m.startswith("Base quantized")), None),
        "base_built_s": built_s,
        "run_wall_s": round(wall, 1),
    }
    return row


def write_checkpoint(path: Path) -> dict[str, Any]:
    """The llama-8b preset's seeded random weights (bf16) and tiny-llama's tokenizer, as
    save_pretrained writes them: what the peers load (Unsloth takes a local directory)."""
    import torch

    from worker.engine.catalog import PRESET_SHAPES
    from worker.engine.models import load_random_shape

    t0 = time.time()
    loaded = load_random_shape(
        PRESET_SHAPES["llama-8b"], "llama-8b", device=torch.device("cuda"), dtype=torch.bfloat16
    )
    loaded.model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"cell": "checkpoint", "path": str(path), "bytes": size, "wall_s": round(time.time() - t0, 1)}


def _peer_model(variant: str, checkpoint: Path) -> tuple[Any, list[Any], Any, str]:
    """(model, trainable params, optimizer, settings in words) of a peer on the checkpoint."""
    import torch

    if variant.startswith("unsloth"):
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(
            model_name=str(checkpoint),
            max_seq_length=PEER_SEQ,
            dtype=torch.bfloat16,
            load_in_4bit=variant == "unsloth_qlora",
        )
        model = FastLanguageModel.get_peft_model(
            model,
            r=16,
            lora_alpha=32,
            lora_dropout=0,
            target_modules=TARGETS,
            bias="none",
            use_gradient_checkpointing="unsloth",
            random_state=0,
        )
        FastLanguageModel.for_training(model)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.data = p.data.float()  # fp32 adapters, as every other cell
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        words = "Unsloth FastLanguageModel, " + (
            "load_in_4bit (bitsandbytes NF4)" if variant == "unsloth_qlora" else "bf16 base"
        )
        return model, params, opt, words + ', use_gradient_checkpointing="unsloth"'
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from bench.peers import with_lora

    quantized = variant == "peft_qlora"
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16, "device_map": {"": 0}, "attn_implementation": "sdpa"}
    if quantized:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    base = AutoModelForCausalLM.from_pretrained(checkpoint, **kwargs)
    base.config.use_cache = False
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, params, opt = with_lora(base, TARGETS)
    model.train()  # from_pretrained leaves eval mode, where transformers skips the checkpointing
    words = "transformers + PEFT, " + ("bitsandbytes 4-bit NF4 (double quant)" if quantized else "bf16 base")
    return model, params, opt, words + ", gradient checkpointing (non-reentrant)"


def _peer_imports(variant: str) -> None:
    """Import what the peer needs (Unsloth first: it patches transformers as it loads)."""
    if variant.startswith("unsloth"):
        import unsloth  # noqa: F401
    if variant in ("unsloth_qlora", "peft_qlora"):
        import bitsandbytes  # noqa: F401
    import peft  # noqa: F401


def peer_cell(variant: str, steps: int, warmup: int, checkpoint: Path, data_file: Path) -> dict[str, Any]:
    """One peer on the 8B checkpoint and the chat set `data_file`, or a row `skipped` with the
    reason it cannot run here."""
    head: dict[str, Any] = {"cell": variant, "model": "llama-8b", "variant": variant}
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        _peer_imports(variant)
    except Exception as exc:  # ImportError, or Unsloth refusing a host without a GPU
        return {**head, "skipped": f"cannot import: {exc!r}"[:600]}
    import torch

    if not torch.cuda.is_available():
        return {**head, "skipped": "no CUDA GPU: the peers run on the GPU only"}
    if not (checkpoint / "config.json").is_file():
        return {**head, "skipped": f"no checkpoint at {checkpoint} (its cell failed)"}
    from bench.job_bench import peer_batches, timed_peer_steps

    batches = peer_batches("peft_padded", 1, PEER_SEQ, PEER_EXAMPLES, warmup + steps, data_file)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model, params, opt, words = _peer_model(variant, checkpoint)
    run = timed_peer_steps(model, params, opt, batches, warmup)
    measured = _peaks(None)
    tok_s = run["tokens"] / run["seconds"]
    return {
        **head,
        "settings": words,
        "batch": PEER_EXAMPLES,
        "seq": PEER_SEQ,
        "steps_timed": steps,
        "tok_s": round(tok_s),
        "step_ms": round(1e3 * run["seconds"] / steps, 2),
        "padding_fraction": round(1 - run["tokens"] / run["slots"], 4),
        "measured": measured,
        "peak_gib": round(measured["max_allocated_bytes"] / GIB, 2),
        "reserved_gib": round(measured["max_reserved_bytes"] / GIB, 2),
        "loss": round(run["loss"], 4),
        "run_wall_s": round(time.time() - t0, 1),
    }


def run_memory_cell(args: list[str]) -> dict[str, Any]:
    """`--memory-cell NAME MODEL STEPS WARMUP CHECKPOINT DATA` (MODEL "-": the cell's own)."""
    import torch

    name, model, steps, warmup = args[0], args[1], int(args[2]), int(args[3])
    checkpoint, data_file = Path(args[4]), Path(args[5])
    if name == "checkpoint":
        return write_checkpoint(checkpoint)
    if name in PEERS:
        return peer_cell(name, steps, warmup, checkpoint, data_file)
    from worker.kernels import configure_kernels

    configure_kernels()  # LORAQ_KERNELS, LORAQ_RANK_UPDATE as the worker applies them
    cell = next(c for c in CELLS if c.name == name)
    device: DeviceName = "cuda" if torch.cuda.is_available() else "cpu"
    return loraq_cell(cell, cell.model if model == "-" else model, steps, warmup, device, data_file)


# ----------------------------------------------------------------------------------- parent


def _by_cell(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["cell"]: r for r in result["rows"] if "error" not in r and "skipped" not in r}


def _within(predicted: int, measured: int | None) -> dict[str, Any]:
    if not measured:
        return {"predicted_gib": round(predicted / GIB, 2), "measured_gib": None, "met": None}
    error = (predicted - measured) / measured
    return {
        "predicted_gib": round(predicted / GIB, 2),
        "measured_gib": round(measured / GIB, 2),
        "rel_error": round(error, 3),
        "met": abs(error) <= 0.10,
    }


def _unsloth(by: dict[str, dict[str, Any]], variant: str) -> tuple[float, float, str]:
    """(tokens/s, peak GiB, source) of an Unsloth peer: this run's row, else PEERS.md's numbers."""
    row = by.get(variant)
    if row is not None:
        return row["tok_s"], row["peak_gib"], "this run"
    tok_s, gib = UNSLOTH_2026_11_27[variant]
    return tok_s, gib, "../shared/PEERS.md (H100, 2026-11-27): not run here"


def _reference_tok_s(model: str) -> int | None:
    rows = json.loads(REFERENCE_JOB.read_text())["rows"]
    job = [r for r in rows if (r.get("model"), r.get("variant"), r.get("seq")) == (model, "job", 2048)]
    return job[0]["tok_s"] if job else None


def summarize(result: dict[str, Any]) -> None:
    """`ratios` (each Loraq 8B row against Unsloth and HF+PEFT: tokens/s and peak memory) and
    `goals` (point 5's targets, each with its numbers; `met` None where the run cannot say: on a
    CPU, or with the models overridden)."""
    by = _by_cell(result)
    judged = result["device"] != "cpu" and not result.get("models_overridden")

    def met(ok: bool) -> bool | None:
        return bool(ok) if judged else None

    ratios: dict[str, Any] = {}
    for cell, peer in [
        ("8b-nf4", "unsloth_qlora"),
        ("8b-nf4", "peft_qlora"),
        ("8b-bf16-17.5g", "unsloth_bf16"),
        ("8b-bf16", "unsloth_bf16"),
        ("8b-bf16-17.5g", "peft_bf16"),
        ("8b-bf16", "peft_bf16"),
    ]:
        ours, theirs = by.get(cell), by.get(peer)
        if ours and theirs and ours["peak_gib"] is not None:
            ratios[f"{cell}_vs_{peer}"] = {
                "tok_s": round(ours["tok_s"] / theirs["tok_s"], 2),
                "peak": round(ours["peak_gib"] / theirs["peak_gib"], 3),
            }
    goals: dict[str, Any] = {}
    for key, cell, peer, cap in [
        ("8b_nf4", "8b-nf4", "unsloth_qlora", 8.0),
        ("8b_bf16_capped", "8b-bf16-17.5g", "unsloth_bf16", 17.5),
    ]:
        ours = by.get(cell)
        tok_s, gib, source = _unsloth(by, peer)
        g: dict[str, Any] = {
            "peak_goal_gib": cap,
            "ratio_goal": 1.5,
            peer + "_tok_s": tok_s,
            peer + "_peak_gib": gib,
            "unsloth_source": source,
        }
        if ours:
            ratio = ours["tok_s"] / tok_s
            g |= {"peak_gib": ours["peak_gib"], "tok_s": ours["tok_s"], "ratio": round(ratio, 2)}
            g["met"] = met(ours["peak_gib"] is not None and ours["peak_gib"] <= cap and ratio >= 1.5)
        else:
            g["met"] = met(False)
        goals[key] = g
    uncapped_tok_s = by["8b-bf16"]["tok_s"] if "8b-bf16" in by else None
    goals["8b_bf16_uncapped"] = {
        "tok_s_goal": 19_500,
        "tok_s": uncapped_tok_s,
        "met": met(uncapped_tok_s is not None and uncapped_tok_s >= 19_500),
    }
    unpacked = by.get("8b-bf16-unpacked-8")
    goals["8b_unpacked_8_rows_fits"] = {
        "ran": unpacked is not None,
        "peak_gib": unpacked["peak_gib"] if unpacked else None,
        "met": met(unpacked is not None),
    }
    big = by.get("70b-nf4", {})
    goals["70b_nf4"] = {
        "seq": 2048,
        "peak_goal_gib": 72.0,
        "peak_gib": big.get("peak_gib"),
        "tok_s": big.get("tok_s"),
        "unsloth_70b": "not run: Unsloth loads a saved checkpoint, and 70B in bf16 (140 GB) does not "
        "fit this host's disk",
        "met": met(big.get("peak_gib") is not None and big["peak_gib"] <= 72.0),
    }
    for key, cell, model in [
        ("1b_bf16_unchanged", "1b-bf16", "llama-1b"),
        ("135m_bf16_unchanged", "135m-bf16", "smollm2-135m"),
    ]:
        ours = by.get(cell)
        reference = _reference_tok_s(model)
        g = {
            "ratio_goal": 0.98,
            "reference_tok_s": reference,
            "reference": str(REFERENCE_JOB.relative_to(ROOT)) + " (job row; H100, another run)",
        }
        if ours and reference:
            ratio = ours["tok_s"] / reference
            no_ckpt = ours["plan"]["checkpointing"] == "none" and not ours["plan"]["micro_rows"]
            g |= {"tok_s": ours["tok_s"], "ratio": round(ratio, 3), "plan_splits_nothing": no_ckpt}
            g["met"] = met(ratio >= 0.98 and no_ckpt)
        else:
            g["met"] = met(False)
        goals[key] = g
    goals["predicted_within_10pct"] = {
        r["cell"]: _within(r["predicted_peak_bytes"], (r.get("measured") or {}).get("max_allocated_bytes"))
        for r in by.values()
        if r.get("variant") == "loraq"
    }
    result["ratios"] = ratios
    result["goals"] = goals


def _cell_args(name: str, args: Any, checkpoint: Path, data_file: Path) -> list[str]:
    cell = next((c for c in CELLS if c.name == name), None)
    steps, warmup = (cell.steps, cell.warmup) if cell else (PEER_STEPS, PEER_WARMUP)
    if "--steps" in sys.argv:
        steps = args.steps
    if "--warmup" in sys.argv:
        warmup = args.warmup
    model = args.presets if "--presets" in sys.argv else "-"
    return ["--memory-cell", name, model, str(steps), str(warmup), str(checkpoint), str(data_file)]


def _needs_checkpoint(names: list[str]) -> bool:
    """Whether a peer here can run: a GPU, and its package importable (found: its cell imports it)."""
    import importlib.util

    import torch

    found = {"unsloth": importlib.util.find_spec("unsloth"), "peft": importlib.util.find_spec("peft")}
    wanted = [n for n in names if n in PEERS]
    usable = [n for n in wanted if found["unsloth" if n.startswith("unsloth") else "peft"] is not None]
    return torch.cuda.is_available() and bool(usable)


def gpu_slug(device: str) -> str:
    """The GPU's model in a file name: "NVIDIA H100 80GB HBM3" -> "h100"."""
    model = re.compile(r"^[A-Za-z]+\d+[A-Za-z]?$")
    found = [t for t in device.split() if model.match(t) and not t.upper().endswith("GB")]
    return found[0].lower() if found else device.split()[-1].lower().replace("/", "-")


def run_memory_mode(args: Any) -> int:
    """`train_bench.py --memory`: every cell in order, the JSON rewritten after each; cells that
    would run past `--time-budget` seconds are recorded as skipped."""
    import torch

    from bench.job_bench import dataset_stats
    from bench.train_bench import record_row, run_header, spawn

    started = time.time()
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    date = time.strftime("%Y-%m-%d", time.gmtime())
    name = f"memory-{gpu_slug(device) if cuda else 'cpu'}-{date}.json"
    out = args.out or ROOT / "bench" / "results" / name
    if out.is_dir():  # a folder (the device's $OUT): the file keeps its default name there
        out = out / name
    names = args.cells.split(",") if args.cells else list(CELL_NAMES)
    unknown = [n for n in names if n not in CELL_NAMES]
    if unknown:
        print(f"--cells: unknown {unknown}; known: {', '.join(CELL_NAMES)}", file=sys.stderr)
        return 2
    checkpoint = Path(args.peer_checkpoint)
    data_file = Path(args.memory_data).resolve()
    result: dict[str, Any] = {
        **run_header(device),
        "gpu_total_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "settings": "LoRA r=16 alpha=32 on q,k,v,o,gate,up,down; fp32 adapters, bf16 compute; fused AdamW "
        "lr 1e-4; clip 1.0. Loraq = recipe.train (job config; the memory plan picks micro-batches and "
        "checkpointing; a cell's limit_gib is the plan's limit, the process capped at limit / 0.9 of the "
        "GPU). Peers: padded batches of 8 examples. tok_s: real tokens. Peaks: torch.cuda "
        "max_memory_allocated / max_memory_reserved over the whole cell, model load included",
        "cells": {c.name: asdict(c) for c in CELLS},
        "models_overridden": args.presets if "--presets" in sys.argv else None,
        "dataset": dataset_stats(path=data_file),
        "rows": [],
    }
    checkpoint_written = False

    def remaining() -> float:
        """Seconds left of --time-budget (without one: a cell's timeout)."""
        return args.time_budget - (time.time() - started) if args.time_budget else args.cell_timeout

    try:
        for name in names:
            left = remaining()
            if name in PEERS and not checkpoint_written and left >= 90 and _needs_checkpoint(names):
                made = spawn(["--memory-cell", "checkpoint", "-", "0", "0", str(checkpoint), "-"], left - 30)
                result["peer_checkpoint"] = made
                checkpoint_written = True
                left = remaining()
            if left < 30:
                result["rows"].append({"cell": name, "skipped": "the run's --time-budget was spent"})
                continue
            row = spawn(_cell_args(name, args, checkpoint, data_file), min(args.cell_timeout, left))
            row.setdefault("cell", name)
            record_row(result, row, summarize, out)
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    summarize(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({"ratios": result["ratios"], "goals": result["goals"]}, indent=1))
    print("wrote", out)
    return 0
