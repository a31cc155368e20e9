"""Per-tenant limits: 429 on queued jobs, the running-job limit at start (with fair share), and
the per-key request rate limit (a fixed window counted in the real local Redis)."""

from __future__ import annotations

import time

import pytest

from service import jobs, ratelimit
from service.db.session import session_scope
from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, job_body


def set_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(f"LORAQ_{name.upper()}", value)
    get_settings.cache_clear()


def post_job(api: ApiClient, file_id: str, **headers: str) -> object:
    return api.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers=headers)


def test_queued_jobs_per_tenant_limit(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, max_queued_jobs_per_tenant="2")
    file_id = api.upload(DATASET)
    first = api.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers={"Idempotency-Key": "k1"})
    assert first.status_code == 200
    api.create_job(file_id)
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id))
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "too_many_queued_jobs"
    assert "2 jobs waiting to start" in err["message"] and "limit is 2" in err["message"]
    # a retried request (same Idempotency-Key) still gets its job, not a 429
    again = api.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers={"Idempotency-Key": "k1"})
    assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
    # the limit is per tenant
    assert api.other is not None
    api.other.create_job(api.other.upload(DATASET))
    # a cancelled job frees its place
    assert api.post(f"/v1/fine_tuning/jobs/{first.json()['id']}/cancel").status_code == 200
    api.create_job(file_id)


