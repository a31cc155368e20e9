"""The job path, benchmarked as users run it: `train_bench.py --job`.

On the committed long-tail chat dataset (bench/data/chat-longtail.jsonl, made by
bench/chat_dataset.py), per model, in one invocation, each cell in its own subprocess:

  job                 `recipe.train` exactly as the worker calls it (packing on, checkpoints every
                      `CHECKPOINT_EVERY` steps, metric callbacks), B rows of T tokens per step
  fixed               the fixed-shape captured step on random tokens at the same B x T
  peft_padded         HF+PEFT, batches of E examples in a seeded random order, padded to the
                      batch's longest (dynamic padding)
  peft_padding_free   HF+PEFT, the same examples concatenated into one row of B·T tokens with
                      position_ids restarting per example (transformers builds the per-example
                      mask from them)

plus a long-context case: the job path and the fixed step with rows of 8,192 tokens.

Family shapes (bench/family_shapes.py: random-init Qwen3-8B, Gemma-3-4B/12B/1B, Llama-3.1-8B,
Mistral-7B, Phi-4-mini, Llama-3.2-1B, Qwen3-1.7B at their published sizes) run job, peft_padded
and peft_padding_free (no fixed row); their goals hold each job row's MFU and peak memory against
the Llama row of its parameter class and its tokens/s against HF+PEFT padded:

    python bench/train_bench.py --job --presets llama-3.1-8b,qwen3-8b,gemma-3-4b,mistral-7b,phi-4-mini \
        --out bench/results/families-h100-DATE.json

`--job --n-gpus N` (multi-GPU scaling): per model, the same job on one GPU (in process, as a
worker runs an n_gpus=1 job) and on N GPUs (`distributed.run_torchrun`, as a worker runs an
n_gpus=N job: one process per GPU, the same global batch split by rows), each in its own
subprocess; the JSON's `ratios` maps each model to its N-GPU / one-GPU tokens/s.
Tokens/s count real (non-padding) tokens; the timed steps start after the job's warm-up and
capture. Settings as train_bench: LoRA r=16/alpha=32 on all seven projections, fp32 adapters,
bf16 base, fused AdamW, clip 1.0, no gradient checkpointing.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.training_config import BatchScaling
    from worker.engine.types import DeviceName, QuantizationName

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "bench" / "data" / "chat-longtail.jsonl"
CHECKPOINT_EVERY = 25
# (rows B, row tokens T, HF+PEFT examples per padded batch, timed steps) per preset
JOB_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "smollm2-135m": (4, 2048, 8, 60),
    "llama-1b": (4, 2048, 8, 40),
    "llama-8b": (2, 2048, 4, 20),
}
LONG_CONTEXT: dict[str, tuple[int, int, int, int]] = {"llama-1b": (1, 8192, 0, 30)}
LONG_CONTEXT_KEYS = {(m, shape[1]) for m, shape in LONG_CONTEXT.items()}
JOB_WARMUP = 8  # eager warm-up, capture and the timed first replays happen in these steps
PEFT_WARMUP = 3


def chat_rows(seq: int, path: Path = DATASET) -> tuple[Any, Any]:
    """The chat set at `path` tokenized as the engine does (the presets share tiny-llama's
    tokenizer), unpacked rows of up to `seq` tokens, and the tokenizer."""
    from worker.engine.data import load_dataset
    from worker.engine.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return load_dataset(path, tok, seq, pack=False), tok


class StepCollector:
    """Training callbacks that keep every step's metrics and every event."""

    def __init__(self) -> None:
        self.steps: list[Any] = []
        self.events: list[tuple[str, str]] = []

    def on_step(self, metrics: Any) -> None:
        self.steps.append(metrics)

    def on_event(self, level: str, message: str, data: Any = None) -> None:
        self.events.append((level, message))

    def on_checkpoint(self, checkpoint: Any) -> None:
        return None

    def should_stop(self) -> bool:
        return False


def job_shape(preset: str) -> tuple[int, int, int, int] | None:
    """(B, T, E, timed steps) of a catalog preset or a family shape (bench/family_shapes.py)."""
    from bench.family_shapes import FAMILY_SHAPES

    return JOB_SHAPES.get(preset) or (FAMILY_SHAPES[preset].job if preset in FAMILY_SHAPES else None)


