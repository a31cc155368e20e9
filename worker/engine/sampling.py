"""Greedy samples of a model under training, for `eval_prompts` (shown per checkpoint)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from worker.engine.data import prompt_ids

SAMPLE_TOKENS = 48


@torch.no_grad()
def greedy_samples(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    device: torch.device,
    max_new_tokens: int = SAMPLE_TOKENS,
) -> list[str]:
    """One greedy answer per prompt, each prompt alone (no padding: what a user would get from the
    chat endpoint at temperature 0). The model's train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        answers = []
        for prompt in prompts:
            ids = prompt_ids([{"role": "user", "content": prompt}], tokenizer)
            inputs = torch.tensor([ids], device=device)
            generate: Any = model.generate  # transformers' decorator hides the signature from mypy
            out = generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            answers.append(str(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)))
        return answers
    finally:
        model.train(was_training)
