"""Webhooks in one process: endpoints over the API (secret once, per tenant), the URL policy's
refusals (400 naming `url`), OpenAI's event payloads signed as Standard Webhooks specifies and
checked with OpenAI's own verifier, the outbox written in the transition's transaction, the
retry schedule, and the delivery-time check of where a host resolves (DNS rebinding).
tests/service/test_webhook_delivery.py sends them to a real receiver process."""

from __future__ import annotations

import base64
import ipaddress
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from tests.conftest import DATASET, ApiClient

PUBLIC_URL = "https://93.184.215.14/hooks/loraq"  # a public address: no DNS needed in the test


def register(api: ApiClient, url: str = PUBLIC_URL, **fields: Any) -> dict[str, Any]:
    r = api.post("/v1/webhook_endpoints", json={"url": url, **fields})
    assert r.status_code == 200, r.text
    endpoint: dict[str, Any] = r.json()
    return endpoint


def deliveries_of(job_id: str) -> list[Any]:
    from service.db.models import WebhookDelivery
    from service.db.session import session_scope

    with session_scope() as s:
        return list(s.scalars(select(WebhookDelivery).where(WebhookDelivery.job_id == job_id)))


@pytest.fixture(autouse=True)
def settle_outbox(loraq_env: Any) -> Iterator[None]:
    """The session's databases are shared: a test's deliveries left pending would be sent by the
    next test's sender (to addresses that do not answer). They end `failed` after each test."""
    yield
    from sqlalchemy import update

    from service.db.models import WebhookDelivery
    from service.db.session import session_scope

    with session_scope() as s:
        s.execute(update(WebhookDelivery).where(WebhookDelivery.state == "pending").values(state="failed"))


@pytest.fixture
def allow_local(monkeypatch: pytest.MonkeyPatch, loraq_env: Any) -> Iterator[None]:
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_WEBHOOK_ALLOW_HTTP", "1")
    monkeypatch.setenv("LORAQ_WEBHOOK_ALLOW_HOSTS", '["127.0.0.1"]')
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


# ---------------------------------------------------------------- signing


def test_events_are_signed_as_standard_webhooks_and_openais_client_verifies_them() -> None:
    from openai import InvalidWebhookSignatureError, OpenAI
    from openai.types.webhooks import FineTuningJobSucceededWebhookEvent

    from service import webhooks

    secret = webhooks.new_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) == 32
    body = webhooks.event_body(
        event_id="evt_1", event_type="fine_tuning.job.succeeded", created_at=1700000000, job_id="ftjob-a"
    )
    headers = webhooks.signed_headers(secret, msg_id="wh_1", body=body)
    client = OpenAI(api_key="unused", webhook_secret=secret)
    event = client.webhooks.unwrap(body, headers)
    assert isinstance(event, FineTuningJobSucceededWebhookEvent)
    assert (event.id, event.type, event.created_at, event.object, event.data.id) == (
        "evt_1",
        "fine_tuning.job.succeeded",
        1700000000,
        "event",
        "ftjob-a",
    )
    # the spec's own example: this id, timestamp, body and key give this signature
    ts = int(headers["webhook-timestamp"])
    assert headers["webhook-signature"] == webhooks.signature(secret, msg_id="wh_1", timestamp=ts, body=body)
    with pytest.raises(InvalidWebhookSignatureError):
        client.webhooks.unwrap(body.replace("ftjob-a", "ftjob-b"), headers)
    with pytest.raises(InvalidWebhookSignatureError):
        client.webhooks.unwrap(body, {**headers, "webhook-id": "wh_2"})
    with pytest.raises(InvalidWebhookSignatureError):
        client.webhooks.verify_signature(body, headers, secret=webhooks.new_secret())


def test_signature_matches_a_hand_computed_hmac() -> None:
    """The spec's recipe written out independently: base64(HMAC-SHA256(key, id.ts.body))."""
    import hashlib
    import hmac

    from service import webhooks

    key = bytes(range(32))
    secret = "whsec_" + base64.b64encode(key).decode()
    expected = hmac.new(key, b'msg_1.1674087231.{"a":1}', hashlib.sha256).digest()
    got = webhooks.signature(secret, msg_id="msg_1", timestamp=1674087231, body='{"a":1}')
    assert got == "v1," + base64.b64encode(expected).decode()
    with pytest.raises(ValueError, match="whsec_"):
        webhooks.secret_key("not-a-secret")


