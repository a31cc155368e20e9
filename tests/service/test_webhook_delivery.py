"""Webhooks delivered to a real receiver process (tests/webhook_receiver.py, which checks every
request with OpenAI's client and processes each `webhook-id` once) by the API's sender thread.

The receiver is killed after it processed an event and before it answered: the sender records
the broken attempt and retries with the same `webhook-id`; the restarted receiver acknowledges
it without processing it again. Succeeded, failed and cancelled jobs each produce their event,
written by the job's transition (the API's cancel, a worker's `jobs.finish`) and sent by the
API process. Also: a 500 is retried until the retry window ends; 410 Gone disables the endpoint.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DATASET, ApiClient
from tests.live_server import free_port
from tests.servers import stop
from tests.service.test_webhooks import register, settle_outbox
from tests.webhook_receiver import read_jsonl

__all__ = ["settle_outbox"]  # autouse: the shared databases keep no pending deliveries

ROOT = Path(__file__).resolve().parents[2]
RETRY_S = 0.3


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@contextmanager
def receiver(port: int, secret: str, directory: Path, *options: str) -> Iterator[subprocess.Popen[bytes]]:
    """The receiver process on `port`, answering once it listens; stopped (its group) after."""
    args = ["--port", str(port), "--secret", secret, "--dir", str(directory), *options]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.webhook_receiver", *args],
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        wait_for(lambda: _listening(port) or proc.poll() is not None, "the receiver listens")
        assert proc.poll() is None, f"the receiver exited with {proc.returncode}"
        yield proc
    finally:
        stop(proc, grace=2)


@pytest.fixture
def sending(loraq_env: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The API's sender on, fast, allowed to send to this machine's loopback over http."""
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_WEBHOOK_ALLOW_HTTP", "1")
    monkeypatch.setenv("LORAQ_WEBHOOK_ALLOW_HOSTS", '["127.0.0.1"]')
    monkeypatch.setenv("LORAQ_WEBHOOK_INTERVAL_SECONDS", "0.1")
    monkeypatch.setenv("LORAQ_WEBHOOK_TIMEOUT_SECONDS", "20")
    monkeypatch.setenv("LORAQ_WEBHOOK_RETRY_DELAYS_SECONDS", f"[{RETRY_S}]")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def deliveries(api: ApiClient, endpoint_id: str) -> list[dict[str, Any]]:
    r = api.get(f"/v1/webhook_endpoints/{endpoint_id}/deliveries")
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    return data


def all_delivered(api: ApiClient, endpoint_id: str, n: int) -> list[dict[str, Any]]:
    """The endpoint's deliveries once there are `n`, each delivered."""

    def done() -> list[dict[str, Any]]:
        found = deliveries(api, endpoint_id)
        return found if len(found) == n and all(d["state"] == "delivered" for d in found) else []

    found: list[dict[str, Any]] = wait_for(done, f"{n} events delivered to {endpoint_id}")
    return found


