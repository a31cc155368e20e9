"""/v1/models says what each base is for: tiny-llama is marked test-only, SmolLM2 names its hub id,
the random-weight presets come after the real bases with a warning, which a job on one carries
too (field and event), naming the real model a near-miss name was probably meant to be."""

from __future__ import annotations

from tests.conftest import DATASET, ApiClient, job_body


def test_models_mark_test_only_and_upstream(api: ApiClient) -> None:
    models = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    assert models["tiny-llama"]["use"] == "tests" and models["tiny-llama"]["random"] is True
    assert "tests only" in models["tiny-llama"]["description"]
    smol = models["smollm2-135m-instruct"]
    assert smol["use"] == "fine-tuning" and smol["random"] is False
    assert smol["upstream"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert models["llama-8b"]["use"] == "benchmarks"


def test_random_presets_come_after_real_bases_and_carry_a_warning(api: ApiClient) -> None:
    models = api.get("/v1/models").json()["data"]
    bases = [m for m in models if not m["id"].startswith("ft:")]
    randoms = [m["random"] for m in bases]
    assert randoms == sorted(randoms) and randoms[0] is False  # real ones first, then the presets
    by_id = {m["id"]: m for m in bases}
    assert by_id["smollm2-135m-instruct"]["warning"] is None
    assert "random weights (for benchmarks only)" in by_id["llama-8b"]["warning"]
    # one word away from the real model: the warning names it
    assert by_id["smollm2-135m"]["warning"].endswith("; did you mean smollm2-135m-instruct?")


def test_a_job_on_random_weights_runs_and_says_so(api: ApiClient) -> None:
    job = api.create_job(api.upload(DATASET), model="smollm2-135m", max_seq_len=128)
    assert job["status"] == "queued"  # accepted: benchmarks need the presets
    assert job["warning"].startswith("smollm2-135m has random weights (for benchmarks only)")
    assert job["warning"].endswith("did you mean smollm2-135m-instruct?")
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["warning"] == job["warning"]
    events = api.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"]
    assert [e["level"] for e in events if e["message"] == job["warning"]] == ["warn"]
    assert api.create_job(api.upload(DATASET))["warning"].startswith(
        "tiny-llama has random weights (for tests only)"
    )


def test_an_unknown_model_near_a_known_one_is_named(api: ApiClient) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=job_body(api.upload(DATASET), model="smollm2-135m-instrct"))
    assert r.status_code == 404, r.text
    message = r.json()["error"]["message"]
    assert "unknown model 'smollm2-135m-instrct'; did you mean 'smollm2-135m-instruct'?" in message