def job_config(
    preset: str,
    batch: int,
    seq: int,
    steps: int,
    tmp: Path,
    pack: bool = True,
    *,
    train_file: Path = DATASET,
    warmup: int = JOB_WARMUP,
    device: DeviceName = "cuda",
    method: Any = None,
    quantization: QuantizationName | None = None,
    batch_scaling: BatchScaling = "global",
) -> Any:
    """The job's TrainConfig (`warmup` steps + `steps` timed ones), its files under `tmp`;
    `method` a worker.engine.training_config method (None: supervised); `quantization` the
    frozen base's storage (None: bf16); `batch_scaling` per_gpu: `batch` rows on every rank."""
    from bench.family_shapes import FAMILY_SHAPES
    from worker.engine.training_config import SupervisedTraining
    from worker.engine.types import LoraConfig, TrainConfig

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if preset in FAMILY_SHAPES:
        targets = FAMILY_SHAPES[preset].targets()
    return TrainConfig(
        model=preset,
        train_file=train_file,
        output_dir=tmp / "out",
        model_store=tmp / "models",
        lora=LoraConfig(r=16, alpha=32, dropout=0.0, target_modules=targets),
        max_seq_len=seq,
        batch_size=batch,
        max_steps=warmup + steps,
        learning_rate=1e-4,
        lr_scheduler="cosine",
        checkpoint_every=CHECKPOINT_EVERY,
        pack=pack,
        device=device,
        method=method or SupervisedTraining(),
        quantization=quantization,
        batch_scaling=batch_scaling,
    )


def family_base(preset: str) -> Any:
    """A family shape's random-init base (a LoadedModel), built here and handed to the job as a
    worker hands its cached base; None for a catalog preset, which the job loads itself."""
    from bench.family_shapes import FAMILY_SHAPES, random_family_model
    from worker.engine.models import LoadedModel
    from worker.engine.tiny import build_tiny_tokenizer

    if preset not in FAMILY_SHAPES:
        return None
    return LoadedModel(random_family_model(preset), build_tiny_tokenizer(), preset, is_random=True)


def job_cell(
    preset: str,
    batch: int,
    seq: int,
    steps: int,
    pack: bool = True,
    n_gpus: int = 1,
    batch_scaling: BatchScaling = "global",
) -> dict[str, Any]:
    import torch

    from worker.engine.distributed import run_torchrun
    from worker.engine.recipe import train

    tmp = Path(tempfile.mkdtemp())
    config = job_config(preset, batch, seq, steps, tmp, pack, batch_scaling=batch_scaling)
    rec = StepCollector()
    loaded = family_base(preset)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    if n_gpus == 1:
        result = train(config, rec, loaded=loaded)
    else:  # the ranks are torchrun's processes: this one measures no GPU memory
        result = run_torchrun(config, rec, n_gpus=n_gpus, workdir=tmp / "torchrun")
    wall = time.time() - t0
    data, _ = chat_rows(seq)
    mem = torch.cuda.max_memory_allocated() if n_gpus == 1 else None
    readings = job_readings(rec, result, JOB_WARMUP, data.trainable_tokens / data.tokens, mem)
    return {
        "model": preset,
        "variant": multi_gpu_variant(n_gpus, batch_scaling) if pack else "job_unpacked",
        "n_gpus": n_gpus,
        "batch": batch,
        "seq": seq,
        **readings,
        "run_wall_s": round(wall, 1),
    }


def job_readings(
    rec: StepCollector, result: Any, warmup: int, trainable_share: float, mem: int | None
) -> dict[str, Any]:
    """A job run's row: tokens/s over the steps after `warmup` (the job's own per-step tokens
    and step seconds), the trainable-token rate by the dataset's share, peak memory (bytes or
    None), the loss curve, step times, checkpoints and the events worth keeping."""
    timed = rec.steps[warmup:]
    seconds = sum(m.step_seconds for m in timed)
    tokens = sum(m.tokens for m in timed)
    return {
        "steps_timed": len(timed),
        "tok_s": round(tokens / seconds),
        "trainable_tok_s": round(tokens / seconds * trainable_share),
        "step_ms": round(1e3 * seconds / len(timed), 2),
        "padding_fraction": round(sum(m.padding_fraction for m in timed) / len(timed), 4),
        "mem_gib": round(mem / 2**30, 2) if mem is not None else None,
        "mem_bytes": mem,
        "loss_first_last": [round(rec.steps[0].train_loss, 4), round(result.final_train_loss, 4)],
        "loss_curve": [m.train_loss for m in rec.steps],
        "step_seconds": [round(m.step_seconds, 4) for m in rec.steps],
        "checkpoints": len(result.checkpoints),
        "events": [m for level, m in rec.events if "Training step" in m or level != "info"],
    }


