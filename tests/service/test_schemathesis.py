"""Property-based API tests from the served OpenAPI spec (Schemathesis), with a valid key and a
real database (SQLite and PostgreSQL): no 5xx, and every response conforms to the documented
status codes, content types and schemas. Cases that fit the schema and cases that do not (its
negative mode) are both sent. Bounded: `MAX_EXAMPLES` generated cases per operation.

Random ids only reach the 404 paths, so the tenant first gets real objects (`real_ids`): files, a
queued, a running and a succeeded job (metrics, a checkpoint, an adapter, a results file), their
checkpoint and fine-tuned model names. Most generated cases then have their ids (path parameters,
`after` cursors, a job's `training_file`/`validation_file`) replaced by real ones, which is where
the deep paths are: cancelling a finished job, metrics past the last step, a submit on a real file.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import negative_data_rejection, not_a_server_error, positive_data_acceptance
from schemathesis.core.result import Ok
from schemathesis.generation.modes import GenerationMode

from service import jobs
from service.db.session import session_scope
from tests.conftest import DATASET, ApiClient
from tests.service.test_api_jobs import run_job_to_success

MAX_EXAMPLES = 25
# Chat completions and dry runs are answered by a `loraq inference` worker, which this test does
# not start: a valid request gets the documented 503 `no_inference_worker`; any other 5xx fails.
NEEDS_INFERENCE_WORKER = {"POST /v1/chat/completions", "POST /v1/fine_tuning/jobs"}
# Where a generated value is replaced by a real one: path parameters, and these body fields.
BODY_IDS = {
    "POST /v1/fine_tuning/jobs": {"training_file": "file_id", "validation_file": "file_id", "model": "base"},
    "POST /v1/chat/completions": {"model": "model"},
    "POST /v1/webhook_endpoints": {"url": "webhook_url"},
}
# The webhook URL policy refuses most strings the schema allows (no https, no host, a host that does
# not resolve): a documented 400 `invalid_webhook_url`, not "valid data rejected".
# Operations whose well-formed bodies may break rules no JSON schema states (a webhook URL's host;
# a chat's tool message answering a call made earlier in the conversation): a 400 naming the field
# is their documented answer, not "valid data rejected". 5xx and undocumented statuses still fail.
SEMANTIC_400 = {"POST /v1/webhook_endpoints", "POST /v1/chat/completions"}


def real_ids(api: ApiClient) -> dict[str, list[str]]:
    """The tenant's objects, by the parameter names that take them."""
    files = [api.upload(DATASET) for _ in range(3)]
    done, running, queued = (api.create_job(files[0])["id"] for _ in range(3))
    run_job_to_success(api, done)
    with session_scope() as s:
        assert jobs.claim(s, job_id=running, worker_id="schemathesis-worker") is not None
        (ckpt,), _ = jobs.list_checkpoints(s, tenant_id=api.tenant_id, job_id=done, after=None, limit=1)
    finished = api.get(f"/v1/fine_tuning/jobs/{done}").json()
    job_ids = [done, running, queued]
    checkpoint_model = api.get(f"/v1/fine_tuning/jobs/{done}/checkpoints").json()["data"][0]
    webhook_url = "https://93.184.215.14/hook"  # a public address: no DNS lookup
    endpoint = api.post("/v1/webhook_endpoints", json={"url": webhook_url}).json()["id"]
    return {
        "file_id": files,
        "fine_tuning_job_id": job_ids,
        "job_id": job_ids,
        "checkpoint_id": [ckpt.id],
        "model": [
            finished["fine_tuned_model"],
            checkpoint_model["fine_tuned_model_checkpoint"],
            "tiny-llama",
        ],
        "base": ["tiny-llama"],
        "after": [*job_ids, *files],
        "endpoint_id": [endpoint],
        "webhook_url": [webhook_url],
    }


