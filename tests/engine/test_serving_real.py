"""Serving the real SmolLM2-135M-Instruct (pulled GGUF, dequantized) on the CPU: a batch mixing an
adapter's rows and the base's rows answers, greedily, exactly what transformers + PEFT answer for
each prompt alone."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.engine.test_serving import PROMPTS, make_adapter, peft_greedy
from worker.engine.models import LoadedModel, load_base_model
from worker.engine.serving import GenRequest, ServingModel
from worker.engine.types import LoraConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NEW_TOKENS = 12


def test_smollm2_mixed_batch_equals_peft(pulled_store: Path, tmp_path: Path) -> None:
    base = load_base_model("smollm2-135m-instruct", store=pulled_store)
    adapter = make_adapter(base, tmp_path / "a", seed=3, cfg=LoraConfig(r=8, alpha=16), b_std=0.02)
    served = ServingModel(LoadedModel(copy.deepcopy(base.model), base.tokenizer, base.name, False), 2)
    slot = served.adapter_slot("a", lambda: adapter)
    rows = [(slot, 0), (0, 0), (slot, 1), (0, 2), (slot, 2)]
    requests = [GenRequest(served.prompt_ids(PROMPTS[p]), NEW_TOKENS, slot=s, temperature=0) for s, p in rows]
    results = served.generate(requests)
    tuned_differs = False
    for (s, _), req, res in zip(rows, requests, results, strict=True):
        expected = peft_greedy(base, tmp_path / "a" if s else None, req.prompt_ids, NEW_TOKENS)
        assert res.text == base.tokenizer.decode(expected, skip_special_tokens=True)
        assert res.completion_tokens == len(expected)
        tuned_differs |= bool(s) and res.text != results[1].text
    assert tuned_differs
