"""/v1/models says what each base is for: tiny-llama is marked test-only, SmolLM2 names its hub id."""

from __future__ import annotations

from tests.conftest import ApiClient


def test_models_mark_test_only_and_upstream(api: ApiClient) -> None:
    models = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    assert models["tiny-llama"]["use"] == "tests" and models["tiny-llama"]["random"] is True
    assert "tests only" in models["tiny-llama"]["description"]
    smol = models["smollm2-135m-instruct"]
    assert smol["use"] == "fine-tuning" and smol["random"] is False
    assert smol["upstream"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert models["llama-8b"]["use"] == "benchmarks"
