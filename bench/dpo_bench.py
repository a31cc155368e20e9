"""The DPO job path against TRL's DPOTrainer + PEFT (issue 33): `train_bench.py --dpo`.

On the committed preference set (bench/data/preference-longtail.jsonl, made by
bench/preference_dataset.py: pairs of 100-1,000 tokens), per model, in one invocation, each cell
in its own subprocess (train_bench.spawn, as `--job` runs its cells):

  dpo_job           `recipe.train` as the worker calls it with method dpo (worker/engine/dpo.py):
                    packed rows of T tokens holding whole pairs, B rows a step, captured on CUDA,
                    reference log-probabilities computed once before the first step (adapter off)
  trl_padded        TRL `DPOTrainer` on a PEFT LoRA model (bench/peers.py: r=16/alpha=32 on the
                    seven projections, fp32 adapters, bf16 base, fused AdamW), bf16 autocast,
                    E pairs a step padded to the batch's longest sequence, TRL's default reference:
                    a no-grad forward with the adapter disabled in every step
  trl_precomputed   the same with `precompute_ref_log_probs=True` (TRL's reference pass runs once
                    before training, as ours does): reported, not the issue's target

Both sides: beta 0.1, the sigmoid loss plus rpo_alpha (our default, 1) × the chosen answers' NLL per
token (ours: `DpoTraining.rpo_alpha`; TRL 1.16: `loss_type=["sigmoid", "sft"]`,
`loss_weights=[1, rpo_alpha]`, the same term: tests/engine/test_dpo_trl.py), clipping at 1.0, no
gradient checkpointing, lr 1e-4.

What tokens/s counts (the same on both sides): every real (non-padding) token a step feeds
forward -- a pair is two sequences, prompt + chosen and prompt + rejected, so its prompt counts
twice (our `StepMetrics.tokens`: Σ of the step's rows' tokens; TRL: Σ of the step's
`attention_mask`). `trainable_tok_s` counts the answer tokens only. Timed: the steps after the
warm-up (ours: the recipe's own step seconds after `warmup` steps, its reference pass before
step 1 excluded and reported as `prepare_s`; TRL: wall time between the ends of the warm-up's
last step and the last step, synchronised). Peak memory: `torch.cuda.max_memory_allocated` over
the whole cell, model load included.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.job_bench import StepCollector
from worker.engine.training_config import AUTO_RPO_ALPHA

if TYPE_CHECKING:
    from worker.engine.types import DeviceName

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "bench" / "data" / "preference-longtail.jsonl"
BETA = 0.1
RPO_ALPHA = AUTO_RPO_ALPHA  # the job's default weight of the chosen answers' NLL, on both sides
# (rows B of T tokens for dpo_job, TRL pairs per step E, timed steps, warm-up steps) per preset:
# B·T = 8,192 packed tokens hold ~20 pairs (mean 404 tokens); E = 8 pairs is 16 padded sequences
DPO_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "llama-1b": (4, 2048, 8, 40, 8),
    "smollm2-135m": (4, 2048, 8, 60, 8),
    "tiny-llama": (1, 2048, 2, 1, 1),  # the CPU plumbing test (tests/deploy/test_dpo_bench.py)
}
VARIANTS = ("dpo_job", "trl_padded", "trl_precomputed")
GOAL_RATIO = 4.0  # dpo_job tokens/s >= 4x trl_padded, peak memory <= trl_padded's


class TimedCollector(StepCollector):
    """StepCollector that also notes when the DPO preparation starts and the first step reports."""

    def __init__(self) -> None:
        super().__init__()
        self.prepare_at: float | None = None
        self.first_step_at: float | None = None

    def on_step(self, metrics: Any) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()
        super().on_step(metrics)

    def on_event(self, level: str, message: str, data: Any = None) -> None:
        if message.startswith("Preparing DPO"):
            self.prepare_at = time.perf_counter()
        super().on_event(level, message, data)


def _memory(device: DeviceName) -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if device == "cuda" else None


def dpo_job_cell(
    preset: str, batch: int, seq: int, steps: int, warmup: int, data: Path, device: DeviceName
) -> dict[str, Any]:
    import torch

    from bench.job_bench import job_config, job_readings
    from worker.engine.data import load_dataset
    from worker.engine.recipe import train
    from worker.engine.tiny import build_tiny_tokenizer
    from worker.engine.training_config import DpoTraining

    tmp = Path(tempfile.mkdtemp())
    config = job_config(
        preset, batch, seq, steps, tmp, train_file=data, warmup=warmup, device=device,
        method=DpoTraining(beta=BETA, rpo_alpha=RPO_ALPHA),
    )  # fmt: skip
    rec = TimedCollector()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    result = train(config, rec)
    wall = time.time() - t0
    tokens = load_dataset(data, build_tiny_tokenizer(), seq, pack=True)
    readings = job_readings(rec, result, warmup, tokens.trainable_tokens / tokens.tokens, _memory(device))
    prepare = rec.first_step_at - rec.prepare_at if rec.prepare_at and rec.first_step_at else None
    return {
        "model": preset,
        "variant": "dpo_job",
        "batch": batch,
        "seq": seq,
        **readings,
        "losses_first": [round(m.train_loss, 5) for m in rec.steps[:5]],
        # the reference pass + the first step (eager warm-up / capture): not in tok_s
        "prepare_s": round(prepare, 2) if prepare is not None else None,
        "run_wall_s": round(wall, 1),
    }


def trl_pairs(data: Path, count: int) -> list[dict[str, Any]]:
    """`count` pairs of the file in a seeded random order, in TRL's conversational columns."""
    lines = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    random.Random(0).shuffle(lines)
    picked = [lines[i % len(lines)] for i in range(count)]
    return [
        {
            "prompt": r["input"]["messages"],
            "chosen": r["preferred_output"],
            "rejected": r["non_preferred_output"],
        }
        for r in picked
    ]


