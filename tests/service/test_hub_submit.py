"""A job on a Hugging Face Hub base that is not local yet is checked at submit against the Hub
(the suite's own, tests/fake_hub.py, through the real huggingface_hub client): gated, missing,
pickle-only and unsupported repositories answer 400 naming the model and what to do; an
accepted one's config.json lands in the store, so `/v1/models` lists its family, size and
context before any worker pulled it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, job_body
from tests.engine.tiny_families import save_tiny_family
from tests.fake_hub import FakeHub, hub_endpoint
from tests.service.test_submit_families import refused
from worker.engine.catalog import hub_dir, register_local_model

REPO = "tiny-org/tiny-mistral"


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    with hub_endpoint(
        monkeypatch, REPO, save_tiny_family("MistralForCausalLM", tmp_path / "mistral")
    ) as served:
        yield served


def test_hub_bases_are_checked_at_submit_and_listed(
    api: ApiClient, fake_hub: FakeHub, tmp_path: Path
) -> None:
    file_id = api.upload(DATASET)
    models = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    assert REPO not in models  # no job named it yet: the store knows nothing of it

    body = job_body(file_id, model=REPO, lora={"r": 4, "target_modules": ["q_proj", "down_proj"]})
    accepted = api.post("/v1/fine_tuning/jobs", json=body)
    assert accepted.status_code == 200, accepted.text
    assert accepted.json()["model"] == REPO
    listed = api.get(f"/v1/models/{REPO}").json()
    assert {k: listed[k] for k in ("kind", "family", "context_length", "local", "upstream")} == {
        "kind": "hub", "family": "Mistral", "context_length": 256, "local": False, "upstream": REPO,
    }  # fmt: skip
    assert listed["parameters"] == 60640  # tests/engine/test_model_shape.py: transformers' count
    # its tokenizer came with its config: examples too long for max_seq_len are refused now,
    # not by the worker after the download
    long_line = {
        "messages": [{"role": "user", "content": "the cat " * 20}, {"role": "assistant", "content": "yes"}]
    }
    short = job_body(api.upload((json.dumps(long_line) + "\n").encode() * 2), model=REPO, max_seq_len=16)
    assert "longer than max_seq_len 16" in refused(
        api.post("/v1/fine_tuning/jobs", json=short), "max_seq_len", "max_seq_len_too_short"
    )
    smol = api.get("/v1/models/smollm2-135m-instruct").json()
    assert (smol["kind"], smol["family"], smol["parameters"], smol["context_length"]) == (
        "pretrained", "Llama", 134515008, 8192,
    )  # fmt: skip

    for model, code, says in [
        ("nobody/nothing", "model_not_on_hub", f"Hub model nobody/nothing does not exist on {fake_hub.url}"),
        ("tiny-org/gated", "model_gated", "Hub model tiny-org/gated is gated"),
        ("tiny-org/pickled", "unsupported_model", "holds only pickle checkpoints (pytorch_model.bin)"),
        ("tiny-org/moe", "unsupported_model", "unsupported architecture ['Qwen3MoeForCausalLM']"),
    ]:
        if model != "nobody/nothing":
            files = dict(fake_hub.repos[REPO].files)
            if model == "tiny-org/pickled":
                files["pytorch_model.bin"] = files.pop("model.safetensors")
            if model == "tiny-org/moe":
                files["config.json"] = files["config.json"].replace(
                    b"MistralForCausalLM", b"Qwen3MoeForCausalLM"
                )
            fake_hub.publish(model, files, gated_token="hf_x" if model == "tiny-org/gated" else None)
        for dry_run in (False, True):
            message = refused(
                api.post("/v1/fine_tuning/jobs", json=job_body(file_id, model=model, dry_run=dry_run)),
                "model",
                code,
            )
            assert says in message, message
    gated = refused(
        api.post("/v1/fine_tuning/jobs", json=job_body(file_id, model="tiny-org/gated")),
        "model",
        "model_gated",
    )
    assert gated.endswith(
        "accept its terms on its Hub page with your account, then set HF_TOKEN to a token of that account"
    )


def test_a_pulled_hub_base_is_local_and_checked_like_a_directory(api: ApiClient, fake_hub: FakeHub) -> None:
    from worker.engine.pull import pull_model

    pull_model(REPO, get_settings().model_store)
    seen = len(fake_hub.seen)
    file_id = api.upload(DATASET)
    assert api.post("/v1/fine_tuning/jobs", json=job_body(file_id, model=REPO)).status_code == 200
    assert len(fake_hub.seen) == seen  # local: the submit asks the Hub nothing
    assert api.get(f"/v1/models/{REPO}").json()["local"] is True
    # its family's layer names are checked as a local directory's are
    wrong = job_body(file_id, model=REPO, lora={"r": 4, "target_modules": ["qkv_proj"]})
    assert "not a linear layer of model" in refused(
        api.post("/v1/fine_tuning/jobs", json=wrong), "lora.target_modules", "invalid_target_modules"
    )
    # a local directory registered beside it lists its family too
    store = get_settings().model_store
    register_local_model("my-copy", hub_dir(REPO, store), store)
    copy = api.get("/v1/models/my-copy").json()
    assert (copy["kind"], copy["family"], copy["parameters"]) == ("local", "Mistral", 60640)