def peer_batches(
    variant: str, batch: int, seq: int, examples: int, count: int, path: Path = DATASET
) -> list[dict[str, Any]]:
    """`count` steps of the chat set at `path` for a peer, in a seeded random order: `peft_padded` batches of
    `examples` examples padded to the batch's longest, or (else) one padding-free row of up to
    B·T tokens with position_ids restarting per example. Each dict holds CPU tensors and "real",
    the batch's real tokens."""
    import torch

    data, tok = chat_rows(seq, path)
    rng = random.Random(0)
    order = list(range(len(data.rows)))
    rng.shuffle(order)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    batches: list[dict[str, Any]] = []
    cursor = 0
    while len(batches) < count:
        if variant == "peft_padded":
            rows = [data.rows[order[(cursor + i) % len(order)]] for i in range(examples)]
            cursor += examples
            width = max(len(r.input_ids) for r in rows)
            ids = torch.full((len(rows), width), pad)
            labels = torch.full((len(rows), width), -100)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for i, r in enumerate(rows):
                n = len(r.input_ids)
                ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(r.input_ids), torch.tensor(r.labels), 1
            batches.append(
                {"input_ids": ids, "labels": labels, "attention_mask": mask, "real": int(mask.sum())}
            )
        else:  # one row of up to B·T tokens, position_ids restarting per example
            budget = batch * seq
            ids_l: list[int] = []
            lab_l: list[int] = []
            pos_l: list[int] = []
            while True:
                r = data.rows[order[cursor % len(order)]]
                if len(ids_l) + len(r.input_ids) > budget:
                    break
                ids_l += r.input_ids
                lab_l += r.labels
                pos_l += range(len(r.input_ids))
                cursor += 1
            batches.append(
                {
                    "input_ids": torch.tensor([ids_l]),
                    "labels": torch.tensor([lab_l]),
                    "position_ids": torch.tensor([pos_l]),
                    "real": len(ids_l),
                }
            )
    return batches


