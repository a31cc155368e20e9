"""Serving the real SmolLM2-135M-Instruct (pulled GGUF, dequantized) on the CPU with an adapter it
was fine-tuned into: a short job on the pirate data, stored as the worker stores it (the adapter
zip), read back as the inference worker reads it. A batch mixing that adapter's rows and the base's
rows answers, greedily and token for token, what transformers + PEFT answer for each prompt alone
with the same zip extracted."""

from __future__ import annotations

import copy
import zipfile
from pathlib import Path

import pytest

from service.storage import FileStore
from tests.engine.conftest import smollm2_pirate_config
from tests.engine.test_serving import PROMPTS, peft_greedy
from worker.engine.models import LoadedModel, load_base_model
from worker.engine.recipe import train
from worker.engine.serving import Adapter, GenRequest, ServingModel
from worker.engine.types import NullCallbacks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NEW_TOKENS = 12


def test_smollm2_fine_tuned_adapter_in_a_mixed_batch_equals_peft(pulled_store: Path, tmp_path: Path) -> None:
    base = load_base_model("smollm2-135m-instruct", store=pulled_store)
    # Three steps at a high rate: enough that the adapter's greedy answers leave the base's.
    config = smollm2_pirate_config(pulled_store, tmp_path / "run", max_steps=3, learning_rate=3e-3)
    tuned = LoadedModel(copy.deepcopy(base.model), base.tokenizer, base.name, False)
    adapter_dir = train(config, NullCallbacks(), loaded=tuned).adapter_dir
    stored = FileStore(tmp_path / "artifacts").put_dir_zip(adapter_dir, "job/adapter.zip")
    zipped = FileStore(tmp_path / "artifacts").verify(stored.key, stored.sha256)
    with zipfile.ZipFile(zipped) as zf:
        zf.extractall(tmp_path / "downloaded")

    served = ServingModel(LoadedModel(copy.deepcopy(base.model), base.tokenizer, base.name, False), 2)
    slot = served.adapter_slot("ft", lambda: Adapter.from_zip(zipped))
    rows = [(slot, 0), (0, 0), (slot, 1), (0, 2), (slot, 2)]
    requests = [GenRequest(served.prompt_ids(PROMPTS[p]), NEW_TOKENS, slot=s, temperature=0) for s, p in rows]
    results = served.generate(requests)
    for (s, _), req, res in zip(rows, requests, results, strict=True):
        expected = peft_greedy(base, tmp_path / "downloaded" if s else None, req.prompt_ids, NEW_TOKENS)
        assert res.token_ids == expected
        assert res.text == base.tokenizer.decode(expected, skip_special_tokens=True)
        assert res.completion_tokens == len(expected)
    # the fine-tune changed what the model says (else the comparison above proves little)
    pairs = [(results[0], results[1]), (results[4], results[3])]  # (tuned, base) on prompts 0 and 2
    assert any(tuned.token_ids != plain.token_ids for tuned, plain in pairs)