def end_job(api: ApiClient, file_id: str, status: str) -> str:
    """A job ended by its worker's transition (claim, then `jobs.finish`)."""
    from service import jobs
    from service.db.session import session_scope

    job_id = str(api.create_job(file_id)["id"])
    with session_scope() as s:
        claim = jobs.claim(s, job_id=job_id, worker_id="test:0:1")
    assert claim is not None
    error = {"code": "internal_error", "message": "boom", "param": None} if status == "failed" else None
    with session_scope() as s:
        assert jobs.finish(s, claim=claim, status=status, error=error)
    return job_id


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_receiver_killed_mid_delivery_processes_each_event_once(
    sending: None, api: ApiClient, tmp_path: Path
) -> None:
    port = free_port()
    endpoint = register(api, f"http://127.0.0.1:{port}/hook")
    file_id = api.upload(DATASET)
    processed, received = tmp_path / "processed.jsonl", tmp_path / "received.jsonl"

    with receiver(port, endpoint["secret"], tmp_path, "--hang-after-processing") as first:
        cancelled = api.create_job(file_id)["id"]
        assert api.post(f"/v1/fine_tuning/jobs/{cancelled}/cancel").json()["status"] == "cancelled"
        wait_for(lambda: read_jsonl(processed), "the receiver processed the event")
        os.killpg(first.pid, signal.SIGKILL)  # processed, never answered
        first.wait()
        broken = wait_for(
            lambda: [d for d in deliveries(api, endpoint["id"]) if d["attempts"]],
            "the sender records the broken attempt",
        )
    (delivery,) = broken
    assert delivery["state"] == "pending" and delivery["job_id"] == cancelled
    assert delivery["attempts"][0]["status_code"] is None
    assert "RemoteProtocolError" in delivery["attempts"][0]["error"], delivery["attempts"][0]

    with receiver(port, endpoint["secret"], tmp_path):
        succeeded = end_job(api, file_id, "succeeded")
        failed = end_job(api, file_id, "failed")
        done = all_delivered(api, endpoint["id"], 3)

    events = {cancelled: "cancelled", succeeded: "succeeded", failed: "failed"}
    by_job = {d["job_id"]: d for d in done}
    assert {j: d["event_type"] for j, d in by_job.items()} == {
        j: f"fine_tuning.job.{status}" for j, status in events.items()
    }
    # processed exactly once per webhook-id, although the cancelled event arrived twice
    once = read_jsonl(processed)
    assert sorted(p["webhook_id"] for p in once) == sorted(d["id"] for d in done)
    assert {p["job_id"]: p["type"] for p in once} == {j: d["event_type"] for j, d in by_job.items()}
    arrivals = read_jsonl(received)
    assert all(a["verified"] for a in arrivals), arrivals  # OpenAI's client checked each signature
    assert all(a["host"] == f"127.0.0.1:{port}" for a in arrivals)
    again = [a for a in arrivals if a["webhook_id"] == by_job[cancelled]["id"]]
    assert [a["duplicate"] for a in again] == [False, True]
    assert again[0]["body"] == again[1]["body"]  # the same event, signed again per attempt
    assert [a["webhook_id"] for a in arrivals].count(by_job[succeeded]["id"]) == 1

    attempts = by_job[cancelled]["attempts"]
    assert [a["attempt"] for a in attempts] == list(range(1, len(attempts) + 1))
    assert attempts[-1]["status_code"] == 200 and attempts[-1]["error"] is None
    assert all(a["status_code"] is None for a in attempts[:-1])  # killed, then refused until restarted
    assert all(a["duration_ms"] >= 0 for a in attempts)
    gaps = [b["started_at"] - a["started_at"] for a, b in itertools.pairwise(attempts)]
    assert all(gap >= RETRY_S * 0.9 for gap in gaps), gaps  # the schedule's delay, jitter included
    # the dashboard's job page reads the same deliveries
    shown = api.get(f"/dashboard/api/jobs/{cancelled}/webhook_deliveries").json()["data"]
    assert [d["id"] for d in shown] == [by_job[cancelled]["id"]] and shown[0]["attempts"] == attempts


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_a_failing_receiver_is_retried_until_the_window_ends_and_410_disables_it(
    sending: None, api: ApiClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_WEBHOOK_RETRY_WINDOW_SECONDS", "2")
    get_settings.cache_clear()
    file_id = api.upload(DATASET)
    port_500, port_410 = free_port(), free_port()
    erring = register(api, f"http://127.0.0.1:{port_500}/hook")
    gone = register(api, f"http://127.0.0.1:{port_410}/hook")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        receiver(port_500, erring["secret"], tmp_path / "a", "--status", "500"),
        receiver(port_410, gone["secret"], tmp_path / "b", "--status", "410"),
    ):
        job_id = end_job(api, file_id, "succeeded")
        (given_up,) = wait_for(
            lambda: [d for d in deliveries(api, erring["id"]) if d["state"] == "failed"],
            "the 500s end in failed",
        )
        (refused,) = wait_for(
            lambda: [d for d in deliveries(api, gone["id"]) if d["state"] == "failed"], "410: failed"
        )
    statuses = [a["status_code"] for a in given_up["attempts"]]
    assert len(statuses) >= 3 and set(statuses) == {500}, statuses
    assert given_up["attempts"][-1]["started_at"] >= given_up["created_at"] + 1  # retried for the window
    assert [a["status_code"] for a in refused["attempts"]] == [410]
    disabled = api.get(f"/v1/webhook_endpoints/{gone['id']}").json()
    assert disabled["disabled_at"] is not None and "410" in disabled["disabled_reason"]
    assert len(read_jsonl(tmp_path / "b" / "received.jsonl")) == 1
    assert read_jsonl(tmp_path / "a" / "processed.jsonl") == []
    # the disabled endpoint gets no further event; the other one does
    end_job(api, file_id, "failed")
    assert len(deliveries(api, gone["id"])) == 1
    assert len(deliveries(api, erring["id"])) == 2
    assert job_id in {d["job_id"] for d in deliveries(api, erring["id"])}


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for DNS name `name` (and nothing else) and its key, made by openssl."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    names = ["-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}"]
    files = ["-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *names, *files],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_https_is_sent_to_the_checked_address_naming_the_host_for_tls(
    sending: None, api: ApiClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """https://localhost:P is resolved and checked by the sender, which connects to 127.0.0.1 and
    names `localhost` in the Host header and the TLS handshake (SNI, certificate check); the same
    receiver reached as https://127.0.0.1:P fails verification (its certificate names localhost
    only), so certificates are checked."""
    from service import webhook_delivery
    from service.settings import get_settings

    cert, key = self_signed(tmp_path, "localhost")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted as a CA, as a user's own CA would be
    monkeypatch.setenv("LORAQ_WEBHOOK_ALLOW_HTTP", "0")
    monkeypatch.setenv("LORAQ_WEBHOOK_ALLOW_HOSTS", '["localhost", "127.0.0.1"]')
    get_settings.cache_clear()
    webhook_delivery._tls.cache_clear()
    try:
        port = free_port()
        by_name = register(api, f"https://localhost:{port}/hook")
        by_address = register(api, f"https://127.0.0.1:{port}/hook")
        file_id = api.upload(DATASET)
        with receiver(port, by_name["secret"], tmp_path, "--tls", str(cert), str(key)):
            job_id = end_job(api, file_id, "succeeded")
            (sent,) = wait_for(
                lambda: [d for d in deliveries(api, by_name["id"]) if d["state"] == "delivered"],
                "delivered over https",
            )
            (refused,) = wait_for(
                lambda: [d for d in deliveries(api, by_address["id"]) if d["attempts"]],
                "the other attempt recorded",
            )
    finally:
        webhook_delivery._tls.cache_clear()
    assert sent["job_id"] == job_id and [a["status_code"] for a in sent["attempts"]] == [200]
    (arrival,) = read_jsonl(tmp_path / "received.jsonl")
    assert arrival["verified"] and arrival["host"] == f"localhost:{port}"
    assert arrival["webhook_id"] == sent["id"]
    assert refused["state"] == "pending" and refused["attempts"][0]["status_code"] is None
    assert "CERTIFICATE_VERIFY_FAILED" in refused["attempts"][0]["error"], refused["attempts"][0]


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_jobs_run_by_the_worker_send_their_events(sending: None, api: ApiClient, tmp_path: Path) -> None:
    """The worker's own code (`runner.run_claimed_job`, what the Celery task runs) trains a
    tiny-llama job to `succeeded` and fails one whose file has bad lines: each end is an event
    the API process sends to a real receiver."""
    from tests.conftest import store_file
    from tests.e2e.datasets import broken_lines
    from worker import runner

    port = free_port()
    endpoint = register(api, f"http://127.0.0.1:{port}/hook")
    trained = api.create_job(api.upload(DATASET))["id"]
    broken = api.create_job(store_file(api.tenant_id, broken_lines()))["id"]
    with receiver(port, endpoint["secret"], tmp_path):
        assert runner.run_claimed_job(trained) == "succeeded", api.get(
            f"/v1/fine_tuning/jobs/{trained}"
        ).json()["error"]
        assert runner.run_claimed_job(broken) == "failed"
        done = all_delivered(api, endpoint["id"], 2)
    assert {d["job_id"]: d["event_type"] for d in done} == {
        trained: "fine_tuning.job.succeeded",
        broken: "fine_tuning.job.failed",
    }
    processed = read_jsonl(tmp_path / "processed.jsonl")
    assert {p["job_id"]: p["type"] for p in processed} == {d["job_id"]: d["event_type"] for d in done}
    assert api.get(f"/v1/fine_tuning/jobs/{trained}").json()["status"] == "succeeded"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_operators_endpoint_receives_every_tenants_events(
    sending: None, api: ApiClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LORAQ_WEBHOOK_OPERATOR_URL gets each organization's job events, signed with its own secret;
    they are not the organization's to read."""
    from service import webhooks
    from service.settings import get_settings

    port, secret = free_port(), webhooks.new_secret()
    monkeypatch.setenv("LORAQ_WEBHOOK_OPERATOR_URL", f"http://127.0.0.1:{port}/ops")
    monkeypatch.setenv("LORAQ_WEBHOOK_OPERATOR_SECRET", secret)
    get_settings.cache_clear()
    assert api.other is not None
    jobs = [client.create_job(client.upload(DATASET))["id"] for client in (api, api.other)]
    with receiver(port, secret, tmp_path):
        for client, job_id in zip((api, api.other), jobs, strict=True):
            client.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        wait_for(lambda: len(read_jsonl(tmp_path / "processed.jsonl")) == 2, "both events at the operator's")
    arrivals = read_jsonl(tmp_path / "received.jsonl")
    assert all(a["verified"] for a in arrivals) and len(arrivals) == 2
    assert sorted(a["job_id"] for a in arrivals) == sorted(jobs)
    assert {a["type"] for a in arrivals} == {"fine_tuning.job.cancelled"}
    assert api.get(f"/dashboard/api/jobs/{jobs[0]}/webhook_deliveries").json()["data"] == []


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_body_that_never_ends_is_not_read(sending: None, api: ApiClient, tmp_path: Path) -> None:
    """Only the status counts: a receiver answering 200 with an endless body is delivered at once."""
    port = free_port()
    endpoint = register(api, f"http://127.0.0.1:{port}/hook")
    job_id = api.create_job(api.upload(DATASET))["id"]
    with receiver(port, endpoint["secret"], tmp_path, "--endless-body"):
        api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        (delivery,) = all_delivered(api, endpoint["id"], 1)
    assert [a["status_code"] for a in delivery["attempts"]] == [200]
    assert delivery["attempts"][0]["duration_ms"] < 5000