def timed_peer_steps(
    model: Any, params: list[Any], opt: Any, batches: list[dict[str, Any]], warmup: int
) -> dict[str, Any]:
    """A peer's training steps on the GPU (bf16 autocast, clip 1.0, the given optimizer): the
    first `warmup` untimed, the rest timed. Returns seconds, real tokens and padded slots of the
    timed steps and the last loss."""
    import torch

    def step(b: dict[str, Any]) -> Any:
        inputs = {k: v.cuda(non_blocking=True) for k, v in b.items() if k != "real"}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**inputs, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for b in batches[:warmup]:
        step(b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        loss = step(b)
    torch.cuda.synchronize()
    timed = batches[warmup:]
    return {
        "seconds": time.perf_counter() - t0,
        "tokens": sum(b["real"] for b in timed),
        "slots": sum(b["input_ids"].numel() for b in timed),
        "loss": float(loss.item()),
    }


def peft_cell(preset: str, variant: str, batch: int, seq: int, examples: int, steps: int) -> dict[str, Any]:
    """HF+PEFT on the same data: padded batches of `examples`, or padding-free rows of B·T."""
    import torch

    from bench.peers import peft_peer_model

    model, params, opt = peft_peer_model(preset, max_positions=8192)
    batches = peer_batches(variant, batch, seq, examples, PEFT_WARMUP + steps)
    torch.cuda.reset_peak_memory_stats()
    run = timed_peer_steps(model, params, opt, batches, PEFT_WARMUP)
    data, _ = chat_rows(seq)
    tok_s = run["tokens"] / run["seconds"]
    return {
        "model": preset,
        "variant": variant,
        "batch": examples if variant == "peft_padded" else 1,
        "seq": seq,
        "steps_timed": steps,
        "tok_s": round(tok_s),
        "trainable_tok_s": round(tok_s * data.trainable_tokens / data.tokens),
        "step_ms": round(1e3 * run["seconds"] / steps, 2),
        "padding_fraction": round(1 - run["tokens"] / run["slots"], 4),
        "mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "loss": round(run["loss"], 4),
    }


def smaller_peer_cell(cell: list[str], row: dict[str, Any]) -> list[str] | None:
    """The HF+PEFT padded cell again with half its examples per batch, when `row` says it ran out
    of GPU memory (its fp32 logits over a 128k-262k vocabulary: E x 2,004 x V x 4 bytes): the
    peer is measured at the largest E that fits, halving from the shape's E down to 1. None when
    the cell is another kind, did not run out of memory, or already had one example a batch."""
    if cell[2] != "peft_padded" or "OutOfMemoryError" not in str(row.get("error", "")):
        return None
    examples = int(cell[5])
    return None if examples <= 1 else [*cell[:5], str(examples // 2), *cell[6:]]


def dataset_stats(seq: int = 2048, path: Path = DATASET) -> dict[str, Any]:
    from bench.chat_dataset import length_stats

    data, _ = chat_rows(seq, path)
    lengths = [len(r.input_ids) for r in data.rows]
    stats: dict[str, Any] = length_stats(lengths)
    stats["trainable_share"] = round(data.trainable_tokens / data.tokens, 3)
    # mean attended context per token (causal, within an example): Σ L² / Σ L / 2 ... the attention
    # FLOPs of train_bench's formula use s, so the equivalent s is Σ L² / Σ L
    stats["attention_equivalent_seq"] = round(sum(n * n for n in lengths) / sum(lengths))
    stats["file"] = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return stats


def summarize_job(result: dict[str, Any]) -> None:
    """Per model (and the long-context case, `MODEL@8192`): `models` holds job_tok_s, fixed_tok_s,
    peft_padded_tok_s and peft_padding_free_tok_s; `goals` the ratios and whether the targets
    (job >= 90% of fixed, >= 4x HF+PEFT padded, peak memory <= fixed's) are met."""
    peak = result.get("peak_tflops") or float("nan")
    attn_seq = result["dataset"]["attention_equivalent_seq"]
    from bench.train_bench import flops_per_token

    by: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in result["rows"]:
        if "error" in r:
            continue
        s = r["seq"] if r["variant"] == "fixed" else min(r["seq"], attn_seq)
        r["mfu"] = round(100 * flops_per_token(r["model"], s) * r["tok_s"] / 1e12 / peak, 1)
        by[(r["model"], r["variant"], r["seq"])] = r
    models: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    from bench.family_shapes import FAMILY_SHAPES

    families = [(m, shape.job) for m, shape in FAMILY_SHAPES.items()]
    for model, (_, seq, _, _) in [*JOB_SHAPES.items(), *LONG_CONTEXT.items(), *families]:
        job = by.get((model, "job", seq))
        if not job:
            continue
        key = f"{model}@{seq}" if (model, seq) in LONG_CONTEXT_KEYS else model
        fixed = by.get((model, "fixed", seq))
        padded = by.get((model, "peft_padded", seq))
        free = by.get((model, "peft_padding_free", seq))
        models[key] = {
            "job_tok_s": job["tok_s"],
            "job_trainable_tok_s": job["trainable_tok_s"],
            "job_mem_gib": job["mem_gib"],
            "job_mfu": job["mfu"],
            "job_padding_fraction": job["padding_fraction"],
            "fixed_tok_s": fixed["tok_s"] if fixed else None,
            "fixed_mem_gib": fixed["mem_gib"] if fixed else None,
            "peft_padded_tok_s": padded["tok_s"] if padded else None,
            "peft_padding_free_tok_s": free["tok_s"] if free else None,
        }
        g: dict[str, Any] = {}
        if fixed:
            g["job_vs_fixed"] = round(job["tok_s"] / fixed["tok_s"], 3)
            g["mem_le_fixed"] = job.get("mem_bytes", job["mem_gib"]) <= fixed.get(
                "mem_bytes", fixed["mem_gib"]
            )
        if padded:
            g["job_vs_peft_padded"] = round(job["tok_s"] / padded["tok_s"], 2)
        if model in FAMILY_SHAPES:
            goals[key] = family_goal(model, job, padded, by)
            continue
        g["met"] = bool(
            g.get("job_vs_fixed", 0) >= 0.9
            and g.get("mem_le_fixed", False)
            and (padded is None or g.get("job_vs_peft_padded", 0) >= 4)
        )
        goals[key] = g
    result["models"] = models
    result["goals"] = goals


def family_goal(
    model: str, job: dict[str, Any], padded: dict[str, Any] | None, by: dict[tuple[str, str, int], Any]
) -> dict[str, Any]:
    """Issue 31's targets for a family shape: job MFU >= 0.9x its Llama peer's job MFU, >= 5x
    HF+PEFT padded on the same data, peak memory <= the Llama peer's (the same parameter class;
    a Llama row is its own peer)."""
    from bench.family_shapes import FAMILY_SHAPES, LLAMA_PEER, LLAMA_TWIN

    if model in LLAMA_TWIN.values():  # a diagnosis row, held against nothing
        return {"twin_of": next(name for name, twin in LLAMA_TWIN.items() if twin == model)}
    peer_name = LLAMA_PEER.get(model, model)
    peer = by.get((peer_name, "job", FAMILY_SHAPES[peer_name].job[1]))
    g: dict[str, Any] = {"llama_peer": peer_name}
    if padded:
        g["job_vs_peft_padded"] = round(job["tok_s"] / padded["tok_s"], 2)
    if peer:
        g["mfu_vs_llama"] = round(job["mfu"] / peer["mfu"], 3)
        g["mem_le_llama"] = job["mem_bytes"] <= peer["mem_bytes"]
    twin = by.get((LLAMA_TWIN.get(model, ""), "job", FAMILY_SHAPES[model].job[1]))
    if twin:  # what the family's own parts cost against a Llama of its sizes (not a goal)
        g["llama_twin"] = {
            "model": twin["model"],
            "mfu_vs_twin": round(job["mfu"] / twin["mfu"], 3),
            "mem_vs_twin_gib": round((job["mem_bytes"] - twin["mem_bytes"]) / 2**30, 2),
        }
    g["met"] = bool(
        g.get("mfu_vs_llama", 0) >= 0.9
        and g.get("mem_le_llama", False)
        and g.get("job_vs_peft_padded", 0) >= 5
    )
    return g


# what a family shape runs: no `fixed` row (that step builds the catalog's Llama presets only)
FAMILY_VARIANTS = ("job", "peft_padded", "peft_padding_free")


def cells(presets: list[str], variants: Sequence[str] | None = None) -> list[list[str]]:
    """The subprocess argument lists of one `--job` invocation, in run order: catalog presets
    preset by preset; family shapes the job and HF+PEFT padded rows of every shape first, then
    their padding-free rows (the longest runs last). `variants`: only those (default all)."""
    from bench.family_shapes import FAMILY_SHAPES

    out: list[list[str]] = []
    family_rows: list[list[str]] = []
    for preset in presets:
        shape = job_shape(preset)
        assert shape is not None, preset
        batch, seq, examples, steps = shape
        kinds = (
            FAMILY_VARIANTS
            if preset in FAMILY_SHAPES
            else ("job", "fixed", "peft_padded", "peft_padding_free")
        )
        for variant in (v for v in kinds if variants is None or v in variants):
            cell = ["--job-cell", preset, variant, str(batch), str(seq), str(examples), str(steps)]
            (family_rows if variant == "peft_padding_free" and preset in FAMILY_SHAPES else out).append(cell)
    out += family_rows
    for preset, (batch, seq, examples, steps) in LONG_CONTEXT.items():
        if preset in presets:
            for variant in (v for v in ("job", "fixed") if variants is None or v in variants):
                out.append(["--job-cell", preset, variant, str(batch), str(seq), str(examples), str(steps)])
    return out


# the N-GPU / one-GPU tokens/s ratio to reach, per GPU count and model
# issue 34's same-global-batch targets
MULTI_GPU_GOALS: dict[int, dict[str, float]] = {
    2: {"llama-1b": 1.9, "smollm2-135m": 1.8},
    4: {"llama-1b": 3.6, "llama-8b": 3.7, "smollm2-135m": 2.5},
    8: {"llama-1b": 7.0},
}
MULTI_GPU_PRESETS = ("smollm2-135m", "llama-1b")


def multi_gpu_batch(
    preset: str, n_gpus: int, batch_scaling: BatchScaling = "global", rows: int | None = None
) -> int:
    """The job's batch_size (rows) on one and on N GPUs: `rows` (default the preset's B), raised
    to a multiple of N so that every rank gets the same number of rows; per_gpu: that B on every
    GPU (the one-GPU job's step on each, a global batch N× as large)."""
    rows = rows or JOB_SHAPES[preset][0]
    return rows if batch_scaling == "per_gpu" else -(-rows // n_gpus) * n_gpus


def multi_gpu_variant(n_gpus: int, batch_scaling: BatchScaling = "global") -> str:
    """A cell's variant: job (one GPU), job_x<N> (N GPUs), job_x<N>_per_gpu (N GPUs, per_gpu)."""
    if n_gpus == 1:
        return "job"
    return f"job_x{n_gpus}" + ("_per_gpu" if batch_scaling == "per_gpu" else "")


def multi_gpu_cells(
    presets: list[str], n_gpus: int, batch_scaling: BatchScaling = "global", rows: int | None = None
) -> list[list[str]]:
    """Per model: the job on one GPU, then the same job on n_gpus GPUs (same batch_size, same
    data; global: the same global batch split, per_gpu: that batch on each GPU); `rows`: the
    batch_size instead of the preset's."""
    out: list[list[str]] = []
    for preset in presets:
        _, seq, examples, steps = JOB_SHAPES[preset]
        batch = str(multi_gpu_batch(preset, n_gpus, batch_scaling, rows))
        for variant in ("job", multi_gpu_variant(n_gpus, batch_scaling)):
            out.append(["--job-cell", preset, variant, batch, str(seq), str(examples), str(steps)])
    return out


def summarize_multi_gpu(result: dict[str, Any], n_gpus: int) -> None:
    """`models`: per model the one- and N-GPU tokens/s, step times and how far the two loss curves
    are apart (bf16: the ranks sum in another order); `ratios`: N-GPU / one-GPU tokens/s;
    `goals`: each ratio against the issue's target where it names one. A per_gpu run (weak
    scaling: N× the global batch, at √N× the learning rate) trains another run than one GPU's, so
    its curves are not compared and the issue's targets (same global batch) do not apply."""
    weak = result.get("batch_scaling") == "per_gpu"
    by = {(r["model"], r.get("n_gpus", 1)): r for r in result["rows"] if "error" not in r}
    models: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    goals: dict[str, Any] = {}
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        one, many = by.get((model, 1)), by.get((model, n_gpus))
        if one is None or many is None:
            continue
        curves = list(zip(one.get("loss_curve", []), many.get("loss_curve", []), strict=False))
        models[model] = {
            "tok_s_1_gpu": one["tok_s"],
            f"tok_s_{n_gpus}_gpus": many["tok_s"],
            "step_ms_1_gpu": one["step_ms"],
            f"step_ms_{n_gpus}_gpus": many["step_ms"],
            "loss_max_rel_diff": None
            if weak
            else max((abs(a - b) / abs(a) for a, b in curves), default=None),
        }
        ratios[model] = round(many["tok_s"] / one["tok_s"], 3)
        goal = None if weak else MULTI_GPU_GOALS.get(n_gpus, {}).get(model)
        if goal is not None:
            goals[model] = {"goal": goal, "ratio": ratios[model], "met": ratios[model] >= goal}
    result["models"] = models
    result["ratios"] = ratios
    result["goals"] = goals


def run_job_cell(args: list[str]) -> dict[str, Any]:
    preset, variant = args[0], args[1]
    batch, seq, examples, steps = (int(x) for x in args[2:6])
    if variant.startswith("job_x"):  # job_x<N> or job_x<N>_per_gpu (multi_gpu_variant)
        n, _, mode = variant.removeprefix("job_x").partition("_")
        scaling: BatchScaling = "per_gpu" if mode == "per_gpu" else "global"
        return job_cell(preset, batch, seq, steps, n_gpus=int(n), batch_scaling=scaling)
    if variant in ("job", "job_unpacked"):
        return job_cell(preset, batch, seq, steps, pack=variant == "job")
    if variant == "fixed":
        from bench.train_bench import run_cell

        row = run_cell(preset, "loraq", batch, seq, steps, 7, None)
        row["variant"] = "fixed"
        return row
    return peft_cell(preset, variant, batch, seq, examples, steps)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1)
