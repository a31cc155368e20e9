"""Tenant isolation: a walk over every /v1 route of the served OpenAPI spec. Tenant B, holding
every id tenant A owns (file, job, checkpoint, fine-tuned model), gets 404 on each route that
takes an id, and cannot use A's files in a job; A gets 200 on the same URLs."""

from __future__ import annotations

import re

from service import jobs
from service.db.session import session_scope
from tests.conftest import DATASET, ApiClient, job_body
from tests.service.test_api_files import assert_error
from tests.service.test_api_jobs import run_job_to_success
from tests.service.test_auth import v1_routes

WEBHOOK_URL = "https://93.184.215.14/hook"  # a public address: no DNS lookup


def test_other_tenant_gets_404_on_every_route_taking_an_id(api: ApiClient) -> None:
    b = api.other
    assert b is not None
    file_id = api.upload(DATASET)
    job = api.create_job(file_id)
    run_job_to_success(api, job["id"])
    with session_scope() as s:
        (ckpt,), _ = jobs.list_checkpoints(s, tenant_id=api.tenant_id, job_id=job["id"], after=None, limit=1)
    owned = {
        "file_id": file_id,
        "fine_tuning_job_id": job["id"],
        "checkpoint_id": ckpt.id,
        "model": api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["fine_tuned_model"],
        "endpoint_id": api.post("/v1/webhook_endpoints", json={"url": WEBHOOK_URL}).json()["id"],
    }
    walked = 0
    for method, path in v1_routes(api):
        params = re.findall(r"{([^}:]+)(?::path)?}", path)
        if not params:
            continue
        unknown = set(params) - set(owned)
        assert not unknown, f"isolation walk does not know how to fill {unknown} in {path}"
        url = re.sub(r"{([^}:]+)(?::path)?}", lambda m: owned[m.group(1)], path)
        if method == "DELETE":
            assert_error(b.request(method, url), 404)
            continue  # A's own delete is exercised in the files tests; keep A's data for the walk
        assert_error(b.request(method, url), 404)
        mine = api.request(method, url)
        # A reaches the same URL (cancelling A's finished job is A's 400, not a 404)
        assert mine.status_code == (200 if method == "GET" else 400), (method, url, mine.text)
        walked += 1
    assert walked >= 8

    # B cannot train on A's file, list A's things, or see A's fine-tune among models.
    assert_error(b.post("/v1/fine_tuning/jobs", json=job_body(file_id)), 404, "training_file")
    assert_error(b.post("/v1/fine_tuning/jobs", json=job_body(file_id, validation_file=file_id)), 404)
    assert b.get("/v1/files").json()["data"] == []
    assert b.get("/v1/fine_tuning/jobs").json()["data"] == []
    assert owned["model"] not in [m["id"] for m in b.get("/v1/models").json()["data"]]
    # A cursor from A's listing is not a way in either.
    assert_error(b.get("/v1/fine_tuning/jobs", params={"after": job["id"]}), 404, "after")
    assert_error(b.get("/v1/files", params={"after": file_id}), 404, "after")
    # A's data is intact after B's attempts.
    assert api.get(f"/v1/files/{file_id}").status_code == 200
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "succeeded"