def assert_waits_for_a_running_slot(api: ApiClient, job_id: str) -> None:
    """The job is queued and says, on itself and in its events, that it waits for a running-job
    slot under a limit of 1."""
    waiting = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert waiting["status"] == "queued"
    assert "running-job slot" in waiting["waiting_for"] and "its limit is 1" in waiting["waiting_for"]
    events = [e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{job_id}/events").json()["data"]]
    assert any(m.startswith("Waiting for a running-job slot") for m in events)


def test_running_limit_holds_at_start(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A job over the running-job limit is accepted, waits with the reason in its
    status and events, and starts when a slot frees; another tenant is not held up by it."""
    set_env(monkeypatch, max_running_jobs_per_tenant="1")
    file_id = api.upload(DATASET)
    first, second = api.create_job(file_id), api.create_job(file_id)
    with session_scope() as s:
        running = jobs.claim_next(s, job_id=first["id"], worker_id="w1")
    assert running is not None and running.job_id == first["id"]
    with session_scope() as s:  # the second worker's delivery finds the tenant at its limit
        assert jobs.claim_next(s, job_id=second["id"], worker_id="w2") is None
    assert_waits_for_a_running_slot(api, str(second["id"]))
    # a submit while at the limit is accepted too, and says what it waits for
    third = api.post("/v1/fine_tuning/jobs", json=job_body(file_id))
    assert third.status_code == 200 and "running-job slot" in third.json()["waiting_for"]
    # another tenant's job starts although this tenant is at its limit
    assert api.other is not None
    other_job = api.other.create_job(api.other.upload(DATASET))
    with session_scope() as s:
        other = jobs.claim_next(s, job_id=second["id"], worker_id="w2")
    assert other is not None and other.job_id == other_job["id"]
    # the slot frees: the waiting job starts, and no longer says it waits
    with session_scope() as s:
        assert jobs.finish(s, claim=running, status="cancelled")
    with session_scope() as s:
        started = jobs.claim_next(s, job_id=second["id"], worker_id="w2")
    assert started is not None and started.job_id == second["id"]
    after = api.get(f"/v1/fine_tuning/jobs/{second['id']}").json()
    assert after["status"] == "running" and after["waiting_for"] is None


def test_a_job_whose_message_claimed_its_tenants_older_job_says_it_waits(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fair share lets the delivery of the second job's message claim the tenant's oldest job.
    The delivery of the first job's message then finds its job taken and the tenant at its limit:
    the second job, still queued, says that it waits. (Seen in a CI run of test_faults' running
    limit: it waited without a reason until the first job finished.)"""
    set_env(monkeypatch, max_running_jobs_per_tenant="1")
    file_id = api.upload(DATASET)
    first, second = api.create_job(file_id), api.create_job(file_id)
    with session_scope() as s:
        running = jobs.claim_next(s, job_id=second["id"], worker_id="w1")
    assert running is not None and running.job_id == first["id"]
    with session_scope() as s:
        assert jobs.claim_next(s, job_id=first["id"], worker_id="w2") is None
    assert_waits_for_a_running_slot(api, str(second["id"]))
    ran = api.get(f"/v1/fine_tuning/jobs/{first['id']}").json()
    assert ran["status"] == "running" and ran["waiting_for"] is None


def test_fair_share_round_robin_across_tenants(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """One tenant's 10 queued jobs do not delay another tenant's single job."""
    set_env(monkeypatch, max_running_jobs_per_tenant="0", max_queued_jobs_per_tenant="0")
    assert api.other is not None
    file_id = api.upload(DATASET)
    busy = [api.create_job(file_id)["id"] for _ in range(10)]
    single = api.other.create_job(api.other.upload(DATASET))["id"]
    order = []
    for _ in range(4):  # one worker: claim, finish, claim the next
        with session_scope() as s:
            c = jobs.claim_next(s, job_id=busy[-1], worker_id="w1")
            assert c is not None
            order.append(c.job_id)
            assert jobs.finish(s, claim=c, status="cancelled")
    assert order == [busy[0], single, busy[1], busy[2]]  # FIFO within the busy tenant
    # the other tenant's next job takes its turn (its last claim is older), and while it runs
    # the busy tenant, with none running, goes next
    late = api.other.create_job(api.other.upload(DATASET))["id"]
    with session_scope() as s:
        assert jobs.claim_next(s, job_id=busy[-1], worker_id="w1").job_id == late  # type: ignore[union-attr]
    with session_scope() as s:
        assert jobs.claim_next(s, job_id=late, worker_id="w2").job_id == busy[3]  # type: ignore[union-attr]


def test_limit_zero_means_no_limit(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, max_queued_jobs_per_tenant="0")
    file_id = api.upload(DATASET)
    for _ in range(3):
        api.create_job(file_id)


def test_rate_limit_per_key_with_retry_after(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, rate_limit_per_minute="5")
    start = (int(time.time()) // 60 + 1) * 60 + 20.0  # 20 s into a window no other test used
    monkeypatch.setattr(ratelimit, "now", lambda: start)
    for _ in range(5):
        assert api.get("/v1/models").status_code == 200
    r = api.get("/v1/fine_tuning/jobs")
    assert r.status_code == 429, r.text
    assert r.headers["Retry-After"] == "40"  # the window ends 40 s later
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert "5 requests per minute" in err["message"]
    # other keys have their own budget; health checks and refused keys are not counted or limited
    assert api.other is not None
    assert api.other.get("/v1/models").status_code == 200
    assert api.client.get("/healthz").status_code == 200
    bad = api.client.get("/v1/models", headers={"Authorization": "Bearer sk-lq-wrong-key-0000000000"})
    assert bad.status_code == 401
    # the next window starts afresh
    monkeypatch.setattr(ratelimit, "now", lambda: start + 40)
    assert api.get("/v1/models").status_code == 200


def test_rate_limit_fails_open_without_redis(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreachable Redis must not take the API down: requests go through, quickly."""
    from tests.e2e.procs import free_port

    set_env(monkeypatch, rate_limit_per_minute="1", redis_url=f"redis://127.0.0.1:{free_port()}/0")
    monkeypatch.setattr(ratelimit, "_broken_until", 0.0)
    t0 = time.monotonic()
    for _ in range(3):
        assert api.get("/v1/models").status_code == 200
    assert time.monotonic() - t0 < 5
    assert ratelimit._broken_until > 0  # the breaker skips Redis for a while
