"""DPO through the API (issue 33, points 1 and 2): OpenAI's `method` (supervised, dpo, refused
reinforcement), the job object's echo of it, the typed method from request to the engine's config,
and the preference file format at upload and at submit. The real app on a real database; the
official `openai` client unmodified."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest

from service import jobs
from service.db.session import session_scope
from tests.conftest import DATASET, ApiClient, job_body
from tests.service.test_api_files import assert_error
from tests.service.test_openai_client import asgi_openai
from worker.engine.training_config import DpoTraining, SupervisedTraining
from worker.engine.types import TrainConfig


def preference_line(i: int = 0) -> dict[str, Any]:
    return {
        "input": {
            "messages": [{"role": "user", "content": f"hello {i}"}],
            "tools": [],
            "parallel_tool_calls": True,
        },
        "preferred_output": [{"role": "assistant", "content": "Ahoy, matey!"}],
        "non_preferred_output": [{"role": "assistant", "content": "Hello."}],
    }


PAIRS = b"".join(json.dumps(preference_line(i)).encode() + b"\n" for i in range(4))


def dpo_body(file_id: str, **spec: Any) -> dict[str, Any]:
    body = job_body(file_id, **spec)
    del body["hyperparameters"]
    return body


def test_dpo_job_echoes_method_and_reaches_the_engine_typed(api: ApiClient, tmp_path: Path) -> None:
    file_id = api.upload(PAIRS)
    assert api.get(f"/v1/files/{file_id}").json()["status"] == "processed"
    # rpo_alpha: Loraq's extension beside OpenAI's beta, taken and echoed the same way
    hp = {"beta": 0.25, "rpo_alpha": 0.5, "n_epochs": 2, "batch_size": 1, "learning_rate_multiplier": "auto"}
    r = api.post(
        "/v1/fine_tuning/jobs", json=dpo_body(file_id, method={"type": "dpo", "dpo": {"hyperparameters": hp}})
    )
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["method"] == {"type": "dpo", "dpo": {"hyperparameters": hp}}
    assert job["hyperparameters"] == {"n_epochs": 2, "batch_size": 1, "learning_rate_multiplier": "auto"}
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json() == job
    with session_scope() as session:
        claim = jobs.claim(session, job_id=job["id"], worker_id="test-worker")
    assert claim is not None and claim.training.method == DpoTraining(beta=0.25, rpo_alpha=0.5)
    # as the worker builds its engine config from the claim (worker.runner.build_train_config)
    config = TrainConfig.build(
        claim.training, model=claim.model, train_file=tmp_path, output_dir=tmp_path, model_store=tmp_path
    )
    assert config.method == DpoTraining(beta=0.25, rpo_alpha=0.5)
    assert config.n_epochs == 2 and config.batch_size == 1
    # beta and rpo_alpha "auto" stay "auto" until the run is planned, then show 0.1 and 1
    auto = api.post("/v1/fine_tuning/jobs", json=dpo_body(file_id, method={"type": "dpo"})).json()
    assert auto["method"]["dpo"]["hyperparameters"]["beta"] == "auto"
    assert auto["method"]["dpo"]["hyperparameters"]["rpo_alpha"] == "auto"
    with session_scope() as session:
        planned = jobs.claim(session, job_id=auto["id"], worker_id="test-worker")
    assert planned is not None and planned.training.method == DpoTraining()
    assert DpoTraining().rpo_alpha_value == 1.0 and DpoTraining().beta_value == 0.1
    # DPO alone: rpo_alpha 0
    alone = {"type": "dpo", "dpo": {"hyperparameters": {"rpo_alpha": 0}}}
    r = api.post("/v1/fine_tuning/jobs", json=dpo_body(file_id, method=alone))
    assert r.status_code == 200, r.text
    assert r.json()["method"]["dpo"]["hyperparameters"]["rpo_alpha"] == 0


def test_supervised_method_and_top_level_hyperparameters_still_work(api: ApiClient) -> None:
    file_id = api.upload(DATASET)
    job = api.create_job(file_id)  # top-level hyperparameters
    assert job["method"] == {"type": "supervised", "supervised": {"hyperparameters": job["hyperparameters"]}}
    with session_scope() as session:
        claim = jobs.claim(session, job_id=job["id"], worker_id="test-worker")
    assert claim is not None and claim.training.method == SupervisedTraining()


def test_unsupported_and_inconsistent_methods_are_400(api: ApiClient) -> None:
    sft, pairs = api.upload(DATASET), api.upload(PAIRS)
    rl = {"type": "reinforcement", "reinforcement": {"grader": {"type": "string_check"}}}
    err = assert_error(api.post("/v1/fine_tuning/jobs", json=dpo_body(sft, method=rl)), 400, "method.type")
    assert err["code"] == "unsupported_method"
    assert "'supervised'" in str(err["message"]) and "'dpo'" in str(err["message"])
    # the top-level hyperparameters belong to supervised jobs
    with_top = job_body(pairs, method={"type": "dpo"})
    assert_error(api.post("/v1/fine_tuning/jobs", json=with_top), 400, "hyperparameters")
    # a block for another type than method.type
    mixed = dpo_body(pairs, method={"type": "dpo", "supervised": {"hyperparameters": {"n_epochs": 1}}})
    assert_error(api.post("/v1/fine_tuning/jobs", json=mixed), 400, "method.supervised")
    bad_beta = dpo_body(pairs, method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0}}})
    assert_error(api.post("/v1/fine_tuning/jobs", json=bad_beta), 400)
    for alpha in (-1, "high"):
        bad_alpha = dpo_body(pairs, method={"type": "dpo", "dpo": {"hyperparameters": {"rpo_alpha": alpha}}})
        err = assert_error(api.post("/v1/fine_tuning/jobs", json=bad_alpha), 400)
        assert "rpo_alpha" in str(err["param"]) + str(err["message"])
    # an extension of DPO's block only
    sft_alpha = {"type": "supervised", "supervised": {"hyperparameters": {"rpo_alpha": 1}}}
    assert_error(api.post("/v1/fine_tuning/jobs", json=dpo_body(sft, method=sft_alpha)), 400)


def test_file_format_must_match_the_method_at_submit(api: ApiClient) -> None:
    sft, pairs = api.upload(DATASET), api.upload(PAIRS)
    err = assert_error(
        api.post("/v1/fine_tuning/jobs", json=dpo_body(sft, method={"type": "dpo"})), 400, "training_file"
    )
    assert (
        err["code"] == "invalid_file_format"
        and sft in str(err["message"])
        and "preferred_output" in str(err["message"])
    )
    err = assert_error(api.post("/v1/fine_tuning/jobs", json=job_body(pairs)), 400, "training_file")
    assert pairs in str(err["message"]) and "dpo" in str(err["message"])
    body = dpo_body(pairs, method={"type": "dpo"}, validation_file=sft)
    assert_error(api.post("/v1/fine_tuning/jobs", json=body), 400, "validation_file")
    # a dry run refuses it as the submit does, before asking a worker to plan
    dry = dpo_body(sft, method={"type": "dpo"}, dry_run=True)
    assert_error(api.post("/v1/fine_tuning/jobs", json=dry), 400, "training_file")


def test_bad_preference_lines_are_named_at_upload(api: ApiClient) -> None:
    good = preference_line()
    two = {**good, "preferred_output": good["preferred_output"] * 2}
    user = {**good, "non_preferred_output": [{"role": "user", "content": "x"}]}
    no_input = {k: v for k, v in good.items() if k != "input"}
    lines = [good, two, good, user, no_input]
    file_id = api.upload(b"".join(json.dumps(x).encode() + b"\n" for x in lines))
    f = api.get(f"/v1/files/{file_id}").json()
    assert f["status"] == "error"
    details = f["status_details"]
    assert details.startswith("3 bad line(s): line 2: field 'preferred_output' must be a list of exactly one")
    assert "line 4: non_preferred_output[0] must have role 'assistant'" in details
    assert "line 5: missing field 'input'" in details


async def client_flow(api: ApiClient) -> None:
    async with asgi_openai(api.key) as client:
        f = await client.files.create(file=("pairs.jsonl", PAIRS), purpose="fine-tune")
        job = await client.fine_tuning.jobs.create(
            model="tiny-llama",
            training_file=f.id,
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 1}}},
            extra_body={"lora": {"r": 4, "alpha": 8}, "max_seq_len": 64},
        )
        assert job.method is not None and job.method.type == "dpo"
        assert job.method.dpo is not None and job.method.dpo.hyperparameters is not None
        assert job.method.dpo.hyperparameters.beta == 0.2 and job.method.dpo.hyperparameters.n_epochs == 1
        again = await client.fine_tuning.jobs.retrieve(job.id)
        assert again.method == job.method
        with pytest.raises(openai.BadRequestError) as refused:
            await client.fine_tuning.jobs.create(
                model="tiny-llama", training_file=f.id, method={"type": "reinforcement"}
            )
        assert refused.value.code == "unsupported_method"


def test_openai_client_method_argument(api: ApiClient) -> None:
    asyncio.run(client_flow(api))
