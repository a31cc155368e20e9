"""Whether a base model is local: `/v1/models` says so, and with `LORAQ_AUTO_PULL=0` a job on a
model that is not local is refused at submit (400 naming `model`) instead of failing later."""

from __future__ import annotations

import pytest

from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, job_body


def models(api: ApiClient) -> dict[str, dict[str, object]]:
    r = api.get("/v1/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


def test_the_model_list_says_which_base_models_are_local(api: ApiClient) -> None:
    listed = models(api)
    assert listed["smollm2-135m-instruct"]["local"] is False  # a fresh data dir: never pulled
    assert listed["tiny-llama"]["local"] is True  # random-init presets are built on the worker
    assert api.get("/v1/models/smollm2-135m-instruct").json()["local"] is False
    # and that a job would download it (LORAQ_AUTO_PULL is on by default)
    assert listed["smollm2-135m-instruct"]["auto_pull"] is True


def test_without_auto_pull_the_model_list_says_so(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAQ_AUTO_PULL", "0")
    get_settings.cache_clear()
    listed = models(api)
    # the dashboard labels such a model "pull it first", not "downloaded on first use"
    assert listed["smollm2-135m-instruct"]["local"] is False
    assert listed["smollm2-135m-instruct"]["auto_pull"] is False
    assert api.get("/v1/models/smollm2-135m-instruct").json()["auto_pull"] is False


def test_with_auto_pull_a_job_on_a_model_not_local_is_accepted(api: ApiClient) -> None:
    file_id = api.upload(DATASET)
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, model="smollm2-135m-instruct"))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "queued"


def test_without_auto_pull_a_job_on_a_model_not_local_is_refused_naming_model(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAQ_AUTO_PULL", "0")
    get_settings.cache_clear()
    file_id = api.upload(DATASET)
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, model="smollm2-135m-instruct"))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_local"
    assert "loraq models pull smollm2-135m-instruct" in error["message"]
    assert api.post("/v1/fine_tuning/jobs", json=job_body(file_id)).status_code == 200  # tiny-llama is local
