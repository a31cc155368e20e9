"""The real model on the CPU: SmolLM2-135M-Instruct learns a fixed answer style it does not follow.

tests/data/pirate/ ships 64 training and 16 validation chats whose assistant answers all read
"ARRR! <Topic> be a fine treasure, matey. Yo ho ho!", plus 20 held-out prompts about topics and in
phrasings that appear in neither file. The base model answers none of them that way; after a few
dozen LoRA steps the adapter, exported and loaded back from disk, must answer ≥80% of them in the
style, and the validation loss must fall to at most half of the base model's.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.engine.export import load_adapter
from worker.engine.lora import lora_modules, remove_lora
from worker.engine.models import LoadedModel, load_base_model
from worker.engine.recipe import LoRAFinetuneRecipe
from worker.engine.types import LoraConfig, NullCallbacks, StepMetrics, TrainConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "pirate"
STYLE_PREFIX = "ARRR!"
STEPS = 24  # "a few dozen" optimizer steps of 4 chats: 96 examples, 1.5 epochs of the 64

# Measured 2026-11-23 on the 2-core machine (one other test process beside it): 102 s for 24
# steps, base valid loss 4.73 -> 0.013, style 0% -> 100%.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


class Recorder(NullCallbacks):
    def __init__(self) -> None:
        self.steps: list[StepMetrics] = []

    def on_step(self, metrics: StepMetrics) -> None:
        self.steps.append(metrics)


def greedy_answers(loaded: LoadedModel, prompts: list[str], max_new_tokens: int = 8) -> list[str]:
    """Greedy completions of single-turn chats, batched with left padding."""
    tok = loaded.tokenizer
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    tok.padding_side = "left"
    try:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tok.padding_side = "right"
    loaded.model.eval()
    with torch.no_grad():
        generate: Any = loaded.model.generate
        out = generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    new_tokens = out[:, enc["input_ids"].shape[1] :]
    return [str(text).strip() for text in tok.batch_decode(new_tokens, skip_special_tokens=True)]


def style_rate(answers: list[str]) -> float:
    return sum(a.startswith(STYLE_PREFIX) for a in answers) / len(answers)


def test_smollm2_learns_a_new_answer_style(pulled_store: Path, tmp_path: Path) -> None:
    started = time.monotonic()
    loaded = load_base_model("smollm2-135m-instruct", store=pulled_store)
    prompts = [
        json.loads(line)["prompt"] for line in (DATA / "heldout_prompts.jsonl").read_text().splitlines()
    ]
    base_rate = style_rate(greedy_answers(loaded, prompts))
    assert base_rate <= 0.10, "the base model already follows the style: the test would prove nothing"

    config = TrainConfig(
        model="smollm2-135m-instruct",
        train_file=DATA / "train.jsonl",
        validation_file=DATA / "valid.jsonl",
        output_dir=tmp_path / "run",
        model_store=pulled_store,
        lora=LoraConfig(r=16, alpha=32.0),
        max_seq_len=128,
        batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-3,
        warmup_ratio=0.1,
        eval_every=0,
        seed=0,
        device="cpu",
    )
    recorder = Recorder()
    recipe = LoRAFinetuneRecipe(config, recorder, loaded=loaded)
    try:
        recipe.setup()
        base_valid = recipe.evaluate()  # B = 0: exactly the base model's loss
        result = recipe.train()
    finally:
        recipe.cleanup()
    assert not lora_modules(loaded.model), "cleanup leaves the cached base model pristine"

    assert base_valid is not None and result.final_valid_loss is not None
    assert math.isfinite(result.final_valid_loss)
    assert result.final_valid_loss <= 0.5 * base_valid, (base_valid, result.final_valid_loss)
    assert [m.step for m in recorder.steps] == list(range(1, STEPS + 1))

    # The exported artifact, not the in-memory adapter, is what must have learned the style.
    load_adapter(result.adapter_dir, loaded.model)
    try:
        tuned = greedy_answers(loaded, prompts)
    finally:
        remove_lora(loaded.model)
    assert style_rate(tuned) >= 0.80, tuned
    elapsed = time.monotonic() - started
    print(
        f"\nsmollm2 real-model test: base valid {base_valid:.3f} -> {result.final_valid_loss:.3f}, "
        f"style {base_rate:.0%} -> {style_rate(tuned):.0%}, {elapsed:.0f} s"
    )