def use_real_ids(case: Any, ids: dict[str, list[str]], data: st.DataObject) -> bool:
    """Replace, in three cases of four each, a generated id (a string) by a real one; whether any was."""
    replaced = False

    def real(name: str, generated: object) -> str | None:
        nonlocal replaced
        if name not in ids or not isinstance(generated, str) or not data.draw(st.integers(0, 3), label=name):
            return None
        replaced = True
        return data.draw(st.sampled_from(ids[name]), label=f"real {name}")

    for params in (case.path_parameters, case.query):
        for name, generated in list((params or {}).items()):
            if (value := real(name, generated)) is not None:
                params[name] = value
    if isinstance(case.body, dict):
        for field, kind in BODY_IDS.get(case.operation.label, {}).items():
            if (value := real(kind, case.body.get(field))) is not None:
                case.body[field] = value
    return replaced


def test_api_conforms_to_its_schema(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_INFERENCE_TIMEOUT_SECONDS", "1")  # no worker: its 503 comes at once
    monkeypatch.setenv("LORAQ_MAX_QUEUED_JOBS_PER_TENANT", "1000")  # real submits get past the 429
    get_settings.cache_clear()
    ids = real_ids(api)
    schema = schemathesis.openapi.from_asgi("/openapi.json", api.client.app).include(
        path_regex="^/(v1/|healthz|dashboard/api/)"
    )
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result.err()
        operations.append(result.ok())
    assert len(operations) >= 15
    failures: dict[str, str] = {}
    statuses: dict[str, set[int]] = {}
    for op in operations:

        @given(case=st.one_of(op.as_strategy(), op.as_strategy(GenerationMode.NEGATIVE)), data=st.data())
        @settings(
            max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case: Any, data: st.DataObject) -> None:
            label = op.label  # noqa: B023 - check() runs in this iteration
            # Negative cases are sent with the key (a case without it is a 401 test of its own), and
            # unknown query parameters are ignored, as OpenAI's API does: such a case is answered,
            # not "schema-violating request accepted". Any 5xx or undocumented status still fails.
            excluded = [negative_data_rejection]
            if label in NEEDS_INFERENCE_WORKER:
                excluded.append(not_a_server_error)
            if use_real_ids(case, ids, data) or label in SEMANTIC_400:
                # A real object's state may refuse a well-formed request, as documented (cancelling
                # a finished job: 400, a file in use: 409): not "valid data rejected".
                excluded.append(positive_data_acceptance)
            response = case.call_and_validate(headers=api.headers, excluded_checks=excluded)
            if response.status_code >= 500:
                assert response.json()["error"]["code"] == "no_inference_worker", response.text
            statuses.setdefault(label, set()).add(response.status_code)

        try:
            check()
        except (
            Exception,
            BaseExceptionGroup,
        ) as e:  # collect every operation's first failure, then report them all
            failures[op.label] = f"{type(e).__name__}: {e}"[:2000]
    print(f"schemathesis: {len(operations)} operations, {sum(map(len, statuses.values()))} distinct statuses")
    for label, seen in sorted(statuses.items()):
        print(f"  {label}: {sorted(seen)}")
    assert not failures, "\n\n".join(f"{k}\n{v}" for k, v in failures.items())
    # the real ids reached past the 404s: real objects were read
    for label in ("GET /v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints", "GET /v1/files/{file_id}"):
        assert 200 in statuses[label], (label, statuses[label])


def test_every_integer_parameter_has_an_upper_bound(api: ApiClient) -> None:
    """An unbounded integer reaches the database as one it cannot hold (PostgreSQL's INTEGER ends
    at 2**31 - 1, SQLite's at 2**63 - 1): a 500. The schema bounds each, the route answers 400."""
    spec = api.client.get("/openapi.json").json()
    integers = [
        (f"{method.upper()} {path}", param["name"], schema)
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
        for param in op.get("parameters", [])
        for schema in param["schema"].get("anyOf", [param["schema"]])
        if schema.get("type") == "integer"
    ]
    assert len(integers) >= 5
    assert [(op, name) for op, name, schema in integers if "maximum" not in schema] == []
    job = api.create_job(api.upload(DATASET))["id"]
    run_job_to_success(api, job)
    url = f"/dashboard/api/jobs/{job}/metrics"
    assert api.get(url, params={"after": 2**31 - 1}).json()["data"] == []
    for after in (2**31, 2**63, 2**64):
        r = api.get(url, params={"after": after})
        assert r.status_code == 400 and r.json()["error"]["param"] == "after", r.text