# ---------------------------------------------------------------- endpoints over the API


def test_endpoint_secret_is_shown_once_and_endpoints_are_the_tenants_own(api: ApiClient) -> None:
    created = register(api, description="ops", events=["fine_tuning.job.failed"])
    assert created["object"] == "webhook_endpoint" and created["id"].startswith("whep-")
    assert created["secret"].startswith("whsec_")
    assert created["events"] == ["fine_tuning.job.failed"] and created["description"] == "ops"
    everything = register(api)
    assert everything["events"] == [
        "fine_tuning.job.succeeded",
        "fine_tuning.job.failed",
        "fine_tuning.job.cancelled",
    ]
    assert everything["secret"] != created["secret"]

    got = api.get(f"/v1/webhook_endpoints/{created['id']}").json()
    assert got["secret"] is None and got["url"] == PUBLIC_URL
    listed = api.get("/v1/webhook_endpoints").json()
    assert [e["id"] for e in listed["data"]] == [created["id"], everything["id"]]
    assert all(e["secret"] is None for e in listed["data"])

    assert api.other is not None
    assert api.other.get(f"/v1/webhook_endpoints/{created['id']}").status_code == 404
    assert api.other.delete(f"/v1/webhook_endpoints/{created['id']}").status_code == 404
    assert api.other.get("/v1/webhook_endpoints").json()["data"] == []

    r = api.delete(f"/v1/webhook_endpoints/{created['id']}")
    assert r.json() == {"id": created["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert api.get(f"/v1/webhook_endpoints/{created['id']}").status_code == 404
    assert [e["id"] for e in api.get("/v1/webhook_endpoints").json()["data"]] == [everything["id"]]


def test_bad_fields_name_themselves(api: ApiClient) -> None:
    r = api.post("/v1/webhook_endpoints", json={"url": PUBLIC_URL, "events": ["fine_tuning.job.running"]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("events"), r.text
    r = api.post("/v1/webhook_endpoints", json={"url": PUBLIC_URL, "secret": "whsec_mine"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "secret", r.text


def test_endpoints_per_tenant_are_limited(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_WEBHOOK_MAX_ENDPOINTS_PER_TENANT", "2")
    get_settings.cache_clear()
    register(api)
    register(api)
    r = api.post("/v1/webhook_endpoints", json={"url": PUBLIC_URL})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_webhook_endpoints", r.text


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://93.184.215.14/hook", "must be https://"),
        ("ftp://93.184.215.14/hook", "must be an https:// URL"),
        ("https:///hook", "has no host"),
        ("https://user:pw@93.184.215.14/hook", "user name or password"),
        ("https://127.0.0.1/hook", "loopback"),
        ("https://127.9.9.9:8443/hook", "loopback"),
        ("https://[::1]/hook", "loopback"),
        ("https://[::ffff:127.0.0.1]/hook", "loopback"),
        ("https://169.254.169.254/latest/meta-data", "link-local"),
        ("https://[fe80::1]/hook", "link-local"),
        ("https://0.0.0.0/hook", "unspecified"),
        ("https://localhost/hook", "which is a loopback address"),
        ("https://testserver/hook", "the API's own host"),  # the Host this request came by
        ("https://10.1.2.3/hook", "LORAQ_WEBHOOK_DENY_NETWORKS"),
        ("https://no-such-host.invalid/hook", "does not resolve"),
        ("https://a..b/hook", "is not a valid host name"),
        ("https://[::1/hook", "is not a valid URL"),
        ("https://93.184.215.14:99999/hook", "is not a valid URL"),
    ],
)
def test_url_policy_refuses_with_a_400_naming_url(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch, url: str, why: str
) -> None:
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_WEBHOOK_DENY_NETWORKS", '["10.0.0.0/8"]')
    get_settings.cache_clear()
    r = api.post("/v1/webhook_endpoints", json={"url": url})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("url", "invalid_webhook_url")
    assert why in error["message"], error["message"]
    assert api.get("/v1/webhook_endpoints").json()["data"] == []


def test_an_address_of_this_machine_is_the_apis_own_host(api: ApiClient) -> None:
    from service.settings import get_settings
    from service.webhook_urls import address_refusal

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # a route's source address; UDP connect sends nothing
        except OSError:
            pytest.skip("this host has no route off loopback")
        own = s.getsockname()[0]
    if own.startswith("127."):
        pytest.skip("this host has no address but loopback")
    assert address_refusal(ipaddress.ip_address(own), get_settings()) == "an address of the API's own host"
    r = api.post("/v1/webhook_endpoints", json={"url": f"https://{own}/hook"})
    assert r.status_code == 400 and "own host" in r.json()["error"]["message"], r.text


def test_the_operator_allows_local_http_receivers(api: ApiClient, allow_local: None) -> None:
    register(api, "http://127.0.0.1:9/hook")
    r = api.post("/v1/webhook_endpoints", json={"url": "http://127.0.0.2:9/hook"})
    assert r.status_code == 400 and "loopback" in r.json()["error"]["message"]


# ---------------------------------------------------------------- the outbox


def _claimed(job_id: str) -> Any:
    from service import jobs
    from service.db.session import session_scope

    with session_scope() as s:
        claim = jobs.claim(s, job_id=job_id, worker_id="test:0:1")
    assert claim is not None
    return claim


def test_each_end_of_a_job_writes_openais_event_for_each_endpoint_in_its_transaction(api: ApiClient) -> None:
    import json

    from service import jobs
    from service.db.session import session_scope

    every = register(api)["id"]
    failed_only = register(api, events=["fine_tuning.job.failed"])["id"]
    assert api.other is not None
    register(api.other)  # another tenant's endpoint gets none of these
    file_id = api.upload(DATASET)

    cancelled = api.create_job(file_id)["id"]
    assert deliveries_of(cancelled) == []  # no event for queued
    assert api.post(f"/v1/fine_tuning/jobs/{cancelled}/cancel").json()["status"] == "cancelled"

    succeeded = api.create_job(file_id)["id"]
    claim = _claimed(succeeded)
    with session_scope() as s:
        assert jobs.finish(s, claim=claim, status="succeeded", fine_tuned_model="ft:x")

    failed = api.create_job(file_id)["id"]
    claim = _claimed(failed)
    with pytest.raises(RuntimeError), session_scope() as s:  # a transition rolled back sends nothing
        assert jobs.finish(s, claim=claim, status="failed", error={"code": "x", "message": "m"})
        raise RuntimeError("the worker's transaction dies before commit")
    assert deliveries_of(failed) == []
    with session_scope() as s:
        assert jobs.finish(s, claim=claim, status="failed", error={"code": "x", "message": "m"})
    with session_scope() as s:  # fenced: a second end of the same attempt writes nothing more
        assert not jobs.finish(s, claim=claim, status="failed", error={"code": "x", "message": "m"})

    expected = {
        cancelled: ("fine_tuning.job.cancelled", {every}),
        succeeded: ("fine_tuning.job.succeeded", {every}),
        failed: ("fine_tuning.job.failed", {every, failed_only}),
    }
    for job_id, (event_type, endpoints) in expected.items():
        rows = deliveries_of(job_id)
        assert {r.endpoint_id for r in rows} == endpoints and len(rows) == len(endpoints)
        assert len({r.id for r in rows}) == len(rows) and len({r.event_id for r in rows}) == 1
        for row in rows:
            assert row.state == "pending" and row.attempts == 0
            event = json.loads(row.body)
            assert event == {
                "id": row.event_id,
                "type": event_type,
                "created_at": row.created_at,
                "object": "event",
                "data": {"id": job_id},
            }
            assert row.id.startswith("wh_") and row.event_id.startswith("evt_")


def test_a_deleted_endpoint_gets_nothing_more(api: ApiClient) -> None:
    endpoint = register(api)["id"]
    file_id = api.upload(DATASET)
    first = api.create_job(file_id)["id"]
    api.post(f"/v1/fine_tuning/jobs/{first}/cancel")
    api.delete(f"/v1/webhook_endpoints/{endpoint}")
    (row,) = deliveries_of(first)
    assert (row.state, row.last_error) == ("failed", "the endpoint was deleted")
    second = api.create_job(file_id)["id"]
    api.post(f"/v1/fine_tuning/jobs/{second}/cancel")
    assert deliveries_of(second) == []


# ---------------------------------------------------------------- retries


def test_the_retry_schedule_backs_off_and_stops_a_day_after_the_event(loraq_env: Any) -> None:
    from service.webhook_delivery import next_attempt_at

    created, at, times = 1000.0, 1000.0, [1000.0]
    for attempt in range(1, 20):
        nxt = next_attempt_at(created_at=created, attempt=attempt, now=at, jitter=0)
        if nxt is None:
            break
        at = nxt
        times.append(at)
    offsets = [t - created for t in times]
    # Standard Webhooks' schedule (5 s, 5 min, 30 min, 2 h, 5 h, 10 h, ...) cut at 24 h
    assert offsets == [0, 5, 305, 2105, 9305, 27305, 63305, 86400]
    # a Retry-After longer than the schedule's delay is honoured, never past the window
    assert next_attempt_at(created_at=0, attempt=1, now=0, retry_after=120, jitter=0) == 120
    assert next_attempt_at(created_at=0, attempt=7, now=86000, retry_after=3600, jitter=0) == 86400
    # jitter stays within ±10 %
    spread = {next_attempt_at(created_at=0, attempt=2, now=0) for _ in range(50)}
    assert all(t is not None and 270 <= t <= 330 for t in spread) and len(spread) > 1


def test_a_host_is_checked_again_where_it_resolves_when_sent(api: ApiClient) -> None:
    """An endpoint whose name now resolves to a loopback address (DNS rebinding) is not sent to:
    the attempt records why and the delivery waits for its retry."""
    from sqlalchemy import update

    from service.db.models import WebhookDelivery, WebhookEndpoint
    from service.db.session import session_scope
    from service.webhook_delivery import Sender

    endpoint = register(api)["id"]
    file_id = api.upload(DATASET)
    job_id = api.create_job(file_id)["id"]
    api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    with session_scope() as s:  # as if the public name now pointed at this machine
        s.execute(
            update(WebhookEndpoint).where(WebhookEndpoint.id == endpoint).values(url="https://localhost/h")
        )
    sender = Sender()
    try:
        before = time.time()
        states = sender.tick()
    finally:
        sender.close()
    (row,) = deliveries_of(job_id)
    assert states[row.id] == "pending"
    assert row.attempts == 1 and row.next_attempt_at >= before + 4
    assert row.last_status is None
    assert re.fullmatch(
        r"the URL is refused now: 'localhost' resolves to (127\.0\.0\.1|::1), which is a loopback "
        r"address; an operator may allow it with LORAQ_WEBHOOK_ALLOW_HOSTS",
        row.last_error or "",
    ), row.last_error
    shown = api.get(f"/dashboard/api/jobs/{job_id}/webhook_deliveries").json()["data"]
    assert [a["error"] for a in shown[0]["attempts"]] == [row.last_error]
    with session_scope() as s:
        assert s.scalar(select(WebhookDelivery.lease_token).where(WebhookDelivery.id == row.id)) is None


def test_a_lease_lets_one_sender_send_a_delivery_and_an_expired_one_is_taken_over(api: ApiClient) -> None:
    """Two API processes' senders: a row is leased by one claim; once its lease expires (its
    sender died mid-request) another claims it with the next attempt number, and the first
    sender's late result is refused by the fence."""
    from service.db.session import session_scope
    from service.settings import get_settings
    from service.webhook_delivery import LEASE_MARGIN_S, Outcome, claim_due, record

    register(api)
    job_id = api.create_job(api.upload(DATASET))["id"]
    api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
    (row,) = deliveries_of(job_id)
    now = time.time()
    with session_scope() as a:
        first = [d for d in claim_due(a, now=now, limit=100) if d.id == row.id]
    with session_scope() as b:
        assert [d for d in claim_due(b, now=now + 1, limit=100) if d.id == row.id] == []
    later = now + get_settings().webhook_timeout_seconds + LEASE_MARGIN_S + 1
    with session_scope() as b:
        second = [d for d in claim_due(b, now=later, limit=100) if d.id == row.id]
    assert [d.attempt for d in first + second] == [1, 2]
    assert first[0].url == PUBLIC_URL and first[0].body == row.body
    ok = Outcome(started_at=now, duration_ms=1.0, status_code=200, error=None)
    with session_scope() as a:
        assert record(a, due=first[0], outcome=ok, now=later) is None  # fenced out
    with session_scope() as b:
        assert record(b, due=second[0], outcome=ok, now=later) == "delivered"
    (row,) = deliveries_of(job_id)
    assert (row.state, row.attempts, row.last_status) == ("delivered", 2, 200)
    shown = api.get(f"/dashboard/api/jobs/{job_id}/webhook_deliveries").json()["data"]
    assert [a["attempt"] for a in shown[0]["attempts"]] == [2]  # attempt 1's sender never reported