def trl_cell(
    preset: str,
    variant: str,
    seq: int,
    examples: int,
    steps: int,
    warmup: int,
    data: Path,
    device: DeviceName,
) -> dict[str, Any]:
    """TRL's DPOTrainer on E pairs a step, one epoch over E·(warm-up + steps) pairs."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from bench.peers import peft_peer_model
    from worker.engine.tiny import build_tiny_tokenizer

    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model, _, opt = peft_peer_model(preset, max_positions=seq, device=device)
    counted = {"tokens": 0, "trainable": 0, "slots": 0, "steps": 0}
    pairs = examples * (warmup + steps)
    marks: list[float] = []

    class Counting(trl.DPOTrainer):
        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if counted["steps"] >= warmup:  # the timed steps' real tokens (prompt twice a pair)
                counted["tokens"] += int(inputs["attention_mask"].sum())
                counted["trainable"] += int(inputs["completion_mask"].sum())
                counted["slots"] += inputs["attention_mask"].numel()  # (2E, longest) padded
            counted["steps"] += 1
            return super().training_step(model, inputs, *args, **kwargs)

    class Clock(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    args = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_cpu=not cuda,
        bf16=cuda,
        per_device_train_batch_size=examples,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_steps=warmup + steps,
        beta=BETA,
        loss_type=["sigmoid", "sft"],  # TRL's former rpo_alpha: the chosen answers' token-mean NLL
        loss_weights=[1.0, RPO_ALPHA],
        max_length=seq,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        precompute_ref_log_probs=variant == "trl_precomputed",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
    )
    trainer = Counting(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(trl_pairs(data, pairs)),
        processing_class=build_tiny_tokenizer(),
        optimizers=(opt, None),
        callbacks=[Clock()],
    )
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    seconds = marks[-1] - marks[warmup - 1]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "model": preset,
        "variant": variant,
        "batch": examples,
        "seq": seq,
        "steps_timed": len(marks) - warmup,
        "tok_s": round(counted["tokens"] / seconds),
        "trainable_tok_s": round(counted["trainable"] / seconds),
        "step_ms": round(1e3 * seconds / (len(marks) - warmup), 2),
        "padding_fraction": round(1 - counted["tokens"] / counted["slots"], 4),
        "mem_gib": round(m / 2**30, 2) if (m := _memory(device)) is not None else None,
        "mem_bytes": _memory(device),
        "losses_first": [round(x, 5) for x in losses[:5]],
        "loss_curve": losses,
        "pairs": pairs,
        "run_wall_s": round(wall, 1),
    }


def cells(
    presets: list[str],
    data: Path,
    steps: int | None,
    warmup: int | None,
    variants: tuple[str, ...] = VARIANTS,
) -> list[list[str]]:
    """The subprocess argument lists of one `--dpo` invocation, preset by preset."""
    out: list[list[str]] = []
    for preset in presets:
        batch, seq, examples, n, w = DPO_SHAPES[preset]
        n, w = steps or n, warmup or w
        for variant in variants:
            out.append(
                [
                    "--dpo-cell",
                    preset,
                    variant,
                    str(batch),
                    str(seq),
                    str(examples),
                    str(n),
                    str(w),
                    str(data),
                ]
            )
    return out


def run_dpo_cell(args: list[str]) -> dict[str, Any]:
    import torch

    preset, variant = args[0], args[1]
    batch, seq, examples, steps, warmup = (int(x) for x in args[2:7])
    data = Path(args[7])
    device: DeviceName = "cuda" if torch.cuda.is_available() else "cpu"
    if variant == "dpo_job":
        return dpo_job_cell(preset, batch, seq, steps, warmup, data, device)
    return trl_cell(preset, variant, seq, examples, steps, warmup, data, device)


def summarize(result: dict[str, Any]) -> None:
    """Per model: `ratios` (dpo_job / trl_padded and / trl_precomputed tokens/s, dpo_job /
    trl_padded peak memory) and `goals` (>= 4x trl_padded's tokens/s at no more memory)."""
    by = {(r["model"], r["variant"]): r for r in result["rows"] if "error" not in r}
    ratios: dict[str, Any] = {}
    goals: dict[str, Any] = {}
    for model in dict.fromkeys(r["model"] for r in result["rows"]):
        job, padded = by.get((model, "dpo_job")), by.get((model, "trl_padded"))
        if job is None or padded is None:
            continue
        r: dict[str, Any] = {"tok_s_vs_trl_padded": round(job["tok_s"] / padded["tok_s"], 2)}
        pre = by.get((model, "trl_precomputed"))
        if pre is not None:
            r["tok_s_vs_trl_precomputed"] = round(job["tok_s"] / pre["tok_s"], 2)
        mem_ok = None
        if job["mem_bytes"] is not None and padded["mem_bytes"] is not None:
            r["mem_vs_trl_padded"] = round(job["mem_bytes"] / padded["mem_bytes"], 3)
            mem_ok = job["mem_bytes"] <= padded["mem_bytes"]
        ratios[model] = r
        goals[model] = {
            "tok_s_ratio_goal": GOAL_RATIO,
            "met": bool(r["tok_s_vs_trl_padded"] >= GOAL_RATIO and mem_ok),
        }
    result["ratios"] = ratios
    result["goals"] = goals


def data_stats(data: Path) -> dict[str, Any]:
    from bench.chat_dataset import length_stats
    from bench.preference_dataset import pair_lengths

    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    stats: dict[str, Any] = length_stats(pair_lengths(rows))
    stats["file"] = str(data.relative_to(ROOT)) if data.is_relative_to(ROOT) else str(data)
    return stats


def run_dpo_mode(args: Any) -> int:
    """`train_bench.py --dpo`: every cell of every preset, the JSON rewritten after each."""
    import sys

    import torch

    from bench.train_bench import record_row, run_header, spawn

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    gpu = device.split()[-1].lower().replace("/", "-") if cuda else "cpu"
    date = time.strftime("%Y-%m-%d", time.gmtime())
    out = args.out or ROOT / "bench" / "results" / f"dpo-{gpu}-{date}.json"
    given = "--presets" in sys.argv
    presets = [p for p in (args.presets.split(",") if given else ["llama-1b"]) if p in DPO_SHAPES]
    data = Path(args.dpo_data).resolve()
    steps = args.steps if "--steps" in sys.argv else None
    warmup = args.warmup if "--warmup" in sys.argv else None
    variants = (
        tuple(v for v in args.variants.split(",") if v in VARIANTS) if "--variants" in sys.argv else VARIANTS
    )
    result: dict[str, Any] = {
        **run_header(device),
        "rpo_alpha": RPO_ALPHA,
        "settings": f"beta {BETA}, sigmoid loss + {RPO_ALPHA} x the chosen answers' NLL per token (TRL: "
        f"loss_type sigmoid+sft, loss_weights [1, {RPO_ALPHA}]); LoRA r=16 alpha=32 on "
        "q,k,v,o,gate,up,down; bf16 base, "
        "fp32 adapters; fused AdamW lr 1e-4; clip 1.0; no gradient checkpointing. dpo_job = recipe.train "
        "(method dpo, packing on, reference precomputed); trl_padded = TRL DPOTrainer + PEFT, padded "
        "batches, reference forward every step (TRL's default); trl_precomputed = the same with "
        "precompute_ref_log_probs. tok_s: real tokens of prompt+chosen and prompt+rejected (the prompt "
        "twice a pair) per second of the timed steps",
        "shapes": {p: DPO_SHAPES[p] for p in presets},
        "shape_fields": ["rows B", "row tokens T", "TRL pairs a step E", "timed steps", "warm-up steps"],
        "dataset": data_stats(data),
        "rows": [],
    }
    print(json.dumps(result["dataset"]), flush=True)
    for cell in cells(presets, data, steps, warmup, variants):
        row = spawn(cell, args.cell_timeout)
        row.setdefault("model", cell[1])
        row.setdefault("variant", cell[2])
        record_row(result, row, summarize, out)
    print(json.dumps({"ratios": result["ratios"], "goals": result["goals"]}, indent=1))
    print("wrote", out)
    return 0
