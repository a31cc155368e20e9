"""The inference worker's base models (`InferenceWorker.model`, worker/inference.py): an LRU of
`inference_max_models` that unloads the least recently used idle model to load another; a model
with rows decoding is never unloaded, and while every loaded model decodes, a request for another
waits (`ModelsBusy`). The bases are tiny-llama and two copies of it registered as local models."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from service.settings import get_settings
from worker.engine.catalog import register_local_model
from worker.engine.models import LoadedModel
from worker.inference import InferenceWorker, ModelsBusy

COPIES = ("tiny-a", "tiny-b")


@pytest.fixture(scope="module")
def data_dir(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir whose model store has tiny-llama's copies registered (tiny-llama is built-in)."""
    data = tmp_path_factory.mktemp("data")
    store = data / "models"
    store.mkdir()
    for name in COPIES:
        directory = data / name
        tiny.model.save_pretrained(directory, safe_serialization=True)
        tiny.tokenizer.save_pretrained(directory)
        register_local_model(name, directory, store)
    return data


def worker(data_dir: Path, max_models: int = 2) -> InferenceWorker:
    # Never started: `model` needs no Redis (the client connects on first use).
    settings = get_settings().model_copy(update={"data_dir": data_dir, "inference_max_models": max_models})
    return InferenceWorker(settings, worker_id="test")


def decoding(w: InferenceWorker, name: str) -> None:
    """Mark `name` as having a row decoding: the LRU asks only whether its batch has rows."""
    from worker.engine.serving import DecodeBatch

    w.batches[name] = DecodeBatch(rows=[cast(Any, "a row")])


def test_loading_past_the_lru_unloads_the_least_recently_used(data_dir: Path) -> None:
    w = worker(data_dir)
    first = w.model("tiny-a")
    w.model("tiny-b")
    assert w.model("tiny-a") is first  # loaded once, and now the most recently used
    w.model("tiny-llama")
    assert list(w.models) == ["tiny-a", "tiny-llama"]  # tiny-b, not the first loaded, went


def test_a_decoding_model_is_not_unloaded(data_dir: Path) -> None:
    w = worker(data_dir)
    busy = w.model("tiny-a")
    w.model("tiny-b")
    decoding(w, "tiny-a")  # the least recently used, but decoding
    w.model("tiny-llama")
    assert list(w.models) == ["tiny-a", "tiny-llama"] and w.models["tiny-a"] is busy


def test_while_every_model_decodes_another_waits(data_dir: Path) -> None:
    w = worker(data_dir)
    for name in COPIES:
        w.model(name)
        decoding(w, name)
    with pytest.raises(ModelsBusy):
        w.model("tiny-llama")
    assert list(w.models) == list(COPIES)  # nothing unloaded for a load that did not happen
    w.batches["tiny-a"].rows.clear()  # its rows finished
    w.model("tiny-llama")
    assert list(w.models) == ["tiny-b", "tiny-llama"]


def test_repeating_calls_while_its_block_runs_survives_a_failing_call_and_stops_after() -> None:
    # what keeps a chat request alive while its base model loads (a "loading" event each period)
    import time

    from worker.inference import repeating

    calls: list[float] = []

    def call() -> None:
        calls.append(time.monotonic())
        raise ConnectionError("Redis went away")  # logged; the next call still comes

    with repeating(0.005, call):
        time.sleep(0.1)
    made = len(calls)
    assert made >= 3
    time.sleep(0.05)
    assert len(calls) == made  # none after the block
    with repeating(0.005, None):  # nothing to repeat: a plain block
        pass
